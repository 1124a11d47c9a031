"""Reading transformers' ``mask_function``: the closures and code objects that ``create_*_mask``
builds are recognised, never evaluated (that would need the Q x K mask jagged attention avoids), and
turned into an ``Overlay``: the pattern and what its overlays mean in ``varlen_attention``'s options
(docs/api.md section 11). The mask hook carries them with the mask; a mask without padding is then
returned anyway, as a marker. Each equals "eager" on every sequence alone
(tests/integrations/test_transformers_overlays.py):

- Llama 4 chunked layers (``chunked_overlay``): ``chunk_size`` (``overlays.chunk_keys``). Packed rows:
  Llama 4's layers do not pass position_ids on, so they need the collator's cu_seq_lens kwargs; a
  packed row that eager separates (no cache) without them is refused.
- PaliGemma prefix-LM and Gemma3 images (``block_sequence_ids`` from ``token_type_ids``):
  ``prefix_lens`` (``overlays.block_prefix_lens``); blocks in packed rows are refused.
- Gemma3 ``use_bidirectional_attention``: the "everything" overlay of its full layers (recognised by
  its bytecode) makes them non-causal; its sliding layers' ``|q - kv| < w`` becomes the window
  ``(w - 1, w - 1)`` (the module's ``sliding_window`` alone would give ``(w, w)``).
- Configs with ``use_bidirectional_attention`` whose mask is causal (PaliGemma's Gemma: its modules
  say ``is_causal=False``) get the causal pattern carried even without padding.

Any other ``or_mask_function``/``and_mask_function`` is refused with a ``ValueError`` naming it."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
from transformers import masking_utils

from .compat import REMAP as _REMAP
from .compat import _cells, _inner_code, packed_pattern


_AND, _OR = _inner_code(masking_utils.and_masks, "and_mask"), _inner_code(masking_utils.or_masks, "or_mask")
_SLIDING = _inner_code(masking_utils.sliding_window_overlay)
_SLIDING_BIDIRECTIONAL = _inner_code(masking_utils.sliding_window_bidirectional_overlay)
_CHUNKED = _inner_code(masking_utils.chunked_overlay)
_BLOCKWISE = _inner_code(masking_utils.blockwise_overlay)
_GEMMA3 = "transformers.models.gemma3.modeling_gemma3"


def _all_true(*args):  # the shape of Gemma3's "everything" overlay: lambda *args: torch.tensor(True, ...)
    return torch.tensor(True, dtype=torch.bool)


_ALL_TRUE = _all_true.__code__


def _is_all_true(fn, code) -> bool:
    """``fn`` is ``lambda *args: torch.tensor(True, dtype=torch.bool)`` (Gemma3's bidirectional overlay):
    the same bytecode, constants, names and flags as ``_all_true`` (nesting and __future__ flags aside),
    no closure, this ``torch``."""
    flags = 0xFFFF & ~inspect.CO_NESTED  # the __future__ flags sit above 0xFFFF
    return fn.__closure__ is None and getattr(fn, "__globals__", {}).get("torch") is torch \
        and code.co_flags & flags == _ALL_TRUE.co_flags & flags and all(
            getattr(code, a) == getattr(_ALL_TRUE, a) for a in ("co_code", "co_consts", "co_names", "co_argcount",
                                                                "co_kwonlyargcount"))


def _is_gemma3_window(code) -> bool:
    """Gemma3's ``_bidirectional_window_overlay`` (``|q - kv| < sliding_window``): its module is loaded
    whenever a Gemma3 model made one."""
    module = sys.modules.get(_GEMMA3)
    return module is not None and code is _inner_code(module._bidirectional_window_overlay)


def overlay_refused(what: str) -> ValueError:
    return ValueError(
        f"mask_function: this model adds a custom mask overlay ({what}); jagged attention supports causal, "
        "sliding-window and padding masks, Llama 4's chunked attention, prefix-LM blocks (PaliGemma, Gemma3 "
        "images at the start of a sequence) and Gemma3's bidirectional attention only -- use "
        "attn_implementation='eager' or 'sdpa' for this model"
    )


@dataclass
class Overlay:
    """The pattern transformers' ``mask_function`` describes, read from its closures (nothing is
    evaluated): the base pattern and what its overlays add, in terms of varlen_attention's options."""

    causal: bool | None = None  # the effective pattern: True causal, False bidirectional, None unknown
    keys_only: bool = False  # built on bidirectional_mask_function (create_bidirectional_mask)
    windowed: bool = False  # a bidirectional sliding_window_bidirectional_overlay (the module passes it)
    sliding: int | None = None  # a causal sliding_window_overlay (the module passes the same window)
    window: tuple | None = None  # a window that replaces the module's (Gemma3: |q - kv| < w -> (w-1, w-1))
    chunk: tuple | None = None  # (chunk_size, left_padding) of chunked_overlay (Llama 4)
    blocks: torch.Tensor | None = None  # block_sequence_ids OR-ed on: prefix-LM if they form a prefix
    blocks_window: int | None = None  # a sliding window AND-ed after the blocks (Gemma3's sliding layers)
    packed: bool = False  # wrapped for packed sequences (position_ids restarting)


