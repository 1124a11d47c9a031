"""MATH's backward alone: time and peak resident memory, one fresh process per case.

    python benchmarks/bench_math.py [case ...]      (default: every case; one thread)

MATH's backward reads neither out nor lse, so zeros stand in for them and no forward runs before
it: the peak is the backward's own (ru_maxrss after minus before, glibc told to map every large
allocation on its own so freed blocks leave the resident set at once). Time: best of the reps.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (lengths, heads, head dim, options, score budget or None, reps)
CASES = {
    "medium": ([512] * 4, 8, 64, {}, None, 3),
    "medium-causal": ([512] * 4, 8, 64, dict(causal=True), None, 3),
    "medium-all": ([512] * 4, 8, 64, dict(causal=True, softcap=20.0, dropout_p=0.1, alibi=True), None, 1),
    "long": ([8192], 1, 16, dict(causal=True, softcap=5.0), 4 << 20, 1),  # test_math_blocked's memory test
}


def run_case(name: str) -> str:
    import jagged_sdpa
    from jagged_sdpa.backends import math as math_backend
    from jagged_sdpa.backends.math import MathBackend
    from jagged_sdpa.spec import PackedCall

    lengths, heads, dim, options, budget, reps = CASES[name]
    options = dict(options)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if budget:
        math_backend.SCORE_BUDGET_BYTES = budget

    def call_of(n_tokens):
        q, k, v = (torch.randn(n_tokens, heads, dim, requires_grad=True) for _ in range(3))
        slopes = (torch.rand(heads) * 0.5).requires_grad_() if options.get("alibi") else None
        cu = torch.tensor([0] + [min(n_tokens, sum(lengths[:i + 1])) for i in range(len(lengths))], dtype=torch.int32)
        kw = {key: val for key, val in options.items() if key != "alibi"}
        spec = jagged_sdpa.explain(q, k, v, cu, cu, alibi_slopes=slopes, **kw).spec
        key = torch.tensor([7, 9]) if spec.dropout_p else None
        return PackedCall(q, k, v, cu, cu, spec, slopes, dropout_key=key)

    total = sum(lengths)
    small = call_of(64)  # every op once before measuring
    MathBackend.backward(small, None, None, torch.ones(64, heads, dim), ())
    call = call_of(total)
    grad_out = torch.randn(total, heads, dim)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        MathBackend.backward(call, None, None, grad_out, ())
        best = min(best, time.perf_counter() - start)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return f"{name:14s} backward {best * 1e3:7.0f} ms   peak RSS +{grew:6.1f} MiB"


def main(names) -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for name in names or CASES:
        proc = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True, text=True)
        print(proc.stdout.strip() if proc.returncode == 0 else f"{name}: failed\n{proc.stderr[-2000:]}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(run_case(sys.argv[2]))
    else:
        main(sys.argv[1:])
