"""ONNX export (issue 60): every model and head as ONNX Runtime runs it, against duolm's own forward.

Each model is saved with duolm.save(format="onnx") once (a module fixture) and run in ONNX Runtime on inputs made
here, at shapes the export was not traced at: one row, and a padded batch of rows of different lengths; within 1e-5
of duolm's fp32 outputs. GPT-2's graph with its KV cache is stepped in ONNX Runtime for 32 greedy tokens and gives
generate()'s ids. all-MiniLM-L6-v2 (real weights) loads in sentence-transformers' ONNX backend, which needs optimum's
ONNX Runtime package and so transformers 4 (.venv/onnx-reference, run in a subprocess with that folder first on its
path, as tests/test_qa_pipeline.py runs the QA pipeline).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from duolm.checkpoint import load, save
from duolm.cli import main
from duolm.convert import onnx as duolm_onnx
from duolm.convert.st import read_pooling
from duolm.generation import generate
from duolm.models import GPT2, Bert, BertConfig, BertForPreTraining, GPT2Config, KVCache
from duolm.models.heads import HeadConfig, attach_head, head_model
from conftest import minilm_dir

TOL = 1e-5
SENTENCES = ["A man is playing a guitar.", "The new movie is awesome, and everyone in the theatre loved it!",
             "A cat sits on the mat.", "Stocks fell sharply on Monday after the central bank raised rates again."]


def onnx_reference() -> Path:
    """optimum's ONNX Runtime package, sentence-transformers 5 and transformers 4.57.3, installed by `make install`
    in a folder of its own, for subprocesses that put it first on PYTHONPATH."""
    folder = Path(sys.prefix) / "onnx-reference"
    if not (folder / "optimum" / "onnxruntime").is_dir():
        pytest.fail(f"{folder} has no optimum.onnxruntime: `make install` puts sentence-transformers' ONNX backend "
                    "there")
    return folder


def _session(path: Path, name="model.onnx"):
    return ort.InferenceSession(str(path / "onnx" / name), providers=["CPUExecutionProvider"])


def _run(session, **inputs):
    return session.run(None, {k: v.numpy() for k, v in inputs.items()})


def _close(got, want, real=None, tol=TOL):
    """got (ONNX Runtime's) within tol of want (duolm's); real: (B, T) mask of the positions compared (the states of
    padding tokens are nobody's output: with real weights they differ by up to 2.4e-5 where real ones by 2e-6)."""
    want = want.detach().float().numpy()
    assert got.shape == want.shape
    if real is not None:
        got, want = got[real.bool().numpy()], want[real.bool().numpy()]
    diff = np.abs(got - want).max()
    assert diff <= tol, diff


# --- inputs made here, none of the exporter's samples ----------------------------------------------------------

def _bert_batch(gen, lengths, vocab=512):
    """ids, mask, segments (B, T): right-padded, segment B from the middle of each row."""
    T = max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, vocab, (len(lengths), T), generator=gen) * mask
    seg = (torch.arange(T)[None] >= torch.tensor(lengths)[:, None] // 2).long() * mask
    return ids, mask, seg


BATCHES = ([5], [9, 3, 6, 1])         # one row; a padded batch of other lengths than the export's samples


BERT = BertConfig.preset("tiny")
GPT = GPT2Config.preset("tiny")
HEADS = {
    "classify": HeadConfig("classify", ["neg", "neu", "pos"]), "regress": HeadConfig("regress"),
    "tag": HeadConfig("tag", ["O", "B-PER", "I-PER"]), "span": HeadConfig("span"), "choice": HeadConfig("choice"),
}


def _make(kind):
    torch.manual_seed(0)
    if kind == "bert":
        return Bert(BERT)
    if kind == "pretraining":
        return BertForPreTraining(BERT)
    if kind == "gpt2-classify":
        return head_model("gpt2", GPT, HeadConfig("classify", ["a", "b"]))
    return head_model("bert", BERT, HEADS[kind])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """kind -> (model, folder), each exported once, on demand."""
    done = {}

    def get(kind):
        if kind not in done:
            model = _make(kind).eval()
            done[kind] = model, save(model, tmp_path_factory.mktemp(kind), format="onnx")
        return done[kind]
    return get


@pytest.mark.parametrize("kind", ["bert", "pretraining", "classify", "tag", "span"])        # regress: the CLI test
def test_bert_models_and_heads_match_duolm(kind, exported, one_thread):
    model, path = exported(kind)
    session = _session(path)
    gen = torch.Generator().manual_seed(1)
    for lengths in BATCHES:
        ids, mask, seg = _bert_batch(gen, lengths)
        got = _run(session, input_ids=ids, attention_mask=mask, token_type_ids=seg)
        with torch.no_grad():
            want = model(ids, seg, mask)
        want = want if isinstance(want, tuple) else (want,)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _close(g, w)


def test_multiple_choice_matches_duolm(exported, one_thread):
    model, path = exported("choice")
    session = _session(path)
    gen = torch.Generator().manual_seed(2)
    for B, N, lengths in ((1, 4, [5, 3, 7, 2]), (2, 3, [8, 4, 6, 1, 5, 3])):
        ids, mask, seg = (x.view(B, N, -1) for x in _bert_batch(gen, lengths))
        (got,) = _run(session, input_ids=ids, attention_mask=mask, token_type_ids=seg)
        with torch.no_grad():
            _close(got, model(ids, seg, mask))


def test_gpt2_classifier_matches_duolm(exported, one_thread):
    model, path = exported("gpt2-classify")
    session = _session(path)
    gen = torch.Generator().manual_seed(3)
    for lengths in BATCHES:
        ids, mask, _ = _bert_batch(gen, lengths)                # right-padded, as GPT2ForSequence reads
        (got,) = _run(session, input_ids=ids, attention_mask=mask)
        with torch.no_grad():
            _close(got, model.classify(ids, mask.sum(1) - 1))


def test_files_and_graph_names(exported):
    model, path = exported("span")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "bert" and config["architectures"] == ["BertForQuestionAnswering"]
    assert not (path / "model.safetensors").exists()
    assert sorted(p.name for p in (path / "onnx").iterdir()) == ["model.onnx"]
    session = _session(path)
    assert [(i.name, i.shape) for i in session.get_inputs()] == [
        (n, ["batch_size", "sequence_length"]) for n in ("input_ids", "attention_mask", "token_type_ids")]
    assert [o.name for o in session.get_outputs()] == ["start_logits", "end_logits"]


# --- GPT-2 -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT2(GPT).eval()
    return model, save(model, tmp_path_factory.mktemp("gpt2"), format="onnx")


def _left(prompts):
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def test_gpt2_kv_cache_graph_steps_to_generates_greedy_ids(gpt2, one_thread):
    """The prompt with a past of length 0, then one token at a time with the present fed back: the ids of
    generate(temperature=0), for one prompt and for a left-padded batch of two."""
    model, path = gpt2
    session = _session(path)
    names = [i.name for i in session.get_inputs()]
    assert names[:2] == ["input_ids", "attention_mask"] and names[2:4] == ["past_key_values.0.key",
                                                                           "past_key_values.0.value"]
    assert [o.name for o in session.get_outputs()][:3] == ["logits", "present.0.key", "present.0.value"]
    for prompts in ([[5, 17, 300, 42]], [[7, 8, 9, 10, 11, 12], [400, 3]]):
        ids, mask = _left(prompts)
        past = {n: np.zeros((len(prompts), GPT.n_head, 0, GPT.head_dim), np.float32) for n in names[2:]}
        out = []
        for _ in range(32):
            logits, *present = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), **past})
            ids = torch.from_numpy(logits[:, -1].argmax(-1))[:, None]
            out.append(ids[:, 0].tolist())
            mask = torch.cat([mask, torch.ones_like(ids)], 1)
            past = dict(zip(names[2:], present))
        greedy = generate(model, prompts, 32, temperature=0)
        for _ in greedy:
            pass
        assert [list(r) for r in zip(*out)] == greedy.tokens


