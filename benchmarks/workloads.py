"""Shared benchmark workloads W1..W5 (issues 3 and 14): one definition of every length set and shape.

Lengths are drawn with numpy's ``default_rng(seed)`` so that every benchmark (CPU, GPU) and every
run sees the same batches; W1 with seed 0 gives lengths 47..851, as in the issue's baseline table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


def lognormal_lengths(batch: int, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(math.log(median), sigma, batch)
    return [int(x) for x in np.clip(np.round(draws), lo, hi)]


def uniform_lengths(batch: int, lo: int, hi: int, seed: int) -> list[int]:
    """Integers in [lo, hi], both ends included."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(lo, hi + 1, batch)]


@dataclass(frozen=True)
class Workload:
    """One benchmark shape. ``kv_lengths`` None means self-attention (keys = queries)."""

    name: str
    q_lengths: tuple[int, ...]
    kv_lengths: Optional[tuple[int, ...]] = None
    heads: int = 8
    kv_heads: Optional[int] = None
    head_dim: int = 64
    causal: bool = False
    alignment: str = "top_left"
    dtype: torch.dtype = torch.float32
    backward: bool = False
    description: str = field(default="", compare=False)

    @property
    def keys(self) -> tuple[int, ...]:
        return self.kv_lengths if self.kv_lengths is not None else self.q_lengths

    @property
    def heads_kv(self) -> int:
        return self.kv_heads or self.heads

    def visible_pairs(self) -> int:
        """(query, key) pairs that attention really computes, per head (for GFLOP/s)."""
        total = 0
        for lq, lk in zip(self.q_lengths, self.keys):
            if not self.causal:
                total += lq * lk
                continue
            shift = lk - lq if self.alignment == "bottom_right" else 0
            total += sum(max(0, min(lk, i + shift + 1)) for i in range(lq))
        return total

    def flops(self) -> float:
        """2 matmuls of 2*D flops per visible pair per head; backward is 2.5x the forward (5 matmuls)."""
        fwd = 4.0 * self.head_dim * self.heads * self.visible_pairs()
        return fwd * 3.5 if self.backward else fwd

    def with_(self, **changes) -> "Workload":
        import dataclasses

        return dataclasses.replace(self, **changes)


W1_LENGTHS = tuple(lognormal_lengths(16, 300, 0.8, 16, 2048, seed=0))
W2_LENGTHS = tuple(uniform_lengths(64, 8, 128, seed=0))
W3_LENGTHS = (64,) * 7 + (2048,)
W4_KV_LENGTHS = tuple(uniform_lengths(32, 64, 1024, seed=0))

W1 = Workload("W1", W1_LENGTHS, description="16 seqs log-normal (median 300, sigma 0.8, 16..2048)")
W2 = Workload("W2", W2_LENGTHS, description="64 seqs uniform 8..128")
W3 = Workload("W3", W3_LENGTHS, description="7 x 64 + 1 x 2048")
W4 = Workload("W4", (1,) * 32, W4_KV_LENGTHS, causal=True, alignment="bottom_right",
              description="decode: 32 requests, 1 query each, 64..1024 keys, bottom-right causal")
# Issue 14's bf16 workload: W1's batch in bfloat16 (the rows earlier runs called "W1 bfloat16").
W5 = Workload("W5", W1_LENGTHS, dtype=torch.bfloat16, description="W1's 16 seqs in bfloat16")
TINY = Workload("tiny", (6, 8, 10, 7), heads=2, head_dim=16, description="B=4, lengths 6..10, H=2, D=16")


def standard_workloads() -> list[Workload]:
    """The issue's table, in its order: fp32 forward and forward+backward, then W5 (W1 in bf16),
    then W3 and W4 in bf16 (issue 22)."""
    rows = [
        W1, W1.with_(causal=True), W1.with_(backward=True), W1.with_(causal=True, backward=True),
        W2, W2.with_(backward=True),
        W3, W3.with_(backward=True),
        W4,
        W5, W5.with_(backward=True),
        # issue 22: what a CPU server runs in bf16: one long sequence beside short ones, and decode
        W3.with_(dtype=torch.bfloat16), W4.with_(dtype=torch.bfloat16),
    ]
    return rows


def make_tensors(w: Workload, *, seed: int = 0, requires_grad: bool = False):
    """Packed q (total_q, Hq, D), k, v (total_k, Hkv, D) and int32 cu_seqlens for a workload."""
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(w.q_lengths), sum(w.keys)
    q = torch.randn(total_q, w.heads, w.head_dim, generator=gen).to(w.dtype)
    k = torch.randn(total_k, w.heads_kv, w.head_dim, generator=gen).to(w.dtype)
    v = torch.randn(total_k, w.heads_kv, w.head_dim, generator=gen).to(w.dtype)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    cu_q = torch.tensor([0, *np.cumsum(w.q_lengths)], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(w.keys)], dtype=torch.int32)
    return q, k, v, cu_q, cu_k
