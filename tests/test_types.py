"""The type checker: mypy over the files pyproject.toml's [tool.mypy] names (the typed seams: tasks, tokenizers,
models, precision), in a subprocess, as `python -m mypy` runs it from the checkout."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_type_errors():
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
