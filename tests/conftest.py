import os
import sys


sys.path.insert(0, os.path.dirname(__file__))
from support.triton_interpreter import interpreter_env  # noqa: E402


def _import_triton_interpreted() -> None:
    """Without a GPU, import triton interpreted once, before any test module (or torch) can import
    it compiled: every module's TRITON cases then run in this process. With a GPU, it stays compiled
    (decided without importing torch, which would import triton)."""
    if os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        return
    with interpreter_env():
        try:
            import triton  # noqa: F401
        except ImportError:
            pass


_import_triton_interpreted()

import pytest  # noqa: E402
import torch  # noqa: E402


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

