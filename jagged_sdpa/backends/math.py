"""MATH: plain torch ops, one sequence at a time; runs on every device and takes every call.

Autograd differentiates it directly (no custom backward). Memory follows the work: each sequence
materialises only its own (Hq, Lq, Lk) scores, never B x max_len^2. fp16/bf16 are computed in
float32 and rounded once at the end. Rows that see no key give 0 and lse -inf, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagged_sdpa.checks.capability import ALL_FLOAT_DTYPES, Capabilities
from jagged_sdpa.backends import keyed_dropout, positions
from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def position_bias_and_mask(spec: AttnSpec, len_q: int, len_k: int, device, slopes=None):
    """Keep-mask (Lq, Lk) or None, and the ALiBi bias (H, Lq, Lk) or None for one sequence.

    The aligned query position is i (top_left) or i + Lk - Lq (bottom_right); causal keeps
    j <= i', the window keeps i' - left <= j <= i' + right; ALiBi adds -slope * |i' - j|.
    """
    need_mask = spec.causal or spec.has_window
    if not need_mask and slopes is None:
        return None, None
    pos, j = positions.aligned_positions(0, len_q, 0, len_k, positions.shift_of(spec, len_q, len_k), device)
    keep = positions.keep_mask(spec, pos, j) if need_mask else None
    bias = None if slopes is None else positions.alibi_bias(slopes, pos, j, slopes.dtype)
    return keep, bias


def attend_one(q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, slopes=None, dropout_key=None, b: int = 0,
               rows=None):
    """One sequence: q (Lq, Hq, D), k (Lk, Hkv, D), v (Lk, Hkv, Dv) -> out (Lq, Hq, Dv), lse (Hq, Lq).

    GQA by broadcasting query groups against their kv head (no expanded K/V). Dropout keeps what
    ``keyed_dropout`` keeps for sequence b, whose rows are at in-sequence positions ``rows``
    (default 0..Lq-1).
    """
    len_q, len_k = q.shape[0], k.shape[0]
    hkv, group = spec.heads_kv, spec.gqa_group
    ct = compute_dtype(q.dtype)
    qh = q.to(ct).unflatten(1, (hkv, group)).permute(1, 2, 0, 3)  # (Hkv, G, Lq, D)
    kh = k.to(ct).permute(1, 0, 2).unsqueeze(1)                   # (Hkv, 1, Lk, D)
    vh = v.to(ct).permute(1, 0, 2).unsqueeze(1)                   # (Hkv, 1, Lk, Dv)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * spec.scale  # (Hkv, G, Lq, Lk)
    if spec.softcap:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    keep, bias = position_bias_and_mask(
        spec, len_q, len_k, q.device, None if slopes is None else slopes.to(ct)
    )
    if bias is not None:
        scores = scores + bias.view(hkv, group, len_q, len_k)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    # A row max that is -inf (no key visible) is replaced by 0 so exp() gives exact zeros.
    row_max = scores.detach().amax(dim=-1, keepdim=True) if len_k else scores.new_zeros(
        scores.shape[:-1] + (1,)
    )
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    with torch.no_grad():
        lse = (row_max + torch.log(denom)).squeeze(-1).reshape(spec.heads_q, len_q).float()
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    if spec.dropout_p:
        rows = torch.arange(len_q, device=q.device) if rows is None else rows
        p = keyed_dropout.dropped(p, dropout_key, b, rows, spec.dropout_p)
    out = torch.matmul(p, vh)                                     # (Hkv, G, Lq, Dv)
    out = out.permute(2, 0, 1, 3).reshape(len_q, spec.heads_q, -1)
    return out.to(q.dtype), lse


def gather_paged_keys(call: PackedCall, b: int, length: int) -> tuple[Tensor, Tensor]:
    """Keys/values of sequence b from the paged cache: only the blocks that hold its keys."""
    bs = call.spec.block_size
    n_blocks = -(-length // bs)
    ids = call.block_table[b, :n_blocks].long()
    k = call.k.index_select(0, ids).flatten(0, 1)[:length]
    v = call.v.index_select(0, ids).flatten(0, 1)[:length]
    return k, v


def sequence_keys(call: PackedCall):
    """Yield (k_b, v_b) for every sequence, from packed buffers or the paged cache."""
    if call.spec.paged:
        used = call.seqused_k_host
        if used is None:
            used = tuple(call.seqused_k.tolist())
        for b, length in enumerate(used):
            yield gather_paged_keys(call, b, length)
    else:
        for start, length in call.key_ranges_host():
            yield call.k[start:start + length], call.v[start:start + length]



class MathBackend(BackendImpl):
    backend = Backend.MATH
    caps = Capabilities(
        devices=frozenset({"cpu", "cuda", "xpu", "mps", "hpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        paged=True,
        alibi_slopes_grad=True,  # autograd differentiates the bias -slope * |i' - j| like any op
    )
    native_autograd = True

    @classmethod
    def forward(cls, call: PackedCall) -> AttnOutput:
        spec = call.spec
        outs, lses = [], []
        for b, ((q_start, len_q), (k_b, v_b)) in enumerate(
            zip(call.query_ranges_host(), sequence_keys(call))
        ):
            if len_q == 0:
                continue
            out_b, lse_b = attend_one(call.q[q_start:q_start + len_q], k_b, v_b, spec, call.slopes_of(b),
                                      call.dropout_key, b)
            outs.append(out_b)
            lses.append(lse_b)
        if not outs:
            # No query row at all: an empty output that is still a function of q, k and v, so that
            # backward runs (and gives zero gradients) as for any other batch.
            anchor = call.q.sum() + call.k.sum() + call.v.sum()
            if call.alibi_slopes is not None:
                anchor = anchor + call.alibi_slopes.sum()
            anchor = anchor.to(call.q.dtype)
            out = anchor.expand(0, spec.heads_q, spec.head_dim_v)
            lse = torch.empty(spec.heads_q, 0, dtype=torch.float32, device=call.q.device)
        else:
            out = torch.cat(outs, dim=0)
            lse = torch.cat(lses, dim=1)
        return AttnOutput(out, lse if spec.return_lse else None)