def test_gpt2_graphs_match_duolm_with_and_without_cache(gpt2, tmp_path, one_thread):
    """The cache graph's logits and presents against duolm's forward over a KVCache holding the same past; the
    graph without a cache (cache=False) against the forward on a left-padded batch."""
    model, path = gpt2
    session = _session(path)
    gen = torch.Generator().manual_seed(4)
    plain = save(model, tmp_path / "plain", format="onnx", cache=False)
    plain_session = _session(plain)
    assert [i.name for i in plain_session.get_inputs()] == ["input_ids", "attention_mask"]
    for B, P, T in ((1, 0, 6), (3, 5, 2)):
        ids = torch.randint(0, GPT.vocab_size, (B, P + T), generator=gen)
        mask = torch.ones(B, P + T, dtype=torch.long)
        mask[-1, :2] = 0                                            # a left-padded row
        cache = KVCache(model.config, B)
        with torch.no_grad():
            if P:
                model(ids[:, :P], mask[:, :P], cache)
            past = {f"past_key_values.{i}.{w}": x[i][:, :, :P].clone().numpy()
                    for i in range(GPT.n_layer) for w, x in (("key", cache.k), ("value", cache.v))}
            want = model(ids[:, P:], mask, cache)
            full = model(ids, mask)
        logits, *present = session.run(None, {"input_ids": ids[:, P:].numpy(), "attention_mask": mask.numpy(), **past})
        _close(logits, want)
        for i in range(GPT.n_layer):
            _close(present[2 * i], cache.k[i][:, :, :P + T])
            _close(present[2 * i + 1], cache.v[i][:, :, :P + T])
        (plain_logits,) = _run(plain_session, input_ids=ids, attention_mask=mask)
        _close(plain_logits, full)


