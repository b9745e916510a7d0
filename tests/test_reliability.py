"""Bad input and hard stops: malicious and malformed files, a full disk, typed special tokens, every CLI
subcommand against bad input (one line naming the file or the argument, never a traceback)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import resource
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import duolm
from duolm.checkpoint import check_safetensors_header
from duolm.cli import main
from duolm.models import GPT2, BertConfig, BertForPreTraining, GPT2Config
from duolm.runs import LOCK
from duolm.tokenizers import ByteLevelBPE, WordPiece

ROOT = Path(__file__).resolve().parents[1]
TEXT = "the king and queen of a small land said that all men must go to sea when winter comes. " * 40


class Exec:
    """A pickle that would run code when loaded."""

    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('x')",))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    bpe = ByteLevelBPE.train([TEXT], vocab_size=300)
    torch.manual_seed(0)
    duolm.save(GPT2(GPT2Config.preset("tiny", vocab_size=bpe.vocab_size)), root / "gpt2", tokenizer=bpe)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(TEXT.replace(".", " .").split()))
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    wp = WordPiece.from_vocab(root / "vocab.txt", lowercase=True)
    duolm.save(BertForPreTraining(BertConfig.preset("tiny", vocab_size=wp.vocab_size)), root / "bert", tokenizer=wp)
    return root


def _fails(argv, capsys, *named):
    """The command exits non-zero without a traceback; its last line (argparse prints its usage above it)
    is one error line naming every string in `named`."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code not in (0, None), err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "error" in last, err
    for n in named:
        assert str(n) in last, (n, err)
    return last


# --- issue: a malicious train_state.pt ---------------------------------------------------------------

def test_malicious_train_state_is_refused_in_one_line(tmp_path):
    from duolm.train import save_checkpoint

    model = GPT2(GPT2Config.preset("tiny"))
    save_checkpoint(tmp_path / "run", 2, model, {"step": 2})
    state = tmp_path / "run" / "ckpt-00000002" / "train_state.pt"
    torch.save({"step": 2, "payload": Exec()}, state)
    code = ("import sys; from duolm.train import load_train_state; from duolm.models import GPT2, GPT2Config\n"
            f"load_train_state({str(tmp_path / 'run')!r}, GPT2(GPT2Config.preset('tiny')))")
    env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode != 0 and not (tmp_path / "PWNED").exists()
    last = p.stderr.strip().splitlines()[-1]
    assert f"{state}: refused as unsafe" in last and "weights_only=False" not in p.stderr


def test_sharded_checkpoint_pickles_are_refused(tmp_path, capsys):
    """A sharded checkpoint (DCP) reads back whole in one process, model and optimizer; DCP pickles its .metadata
    and its non-tensor values: a .metadata that would run code, or an optimizer value that would, is refused in
    one line, nothing run."""
    import pickle

    from duolm.train.optim import make_optimizer
    from duolm.train.parallel import load_shards, save_shards

    model = GPT2(GPT2Config.preset("tiny"))
    adamw = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    model(torch.randint(0, 100, (2, 8))).sum().backward()
    adamw.step()
    duolm.save(model, tmp_path / "ckpt", weights=False)
    save_shards(model, adamw, tmp_path / "ckpt" / "shards")
    loaded, _ = duolm.load(tmp_path / "ckpt")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    again = GPT2(GPT2Config.preset("tiny"))
    adamw_again = make_optimizer(again, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    load_shards(again, adamw_again, tmp_path / "ckpt" / "shards")
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p, q) and all(torch.equal(adamw.state[p][k], adamw_again.state[q][k]) for k in adamw.state[p])
    metadata = tmp_path / "ckpt" / "shards" / ".metadata"
    good = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(Exec()))
    _fails(["convert", tmp_path / "ckpt", tmp_path / "out"], capsys, f"{metadata}: refused as unsafe")
    metadata.write_bytes(good)
    # an optimizer hyperparameter that would run code, as DCP would store it (torch.save of the value)
    adamw.param_groups[0]["eps"] = Exec()
    save_shards(model, adamw, tmp_path / "evil")
    with pytest.raises(ValueError, match="refused as unsafe"):
        load_shards(again, adamw_again, tmp_path / "evil")
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


# --- issue: safetensors headers ------------------------------------------------------------------

def _safetensors(path: Path, header: bytes, body: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)
    return path


