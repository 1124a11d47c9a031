"""MATH: plain torch ops; runs on every device and takes every call.

It is the fallback for float64 and for machines without a C++ compiler, so memory stays bounded
whatever the lengths: each sequence is walked in blocks of query rows whose scores fit
``SCORE_BUDGET_BYTES``, each block multiplied only against the keys its rows can see (causal and
window calls skip the rest), never B x max_len^2 nor even one sequence's Lq x Lk.

The backward is our own (``ops.py`` calls it), not autograd over the forward, which would keep
every block's scores alive: per block it runs the forward's own function (``attend_block``) again
under autograd and differentiates it against grad_out, so peak memory is one block in both
directions and the gradients are those of exactly the forward's rounding (one implementation of
the math). dK/dV (and the ALiBi slopes' gradient, which only MATH gives) accumulate over blocks in
the compute dtype; a paged cache's gradient sums, sequence by sequence in order, into the blocks
each sequence read, so shared blocks accumulate deterministically.

fp16/bf16 are computed in float32 and rounded once at the end. Rows that see no key give 0 and lse
-inf, never NaN.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple, Optional, Union

import torch
from torch import Tensor

from jagged_sdpa.checks.capability import ALL_FLOAT_DTYPES, Capabilities
from jagged_sdpa.backends import keyed_dropout, positions
from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall

# Most bytes of scores, (Hq, rows, keys) in the compute dtype, that one block of query rows holds.
# A block's temporaries take a few times that: measured peaks of about 3x in the forward and 8x in
# the backward (one block's autograd graph and its gradients), so about 128 MiB whatever the
# lengths. Tests shrink it to put block boundaries everywhere on small shapes.
SCORE_BUDGET_BYTES = 16 << 20


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def block_rows(spec: AttnSpec, len_q: int, len_k: int) -> int:
    """Query rows per block: the most whose scores fit ``SCORE_BUDGET_BYTES`` (at least one).

    Any rows see at most len_k keys; with a window bounded on both sides (causal bounds the right
    at 0), ``rows`` rows see at most rows + left + right keys, which lets long windowed sequences
    take much larger blocks."""
    itemsize = torch.finfo(compute_dtype(spec.dtype)).bits // 8
    cap = max(1, SCORE_BUDGET_BYTES // (spec.heads_q * itemsize))  # score elements per head
    rows = cap // max(len_k, 1)
    left, right = spec.window
    right = 0 if spec.causal else right
    if left >= 0 and right >= 0:  # rows * (rows + left + right) <= cap
        width = left + right
        rows = max(rows, (math.isqrt(width * width + 4 * cap) - width) // 2)
    return max(1, min(rows, len_q))


class Block(NamedTuple):
    """Query rows [r0, r1) of a sequence and the keys [lo, hi) they see."""

    r0: int
    r1: int
    lo: int
    hi: int


def blocks(spec: AttnSpec, len_q: int, len_k: int) -> Iterator[Block]:
    """A sequence's blocks of query rows, in order. Blocks whose rows see no key are left out
    (their out stays 0, lse -inf, gradients 0). Forward and backward walk the same blocks."""
    step = block_rows(spec, len_q, len_k)
    shift = positions.shift_of(spec, len_q, len_k)
    for r0 in range(0, len_q, step):
        r1 = min(len_q, r0 + step)
        lo = positions.visible_keys(spec, r0 + shift, len_k)[0]
        hi = positions.visible_keys(spec, r1 - 1 + shift, len_k)[1]  # both ends grow with the row
        if hi > lo:
            yield Block(r0, r1, lo, hi)


def attend_block(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, slopes: Optional[Tensor], shift: int,
                 block: Block, dropout_key: Optional[Tensor] = None, b: int = 0) -> tuple[Tensor, Tensor]:
    """One block: q (rows, Hq, D) against its keys k (keys, Hkv, D), v (keys, Hkv, Dv) ->
    out (rows, Hq, Dv) in q's dtype, lse (Hq, rows) in the compute dtype.

    The forward runs it without grad; the backward runs it again under autograd on inputs already
    in the compute dtype (``.to`` leaves them as they are, so every rounding is the forward's).
    GQA by broadcasting query groups against their kv head (no expanded K/V)."""
    rows, keys = block.r1 - block.r0, block.hi - block.lo
    hkv, group = spec.heads_kv, spec.gqa_group
    ct = compute_dtype(q.dtype)
    qh = q.to(ct).unflatten(1, (hkv, group)).permute(1, 2, 0, 3)  # (Hkv, G, rows, D)
    kh = k.to(ct).permute(1, 0, 2).unsqueeze(1)                   # (Hkv, 1, keys, D)
    vh = v.to(ct).permute(1, 0, 2).unsqueeze(1)                   # (Hkv, 1, keys, Dv)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * spec.scale  # (Hkv, G, rows, keys)
    if spec.softcap:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if slopes is not None or spec.causal or spec.has_window:
        pos, j = positions.aligned_positions(block.r0, block.r1, block.lo, block.hi, shift, q.device)
        if slopes is not None:
            bias = positions.alibi_bias(slopes.to(ct), pos, j, ct)
            scores = scores + bias.view(hkv, group, rows, keys)
        if spec.causal or spec.has_window:
            scores = scores.masked_fill(~positions.keep_mask(spec, pos, j), float("-inf"))
    # A row max that is -inf (no key visible) is replaced by 0 so exp() gives exact zeros.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    with torch.no_grad():
        lse = (row_max + torch.log(denom)).reshape(spec.heads_q, rows)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    if spec.dropout_p:
        rows_at = torch.arange(block.r0, block.r1, device=q.device)  # in-sequence positions: keyed_dropout
        p = keyed_dropout.dropped(p, dropout_key, b, rows_at, spec.dropout_p, j_start=block.lo)
    out = torch.matmul(p, vh)                                     # (Hkv, G, rows, Dv)
    return out.permute(2, 0, 1, 3).reshape(rows, spec.heads_q, -1).to(q.dtype), lse


KeyRows = Union[slice, Tensor]


class Sequence(NamedTuple):
    """Sequence b's query rows [q_start, q_start + len_q), its keys/values (a view of packed k/v, or
    gathered from the paged cache) and where they live: a slice of packed k/v, or the flat cache
    slots (LongTensor) of a paged cache."""

    b: int
    q_start: int
    len_q: int
    k: Tensor
    v: Tensor
    key_rows: KeyRows


def paged_slots(call: PackedCall, b: int, length: int) -> Tensor:
    """Flat cache slots (block * block_size + offset) of sequence b's first ``length`` keys."""
    bs = call.spec.block_size
    ids = call.block_table[b, :-(-length // bs)].long()
    return (ids.unsqueeze(1) * bs + torch.arange(bs, device=ids.device)).flatten()[:length]


def sequences(call: PackedCall) -> Iterator[Sequence]:
    """Every sequence with at least one query row, in order; a paged sequence gathers only the
    cache slots that hold its keys."""
    q_ranges = call.query_ranges_host()
    if call.spec.paged:
        used = call.seqused_k_host
        if used is None:
            used = tuple(call.seqused_k.tolist())
        k_flat, v_flat = call.k.flatten(0, 1), call.v.flatten(0, 1)
        for b, ((q_start, len_q), length) in enumerate(zip(q_ranges, used)):
            if len_q:
                slots = paged_slots(call, b, length)
                yield Sequence(b, q_start, len_q, k_flat.index_select(0, slots), v_flat.index_select(0, slots), slots)
        return
    for b, ((q_start, len_q), (k_start, len_k)) in enumerate(zip(q_ranges, call.key_ranges_host())):
        if len_q:
            keys = slice(k_start, k_start + len_k)
            yield Sequence(b, q_start, len_q, call.k[keys], call.v[keys], keys)


def _add_rows(acc: Tensor, rows: KeyRows, x: Tensor) -> None:
    """acc[rows] += x; index_add_ for cache slots, which sums rows that repeat, in order."""
    if isinstance(rows, slice):
        acc[rows] += x
    else:
        acc.index_add_(0, rows, x)


class MathBackend(BackendImpl):
    backend = Backend.MATH
    caps = Capabilities(
        devices=frozenset({"cpu", "cuda", "xpu", "mps", "hpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        paged=True,
        alibi_slopes_grad=True,  # its backward differentiates the bias -slope * |i' - j|
    )

    @classmethod
    @torch.no_grad()
    def forward(cls, call: PackedCall) -> AttnOutput:
        spec = call.spec
        q = call.q
        out = q.new_zeros(spec.total_q, spec.heads_q, spec.head_dim_v)
        lse = torch.full((spec.heads_q, spec.total_q), float("-inf"), dtype=torch.float32, device=q.device)
        for seq in sequences(call):
            shift = positions.shift_of(spec, seq.len_q, seq.k.shape[0])
            for block in blocks(spec, seq.len_q, seq.k.shape[0]):
                rows = slice(seq.q_start + block.r0, seq.q_start + block.r1)
                out[rows], lse[:, rows] = attend_block(
                    spec, q[rows], seq.k[block.lo:block.hi], seq.v[block.lo:block.hi], call.slopes_of(seq.b),
                    shift, block, call.dropout_key, seq.b)
        return AttnOutput(out, lse if spec.return_lse else None)

    @classmethod
    def backward(cls, call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor, state: object):
        """Per block, ``attend_block`` again under autograd (``out`` and ``lse`` are not read)."""
        spec = call.spec
        ct = compute_dtype(spec.dtype)
        device = call.q.device
        dq = torch.zeros_like(call.q)
        # dK/dV in the compute dtype, rounded once at the end; cache-shaped when paged.
        dk = torch.zeros(call.k.shape, dtype=ct, device=device)
        dv = torch.zeros(call.v.shape, dtype=ct, device=device)
        dk_rows, dv_rows = (dk.flatten(0, 1), dv.flatten(0, 1)) if spec.paged else (dk, dv)
        dslopes = None
        if spec.alibi_grad:
            dslopes = torch.zeros(call.alibi_slopes.shape, dtype=ct, device=device)
        for seq in sequences(call):
            len_k = seq.k.shape[0]
            shift = positions.shift_of(spec, seq.len_q, len_k)
            dk_b = torch.zeros(seq.k.shape, dtype=ct, device=device)
            dv_b = torch.zeros(seq.v.shape, dtype=ct, device=device)
            slopes = call.slopes_of(seq.b)
            ds_b = None if dslopes is None else torch.zeros(slopes.shape, dtype=ct, device=device)
            for block in blocks(spec, seq.len_q, len_k):
                rows = slice(seq.q_start + block.r0, seq.q_start + block.r1)
                keys = slice(block.lo, block.hi)
                with torch.enable_grad():
                    inputs = [t.detach().to(ct).requires_grad_() for t in (call.q[rows], seq.k[keys], seq.v[keys])]
                    s = None if slopes is None else slopes.detach().to(ct).requires_grad_(ds_b is not None)
                    block_out, _ = attend_block(spec, *inputs, s, shift, block, call.dropout_key, seq.b)
                    wrt = inputs + ([s] if ds_b is not None else [])
                    grads = torch.autograd.grad(block_out, wrt, grad_out[rows], allow_unused=True)
                grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, wrt)]
                dq[rows] = grads[0]
                dk_b[keys] += grads[1]
                dv_b[keys] += grads[2]
                if ds_b is not None:
                    ds_b += grads[3]
            _add_rows(dk_rows, seq.key_rows, dk_b)
            _add_rows(dv_rows, seq.key_rows, dv_b)
            if ds_b is not None:
                if dslopes.dim() == 1:
                    dslopes += ds_b
                else:
                    dslopes[seq.b] += ds_b
        grads = (dq, dk.to(call.k.dtype), dv.to(call.v.dtype))
        if dslopes is None:
            return grads
        return (*grads, dslopes.to(call.alibi_slopes.dtype))
