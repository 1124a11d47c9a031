"""Triton kernels of ``checks.device``: each writes 1 (ok) or 0 into its flag slot(s) of ``Ok``.

Every load is masked to the tensor it reads. Offsets are widened to int64 before any difference is
taken, and each one must lie in [0, total]: an int32 difference of out-of-range offsets wraps
(``[0, 2**31 - 1, -2**31 + 5, 4, 10]`` has int32 lengths 2**31 - 1, 6, 2**31 - 1, 6, none negative), and
int64 ones could wrap the same way near 2**63.
"""

from __future__ import annotations

import triton
import triton.language as tl

from jagged_sdpa.backends.triton.mode import jit


@jit
def cu_ok(Ok, slot, Cu, n_seq, total, max_len, BLOCK: tl.constexpr):
    """Cu (n_seq + 1,): Cu[0] == 0, Cu[n_seq] == total, 0 <= Cu[b] <= total for every b, and
    0 <= Cu[b + 1] - Cu[b] <= max_len (in int64)."""
    bad = ((tl.load(Cu) != 0) | (tl.load(Cu + n_seq) != total)).to(tl.int32)
    for b0 in range(0, n_seq, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        inside = offs < n_seq
        start = tl.load(Cu + offs, mask=inside, other=0).to(tl.int64)
        end = tl.load(Cu + offs + 1, mask=inside, other=0).to(tl.int64)
        n = end - start
        out_of_range = (start < 0) | (start > total) | (end < 0) | (end > total)
        bad = bad | tl.max((out_of_range | (n < 0) | (n > max_len)).to(tl.int32), axis=0)
    tl.store(Ok + slot, 1 - bad)


@jit
def lengths_ok(Ok, slot, Lengths, n_seq, CapCu, cap_fixed, max_len, CAP_FROM_CU: tl.constexpr,
               BLOCK: tl.constexpr):
    """0 <= Lengths[b] <= capacity[b] (CapCu[b + 1] - CapCu[b], or cap_fixed) and <= max_len."""
    bad = tl.zeros([], dtype=tl.int32)
    for b0 in range(0, n_seq, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        inside = offs < n_seq
        n = tl.load(Lengths + offs, mask=inside, other=0).to(tl.int64)
        if CAP_FROM_CU:
            cap = (tl.load(CapCu + offs + 1, mask=inside, other=0).to(tl.int64)
                   - tl.load(CapCu + offs, mask=inside, other=0).to(tl.int64))
        else:
            cap = cap_fixed
        bad = bad | tl.max(((n < 0) | (n > cap) | (n > max_len)).to(tl.int32), axis=0)
    tl.store(Ok + slot, 1 - bad)


@jit
def block_ids_ok(Ok, slot, Table, stride_b, stride_w, Used, n_seq, width, block_size, num_blocks,
                 BLOCK: tl.constexpr):
    """Program b: the first ceil(Used[b] / block_size) ids of table row b lie in [0, num_blocks)."""
    b = tl.program_id(0)
    bad = tl.zeros([], dtype=tl.int32)
    if b < n_seq:
        needed = (tl.load(Used + b).to(tl.int64) + block_size - 1) // block_size
        for w0 in range(0, width, BLOCK):
            offs = w0 + tl.arange(0, BLOCK)
            read = (offs < width) & (offs < needed)
            ids = tl.load(Table + b.to(tl.int64) * stride_b + offs.to(tl.int64) * stride_w, mask=read, other=0)
            bad = bad | tl.max((read & ((ids < 0) | (ids >= num_blocks))).to(tl.int32), axis=0)
    tl.store(Ok + slot + b, 1 - bad)