def test_duplicate_safetensors_keys_are_refused(tmp_path, models):
    entry = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    f = _safetensors(tmp_path / "dup.safetensors", f'{{"a":{entry},"a":{entry}}}'.encode(), b"\0" * 4)
    with pytest.raises(ValueError, match=r"dup\.safetensors.*'a' twice"):
        check_safetensors_header(f)
    many = "{" + ",".join(f'"t{i}":{entry}' for i in range(100_001)) + "}"
    with pytest.raises(ValueError, match="100001 entries, over the limit"):
        check_safetensors_header(_safetensors(tmp_path / "many.safetensors", many.encode(), b"\0" * 4))
    # through a whole model directory, and the CLI
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((models / "gpt2" / "config.json").read_text())
    _safetensors(d / "model.safetensors", f'{{"wte.weight":{entry},"wte.weight":{entry}}}'.encode(), b"\0" * 4)
    with pytest.raises(ValueError, match="'wte.weight' twice"):
        duolm.load(d)


def test_safetensors_header_fuzz_gives_clear_errors_fast(models, tmp_path):
    """3,000 mutations of a real file's header: each read is a ValueError naming the file (or a valid
    load), none slower than a second."""
    good = (models / "gpt2" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    rng = random.Random(0)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((models / "gpt2" / "config.json").read_text())
    outcomes = {"error": 0, "loaded": 0}
    for i in range(3000):
        b = bytearray(good)
        kind = i % 4
        if kind == 0:                                   # flip bytes inside the header
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(8, 8 + n)] = rng.randrange(256)
        elif kind == 1:                                 # a wrong header length
            b[:8] = struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, len(good), 2 ** 63, rng.randrange(2 ** 64)]))
        elif kind == 2:                                 # truncated anywhere
            b = b[:rng.randrange(len(b))]
        else:                                           # digits changed (shapes, offsets)
            digits = [j for j in range(8, 8 + n) if chr(b[j]).isdigit()]
            for j in rng.sample(digits, 2):
                b[j] = ord(str(rng.randrange(10)))
        (d / "model.safetensors").write_bytes(bytes(b))
        try:
            duolm.load(d)
            outcomes["loaded"] += 1
        except ValueError as e:
            assert "model.safetensors" in str(e), str(e)
            outcomes["error"] += 1
    assert outcomes["error"] > 2500


# --- issue: a full disk during a checkpoint ----------------------------------------------------------

def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))     # any write past 400 kB fails
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)                     # ... with an OSError, not a signal


