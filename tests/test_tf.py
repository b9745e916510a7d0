"""The original TensorFlow releases without TensorFlow: our reader against what TensorFlow wrote and read
back, GPT-2 / BERT logits against transformers' TF loaders, damaged files, and a mutation fuzz.

The fixtures (tests/fixtures/tf/) were written once by real TensorFlow with the releases' exact names
and shapes; make_fixtures.py there says how. TensorFlow is not needed here."""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import duolm
from duolm.convert import crc32c, tf
from duolm.models import Bert, BertForPreTraining, GPT2
from tf_bundle import mask as _mask, write_bundle

FIX = Path(__file__).resolve().parent / "fixtures" / "tf"
ATOL = 1e-5


def _flip(file: Path, pos: int):
    raw = bytearray(file.read_bytes())
    raw[pos] ^= 0x10
    file.write_bytes(raw)


@pytest.fixture
def copy(tmp_path):
    def make(name):
        shutil.copytree(FIX / name, tmp_path / name)
        return tmp_path / name
    return make


# --- CRC-32C --------------------------------------------------------------------------------------

def test_crc32c_known_values():
    # RFC 3720 (iSCSI) appendix B.4 test vectors, and the standard check value
    assert crc32c.crc32c(b"123456789") == 0xE3069283
    assert crc32c.crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c.crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert crc32c.crc32c(b"") == 0


def test_crc32c_takes_what_the_reader_passes(tmp_path):
    """The reader checks memory-mapped slices of a shard (numpy arrays), tests pass bytes: both, and
    memoryviews, give the CRC of the same bytes."""
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    (tmp_path / "shard").write_bytes(data.tobytes())
    mapped = np.memmap(tmp_path / "shard", dtype=np.uint8, mode="c")
    want = crc32c.crc32c(data[3:70001].tobytes())
    assert crc32c.crc32c(mapped[3:70001]) == crc32c.crc32c(memoryview(data)[3:70001]) == want


def test_crc32c_without_the_package_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "google_crc32c", None)      # import google_crc32c -> ImportError
    with pytest.raises(ImportError, match=r"^reading TensorFlow checkpoints needs google-crc32c.*"
                                          r"pip install 'duolm\[tf\]'$"):
        crc32c.crc32c(b"123456789")


def test_unmask_undoes_tfs_mask():
    for crc in (0, 1, 0xE3069283, 0xFFFFFFFF, 0x80000000):
        assert crc32c.unmask(_mask(crc)) == crc


# --- the reader against what TensorFlow wrote -----------------------------------------------------

def test_every_dtype_in_two_shards_as_tensorflow_reads_it():
    ckpt = tf.read_checkpoint(FIX / "dtypes" / "dtypes.ckpt")
    ref = np.load(FIX / "dtypes" / "tensors.npz", allow_pickle=False)
    assert sorted(ckpt) == sorted(ref.files)
    assert ckpt.n_shards == 2 and {e.shard for e in ckpt.entries.values()} == {0, 1}
    assert {ckpt[n].dtype.name for n in ckpt} >= {"float16", "float32", "float64", "int8", "int16", "int32", "int64",
                                                   "uint8", "uint16", "uint32", "uint64", "bool"}
    assert any(e.offset % e.dtype.itemsize for e in ckpt.entries.values())   # unaligned tensors are read too
    for name in ckpt:
        a = ckpt[name]
        assert a.dtype == ref[name].dtype and a.shape == ref[name].shape, name
        assert a.tobytes() == ref[name].tobytes(), name
    assert ckpt["x/scalar"].shape == () and ckpt["x/scalar"] == np.float32(3.25)
    assert ckpt["x/empty"].shape == (0, 4)


def test_bert_checkpoint_in_three_shards_with_optimizer_state():
    ckpt = tf.read_checkpoint(FIX / "bert" / "bert_model.ckpt")
    ref = np.load(FIX / "bert" / "tensors.npz", allow_pickle=False)
    assert ckpt.n_shards == 3 and {e.shard for e in ckpt.entries.values()} == {0, 1, 2}
    for name in ref.files:
        assert ckpt[name].dtype == ref[name].dtype and np.array_equal(ckpt[name], ref[name]), name
    assert ckpt["global_step"].dtype == np.int64 and ckpt["global_step"] == 100000
    slots = [n for n in ckpt if n.endswith(("/adam_m", "/adam_v"))]
    assert len(slots) == 2 * (len(ckpt) - len(slots) - 1)
    for name in slots:   # checksums verified on each read
        assert ckpt[name].shape == ckpt[name.rsplit("/", 1)[0]].shape