def read_mask_function(fn) -> Overlay:
    """Read a mask function built by transformers' ``create_*_mask`` into an ``Overlay``; anything it
    does not recognise exactly (a custom or_mask_function/and_mask_function) is refused."""
    code = getattr(fn, "__code__", None)
    if fn is masking_utils.causal_mask_function:
        return Overlay(causal=True)
    if fn is masking_utils.bidirectional_mask_function:
        return Overlay(causal=False, keys_only=True)
    if _REMAP is not None and code is _REMAP:  # packed sequences: positions remapped per sequence (5.18+)
        return Overlay(**{**read_mask_function(_cells(fn)["mask_function"]).__dict__, "packed": True})
    if code is _AND:
        return _read_and(_cells(fn)["mask_functions"])
    if code is _OR:
        base, *extra = _cells(fn)["mask_functions"]
        overlay = read_mask_function(base)
        for f in extra:
            overlay = _read_or(overlay, f)
        return overlay
    raise overlay_refused(f"{getattr(fn, '__qualname__', type(fn).__name__)} is not a transformers mask pattern")


def _read_and(functions) -> Overlay:
    """``and_masks``: transformers' own constructions, recognised by their order -- an overlay first then
    its pattern (``sliding_window_causal_mask_function``, ``chunked_causal_mask_function``,
    ``sliding_window_bidirectional_mask_function``, ``packed_sequence_compatibility_function``), whose
    window the module passes as ``sliding_window``; or a pattern then an ``and_mask_function``, of which
    only Gemma3's window after its image blocks is known."""
    if len(functions) != 2:
        raise overlay_refused("and_mask_function")
    first, second = functions
    code, cells = getattr(first, "__code__", None), _cells(first) if getattr(first, "__closure__", None) else {}
    pattern = packed_pattern(first, second)  # transformers' packed-sequence wrapper (compat.packed_pattern)
    if pattern is not None:
        overlay = read_mask_function(pattern)
        if overlay.keys_only:  # transformers packs causal masks only: a bidirectional one is a model's own overlay
            raise overlay_refused("and_mask_function")
        overlay.packed = True
        return overlay
    if code is _SLIDING_BIDIRECTIONAL and second is masking_utils.bidirectional_mask_function:
        return Overlay(causal=False, keys_only=True, windowed=True)  # |q - kv| <= w: the module's (w, w)
    if code in (_SLIDING, _CHUNKED):
        overlay = read_mask_function(second)
        if overlay.causal is True and overlay.chunk is None and overlay.sliding is None and overlay.blocks is None:
            if code is _SLIDING:
                overlay.sliding = cells["sliding_window"]
            else:
                overlay.chunk = (cells["chunk_size"], cells["left_padding"])
            return overlay
    if getattr(second, "__code__", None) is _SLIDING:
        overlay = read_mask_function(first)
        if overlay.causal is True and overlay.blocks is not None and overlay.blocks_window is None:
            overlay.blocks_window = _cells(second)["sliding_window"]  # (causal | blocks) & window: Gemma3 images
            return overlay
    raise overlay_refused("and_mask_function")


def _read_or(overlay: Overlay, fn) -> Overlay:
    """``or_masks``: the overlays transformers' families OR on a causal pattern."""
    code = getattr(fn, "__code__", None)
    if overlay.causal is False:
        if overlay.windowed or overlay.window is not None:  # an OR would reach past the window
            raise overlay_refused(f"or_mask_function {getattr(fn, '__qualname__', type(fn).__name__)} on a "
                                  "bidirectional sliding window")
        _read_or(Overlay(causal=True), fn)  # bidirectional | anything = bidirectional; unknown ones stay refused
        return overlay
    plain = overlay.causal is True and overlay.chunk is None and overlay.blocks is None and not overlay.packed
    if code is _BLOCKWISE and overlay.causal is True and overlay.blocks is None:
        overlay.blocks = _cells(fn)["block_sequence_ids"]
        return overlay
    if code is not None and _is_all_true(fn, code) and plain and overlay.sliding is None:
        return Overlay(causal=False)  # Gemma3 use_bidirectional_attention, full layers
    if code is not None and _is_gemma3_window(code) and plain and overlay.sliding == _cells(fn)["sliding_window"]:
        # (q - w < kv <= q) | |q - kv| < w == |q - kv| < w: Gemma3 use_bidirectional_attention, sliding layers
        w = overlay.sliding
        return Overlay(causal=False, window=(w - 1, w - 1))
    raise overlay_refused(f"or_mask_function {getattr(fn, '__qualname__', type(fn).__name__)}")


def overlay_of(mask_function, use_vmap) -> Overlay:
    """The pattern of the hook's ``mask_function`` (``read_mask_function``); none given: unknown."""
    if mask_function is None:
        if use_vmap:
            raise overlay_refused("or_mask_function/and_mask_function")
        return Overlay()
    return read_mask_function(mask_function)
