"""MATH: plain torch ops; runs on every device and takes every call.

It is the fallback for float64 and for machines without a C++ compiler, so memory stays bounded
whatever the lengths: each sequence is walked in blocks of query rows whose scores fit
``SCORE_BUDGET_BYTES``, each block multiplied only against the keys its rows can see (causal and
window calls skip the rest), never B x max_len^2 nor even one sequence's Lq x Lk.

The backward is our own (``ops.py`` calls it), not autograd over the forward, which would keep
every block's scores alive: per block it recomputes the forward's probabilities with the forward's
own function (``block_probs``, the one implementation of the score rule) and applies the
gradient formulas of ``attend_block_backward`` to them, so peak memory is one block in both
directions. No autograd runs inside it, so it works where autograd is off, e.g. under a
``TorchDispatchMode`` (FlopCounterMode, selective activation checkpointing). dK/dV (and the
ALiBi slopes' gradient, which only MATH gives) accumulate over blocks in the compute dtype; a
paged cache's gradient sums, sequence by sequence in order, into the blocks each sequence read, so
shared blocks accumulate deterministically.

fp16/bf16 are computed in float32 and rounded once at the end. Rows that see no key give 0 and lse
-inf, never NaN.

docs/api.md section 11: ``sinks`` add e^{sink_h} to every row's softmax denominator (the lse includes
it; a row that sees no key keeps out 0 and lse sink_h); their gradient is
dsink_h = -sum_i p_sink,i * rowsum(dP o P)_i (that rowsum is dO_i . O_i), summed per block.
``chunk_size`` and ``prefix_lens`` are position rules (``positions``): blocks see exactly the key
ranges their rows can see.
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
# A block's temporaries take a few times that: about 2x in the forward and 3x in the backward (P,
# dP and dP o P; 4x with a softcap, whose tanh it keeps), so under 64 MiB whatever the lengths.
# Tests shrink it to put block boundaries everywhere on small shapes.
SCORE_BUDGET_BYTES = 16 << 20
# Most elements of a dropout mask drawn at once (Philox's int64 temporaries: 2 MiB each).
MASK_CHUNK_ELEMENTS = 1 << 18


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
    widths = []
    if left >= 0 and right >= 0:
        widths.append(left + right)
    if spec.chunk_size is not None:  # rows [r0, r1) see keys within [r0 - (C - 1), r1 + C - 1)
        widths.append(2 * (spec.chunk_size - 1))
    if widths and not spec.prefix:  # rows * (rows + width) <= cap (a prefix row may see up to P keys)
        width = min(widths)
        rows = max(rows, (math.isqrt(width * width + 4 * cap) - width) // 2)
    return max(1, min(rows, len_q))


class Block(NamedTuple):
    """Query rows [r0, r1) of a sequence and the keys [lo, hi) they see."""

    r0: int
    r1: int
    lo: int
    hi: int


def blocks(spec: AttnSpec, len_q: int, len_k: int, prefix: int = 0) -> Iterator[Block]:
    """A sequence's blocks of query rows, in order. Blocks whose rows see no key are left out
    (their out stays 0, lse -inf (sink_h with sinks), gradients 0). Forward and backward walk the
    same blocks. ``prefix``: the sequence's prefix length P (prefix_lens)."""
    step = block_rows(spec, len_q, len_k)
    shift = positions.shift_of(spec, len_q, len_k)
    for r0 in range(0, len_q, step):
        r1 = min(len_q, r0 + step)
        lo = positions.visible_keys(spec, r0 + shift, len_k, prefix)[0]
        hi = positions.visible_keys(spec, r1 - 1 + shift, len_k, prefix)[1]  # both ends grow with the row
        if hi > lo:
            yield Block(r0, r1, lo, hi)


def _heads(spec: AttnSpec, x: Tensor) -> Tensor:
    """Rows (rows, Hq, d) -> (Hkv, G, rows, d) in the compute dtype: query head h = kvh * G + g
    pairs with kv head kvh (``.to`` leaves a tensor already in the compute dtype as it is)."""
    return x.to(compute_dtype(x.dtype)).unflatten(1, (spec.heads_kv, spec.gqa_group)).permute(1, 2, 0, 3)


def _kv_heads(x: Tensor) -> Tensor:
    """Keys (keys, Hkv, d) -> (Hkv, 1, keys, d) in the compute dtype, broadcast over the group."""
    return x.to(compute_dtype(x.dtype)).permute(1, 0, 2).unsqueeze(1)


