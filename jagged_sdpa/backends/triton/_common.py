"""Pieces shared by the forward and backward Triton kernels: score transforms, masks, key
addressing (packed or paged), the dropout mask (``keyed_dropout``'s rule), and the host-side
argument helpers.

The score of query row i (aligned position i') and key j is, in this order: ``scale * q.k``,
softcap ``c * tanh(s / c)``, ALiBi ``- slope * |i' - j|``, then the position mask: row i' sees the
keys [lo, hi) of ``_visible_keys`` (``positions.visible_keys`` in Triton: the band
``i' - left <= j <= i' + right`` with causal as ``right = 0``, ANDed with the chunk of i' when
``chunk_size`` is set, and widened to [0, max(hi, P)) for prefix rows i' < P of ``prefix_lens``).
Both passes call the same helpers so forward and backward can never disagree about a mask or a
dropout draw, nor the loop bounds (derived from the same ranges) about the keys a mask keeps.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from jagged_sdpa.backends import keyed_dropout
from jagged_sdpa.backends.triton.mode import INTERPRETED, jit

_INTERPRETED = tl.constexpr(INTERPRETED)  # a global a kernel may read

# Stand-in for an unbounded window side: far beyond any sequence, far from int32 overflow.
UNBOUNDED = 1 << 30


@jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1) saturates cleanly to +-1 and needs no libdevice (the interpreter has none).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs would otherwise go through TF32 on Ampere+, far outside fp32 tolerances.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@jit
def _key_offsets(offs_n, start_k, len_k, BlockTableRow, stride_btn, stride_kb, stride_kt, PAGED: tl.constexpr,
                 PAGE_SIZE: tl.constexpr):
    """int64 element offset of key j = offs_n of this sequence (without the head/dim part). A dense
    cache is addressed as packed keys from its row's base: start_k is then cache_leftpad[b]."""
    if PAGED:
        # The table's column stride is honoured: nothing makes a (B, max_blocks) table contiguous.
        entry = BlockTableRow + (offs_n // PAGE_SIZE).to(tl.int64) * stride_btn
        block = tl.load(entry, mask=offs_n < len_k, other=0)
        return block.to(tl.int64) * stride_kb + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kt
    else:
        return (start_k + offs_n).to(tl.int64) * stride_kt


@jit
def _fp8_widen(x, FP8: tl.constexpr, DTYPE: tl.constexpr):
    """fp8 bytes (uint8) to DTYPE (q's dtype), exactly (every value of both formats is exact in
    float16, bfloat16 and float32). FP8 (``fp8_args``): 1 float8_e4m3fn, 2 float8_e5m2, 3
    float8_e4m3fn on a GPU that converts it itself (sm89+: two values per instruction; the integer
    decoding made the fp8 decode kernel ~3x slower than bf16 on an H200). e5m2 is the top byte of a
    float16: one shift. The interpreter decodes in integers (it gets fp8 NaN wrong)."""
    if _INTERPRETED:
        return _fp8_to_f32(x, 1 if FP8 == 3 else FP8).to(DTYPE)
    elif FP8 == 3:
        return x.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    elif FP8 == 2:
        return (x.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(DTYPE)
    else:
        return _fp8_to_f32(x, FP8).to(DTYPE)


@jit
def _fp8_to_f32(x, FP8: tl.constexpr):
    """fp8 bytes (uint8) to float32, exactly, by bit manipulation: FP8 1 = float8_e4m3fn (bias 7,
    S.1111.111 is NaN, no inf), 2 = float8_e5m2 (bias 15, inf and NaN at exponent 31). Decoded in
    integers because Triton's own fp8 casts differ across versions and its interpreter gets NaN
    wrong; every value of both formats is exact in float16, bfloat16 and float32."""
    bits = x.to(tl.uint32)
    sign = (bits >> 7) << 31
    if FP8 == 1:
        e = (bits >> 3) & 15
        m = bits & 7
        normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        small = m.to(tl.float32) * 0.001953125                      # m/8 * 2^-6
        special = (bits & 127) == 127
        special_bits = sign * 0 + 0x7FC00000
    else:
        e = (bits >> 2) & 31
        m = bits & 3
        normal = (sign | ((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        small = m.to(tl.float32) * 0.0000152587890625               # m/4 * 2^-14
        special = e == 31
        special_bits = tl.where(m == 0, sign | 0x7F800000, sign * 0 + 0x7FC00000)
    value = tl.where(e == 0, tl.where(sign != 0, -small, small), normal)
    return tl.where(special, special_bits.to(tl.float32, bitcast=True), value)


@jit
def _floor_div(a, c):
    """floor(a / c) for c > 0 and any sign of a. Triton's ``//`` truncates toward zero (C's rule),
    so only non-negative numerators are divided: a negative position is in chunk -1 or below."""
    return tl.where(a >= 0, a, 0) // c - tl.where(a < 0, (c - 1 - a) // c, 0)


@jit
def _visible_keys(pos, len_k, window_left, window_right, chunk_size, prefix_len,
                  HAS_CHUNK: tl.constexpr, HAS_PREFIX: tl.constexpr):
    """Keys [lo, hi) (0 <= lo, hi <= len_k; none when hi <= lo) seen by the row at aligned
    position ``pos`` (a scalar or a vector of rows): ``positions.visible_keys``. Both ends grow
    with pos, so rows [p0, p1] together see [lo(p0), hi(p1)) and every one of them [lo(p1), hi(p0))."""
    lo = tl.maximum(pos - window_left, 0)
    hi = tl.minimum(pos + window_right + 1, len_k)
    if HAS_CHUNK:
        start = _floor_div(pos, chunk_size) * chunk_size
        lo = tl.maximum(lo, start)
        hi = tl.minimum(hi, start + chunk_size)
    if HAS_PREFIX:
        # A prefix row's own keys start at or below pos < P: with the prefix they make [0, max(hi, P)).
        in_prefix = pos < prefix_len
        lo = tl.where(in_prefix, 0, lo)
        hi = tl.where(in_prefix, tl.maximum(hi, prefix_len), hi)
    return tl.minimum(lo, len_k), tl.maximum(tl.minimum(hi, len_k), 0)


@jit
def _visible_rows(n0, n1, window_left, window_right, chunk_size, prefix_len,
                  HAS_CHUNK: tl.constexpr, HAS_PREFIX: tl.constexpr):
    """Aligned positions [lo, hi) of the rows that see some key of [n0, n1) (0 <= n0 < n1 <= len_k):
    the inverse of ``_visible_keys``. A row sees one iff its hi > n0 and its lo < n1; both ends
    grow with the row, so those rows are one range: hi(p) > n0 needs p + right >= n0 and p's chunk
    at or after n0's, lo(p) < n1 needs p - left < n1 and p's chunk at or before n1 - 1's. When n0 < P
    every prefix row sees key n0 too (and the first bound is already <= n0 < P)."""
    lo = n0 - window_right
    hi = n1 + window_left
    if HAS_CHUNK:
        lo = tl.maximum(lo, (n0 // chunk_size) * chunk_size)
        hi = tl.minimum(hi, ((n1 - 1) // chunk_size + 1) * chunk_size)
    if HAS_PREFIX:
        lo = tl.where(n0 < prefix_len, -1073741824, lo)  # -UNBOUNDED: below every row
        hi = tl.where(n0 < prefix_len, tl.maximum(hi, prefix_len), hi)
    return lo, hi


@jit
def _scores(qk, pos_q, offs_n, len_k, row_valid, sm_scale, softcap, slope, window_left, window_right,
            chunk_size, prefix_len, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BAND: tl.constexpr,
            HAS_CHUNK: tl.constexpr, HAS_PREFIX: tl.constexpr, MASKED: tl.constexpr):
    """Transformed, masked scores (natural units) and, for softcap's backward, tanh(s / c).

    MASKED=False skips the mask for key blocks every row of the tile sees (interior blocks)."""
    s = qk * sm_scale
    tanh_s = s
    if HAS_SOFTCAP:
        tanh_s = _tanh(s / softcap)
        s = softcap * tanh_s
    if HAS_ALIBI:
        dist = (pos_q[:, None] - offs_n[None, :]).to(tl.float32)
        s = s - slope * tl.abs(dist)
    if MASKED:
        keep = row_valid[:, None] & (offs_n[None, :] < len_k)
        if HAS_BAND:
            lo, hi = _visible_keys(pos_q, len_k, window_left, window_right, chunk_size, prefix_len, HAS_CHUNK,
                                   HAS_PREFIX)
            keep = keep & (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
        s = tl.where(keep, s, float("-inf"))
    return s, tanh_s


@jit
def _sequence_bounds(CuQ, CuK, SeqUsedK, CacheLeftpad, b, HAS_SEQUSED: tl.constexpr, PAGED: tl.constexpr,
                     DENSE: tl.constexpr, HAS_LEFTPAD: tl.constexpr):
    """Sequence b's query rows and key rows (paged: keys start at 0 of its block table row; a dense
    cache: at cache_leftpad[b] of its cache row, 0 without leftpad)."""
    start_q = tl.load(CuQ + b)
    len_q = tl.load(CuQ + b + 1) - start_q
    if PAGED:
        start_k = start_q * 0
        len_k = tl.load(SeqUsedK + b)
    elif DENSE:
        start_k = start_q * 0
        if HAS_LEFTPAD:
            start_k = tl.load(CacheLeftpad + b)
        len_k = tl.load(SeqUsedK + b)
    else:
        start_k = tl.load(CuK + b)
        if HAS_SEQUSED:
            len_k = tl.load(SeqUsedK + b)
        else:
            len_k = tl.load(CuK + b + 1) - start_k
    return start_q, len_q, start_k, len_k


@jit
def _cache_row(BlockTable, b, stride_btb, DENSE: tl.constexpr):
    """A dense cache's row of sequence b (its block table's one entry) as an int64, 0 otherwise."""
    row = b.to(tl.int64) * 0
    if DENSE:
        row = tl.load(BlockTable + b.to(tl.int64) * stride_btb).to(tl.int64)
    return row


@jit
def _dropout_keep(key_seed, key_offset, b, rows, heads, offs_n, dropout_p):
    """``keyed_dropout``'s keep mask (rows x keys): uniform(philox((seed, offset); j, i, h, b)[0]) >= p,
    with i (rows) and j (offs_n) positions inside sequence b. The key words arrive as int32 bit
    patterns (``dropout_key_args``); tl.philox takes them as one 64-bit seed, low word first."""
    seed = key_seed.to(tl.uint32, bitcast=True).to(tl.uint64)
    seed = seed | (key_offset.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
    zeros = tl.zeros([rows.shape[0], offs_n.shape[0]], dtype=tl.uint32)
    c0 = zeros + offs_n[None, :].to(tl.uint32)
    c1 = zeros + rows[:, None].to(tl.uint32)
    c2 = zeros + heads.to(tl.uint32)
    c3 = zeros + b.to(tl.uint32)
    r0, _r1, _r2, _r3 = tl.philox(seed, c0, c1, c2, c3)
    return tl.uint_to_uniform_float(r0) >= dropout_p


def dropout_key_args(call) -> tuple[int, int]:
    """The call's dropout key (``keyed_dropout``) as two int32 bit patterns, (0, 0) without dropout.
    Triton types an int >= 2**31 as int64, which would compile a second variant of each kernel."""
    if not call.spec.dropout_p:
        return 0, 0
    seed, offset = keyed_dropout.key_words(call.dropout_key)
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in (seed, offset))


def on_device(t: torch.Tensor):
    """Launch on the tensor's GPU, not the current one (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def tile_bytes_per_row(named_args: dict, kwargs: dict) -> int:
    """Padded head dim x element size of q: what decides which tiles fit in shared memory."""
    def arg(name, default):
        return kwargs.get(name, named_args.get(name, default))

    d = max(arg("HEAD_DIM_PAD", 64), arg("HEAD_DIM_V_PAD", 64))
    q = named_args.get("Q")
    return d * (q.element_size() if hasattr(q, "element_size") else 2)


def head_dim_pad(d: int) -> int:
    """tl.dot needs power-of-two extents >= 16; the extra dims are masked."""
    return max(16, triton.next_power_of_2(d))


def mask_args(call) -> tuple[tuple[int, int, int, torch.Tensor], dict]:
    """The position mask's kernel arguments: (window_left, window_right, chunk_size, prefix_lens or
    a dummy int32 tensor) and the constexprs HAS_BAND (rows see a key range: causal, window or
    chunk; a prefix only widens one), HAS_CHUNK and HAS_PREFIX. Unbounded sides are UNBOUNDED,
    causal is folded into right."""
    spec = call.spec
    left, right = spec.window
    left = UNBOUNDED if left < 0 else left
    right = UNBOUNDED if right < 0 else right
    if spec.causal:
        right = min(right, 0)
    has_band = spec.causal or spec.has_window or spec.chunk_size is not None
    prefix = call.prefix_lens if spec.prefix else call.cu_seqlens_q
    flags = dict(HAS_BAND=has_band, HAS_CHUNK=spec.chunk_size is not None, HAS_PREFIX=spec.prefix and has_band)
    return (left, right, spec.chunk_size or 1, prefix), flags


def sink_args(call) -> torch.Tensor:
    """The sinks (Hq,) in float32 (docs/api.md section 11 computes them in float32), or a dummy without sinks."""
    return call.sinks.to(torch.float32).contiguous() if call.spec.sinks else call.cu_seqlens_q


def length_bucket(n: int) -> int:
    """Autotune key for a sequence length: its power-of-two bucket, so lengths never recompile."""
    return triton.next_power_of_2(max(int(n), 1))


@jit
def _work(CuQ, CuK, SeqUsedK, b, valid, HAS_SEQUSED: tl.constexpr):
    """Lq * (Lk + 1) of sequences b (int64; keys from seqused_k when given, else cu_seqlens_k)."""
    len_q = tl.load(CuQ + b + 1, mask=valid, other=0).to(tl.int64) - tl.load(CuQ + b, mask=valid, other=0)
    if HAS_SEQUSED:
        len_k = tl.load(SeqUsedK + b, mask=valid, other=0).to(tl.int64)
    else:
        len_k = tl.load(CuK + b + 1, mask=valid, other=0).to(tl.int64) - tl.load(CuK + b, mask=valid, other=0)
    return len_q * (len_k + 1)


@jit(do_not_specialize=["n_seq"])
def _sequence_order(Order, CuQ, CuK, SeqUsedK, n_seq, HAS_SEQUSED: tl.constexpr, BLOCK: tl.constexpr):
    """Program i ranks sequences [i BLOCK, (i + 1) BLOCK): rank b = #{j: w_j > w_b} + #{j < b: w_j == w_b},
    a stable descending sort, and writes Order[rank b] = b. Ranks of any lengths (bad ones are the
    device checks' business) form a permutation, so Order never indexes outside the batch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mine = offs < n_seq
    w = _work(CuQ, CuK, SeqUsedK, offs, mine, HAS_SEQUSED)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, n_seq, BLOCK):
        offs_j = j0 + tl.arange(0, BLOCK)
        w_j = _work(CuQ, CuK, SeqUsedK, offs_j, offs_j < n_seq, HAS_SEQUSED)
        ahead = (w_j[None, :] > w[:, None]) | ((w_j[None, :] == w[:, None]) & (offs_j[None, :] < offs[:, None]))
        rank += tl.sum((ahead & (offs_j[None, :] < n_seq)).to(tl.int32), 1)
    tl.store(Order + rank, offs, mask=mine)


def sequence_order(call) -> torch.Tensor:
    """Batch indices heaviest first (Lq * Lk), computed on the device by one kernel: no host sync
    (argsort and the lengths around it took ~8 launches, host time a decode call is made of).

    Programs launch in grid order, so the long sequences of a long-tail batch start first instead
    of running alone at the end.
    """
    cu_q = call.cu_seqlens_q
    batch = cu_q.shape[0] - 1
    order = torch.empty(max(batch, 0), dtype=torch.int32, device=cu_q.device)
    if batch <= 0:
        return order
    cu_k = call.cu_seqlens_k if call.cu_seqlens_k is not None else cu_q
    used = call.seqused_k if call.seqused_k is not None else cu_q
    block = 64
    with on_device(cu_q):
        _sequence_order[(triton.cdiv(batch, block),)](order, cu_q, cu_k, used, batch,
                                                       HAS_SEQUSED=call.seqused_k is not None, BLOCK=block)
    return order


def alibi_args(call):
    """(slopes tensor or a dummy, batch stride, head stride): per_head slopes broadcast with batch
    stride 0. Both strides are passed: slopes may be any view (``s[::2]``)."""
    slopes = call.alibi_slopes
    if slopes is None:
        return call.cu_seqlens_q, 0, 0
    if slopes.dim() == 1:
        return slopes, 0, slopes.stride(0)
    return slopes, slopes.stride(0), slopes.stride(1)


def table_args(call):
    """(block table or a dummy, row stride, column stride): the table may be any view."""
    table = call.block_table
    if table is None or not call.spec.paged:
        return call.cu_seqlens_q, 0, 0
    return table, table.stride(0), table.stride(1)


def leftpad_arg(call) -> torch.Tensor:
    """cache_leftpad (B,) of a dense cache, or a dummy."""
    return call.cache_leftpad if call.spec.leftpad and call.cache_leftpad is not None else call.cu_seqlens_q


def fp8_args(call):
    """An fp8 cache (docs/api.md section 13): k and v as uint8 views (the kernels decode the bytes,
    ``_fp8_widen``), the scales and their head strides (0 = per tensor), and FP8 (0 none, 1
    float8_e4m3fn, 2 float8_e5m2, 3 float8_e4m3fn converted by the GPU: sm89 and later)."""
    dtype = call.spec.cache_dtype
    if dtype is None:
        return call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_q, 0, 0, 0
    k_scale, v_scale = call.k_scale.reshape(-1), call.v_scale.reshape(-1)
    return (call.k.view(torch.uint8), call.v.view(torch.uint8), k_scale, v_scale,
            k_scale.stride(0) if k_scale.numel() > 1 else 0, v_scale.stride(0) if v_scale.numel() > 1 else 0,
            2 if dtype == torch.float8_e5m2 else 3 if (call.spec.capability or (0, 0)) >= (8, 9) else 1)


def layout_flags(call) -> dict:
    """PAGED (keys through the block table, PAGE_SIZE a constexpr) or DENSE (keys at
    ``row * stride_kb + (leftpad + j) * stride_kt``: a dense cache's length S is never a constexpr,
    so a cache growing by one slot per decode step does not recompile)."""
    spec = call.spec
    dense = bool(spec.dense_cache)
    paged = spec.paged and not dense
    return dict(PAGED=paged, DENSE=dense, HAS_LEFTPAD=dense and spec.leftpad and call.cache_leftpad is not None,
                PAGE_SIZE=spec.block_size if paged else 16)


@functools.cache
def _cuda_shared_memory(index: int) -> Optional[int]:
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # an older driver API: torch's opt-in figure, when it has one
        props = torch.cuda.get_device_properties(index)
        value = getattr(props, "shared_memory_per_block_optin", None)
        return int(value) if value else None


def shared_memory_limit(t) -> Optional[int]:
    """Bytes of shared memory one program may use on t's GPU; None off CUDA (no limit to prune by)."""
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        return None
    return _cuda_shared_memory(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch(kernel, configs, prune, grid, args, kwargs, named, autotune: bool):
    """Run ``kernel`` (an autotuner when ``autotune``) with the config ``prune`` picks. Without
    autotuning the kernel is a plain JIT function launched with that config: an autotuner over one
    config still benchmarks it on every new key in Triton < 3.7 (a device sync and ~0.1 s per
    shape bucket, and a failed CUDA-graph capture when a new bucket first appears inside one)."""
    if autotune:
        kernel[grid](*args, **kwargs)
        return None
    config = prune(configs, named, **kwargs)[0]
    kernel[grid](*args, **kwargs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    return config


def kv_strides(t: torch.Tensor, paged: bool) -> tuple[int, int, int, int]:
    """(block, token, head, dim) strides of packed (total, H, D) or paged (blocks, size, H, D) K/V."""
    if paged:
        return t.stride(0), t.stride(1), t.stride(2), t.stride(3)
    return 0, t.stride(0), t.stride(1), t.stride(2)
