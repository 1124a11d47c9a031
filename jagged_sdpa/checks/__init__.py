"""Two kinds of checks: ``inputs`` raises on user errors, ``capability`` returns eligibility reasons."""

from __future__ import annotations

from typing import Iterable, Optional

Reason = str


def collect(reasons: Iterable[Optional[Reason]]) -> tuple[Reason, ...]:
    """Keep every reason that fired (gather everything, never stop at the first)."""
    return tuple(r for r in reasons if r)