# --- all-MiniLM-L6-v2 ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm_onnx(tmp_path_factory):
    """all-MiniLM-L6-v2 through `duolm convert --to onnx` (a sentence-transformers checkpoint: exported as the embedding
    model its modules make), and the same as duolm's BertForEmbedding."""
    out = tmp_path_factory.mktemp("minilm")
    main(["convert", str(minilm_dir()), str(out), "--to", "onnx"])
    bert, tok = load(minilm_dir())
    pooling = read_pooling(minilm_dir())
    assert (pooling.mode, pooling.normalize) == ("mean", True)
    return attach_head(bert, HeadConfig("embed", pooling=pooling.mode, normalize=pooling.normalize)).eval(), tok, out


def _encode(tok, texts):
    """ids, mask, segments (B, T) of the texts, right-padded."""
    rows = [tok.encode(t) for t in texts]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    return ids, mask, torch.zeros_like(ids)


def test_minilm_encoder_and_embedding_graphs_match_duolm(minilm_onnx):
    model, tok, path = minilm_onnx
    encoder, embedding = _session(path), _session(path, "embedding.onnx")
    for texts in (SENTENCES[:1], SENTENCES):
        ids, mask, seg = _encode(tok, texts)
        with torch.no_grad():
            hidden, _ = model.bert(ids, seg, mask)
            vectors = model(ids, seg, mask)
        (got,) = _run(encoder, input_ids=ids, attention_mask=mask, token_type_ids=seg)
        _close(got, hidden, mask)
        (got,) = _run(embedding, input_ids=ids, attention_mask=mask, token_type_ids=seg)
        _close(got, vectors)
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "vocab.txt", "tokenizer_config.json", "modules.json", "1_Pooling", "2_Normalize"} <= files
    assert json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"] == 256     # MiniLM's


# sentence-transformers' ONNX backend and optimum's ORTModelFor* classes, as a user loads the exports
LOADERS = r"""
import json, sys
import torch
from optimum.onnxruntime import ORTModelForCausalLM, ORTModelForSequenceClassification
from sentence_transformers import SentenceTransformer
job = json.loads(sys.argv[1])
st = SentenceTransformer(job["minilm"], backend="onnx", device="cpu", model_kwargs={"file_name": "onnx/model.onnx"})
lm = ORTModelForCausalLM.from_pretrained(job["gpt2"], subfolder="onnx")
ids = lm.generate(torch.tensor([job["prompt"]]), max_new_tokens=32, do_sample=False)[0, len(job["prompt"]):]
classify = ORTModelForSequenceClassification.from_pretrained(job["classify"], subfolder="onnx")
x = torch.tensor(job["ids"])
logits = classify(input_ids=x, attention_mask=torch.ones_like(x), token_type_ids=torch.zeros_like(x)).logits
print(json.dumps({"embeddings": st.encode(job["texts"], convert_to_numpy=True).tolist(), "greedy": ids.tolist(),
                  "logits": logits.tolist()}))
"""


