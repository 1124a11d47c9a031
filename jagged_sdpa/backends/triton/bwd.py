"""Backward attention kernels on packed ``thd`` buffers, with their launcher.

Mirrors ``fwd.py``: ``_attn_bwd_delta`` computes ``delta = rowsum(out * grad_out)`` first (rounded
as dP is, so a one-hot row's dS is exactly 0), then two
kernels recompute the probabilities from q, k and the forward's lse (``P = exp(S - lse)``;
reference: the float64 ``tests/support/reference.py`` differentiated by autograd):

* ``_attn_bwd_dkdv``: grid (key blocks of the longest sequence, Hkv * GROUP_SPLITS, B). One program
  owns a key block of one kv head and loops over (its share of) the GROUP query heads that share it
  and over the query blocks whose rows see it, so dK/dV are reduced across the query group in
  registers (and, with GROUP_SPLITS > 1, over float32 partials afterwards): no expanded K/V, no
  atomics, deterministic.
* ``_attn_bwd_dq``: grid (query blocks, Hq, B). One program owns a query block and loops over the
  key blocks its rows can see.

The position rules (band, chunk, prefix) and their block bounds are the forward's
(``_common._visible_keys``; the dK/dV loop uses its inverse ``_visible_rows``). Sinks need nothing
in the kernels: the forward's lse includes them, so P = exp(S - lse) is already right;
dsink_h = -sum_i exp(sink_h - lse_i) delta_i is computed from lse and delta afterwards (``sink_grad``).

With dropout Z (keep / (1 - p), the forward's mask recomputed from the call's key):
dV = (P o Z)^T dO, dP = (dO V^T) o Z, dS = P o (dP - delta); softcap multiplies dS by 1 - tanh^2; dQ = scale dS K, dK = scale dS^T Q.
Same features and limits as the forward, except the paged KV cache (forward-only: blocks shared by
several rows would need atomics); a dense cache's rows are never shared, so its dK/dV are written
in place of the cache's shape (``DENSE``: row base + (leftpad + j) * token stride).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jagged_sdpa.backends.triton import autotune_setting
from jagged_sdpa.backends.triton.mode import INTERPRETED, jit
from jagged_sdpa.backends.triton._common import (
    _cache_row, _dot, _dropout_keep, _scores, _sequence_bounds, _visible_keys, _visible_rows, alibi_args,
    dropout_key_args, head_dim_pad, launch, layout_flags, leftpad_arg, length_bucket, mask_args, on_device,
    sequence_order, shared_memory_limit, table_args, tile_bytes_per_row,
)
from jagged_sdpa.spec import PackedCall

AUTOTUNE = autotune_setting()


def bwd_configs() -> list[triton.Config]:
    """One config under the interpreter. Compiled: one per row width by default (``_prune``), a
    set to benchmark with JAGGED_SDPA_TRITON_AUTOTUNE=1."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    defaults = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                for bm, bn, w, s, _ in DEFAULT_TILES]
    if not AUTOTUNE:
        return defaults
    tuned = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn in ((32, 64), (64, 64), (64, 32), (32, 128)) for w in (4, 8) for s in (1, 2)
    ]
    seen = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in tuned}
    return tuned + [c for c in defaults if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                    not in seen]


# Default tiles (BLOCK_M, BLOCK_N, warps, stages, widest row in bytes = padded head dim x element
# size), widest first; from ptxas reports for sm_90 (compile_check.py): 64x64 at bf16 D=128 uses
# 82 KB of shared memory in dK/dV; the narrower tiles keep fp32 and D=256 under A100's 164 KB.
DEFAULT_TILES = (
    (64, 64, 8, 2, 256),
    (32, 64, 4, 1, 512),
    (16, 32, 4, 1, 1 << 30),
)


