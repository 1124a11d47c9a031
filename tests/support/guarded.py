"""Tensors that sit right against an inaccessible page: a read past their last byte (``side="after"``)
or before their first byte (``side="before"``) is a segfault instead of a silently wrong number.

``guarded(t)`` copies ``t`` into an anonymous ``mmap`` whose neighbouring page is ``mprotect``ed to
``PROT_NONE``, keeping t's sizes and strides (a strided view keeps its gaps: its furthest element is
the one next to the guard). The maps are never unmapped (the tensors share them); use it in short
child processes (a crash must fail a test, not kill pytest): see ``run_child``.
Imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import subprocess
import sys

import torch

PAGE = mmap.PAGESIZE
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAPS: list = []  # alive as long as the process: the tensors point into them


def _extent(t: torch.Tensor) -> int:
    """Elements from t's first element to its furthest one, inclusive (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    assert all(s >= 0 for s in t.stride()), "negative strides are not supported"
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def guarded(t: torch.Tensor, side: str = "after") -> torch.Tensor:
    """A copy of ``t`` (same dtype, sizes, strides, values; requires_grad kept) placed so that the
    byte after its last element (``"after"``) or before its first (``"before"``) is PROT_NONE."""
    assert side in ("after", "before"), side
    t_ = t.detach()
    elems = _extent(t_)
    nbytes = elems * t_.element_size()
    data_pages = max(1, -(-nbytes // PAGE))
    mm = mmap.mmap(-1, (data_pages + 1) * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    guard = base + data_pages * PAGE if side == "after" or elems == 0 else base
    if _LIBC.mprotect(guard, PAGE, 0):  # PROT_NONE
        raise OSError(ctypes.get_errno(), "mprotect failed")
    _MAPS.append(mm)
    if elems == 0:  # an empty tensor points at the guard page itself: reading any element faults
        size = t_.element_size()
        cell = torch.frombuffer(mm, dtype=t_.dtype, count=1, offset=data_pages * PAGE - size)
        return cell.as_strided(t_.shape, t_.stride(), 1).requires_grad_(t.requires_grad)
    start = data_pages * PAGE - nbytes if side == "after" else PAGE
    flat = torch.frombuffer(mm, dtype=t_.dtype, count=elems, offset=start)
    out = flat.as_strided(t_.shape, t_.stride())
    out.copy_(t_)
    return out.requires_grad_(t.requires_grad)


def run_child(code: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs python ``code`` in a child process, in the repository root, with tests/ (for ``support``)
    and the repository on its path; returns the finished process (stdout and stderr merged into
    stdout). Without ``env`` the child is forked from a server that has imported torch
    (``support/forkserver.py``: ~1 s of CPU instead of ~8); with ``env`` (variables it must start
    with: ``LD_PRELOAD``, ``JAGGED_SDPA_CPU_ARCH``) it is a fresh ``python -c``."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if env is None:
        from support import forkserver

        return forkserver.run_python(code, os.path.dirname(tests), [tests, os.path.dirname(tests)], timeout)
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [tests, os.path.dirname(tests)] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # A session of its own: on a timeout the whole group goes (a compiler the child started, e.g. the
    # sanitized build, would otherwise keep running after the child is killed).
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=full_env, cwd=os.path.dirname(tests), start_new_session=True) as proc:
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout)


def read_past_the_keys(k_expr: str, marker: str) -> str:
    """Child code for the controls: the kernel called with cu_seqlens_k patched, after validation,
    to claim 40 keys where ``k`` (built by ``k_expr``) holds 4, so it reads past k; prints
    ``marker`` only if nothing stopped it."""
    return f"""
import ctypes, torch
from support.guarded import guarded
from support.kernel_calls import packed_call
from jagged_sdpa.backends.cpu import native
q, k = torch.randn(4, 1, 16), {k_expr}
cu = torch.tensor([0, 4], dtype=torch.int32)
call = packed_call(q, k, k, cu, cu)
out, lse, keep = torch.empty(4, 1, 16), torch.empty(1, 4), []
params = native._params(call, out, lse, keep)
bad = torch.tensor([0, 40], dtype=torch.int32)
params.cu_k = bad.data_ptr()
native.library().js_attention_forward(ctypes.byref(params))
print("{marker}")
"""
