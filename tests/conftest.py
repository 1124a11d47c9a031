import os
import sys


def _import_triton_interpreted() -> None:
    """Without CUDA, import triton once with TRITON_INTERPRET=1 (its own library functions are
    decorated at import), then put the variable back: every module's TRITON cases can then run in
    this process under the interpreter (tests set the variable around them), whichever module
    imports torch or jagged_sdpa first, while automatic selection keeps seeing TRITON ineligible on
    the CPU. With CUDA, triton stays compiled."""
    if os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        return  # a GPU machine (decided without importing torch, which would import triton compiled)
    had = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    finally:
        if had is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = had


_import_triton_interpreted()

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