def test_tensors_are_read_lazily_from_a_memory_map(copy):
    d = copy("gpt2")
    ckpt = tf.read_checkpoint(d / "model.ckpt")
    e = ckpt.entries["model/h1/mlp/c_fc/w"]
    _flip(d / "model.ckpt.data-00000-of-00001", e.offset + 5)   # damage one tensor after the index was read
    ckpt = tf.read_checkpoint(d / "model.ckpt")   # opening reads no tensor data
    assert isinstance(ckpt["model/wte"].base, np.memmap)
    with pytest.raises(ValueError, match=r"model\.ckpt\.data-00000-of-00001: tensor 'model/h1/mlp/c_fc/w': checksum"):
        ckpt["model/h1/mlp/c_fc/w"]


# --- models against transformers' TF loaders ------------------------------------------------------

def test_gpt2_logits_equal_transformers_tf_loader():
    config, sd = tf.gpt2_from_tf(FIX / "gpt2")
    assert (config.vocab_size, config.block_size, config.n_layer, config.n_head, config.n_embd) == (267, 16, 2, 4, 32)
    model = GPT2(config).eval()
    model.load_state_dict(sd, strict=True)
    exp = np.load(FIX / "gpt2" / "expected.npz")
    with torch.no_grad():
        logits = model(torch.from_numpy(exp["idx"]))
    np.testing.assert_allclose(logits.numpy(), exp["logits"], atol=ATOL, rtol=0)


def _bert_inputs():
    exp = np.load(FIX / "bert" / "expected.npz")
    return exp, [torch.from_numpy(exp[k]) for k in ("idx", "segments", "mask")]


def test_bert_mlm_and_nsp_logits_equal_transformers_tf_loader():
    config, sd, heads = tf.bert_from_tf(FIX / "bert")
    assert heads and config.n_inner == 48 and config.vocab_size == 40
    assert not any("adam" in k or "step" in k for k in sd)
    model = BertForPreTraining(config).eval()
    model.load_state_dict(sd, strict=True)
    exp, inputs = _bert_inputs()
    with torch.no_grad():
        mlm, nsp = model(*inputs)
    np.testing.assert_allclose(mlm.numpy(), exp["mlm_logits"], atol=ATOL, rtol=0)   # padded positions too
    np.testing.assert_allclose(nsp.numpy(), exp["nsp_logits"], atol=ATOL, rtol=0)


def test_duolm_load_reads_release_folders_with_their_tokenizers():
    from transformers import BertTokenizer, GPT2Tokenizer

    model, tok = duolm.load(FIX / "gpt2")
    assert isinstance(model, GPT2) and not model.training
    ref = GPT2Tokenizer(str(FIX / "gpt2" / "encoder.json"), str(FIX / "gpt2" / "vocab.bpe"))
    text = "the cat sat in the hat, at the sea<|endoftext|>"
    assert tok.encode(text, allowed_special="all") == ref.encode(text)
    exp = np.load(FIX / "gpt2" / "expected.npz")
    with torch.no_grad():
        logits = model(torch.from_numpy(exp["idx"]))
    np.testing.assert_allclose(logits.numpy(), exp["logits"], atol=ATOL, rtol=0)

    model, tok = duolm.load(FIX / "bert")
    assert isinstance(model, BertForPreTraining)
    ref = BertTokenizer(str(FIX / "bert" / "vocab.txt"), do_lower_case=True)
    text = "The dog played in the sunny park. The cat sat under a tree!"
    assert tok.encode(text) == ref.encode(text)
    exp, inputs = _bert_inputs()
    with torch.no_grad():
        _, nsp = model(*inputs)
    np.testing.assert_allclose(nsp.numpy(), exp["nsp_logits"], atol=ATOL, rtol=0)


def test_bert_without_heads_loads_as_bert(copy):
    # a checkpoint without cls/ (e.g. a released encoder only): Bert's state dict
    d = copy("bert")
    config, sd, heads = tf.bert_from_tf(d)
    full = BertForPreTraining(config).eval()
    full.load_state_dict(sd)
    ckpt = tf.read_checkpoint(d / "bert_model.ckpt")
    names = [n for n in ckpt if not n.startswith("cls/")]
    sub = _rewrite(d / "bert_model.ckpt", {n: ckpt[n] for n in names})
    config, sd, heads = tf.bert_from_tf(sub)
    assert not heads and not any(k.startswith(("mlm.", "nsp.", "bert.")) for k in sd)
    model = Bert(config).eval()
    model.load_state_dict(sd, strict=True)
    _, inputs = _bert_inputs()
    with torch.no_grad():
        assert torch.equal(model(*inputs)[0], full.bert(*inputs)[0])


