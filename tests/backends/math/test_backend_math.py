"""MATH specifics: memory follows the work (never B x max_len^2), and it takes every call.

Its blocked forward and backward are tested in test_math_blocked.py."""

from __future__ import annotations

import jagged_sdpa
from jagged_sdpa.backends import math as math_backend
from support.cases import cu_of, packed


def test_scores_are_per_sequence_never_padded(monkeypatch):
    """One long sequence among many short ones: each score block is that sequence's own size."""
    seen = []
    original = math_backend.attend_block

    def recording(spec, q, k, v, *args, **kwargs):
        seen.append((q.shape[0], k.shape[0]))
        return original(spec, q, k, v, *args, **kwargs)

    monkeypatch.setattr(math_backend, "attend_block", recording)
    lengths = [512] + [3] * 100
    q = packed(lengths, 1, 8)
    jagged_sdpa.varlen_attention(q, q, q, cu_of(lengths), cu_of(lengths), causal=True, backend="math")
    assert seen[0] == (512, 512) and set(seen[1:]) == {(3, 3)} and len(seen) == 101
    work = sum(a * b for a, b in seen)
    assert work < 101 * 512 * 512 / 90  # the padded batch would be 101 x 512 x 512