def test_a_full_disk_during_a_checkpoint_gives_one_line_and_no_temp_files(tmp_path):
    """The first checkpoint fits; a bigger model's checkpoint does not: one line, the last complete checkpoint
    named, no temp file left, and that checkpoint still loads."""
    from duolm.data import prepare

    (tmp_path / "c.txt").write_text(TEXT.replace(". ", ".\n") * 5)
    prepare([tmp_path / "c.txt"], ByteLevelBPE.train([TEXT], vocab_size=300), tmp_path / "d", val_fraction=0.2,
            chunk_chars=2000)
    run = tmp_path / "run"
    base = [sys.executable, "-m", "duolm", "pretrain", "gpt2", "--data", tmp_path / "d", "-o", run, "--quiet",
            "--block-size", "16", "--batch-size", "2", "--max-steps", "2", "--eval-every", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([str(a) for a in base], check=True, env=env, capture_output=True)
    p = subprocess.run([str(a) for a in base + ["--max-steps", "4", "--resume", "--n-embd", "64", "--n-layer", "2"]],
                       env=env, capture_output=True, text=True, preexec_fn=_limit_file_size)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert err[-1] == (f"duolm: error: could not write {run / 'ckpt-00000004'} (File too large); "
                       f"the last complete checkpoint is ckpt-00000002"), err
    leftovers = [q.name for q in run.rglob("*") if (q.name.startswith(".") or q.name.endswith(".tmp"))
                 and q.name != LOCK]                            # (the writer's lock file stays)
    assert leftovers == []
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 2
    duolm.load(run)
    # space freed (no limit): --resume goes on from the last complete checkpoint
    subprocess.run([str(a) for a in base + ["--max-steps", "4", "--resume", "--n-embd", "64", "--n-layer", "2"]],
                   check=True, env=env, capture_output=True)
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 4


def test_the_os_reason_is_found_behind_library_errors():
    """torch.save and safetensors wrap a failed write in their own errors (these are the ones they raise under
    RLIMIT_FSIZE); the reason is found behind them, and a WriteError passed on keeps it."""
    from safetensors import SafetensorError

    from duolm.fileio import write_error

    try:
        try:
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:
        torch_err = write_error("/r/train_state.pt", e)
    assert (torch_err.errno, str(torch_err)) == (errno.EFBIG, "could not write /r/train_state.pt (File too large)")
    st = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert str(write_error("/r/model.safetensors", st)) == "could not write /r/model.safetensors (No space left on device)"
    passed_on = write_error("/r/ckpt-00000004", torch_err, "the last complete checkpoint is ckpt-00000002")
    assert str(passed_on) == "could not write /r/ckpt-00000004 (File too large); the last complete checkpoint is ckpt-00000002"
    assert str(write_error("/x", RuntimeError("no OS error"))) == "could not write /x (no OS error)"


@contextlib.contextmanager
def _tmpfs(where: Path, options: str):
    """A tmpfs mounted at `where` for the test's length: a real full or read-only file system, which root cannot
    write past (chmod does not stop root). Mounting needs root with CAP_SYS_ADMIN; without it the test is skipped,
    saying why."""
    where.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _no_temp_files(folder: Path):
    assert [q.name for q in folder.rglob("*") if q.name.startswith(".") or q.name.endswith(".tmp")] == []


def test_a_full_file_system_says_no_space_left(models, tmp_path, capsys):
    """A 64 kB tmpfs: the model's weights do not fit; the line names the file and the OS's reason."""
    with _tmpfs(tmp_path / "small", "size=64k") as small:
        _fails(["convert", models / "gpt2", small / "o"], capsys,
               f"could not write {small / 'o' / 'model.safetensors'} (No space left on device)")
        _no_temp_files(small)


def _writers(models, tmp_path, out: Path) -> list[list]:
    """Subcommands that write into `out`, each with its input ready."""
    from duolm.data import prepare

    (tmp_path / "c.txt").write_text(TEXT.replace(". ", ".\n") * 5)
    if not (tmp_path / "d").exists():
        prepare([tmp_path / "c.txt"], duolm.load(models / "gpt2")[1], tmp_path / "d", val_fraction=0.2,
                chunk_chars=2000)
    return [["tokenizer", "train", "--kind", "bpe", "--vocab-size", "300", tmp_path / "c.txt", "-o", out],
            ["convert", models / "gpt2", out],
            ["prepare", tmp_path / "c.txt", "--tokenizer", models / "gpt2", "-o", out, "--quiet", "--workers", "1",
             "--val-fraction", "0"],
            ["pretrain", "gpt2", "--data", tmp_path / "d", "-o", out, "--quiet", "--max-steps", "1",
             "--block-size", "16", "--batch-size", "2", "--eval-every", "0"]]


def test_an_unwritable_output_names_the_os_reason_and_the_path(models, tmp_path, capsys):
    """Root writes through a chmod-ed folder, so the unwritable outputs are ones root cannot bypass: a path under a
    regular file (mkdir fails: "Not a directory") and, where a tmpfs can be mounted, a read-only file system (the
    folder exists, the first file write fails: "Read-only file system")."""
    (tmp_path / "file").write_text("x")
    under_file = tmp_path / "file" / "out"
    for argv in _writers(models, tmp_path, under_file):
        _fails(argv, capsys, under_file, "Not a directory")
    if os.geteuid() != 0:       # not root: a folder without write permission is unwritable
        (tmp_path / "ro").mkdir(mode=0o555)
        for argv in _writers(models, tmp_path, tmp_path / "ro"):
            _fails(argv, capsys, tmp_path / "ro", "Permission denied")
        return
    with _tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        for argv in _writers(models, tmp_path, ro):
            _fails(argv, capsys, ro, "Read-only file system")


# --- issue: typed special tokens are text -------------------------------------------------------------

def test_typed_special_tokens_are_text(models, capsys):
    main(["tokenizer", "encode", str(models / "gpt2"), "Hello<|endoftext|>World"])
    out = capsys.readouterr().out
    eot = duolm.load(models / "gpt2")[1].eot_id
    assert f" {eot}," not in out and f"[{eot}," not in out and "plain text" in out
    main(["tokenizer", "encode", str(models / "gpt2"), "Hello<|endoftext|>World", "--allow-special"])
    assert f"{eot}" in capsys.readouterr().out.split("pieces")[0]
    from duolm.textgen import generate_text

    model, tok = duolm.load(models / "gpt2")
    gen = generate_text(model, tok, "<|endoftext|>", 1, temperature=0)
    list(gen)
    assert gen.prompt_ids == tok.encode("<|endoftext|>", disallowed_special=()) and eot not in gen.prompt_ids
    gen = generate_text(model, tok, "<|endoftext|>", 1, temperature=0, allow_special=True)
    list(gen)
    assert gen.prompt_ids == [eot]


# --- issue: bounded config sizes, named files ---------------------------------------------------------

def test_unreasonable_config_sizes_and_garbage_json_name_the_file(models, tmp_path):
    import shutil

    d = tmp_path / "huge"
    shutil.copytree(models / "gpt2", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["config"]["vocab_size"] = 2 ** 40
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"{d / 'config.json'}.*vocab_size={2 ** 40} must be an integer in \[1, "):
        duolm.load(d)
    for name in ("config.json", "checkpoint.json"):
        g = tmp_path / ("garbage-" + name)
        g.mkdir()
        (g / name).write_text("{not json")
        with pytest.raises(ValueError, match=rf"{g / name}: not valid JSON"):
            duolm.load(g)
    from duolm.data import load_meta

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'data' / 'meta.json'}: not valid JSON"):
        load_meta(tmp_path / "data")


