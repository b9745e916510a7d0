"""Zero-shot multiple choice (duolm.evaluation.choice) against the real lm-evaluation-harness (a test-only
dependency): PIQA, ARC-Easy and COPA slices (llm-foundry's multiple-choice form), WSC273 (its schema form,
partial scoring) and HellaSwag items written here in the raw form, through lm-eval's own preprocessing. A tiny
GPT-2 (GPT-2's vocabulary, a 72-token window so that long items are left-truncated) is trained here for a few
steps on the sets' text; lm_eval scores its HF export (`--model hf`) and `duolm serve` (`local-completions`)
from YAML task files written here; acc and acc_norm must equal duolm's item for item."""
import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import duolm
from duolm.evaluation import choice
from duolm.evaluation.choice import (encode_pair, hellaswag_doc, hellaswag_preprocess, item_metrics,
                                     model_inputs, multiple_choice, read_items, score_inputs, score_pairs, span)
from duolm.models import GPT2, GPT2Config

BLOCK = 72
N = 24                                              # items per set
SETS = {"piqa": "piqa.jsonl", "arc_easy": "arc_easy.jsonl", "copa": "copa.jsonl", "wsc": "winograd_wsc.jsonl"}

MC_YAML = "output_type: multiple_choice\ndoc_to_text: query\ndoc_to_target: gold\ndoc_to_choice: choices\n"
YAML = {
    "piqa": MC_YAML, "arc_easy": MC_YAML, "copa": MC_YAML,
    # an int from doc_to_text: lm-eval's "multiple inputs", the schema's partial scoring (as its WinoGrande)
    "wsc": "output_type: multiple_choice\ndoc_to_text: gold\ndoc_to_target: continuation\ndoc_to_choice: context_options\n",
    # lm_eval/tasks/hellaswag/hellaswag.yaml, its process_docs imported from lm_eval itself
    "hellaswag": ("output_type: multiple_choice\nprocess_docs: !function hellaswag_utils.process_docs\n"
                  "doc_to_text: \"{{query}}\"\ndoc_to_target: \"{{label}}\"\ndoc_to_choice: choices\n"),
}
METRICS = "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"


pytestmark = pytest.mark.usefixtures("one_thread")         # tiny models: a second thread only adds waits