def test_exports_load_in_sentence_transformers_and_optimum(minilm_onnx, gpt2, exported):
    """SentenceTransformer(out, backend="onnx") gives duolm's embeddings; optimum's ORTModelForCausalLM.generate
    duolm's greedy ids (32 tokens, through the KV cache graph); ORTModelForSequenceClassification duolm's logits."""
    model, tok, path = minilm_onnx
    classifier, classify_path = exported("classify")
    prompt, ids = [5, 17, 300, 42], [[2, 40, 9, 300, 77, 3]]
    job = {"minilm": str(path), "texts": SENTENCES, "gpt2": str(gpt2[1]), "prompt": prompt,
           "classify": str(classify_path), "ids": ids}
    env = {**os.environ, "PYTHONPATH": str(onnx_reference()), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", LOADERS, json.dumps(job)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    x, mask, seg = _encode(tok, SENTENCES)
    greedy = generate(gpt2[0], [prompt], 32, temperature=0)
    for _ in greedy:
        pass
    with torch.no_grad():
        _close(np.array(got["embeddings"], dtype=np.float32), model(x, seg, mask))
        _close(np.array(got["logits"], dtype=np.float32), classifier(torch.tensor(ids)))
    assert got["greedy"] == greedy.tokens[0]


def test_int8_export_agrees_with_fp32(minilm_onnx):
    """quantize(): the int8 graphs' agreement with fp32 on the exporter's samples (random ids), and on real sentences
    here, the embeddings' cosine to duolm's fp32 ones. ONNX Runtime's dynamic int8 quantizes each activation tensor
    with one scale (duolm's int8 one a row: >= 0.995 on STS-B sentences, docs/benchmarks.md): measured 0.976 on the
    samples, 0.990 on these sentences."""
    model, tok, path = minilm_onnx
    agreements = duolm_onnx.quantize(model, path)
    for a in agreements:
        print(f"int8 {a.file}: {a.output} cosine to fp32 >= {a.cosine:.5f} (the exporter's samples)")
    assert [a.file for a in agreements] == ["model_quantized.onnx", "embedding_quantized.onnx"]
    assert all(0.95 <= a.cosine < 1.0 and a.top1 is None for a in agreements)
    ids, mask, seg = _encode(tok, SENTENCES)
    (got,) = _run(_session(path, "embedding_quantized.onnx"), input_ids=ids, attention_mask=mask, token_type_ids=seg)
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(torch.from_numpy(got), model(ids, seg, mask)).min().item()
    print(f"int8 embeddings of {len(SENTENCES)} sentences: cosine to duolm fp32 >= {cosine:.5f}")
    assert 0.98 <= cosine < 1.0              # not 1: the graph really is int8


# --- errors ---------------------------------------------------------------------------------------------------------

def test_an_export_that_differs_is_refused_and_nothing_is_written(tmp_path):
    """A module whose eager forward is not what torch.export traces (here: a hook that adds 1 outside a trace): the
    check in ONNX Runtime finds the difference, names the model and the output, and leaves no graph behind."""
    torch.manual_seed(0)
    model = Bert(BERT).eval()
    model.pool.register_forward_hook(lambda m, i, out: out if torch.compiler.is_compiling() else out + 1)
    with pytest.raises(ValueError, match=r"ONNX export of Bert: pooler_output differs from duolm's by .* nothing "
                                         "written"):
        save(model, tmp_path, format="onnx")
    assert list((tmp_path / "onnx").iterdir()) == []
    with pytest.raises(ValueError, match="cannot export a Linear to ONNX"):
        duolm_onnx.export(torch.nn.Linear(2, 2), tmp_path)


def test_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    save(Bert(BERT), tmp_path / "src")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)            # as if not installed
    with pytest.raises(SystemExit):
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "onnx"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'duolm[onnx]'" in err, err


def test_cli_convert_to_onnx_with_int8(tmp_path, capsys, one_thread):
    """A regressor through the command: the export, its int8 graph and their agreement in one line (a regressor's
    scores as one vector: no argmax); then a regressor's graph against duolm."""
    torch.manual_seed(0)
    model = head_model("bert", BERT, HEADS["regress"]).eval()
    save(model, tmp_path / "src")
    main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "onnx", "--quantize", "int8"])
    out = capsys.readouterr().out
    print(out)
    assert "(onnx format): BertForSequence" in out
    line = next(x for x in out.splitlines() if x.startswith("int8 "))
    assert "model_quantized.onnx: logits cosine to fp32 >= 0.9" in line and "argmax" not in line
    ids, mask, seg = _bert_batch(torch.Generator().manual_seed(5), [7, 2, 4])
    (got,) = _run(_session(tmp_path / "out"), input_ids=ids, attention_mask=mask, token_type_ids=seg)
    with torch.no_grad():
        _close(got, model(ids, seg, mask))
    assert sorted(p.name for p in (tmp_path / "out" / "onnx").iterdir()) == ["model.onnx", "model_quantized.onnx"]
    with pytest.raises(SystemExit):
        main(["convert", str(tmp_path / "src"), str(tmp_path / "hf"), "--to", "hf", "--quantize", "int8"])
    assert capsys.readouterr().err == "duolm: error: --quantize and --no-cache are options of --to onnx, not --to hf\n"


def test_duolm_imports_onnx_only_when_exporting():
    code = ("import sys, duolm.checkpoint, duolm.convert.onnx, duolm.cli; "
            "print(sorted(m for m in ('onnx', 'onnxruntime', 'onnxscript') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
