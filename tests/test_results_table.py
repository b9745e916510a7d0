"""README.md's fine-tuning results table is generated from results/*.json (benchmarks/results.py): the committed
table must equal what the committed files give, and a changed file must be caught."""
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


def test_readme_table_equals_the_result_files():
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


def test_a_changed_result_file_fails_the_check(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "results", results) if (ROOT / "results").is_dir() else results.mkdir()
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    assert _check("--readme", str(readme), "--results", str(results)).returncode == 0
    (results / "mrpc.json").write_text(json.dumps(_record([0.81, 0.86, 0.91])))
    out = _check("--readme", str(readme), "--results", str(results))
    assert out.returncode == 1 and "+| MRPC | 3,302 / 367 |" in out.stdout


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
