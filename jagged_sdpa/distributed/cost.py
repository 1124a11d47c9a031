"""The cost model behind ``algorithm="auto"`` and ``explain``: compute from the plan's attention
work, collectives as latency + bytes / bandwidth (alpha-beta), per rank, slowest rank wins.

Forward FLOPs are 2 (D + Dv) per visible (query, key) pair and query head; the backward is 2.5x.
An all-to-all over W ranks costs (W - 1) latencies (pairwise exchange) plus the larger of the
bytes a rank sends or receives over its bandwidth. Machine numbers are assumptions, listed with
the predictions (BENCHMARKS.md); the CPU ones were measured on the 2-core development machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jagged_sdpa.distributed.routes import needed_remote, remote_rows
from jagged_sdpa.distributed.ulysses import kv_heads
from jagged_sdpa.distributed.work import WorkTable


@dataclass(frozen=True)
class Machine:
    name: str
    flops: float          # effective attention FLOP/s per rank (forward)
    latency: float        # seconds per collective step
    bandwidth: float      # bytes/s per rank and direction
    overlap: float = 0.0  # fraction of communication hidden behind compute
    copy_bandwidth: float = 2.0e12  # bytes/s of local gathers, scatters and packing


MACHINES = {
    # measured on the 2-core CPU machine, gloo over loopback (benchmarks/bench_distributed.py)
    "cpu": Machine("CPU + gloo (2-core dev machine)", flops=4.4e10, latency=1.0e-4, bandwidth=5.0e8,
                   copy_bandwidth=3.0e9),
    # assumptions: H100 SXM, bf16 flash attention at ~50% of peak, NVLink 4 / NDR InfiniBand
    "nvlink": Machine("H100 + NVLink (assumed)", flops=4.0e14, latency=1.0e-5, bandwidth=3.0e11),
    "infiniband": Machine("H100 + InfiniBand NDR (assumed)", flops=4.0e14, latency=2.0e-5, bandwidth=5.0e10),
}


def machine_for(device) -> Machine:
    return MACHINES["cpu" if str(device).startswith("cpu") else "nvlink"]


@dataclass(frozen=True)
class Estimate:
    algorithm: str
    pairs: tuple          # per rank: visible (query, key) pairs times query heads
    bytes_fwd: tuple      # per rank: max(sent, received) bytes, forward
    bytes_bwd: tuple      # the same, backward (0 without gradients)
    collectives: int      # data collectives, forward + backward
    t_compute: float
    t_comm: float
    t_local: float = 0.0  # packing, gathering and scattering rows on the rank

    @property
    def seconds(self) -> float:
        return self.t_compute + self.t_comm + self.t_local

    @property
    def total_bytes(self) -> int:
        return int(sum(self.bytes_fwd) + sum(self.bytes_bwd))


def call_work(plan, causal, window) -> list[int]:
    """Visible pairs per rank for the call's mask (which may differ from the plan's)."""
    key = ("call_work", causal, window)
    if key not in plan._cache:
        table = WorkTable(plan.lengths, causal, window)
        plan._cache[key] = [sum(table.piece(*run) for run in runs) for runs in plan.runs]
    return plan._cache[key]


def _allgather_bytes(plan, causal, window, row_bytes):
    W = plan.world_size
    if plan.total * plan.world_size <= 1 << 24:
        owner, _ = plan.owners()
        recv = [needed_remote(plan, r, causal, window).size for r in range(W)]
        sent = [0] * W
        for r in range(W):
            sent = [a + b for a, b in zip(sent, np.bincount(owner[needed_remote(plan, r, causal, window)],
                                                            minlength=W).tolist())]
    else:  # large plans: interval arithmetic, sends assumed symmetric
        recv = [remote_rows(plan, r, causal, window) for r in range(W)]
        sent = recv
    return [max(s, r) * row_bytes for s, r in zip(sent, recv)]


def estimate(plan, algorithm, hq, hkv, d, dv, itemsize, *, causal, window, grad, machine,
             return_lse=False) -> Estimate:
    W = plan.world_size
    work = call_work(plan, causal, window)
    flops_per_pair = 2.0 * (d + dv)
    steps = max(W - 1, 0)
    acc = 8 if itemsize == 8 else 4
    passes = 3.0 if grad else 1.0      # local copies: the backward moves twice what the forward does
    if algorithm == "allgather":
        pairs = tuple(w * hq for w in work)
        # kv packed, keys gathered per run (about 3 copies of the gathered rows per pass)
        keys = max(_run_keys(plan, r, causal, window) for r in range(W))
        local = 3 * keys * hkv * (d + dv) * itemsize * passes
        fwd = tuple(_allgather_bytes(plan, causal, window, hkv * (d + dv) * itemsize))
        bwd = tuple(b // itemsize * acc for b in fwd) if grad else (0,) * W
        n_coll = 1 + (1 if grad else 0)
    else:
        per = hq // W
        total = sum(work)
        pairs = tuple(total * per for _ in range(W))
        heads = [kv_heads(hq, hkv, W, r) for r in range(W)]
        n, N = plan.tokens, plan.total
        fwd, bwd = [], []
        for r in range(W):
            out_sent = sum(n[s] for s in range(W) if s != r) * per * dv
            out_recv = n[r] * (hq - per) * dv
            in_sent = n[r] * sum(per * d + len(heads[s]) * (d + dv) for s in range(W) if s != r)
            in_recv = (N - n[r]) * (per * d + len(heads[r]) * (d + dv))
            data = max(in_sent, in_recv) + max(out_sent, out_recv)
            lse = (N - n[r]) * per * 4 if return_lse else 0
            fwd.append(data * itemsize + lse)
            bwd.append(data * itemsize if grad else 0)
        fwd, bwd = tuple(fwd), tuple(bwd)
        n_coll = 2 + (1 if return_lse else 0) + (2 if grad else 0)
        # pack, unpack, reorder to global order and back: about 3 copies of the head shard per pass
        local = 3 * N * (per * (d + dv) + max(len(h) for h in heads) * (d + dv)) * itemsize * passes
    if W == 1:
        fwd, bwd, n_coll = (0,), (0,), 0
    t_compute = max(pairs) * flops_per_pair * (3.5 if grad else 1.0) / machine.flops
    t_comm = (n_coll * steps * machine.latency
              + max(f + b for f, b in zip(fwd, bwd)) / machine.bandwidth) * (1.0 - machine.overlap)
    return Estimate(algorithm, pairs, fwd, bwd, n_coll, t_compute, t_comm, local / machine.copy_bandwidth)


def _run_keys(plan, rank, causal, window) -> int:
    """Key rows the runs of ``rank`` read (with repeats across runs)."""
    left, right = window
    total = 0
    for d, s, e in plan.runs[rank]:
        ks = 0 if left < 0 else max(0, s - left)
        ke = e if causal else (plan.lengths[d] if right < 0 else min(plan.lengths[d], e + right))
        total += ke - ks
    return total
