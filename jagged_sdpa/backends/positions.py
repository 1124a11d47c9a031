"""The position rules of docs/api.md section 5b in torch ops, written once (MATH runs them; tests/support/reference.py is independent).

A query row's aligned position is i' = i (top_left) or i + Lk - Lq (bottom_right). Causal keeps
keys j <= i'; a window keeps i' - left <= j <= i' + right (-1 unbounded); ALiBi adds
-slope * |i' - j|. Callers pass the rows and keys they work on (a whole sequence or one block).

docs/api.md section 11: chunked attention (``chunk_size`` C) also requires j // C == i' // C (floor
division: a negative i' is in chunk -1, which holds no key); a prefix P of the sequence
(``prefix_lens``) lets rows with i' < P also see every key j < P, whatever the other masks say:

    visible(i', j) = (causal and window and chunk) or (i' < P and j < P)

Every row's visible keys are one range: a prefix row's other keys start at or below i' < P, so
with the prefix they make [0, max(hi, P)).
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagged_sdpa.spec import AttnSpec


def shift_of(spec: AttnSpec, len_q: int, len_k: int) -> int:
    """i' - i for a sequence with len_q queries and len_k keys."""
    return len_k - len_q if spec.alignment == "bottom_right" else 0


def visible_keys(spec: AttnSpec, pos: int, len_k: int, prefix: int = 0) -> tuple[int, int]:
    """Keys [lo, hi) a query row at aligned position ``pos`` sees (hi <= lo: it sees none), with
    ``prefix`` the sequence's P (0 without prefix_lens). Both ends grow with pos (a prefix row's
    lo is 0 and its hi at most that of the first row past the prefix, whose hi is above P), so
    rows [r0, r1) together see [lo(r0), hi(r1 - 1))."""
    left, right = spec.window
    lo = max(0, pos - left) if left >= 0 else 0
    hi = len_k
    if right >= 0:
        hi = min(hi, pos + right + 1)
    if spec.causal:
        hi = min(hi, pos + 1)
    if spec.chunk_size is not None:
        start = (pos // spec.chunk_size) * spec.chunk_size  # floor: -1 // C == -1
        lo, hi = max(lo, start), min(hi, start + spec.chunk_size)
    if prefix > 0 and pos < prefix:
        return 0, max(hi, prefix)
    return max(0, min(lo, len_k)), max(0, hi)


def aligned_positions(row_lo: int, row_hi: int, key_lo: int, key_hi: int, shift: int, device):
    """Aligned query positions (rows, 1) and key positions (1, keys)."""
    pos = torch.arange(row_lo + shift, row_hi + shift, device=device).unsqueeze(1)
    j = torch.arange(key_lo, key_hi, device=device).unsqueeze(0)
    return pos, j


def keep_mask(spec: AttnSpec, pos: Tensor, j: Tensor, prefix: int = 0) -> Tensor:
    """Boolean mask of the broadcast of pos and j (e.g. (rows, 1) and (1, keys) give (rows, keys)):
    True where the row may attend the key (causal, window and chunk; or both in the prefix)."""
    left, right = spec.window
    keep = torch.ones(torch.broadcast_shapes(pos.shape, j.shape), dtype=torch.bool, device=pos.device)
    if spec.causal:
        keep &= j <= pos
    if left >= 0:
        keep &= j >= pos - left
    if right >= 0:
        keep &= j <= pos + right
    if spec.chunk_size is not None:
        keep &= torch.div(j, spec.chunk_size, rounding_mode="floor") == torch.div(pos, spec.chunk_size,
                                                                                    rounding_mode="floor")
    if prefix > 0:
        keep |= (pos < prefix) & (j < prefix)
    return keep


def distance(pos: Tensor, j: Tensor, dtype: torch.dtype) -> Tensor:
    """|i' - j| in ``dtype``: ALiBi's bias per unit of slope (and so its derivative in the slope)."""
    return (pos - j).abs().to(dtype)


def alibi_bias(slopes: Tensor, pos: Tensor, j: Tensor, dtype: torch.dtype) -> Tensor:
    """-slope * |i' - j| as (Hq, rows, keys) in ``dtype``, computed in float32 (float64 for it)."""
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    return (-slopes.to(exact).reshape(-1, 1, 1) * distance(pos, j, exact)).to(dtype)
