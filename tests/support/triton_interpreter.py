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
from unittest import mock


@contextlib.contextmanager
def interpreter_env(enabled: bool = True):
    """``TRITON_INTERPRET=1`` while the block runs (when ``enabled``), then as it was."""
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"} if enabled else {}):
        yield


def is_interpreted(triton) -> bool:
    """Whether this process's triton was imported interpreted."""
    return triton is not None and type(triton.language.cdiv).__name__ == "InterpretedFunction"
