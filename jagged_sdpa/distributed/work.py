"""Attention work of query rows under a mask: how many keys each row of a self-attention
sequence sees. Plans balance it, the cost model prices it. Host-side numpy, no tensors.
"""

from __future__ import annotations

import numpy as np


def visible_keys(length: int, causal: bool, window: tuple[int, int]) -> np.ndarray:
    """int64 (length,): keys row i of a sequence of ``length`` tokens sees (self-attention, Lq == Lk)."""
    left, right = window
    i = np.arange(length, dtype=np.int64)
    lo = np.zeros_like(i) if left < 0 else np.maximum(0, i - left)
    if causal:
        hi = i
    else:
        hi = np.full_like(i, length - 1) if right < 0 else np.minimum(length - 1, i + right)
    return np.maximum(0, hi - lo + 1)


class WorkTable:
    """Prefix sums of ``visible_keys`` per document, so a piece's work is two lookups."""

    def __init__(self, lengths, causal: bool, window: tuple[int, int]):
        self.lengths = tuple(lengths)
        self._prefix = []
        for n in self.lengths:
            p = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(visible_keys(n, causal, window), out=p[1:])
            self._prefix.append(p)

    def piece(self, doc: int, start: int, end: int) -> int:
        p = self._prefix[doc]
        return int(p[end] - p[start])

    def prefix(self, doc: int) -> np.ndarray:
        return self._prefix[doc]

    def doc(self, doc: int) -> int:
        return int(self._prefix[doc][-1])

    def total(self) -> int:
        return sum(int(p[-1]) for p in self._prefix)
