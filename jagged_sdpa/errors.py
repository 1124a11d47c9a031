"""``NoBackendError``: raised when no backend can take a call; it carries the ``Explanation``."""

from __future__ import annotations


class NoBackendError(RuntimeError):
    """No backend can take the call. ``.explanation`` holds every backend's reasons."""

    def __init__(self, explanation, header: str = "no backend can take this call", left_out: str = ""):
        self.explanation = explanation
        super().__init__(f"{header}\n{explanation}" + (f"\n{left_out}" if left_out else ""))
