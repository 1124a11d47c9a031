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

import torch
from torch import Tensor

from jagged_sdpa.backends import positions
from jagged_sdpa.backends.cpu import plan
from jagged_sdpa.spec import AttnSpec

# Products per chunk (keys x Hq x D): 2^19 float32 = 2 MiB of workspace (kept), 1024 keys at
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
    elif x.shape == out.shape:
        out.copy_(x).mul_(factor)
    else:
        # x broadcasts over the GQA group: widen it once, not once per query head.
        torch.mul(x.to(out.dtype), factor, out=out)


def forward_rows(spec: AttnSpec, q: Tensor, rows: list, out: Tensor, lse: Tensor, need_lse: bool) -> None:
    """Every decode row of a call, one after another (each pass uses intra-op threads).

    ``rows`` holds (i, k, v, slopes): query row i of q (total_q, Hq, D) with the keys and values
    it attends, k/v (Lk > 0, Hkv, D/Dv). Writes out[i] (Hq, Dv) and, if ``need_lse``, lse[:, i].
    Per-call work (scaled queries, workspace views, the scores buffer) is hoisted out of the
    loop: on W4 each row's Python and op-dispatch cost was about a quarter of the call.
    """
    hq, hkv, group, dim, dim_v = spec.heads_q, spec.heads_kv, spec.gqa_group, spec.head_dim, spec.head_dim_v
    acc = compute_dtype(spec.dtype)
    # Only the decode rows of q are scaled (a mixed call's prefill rows are not).
    picked = q.index_select(0, torch.tensor([i for i, _, _, _ in rows], device=q.device))
    q_scaled = (picked.to(acc) * spec.scale).view(len(rows), hkv, group, dim)
    max_keys = max(k.shape[0] for _, k, _, _ in rows)
    step = chunk_keys(spec)
    work = workspace(spec, max_keys)
    chunk = work.numel() // (hq * max(dim, dim_v))
    k_work = work[:chunk * hq * dim].view(chunk, hkv, group, dim)
    v_work = work[:chunk * hq * dim_v].view(chunk, hkv, group, dim_v)
    scores_buf = torch.empty(hq * max_keys, dtype=acc)
    for r, (i, k, v, slopes) in enumerate(rows):
        # One row always sees a key when Lk > 0: its aligned position (0 top-left, Lk - 1
        # bottom-right) lies inside [0, Lk) and inside its own window.
        lo, hi = plan.row_keys(spec, 1, k.shape[0], 0)
        n = hi - lo
        # Scores as (Hq, keys), written through a transposed view: the softmax then runs on rows.
        s = scores_buf[:hq * n].view(hq, n)
        q_i = q_scaled[r]
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            prod = k_work[:c1 - c0]
            _times(k[lo + c0:lo + c1].unsqueeze(2), q_i, prod)
            torch.sum(prod, -1, out=s[:, c0:c1].t().view(c1 - c0, hkv, group))
        if spec.softcap:
            s = torch.tanh(s / spec.softcap).mul_(spec.softcap)
        if slopes is not None:
            pos, j = positions.aligned_positions(0, 1, lo, hi, plan.shift_of(spec, 1, k.shape[0]), s.device)
            s = s + positions.alibi_bias(slopes, pos, j, acc)[:, 0]
        if need_lse:
            row_lse = torch.logsumexp(s, dim=-1, keepdim=True)
            p = torch.exp(s - row_lse)
            lse[:, i] = row_lse[:, 0]
        else:
            p = torch.softmax(s, dim=-1)
        p = p.t().view(n, hkv, group, 1)
        if n <= step and out.dtype == acc:
            prod = v_work[:n]
            _times(v[lo:hi].unsqueeze(2), p, prod)
            torch.sum(prod, 0, out=out[i].view(hkv, group, dim_v))
            continue
        total = None
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            prod = v_work[:c1 - c0]
            _times(v[lo + c0:lo + c1].unsqueeze(2), p[c0:c1], prod)
            part = prod.sum(0)
            total = part if total is None else total.add_(part)
        out[i] = total.view(hq, dim_v)