def shared_bytes(config, named_args, kwargs) -> int:
    """Shared memory a backward config needs, estimated: the K and V tiles of the key block plus
    one Q and one dO tile per pipeline stage (padded head dims x element size)."""
    q = named_args.get("Q")
    size = q.element_size() if hasattr(q, "element_size") else 2
    d = kwargs.get("HEAD_DIM_PAD", 64)
    dv = kwargs.get("HEAD_DIM_V_PAD", d)
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    return size * (bn * (d + dv) + max(config.num_stages, 1) * bm * (d + dv))


def _prune(configs, named_args, autotune=None, **kwargs):
    """The first default tile that fits the row width; autotuning: the configs that fit the
    device's shared memory, or else that default tile."""
    autotune = AUTOTUNE if autotune is None else autotune
    row_bytes = tile_bytes_per_row(named_args, kwargs)
    widest = {(bm, bn, w, st): row for bm, bn, w, st, row in DEFAULT_TILES}

    def by_rule(candidates):
        return [c for c in candidates if row_bytes <= widest.get(
            (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages), 0)][:1]

    if not autotune:
        return by_rule(configs) or configs[-1:]
    d = row_bytes // 2
    kept = [c for c in configs if d <= 64 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64 // (d // 64)]
    limit = shared_memory_limit(named_args.get("Q"))
    if limit is not None:
        kept = [c for c in kept if shared_bytes(c, named_args, kwargs) <= limit]
    return kept or by_rule(configs) or configs[-1:]


_AUTOTUNE_KEY = ["max_seqlen_q_bucket", "max_seqlen_k_bucket", "HEAD_DIM", "HEAD_DIM_V", "GROUP", "HAS_BAND",
                 "HAS_CHUNK", "HAS_PREFIX", "HAS_SOFTCAP", "HAS_ALIBI", "HAS_DROPOUT"]


@jit
def _attn_bwd_delta(
    Out, DO, Delta,                                      # out, grad_out (total_q, Hq, Dv); delta float32 (Hq, total_q)
    CuQ,                                                 # int32 (B + 1,)
    stride_ot, stride_oh, stride_od,
    stride_dot, stride_doh, stride_dod,
    stride_lh, stride_lt,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr,
):
    """delta = rowsum(out * grad_out) in float32, one pass over both (no float32 copies); grid
    (row blocks of the longest sequence, Hq, B).

    It is the diagonal of dO O^T computed by ``_dot`` as dP = dO V^T is (same operand dtypes, same
    padded reduction length, same precision, and row blocks starting where the dK/dV and dQ
    kernels' do, at multiples of the block inside each sequence): in a row whose P is one-hot, O is
    that key's value row, so delta equals that key's dP and dS = P (dP - delta) is 0, as in MATH.
    A tl.sum rounds differently, and at large logits (|q| ~ 1e2) dq/dk picked up that rounding
    times scale |q|."""
    head = tl.program_id(1)
    b = tl.program_id(2)
    start_q = tl.load(CuQ + b)
    len_q = tl.load(CuQ + b + 1) - start_q
    m0 = tl.program_id(0) * BLOCK_T
    if m0 >= len_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_T)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    rows = (start_q + offs_m).to(tl.int64)
    row_ok = offs_m < len_q
    mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    o = tl.load(Out + head.to(tl.int64) * stride_oh + rows[:, None] * stride_ot
                + offs_dv[None, :].to(tl.int64) * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + head.to(tl.int64) * stride_doh + rows[:, None] * stride_dot
                 + offs_dv[None, :].to(tl.int64) * stride_dod, mask=mask, other=0.0)
    products = _dot(do, tl.trans(o.to(do.dtype)), IEEE)
    diagonal = tl.arange(0, BLOCK_T)[:, None] == tl.arange(0, BLOCK_T)[None, :]
    delta = tl.sum(tl.where(diagonal, products, 0.0), 1)
    tl.store(Delta + head.to(tl.int64) * stride_lh + rows * stride_lt, delta, mask=row_ok)


