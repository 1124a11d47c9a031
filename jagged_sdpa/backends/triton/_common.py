"""Pieces shared by the forward and backward Triton kernels: score transforms, masks, key
addressing (packed or paged), the dropout mask (``keyed_dropout``'s rule), and the host-side
argument helpers.

The score of query row i (aligned position i') and key j is, in this order: ``scale * q.k``,
softcap ``c * tanh(s / c)``, ALiBi ``- slope * |i' - j|``, then the band mask
``i' - left <= j <= i' + right`` (causal is ``right = 0``). Both passes call the same helpers so
forward and backward can never disagree about a mask or a dropout draw.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from jagged_sdpa.backends import keyed_dropout

# Stand-in for an unbounded window side: far beyond any sequence, far from int32 overflow.
UNBOUNDED = 1 << 30


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1) saturates cleanly to +-1 and needs no libdevice (the interpreter has none).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs would otherwise go through TF32 on Ampere+, far outside fp32 tolerances.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _key_offsets(offs_n, start_k, len_k, BlockTableRow, stride_kb, stride_kt, PAGED: tl.constexpr,
                 PAGE_SIZE: tl.constexpr):
    """int64 element offset of key j = offs_n of this sequence (without the head/dim part)."""
    if PAGED:
        block = tl.load(BlockTableRow + offs_n // PAGE_SIZE, mask=offs_n < len_k, other=0)
        return block.to(tl.int64) * stride_kb + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kt
    else:
        return (start_k + offs_n).to(tl.int64) * stride_kt


@triton.jit
def _scores(qk, pos_q, offs_n, len_k, row_valid, sm_scale, softcap, slope, window_left, window_right,
            HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BAND: tl.constexpr, MASKED: tl.constexpr):
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
            keep = keep & (offs_n[None, :] <= pos_q[:, None] + window_right)
            keep = keep & (offs_n[None, :] >= pos_q[:, None] - window_left)
        s = tl.where(keep, s, float("-inf"))
    return s, tanh_s


@triton.jit
def _sequence_bounds(CuQ, CuK, SeqUsedK, b, HAS_SEQUSED: tl.constexpr, PAGED: tl.constexpr):
    """Sequence b's query rows and key rows (paged: keys start at 0 of its block table row)."""
    start_q = tl.load(CuQ + b)
    len_q = tl.load(CuQ + b + 1) - start_q
    if PAGED:
        start_k = start_q * 0
        len_k = tl.load(SeqUsedK + b)
    else:
        start_k = tl.load(CuK + b)
        if HAS_SEQUSED:
            len_k = tl.load(SeqUsedK + b)
        else:
            len_k = tl.load(CuK + b + 1) - start_k
    return start_q, len_q, start_k, len_k


@triton.jit
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


def window_bounds(spec) -> tuple[int, int, bool]:
    """(left, right, has_band) with unbounded sides as UNBOUNDED and causal folded into right."""
    left, right = spec.window
    left = UNBOUNDED if left < 0 else left
    right = UNBOUNDED if right < 0 else right
    if spec.causal:
        right = min(right, 0)
    return left, right, spec.causal or spec.has_window


def length_bucket(n: int) -> int:
    """Autotune key for a sequence length: its power-of-two bucket, so lengths never recompile."""
    return triton.next_power_of_2(max(int(n), 1))


def sequence_order(call) -> torch.Tensor:
    """Batch indices heaviest first (Lq * Lk), computed on the device: no host sync.

    Programs launch in grid order, so the long sequences of a long-tail batch start first instead
    of running alone at the end.
    """
    cu_q = call.cu_seqlens_q
    len_q = (cu_q[1:] - cu_q[:-1]).to(torch.int64)
    if call.seqused_k is not None:
        len_k = call.seqused_k.to(torch.int64)
    else:
        len_k = (call.cu_seqlens_k[1:] - call.cu_seqlens_k[:-1]).to(torch.int64)
    work = len_q * (len_k + 1)
    return torch.argsort(work, descending=True, stable=True).to(torch.int32)


def alibi_args(call):
    """(slopes tensor or a dummy, batch stride): per_head slopes broadcast with stride 0."""
    slopes = call.alibi_slopes
    if slopes is None:
        return call.cu_seqlens_q, 0
    if slopes.dim() == 1:
        return slopes, 0
    return slopes, slopes.stride(0)


def kv_strides(t: torch.Tensor, paged: bool) -> tuple[int, int, int, int]:
    """(block, token, head, dim) strides of packed (total, H, D) or paged (blocks, size, H, D) K/V."""
    if paged:
        return t.stride(0), t.stride(1), t.stride(2), t.stride(3)
    return 0, t.stride(0), t.stride(1), t.stride(2)
