import os
import sys


sys.path.insert(0, os.path.dirname(__file__))  # the helpers: ``from support.cases import cu_of``

# Under pytest-xdist (``-n 2`` in pyproject's addopts) each worker gets one torch/OpenMP thread: two
# workers on a 2-core machine, each with two threads, would spin at OpenMP barriers. Tests that are
# about threads set their own counts (and put them back).
# Inductor's compiles likewise stay in the worker's process: its default is a pool of compile
# subprocesses per worker (each importing torch), four processes on two cores for a few small graphs.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# A test that runs pytest in a child process (a module's cases under TRITON_INTERPRET=1, the kernel
# subset on another build) runs it in that one process: the child's own workers would not see what
# the parent set up for it (e.g. the Arm build's entry points) and would load the machine twice.
os.environ["PYTEST_ADDOPTS"] = " ".join(filter(None, (os.environ.get("PYTEST_ADDOPTS"), "-n 0")))

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

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _build_the_kernel_once() -> None:
    """Under xdist every worker collects modules that load the compiled CPU kernel, so with an empty
    build cache each worker compiled it, at the same time (~45 s of CPU each, the same library).
    One worker builds it while the others wait on a lock in the cache, then load it from there."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("JAGGED_SDPA_NATIVE", "1") == "0":
        return
    try:
        import fcntl

        from jagged_sdpa.backends.cpu import native

        root = native.cache_dir()
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / ".pytest-build.lock", "w")
    except (ImportError, OSError):
        return  # each worker builds it itself, as before
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        native.library()


_build_the_kernel_once()

# Modules whose tests share an expensive build (module fixtures: tiny transformers models, the
# sanitized kernel, the Arm driver; the x86-64-v3 kernel in the build cache for the guard-page
# children): under ``--dist loadgroup`` each runs on one worker, which builds it once. (Two workers
# building one library at once would be safe, native.py installs it by atomic rename, but twice
# the work.)
_ONE_WORKER = ("integrations/test_transformers", "safety/test_sanitizers.py", "safety/test_guard_pages.py",
               "backends/cpu/test_arm_build.py")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::")[0]
        if any(part in path for part in _ONE_WORKER):
            item.add_marker(pytest.mark.xdist_group(path))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # not keywords: a "cuda" folder is one
            item.add_marker(skip)