def _hellaswag_docs(data_dir, n=N) -> list[dict]:
    """HellaSwag's raw form built from ARC-Easy questions: a lower-case ctx_b (capitalized by the preprocessing),
    WikiHow's [title] / [header] artifacts and double spaces in the endings, labels as strings (as on the Hub)."""
    docs = []
    for k, line in enumerate((data_dir / "mc" / "arc_easy.jsonl").read_text(encoding="utf-8").splitlines()[200:200 + n]):
        d = json.loads(line)
        q = d["query"].removeprefix("Question: ")
        cut = q.find(" ", len(q) // 2)
        endings = [c + (" [title] Then  see [header] more." if (j + k) % 3 == 0 else "") for j, c in enumerate(d["choices"])]
        docs.append({"activity_label": ["Science", "Biology"][k % 2], "ctx_a": q[:cut], "ctx_b": q[cut + 1:].lower(),
                     "endings": endings, "label": str(d["gold"]), "split": "val", "ind": k})
    return docs


@pytest.fixture(scope="module")
def sets(data_dir, tmp_path_factory) -> dict[str, Path]:
    """name -> a jsonl of N items: slices of the shared files and the HellaSwag-form items."""
    folder = tmp_path_factory.mktemp("mc")
    out = {}
    for name, file in SETS.items():
        lines = (data_dir / "mc" / file).read_text(encoding="utf-8").splitlines()[:N]
        out[name] = folder / f"{name}.jsonl"
        out[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    out["hellaswag"] = folder / "hellaswag.jsonl"
    out["hellaswag"].write_text("".join(json.dumps(d) + "\n" for d in _hellaswag_docs(data_dir)), encoding="utf-8")
    return out


# What this module builds once for test_prefix.py too: it imports these fixtures, and pytest would build them
# again for that module.
_SHARED: dict = {}


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """(model, tokenizer, duolm dir, HF dir): a tiny GPT-2 trained for 60 steps on the sets' gold answers."""
    if "trained" not in _SHARED:
        _SHARED["trained"] = _train(data_dir, tmp_path_factory.mktemp("models"))
    return _SHARED["trained"]


def _train(data_dir: Path, root: Path):
    tok = duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")
    text = ""
    for file in ("piqa.jsonl", "arc_easy.jsonl", "copa.jsonl"):
        for line in (data_dir / "mc" / file).read_text(encoding="utf-8").splitlines()[N:N + 300]:
            d = json.loads(line)
            text += d["query"] + " " + d["choices"][d["gold"]] + "\n"
    ids = torch.tensor(tok.encode_ordinary(text))
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=50257, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        starts = torch.randint(0, len(ids) - BLOCK - 1, (8,), generator=g)
        x = torch.stack([ids[s:s + BLOCK] for s in starts])
        y = torch.stack([ids[s + 1:s + BLOCK + 1] for s in starts])
        loss = F.cross_entropy(model(x).reshape(-1, 50257), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return (model, tok, duolm.save(model, root / "tiny-mc", tok),
            duolm.save(model, root / "hf", tokenizer=tok, format="hf"))


def _write_tasks(folder: Path, sets: dict[str, Path]) -> list[str]:
    folder.mkdir()
    (folder / "hellaswag_utils.py").write_text("from lm_eval.tasks.hellaswag.utils import process_docs  # noqa\n")
    for name, path in sets.items():
        (folder / f"duolm_mc_{name}.yaml").write_text(
            f"task: duolm_mc_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
            f"test_split: test\n{YAML[name]}{METRICS}", encoding="utf-8")
    return [f"duolm_mc_{name}" for name in sets]


def _lm_eval_start(model_kind: str, model_args: str, tasks: list[str], include: Path, out: Path) -> subprocess.Popen:
    """python -m lm_eval ... --log_samples, started (its output to out/lm_eval.log: no pipe to fill while another
    process is waited for)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(out / "datasets")}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lm_eval.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "lm_eval", "--model", model_kind, "--model_args", model_args,
                                 "--tasks", ",".join(tasks), "--include_path", str(include), "--output_path", str(out),
                                 "--log_samples"], env=env, stdout=log, stderr=subprocess.STDOUT)


def _lm_eval_samples(run: subprocess.Popen, tasks: list[str], out: Path) -> dict:
    """_lm_eval_start's run, waited for -> {task: [per-doc sample, by doc_id]}."""
    try:
        run.wait(timeout=900)
    finally:
        run.kill()
    assert run.returncode == 0, (out / "lm_eval.log").read_text(errors="replace")[-8000:]
    samples = {}
    for task in tasks:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()),
                               key=lambda s: s["doc_id"])
    return samples


def _lm_eval(model_kind: str, model_args: str, tasks: list[str], include: Path, out: Path) -> dict:
    """python -m lm_eval ... --log_samples -> {task: [per-doc sample, by doc_id]}."""
    return _lm_eval_samples(_lm_eval_start(model_kind, model_args, tasks, include, out), tasks, out)


def _assert_same(samples: dict, ours: dict, rel: float):
    """lm-eval's per-doc acc / acc_norm equal ours item for item; its log-probabilities ours to `rel`."""
    for name, result in ours.items():
        got = samples[f"duolm_mc_{name}"]
        assert len(got) == len(result["items"]) == N
        for s, r in zip(got, result["items"]):
            assert (s["acc"], s["acc_norm"]) == (r["acc"], r["acc_norm"]), (name, s["doc_id"])
            assert [float(x[0][0]) for x in s["resps"]] == pytest.approx(r["lls"], rel=rel, abs=1e-4)


@pytest.fixture(scope="module")
def ours(trained, sets):
    model, tok, _, _ = trained
    return {name: multiple_choice(model, tok, path, task="hellaswag" if name == "hellaswag" else "multiple-choice")
            for name, path in sets.items()}


def test_scores_equal_lm_eval_hf_item_for_item(trained, sets, ours, runs):
    _, tok, _, _ = trained
    samples = runs["hf"]
    _assert_same(samples, ours, rel=1e-5)
    # the inputs are lm-eval's: HellaSwag's query and " " + ending after its preprocessing, WSC's partial scoring
    first = samples["duolm_mc_hellaswag"][0]["arguments"]
    query, choices, _ = hellaswag_doc(json.loads(sets["hellaswag"].read_text().splitlines()[0]))
    assert [(a["arg_0"], a["arg_1"]) for a in first.values()] == [(query, " " + c) for c in choices]
    wsc = samples["duolm_mc_wsc"][0]["arguments"]
    assert len({a["arg_1"] for a in wsc.values()}) == 1 and len({a["arg_0"] for a in wsc.values()}) == 2
    # the slices exercise what they should: truncated items, a trailing newline moved (PIQA), hits and misses
    truncated = sum(len(sum(encode_pair(tok, *p), [])) > BLOCK + 1 for item in read_items(sets["piqa"])[1]
                    for p in item.pairs)
    assert truncated > 0
    for result in ours.values():
        assert 0 < sum(r["acc"] for r in result["items"]) < N
    assert any(r["acc"] != r["acc_norm"] for result in ours.values() for r in result["items"])


def _api_window(model, tok, item) -> dict:
    """An item scored as lm-eval's API models cut: the last max_length - 1 tokens of context + continuation (they
    keep a position for a generated token), so with max_length = BLOCK + 1 a long item keeps one context token
    fewer than its hf model (and duolm eval) keep."""
    pairs = [(lambda ctx, cont: ((ctx + cont)[-BLOCK:][:-len(cont)], cont))(*encode_pair(tok, *p)) for p in item.pairs]
    lls = score_pairs(model, pairs)
    return {"lls": lls, **item_metrics(lls, list(item.chars), [len(c) for _, c in pairs], item.gold)}


def served_lm_eval(model_dir: Path, sets: dict[str, Path], folder: Path, *flags: str) -> dict:
    """lm-eval's local-completions against `duolm serve MODEL *flags` on `sets`: {task: samples}, and "metrics" the
    server's /metrics (JSON) after."""
    import httpx
    from test_serve_e2e import server
    tasks = _write_tasks(folder / "tasks", sets)
    with server(model_dir, folder / "serve.log", *flags) as (url, _):
        # max_length: the server feeds the whole prompt (it draws a token after it), so at most BLOCK tokens
        args = f"base_url={url}/v1/completions,model={model_dir.name},max_length={BLOCK + 1},num_concurrent=4,max_retries=1"
        samples = _lm_eval("local-completions", args, tasks, folder / "tasks", folder / "out")
        samples["metrics"] = httpx.get(url + "/metrics?format=json").json()
    return samples


PREFIX_SETS = ("piqa", "arc_easy", "copa")          # test_prefix.py's comparison with the prefix cache off


@pytest.fixture(scope="module")
def runs(trained, sets, tmp_path_factory) -> dict:
    """lm-eval on every set: "hf" its `--model hf` on the HF export, "served" served_lm_eval (the server's prefix
    cache on, its default), and "plain" served_lm_eval --no-prefix-cache on PREFIX_SETS (for test_prefix.py), all
    side by side (each mostly one thread of one process: lm-eval's start takes seconds); once for this module and
    test_prefix.py. "served" and "plain" None without fastapi."""
    import lm_eval  # noqa: F401  (a test dependency: missing, this test fails)
    if "runs" not in _SHARED:
        folder = tmp_path_factory.mktemp("lm-eval")
        tasks = _write_tasks(folder / "tasks", sets)
        hf = _lm_eval_start("hf", f"pretrained={trained[3]},dtype=float32,max_length={BLOCK}", tasks,
                            folder / "tasks", folder / "hf")
        try:
            served = dict.fromkeys(("served", "plain"))
            if importlib.util.find_spec("fastapi"):
                (folder / "served").mkdir()
                (folder / "plain").mkdir()
                with ThreadPoolExecutor(2) as pool:          # threads that wait on the processes
                    cached = pool.submit(served_lm_eval, trained[2], sets, folder / "served")
                    plain = pool.submit(served_lm_eval, trained[2], {k: sets[k] for k in PREFIX_SETS},
                                        folder / "plain", "--no-prefix-cache")
                    served = {"served": cached.result(), "plain": plain.result()}
        except BaseException:
            hf.kill()
            raise
        _SHARED["runs"] = {"hf": _lm_eval_samples(hf, tasks, folder / "hf"), **served}
    return _SHARED["runs"]


@pytest.fixture(scope="module")
def served(runs) -> dict:
    if runs["served"] is None:
        pytest.skip("fastapi is not installed: no duolm serve")
    return runs["served"]


def test_scores_equal_lm_eval_local_completions_against_duolm_serve(trained, sets, ours, served):
    model, tok, _, _ = trained
    samples = served
    api = {name: {"items": [_api_window(model, tok, item) for item in read_items(path)[1]]} for name, path in sets.items()}
    _assert_same(samples, api, rel=1e-4)
    differ = [(name, k) for name in sets for k, (a, b) in enumerate(zip(api[name]["items"], ours[name]["items"]))
              if a["lls"] != pytest.approx(b["lls"], rel=1e-5)]
    assert differ == [("piqa", 22), ("hellaswag", 4)]   # the items longer than the window


def test_cli_eval_json_scores_file_and_suite(trained, sets, ours, tmp_path, capsys):
    from duolm.cli import main
    _, _, model_dir, _ = trained
    main(["eval", str(model_dir), "--task", "multiple-choice", "--data", str(sets["copa"]), "--json",
          "--scores", str(tmp_path / "scores.jsonl")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: last[k] for k in ("acc", "acc_norm", "n")} == {k: ours["copa"][k] for k in ("acc", "acc_norm", "n")}
    assert "items" not in last
    lines = [json.loads(x) for x in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert [x["lls"] for x in lines] == [r["lls"] for r in ours["copa"]["items"]]

    (tmp_path / "dir" / "mc").mkdir(parents=True)
    for name, file in (("piqa", "piqa.jsonl"), ("wsc", "winograd_wsc.jsonl")):
        (tmp_path / "dir" / "mc" / file).write_bytes(sets[name].read_bytes())
    (tmp_path / "dir" / "hellaswag_val.jsonl").write_bytes(sets["hellaswag"].read_bytes())
    main(["eval", str(model_dir), "--suite", "zero-shot-mc", "--data-dir", str(tmp_path / "dir")])
    table = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"hellaswag", "piqa", "wsc273"} and "copa" not in rows
    assert rows["piqa"].startswith(f"| piqa | {N} | {100 * ours['piqa']['acc']:.2f} | "
                                   f"{100 * ours['piqa']['acc_norm']:.2f} | 50.00 |")
    assert rows["hellaswag"].endswith("| 25.00 |  | 31.14 |")


def test_pretrain_logs_the_acc_norm_duolm_eval_gives_on_its_checkpoint(data_dir, sets, tmp_path, capsys):
    from duolm.cli import main
    from duolm.data import prepare
    from duolm.runs import read_metrics
    from duolm.tokenizers import ByteLevelBPE

    text = (data_dir / "tinyshakespeare" / "input.txt").read_text()[:50_000]
    (tmp_path / "text.txt").write_text(text)
    prepare([tmp_path / "text.txt"], ByteLevelBPE.train([text], vocab_size=300), tmp_path / "data",
            val_fraction=0.1, chunk_chars=8192)
    run = tmp_path / "run"
    main(["pretrain", "gpt2", "--data", str(tmp_path / "data"), "-o", str(run), "--block-size", "128",
          "--batch-size", "8", "--max-steps", "4", "--eval-every", "2", "--eval-batches", "1", "--quiet",
          "--precision", "fp32", "--eval-mc", str(sets["copa"]), "--eval-mc", str(sets["wsc"])])
    rows = [r for r in read_metrics(run) if "val_mc_copa_acc_norm" in r]
    assert [r["step"] for r in rows] == [0, 2, 4] and all("val_mc_wsc_acc_norm" in r for r in rows)
    assert (run / "loss.png").is_file()
    for name in ("copa", "wsc"):
        main(["eval", str(run), "--task", "multiple-choice", "--data", str(sets[name]), "--json"])
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["acc_norm"] == rows[-1][f"val_mc_{name}_acc_norm"]


def test_hellaswag_preprocessing_is_lm_evals(data_dir):
    from lm_eval.tasks.hellaswag.utils import preprocess
    texts = [" Roof shingle removal: A man is [header] sitting on a roof. [title] Then  ", "[step] a  b [title]c",
             "no brackets here.", "  two   spaces [x] [y] "]
    assert [hellaswag_preprocess(t) for t in texts] == [preprocess(t) for t in texts]
    assert hellaswag_preprocess(texts[0]) == "Roof shingle removal: A man is sitting on a roof.. Then"
    doc = {"activity_label": "Cooking", "ctx_a": "A woman stirs a pot.", "ctx_b": "then SHE [title] adds salt",
           "endings": ["tastes it.", "[header] leaves."], "label": "1"}
    assert hellaswag_doc(doc) == ("Cooking: A woman stirs a pot. Then she. adds salt", ["tastes it.", " leaves."], 1)


def test_metrics_worked_example_and_lm_eval_pair_encoding(trained):
    assert item_metrics([-6.0, -8.0], [4, 10], [2, 4], gold=1) == {
        "pred": 0, "pred_norm": 1, "pred_per_token": 1, "acc": 0.0, "acc_norm": 1.0, "acc_per_token": 1.0}
    assert item_metrics([-1.0, -1.0], [3, 3], [1, 1], gold=1)["acc"] == 0.0       # ties: the first, as np.argmax
    _, tok, _, _ = trained
    # a context's trailing whitespace moves to the continuation (PIQA's queries end with a newline)
    ctx, cont = encode_pair(tok, "Question: dresser\n", " replace drawer")
    assert ctx == tok.encode_ordinary("Question: dresser") and cont == tok.encode_ordinary("\n replace drawer")
    assert encode_pair(tok, "", " hi") == ([tok.eot_id], tok.encode_ordinary(" hi"))


def test_batched_shared_prefixes_equal_one_full_forward_per_choice(trained):
    """The fast path against the plain one: items of different shared-prefix lengths (left-padded into one
    cache), a truncated input, and an item with no shared prefix, against every (context, continuation) run
    alone through the whole model, left-truncated as lm-eval cuts it."""
    model, tok, _, _ = trained
    long = tok.encode_ordinary("the cat sat on the mat " * 20)[:BLOCK + 10]
    conts = [tok.encode_ordinary(t) for t in (" and then", " a", " slept all day long")]
    groups = [[(long[:50], conts[0]), (long[:50], conts[1])], [(long[:20], conts[2]), (long[:20], conts[1])],
              [(long, conts[0]), (long, conts[1]), (long[:30], conts[2])]]       # the last: cut differently
    inputs = [model_inputs(g, BLOCK) for g in groups]
    assert [x.shared for x in inputs] == [49, 19, 0] and span(inputs[:2]) <= BLOCK < span(inputs)
    got = score_inputs(model, inputs[:2]) + score_inputs(model, inputs[2:])
    for group, lls in zip(groups, got):
        want = []
        for ctx, cont in group:
            inp = (ctx + cont)[-(BLOCK + 1):]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([inp[:-1]]))[0, -len(cont):].double(), -1)
            want.append(float(logp[torch.arange(len(cont)), torch.tensor(cont)].sum()))
        assert lls == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("line, error", [
    ('{"query": "q", "choices": ["a", "b"], "gold": 2}', "gold 2 is not an index into the 2 choices"),
    ('{"query": "q", "choices": [], "gold": 0}', 'field "choices" must be a non-empty list of strings, got []'),
    ('{"context_options": ["a"], "continuation": "c", "gold": -1}', "gold -1 is not an index into the 1 choices"),
    ('{"query": "q", "choices": ["a"], "gold": 0', "Expecting"),
    ('{"question": "q", "answers": ["a"]}', "not a multiple-choice record: expected the fields {query, choices, gold}"),
    ('{"ctx_a": "a", "ctx_b": "b", "activity_label": "x", "endings": ["e"], "label": "0"}',
     "a hellaswag record, expected multiple-choice or schema"),
])
def test_bad_lines_are_one_line_errors_naming_file_and_line(tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n" + line + "\n")
    with pytest.raises(ValueError) as e:
        read_items(path, ("multiple-choice", "schema"))
    assert str(e.value).startswith(f"{path}:2: ") and error in str(e.value) and "\n" not in str(e.value)
    path.write_text('{"query": "q", "choices": ["a", "b"], "gold": 1}\n{"context_options": ["a"], "continuation": "c", "gold": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a schema record, expected multiple-choice$"):
        read_items(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no items"):
        read_items(tmp_path / "empty.jsonl")


# one valid record of each form; the fields walked are the reader's own (choice.FORMS)
VALID = {"multiple-choice": {"query": "Q:", "choices": ["a", "b"], "gold": 1},
         "schema": {"context_options": ["The cat", "The dog"], "continuation": "sat.", "gold": 0},
         "hellaswag": {"ctx_a": "A man", "ctx_b": "then he", "activity_label": "Cooking", "endings": ["a", "b"],
                       "label": 1}}
# a value of each JSON type: sent where the valid record's value is of another type
OF_TYPE = [None, True, 5, 0.5, "abcd", ["abcd"], {"a": 1}]


def wrong_values(valid):
    """The values of other JSON types than `valid`'s; for a list, also an empty one and one holding a number."""
    return [v for v in OF_TYPE if type(v) is not type(valid)] + ([[], ["a", 5]] if isinstance(valid, list) else [])


@pytest.mark.parametrize("form", list(choice.FORMS))
def test_every_field_of_the_wrong_type_is_a_line_naming_it(tmp_path, form):
    """Each field of each form null, of each other JSON type, or a list of something else: a one-line ValueError
    naming the file, the line and the field ("query": 5 once ended in a TypeError, "endings": "abcd" was read as
    four endings)."""
    assert set(VALID) == set(choice.FORMS) and set(VALID[form]) == set(choice.FORMS[form])
    path, ok = tmp_path / "items.jsonl", json.dumps(VALID[form]) + "\n"
    forms = (form,) if form == "hellaswag" else ("multiple-choice", "schema")
    path.write_text(ok)
    assert read_items(path, forms)[0] == form
    for field, valid in VALID[form].items():
        for value in wrong_values(valid):
            path.write_text(ok + json.dumps({**VALID[form], field: value}) + "\n")
            with pytest.raises(ValueError) as e:
                read_items(path, forms)
            msg = str(e.value)
            assert msg.startswith(f"{path}:2: {form}: field \"{field}\" must be ") and "\n" not in msg, (field, value)


def test_hellaswag_labels_as_the_hub_writes_them():
    doc = {**VALID["hellaswag"], "label": "1"}
    assert choice.make_item(doc) == choice.make_item(VALID["hellaswag"]) and choice.make_item(doc).gold == 1
    for label in ("", "1.0", "-1", "\u0661"):          # not a string of ASCII digits (U+0661: ARABIC-INDIC ONE)
        with pytest.raises(ValueError, match='field "label" must be an integer or a string of digits'):
            choice.make_item({**doc, "label": label})


@pytest.mark.parametrize("text", [None, 5, ["a b"], {"t": "a b"}])
def test_lambada_jsonl_text_of_the_wrong_type_names_file_line_and_field(tmp_path, text):
    from duolm.evaluation.readers import lambada_examples
    path = tmp_path / "lambada_test.jsonl"
    path.write_text(json.dumps({"text": "a b"}) + "\n" + json.dumps({"text": text}) + "\n")
    with pytest.raises(ValueError) as e:
        lambada_examples(path)
    assert str(e.value).startswith(f"lambada: {path} line 2: ") and '"text" string' in str(e.value)


def test_cli_eval_of_a_bad_field_is_one_line(data_dir, tmp_path, capsys):
    from duolm.cli import main
    tok = duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")
    model = GPT2(GPT2Config(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16))
    model_dir = duolm.save(model, tmp_path / "model", tok)
    for task, doc, field in (("multiple-choice", {"query": 5, "choices": ["a"], "gold": 0}, "query"),
                             ("hellaswag", {**VALID["hellaswag"], "ctx_b": None}, "ctx_b")):
        (tmp_path / "bad.jsonl").write_text(json.dumps(doc) + "\n")
        with pytest.raises(SystemExit) as e:
            main(["eval", str(model_dir), "--task", task, "--data", str(tmp_path / "bad.jsonl")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1
        assert err.startswith(f"duolm: error: {tmp_path / 'bad.jsonl'}:1: {task}: field \"{field}\" must be a string")
