"""Imports point down only. Every module of the package is read (its imports, module-level and inside
functions alike) and placed on a layer; an import must point to a lower layer or stay inside its own
package, and the import graph must have no cycle. Then the runtime rules: the tokenizers work without
torch, and the package never imports the reference libraries the tests compare against."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# top-level part of duolm -> layer (DESIGN's layers, numbered finer: cli wires the demo and the server)
LAYERS = {
    "duolm.fileio": 0, "duolm.config": 0, "duolm.metrics": 0, "duolm.malloc": 0, "duolm.kernels": 0,
    "duolm.tokenizers": 1, "duolm.models": 1, "duolm.runs": 1, "duolm.hub": 1, "duolm.objectives": 1,
    "duolm.engines": 1,
    "duolm.convert": 2, "duolm.data": 2, "duolm.generation": 2, "duolm.precision": 2, "duolm.dcp": 2,
    "duolm.checkpoint": 3, "duolm.textgen": 3,
    "duolm.tasks": 4, "duolm.evaluation": 4,
    "duolm.train": 5,
    "duolm.demo": 6, "duolm.serve": 6, "duolm.cli": 7, "duolm.__main__": 8,
}
REFERENCES = ["transformers", "tokenizers", "tiktoken", "sentence_transformers", "sklearn", "seqeval", "openai"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "duolm").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """duolm modules imported anywhere in the file (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    modules = _modules()
    return {m for m in found if m in modules and m != name}


def _part(module: str) -> str:
    return next(p for p in sorted(LAYERS, key=len, reverse=True) if module == p or module.startswith(p + "."))


def test_every_module_has_a_layer():
    assert [m for m in _modules() if m != "duolm" and not any(m == p or m.startswith(p + ".") for p in LAYERS)] == []


def _upward_imports() -> list[str]:
    bad = []
    for name, path in _modules().items():
        if name == "duolm":          # the lazy public API names what it re-exports; it imports nothing eagerly
            continue
        for dep in _imports(name, path):
            if dep == "duolm" or _part(dep) == _part(name):
                continue
            if LAYERS[_part(dep)] >= LAYERS[_part(name)]:
                bad.append(f"{name} (L{LAYERS[_part(name)]}) imports {dep} (L{LAYERS[_part(dep)]})")
    return bad


def test_imports_point_down():
    assert _upward_imports() == []


def test_models_import_torch_only_and_probe_no_cpu():
    """The model files read as the papers: no module of duolm.models imports duolm's kernels or engines, nor reads
    the CPU's flags; a fast path arrives by a visible swap (duolm.precision.quantize)."""
    models = {name: path for name, path in _modules().items() if name.startswith("duolm.models")}
    assert models
    for name, path in models.items():
        duolm = {d for d in _imports(name, path) if d == "duolm" or d.startswith("duolm.")}
        assert all(d.startswith("duolm.models") for d in duolm), (name, duolm)
        text = path.read_text(encoding="utf-8")
        assert not any(probe in text for probe in ("cpuinfo", "avx", "get_cpu_capability", "kernels.")), path


def _cycles() -> list[list[str]]:
    graph = {name: _imports(name, path) for name, path in _modules().items() if name != "duolm"}
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = "open"
        for d in sorted(graph.get(n, ())):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    # inside one package (its __init__ re-exporting its own submodules) a loop is harmless
    return [c for c in cycles if len({_part(m) for m in c}) > 1]


def test_no_import_cycles():
    assert _cycles() == []


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / "duolm"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("from duolm.cli import main\n")
    (pkg / "cli.py").write_text("def main():\n    from duolm.demo import run\n")
    (pkg / "demo.py").write_text("def run():\n    from duolm.cli import main\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert "duolm.models (L1) imports duolm.cli (L7)" in _upward_imports()
    assert _cycles() == [["duolm.cli", "duolm.demo", "duolm.cli"]]


# "Small and elegant": no function over 80 lines, no module over 500.
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 500


def _oversized() -> list[str]:
    """"path: N lines" for each module, and "path::qualified.name: N lines" for each function (methods and
    nested functions included, decorators not), over its limit."""
    out = []
    for path in sorted((SRC / "duolm").rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_MODULE_LINES:
            out.append(f"{rel}: {len(text.splitlines())} lines")
        stack: list[tuple[str, ast.AST]] = [("", ast.parse(text))]
        while stack:
            prefix, node = stack.pop()
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = prefix + child.name
                    n = child.end_lineno - child.lineno + 1
                    if not isinstance(child, ast.ClassDef) and n > MAX_FUNCTION_LINES:
                        out.append(f"{rel}::{name}: {n} lines")
                    name += "."
                stack.append((name, child))
    return sorted(out)


def test_functions_and_modules_are_small():
    assert _oversized() == []


def test_the_size_checker_sees_a_long_method_and_a_long_module(tmp_path, monkeypatch):
    pkg = tmp_path / "duolm"
    pkg.mkdir()
    long = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))        # A.f: 81 lines with its def
    at_limit = "".join(f"    y{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))    # g: 80 lines
    (pkg / "a.py").write_text("class A:\n    def f(self):\n" + long + "\n\ndef g():\n" + at_limit)
    (pkg / "b.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert _oversized() == ["duolm/a.py::A.f: 81 lines", "duolm/b.py: 501 lines"]


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nprint('\\n'.join(sys.modules))"], capture_output=True,
                         text=True, check=True).stdout.split()
    return set(out)


def test_tokenizers_need_no_torch():
    loaded = _loaded_after("import sys, duolm, duolm.tokenizers")
    assert not {"torch", "numpy"} & loaded


def test_package_never_imports_the_references():
    names = [m for m in _modules() if not m.startswith("duolm.serve") and m != "duolm.__main__"]
    loaded = _loaded_after("import sys, importlib\n" + "\n".join(f"importlib.import_module({m!r})" for m in names))
    assert [r for r in REFERENCES if r in loaded] == []


def _closure(start: set[str]) -> set[str]:
    """Every duolm module that `start` imports, directly or through other modules (packages' __init__ included)."""
    modules, seen, todo = _modules(), set(), list(start)
    while todo:
        m = todo.pop()
        if m in seen or m not in modules:
            continue
        seen.add(m)
        todo += _imports(m, modules[m]) | ({m.rpartition(".")[0]} if "." in m else set())
    return seen


def _function_imports(path: Path, names: set[str]) -> set[str]:
    """duolm modules imported inside the named functions of a file."""
    found = set()
    for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(fn, ast.FunctionDef) and fn.name in names:
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in _modules()}


def test_serving_prediction_and_evaluation_need_no_training_code():
    serve = {m for m in _modules() if m.startswith("duolm.serve")}
    cli = _function_imports(SRC / "duolm" / "cli" / "tasks.py", {"cmd_predict", "cmd_evaluate"})
    assert cli and serve
    assert sorted(m for m in _closure(serve | cli) if m.startswith("duolm.train")) == []
    assert "duolm.train.finetune" in _closure(_function_imports(SRC / "duolm" / "cli" / "tasks.py", {"cmd_finetune"}))
