"""Forward attention kernel on packed ``thd`` buffers (and paged KV caches), with its launcher.

Computes, per sequence b and query head h, ``out = softmax(scores) @ V`` (dropout applied to the
probabilities) and the natural-log lse of each row, reference: ``tests/support/reference.py``.

Layout: q (total_q, Hq, D), k/v (total_k, Hkv, D/Dv) or paged (num_blocks, block_size, Hkv, D/Dv)
with a block table; every stride is passed, so non-contiguous views (a fused qkv buffer) work.
Grid: (row blocks of the longest sequence, Hq, B * num_splits). Each program reads its sequence's
bounds from cu_seqlens (or seqused_k), exits at once past the end, and walks only the key blocks its
rows can see (causal / window / chunk / prefix ranges, ``_common._visible_keys``), unmasked where
every row of the tile sees the whole block.
Sequences run heaviest first (``sequence_order``) and, inside a sequence, the last (for causal,
heaviest) query blocks first.
Decode-shaped calls (rules in ``launch_rules.py``): with num_splits > 1 each program takes one slice of
the keys and writes a float32 partial output and lse that ``merge_splits`` combines in one launch
(split-K); with PACK_GQA the grid's second axis is Hkv and a tile's rows are (query, head of the kv
group) pairs.
Features: GQA by ``kv_head = h // GROUP``, both causal alignments, window, softcap, ALiBi (per head
or per batch and head), sinks, chunk_size and prefix_lens (docs/api.md section 11; a sink joins each row's
denominator after the key loop), dropout (``keyed_dropout``'s mask, ``_common._dropout_keep``),
Dv != D, any head dim <= 256 (padded to a power of two and masked), zero-length sequences (zeros,
lse -inf; lse = sink with sinks), seqused_k.
Limits: bf16 under the Triton 3.9 interpreter is wrong (tl.dot and fp32->bf16 casts), so CPU
tests use fp32/fp16; bf16 is tested on CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jagged_sdpa.backends.triton import autotune_setting
from jagged_sdpa.backends.triton.launch_rules import MAX_SPLITS
from jagged_sdpa.backends.triton.mode import INTERPRETED, jit
from jagged_sdpa.backends.triton._common import (
    _cache_row, _dot, _dropout_keep, _fp8_widen, _key_offsets, _scores, _sequence_bounds, _visible_keys, alibi_args,
    dropout_key_args, fp8_args, head_dim_pad, kv_strides, launch, layout_flags, leftpad_arg, length_bucket, mask_args, on_device,
    sequence_order, shared_memory_limit, sink_args, table_args, tile_bytes_per_row,
)
from jagged_sdpa.spec import AttnOutput, PackedCall

AUTOTUNE = autotune_setting()


def default_configs() -> list[triton.Config]:
    """The default tiles as configs, widest first (``_prune`` picks one per call without autotuning)."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in DEFAULT_TILES]


