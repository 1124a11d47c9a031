"""benchmarks/gpu_check.py in its CPU mode: the script a GPU session runs first must not rot.

The CPU mode runs the checks the CPU can make (the Triton kernels under the interpreter with tiny
shapes, MATH for the compiled training step) and skips the GPU ones; every check must report, and
none that runs here may fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")


def test_gpu_check_cpu_mode(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself before importing triton
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {r["check"]: r["status"] for r in report["results"]}
    assert "FAIL" not in status.values(), status
    for name in ("triton-interior-tiles", "paged-split-k-2**32", "strided-table-slopes", "fp8-cache-decode",
                 "no-autotuner-graph-capture",
                 "one-hot-gradients", "compiled-training-step", "plan-run-host-time"):
        assert status[name] == "PASS", (name, status)
    for name in ("cuda-tests", "graph-decode-seqused-k", "k-beyond-2**31", "bench-cuda", "fp32-d256-decode-autotune"):
        assert status[name] == "SKIP", (name, status)
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("\n| ") == len(status) + 1  # header row + one row per check
