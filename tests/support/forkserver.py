"""Fresh child processes without paying torch's import in each: they are forked from one fork server
per test process (``multiprocessing``'s "forkserver"), which imported torch, torch.distributed and
torch._dynamo (jagged_sdpa imports it: ~7 of the ~8 s of CPU a fresh python spends before its first
jagged_sdpa call) once, before any torch op ran (no OpenMP pool to inherit). A child still imports
jagged_sdpa and the test helpers itself, from the parent's ``sys.path`` (this worktree first), and
runs with the parent's environment of the moment. What the server imported read the environment
when it started (without ``TRITON_INTERPRET``: torch._dynamo imports triton, here compiled): a
child that needs other variables at its start (``LD_PRELOAD``, ``MALLOC_*``, ``TRITON_INTERPRET``)
must be an ordinary subprocess.
Imports only the standard library.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from multiprocessing import forkserver
from unittest import mock

PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


@functools.lru_cache(maxsize=1)
def context():
    """The fork-server context (the preload is set before the server's first start)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ):
        os.environ.pop("TRITON_INTERPRET", None)
        forkserver.ensure_running()
    return ctx


def _exec_child(code: str, cwd: str, path: list, env: dict, out_path: str) -> None:
    os.setsid()   # a group of its own: on a timeout the parent kills it and whatever it started
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(out_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.path[:0] = path
    os.chdir(cwd)
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


def run_python(code: str, cwd: str, path: list, timeout: float) -> subprocess.CompletedProcess:
    """``python -c code`` in ``cwd`` with ``path`` first on sys.path, forked from the server: the
    finished process with stdout and stderr merged into ``stdout``, its exit status as a
    subprocess's (an uncaught exception 1, ``sys.exit(n)`` n, a signal -signum);
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the child's group killed)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".out") as out:
        proc = context().Process(target=_exec_child, args=(code, cwd, list(path), dict(os.environ), out.name))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.join()
            raise subprocess.TimeoutExpired(["python", "-c", code], timeout, out.read())
        return subprocess.CompletedProcess(["python", "-c", code], proc.exitcode, out.read())
