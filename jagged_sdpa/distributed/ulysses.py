"""Ulysses: an all-to-all turns row shards into head shards, each rank runs the unchanged
single-process call on every token for Hq/W query heads, and a second all-to-all brings the
output rows home. Whole sequences, true positions: every option is exact, balance is perfect.

Needs Hq % W == 0. KV heads go to every rank whose query heads use them (replicated when
Hkv < W; expanded per query head when a rank's query heads straddle KV groups). On the CPU the
per-head computation is the single call's, so results are bitwise equal (no replication).
"""

from __future__ import annotations

import numpy as np
import torch

import jagged_sdpa
from jagged_sdpa.distributed.exchange import all_to_all


def refusal(plan, world_size, hq, hkv, opts):
    if hq % world_size:
        return (f"needs the query heads divisible by the world size: Hq={hq}, world size {world_size} "
                "(use algorithm='allgather')")
    return None


def kv_heads(hq, hkv, world_size, rank) -> list[int]:
    """KV heads rank's query heads read, in the order its local call indexes them."""
    per = hq // world_size
    group = hq // hkv
    wanted = [h // group for h in range(rank * per, (rank + 1) * per)]
    if group % per == 0 or per % group == 0:
        return sorted(set(wanted))          # whole GQA groups (or one shared KV head)
    return wanted                           # straddles groups: one KV head per query head


def _order(plan, device):
    """Global rows in plan order (rank 0's rows, rank 1's, ...) and its inverse."""
    order = plan.device_tensor("plan_order", lambda: np.concatenate([plan.rows(r) for r in range(plan.world_size)]), device)
    inverse = plan.device_tensor("plan_inverse", lambda: np.argsort(np.concatenate(
        [plan.rows(r) for r in range(plan.world_size)])), device)
    return order, inverse


def _local_call(plan, hq, world_size, rank, opts, device):
    per = hq // world_size
    alibi = opts["alibi_slopes"]
    if alibi is not None:
        alibi = alibi[..., rank * per:(rank + 1) * per]
    cu = plan.device_tensor("cu_seqlens", lambda: torch.tensor(plan.cu_seqlens, dtype=torch.int32), device)
    max_len = max(plan.lengths, default=0)
    return (cu, cu, max_len, max_len), dict(
        softmax_scale=opts["softmax_scale"], causal=opts["causal"], window_size=opts["window_size"],
        softcap=opts["softcap"], alibi_slopes=alibi, return_lse=True, backend=opts["backend"])


def explain_calls(q, k, v, plan, rank, opts):
    hq, hkv, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    W = plan.world_size
    n_kv = len(kv_heads(hq, hkv, W, rank))
    grad = q.requires_grad or k.requires_grad or v.requires_grad
    qq = torch.empty(plan.total, hq // W, d, dtype=q.dtype, device=q.device).requires_grad_(grad)
    kk = torch.empty(plan.total, n_kv, d, dtype=k.dtype, device=k.device).requires_grad_(grad)
    vv = torch.empty(plan.total, n_kv, dv, dtype=v.dtype, device=v.device).requires_grad_(grad)
    args, kwargs = _local_call(plan, hq, W, rank, opts, q.device)
    kwargs.pop("return_lse")
    return [jagged_sdpa.explain(qq, kk, vv, *args, return_lse=True, **kwargs)]


def attention(q, k, v, plan, comm, opts):
    W, me = comm.world_size, comm.rank
    n, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    per = hq // W
    device = q.device
    tokens = plan.tokens
    heads = [kv_heads(hq, hkv, W, r) for r in range(W)]

    send, send_counts = [], []
    for r in range(W):
        idx = plan.device_tensor(("kv_heads", hq, hkv, r), lambda r=r: torch.tensor(heads[r]), device)
        parts = (q[:, r * per:(r + 1) * per], k.index_select(1, idx), v.index_select(1, idx))
        send.extend(p.reshape(-1) for p in parts)
        send_counts.append(n * (per * d + len(heads[r]) * (d + dv)))
    mine = len(heads[me])
    row = per * d + mine * (d + dv)
    recv = all_to_all(torch.cat(send), comm, send_counts, [t * row for t in tokens])
    qs, ks, vs = [], [], []
    for piece, t in zip(recv.split([t * row for t in tokens]), tokens):
        a, b, c = piece.split([t * per * d, t * mine * d, t * mine * dv])
        qs.append(a.view(t, per, d))
        ks.append(b.view(t, mine, d))
        vs.append(c.view(t, mine, dv))
    order, inverse = _order(plan, device)
    q_all = torch.cat(qs).index_select(0, inverse)
    k_all = torch.cat(ks).index_select(0, inverse)
    v_all = torch.cat(vs).index_select(0, inverse)

    args, kwargs = _local_call(plan, hq, W, me, opts, device)
    out, lse = jagged_sdpa.varlen_attention(q_all, k_all, v_all, *args, **kwargs)

    out_sorted = out.index_select(0, order)                       # (N, per, Dv) in plan order
    back = all_to_all(out_sorted.reshape(-1), comm, [t * per * dv for t in tokens], [n * per * dv] * W)
    out_local = torch.cat([p.view(n, per, dv) for p in back.split([n * per * dv] * W)], dim=1)
    if not opts["return_lse"]:
        return out_local, None
    lse_sorted = lse.index_select(1, order)                       # (per, N) in plan order
    lse_send = torch.cat([p.reshape(-1) for p in lse_sorted.split(list(tokens), dim=1)])
    lse_back = comm.all_to_all(lse_send.contiguous(), [per * t for t in tokens], [per * n] * W)
    return out_local, torch.cat([p.view(per, n) for p in lse_back.split([per * n] * W)], dim=0)