class Probs(NamedTuple):
    """A block's softmax probabilities p (Hkv, G, rows, keys), 0 at masked keys and in rows that
    see no key; lse (Hq, rows); tanh(S0 / softcap) when the backward asks for it (else None);
    hidden (rows, keys), True at the pairs the masks remove (None without masks); p_sink
    (Hkv, G, rows, 1), the sink's share of each row, with sinks (else None)."""

    p: Tensor
    lse: Tensor
    tanh: Optional[Tensor]
    hidden: Optional[Tensor]
    p_sink: Optional[Tensor] = None


def _sink_heads(spec: AttnSpec, sinks: Optional[Tensor], ct: torch.dtype) -> Optional[Tensor]:
    """sinks (Hq,) -> (Hkv, G, 1, 1) in the compute dtype (query head h = kvh * G + g), or None."""
    return None if sinks is None else sinks.to(ct).view(spec.heads_kv, spec.gqa_group, 1, 1)


def block_probs(spec: AttnSpec, qh: Tensor, kh: Tensor, slopes: Optional[Tensor], shift: int, block: Block,
                keep_tanh: bool = False, prefix: int = 0, sinks: Optional[Tensor] = None) -> Probs:
    """The score rule, in docs/api.md's order, once for forward and backward: S0 = scale * Q K^T, the
    softcap cap * tanh(S0 / cap), ALiBi's -slope * |i' - j|, the causal/window/chunk/prefix masks,
    softmax (with ``sinks`` (Hq,): one more logit per head in the denominator, not scaled).
    GQA by broadcasting query groups against their kv head (no expanded K/V)."""
    ct = qh.dtype
    scores = torch.matmul(qh, kh.transpose(-1, -2)).mul_(spec.scale)  # (Hkv, G, rows, keys)
    tanh = hidden = None
    if spec.softcap:
        t = scores.div_(spec.softcap).tanh_()
        if keep_tanh:  # the backward's softcap derivative 1 - tanh^2
            tanh, scores = t, t * spec.softcap
        else:
            scores = t.mul_(spec.softcap)
    masks = spec.causal or spec.has_window or spec.chunk_size is not None
    if slopes is not None or masks:
        pos, j = positions.aligned_positions(block.r0, block.r1, block.lo, block.hi, shift, qh.device)
        if slopes is not None:
            scores.add_(positions.alibi_bias(slopes.to(ct), pos, j, ct).view(scores.shape))
        if masks:
            hidden = ~positions.keep_mask(spec, pos, j, prefix)
            scores.masked_fill_(hidden, float("-inf"))
    # A row max that is -inf (no key visible) is replaced by 0 so exp() gives exact zeros.
    row_max = scores.amax(dim=-1, keepdim=True)
    sink = _sink_heads(spec, sinks, ct)
    if sink is not None:  # the sink is one more logit of every row
        row_max = torch.maximum(row_max, sink.expand_as(row_max))
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = scores.sub_(row_max).exp_()
    denom = p.sum(dim=-1, keepdim=True)
    p_sink = None
    if sink is not None:
        p_sink = (sink - row_max).exp_()
        denom = denom + p_sink
        p_sink = p_sink.div_(torch.where(denom > 0, denom, torch.ones_like(denom)))
    lse = (row_max + torch.log(denom)).reshape(spec.heads_q, -1)
    p.div_(torch.where(denom > 0, denom, torch.ones_like(denom)))
    return Probs(p, lse, tanh, hidden, p_sink)


