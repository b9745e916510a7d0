"""EleutherAI's lm-evaluation-harness (the real `lm_eval`, its `local-completions` model, a test-only
dependency) against a real `duolm serve` process on 127.0.0.1, with no tokenizer argument: it finds
/tokenizer_info and /tokenize and tokenizes on the server. Three tasks from YAML files written here, their
data in JSONL files beside them (nothing is downloaded): LAMBADA-style loglikelihood on passages of the shared
LAMBADA dev file against `duolm eval --task lambada` (evaluate_lm), rolling loglikelihood on WikiText-2 text
against the corpus perplexity of the same text, and generation against generate_text."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import duolm
from duolm.evaluation import evaluate_lm
from duolm.evaluation.readers import lambada_examples
from duolm.textgen import generate_text

pytest.importorskip("fastapi")
from test_serve import gpt2, gpt2_dir  # noqa: E402,F401
from test_serve_e2e import server  # noqa: E402

CONTEXT = 256                     # gpt2_dir's block_size
GEN_STOP, GEN_TOKENS = ["\n\n"], 12

TASKS = {
    "duolm_lambada": """
output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "duolm_rolling": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""",
    "duolm_generate": f"""
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: ""
generation_kwargs:
  until: {json.dumps(GEN_STOP)}
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def _lambada(data_dir, model, tok, n=40):
    """The first n passages of the LAMBADA dev file as (context, " word"). A random model predicts no real last
    word, so every other passage ends instead with the model's greedy next token when that is a word: the
    accuracy then counts hits, and lm-eval's greedy test (a token's log p equal to the best) is exercised."""
    out = []
    for k, ex in enumerate(lambada_examples(data_dir / "lambada" / "lambada_development_plain_text.txt")[:n]):
        target = ex.target
        if k % 2:
            with torch.no_grad():
                best = int(model(torch.tensor([tok.encode_ordinary(ex.context)]))[0, -1].argmax())
            word = tok.decode([best])
            if re.fullmatch(r" [A-Za-z]+", word) and tok.encode_ordinary(word) == [best]:
                target = word
        assert re.fullmatch(r" \S+", target)
        out.append((ex.context, target))
    return out


def _wikitext(data_dir, tok, windows=3) -> str:
    """WikiText-2 test text (lines and newlines) of exactly `windows` x (CONTEXT - 1) tokens, cut where it
    re-encodes to the same ids. Texts that fill whole windows are scored alike by lm-eval's rolling windows
    and duolm eval's with stride = window; on a last, partial window they differ by design (docs/serving.md)."""
    with open(data_dir / "wikitext-2" / "test.txt", encoding="utf-8") as f:
        ids = tok.encode_ordinary("".join(next(f) for _ in range(120)))
    n = windows * (CONTEXT - 1)
    for start in range(len(ids) - n):
        text = tok.decode(ids[start:start + n])
        if tok.encode_ordinary(text) == ids[start:start + n]:
            return text
    raise AssertionError("no cut of the text re-encodes to its ids")


def _write_task(folder: Path, name: str, docs: list):
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
        f"test_split: test\n{TASKS[name]}", encoding="utf-8")


def _samples(out: Path, task: str) -> list:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()),
                  key=lambda s: s["doc_id"])


def test_lm_eval_harness_against_duolm_eval(gpt2_dir, gpt2, data_dir, tmp_path):
    import lm_eval  # noqa: F401  (a test dependency: missing, this test fails)
    model, tok = gpt2
    passages = _lambada(data_dir, model, tok)
    text = _wikitext(data_dir, tok)
    prompts = [" ".join(ctx.split()[-30:]) for ctx, _ in passages[:4]]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write_task(tasks, "duolm_lambada", [{"context": c, "target": t} for c, t in passages])
    _write_task(tasks, "duolm_rolling", [{"text": text}])
    _write_task(tasks, "duolm_generate", [{"context": p} for p in prompts])

    out = tmp_path / "out"
    with server(gpt2_dir, tmp_path / "serve.log") as (url, _):
        # max_length: lm-eval keeps one position for a generated token that a scoring request never feeds, so
        # CONTEXT + 1 gives its rolling windows duolm eval's (stride = window); custom_prefix_token_id: the first
        # token of a document is scored after <|endoftext|> (see docs/serving.md)
        args = (f"base_url={url}/v1/completions,model={gpt2_dir.name},max_length={CONTEXT + 1},"
                f"custom_prefix_token_id={tok.eot_id},num_concurrent=4,max_retries=1")
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
        run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                              "--tasks", ",".join(TASKS), "--include_path", str(tasks), "--output_path", str(out),
                              "--log_samples"], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        served_log = (tmp_path / "serve.log").read_text()
    assert "Using remote tokenizer" in run.stderr + run.stdout          # tokenized on the server
    assert "GET /tokenizer_info" in served_log and "POST /tokenize" in served_log
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]

    # LAMBADA-style loglikelihood: duolm eval's numbers, on a file of the same passages
    (tmp_path / "lambada.jsonl").write_text("".join(json.dumps({"text": c + t}) + "\n" for c, t in passages))
    ref = evaluate_lm(model, tok, "lambada", tmp_path / "lambada.jsonl")
    assert ref["examples"] == len(passages) and 0 < ref["acc_last_word"] < 100
    got = results["duolm_lambada"]
    assert 100 * got["acc,none"] == ref["acc_last_word"]
    assert got["perplexity,none"] == pytest.approx(ref["ppl"], rel=1e-4)
    sample = _samples(out, "duolm_lambada")[1]
    assert sample["arguments"]["gen_args_0"] == {"arg_0": passages[1][0], "arg_1": passages[1][1]}

    # rolling loglikelihood: the corpus perplexity of the same text (raw text, after <|endoftext|>, windows of the
    # context with stride = window)
    (tmp_path / "wiki.txt").write_text(text, encoding="utf-8")
    corpus = evaluate_lm(model, tok, "enwik8", tmp_path / "wiki.txt", stride=CONTEXT)
    assert corpus["tokens"] == 3 * (CONTEXT - 1)
    (doc,) = _samples(out, "duolm_rolling")
    loglikelihood = float(doc["resps"][0][0])          # the samples log writes numbers as text
    assert math.exp(-loglikelihood / corpus["tokens"]) == pytest.approx(corpus["ppl_token"], rel=1e-4)

    # generation: greedy, stopped at "\n\n" (and <|endoftext|>), as generate_text gives it
    for s, prompt in zip(_samples(out, "duolm_generate"), prompts):
        want = "".join(generate_text(model, tok, prompt, GEN_TOKENS, temperature=0.0,
                                     stop=GEN_STOP + ["<|endoftext|>"]))
        assert s["resps"][0][0] == want
    assert any(s["resps"][0][0] for s in _samples(out, "duolm_generate"))
