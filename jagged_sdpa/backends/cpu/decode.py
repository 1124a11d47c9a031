"""Engine 4 (forward only): decode rows, one query row against its keys.

A decode row is bound by reading its K and V once. As matmuls it is a matrix-vector product per
head over packed (L, H, D) keys with a stride of H*D elements, which BLAS (and the fused kernel)
stream at ~11 GB/s on this machine, where a plain elementwise pass over the same bytes reaches
~30 GB/s. So a decode row is computed with elementwise passes over contiguous key chunks, all
heads at once: scores[l, h] = sum_d K[l, h, d] q[h, d]; a softmax over keys; out[h] =
sum_l p[l, h] V[l, h, :]. Chunks of at most ``CHUNK_ELEMENTS`` products bound the workspace.

A single query row sees one contiguous key range under every mask of the contract (causal,
window), so masks are slices; softcap and ALiBi are applied to the (L, H) scores. Half-precision
inputs are multiplied and summed in float32 (exact products, one rounding of the output), so the
lse is float32-accurate. Dropout stays with the blocked engine, whose backward replays its draws.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import Tensor

from jagged_sdpa.backends import positions
from jagged_sdpa.backends.cpu import plan
from jagged_sdpa.spec import AttnSpec

# Products per chunk (keys x Hq x D): 2^19 float32 = 2 MiB of workspace per call, 1024 keys at
# Hq=8, D=64, whatever the context length. Measured on W4 (32 rows of 64..1024 keys, 2 threads):
# 2^17 (256 keys) 5.5 ms, 2^18 4.7 ms, 2^19 4.2 ms; the loop of dense SDPA calls 4.8 ms.
CHUNK_ELEMENTS = 1 << 19


def eligible(spec: AttnSpec, len_q: int) -> bool:
    """One query row, no gradient (the backward recomputes scores as the blocked engine's
    matmuls) and no dropout (its draws belong to the blocked engine's order)."""
    return len_q == 1 and not spec.needs_grad and not spec.dropout_p


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_WORKSPACES = threading.local()


def workspace(spec: AttnSpec, max_keys: int) -> Tensor:
    """The workspace for every decode row of a call (rows run one after another).

    Kept per thread and dtype between calls, grown to the largest size asked for: at most
    ``CHUNK_ELEMENTS`` elements (or one key's products, if larger), 2 MiB in float32. A decode
    step then allocates only its outputs, as a loop of dense SDPA calls does.
    """
    keys = max(1, min(max_keys, chunk_keys(spec)))
    size = keys * spec.heads_q * max(spec.head_dim, spec.head_dim_v)
    dtype = compute_dtype(spec.dtype)
    cache = _WORKSPACES.__dict__
    work = cache.get(dtype)
    if work is None or work.numel() < size:
        work = cache[dtype] = torch.empty(size, dtype=dtype)
    return work[:size]


def chunk_keys(spec: AttnSpec) -> int:
    return max(1, CHUNK_ELEMENTS // (spec.heads_q * max(spec.head_dim, spec.head_dim_v)))


def _times(x: Tensor, factor: Tensor, out: Tensor) -> None:
    """out = x * factor in out's dtype. A half-precision x is widened by a plain copy first:
    torch's mixed-dtype multiply is ~3x slower than a copy plus a same-dtype multiply."""
    if x.dtype == out.dtype:
        torch.mul(x, factor, out=out)
    else:
        out.copy_(x.expand(out.shape)).mul_(factor)


def scaled_queries(spec: AttnSpec, q: Tensor) -> Tensor:
    """q * scale in the compute dtype, once for every decode row of a call."""
    return q.to(compute_dtype(spec.dtype)) * spec.scale


def forward_row(spec: AttnSpec, q_scaled: Tensor, k: Tensor, v: Tensor, slopes: Optional[Tensor], out: Tensor,
                lse: Tensor, need_lse: bool, work: Tensor) -> None:
    """q_scaled (Hq, D) (from ``scaled_queries``), k/v (Lk > 0, Hkv, D/Dv); writes out (Hq, Dv)
    and, if ``need_lse``, lse (Hq,)."""
    len_k = k.shape[0]
    hq, hkv, group, dim, dim_v = spec.heads_q, spec.heads_kv, spec.gqa_group, spec.head_dim, spec.head_dim_v
    acc = work.dtype
    # One row always sees a key when len_k > 0: its aligned position (0 top-left, Lk - 1
    # bottom-right) lies inside [0, Lk) and inside its own window.
    lo, hi = plan.row_keys(spec, 1, len_k, 0)
    n = hi - lo
    qg = q_scaled.view(hkv, group, dim)
    step = chunk_keys(spec)
    # Scores as (Hq, keys), written through a transposed view: the softmax then runs on rows.
    scores = torch.empty(hq, n, dtype=acc)
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        prod = work[:(c1 - c0) * hq * dim].view(c1 - c0, hkv, group, dim)
        _times(k[lo + c0:lo + c1].unsqueeze(2), qg, prod)
        torch.sum(prod, -1, out=scores[:, c0:c1].t().view(c1 - c0, hkv, group))
    s = scores
    if spec.softcap:
        s = torch.tanh(s / spec.softcap).mul_(spec.softcap)
    if slopes is not None:
        pos, j = positions.aligned_positions(0, 1, lo, hi, plan.shift_of(spec, 1, len_k), s.device)
        s = s + positions.alibi_bias(slopes, pos, j, acc)[:, 0]
    if need_lse:
        row_lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - row_lse)
        lse.copy_(row_lse[:, 0])
    else:
        p = torch.softmax(s, dim=-1)
    p = p.t().view(n, hkv, group, 1)
    direct = out.dtype == acc and n <= step
    total = None
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        prod = work[:(c1 - c0) * hq * dim_v].view(c1 - c0, hkv, group, dim_v)
        _times(v[lo + c0:lo + c1].unsqueeze(2), p[c0:c1], prod)
        if direct:
            torch.sum(prod, 0, out=out.view(hkv, group, dim_v))
            return
        part = prod.sum(0)
        total = part if total is None else total.add_(part)
    out.copy_(total.view(hq, dim_v))
