"""Importing triton so that its kernels run on CPU tensors under its interpreter: one place for the rule.

Triton reads ``TRITON_INTERPRET`` when a function is decorated (its own library functions at
``import triton``, ours when ``jagged_sdpa.backends.triton`` modules are imported), so whatever
should run interpreted is imported inside ``interpreter_env()``; the variable is put back at once,
so that automatic selection keeps seeing TRITON ineligible on the CPU (tests set it around TRITON
calls). Imports only the standard library: the conftest uses it before torch is imported.
"""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def interpreter_env(enabled: bool = True):
    """``TRITON_INTERPRET=1`` while the block runs (when ``enabled``), then as it was."""
    had = os.environ.get("TRITON_INTERPRET")
    if enabled:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if had is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = had


def is_interpreted(triton) -> bool:
    """Whether this process's triton was imported interpreted."""
    return triton is not None and type(triton.language.cdiv).__name__ == "InterpretedFunction"
