"""Every input of every kernel path placed against a PROT_NONE page (``guarded.py``): q, k, v,
cu_seqlens, NJT offsets, ALiBi slopes, seqused_k, block tables, paged caches, the backward's
leaves and output gradient, in fp32/fp16/bf16, through ``varlen_attention``/``sdpa`` with
``backend="cpu_fused"`` (the compiled kernel, under two work splits) and ``backend="math"``
(``kernel_workload.py`` lists the calls). Once with each tensor ending at the guard page (a read
past its end faults), once with each starting right after one (a read before its start faults).

Runs in a child python: a fault is a failed test naming the case that was running, not a dead
pytest. Results must also equal the same calls on ordinary tensors bit for bit, and MATH's
loosely. The controls show that the guard pages do fault, for a direct read and for a kernel
call that reads past its keys.
"""

from __future__ import annotations

import os
import signal

import pytest

from support.guarded import read_past_the_keys, run_child
from jagged_sdpa.backends.cpu import native

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason=f"compiled kernel unavailable: {native.unavailable_reason()}")

_SEGV = (-signal.SIGSEGV, 128 + signal.SIGSEGV)

# Where the native build is AVX-512, the AVX2 tiles (other loops, other loads) are the
# x86-64-v3 build's: the workload runs on that build too. Where the native build is AVX2 already,
# the test above ran them.
_NATIVE_512 = native.library() is not None and "avx512f" in (native.build_target() or "")
_RUNS_V3 = {"avx2", "fma", "f16c"} <= set(native._cpu_flags().split())


def _last_case(stdout: str) -> str:
    cases = [line for line in stdout.splitlines() if line.startswith("case ")]
    return cases[-1] if cases else "(before the first case)"


@pytest.mark.parametrize("side", ["after", "before"])
def test_every_kernel_path_reads_only_its_tensors(side):
    code = f"""
from support.guarded import guarded
from support import kernel_workload
kernel_workload.run(lambda t: guarded(t, {side!r}))
"""
    proc = run_child(code, timeout=300)
    assert proc.returncode == 0 and "workload done" in proc.stdout, \
        f"exit {proc.returncode} in {_last_case(proc.stdout)}:\n{proc.stdout[-3000:]}"


@pytest.mark.skipif(not (_NATIVE_512 and _RUNS_V3),
                    reason="the native build is not AVX-512 (the test above ran the AVX2 tiles), or this CPU lacks AVX2")
@pytest.mark.parametrize("side", ["after", "before"])
def test_the_avx2_build_reads_only_its_tensors(side):
    code = f"""
from support.guarded import guarded
from jagged_sdpa.backends.cpu import native
assert native.build_target().startswith("-march=x86-64-v3 "), (native.build_target(), native.unavailable_reason())
from support import kernel_workload
kernel_workload.run(lambda t: guarded(t, {side!r}))
"""
    # One thread, as test_portable_build's child: spinning OpenMP threads on a loaded CI machine.
    env = dict(os.environ, JAGGED_SDPA_CPU_ARCH="x86-64-v3", OMP_NUM_THREADS="1")
    proc = run_child(code, timeout=300, env=env)
    assert proc.returncode == 0 and "workload done" in proc.stdout, \
        f"exit {proc.returncode} in {_last_case(proc.stdout)}:\n{proc.stdout[-3000:]}"


@pytest.mark.parametrize("side", ["after", "before"])
def test_control_guard_pages_fault(side):
    """One element past the end (or before the start) of a guarded tensor is a segfault."""
    offset = "t.numel() * 4" if side == "after" else "-4"
    code = f"""
import ctypes, torch
from support.guarded import guarded
t = guarded(torch.arange(10, dtype=torch.float32), {side!r})
assert ctypes.c_float.from_address(t.data_ptr() + 4 * 9 if {side!r} == "after" else t.data_ptr()).value >= 0
print("read", ctypes.c_float.from_address(t.data_ptr() + {offset}).value)
"""
    proc = run_child(code, timeout=60)
    assert proc.returncode in _SEGV and "read" not in proc.stdout, proc.stdout[-2000:]


def test_control_a_kernel_read_past_the_keys_faults():
    """The kernel with cu_seqlens_k patched (after validation) to claim 40 keys where the guarded k
    holds 4 reads past k and faults."""
    code = read_past_the_keys("guarded(torch.randn(4, 1, 16))", "NO FAULT")
    proc = run_child(code, timeout=60)
    assert proc.returncode in _SEGV and "NO FAULT" not in proc.stdout, proc.stdout[-2000:]