def _dropout_keep(spec: AttnSpec, key: Tensor, b: int, block: Block, shape: torch.Size, device) -> Tensor:
    """The keyed mask (``keyed_dropout``) of the block's probabilities, shaped like them: its
    (Hkv, G) heads flatten to the query heads in order, its rows and keys are in-sequence positions.
    Drawn a few rows at a time: Philox's int64 temporaries would take 8 bytes per element each
    for the whole block."""
    keys = torch.arange(block.lo, block.hi, device=device)
    keep = torch.empty(spec.heads_q, block.r1 - block.r0, block.hi - block.lo, dtype=torch.bool, device=device)
    step = max(1, MASK_CHUNK_ELEMENTS // (spec.heads_q * keys.numel()))
    for r in range(block.r0, block.r1, step):
        rows = torch.arange(r, min(r + step, block.r1), device=device)
        keep[:, r - block.r0:r - block.r0 + rows.numel()] = keyed_dropout.keep_mask(
            key, b, spec.heads_q, rows, keys, spec.dropout_p)
    return keep.view(shape)


def _drop(x: Tensor, keep: Tensor, p: float) -> Tensor:
    """x o Z / (1 - p) in place: dropout's factor, on the probabilities and on their gradient."""
    return x.mul_(keep).div_(1.0 - p)


def attend_block(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, slopes: Optional[Tensor], shift: int,
                 block: Block, dropout_key: Optional[Tensor] = None, b: int = 0, prefix: int = 0,
                 sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """One block: q (rows, Hq, D) against its keys k (keys, Hkv, D), v (keys, Hkv, Dv) ->
    out (rows, Hq, Dv) in q's dtype, lse (Hq, rows) in the compute dtype. Dropout drops key
    probabilities only (the sink's share is never dropped)."""
    p, lse, _, _, _ = block_probs(spec, _heads(spec, q), _kv_heads(k), slopes, shift, block, prefix=prefix,
                                  sinks=sinks)
    if spec.dropout_p:
        p = _drop(p, _dropout_keep(spec, dropout_key, b, block, p.shape, q.device), spec.dropout_p)
    out = torch.matmul(p, _kv_heads(v))                            # (Hkv, G, rows, Dv)
    return out.permute(2, 0, 1, 3).reshape(block.r1 - block.r0, spec.heads_q, -1).to(q.dtype), lse


class BlockGrads(NamedTuple):
    """One block's gradients in the compute dtype: dq (rows, Hq, D), dk (keys, Hkv, D), dv (keys,
    Hkv, Dv) summed over each GQA group, dslopes (Hq,) or None, dsinks (Hq,) or None."""

    dq: Tensor
    dk: Tensor
    dv: Tensor
    dslopes: Optional[Tensor]
    dsinks: Optional[Tensor] = None


def attend_block_backward(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor,
                          slopes: Optional[Tensor], shift: int, block: Block, dropout_key: Optional[Tensor] = None,
                          b: int = 0, slopes_grad: bool = False, prefix: int = 0, sinks: Optional[Tensor] = None,
                          sinks_grad: bool = False) -> BlockGrads:
    """The gradients of ``attend_block`` against grad_out (rows, Hq, Dv), from its probabilities
    recomputed by ``block_probs`` (S1 the scores after softcap and bias, Pd = P o Z / (1 - p)):

        dV = Pd^T dO    dP = (dO V^T) o Z / (1 - p)    dS1 = P o (dP - rowsum(dP o P))
        dslope_h = -sum dS1_h o |i' - j|    dS0 = dS1 o (1 - tanh^2(S0 / cap))
        dQ = scale dS0 K    dK = scale dS0^T Q

    The block sees all its keys at once, so rowsum(dP o P) comes from the block's own P (no saved
    out or lse). dK/dV sum over the query heads of a group inside one matmul. With sinks P
    already has the sink in its denominator, which leaves dS1 as it is, and
    dsink_h = -sum_i p_sink,i * rowsum(dP o P)_i."""
    qh, kh, vh = _heads(spec, q), _kv_heads(k), _kv_heads(v)
    do = _heads(spec, grad_out)                                    # (Hkv, G, rows, Dv)
    p, _, tanh, hidden, p_sink = block_probs(spec, qh, kh, slopes, shift, block, keep_tanh=True, prefix=prefix,
                                             sinks=sinks)
    keep = None
    if spec.dropout_p:
        keep = _dropout_keep(spec, dropout_key, b, block, p.shape, q.device)
    pd = p if keep is None else _drop(p.clone(), keep, spec.dropout_p)
    dv = torch.matmul(pd.flatten(1, 2).transpose(-1, -2), do.flatten(1, 2))  # (Hkv, keys, Dv)
    del pd
    dp = torch.matmul(do, vh.transpose(-1, -2))                   # (Hkv, G, rows, keys)
    if keep is not None:
        _drop(dp, keep, spec.dropout_p)
    delta = (dp * p).sum(dim=-1, keepdim=True)                     # rowsum(dP o P) = dO_i . O_i
    dsinks = None
    if sinks_grad:
        dsinks = -(p_sink * delta).sum(dim=(-2, -1)).reshape(spec.heads_q)
    ds = dp.sub_(delta).mul_(p)                                    # dS1
    if hidden is not None:  # exact zeros where masked, even in a NaN row (whose P is NaN there)
        ds.masked_fill_(hidden, 0.0)
    dslopes = None
    if slopes_grad:
        pos, j = positions.aligned_positions(block.r0, block.r1, block.lo, block.hi, shift, q.device)
        dist = positions.distance(pos, j, ds.dtype).flatten()
        dslopes = -torch.matmul(ds.reshape(spec.heads_q, -1), dist)
    if tanh is not None:
        ds.mul_(tanh.square_().neg_().add_(1.0))                  # dS0
    ds.mul_(spec.scale)
    dq = torch.matmul(ds, kh)                                     # (Hkv, G, rows, D)
    dk = torch.matmul(ds.flatten(1, 2).transpose(-1, -2), qh.flatten(1, 2))  # (Hkv, keys, D)
    rows = block.r1 - block.r0
    return BlockGrads(dq.permute(2, 0, 1, 3).reshape(rows, spec.heads_q, -1), dk.permute(1, 0, 2),
                      dv.permute(1, 0, 2), dslopes, dsinks)


KeyRows = Union[slice, tuple, Tensor]


class Sequence(NamedTuple):
    """Sequence b's query rows [q_start, q_start + len_q), its keys/values (a view of packed k/v or
    of a dense cache's row, or gathered from the paged cache) and where they live: a slice of packed
    k/v, (b, slice) of a dense cache, or the flat cache slots (LongTensor) of a paged cache."""

    b: int
    q_start: int
    len_q: int
    k: Tensor
    v: Tensor
    key_rows: KeyRows
    prefix: int = 0          # P_b of prefix_lens (docs/api.md section 11), 0 without


def paged_slots(call: PackedCall, b: int, length: int) -> Tensor:
    """Flat cache slots (block * block_size + offset) of sequence b's first ``length`` keys."""
    bs = call.spec.block_size
    ids = call.block_table[b, :-(-length // bs)].long()
    return (ids.unsqueeze(1) * bs + torch.arange(bs, device=ids.device)).flatten()[:length]


def sequences(call: PackedCall) -> Iterator[Sequence]:
    """Every sequence with at least one query row, in order; a paged sequence gathers only the
    cache slots that hold its keys."""
    q_ranges = call.query_ranges_host()
    prefixes = call.prefixes_host() if call.spec.prefix else None
    if prefixes is None:
        prefixes = (0,) * len(q_ranges)
    if call.spec.paged:
        used = call.seqused_k_host
        if used is None:
            used = tuple(call.seqused_k.tolist())
        if call.spec.dense_cache:  # views of each row's range: the cache is never copied
            starts = call.leftpad_host
            if starts is None:
                starts = (0,) * len(used) if call.cache_leftpad is None else tuple(call.cache_leftpad.tolist())
            for b, ((q_start, len_q), start, length) in enumerate(zip(q_ranges, starts, used)):
                if len_q:
                    keys = slice(start, start + length)
                    yield Sequence(b, q_start, len_q, call.k[b, keys], call.v[b, keys], (b, keys), prefixes[b])
            return
        k_flat, v_flat = call.k.flatten(0, 1), call.v.flatten(0, 1)
        for b, ((q_start, len_q), length) in enumerate(zip(q_ranges, used)):
            if len_q:
                slots = paged_slots(call, b, length)
                yield Sequence(b, q_start, len_q, k_flat.index_select(0, slots), v_flat.index_select(0, slots), slots,
                               prefixes[b])
        return
    for b, ((q_start, len_q), (k_start, len_k)) in enumerate(zip(q_ranges, call.key_ranges_host())):
        if len_q:
            keys = slice(k_start, k_start + len_k)
            yield Sequence(b, q_start, len_q, call.k[keys], call.v[keys], keys, prefixes[b])


def dequantized(x: Tensor, scale: Tensor) -> Tensor:
    """An fp8 cache's keys or values (keys, Hkv, d) as docs/api.md section 13 defines them:
    ``x.float() * scale``, scale () or (Hkv,)."""
    return x.float() * scale.view(-1, 1)


def _add_rows(acc: Tensor, rows: KeyRows, x: Tensor) -> None:
    """acc[rows] += x; index_add_ for cache slots, which sums rows that repeat, in order."""
    if isinstance(rows, (slice, tuple)):
        acc[rows] += x
    else:
        acc.index_add_(0, rows, x)


class MathBackend(BackendImpl):
    backend = Backend.MATH
    caps = Capabilities(
        devices=frozenset({"cpu", "cuda", "xpu", "mps", "hpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        paged=True,
        dense_cache=True,
        alibi_slopes_grad=True,  # its backward differentiates the bias -slope * |i' - j|
        sinks=True,
        sinks_grad=True,
        chunked=True,
        prefix=True,
        fp8_cache=True,  # dequantized per sequence: the reference of the kernels that read fp8 in place
    )

    @classmethod
    @torch.no_grad()
    def forward(cls, call: PackedCall) -> AttnOutput:
        spec = call.spec
        q = call.q
        out = q.new_zeros(spec.total_q, spec.heads_q, spec.head_dim_v)
        if spec.sinks:  # a row that sees no key has lse sink_h
            lse = call.sinks.to(torch.float32).unsqueeze(1).repeat(1, spec.total_q)
        else:
            lse = torch.full((spec.heads_q, spec.total_q), float("-inf"), dtype=torch.float32, device=q.device)
        for seq in sequences(call):
            if spec.cache_dtype is not None:
                seq = seq._replace(k=dequantized(seq.k, call.k_scale), v=dequantized(seq.v, call.v_scale))
            shift = positions.shift_of(spec, seq.len_q, seq.k.shape[0])
            for block in blocks(spec, seq.len_q, seq.k.shape[0], seq.prefix):
                rows = slice(seq.q_start + block.r0, seq.q_start + block.r1)
                out[rows], lse[:, rows] = attend_block(
                    spec, q[rows], seq.k[block.lo:block.hi], seq.v[block.lo:block.hi], call.slopes_of(seq.b),
                    shift, block, call.dropout_key, seq.b, seq.prefix, call.sinks)
        return AttnOutput(out, lse if spec.return_lse else None)

    @classmethod
    @torch.no_grad()
    def backward(cls, call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor, state: object):
        """Per block, ``attend_block_backward`` (``out`` and ``lse`` are not read). Explicit
        formulas, not autograd: it runs the same under a TorchDispatchMode (which excludes autograd)."""
        spec = call.spec
        ct = compute_dtype(spec.dtype)
        device = call.q.device
        dq = torch.zeros_like(call.q)
        # dK/dV in the compute dtype, rounded once at the end; cache-shaped when paged.
        dk = torch.zeros(call.k.shape, dtype=ct, device=device)
        dv = torch.zeros(call.v.shape, dtype=ct, device=device)
        flat = spec.paged and not spec.dense_cache
        dk_rows, dv_rows = (dk.flatten(0, 1), dv.flatten(0, 1)) if flat else (dk, dv)
        dslopes = dsinks = None
        if spec.alibi_grad:
            dslopes = torch.zeros(call.alibi_slopes.shape, dtype=ct, device=device)
        if spec.sinks_grad:
            dsinks = torch.zeros(spec.heads_q, dtype=ct, device=device)
        for seq in sequences(call):
            len_k = seq.k.shape[0]
            shift = positions.shift_of(spec, seq.len_q, len_k)
            dk_b = torch.zeros(seq.k.shape, dtype=ct, device=device)
            dv_b = torch.zeros(seq.v.shape, dtype=ct, device=device)
            ds_b = None if dslopes is None else torch.zeros(spec.heads_q, dtype=ct, device=device)
            for block in blocks(spec, seq.len_q, len_k, seq.prefix):
                rows = slice(seq.q_start + block.r0, seq.q_start + block.r1)
                keys = slice(block.lo, block.hi)
                g = attend_block_backward(spec, call.q[rows], seq.k[keys], seq.v[keys], grad_out[rows],
                                          call.slopes_of(seq.b), shift, block, call.dropout_key, seq.b,
                                          slopes_grad=ds_b is not None, prefix=seq.prefix, sinks=call.sinks,
                                          sinks_grad=dsinks is not None)
                dq[rows] = g.dq
                dk_b[keys] += g.dk
                dv_b[keys] += g.dv
                if ds_b is not None:
                    ds_b += g.dslopes
                if dsinks is not None:
                    dsinks += g.dsinks
            _add_rows(dk_rows, seq.key_rows, dk_b)
            _add_rows(dv_rows, seq.key_rows, dv_b)
            if ds_b is not None:
                if dslopes.dim() == 1:
                    dslopes += ds_b
                else:
                    dslopes[seq.b] += ds_b
        grads = (dq, dk.to(call.k.dtype), dv.to(call.v.dtype))
        if dslopes is not None:
            grads += (dslopes.to(call.alibi_slopes.dtype),)
        if dsinks is not None:
            grads += (dsinks.to(call.sinks.dtype),)
        return grads
