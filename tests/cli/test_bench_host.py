"""``benchmarks/bench_host.py`` end to end: both CUDA backends' host rows, and the aten ops a
decode-sized call makes (each a launch on a GPU): EFFICIENT made ~32 before its row bookkeeping
was kept per batch, FLASH_VARLEN 2-3."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_host_rows_and_ops_per_call():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_host.py"), "--ops", "--reps", "5"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = dict(re.findall(r"^(flash_varlen|efficient)\s+[\d.]+ /\s+[\d.]+\s+[\d.]+\s+([\d.]+)$", run.stdout, re.M))
    assert set(rows) == {"flash_varlen", "efficient"}, run.stdout
    ops = [int(n) for n in re.findall(r"^\s+(\d+) top-level aten ops:", run.stdout, re.M)]
    assert len(ops) == 2 and ops[0] <= 3 and ops[1] <= 8, run.stdout  # flash_varlen, then efficient