@jit
def _probabilities(q, kT, lse, offs_m, offs_n, len_q, len_k, shift, sm_scale, softcap, slope, window_left,
                   window_right, chunk_size, prefix_len, HAS_BAND: tl.constexpr, HAS_CHUNK: tl.constexpr,
                   HAS_PREFIX: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   IEEE: tl.constexpr):
    """P = exp(S - lse) (0 where masked, and for rows whose lse is -inf) and tanh(s / c). With
    sinks the lse includes the sink, so P is already the probability and dS needs nothing more."""
    qk = _dot(q, kT, IEEE)
    s, tanh_s = _scores(qk, offs_m + shift, offs_n, len_k, offs_m < len_q, sm_scale, softcap, slope,
                        window_left, window_right, chunk_size, prefix_len, HAS_SOFTCAP, HAS_ALIBI, HAS_BAND,
                        HAS_CHUNK, HAS_PREFIX, True)
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    p = tl.math.exp2((s - lse_safe[:, None]) * 1.4426950408889634)
    return p, tanh_s


@jit
def _grad_scores(p, dp, delta, tanh_s, HAS_SOFTCAP: tl.constexpr):
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - tanh_s * tanh_s)
    return ds


@jit(do_not_specialize=["key_seed", "key_offset", "chunk_size"])
def _attn_bwd_dkdv(
    Q, K, V, DO, Lse, Delta, DK, DV,                     # tensors; lse/delta float32 (Hq, total_q)
    CuQ, CuK, SeqUsedK, Alibi, SeqOrder, PrefixLens,     # int32 metadata, float32 slopes
    CacheLeftpad, BlockTable,                            # a dense cache's int32 (B,) leftpad and (B, 1) rows
    stride_qt, stride_qh, stride_qd,                     # q (total_q, Hq, D)
    stride_kb, stride_kt, stride_kh, stride_kd,          # k (total_k, Hkv, D) (stride_kb 0) or a dense (B, S, Hkv, D)
    stride_vb, stride_vt, stride_vh, stride_vd,          # v likewise with Dv
    stride_dot, stride_doh, stride_dod,                  # grad_out (total_q, Hq, Dv)
    stride_lh, stride_lt,                                # lse and delta (Hq, total_q)
    stride_dks, stride_dkb, stride_dkt, stride_dkh, stride_dkd,  # dk like k, or float32 partials (splits, *k.shape)
    stride_dvs, stride_dvb, stride_dvt, stride_dvh, stride_dvd,  # dv likewise
    stride_btb, stride_ab, stride_ah,                    # block table row, alibi batch (0 = per head) and head
    sm_scale, softcap, window_left, window_right, chunk_size, dropout_p, key_seed, key_offset,
    max_seqlen_q_bucket, max_seqlen_k_bucket,            # autotune keys only
    GROUP: tl.constexpr,
    GROUP_SPLITS: tl.constexpr,                          # programs sharing one kv head's query group
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_BAND: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    DENSE: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1) // GROUP_SPLITS
    group_split = tl.program_id(1) % GROUP_SPLITS
    b = tl.load(SeqOrder + tl.program_id(2))
    start_q, len_q, start_k, len_k = _sequence_bounds(CuQ, CuK, SeqUsedK, CacheLeftpad, b, HAS_SEQUSED, False,
                                                      DENSE, HAS_LEFTPAD)
    cache_row = _cache_row(BlockTable, b, stride_btb, DENSE)
    n_blocks = tl.cdiv(len_k, BLOCK_N)
    if pid_n >= n_blocks:
        return
    n0 = (n_blocks - 1 - pid_n) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    key_ok = offs_n < len_k
    shift = 0
    if BOTTOM_RIGHT:
        shift = len_k - len_q

    k_rows = (start_k + offs_n).to(tl.int64)
    # K and V transposed: (D, BLOCK_N), ready for q @ kT and do @ vT.
    kT = tl.load(K + cache_row * stride_kb + kv_head.to(tl.int64) * stride_kh + k_rows[None, :] * stride_kt
                 + offs_d[:, None].to(tl.int64) * stride_kd,
                 mask=key_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
    vT = tl.load(V + cache_row * stride_vb + kv_head.to(tl.int64) * stride_vh + k_rows[None, :] * stride_vt
                 + offs_dv[:, None].to(tl.int64) * stride_vd,
                 mask=key_ok[None, :] & (offs_dv[:, None] < HEAD_DIM_V), other=0.0)

    # Query rows i whose visible keys reach this key block (``_visible_rows``, aligned positions
    # clamped to the sequence's rows [shift, len_q + shift) before shifting back: no overflow).
    prefix_len = 0
    if HAS_PREFIX:
        prefix_len = tl.load(PrefixLens + b)
    lo = 0
    hi = len_q
    if HAS_BAND:
        p_lo, p_hi = _visible_rows(n0, tl.minimum(n0 + BLOCK_N, len_k), window_left, window_right, chunk_size,
                                   prefix_len, HAS_CHUNK, HAS_PREFIX)
        lo = tl.maximum(p_lo, shift) - shift
        hi = tl.maximum(tl.minimum(p_hi, len_q + shift) - shift, lo)
    lo = (lo // BLOCK_M) * BLOCK_M

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V_PAD], dtype=tl.float32)
    for g in range(GROUP // GROUP_SPLITS):
        head = kv_head * GROUP + group_split * (GROUP // GROUP_SPLITS) + g
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Alibi + b * stride_ab + head * stride_ah)
        for m0 in range(lo, hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < len_q
            rows = (start_q + offs_m).to(tl.int64)
            q = tl.load(Q + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qt
                        + offs_d[None, :].to(tl.int64) * stride_qd,
                        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
            do = tl.load(DO + head.to(tl.int64) * stride_doh + rows[:, None] * stride_dot
                         + offs_dv[None, :].to(tl.int64) * stride_dod,
                         mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
            lse = tl.load(Lse + head.to(tl.int64) * stride_lh + rows * stride_lt, mask=row_ok, other=0.0)
            delta = tl.load(Delta + head.to(tl.int64) * stride_lh + rows * stride_lt, mask=row_ok, other=0.0)
            p, tanh_s = _probabilities(q, kT, lse, offs_m, offs_n, len_q, len_k, shift, sm_scale, softcap, slope,
                                       window_left, window_right, chunk_size, prefix_len, HAS_BAND, HAS_CHUNK,
                                       HAS_PREFIX, HAS_SOFTCAP, HAS_ALIBI, IEEE)
            dp = _dot(do, vT, IEEE)
            if HAS_DROPOUT:
                keep = _dropout_keep(key_seed, key_offset, b, offs_m, head, offs_n, dropout_p)
                scale_keep = tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
                dv += _dot(tl.trans(p * scale_keep).to(do.dtype), do, IEEE)
                dp = dp * scale_keep
            else:
                dv += _dot(tl.trans(p).to(do.dtype), do, IEEE)
            ds = _grad_scores(p, dp, delta, tanh_s, HAS_SOFTCAP)
            dk += _dot(tl.trans(ds).to(q.dtype), q, IEEE)

    dk = dk * sm_scale
    tl.store(DK + group_split.to(tl.int64) * stride_dks + cache_row * stride_dkb + kv_head.to(tl.int64) * stride_dkh
             + k_rows[:, None] * stride_dkt
             + offs_d[None, :].to(tl.int64) * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(DV + group_split.to(tl.int64) * stride_dvs + cache_row * stride_dvb + kv_head.to(tl.int64) * stride_dvh
             + k_rows[:, None] * stride_dvt
             + offs_dv[None, :].to(tl.int64) * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=key_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


@jit(do_not_specialize=["key_seed", "key_offset", "chunk_size"])
def _attn_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ,
    CuQ, CuK, SeqUsedK, Alibi, SeqOrder, PrefixLens, CacheLeftpad, BlockTable,
    stride_qt, stride_qh, stride_qd,                     # q (total_q, Hq, D)
    stride_kb, stride_kt, stride_kh, stride_kd,          # k (total_k, Hkv, D) (stride_kb 0) or a dense (B, S, Hkv, D)
    stride_vb, stride_vt, stride_vh, stride_vd,          # v likewise with Dv
    stride_dot, stride_doh, stride_dod,                  # grad_out (total_q, Hq, Dv)
    stride_lh, stride_lt,                                # lse and delta (Hq, total_q)
    stride_dqt, stride_dqh, stride_dqd,                  # dq like q
    stride_btb, stride_ab, stride_ah,
    sm_scale, softcap, window_left, window_right, chunk_size, dropout_p, key_seed, key_offset,
    max_seqlen_q_bucket, max_seqlen_k_bucket,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_BAND: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    DENSE: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.load(SeqOrder + tl.program_id(2))
    start_q, len_q, start_k, len_k = _sequence_bounds(CuQ, CuK, SeqUsedK, CacheLeftpad, b, HAS_SEQUSED, False,
                                                      DENSE, HAS_LEFTPAD)
    cache_row = _cache_row(BlockTable, b, stride_btb, DENSE)
    n_blocks = tl.cdiv(len_q, BLOCK_M)
    if pid_m >= n_blocks:
        return
    m0 = (n_blocks - 1 - pid_m) * BLOCK_M
    kv_head = head // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    row_ok = offs_m < len_q
    shift = 0
    if BOTTOM_RIGHT:
        shift = len_k - len_q
    rows = (start_q + offs_m).to(tl.int64)
    q = tl.load(Q + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qt
                + offs_d[None, :].to(tl.int64) * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    do = tl.load(DO + head.to(tl.int64) * stride_doh + rows[:, None] * stride_dot
                 + offs_dv[None, :].to(tl.int64) * stride_dod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    lse = tl.load(Lse + head.to(tl.int64) * stride_lh + rows * stride_lt, mask=row_ok, other=0.0)
    delta = tl.load(Delta + head.to(tl.int64) * stride_lh + rows * stride_lt, mask=row_ok, other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b * stride_ab + head * stride_ah)

    # Keys [lo, hi) some row of the block sees (``_visible_keys`` of its first and last row).
    prefix_len = 0
    if HAS_PREFIX:
        prefix_len = tl.load(PrefixLens + b)
    lo = 0
    hi = len_k
    if HAS_BAND:
        lo, _hi = _visible_keys(m0 + shift, len_k, window_left, window_right, chunk_size, prefix_len, HAS_CHUNK,
                                HAS_PREFIX)
        _lo, hi = _visible_keys(m0 + BLOCK_M - 1 + shift, len_k, window_left, window_right, chunk_size, prefix_len,
                                HAS_CHUNK, HAS_PREFIX)
        hi = tl.maximum(hi, lo)
    lo = (lo // BLOCK_N) * BLOCK_N

    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < len_k
        k_rows = (start_k + offs_n).to(tl.int64)
        kT = tl.load(K + cache_row * stride_kb + kv_head.to(tl.int64) * stride_kh + k_rows[None, :] * stride_kt
                     + offs_d[:, None].to(tl.int64) * stride_kd,
                     mask=key_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        vT = tl.load(V + cache_row * stride_vb + kv_head.to(tl.int64) * stride_vh + k_rows[None, :] * stride_vt
                     + offs_dv[:, None].to(tl.int64) * stride_vd,
                     mask=key_ok[None, :] & (offs_dv[:, None] < HEAD_DIM_V), other=0.0)
        p, tanh_s = _probabilities(q, kT, lse, offs_m, offs_n, len_q, len_k, shift, sm_scale, softcap, slope,
                                   window_left, window_right, chunk_size, prefix_len, HAS_BAND, HAS_CHUNK,
                                   HAS_PREFIX, HAS_SOFTCAP, HAS_ALIBI, IEEE)
        dp = _dot(do, vT, IEEE)
        if HAS_DROPOUT:
            keep = _dropout_keep(key_seed, key_offset, b, offs_m, head, offs_n, dropout_p)
            dp = dp * tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
        ds = _grad_scores(p, dp, delta, tanh_s, HAS_SOFTCAP)
        dq += _dot(ds.to(kT.dtype), tl.trans(kT), IEEE)

    dq = dq * sm_scale
    tl.store(DQ + head.to(tl.int64) * stride_dqh + rows[:, None] * stride_dqt
             + offs_d[None, :].to(tl.int64) * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dsink_h = -sum_i p_sink,i delta_i over the rows of head h, in the sinks' dtype: p_sink =
    exp(sink_h - lse_i) is the sink's share of row i (the lse includes it) and delta_i = dO_i . O_i
    (MATH's ``attend_block_backward``). float32 torch ops on (Hq, total_q): no kernel needed."""
    sink = sinks.to(torch.float32).unsqueeze(1)
    p_sink = torch.where(lse == float("-inf"), 0.0, torch.exp(sink - lse))  # a sink of -inf: no share
    return (-(p_sink * delta).sum(1)).to(sinks.dtype)


CONFIGS = bwd_configs()
# Without autotuning the kernels are launched directly with ``_prune``'s one config (``launch``);
# the gradients are allocated zeroed, which is all reset_to_zero did for a single run.
_attn_bwd_dkdv_jit, _attn_bwd_dq_jit = _attn_bwd_dkdv, _attn_bwd_dq
if AUTOTUNE:
    _attn_bwd_dkdv = triton.autotune(configs=CONFIGS, key=_AUTOTUNE_KEY + ["GROUP_SPLITS", "DENSE"],
                                     prune_configs_by={"early_config_prune": _prune},
                                     reset_to_zero=["DK", "DV"])(_attn_bwd_dkdv_jit)
    _attn_bwd_dq = triton.autotune(configs=CONFIGS, key=_AUTOTUNE_KEY + ["DENSE"],
                                   prune_configs_by={"early_config_prune": _prune},
                                   reset_to_zero=["DQ"])(_attn_bwd_dq_jit)


def _kv_strides(t: torch.Tensor, dense: bool) -> tuple[int, int, int, int]:
    """(row, token, head, dim) strides of packed (total, H, D) K/V (row stride 0) or a dense cache."""
    return tuple(t.stride()) if dense else (0, *t.stride())


def launch_bwd(call: PackedCall, out, lse, grad_out, *, group_splits: int = 1):
    """(dq, dk, dv[, dsinks]) in the shapes of call.q/k/v (and of the sinks when they need a
    gradient; packed keys or a dense cache, whose dk/dv are cache-shaped and zero outside each
    row's keys; see the module docstring). group_splits > 1 spreads each kv head's query group over
    that many dK/dV programs, which write float32 partials summed here
    (``launch_rules.plan_group_splits``)."""
    spec = call.spec
    q, k, v = call.q, call.k, call.v
    dense = bool(spec.dense_cache)
    dq = torch.zeros(q.shape, device=q.device, dtype=q.dtype)
    batch = call.cu_seqlens_q.shape[0] - 1
    if batch == 0 or q.shape[0] == 0 or k.numel() == 0:  # every out row is 0: so is every gradient
        grads = (dq, torch.zeros(k.shape, device=k.device, dtype=k.dtype),
                 torch.zeros(v.shape, device=v.device, dtype=v.dtype))
        return grads + ((torch.zeros_like(call.sinks),) if spec.sinks_grad else ())
    part_dtype = torch.float32 if group_splits > 1 else k.dtype
    dk_parts = torch.zeros((group_splits, *k.shape), device=k.device, dtype=part_dtype)
    dv_parts = torch.zeros((group_splits, *v.shape), device=v.device, dtype=part_dtype)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    (left, right, chunk, prefix), mask_flags = mask_args(call)
    slopes, stride_ab, stride_ah = alibi_args(call)
    table, stride_btb, _ = table_args(call)
    seqused = call.seqused_k if call.seqused_k is not None else call.cu_seqlens_q
    cu_k = call.cu_seqlens_k if call.cu_seqlens_k is not None else call.cu_seqlens_q
    order = sequence_order(call)
    common = dict(
        GROUP=spec.heads_q // spec.heads_kv,
        HEAD_DIM=spec.head_dim, HEAD_DIM_PAD=head_dim_pad(spec.head_dim),
        HEAD_DIM_V=spec.head_dim_v, HEAD_DIM_V_PAD=head_dim_pad(spec.head_dim_v),
        BOTTOM_RIGHT=spec.alignment == "bottom_right", **mask_flags, HAS_SOFTCAP=bool(spec.softcap),
        HAS_ALIBI=spec.alibi is not None, HAS_DROPOUT=spec.dropout_p > 0, HAS_SEQUSED=call.seqused_k is not None,
        DENSE=dense, HAS_LEFTPAD=layout_flags(call)["HAS_LEFTPAD"],
        IEEE=q.dtype == torch.float32,
    )
    scalars = (spec.scale, spec.softcap or 1.0, left, right, chunk, spec.dropout_p, *dropout_key_args(call),
               length_bucket(spec.max_seqlen_q), length_bucket(spec.max_seqlen_k))
    metadata = (call.cu_seqlens_q, cu_k, seqused, slopes, order, prefix, leftpad_arg(call), table)
    kv = (*q.stride(), *_kv_strides(k, dense), *_kv_strides(v, dense), *grad_out.stride(), *lse.stride())
    part_strides = lambda t: (t.stride(0), *_kv_strides(t[0], dense))  # noqa: E731
    max_k, max_q = max(spec.max_seqlen_k, 1), max(spec.max_seqlen_q, 1)
    named = {"Q": q, "max_seqlen_q_bucket": length_bucket(spec.max_seqlen_q)}
    with on_device(q):
        block_t = 16 if INTERPRETED else 64
        _attn_bwd_delta[(triton.cdiv(max_q, block_t), spec.heads_q, batch)](
            out, grad_out, delta, call.cu_seqlens_q, *out.stride(), *grad_out.stride(), *delta.stride(),
            HEAD_DIM_V=spec.head_dim_v, HEAD_DIM_V_PAD=head_dim_pad(spec.head_dim_v), BLOCK_T=block_t,
            IEEE=q.dtype == torch.float32,
        )
        launch(_attn_bwd_dkdv, CONFIGS, _prune,
               lambda meta: (triton.cdiv(max_k, meta["BLOCK_N"]), spec.heads_kv * group_splits, batch),
               (q, k, v, grad_out, lse, delta, dk_parts, dv_parts, *metadata, *kv,
                *part_strides(dk_parts), *part_strides(dv_parts), stride_btb, stride_ab, stride_ah, *scalars),
               dict(GROUP_SPLITS=group_splits, **common), named, AUTOTUNE)
        launch(_attn_bwd_dq, CONFIGS, _prune,
               lambda meta: (triton.cdiv(max_q, meta["BLOCK_M"]), spec.heads_q, batch),
               (q, k, v, grad_out, lse, delta, dq, *metadata, *kv, *dq.stride(), stride_btb, stride_ab, stride_ah,
                *scalars),
               common, named, AUTOTUNE)
    grads = (dq, dk_parts.sum(0).to(k.dtype), dv_parts.sum(0).to(v.dtype)) if group_splits > 1 else (
        dq, dk_parts[0], dv_parts[0])
    return grads + ((sink_grad(call.sinks, lse, delta),) if spec.sinks_grad else ())
