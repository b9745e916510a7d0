"""README.md's fine-tuning results table and speed table, and docs/benchmarks.md's table of every speed row, are
generated from results/*.json (benchmarks/results.py): the committed tables must equal what the committed files
give, and a changed file must be caught."""
import ast
import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "results.py"


def _results_module():
    spec = importlib.util.spec_from_file_location("results_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                     # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _check(*args):
    return subprocess.run([sys.executable, str(SCRIPT), "--check", *args], capture_output=True, text=True, cwd=ROOT)


def test_the_tables_equal_the_result_files():
    out = _check()
    assert out.returncode == 0, out.stdout + out.stderr


def _record(values, lr=5e-5):
    runs = [{"run": f"lr-{lr:g}-seed-{s}", "lr": lr, "seed": s, "best_epoch": 2.0,
             "metrics": {"f1": v, "accuracy": v - 0.1}, "epochs": [], "wall_s": 100.0 + s, "load_at_start": 0.5,
             "resumed": False} for s, v in enumerate(values)]
    return {"key": "mrpc", "label": "MRPC", "grid": [lr], "epochs": 3.0, "precision": "bf16", "metric": "f1",
            "data": {"train": 3302, "dev": {"dev": 367}}, "runs": runs, "lr": lr,
            "mean": {"f1": sum(values) / len(values), "accuracy": sum(values) / len(values) - 0.1},
            "std": {"f1": 0.05, "accuracy": 0.05}}


def _copies(tmp_path):
    """The README, docs/benchmarks.md and results/ copied under tmp_path: the --check arguments that read them."""
    shutil.copytree(ROOT / "results", tmp_path / "results")
    for name in ("README.md", "benchmarks.md"):
        shutil.copy(ROOT / name if name == "README.md" else ROOT / "docs" / name, tmp_path / name)
    args = ("--readme", str(tmp_path / "README.md"), "--docs", str(tmp_path / "benchmarks.md"),
            "--results", str(tmp_path / "results"))
    assert _check(*args).returncode == 0
    return tmp_path / "results", args


def test_a_changed_result_file_fails_the_check(tmp_path):
    results, args = _copies(tmp_path)
    (results / "mrpc.json").write_text(json.dumps(_record([0.81, 0.86, 0.91])))
    out = _check(*args)
    assert out.returncode == 1 and "+| MRPC | 3,302 / 367 |" in out.stdout


def test_a_changed_speed_row_fails_the_check_of_both_tables(tmp_path):
    """A README row (gpt2-infer) re-measured on another machine: the README's and docs' tables both differ."""
    results, args = _copies(tmp_path)
    speed = json.loads((results / "speed-cpu.json").read_text())
    row = [r for r in speed["rows"] if r["key"] == "gpt2-infer"][-1]          # the newest: the README's
    row.update(ratio=1.99, date="2027-01-02", machine={**row["machine"], "cpu": "Some CPU"})
    (results / "speed-cpu.json").write_text(json.dumps(speed))
    out = _check(*args)
    assert out.returncode == 1
    changed = [line for line in out.stdout.splitlines() if line.startswith("+| GPT-2 124M inference")]
    assert len(changed) == 2 and all("1.99x" in line and "Some CPU" in line for line in changed)
    assert "2027-01-02 |" in changed[0] and "| 2027-01-02 |" in changed[1]      # README first, then docs


def test_every_speed_row_is_in_the_docs_table_and_names_its_machine_and_date():
    R = _results_module()
    rows, table = R.speed_rows(), R.speed_table().splitlines()[2:]
    assert len(table) == len(rows) and set(R.HEADLINE) <= {r["key"] for r in rows}
    for row, line in zip(rows, table):
        assert f"| {row['date']} |" in line and (row["machine"].get("gpu") or row["machine"]["cpu"]) in line


def test_gpu_rows_read_a_gpu_result_file():
    """benchmarks/gpu.py's cases (tokens/s, MFU, ratio) and the served model's figures, as speed rows."""
    R = _results_module()
    rec = {"gpu": "Some GPU", "date": "2027-01-02", "runs": {"run 3": "python benchmarks/serve.py --device cuda"},
           "cases": [{"case": "gpt2-train", "duolm_tokens_per_s": 476306.4, "transformers_tokens_per_s": 20073.9,
                      "ratio": 23.7279, "duolm_mfu": 0.49973, "transformers_mfu": 0.021}],
           "serve": {"run": "run 3", "requests": 128, "prompt_tokens_mean": 24, "new_tokens": 64,
                     "library_alone_tokens_per_s": 400.2, "duolm_serve_tokens_per_s": {"1": 276.9, "16": 1845.5},
                     "aggregate_16_vs_1": 6.67}}
    train, one, sixteen = R.gpu_rows(rec)
    assert (train["duolm"], train["reference_figure"], train["ratio"]) == \
        ("476K tokens/s, 50.0% MFU", "20.1K tokens/s, 2.1% MFU", 23.73)
    assert train["machine"] == {"gpu": "Some GPU"} and train["date"] == "2027-01-02"
    assert (one["duolm"], one["ratio"], one["reference_figure"]) == ("277 tokens/s", None, "400 tokens/s")
    assert (sixteen["duolm"], sixteen["ratio"], sixteen["reference"]) == ("1,846 tokens/s", 6.67, "1 client")
    assert sixteen["command"] == "python benchmarks/serve.py --device cuda"


def test_a_row_shows_the_mean_std_and_every_seed(tmp_path):
    R = _results_module()
    (tmp_path / "mrpc.json").write_text(json.dumps(_record([0.80, 0.85, 0.90])))
    row = next(line for line in R.table(tmp_path).splitlines() if line.startswith("| MRPC"))
    assert row == ("| MRPC | 3,302 / 367 | 3 | 5e-05 (5e-05) | F1 **85.0** ± 5.0; accuracy **75.0** ± 5.0 "
                   "| 80.0, 85.0, 90.0 | 101 s (bf16) | `mrpc` |")


def test_time_per_run_leaves_out_runs_continued_from_a_checkpoint(tmp_path):
    """A resumed run's wall time covers only its last part: the row's time per run is over whole runs."""
    R = _results_module()
    rec = _record([0.80, 0.85, 0.90])
    rec["runs"][2].update(wall_s=20.0, resumed=True)
    (tmp_path / "mrpc.json").write_text(json.dumps(rec))
    row = next(line for line in R.table(tmp_path).splitlines() if line.startswith("| MRPC"))
    assert "| 100 s (bf16) |" in row                   # (100 + 101) / 2, not (100 + 101 + 20) / 3


def test_every_benchmark_imports_names_duolm_has():
    """The benchmarks run by hand, not in the suite: a name moved inside duolm must not leave one unable to start
    (precision_quality.py once imported read_pooling from where it had gone)."""
    missing = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "duolm":
                module = importlib.import_module(node.module)
                missing += [f"{script.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing, missing