# --- every subcommand against bad input ---------------------------------------------------------------

def test_every_subcommand_fails_cleanly_on_bad_input(models, tmp_path, capsys):
    missing = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.mkdir()
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2,
                                                     "vocab_size": 10, "n_positions": 8}))
    torch.save({"x": Exec()}, bin_dir / "pytorch_model.bin")
    bad_run = tmp_path / "run"
    bad_run.mkdir()
    (bad_run / "checkpoint.json").write_text('{"latest": "../../etc", "checkpoints": []}')
    cases = [
        (["tokenizer", "encode", missing, "hi"], [missing]),
        (["tokenizer", "encode", empty, "hi"], [empty, "duolm tokenizer train"]),
        (["tokenizer", "train", "--kind", "bpe", "--vocab-size", "300", missing, "-o", tmp_path / "t"], [missing]),
        (["tokenizer", "train", "--kind", "wordpiece", "--vocab-size", "x", latin1, "-o", tmp_path / "t"],
         ["--vocab-size"]),
        (["convert", missing, tmp_path / "o"], [missing]),
        (["convert", empty, tmp_path / "o"], [empty / "config.json"]),
        (["convert", bin_dir, tmp_path / "o"], [bin_dir / "pytorch_model.bin", "refused as unsafe"]),
        (["convert", bad_run, tmp_path / "o"], [bad_run / "checkpoint.json", "outside"]),
        (["convert", models / "gpt2", tmp_path / "o", "--to", "tf"], ["--to"]),
        (["prepare", latin1, "--tokenizer", models / "gpt2", "-o", tmp_path / "p"], [latin1, "UTF-8"]),
        (["prepare", missing, "--tokenizer", models / "gpt2", "-o", tmp_path / "p"], [missing]),
        (["prepare", latin1, "--tokenizer", missing, "-o", tmp_path / "p"], [missing]),
        (["pretrain", "gpt2", "--data", missing, "-o", tmp_path / "r"], [missing / "meta.json"]),
        (["pretrain", "gpt2", "--data", empty, "-o", tmp_path / "r", "--batch-size", "0"], ["batch_size=0"]),
        (["pretrain", "gpt2", "--data", empty, "-o", tmp_path / "r", "--decay", "exp"], ["--decay"]),
        (["pretrain", "gpt3", "--data", empty, "-o", tmp_path / "r"], ["gpt3"]),
        (["generate", models / "bert", "hello"], ["GPT-2"]),
        (["generate", models / "gpt2", "hello", "--max-new-tokens", "-1"], ["max_new_tokens (-1)"]),
        (["generate", models / "gpt2", "hello " * 100], ["context window is 64", "truncate"]),
        (["generate", models / "gpt2", "hello", "--top-p", "1.5"], ["top_p"]),
        (["fill-mask", models / "gpt2", "a [MASK]"], ["masked-LM head"]),
        (["fill-mask", models / "bert", "no mask here"], ["[MASK]"]),
        (["demo", "--text", missing, "-o", tmp_path / "demo"], [missing]),
        (["finetune", models / "bert", "--task", "sst3", "--data", empty, "-o", tmp_path / "f"], ["sst3"]),
        (["finetune", missing, "--task", "sst2", "--data", empty, "-o", tmp_path / "f"], [missing]),
        (["finetune", models / "bert", "--task", "sst2", "--data", empty, "-o", tmp_path / "f"], [empty]),
        (["predict", missing, "some text"], [missing]),
        (["predict", models / "bert", "some text"], ["head"]),
        (["evaluate", missing, "--data", empty], [missing]),
        (["eval", models / "gpt2", "--task", "wikitext2", "--data", missing], [missing]),
        (["eval", models / "bert", "--task", "wikitext2", "--data", latin1], ["GPT-2"]),
        (["eval", models / "gpt2", "--task", "wikitext9", "--data", latin1], ["--task"]),
        (["serve", missing], [missing]),
        (["serve", models / "gpt2", "--port", "x"], ["--port"]),
    ]
    for argv, named in cases:
        _fails(argv, capsys, *named)
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()
