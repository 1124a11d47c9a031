"""Keyed counter-based dropout: the one definition of which attention probabilities are dropped.

MATH, CPU_FUSED's compiled kernel and TRITON draw the same mask for the same call, so a dropout
call compares exactly across them and against the float64 reference (PyTorch's flash/efficient
CUDA kernels keep their own RNG).

The rule. A call draws one key ``(seed, offset)``, two uint32 words, from torch's default CPU
generator (``draw_key``: ``torch.manual_seed`` reproduces it, and a CPU draw costs no device
sync). The probability of query head h, query position i and key position j of sequence b (i and
j counted from the start of that sequence, b its index in the batch) is kept iff

    uniform(philox4x32_10(counter=(j, i, h, b), key=(seed, offset))[0]) >= p     (p in float32)

and kept values are scaled by 1 / (1 - p). ``philox4x32_10`` is Random123's Philox4x32 with 10
rounds, which is Triton's ``tl.philox(seed | offset << 32, j, i, h, b)``; ``uniform`` is Triton's
``tl.uint_to_uniform_float`` on the first output word (the word as int32, ``~x`` where negative,
times 4.6566127342e-10 in float32), so Triton uses its own generator and matches bit for bit.

Consequences: each (sequence, head, i, j) draw is a pure function of the key and those four
numbers. It does not depend on the thread count, on how work is split into tiles, chunks or
key splits, on the order work runs in, on the sequences packed around it (at the same index b),
on padding, or on a paged cache's block layout. Kernels recompute the mask in the backward instead
of storing it. A sequence's index b is part of the counter: moving it in the batch changes its mask.

This module holds the torch form (integer ops on int64 tensors, exact on every device: MATH and
the tests' float64 reference use it); ``cpu/csrc/attention.cpp`` and ``triton/_common.py`` compute
the same function.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

# Philox4x32 constants (Random123; Triton's PHILOX_ROUND_A/B and PHILOX_KEY_A/B).
ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85
ROUNDS = 10
# tl.uint_to_uniform_float's scale for 32-bit words: the largest x with (2**31 - 1) * x < 1 in float32.
UNIFORM_SCALE = 4.6566127342e-10
MASK32 = 0xFFFFFFFF


def draw_key() -> Tensor:
    """A fresh key: int64 CPU tensor [seed, offset], each in [0, 2**32), from the default generator."""
    return torch.randint(0, 1 << 32, (2,), dtype=torch.int64, device="cpu")


def key_words(key: Optional[Tensor]) -> tuple[int, int]:
    """(seed, offset) as Python ints (the key lives on the CPU: no device sync)."""
    if key is None:
        raise RuntimeError("a call with dropout_p > 0 reached a backend without its dropout_key "
                           "(the public functions draw it: keyed_dropout.draw_key)")
    seed, offset = (int(x) for x in key.tolist())
    return seed, offset


def _mul_hi_lo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """High and low 32-bit words of a * m, for int64 tensors holding uint32 values and a uint32
    constant: products of 16-bit halves, so no intermediate leaves int64 (no overflow anywhere)."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    a_hi, a_lo = a >> 16, a & 0xFFFF
    mid = a_hi * m_lo + a_lo * m_hi                      # < 2**33
    low = a_lo * m_lo + ((mid & 0xFFFF) << 16)           # < 2**33
    hi = a_hi * m_hi + (mid >> 16) + (low >> 32)         # < 2**32: a * m < 2**64
    return hi, low & MASK32


def philox4x32_10(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: int, k1: int):
    """Philox4x32-10 of the counter words (int64 tensors of uint32 values, broadcastable) under the
    key (k0, k1); returns the four output words, int64 tensors of uint32 values."""
    for _ in range(ROUNDS):
        hi_a, lo_a = _mul_hi_lo(c0, ROUND_A)
        hi_b, lo_b = _mul_hi_lo(c2, ROUND_B)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & MASK32, (k1 + KEY_B) & MASK32
    return c0, c1, c2, c3


def uniform(word: Tensor) -> Tensor:
    """float32 in [0, 1) of a uint32 word, exactly as ``tl.uint_to_uniform_float``."""
    x = torch.where(word >= 1 << 31, word ^ MASK32, word)  # the word as int32; ~x where negative
    return x.to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32, device=word.device)


def keep_mask(key: Tensor, b: int, heads: Union[int, Tensor], i_positions: Tensor, j_positions: Tensor,
              p: float) -> Tensor:
    """Bool (H, Lq, Lk): True where sequence b keeps the probability of (head, i, j).

    heads: H (heads 0..H-1) or a 1-D tensor of head indices; i_positions / j_positions: 1-D int
    tensors of in-sequence query / key positions (a block of rows passes its own). Computed on
    i_positions' device."""
    device = i_positions.device
    seed, offset = key_words(key)
    h = torch.arange(heads, device=device) if isinstance(heads, int) else heads.to(device)
    c0 = j_positions.to(device=device, dtype=torch.int64).view(1, 1, -1) & MASK32
    c1 = i_positions.to(torch.int64).view(1, -1, 1) & MASK32
    c2 = h.to(torch.int64).view(-1, 1, 1) & MASK32
    c3 = torch.tensor(b & MASK32, dtype=torch.int64, device=device)
    r0 = philox4x32_10(c0, c1, c2, c3, seed, offset)[0]  # (H, Lq, Lk): every word mixes in by round 3
    return uniform(r0) >= torch.tensor(p, dtype=torch.float32, device=device)