def test_convert_to_hf_loads_in_transformers(tmp_path):
    import transformers
    from duolm import cli

    assert cli.main(["convert", str(FIX / "gpt2"), str(tmp_path / "gpt2"), "--to", "hf"]) in (0, None)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval()
    exp = np.load(FIX / "gpt2" / "expected.npz")
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.from_numpy(exp["idx"])).logits.numpy(), exp["logits"], atol=ATOL, rtol=0)
    assert cli.main(["convert", str(FIX / "bert"), str(tmp_path / "bert"), "--to", "hf"]) in (0, None)
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "bert").eval()
    exp, (idx, seg, mask) = _bert_inputs()
    with torch.no_grad():
        out = hf(idx, token_type_ids=seg, attention_mask=mask)
    np.testing.assert_allclose(out.seq_relationship_logits.numpy(), exp["nsp_logits"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out.prediction_logits.numpy(), exp["mlm_logits"], atol=ATOL, rtol=0)


# --- checkpoints TensorFlow did not write (tests/tf_bundle.py) -------------------------------------

def _rewrite(prefix: Path, tensors: dict) -> Path:
    """`tensors` as a one-shard bundle in a new folder beside prefix's, with its config and vocab files."""
    src = prefix.parent
    out = src.parent / (src.name + "-rewritten")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json" or f.name == "vocab.txt":
            shutil.copy(f, out / f.name)
    write_bundle(out / prefix.name, tensors)
    return out


def test_the_test_writer_round_trips(copy):
    ckpt = tf.read_checkpoint(FIX / "dtypes" / "dtypes.ckpt")
    d = _rewrite(copy("dtypes") / "dtypes.ckpt", {n: ckpt[n] for n in ckpt})
    back = tf.read_checkpoint(d / "dtypes.ckpt")
    assert sorted(back) == sorted(ckpt)
    assert all(back[n].dtype == ckpt[n].dtype and back[n].tobytes() == ckpt[n].tobytes() for n in ckpt)


# --- name tables: every tensor used once, every shape checked -------------------------------------

def test_unused_and_missing_tensors_are_named(copy):
    d = copy("gpt2")
    ckpt = tf.read_checkpoint(d / "model.ckpt")
    t = {n: ckpt[n] for n in ckpt}
    extra = _rewrite(d / "model.ckpt", {**t, "model/h0/attn/extra": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"model\.ckpt\.index: .*unused tensors \['model/h0/attn/extra'\]"):
        tf.gpt2_from_tf(extra)
    missing = _rewrite(d / "model.ckpt", {n: v for n, v in t.items() if n != "model/h1/ln_2/b"})
    with pytest.raises(ValueError, match=r"missing tensors \['model/h1/ln_2/b'\]"):
        tf.gpt2_from_tf(missing)
    slots = _rewrite(d / "model.ckpt", {**t, "model/wte/adam_m": t["model/wte"], "global_step": np.int64(7)})
    assert tf.gpt2_from_tf(slots)[1].keys() == tf.gpt2_from_tf(d)[1].keys()


def test_shapes_and_dtypes_are_checked_against_the_config(copy):
    d = copy("gpt2")
    hp = json.loads((d / "hparams.json").read_text())
    (d / "hparams.json").write_text(json.dumps({**hp, "n_embd": 40, "n_head": 4}))
    with pytest.raises(ValueError, match=r"tensor 'model/wte' has shape \[267, 32\]; the config needs \[267, 40\]"):
        tf.gpt2_from_tf(d)
    (d / "hparams.json").write_text(json.dumps({**hp, "n_layer": 3}))
    with pytest.raises(ValueError, match=r"holds 2 layers, but hparams.json says 3"):
        tf.gpt2_from_tf(d)
    (d / "hparams.json").write_text(json.dumps({**hp, "n_ctx": 1.5}))
    with pytest.raises(ValueError, match=r"hparams.json: block_size=1.5 must be an integer"):
        tf.gpt2_from_tf(d)
    (d / "hparams.json").write_text(json.dumps({**hp, "n_positions": 16}))
    with pytest.raises(ValueError, match=r"hparams.json: expected exactly the keys"):
        tf.gpt2_from_tf(d)
    ckpt = tf.read_checkpoint(d / "model.ckpt")
    (d / "hparams.json").write_text(json.dumps(hp))
    ints = _rewrite(d / "model.ckpt", {n: ckpt[n].astype(np.int32) if n == "model/ln_f/b" else ckpt[n] for n in ckpt})
    with pytest.raises(ValueError, match=r"tensor 'model/ln_f/b' has dtype int32"):
        tf.gpt2_from_tf(ints)


def test_bert_config_errors_name_the_file(copy):
    d = copy("bert")
    cfg = json.loads((d / "bert_config.json").read_text())
    (d / "bert_config.json").write_text(json.dumps({**cfg, "hidden_act": "relu"}))
    with pytest.raises(ValueError, match=r"bert_config.json: .*hidden_act='relu'"):
        tf.bert_from_tf(d)
    (d / "bert_config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    with pytest.raises(ValueError, match=r"'bert/encoder/layer_0/intermediate/dense/kernel' has shape \[32, 48\]; "
                                         r"the config needs \[32, 64\]"):
        tf.bert_from_tf(d)
    (d / "bert_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"bert_config.json: not valid JSON"):
        duolm.load(d)


# --- damaged files: clear errors naming the file and the tensor -----------------------------------

def test_index_without_data(copy):
    d = copy("gpt2")
    (d / "model.ckpt.data-00000-of-00001").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.ckpt\.data-00000-of-00001: missing .*'model/h0/attn/"):
        tf.read_checkpoint(d / "model.ckpt")


def test_wrong_shard_count(copy):
    d = copy("bert")
    for i in range(3):
        (d / f"bert_model.ckpt.data-0000{i}-of-00003").rename(d / f"bert_model.ckpt.data-0000{i}-of-00004")
    with pytest.raises(ValueError, match=r"bert_model\.ckpt\.index: says 3 shards, but bert_model\.ckpt\.data-00000-"
                                         r"of-00003 is missing .*different saves"):
        duolm.load(d)


def test_bad_tensor_checksum(copy):
    d = copy("bert")
    ckpt = tf.read_checkpoint(d / "bert_model.ckpt")
    name = "bert/encoder/layer_1/output/dense/kernel"
    e = ckpt.entries[name]
    f = d / f"bert_model.ckpt.data-0000{e.shard}-of-00003"
    _flip(f, e.offset + e.size - 1)   # one bit of the tensor's last byte
    with pytest.raises(ValueError, match=rf"{f.name}: tensor '{name}': checksum mismatch"):
        tf.bert_from_tf(d)


def test_bad_index_block_checksum(copy):
    d = copy("gpt2")
    _flip(d / "model.ckpt.index", 20)
    with pytest.raises(ValueError, match=r"model\.ckpt\.index: block at offset 0: checksum mismatch"):
        tf.gpt2_from_tf(d)


def test_tensor_running_past_its_shard(copy):
    d = copy("gpt2")
    f = d / "model.ckpt.data-00000-of-00001"
    ckpt = tf.read_checkpoint(d / "model.ckpt")
    last = max(ckpt.entries, key=lambda n: ckpt.entries[n].offset)
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ValueError, match=rf"{f.name}: tensor '{last}' .*runs past the end of the file"):
        tf.read_checkpoint(d / "model.ckpt")


@pytest.mark.parametrize("keep", [0, 10, 47, 300])
def test_truncated_index(copy, keep):
    d = copy("gpt2")
    f = d / "model.ckpt.index"
    f.write_bytes(f.read_bytes()[:keep])
    with pytest.raises(ValueError, match=r"model\.ckpt\.index: not a TensorFlow checkpoint index"):
        tf.read_checkpoint(d / "model.ckpt")


def test_folder_with_two_checkpoints_uses_the_checkpoint_file(copy):
    d = copy("gpt2")
    for f in list(d.glob("model.ckpt.*")):
        shutil.copy(f, d / f.name.replace("model.ckpt", "model-old.ckpt"))
    assert tf.find_prefix(d) == d / "model.ckpt"
    (d / "checkpoint").unlink()
    with pytest.raises(FileNotFoundError, match=r"expected one TensorFlow checkpoint .*model-old.ckpt.index"):
        tf.find_prefix(d)


# --- mutation fuzz (the full 10,000 cases: python tests/tf_fuzz.py) -------------------------------

def test_mutation_fuzz_gives_only_clear_errors(tmp_path):
    import tf_fuzz

    stats = tf_fuzz.run(cases=100, seed=1234, workdir=tmp_path)
    assert stats["cases"] == 100
    assert stats["failures"] == []
    assert stats["errors"] > 0