def fwd_configs() -> list[triton.Config]:
    """One config under the interpreter. Compiled: by default one config per shape class, picked by
    ``_prune`` (prefill tiles of 128/64 rows, 16-row decode tiles, smaller tiles where a row is
    wide); with JAGGED_SDPA_TRITON_AUTOTUNE=1 a Hopper/Ampere set the autotuner benchmarks, plus
    the default tiles (what ``_prune`` falls back to when no other fits the shared memory)."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    if not AUTOTUNE:
        return default_configs()
    prefill = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)
    ]

    def keep(c):
        return not (c.kwargs["BLOCK_M"] == 128 and c.num_warps == 4) and not (
            c.kwargs["BLOCK_N"] == 128 and c.kwargs["BLOCK_M"] == 64)

    decode = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=s)
        for bm in (16, 32) for bn in (64, 128) for s in (2, 3)
    ]
    tuned = list(filter(keep, prefill)) + decode
    seen = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in tuned}
    return tuned + [c for c in default_configs()
                    if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) not in seen]


# Default tiles (BLOCK_M, BLOCK_N, warps, stages), widest first: the first that fits a call's row
# width (padded head dim x element size, in bytes) is used. Chosen from ptxas reports for sm_90
# (compile_check.py): the 128x64 prefill tile spills ~30 B at bf16 D=128, the others fit the
# shared memory of A100 (164 KB) and H100 (228 KB). To be replaced by measured choices on a GPU.
DEFAULT_TILES = (
    (128, 64, 8, 3),   # prefill, rows up to 256 B (bf16/fp16 D <= 128, fp32 D <= 64)
    (64, 64, 4, 2),    # prefill, rows up to 512 B
    (64, 32, 4, 1),    # prefill, wider rows (fp32 D=256)
    (16, 128, 4, 2),   # decode, rows up to 256 B
    (16, 64, 4, 2),    # decode, rows up to 512 B
    (16, 32, 4, 1),    # decode, wider rows
)
_TILE_ROW_BYTES = {(128, 64): 256, (64, 64): 512, (64, 32): 1 << 30, (16, 128): 256, (16, 64): 512,
                   (16, 32): 1 << 30}


def shared_bytes(config, named_args, kwargs) -> int:
    """Shared memory a forward config needs, estimated: the Q tile plus one K and one V tile per
    pipeline stage (padded head dims x element size)."""
    q = named_args.get("Q")
    size = q.element_size() if hasattr(q, "element_size") else 2
    d = kwargs.get("HEAD_DIM_PAD", 64)
    dv = kwargs.get("HEAD_DIM_V_PAD", d)
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    return size * (bm * d + max(config.num_stages, 1) * bn * (d + dv))


def _prune(configs, named_args, autotune=None, **kwargs):
    """Tile rows sized to the call (a decode step has GROUP rows at most, or one); tiles that fit
    the row width; without autotuning, the first (widest) such tile only. Autotuning keeps the
    configs whose shared memory fits the device, or else the default tile for the row width."""
    autotune = AUTOTUNE if autotune is None else autotune

    def arg(name, default):
        return kwargs.get(name, named_args.get(name, default))

    row_bytes = tile_bytes_per_row(named_args, kwargs)
    rows = arg("max_seqlen_q_bucket", 1024) * (arg("GROUP", 1) if arg("PACK_GQA", False) else 1)
    small = rows <= 32
    kept = [c for c in configs if (c.kwargs["BLOCK_M"] <= 32) == small]

    def by_rule(candidates):
        fitting = [c for c in candidates
                   if row_bytes <= _TILE_ROW_BYTES.get((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]), 0)]
        return fitting[:1]

    if not autotune:
        return by_rule(kept) or configs[-1:]
    d = row_bytes // 2
    kept = [c for c in kept if d <= 128 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
    limit = shared_memory_limit(named_args.get("Q"))
    if limit is not None:
        kept = [c for c in kept if shared_bytes(c, named_args, kwargs) <= limit]
    return kept or by_rule([c for c in configs if (c.kwargs["BLOCK_M"] <= 32) == small]) or configs[-1:]


@jit
def _fwd_inner(acc, l_i, m_i, q, K, V, BlockTableRow, stride_btn, b, offs_m, pos_q, row_valid, offs_d,
               offs_dv, start_k, len_k, lo, hi, kv_head_off_k, kv_head_off_v,
               stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
               sm_scale, softcap, slope, window_left, window_right, chunk_size, prefix_len, dropout_p, key_seed,
               key_offset, heads_col, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_BAND: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_PREFIX: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, IEEE: tl.constexpr,
               MASKED: tl.constexpr, FP8: tl.constexpr = 0):
    """Online softmax over the key blocks [lo, hi) of one sequence (exp2 of natural-unit differences); MASKED=False only for
    blocks every row of the tile sees."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < len_k
        k_rows = _key_offsets(offs_n, start_k, len_k, BlockTableRow, stride_btn, stride_kb, stride_kt, PAGED,
                              PAGE_SIZE)
        k = tl.load(K + kv_head_off_k + k_rows[None, :] + offs_d[:, None].to(tl.int64) * stride_kd,
                    mask=key_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        if FP8:  # exact in q's dtype; k_scale is in sm_scale
            k = _fp8_widen(k, FP8, q.dtype)
        qk = _dot(q, k, IEEE)
        s, _t = _scores(qk, pos_q, offs_n, len_k, row_valid, sm_scale, softcap, slope, window_left,
                        window_right, chunk_size, prefix_len, HAS_SOFTCAP, HAS_ALIBI, HAS_BAND, HAS_CHUNK,
                        HAS_PREFIX, MASKED)
        # The max stays in natural units (the scores as they are): the exponent (s - m) log2(e) is
        # then exact where s = m, and lse = m + log(l) is the top score itself in a one-hot row, so
        # the backward's exp(S - lse) gives P = 1 there. (Scaling s by log2(e) first rounded
        # s log2(e) and m / log2(e): ~|s| 2^-24 each, 5e-4 of P at |s| ~ 1e4.)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no key keep m = -inf; subtracting 0 instead avoids -inf - -inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2((s - m_safe[:, None]) * 1.4426950408889634)
        alpha = tl.math.exp2((m_i - m_safe) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = _dropout_keep(key_seed, key_offset, b, offs_m, heads_col, offs_n, dropout_p)
            p = tl.where(keep, p, 0.0)
        v_rows = _key_offsets(offs_n, start_k, len_k, BlockTableRow, stride_btn, stride_vb, stride_vt, PAGED,
                              PAGE_SIZE)
        v = tl.load(V + kv_head_off_v + v_rows[:, None] + offs_dv[None, :].to(tl.int64) * stride_vd,
                    mask=key_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        if FP8:  # v_scale multiplies the output
            v = _fp8_widen(v, FP8, q.dtype)
        acc += _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, l_i, m_i


# Per-call integers that vary from step to step are not specialised (Triton would compile a new
# variant whenever one becomes 1 or a multiple of 16): serving measured 1.8 s steps from that.
@jit(do_not_specialize=["key_seed", "key_offset", "num_splits", "window_left", "window_right", "chunk_size",
                        "max_seqlen_q_bucket", "max_seqlen_k_bucket"])
def _attn_fwd(
    Q, K, V, Out, Lse,                                   # tensors
    CuQ, CuK, SeqUsedK, BlockTable, Alibi, SeqOrder,     # int32 metadata, float32 slopes
    PrefixLens, Sinks, CacheLeftpad,                     # int32 (B,), float32 (Hq,) (docs/api.md section 11), int32 (B,)
    KScale, VScale, stride_ksh, stride_vsh,              # an fp8 cache's float32 scales, head stride 0 = per tensor
    stride_qt, stride_qh, stride_qd,                     # q (total_q, Hq, D)
    stride_kb, stride_kt, stride_kh, stride_kd,          # k (total_k, Hkv, D), (blocks, size, Hkv, D) or (B, S, Hkv, D)
    stride_vb, stride_vt, stride_vh, stride_vd,          # v, same with Dv
    stride_os, stride_ot, stride_oh, stride_od,          # out (splits, total_q, Hq, Dv); split stride 0 if none
    stride_ls, stride_lh, stride_lt,                     # lse (splits, Hq, total_q)
    stride_btb, stride_btn, stride_ab, stride_ah,        # block table row/column, alibi batch (0 = per head)/head
    sm_scale, softcap, window_left, window_right, chunk_size,  # runtime scalars
    dropout_p, key_seed, key_offset, num_splits,
    max_seqlen_q_bucket, max_seqlen_k_bucket,            # autotune keys only, never constexpr lengths
    GROUP: tl.constexpr,                                 # Hq // Hkv
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_BAND: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    HAS_SINKS: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DENSE: tl.constexpr, HAS_LEFTPAD: tl.constexpr,      # a dense (B, S, Hkv, D) cache read in place
    SPLIT_K: tl.constexpr,                               # num_splits > 1 (a runtime value: no recompile per count)
    PACK_GQA: tl.constexpr,                              # tile rows = (query, head of the kv group) pairs
    IEEE: tl.constexpr,
    FP8: tl.constexpr,                                   # K/V bytes: 0 q's dtype, else fp8 (fp8_args)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)                             # kv head with PACK_GQA, query head otherwise
    pid_z = tl.program_id(2)
    b = tl.load(SeqOrder + pid_z // num_splits)
    split = pid_z % num_splits
    start_q, len_q, start_k, len_k = _sequence_bounds(CuQ, CuK, SeqUsedK, CacheLeftpad, b, HAS_SEQUSED, PAGED, DENSE,
                                                      HAS_LEFTPAD)
    n_rows = len_q
    if PACK_GQA:
        n_rows = len_q * GROUP
    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    if pid_m >= n_blocks:
        return
    r0 = (n_blocks - 1 - pid_m) * BLOCK_M
    offs_r = r0 + tl.arange(0, BLOCK_M)
    if PACK_GQA:
        # Decode with GQA: the GROUP query heads sharing a kv head fill the tile instead of one
        # query padding it, so each K/V block is read once per kv head.
        kv_head = pid_h
        offs_m = offs_r // GROUP
        heads = kv_head * GROUP + offs_r % GROUP
        q_first = r0 // GROUP
        q_last = (r0 + BLOCK_M - 1) // GROUP
    else:
        kv_head = pid_h // GROUP
        offs_m = offs_r
        heads = pid_h + offs_r * 0
        q_first = r0
        q_last = r0 + BLOCK_M - 1

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    row_valid = offs_r < n_rows
    shift = 0
    if BOTTOM_RIGHT:
        shift = len_k - len_q
    pos_q = offs_m + shift

    q_rows = (start_q + offs_m).to(tl.int64) * stride_qt + heads.to(tl.int64) * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :].to(tl.int64) * stride_qd,
                mask=row_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    # Keys [lo, hi) are seen by some row of the tile; under a band, keys [full_lo, full_hi) by every
    # row (each row sees one range and both its ends grow with the row, ``_visible_keys``).
    lo = start_k * 0
    hi = len_k
    full_lo = start_k * 0
    full_hi = len_k
    prefix_len = 0
    if HAS_PREFIX:
        prefix_len = tl.load(PrefixLens + b)
    if HAS_BAND:
        lo, full_hi = _visible_keys(q_first + shift, len_k, window_left, window_right, chunk_size, prefix_len,
                                    HAS_CHUNK, HAS_PREFIX)
        full_lo, hi = _visible_keys(q_last + shift, len_k, window_left, window_right, chunk_size, prefix_len,
                                    HAS_CHUNK, HAS_PREFIX)
    if SPLIT_K:
        # Each tile splits the keys it sees, [lo, hi), into num_splits ranges that start on multiples
        # of 128 (of every BLOCK_N: no key block is read by two splits), sized by this sequence, not
        # by max_seqlen_k: sized by a server's static bound (131072), a 2k-key decode put all its
        # keys in split 0 and ran 3.5x slower on an H200. int64 throughout (no product can wrap). An
        # empty split becomes [0, 0), so both bounds fit int32 and no block below lo is read.
        base = (lo.to(tl.int64) // 128) * 128
        split_size = tl.cdiv(tl.cdiv(hi.to(tl.int64) - base, num_splits), 128) * 128
        split_lo = base + split.to(tl.int64) * split_size
        lo64 = tl.maximum(lo.to(tl.int64), split_lo)
        hi64 = tl.minimum(hi.to(tl.int64), split_lo + split_size)
        empty = lo64 >= hi64
        lo = tl.where(empty, 0, lo64).to(tl.int32)
        hi = tl.where(empty, 0, hi64).to(tl.int32)
    # A tile whose rows see no key (e.g. bottom-right causal, Lq > Lk) or an empty split gets
    # hi <= lo. Keep every bound >= 0 (``_visible_keys`` clamps them): Triton's integer division
    # truncates toward zero, so a negative hi made the interior range below start at a negative
    # key and read before the sequence, unmasked.
    hi = tl.maximum(hi, lo)
    lo = (lo // BLOCK_N) * BLOCK_N
    # Interior blocks [mid_lo, mid_hi), block-aligned inside [lo, hi), skip the mask.
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    mid_hi = tl.maximum(tl.minimum(full_hi // BLOCK_N, hi // BLOCK_N) * BLOCK_N, mid_lo)

    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b * stride_ab + heads * stride_ah)[:, None]
    if FP8:  # scale * q.(k k_scale) = (scale k_scale) q.k
        sm_scale = sm_scale * tl.load(KScale + kv_head * stride_ksh)
    heads_col = heads[:, None]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    table_row = BlockTable + b.to(tl.int64) * stride_btb
    cache_row = _cache_row(BlockTable, b, stride_btb, DENSE)
    k_head = kv_head.to(tl.int64) * stride_kh + cache_row * stride_kb
    v_head = kv_head.to(tl.int64) * stride_vh + cache_row * stride_vb
    if HAS_BAND:
        # Causal/window tiles: masked boundary blocks around an unmasked interior. (Without a band
        # the mask is one compare, and splitting off the last block measured more register spills
        # with ptxas for sm_90 than it saves.)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, table_row, stride_btn, b, offs_m, pos_q, row_valid, offs_d, offs_dv, start_k, len_k,
            lo, mid_lo, k_head, v_head, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
            sm_scale, softcap, slope, window_left, window_right, chunk_size, prefix_len, dropout_p, key_seed,
            key_offset, heads_col, HEAD_DIM, HEAD_DIM_V, BLOCK_N, HAS_BAND, HAS_CHUNK, HAS_PREFIX, HAS_SOFTCAP,
            HAS_ALIBI, HAS_DROPOUT, PAGED, PAGE_SIZE, IEEE,
            True, FP8)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, table_row, stride_btn, b, offs_m, pos_q, row_valid, offs_d, offs_dv, start_k, len_k,
            mid_lo, mid_hi, k_head, v_head, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
            sm_scale, softcap, slope, window_left, window_right, chunk_size, prefix_len, dropout_p, key_seed,
            key_offset, heads_col, HEAD_DIM, HEAD_DIM_V, BLOCK_N, HAS_BAND, HAS_CHUNK, HAS_PREFIX, HAS_SOFTCAP,
            HAS_ALIBI, HAS_DROPOUT, PAGED, PAGE_SIZE, IEEE,
            False, FP8)
        lo = mid_hi
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K, V, table_row, stride_btn, b, offs_m, pos_q, row_valid, offs_d, offs_dv, start_k, len_k,
        lo, hi, k_head, v_head, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
        sm_scale, softcap, slope, window_left, window_right, chunk_size, prefix_len, dropout_p, key_seed,
        key_offset, heads_col, HEAD_DIM, HEAD_DIM_V, BLOCK_N, HAS_BAND, HAS_CHUNK, HAS_PREFIX, HAS_SOFTCAP,
        HAS_ALIBI, HAS_DROPOUT, PAGED, PAGE_SIZE, IEEE,
        True, FP8)

    if HAS_SINKS:
        # The sink is one more logit of the row (not scaled, never dropped): it joins the online
        # softmax's denominator only. Under split-K the first split carries it (the merge adds the
        # splits' denominators). A row that saw no key then has out 0 and lse = sink.
        sink = tl.load(Sinks + heads)
        if SPLIT_K:
            sink = tl.where(split == 0, sink, float("-inf"))
        m_fin = tl.maximum(m_i, sink)
        m_safe = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.math.exp2((m_i - m_safe) * 1.4426950408889634)
        l_i = l_i * alpha + tl.math.exp2((sink - m_safe) * 1.4426950408889634)
        acc = acc * alpha[:, None]
        m_i = m_fin
    # A row that saw no key (nor a sink) has l = 0: it writes zeros and lse -inf, never 0/0. A NaN
    # score makes l NaN, which counts as seen: out and lse are NaN, as in dense SDPA.
    seen = l_i != 0.0
    inv_l = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    if FP8:
        out = out * tl.load(VScale + kv_head * stride_vsh)
    lse = tl.where(seen, m_i + tl.math.log(tl.where(seen, l_i, 1.0)), float("-inf"))

    o_rows = (start_q + offs_m).to(tl.int64) * stride_ot + heads.to(tl.int64) * stride_oh
    o_ptrs = Out + split.to(tl.int64) * stride_os + o_rows[:, None] + offs_dv[None, :].to(tl.int64) * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_valid[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    l_ptrs = (Lse + split.to(tl.int64) * stride_ls + heads.to(tl.int64) * stride_lh
              + (start_q + offs_m).to(tl.int64) * stride_lt)
    tl.store(l_ptrs, lse, mask=row_valid)


_AUTOTUNE_KEY = ["max_seqlen_q_bucket", "max_seqlen_k_bucket", "HEAD_DIM", "HEAD_DIM_V", "GROUP", "HAS_BAND",
                 "HAS_CHUNK", "HAS_PREFIX", "HAS_SINKS", "HAS_SOFTCAP", "HAS_ALIBI", "HAS_DROPOUT", "PAGED", "DENSE",
                 "SPLIT_K", "PACK_GQA", "FP8"]
CONFIGS = fwd_configs()
# Without autotuning the kernel is launched directly with ``_prune``'s one config (``launch``).
_attn_fwd_jit = _attn_fwd
if AUTOTUNE:
    _attn_fwd = triton.autotune(configs=CONFIGS, key=_AUTOTUNE_KEY,
                                prune_configs_by={"early_config_prune": _prune})(_attn_fwd_jit)


def launch_fwd(call: PackedCall, *, num_splits: int = 1, pack_gqa: bool = False) -> AttnOutput:
    """Run the forward kernel; with num_splits > 1 each split writes a partial (merged by
    ``merge_splits``) and this returns the float32 partial out (S, total_q, Hq, Dv) and lse
    (S, Hq, total_q) instead of the final ones. pack_gqa puts a kv group's query heads in one tile."""
    spec = call.spec
    q = call.q
    k, v, k_scale, v_scale, stride_ksh, stride_vsh, fp8 = fp8_args(call)
    total_q, heads_q = q.shape[0], q.shape[1]
    batch = call.cu_seqlens_q.shape[0] - 1
    if num_splits > 1:
        out = torch.empty((num_splits, total_q, heads_q, spec.head_dim_v), device=q.device, dtype=torch.float32)
        lse = torch.empty((num_splits, heads_q, total_q), device=q.device, dtype=torch.float32)
    else:
        out = torch.empty((1, total_q, heads_q, spec.head_dim_v), device=q.device, dtype=q.dtype)
        lse = torch.empty((1, heads_q, total_q), device=q.device, dtype=torch.float32)
    if batch == 0 or total_q == 0:
        return AttnOutput(out[0] if num_splits == 1 else out, lse[0] if num_splits == 1 else lse)
    (left, right, chunk, prefix), mask_flags = mask_args(call)
    slopes, stride_ab, stride_ah = alibi_args(call)
    block_table, stride_btb, stride_btn = table_args(call)
    seqused = call.seqused_k if call.seqused_k is not None else call.cu_seqlens_q
    cu_k = call.cu_seqlens_k if call.cu_seqlens_k is not None else call.cu_seqlens_q
    group = spec.heads_q // spec.heads_kv
    rows = max(spec.max_seqlen_q, 1) * (group if pack_gqa else 1)
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), spec.heads_kv if pack_gqa else heads_q,
                         batch * num_splits)
    q_bucket = length_bucket(spec.max_seqlen_q)
    args = (
        q, k, v, out, lse,
        call.cu_seqlens_q, cu_k, seqused, block_table, slopes, sequence_order(call), prefix, sink_args(call),
        leftpad_arg(call), k_scale, v_scale, stride_ksh, stride_vsh,
        *q.stride(),
        *kv_strides(k, spec.paged),
        *kv_strides(v, spec.paged),
        *out.stride(),
        *lse.stride(),
        stride_btb, stride_btn, stride_ab, stride_ah,
        spec.scale, spec.softcap or 1.0, left, right, chunk,
        spec.dropout_p, *dropout_key_args(call), num_splits,
        q_bucket, length_bucket(spec.max_seqlen_k),
    )
    kwargs = dict(
        GROUP=group,
        HEAD_DIM=spec.head_dim, HEAD_DIM_PAD=head_dim_pad(spec.head_dim),
        HEAD_DIM_V=spec.head_dim_v, HEAD_DIM_V_PAD=head_dim_pad(spec.head_dim_v),
        BOTTOM_RIGHT=spec.alignment == "bottom_right", **mask_flags, HAS_SOFTCAP=bool(spec.softcap),
        HAS_ALIBI=spec.alibi is not None, HAS_DROPOUT=spec.dropout_p > 0, HAS_SEQUSED=call.seqused_k is not None,
        HAS_SINKS=spec.sinks, **layout_flags(call),
        SPLIT_K=num_splits > 1, PACK_GQA=pack_gqa, IEEE=q.dtype == torch.float32, FP8=fp8,
    )
    with on_device(q):
        launch(_attn_fwd, CONFIGS, _prune, grid, args, kwargs, {"Q": q, "max_seqlen_q_bucket": q_bucket}, AUTOTUNE)
    if num_splits > 1:
        return AttnOutput(out, lse)
    return AttnOutput(out[0], lse[0])


@jit(do_not_specialize=["num_splits"])
def _merge_splits(
    OutParts, LseParts, Out, Lse, num_splits,
    stride_ps, stride_pt, stride_ph, stride_pd,          # partial out (splits, total_q, Hq, Dv), float32
    stride_ls, stride_lh, stride_lt,                     # partial lse (splits, Hq, total_q), float32
    stride_ot, stride_oh, stride_od,                     # out (total_q, Hq, Dv), q's dtype
    stride_mh, stride_mt,                                # lse (Hq, total_q), float32
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    MAX_S: tl.constexpr,                                 # launch_rules.MAX_SPLITS: one variant for every count
):
    """Program (row, head): ``lse = logsumexp_s lse_s`` (torch's rule: the max shifted to 0 when
    infinite, so all -inf gives -inf and a NaN gives NaN), ``out = sum_s w_s out_s`` with
    ``w_s = exp(lse_s - lse)`` (lse taken as 0 when not finite) and 0 for a non-finite lse_s. Every
    split's out is multiplied, weight 0 included, so a NaN partial stays NaN."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, MAX_S)
    lse_row = LseParts + h * stride_lh + t * stride_lt
    x = tl.load(lse_row + offs_s.to(tl.int64) * stride_ls, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(x, 0)
    m = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    total = tl.sum(tl.exp(x - m), 0)  # 0 only when every split is empty (then m is 0)
    lse = tl.where(total == 0.0, float("-inf"), tl.log(tl.where(total == 0.0, 1.0, total))) + m
    shift = tl.where(tl.abs(lse) < float("inf"), lse, 0.0)
    offs_d = tl.arange(0, HEAD_DIM_V_PAD)
    d_ok = offs_d < HEAD_DIM_V
    part = OutParts + t * stride_pt + h * stride_ph + offs_d.to(tl.int64) * stride_pd
    acc = tl.zeros([HEAD_DIM_V_PAD], dtype=tl.float32)
    for _s in range(0, num_splits):
        x_s = tl.load(lse_row)
        w = tl.where(tl.abs(x_s) < float("inf"), tl.exp(x_s - shift), 0.0)
        acc += w * tl.load(part, mask=d_ok, other=0.0)
        lse_row += stride_ls  # pointers advance: s * stride in int32 could wrap
        part += stride_ps
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d.to(tl.int64) * stride_od, acc.to(Out.dtype.element_ty),
             mask=d_ok)
    tl.store(Lse + h * stride_mh + t * stride_mt, lse)


def merge_splits(out_parts: torch.Tensor, lse_parts: torch.Tensor, dtype: torch.dtype):
    """Split-K's float32 partials, out (S, total_q, Hq, Dv) and lse (S, Hq, total_q), merged by
    ``_merge_splits`` in one launch (the torch form took ~12 ops, host time a decode call is made
    of): out (total_q, Hq, Dv) in ``dtype``, lse (Hq, total_q) float32. Empty splits carry lse
    -inf and weigh 0; a row empty in every split gets out 0 and lse -inf."""
    splits, total_q, heads, dv = out_parts.shape
    if splits > MAX_SPLITS:
        raise ValueError(f"{splits} splits > {MAX_SPLITS} (launch_rules.MAX_SPLITS)")
    out = torch.empty((total_q, heads, dv), device=out_parts.device, dtype=dtype)
    lse = torch.empty((heads, total_q), device=out_parts.device, dtype=torch.float32)
    if total_q * heads == 0:
        return out, lse
    with on_device(out_parts):
        _merge_splits[(total_q, heads)](
            out_parts, lse_parts, out, lse, splits, *out_parts.stride(), *lse_parts.stride(), *out.stride(),
            *lse.stride(), HEAD_DIM_V=dv, HEAD_DIM_V_PAD=head_dim_pad(dv), MAX_S=MAX_SPLITS, num_warps=1)
    return out, lse
