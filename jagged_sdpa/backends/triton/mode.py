"""One rule for how our Triton functions are decorated: in the mode triton's own were.

``@triton.jit`` reads ``TRITON_INTERPRET`` when it runs: triton's library functions (``tl.cdiv``)
take their mode when ``triton`` is imported, ours when our kernel modules are. A compiled kernel
cannot call an interpreted helper ("Unsupported function referenced"), nor find one by name, so a
process that imports triton compiled (a GPU machine) and sets ``TRITON_INTERPRET=1`` later (a test,
a user's script) before our first kernel import would break every launch. ``jit`` decorates in
triton's own mode, whatever the variable says when our modules happen to be imported.
"""

from __future__ import annotations

import contextlib
import os

import triton
import triton.language as tl

# Whether this process's triton was imported interpreted: its library functions say so.
INTERPRETED = type(tl.cdiv).__name__ == "InterpretedFunction"


@contextlib.contextmanager
def _tritons_mode():
    saved = os.environ.get("TRITON_INTERPRET")
    if INTERPRETED:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def jit(fn=None, **options):
    """``triton.jit`` in triton's own mode (``INTERPRETED``); used as ``@jit`` or ``@jit(**options)``."""
    def decorate(f):
        with _tritons_mode():
            return triton.jit(f, **options)
    return decorate if fn is None else decorate(fn)
