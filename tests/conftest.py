"""Test-wide settings, made before torch or triton is imported anywhere."""
import os

# Several torch processes share 2 cores in tests: one thread each (inherited by children).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Triton kernels run on CPU through the interpreter when no GPU is present.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A CPU install without pdserve[gpu] has no triton: the tests of the Triton kernels (under the
# interpreter here) skip, saying so; every other test runs. Only an import of triton itself
# that fails while triton is absent counts: any other error stays an error.
import importlib.util  # noqa: E402

import pytest  # noqa: E402



def _triton_absent() -> bool:
    try:
        return importlib.util.find_spec("triton") is None
    except ImportError:                  # a finder that refuses it
        return True


NO_TRITON = _triton_absent()
NO_TRITON_REASON = ("triton is not installed (a CPU install without the gpu extra): the Triton "
                    "kernels' tests need it; pip install -e '.[gpu]' (or '.[dev]') runs them")


def _is_no_triton(text: str) -> bool:
    return NO_TRITON and "ModuleNotFoundError: No module named 'triton" in text


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A test module that imports a Triton kernel: skipped as a whole."""
    rep = yield
    if rep.failed and _is_no_triton(str(rep.longrepr)):
        rep.outcome, rep.longrepr, rep.result = "skipped", (str(collector.path), 0,
                                                           f"Skipped: {NO_TRITON_REASON}"), []
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that runs a Triton kernel (imported on first use): skipped."""
    rep = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    if (NO_TRITON and isinstance(exc, ModuleNotFoundError) and exc.name.split(".")[0] == "triton"
            and call.when == "call"):
        rep.outcome, rep.longrepr = "skipped", (str(item.path), item.location[1] or 0,
                                                f"Skipped: {NO_TRITON_REASON}")
    return rep


@pytest.fixture(scope="session")
def default_model_dir():
    """SmolLM2-135M-Instruct's directory (the GGUF `pdserve up` serves), fetched on first use
    as pdserve fetches it; skipped, saying why, only where that fetch cannot work."""
    from pdserve.default_model import resolve_default_model
    path = resolve_default_model()
    if path.suffix != ".gguf":
        pytest.skip("the default model could not be fetched here (see the WARNING on stderr)")
    return path.parent
