"""Which keys each block of query rows can see, and the additive mask for that block.

Both CPU engines walk a sequence in blocks of query rows and multiply each block only against the
key range its rows can see, so causal and windowed calls skip the blocks that are fully masked.
Every bound here follows the contract's aligned position i' (= i, or i + Lk - Lq bottom-right).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor

from jagged_sdpa.backends import positions
from jagged_sdpa.spec import AttnSpec


@dataclass(frozen=True, slots=True)
class Block:
    """Query rows [row_lo, row_hi) of one sequence and the key range [key_lo, key_hi) they see.

    ``exact`` is True when every row sees exactly that whole range (no mask needed).
    """

    row_lo: int
    row_hi: int
    key_lo: int
    key_hi: int
    exact: bool

    @property
    def empty(self) -> bool:
        return self.key_hi <= self.key_lo


def _row_bounds(spec: AttnSpec, shift: int, len_k: int, i: int) -> tuple[int, int]:
    """Visible keys [lo, hi) of query row i (hi <= lo: the row sees no key)."""
    return positions.visible_keys(spec, i + shift, len_k)


shift_of = positions.shift_of


def row_keys(spec: AttnSpec, len_q: int, len_k: int, i: int) -> tuple[int, int]:
    """Visible keys [lo, hi) of query row i of a sequence (hi <= lo: it sees none)."""
    return _row_bounds(spec, shift_of(spec, len_q, len_k), len_k, i)


def backward_lse(lse: Tensor, dtype: torch.dtype) -> Tensor:
    """The forward's lse for a backward that recomputes P = exp(S - lse): rows that see no key
    have lse -inf, and +inf there makes every recomputed probability exactly 0."""
    return torch.where(torch.isneginf(lse), float("inf"), lse).to(dtype)


def blocks(spec: AttnSpec, len_q: int, len_k: int, block_rows: int) -> Iterator[Block]:
    """Split a sequence's query rows into blocks with their visible key ranges.

    Bounds grow monotonically with the row, so a block's range is [lo(first), hi(last)).
    Unmasked calls use one block for the whole sequence (nothing to skip).
    """
    if len_q == 0:
        return
    masked = spec.causal or spec.has_window
    step = block_rows if masked else len_q
    shift = shift_of(spec, len_q, len_k)
    for r0 in range(0, len_q, step):
        r1 = min(len_q, r0 + step)
        lo0, hi0 = _row_bounds(spec, shift, len_k, r0)
        lo1, hi1 = _row_bounds(spec, shift, len_k, r1 - 1)
        lo, hi = lo0, max(hi0, hi1)
        exact = lo0 == lo1 and hi0 == hi1 and hi0 > lo0
        yield Block(r0, r1, lo, hi, exact)


def _block_positions(shift: int, block: Block, device):
    return positions.aligned_positions(block.row_lo, block.row_hi, block.key_lo, block.key_hi, shift, device)


def keep_mask(spec: AttnSpec, shift: int, block: Block, device) -> Tensor:
    """Boolean (rows, keys) of the block: True where the row may attend the key."""
    return positions.keep_mask(spec, *_block_positions(shift, block, device))


def alibi_bias(slopes: Tensor, shift: int, block: Block, dtype: torch.dtype) -> Tensor:
    """-slope * |i' - j| for the block: (Hq, rows, keys) in ``dtype``."""
    return positions.alibi_bias(slopes, *_block_positions(shift, block, slopes.device), dtype)


def empty_rows(spec: AttnSpec, shift: int, len_k: int, block: Block) -> Optional[list[int]]:
    """Rows (relative to the block) that see no key at all, or None when there are none."""
    rows = []
    for r in range(block.row_lo, block.row_hi):
        lo, hi = _row_bounds(spec, shift, len_k, r)
        if hi <= lo:
            rows.append(r - block.row_lo)
    return rows or None


def may_have_empty_rows(spec: AttnSpec, len_q: int, len_k: int) -> bool:
    """Can any row of this sequence see no key? Checking the first and last row suffices.

    A row sees nothing only when its aligned position lies before key 0 (causal or a bounded
    right window) or past the last key (a bounded left window), and positions grow with the row.
    """
    if len_k == 0:
        return True
    if not (spec.causal or spec.has_window):
        return False
    shift = shift_of(spec, len_q, len_k)
    for i in (0, len_q - 1):
        lo, hi = _row_bounds(spec, shift, len_k, i)
        if hi <= lo:
            return True
    return False
