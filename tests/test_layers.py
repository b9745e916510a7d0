"""Imports point down only: each module, imported alone in a fresh interpreter, pulls in nothing above it."""
import subprocess
import sys

import pytest

# module -> modules it must not pull in
FORBIDDEN = {
    "duolm.tokenizers": ["torch", "numpy", "duolm.models", "duolm.checkpoint", "duolm.cli"],
    "duolm.models": ["duolm.tokenizers", "duolm.checkpoint", "duolm.data", "duolm.train", "duolm.cli"],
    "duolm.convert": ["duolm.tokenizers", "duolm.checkpoint", "duolm.train", "duolm.cli"],
    "duolm.generation": ["duolm.tokenizers", "duolm.checkpoint", "duolm.data", "duolm.train", "duolm.cli"],
    "duolm.quant": ["duolm.tokenizers", "duolm.checkpoint", "duolm.data", "duolm.train", "duolm.cli"],
    "duolm.data": ["duolm.models", "duolm.checkpoint", "duolm.generation", "duolm.train", "duolm.cli"],
    "duolm.checkpoint": ["duolm.data", "duolm.generation", "duolm.train", "duolm.cli"],
    "duolm.train": ["duolm.cli"],
}
# the references are test-only: the package never imports them
REFERENCES = ["transformers", "tokenizers", "tiktoken"]


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_module_imports_nothing_above_it(module):
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        "print('\\n'.join(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    loaded = set(out)
    bad = [m for m in FORBIDDEN[module] + REFERENCES if m in loaded]
    assert not bad, f"{module} pulls in {bad}"


def test_cli_imports_no_reference_library():
    code = "import sys, duolm.cli; print('\\n'.join(sys.modules))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert not [m for m in REFERENCES if m in loaded]
