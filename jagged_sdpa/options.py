"""A layer's attention options, validated once: ``Options``, the per-layer half of a call's spec.

``varlen_attention``, ``sdpa`` and ``plan`` each validate their keyword arguments here into one
frozen, hashable ``Options``; the batch's half is ``batch.Batch``, and ``plans.Plan`` joins the two
with a layer's tensors into the ``AttnSpec`` that selection reads. Validation of the same
arguments is cached: a model passes the same options in every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from jagged_sdpa.backends import Backend
from jagged_sdpa.checks import inputs
from jagged_sdpa.selection import to_backend


@dataclass(frozen=True)
class Options:
    """What a call's keyword arguments ask for, validated. ``scale`` None means 1/sqrt(D);
    ``run_dropout_p`` is what kernels run with (0 when ``drops_everything``, whose output is zeroed
    instead)."""

    entry: str                       # "varlen" or "sdpa": how errors and explain name things
    causal: bool = False
    alignment: str = "bottom_right"
    window: tuple = (-1, -1)
    softcap: float = 0.0
    dropout_p: float = 0.0
    run_dropout_p: float = 0.0
    scale: Optional[float] = None
    scale_name: str = "softmax_scale"
    return_lse: bool = False
    forced: Optional[Backend] = None
    notes: tuple = ()
    chunk_size: Optional[int] = None     # docs/api.md section 11; normalised per call by ``spec.effective_chunk``

    def scale_for(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale

    @property
    def drops_everything(self) -> bool:
        """dropout_p == 1 drops every probability. PyTorch's SDPA accepts it and returns
        ``(P * 0) @ V``: zeros, NaN where P or V is NaN. The call runs without dropout (the lse does
        not depend on dropout) and its output is multiplied by 0, which gives exactly that."""
        return self.dropout_p == 1.0


DROPS_EVERYTHING_NOTE = "dropout_p=1 drops every probability: run without dropout, output multiplied by 0"


_CACHE: dict = {}


def _cached(build, *args):
    """``build(*args)``, cached by the arguments' types and values (``True`` and ``1`` differ:
    one is valid where the other is a TypeError). Unhashable arguments are validated each time, and
    so are traced ones: Dynamo would guard the compiled graph on the cache's contents, and the
    first call after the trace (which fills it) would recompile."""
    if torch.compiler.is_compiling():
        return build(*args)
    key = (build, tuple((type(a), a) for a in args))
    try:
        found = _CACHE.get(key)
    except TypeError:  # a list window, say
        return build(*args)
    if found is None:
        found = build(*args)
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = found
    return found


def _validated(entry, causal_name, causal, alignment, window_size, softcap, dropout_p, scale_name, scale,
               return_lse, backend, chunk_size) -> Options:
    """The one validation of a call's options; ``*_name``: how the caller's function spells them."""
    inputs.validate_bool(causal_name, causal)
    inputs.validate_bool("return_lse", return_lse)
    forced = None if backend is None else to_backend(backend)
    alignment = inputs.validate_alignment(alignment)
    window = inputs.validate_window(window_size)
    cap = inputs.validate_softcap(softcap, zero_means_off=entry == "varlen")
    p = inputs.validate_dropout(dropout_p)
    run_p, notes = (0.0, (DROPS_EVERYTHING_NOTE,)) if p == 1.0 else (p, ())
    inputs.validate_scale(scale_name, scale)
    chunk = inputs.validate_chunk_size(chunk_size)
    return Options(entry, causal, alignment, window, cap, p, run_p, None if scale is None else float(scale),
                   scale_name, return_lse, forced, tuple(notes), chunk)


def _varlen(dropout_p, softmax_scale, causal, window_size, softcap, return_lse, backend, chunk_size) -> Options:
    return _validated("varlen", "causal", causal, "bottom_right", window_size, softcap, dropout_p, "softmax_scale",
                      softmax_scale, return_lse, backend, chunk_size)


def varlen(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, return_lse=False,
           backend=None, chunk_size=None) -> Options:
    """The Options of ``varlen_attention``'s (and ``plan``'s) keyword arguments."""
    return _cached(_varlen, dropout_p, softmax_scale, causal, window_size, softcap, return_lse, backend, chunk_size)


def _sdpa(dropout_p, is_causal, scale, causal_alignment, window_size, softcap, backend, chunk_size) -> Options:
    return _validated("sdpa", "is_causal", is_causal, causal_alignment, window_size, softcap, dropout_p, "scale", scale,
                      False, backend, chunk_size)


def sdpa(dropout_p=0.0, is_causal=False, scale=None, causal_alignment="top_left", window_size=None, softcap=None,
         backend=None, chunk_size=None) -> Options:
    """The Options of ``sdpa``'s arguments."""
    return _cached(_sdpa, dropout_p, is_causal, scale, causal_alignment, window_size, softcap, backend, chunk_size)
