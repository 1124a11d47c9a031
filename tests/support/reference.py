"""Float64 per-sequence attention reference. Imports only torch and math: never jagged_sdpa.

It is deliberately boring: an explicit loop over sequences, query rows' aligned positions written
out once, an explicit boolean mask (every pair decided in Python integers, then made one tensor),
and per head one softmax over the rows that see a key. Rows that see no key give out 0 and lse -inf.

docs/api.md section 11, written from the contract's formulas (not from jagged_sdpa's position code):
``chunk_size`` C keeps (query, key) pairs whose chunk ids, Python's floor division of the aligned
position and of the key position by C, agree; ``prefix_lens`` P_b additionally shows every key
j < P_b to the rows at aligned positions < P_b; ``sinks`` add e^{sink_h} to every row's
denominator: out_i = sum_j e^{s_ij} v_j / (e^{sink_h} + sum_j e^{s_ij}), lse_i =
log(e^{sink_h} + sum_j e^{s_ij}), a row that sees no key gives out 0 and lse sink_h.
"""

from __future__ import annotations

import math

import torch


def keep_mask(len_q, len_k, *, causal, alignment, window, device=None):
    """Boolean (Lq, Lk): True where query i may attend key j. (Each pair is decided in Python
    integers, exact for windows up to and past 2^63, and the mask is made a tensor once.)"""
    shift = len_k - len_q if alignment == "bottom_right" else 0
    keep = []
    for i in range(len_q):
        pos = i + shift
        row = []
        for j in range(len_k):
            ok = True
            if causal and j > pos:
                ok = False
            if window[0] >= 0 and j < pos - window[0]:
                ok = False
            if window[1] >= 0 and j > pos + window[1]:
                ok = False
            row.append(ok)
        keep.append(row)
    return torch.tensor(keep, dtype=torch.bool, device=device).reshape(len_q, len_k)


def chunk_prefix_mask(keep, len_q, len_k, *, alignment, chunk_size=None, prefix=0):
    """``keep`` (Lq, Lk) with docs/api.md section 11's chunk rule ANDed in and the prefix rule ORed in."""
    shift = len_k - len_q if alignment == "bottom_right" else 0
    device = keep.device
    keep = keep.tolist()
    for i in range(len_q):
        pos = i + shift
        for j in range(len_k):
            if chunk_size is not None and math.floor(pos / chunk_size) != math.floor(j / chunk_size):
                keep[i][j] = False
            if pos < prefix and j < prefix:
                keep[i][j] = True
    return torch.tensor(keep, dtype=torch.bool, device=device).reshape(len_q, len_k)


def attention_reference(q, k, v, cu_q, cu_k, *, scale=None, causal=False, alignment="top_left",
                        window=(-1, -1), softcap=0.0, alibi_slopes=None, seqused_k=None, dropout_p=0.0,
                        dropout_keep=None, sinks=None, chunk_size=None, prefix_lens=None):
    """q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); cu_* lists or int tensors.

    Dropout: ``dropout_keep(b, len_q, len_k)`` gives sequence b's bool keep mask (Hq, Lq, Lk) (the
    tests pass the keyed mask, so a dropout call is compared exactly); kept probabilities are
    multiplied by 1 / (1 - dropout_p) before the product with V. The lse does not see dropout.

    ``sinks`` (Hq,) (differentiable: pass a float64 leaf for its gradient), ``chunk_size`` (int or
    None), ``prefix_lens`` (a list or int tensor of B prefix lengths): docs/api.md section 11. Dropout
    scales the key probabilities only.

    Returns (out float64 (total_q, Hq, Dv), lse float64 (Hq, total_q)).
    """
    cu_q = [int(x) for x in cu_q]
    cu_k = [int(x) for x in cu_k]
    hq, hkv, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(q.shape[0], hq, dv, dtype=torch.float64, device=q.device)
    lse = torch.full((hq, q.shape[0]), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(len(cu_q) - 1):
        qs, qe = cu_q[b], cu_q[b + 1]
        ks = cu_k[b]
        ke = cu_k[b + 1] if seqused_k is None else ks + int(seqused_k[b])
        len_q, len_k = qe - qs, ke - ks
        if len_q == 0:
            continue
        keep = keep_mask(len_q, len_k, causal=causal, alignment=alignment, window=window, device=q.device)
        prefix = 0 if prefix_lens is None else int(prefix_lens[b])
        if chunk_size is not None or prefix:
            keep = chunk_prefix_mask(keep, len_q, len_k, alignment=alignment, chunk_size=chunk_size, prefix=prefix)
        dropped = dropout_keep(b, len_q, len_k).to(q.device) if dropout_p else None
        shift = len_k - len_q if alignment == "bottom_right" else 0
        for h in range(hq):
            kh = h // group
            qb = q[qs:qe, h].double()
            kb = k[ks:ke, kh].double()
            vb = v[ks:ke, kh].double()
            s = qb @ kb.T * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                i = torch.arange(len_q, device=q.device, dtype=torch.float64).unsqueeze(1) + shift
                j = torch.arange(len_k, device=q.device, dtype=torch.float64).unsqueeze(0)
                s = s - slope.double().to(q.device) * (i - j).abs()  # differentiable in the slopes
            s = s.masked_fill(~keep, -math.inf)
            sink = None if sinks is None else sinks[h].double().to(q.device)
            if sink is not None:
                lse[h, qs:qe] = sink                        # rows that see no key: lse sink_h, out 0
            rows = keep.any(1).nonzero().squeeze(1)         # the rows that see a key, all at once
            if rows.numel() == 0:
                continue
            s = s[rows]
            m = s.amax(1, keepdim=True) if sink is None else torch.maximum(s.amax(1, keepdim=True), sink)
            p = torch.exp(s - m)
            total = p.sum(1, keepdim=True) if sink is None else p.sum(1, keepdim=True) + torch.exp(sink - m)
            prob = p / total
            if dropped is not None:
                prob = prob * dropped[h][rows].double() / (1.0 - dropout_p)
            out[qs + rows, h] = prob @ vb
            lse[h, qs + rows] = (m + torch.log(total)).squeeze(1)
    return out, lse
