"""The compiled CPU kernel built with AddressSanitizer + UndefinedBehaviorSanitizer
(``JAGGED_SDPA_SANITIZE=address,undefined``: ``-fsanitize=address,undefined -fno-omit-frame-pointer
-fno-sanitize-recover=all -g``, a library of its own in the build cache), run over every kernel
path (``kernel_workload.py``: forward tiles, decode rows, windows past the keys, the issue-11
repros, NaN rows, backward, paged forward and backward (shared blocks); fp32/fp16/bf16; two work
splits).

Why a child python: an ASan library only loads into a process that starts with the ASan runtime
(``LD_PRELOAD=$(g++ -print-file-name=libasan.so)``), and a report aborts that process. Under the
preload torch's tensors come from ASan's malloc, with poisoned bytes right after each one, so a
read even one element past an input (or before it) is reported. The first test is the control:
a call that reads past its keys must be reported, so a build that silently lost its
instrumentation fails here instead of passing everything.

Built at -O0 here (``native.SANITIZE_FLAGS`` say -O1; each child replaces it, ``_O0``): the
instrumented -O1 build of attention.cpp took 257 s of CPU (g++ 12, 2-core AMD EPYC), over native.py's
300 s limit on a loaded machine, the -O0 build 24 s; the workload then runs 18 s instead of 12.
Every access is still instrumented (-O0 instruments more of them: none is optimised away).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from support.guarded import read_past_the_keys, run_child
from jagged_sdpa.backends.cpu import native

SANITIZE = "address,undefined"
# Where the native build is AVX-512, the AVX2 tiles (16 ymm registers) are the x86-64-v3 build's: the
# workload runs sanitized on that build too. Where the native build is AVX2, it already ran them.
_NATIVE_512 = native.library() is not None and "avx512f" in (native.build_target() or "")
_RUNS_V3 = {"avx2", "fma", "f16c"} <= set(native._cpu_flags().split())


# Every child (the build and the sanitized runs, which find the library by the flags' hash) builds
# and loads the -O0 library (the module docstring says why).
_O0 = """
from jagged_sdpa.backends.cpu import native
native.SANITIZE_FLAGS = tuple("-O0" if f.startswith("-O") else f for f in native.SANITIZE_FLAGS)
"""


def _libasan():
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return None
    path = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _asan_env(**extra):
    """The environment of a sanitized child; builds the sanitized library first (without the
    preload: the compiler need not run under ASan)."""
    libasan = _libasan()
    if libasan is None:
        pytest.skip("no libasan.so next to the C++ compiler (g++ -print-file-name=libasan.so)")
    env = dict(os.environ, JAGGED_SDPA_SANITIZE=SANITIZE, **extra)
    env.pop("LD_PRELOAD", None)
    # native.py gives the instrumented build 900 s itself; the child waits longer, so that a slow build (a
    # loaded machine) fails with native.py's own message, not a timeout here.
    build = run_child(_O0 + "print(native._build())", env=env, timeout=1000)
    assert build.returncode == 0 and "attention-sanitize-" in build.stdout, build.stdout[-3000:]
    env.update(LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0:halt_on_error=1",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")
    return env


@pytest.fixture(scope="module")
def asan_env():
    return _asan_env()


_LOAD = _O0 + """
assert "attention-sanitize-" in str(native.library_path()), (native.library_path(), native.unavailable_reason())
"""


def test_control_a_read_past_the_keys_is_reported(asan_env):
    """cu_seqlens_k patched after validation to claim 40 keys where k holds 4: the kernel reads
    past k, and the sanitized build must abort with a heap-buffer-overflow report in the kernel's source (attention.cpp or a part it includes)."""
    code = _LOAD + read_past_the_keys("torch.randn(4, 1, 16)", "NO SANITIZER REPORT")
    proc = run_child(code, env=asan_env, timeout=120)
    assert proc.returncode != 0 and "NO SANITIZER REPORT" not in proc.stdout, proc.stdout[-3000:]
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stdout and "/csrc/" in proc.stdout, \
        proc.stdout[-3000:]


def test_every_kernel_path_is_clean_under_address_and_ub_sanitizers(asan_env):
    code = _LOAD + """
from support import kernel_workload
kernel_workload.run(lambda t: t.clone(), backends=("cpu_fused",))
"""
    proc = run_child(code, env=asan_env, timeout=300)
    report = proc.stdout[-6000:]
    assert "Sanitizer" not in proc.stdout and "runtime error" not in proc.stdout, report
    assert proc.returncode == 0 and "workload done" in proc.stdout, report


@pytest.mark.skipif(not (_NATIVE_512 and _RUNS_V3),
                    reason="the native build is not AVX-512 (the test above ran the AVX2 tiles), or this CPU lacks AVX2")
def test_the_avx2_build_is_clean_under_address_and_ub_sanitizers():
    env = _asan_env(JAGGED_SDPA_CPU_ARCH="x86-64-v3", OMP_NUM_THREADS="1")
    code = _LOAD + """
assert "attention-sanitize-x86-64-v3-" in str(native.library_path()), native.library_path()
from support import kernel_workload
kernel_workload.run(lambda t: t.clone(), backends=("cpu_fused",))
"""
    proc = run_child(code, env=env, timeout=300)
    report = proc.stdout[-6000:]
    assert "Sanitizer" not in proc.stdout and "runtime error" not in proc.stdout, report
    assert proc.returncode == 0 and "workload done" in proc.stdout, report
