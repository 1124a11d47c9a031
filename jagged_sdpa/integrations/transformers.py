"""Hugging Face transformers integration: ``attn_implementation="jagged"``.

    from jagged_sdpa.integrations import transformers as jt
    name = jt.register()                      # "jagged"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

``register`` installs two functions in transformers:

- an attention-mask function (``AttentionMaskInterface``). Without one, transformers hands a
  custom attention function ``attention_mask=None`` and padding is silently ignored. Ours turns
  the 2-D padding mask and the cache geometry (query/key offsets, static cache slots not yet
  written) into a compact bool mask ``(B, 1, 1, Q + K)`` -- query validity then key validity, no
  ``Q x K`` matrix -- and computes the unpadding indices and lengths once per forward;
- an attention function (``AttentionInterface``) that unpads queries/keys/values with them, runs
  ``jagged_sdpa.varlen_attention`` (causal is bottom-right: new queries see every cached key;
  GQA without repeating K/V; sliding window, softcap, scaling and dropout from the module) and
  re-pads the output (padded query rows are zeros). Without padding it reads packed sequences
  from ``cu_seq_lens_q/k`` + ``max_length_q/k`` (``DataCollatorWithFlattening``) or from
  ``position_ids`` that do not continue by +1.

Encoder-decoder models: the mask hook reads which pattern transformers asked for (causal or
bidirectional) from the mask function; bidirectional masks (encoder self-attention, cross-attention)
mask keys only and keep every query row, as eager does, and a known pattern overrides the module's
``is_causal`` (eager applies the mask whatever the module declares).

Model code that uses the mask itself (``_model_reads_mask``: a caller that asks transformers for a
materialized mask to overlay, e.g. sparse-attention indexers; NLLB-MoE's padding-aware router; families
whose modeling code never calls a registered attention function, e.g. Bloom, MPT, XGLM) gets transformers'
own eager mask instead, carrying the same unpadding data. What jagged attention cannot honour is refused
with a ValueError at the first call: an indexer's top-k ``indices``, compressed-KV layers
(``config.compress_rates``), a 4-D mask the model computed or edited itself.

Mask overlays (docs/api.md section 11). The mask hook reads transformers' ``mask_function`` (its closures and
code objects, ``_read_mask_function``; nothing is evaluated) and carries what it finds with the mask to
``varlen_attention``'s options; a mask without padding is then returned anyway, as a marker. Each equals
"eager" on every sequence alone (tests/test_transformers_overlays.py):

- Llama 4 chunked layers (``chunked_overlay``): ``chunk_size``. Eager numbers chunks from each row's
  first real token (absolute position minus the left padding) and its chunked layers' cache keeps the
  last C - 1 keys, so the hook drops the keys before the chunk of each row's first query: varlen's
  first key then starts that chunk. Padding between real tokens (or a cache that lost the chunk's
  start) where the chunks of several queries would differ is refused (decoding one token per row past
  it is exact: the keys kept are its chunk); a chunk covering every key slot changes nothing.
  Packed rows: Llama 4's layers do not pass position_ids on, so they need the collator's cu_seq_lens
  kwargs; a packed row that eager separates (no cache) without them is refused.
- PaliGemma prefix-LM and Gemma3 images (``block_sequence_ids`` from ``token_type_ids``):
  ``prefix_lens`` = the length of the block each row starts with, counted from its first real token,
  when every later real token has no block (-1): tokens without a block change nothing (Gemma3 text
  with ``token_type_ids``), other blocks (an image after text, several images) are refused, and so is a
  block longer than the sliding window Gemma3 applies after it, and blocks in packed rows.
- Gemma3 ``use_bidirectional_attention``: the "everything" overlay of its full layers (recognised by
  its bytecode) makes them non-causal; its sliding layers' ``|q - kv| < w`` becomes the window
  ``(w - 1, w - 1)`` (the module's ``sliding_window`` alone would give ``(w, w)``).
- Configs with ``use_bidirectional_attention`` whose mask is causal (PaliGemma's Gemma: its modules
  say ``is_causal=False``) get the causal pattern carried even without padding.

Any other ``or_mask_function``/``and_mask_function`` is refused with a ``ValueError`` naming it.

Causal sliding windows: the hook drops the keys before each row's first query's window (no query sees
them), and with one query per row (decoding) the keys left are exactly its window, so the window is
dropped: decoding past padding between real tokens (a right-padded prompt continued by a new turn)
equals eager. Padding inside the window of several queries of a row is refused (the distances differ).

Continuous batching (``generate_batch``): ``enable_continuous_batching()`` puts
``continuous_batching_sdpa_forward`` in transformers' "sdpa" entry (see the end of this module).

The name avoids "sdpa" and "flash": transformers applies its SDPA dispatch rules to names with
"sdpa" (and ~20 model families, e.g. Gemma2, then refuse it), and tries to fetch a Hub kernel for
names with "flash".
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import types
import weakref
from dataclasses import dataclass

import numpy as np
import torch

try:
    import transformers as _transformers  # noqa: F401  (the real package: absolute import)
    from transformers import masking_utils
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
except ImportError as _err:  # pragma: no cover - exercised by a test that hides transformers
    raise ImportError(
        "jagged_sdpa.integrations.transformers needs Hugging Face transformers, which is not "
        "installed: pip install \"jagged_sdpa[transformers]\" (or pip install transformers)"
    ) from _err

from jagged_sdpa.api import varlen_attention

__all__ = ["register", "jagged_attention_forward", "jagged_attention_mask", "DEFAULT_NAME", "enable_continuous_batching",
           "disable_continuous_batching", "continuous_batching_enabled", "continuous_batching_sdpa_forward"]

DEFAULT_NAME = "jagged"
_logger = logging.getLogger("jagged_sdpa")
_UNPAD_ATTR = "_jagged_sdpa_unpad"
_EAGER_VERSION_ATTR = "_jagged_sdpa_version"  # eager-layout masks: their version when handed to the model
_BUILTIN_NAMES = ("eager", "sdpa", "flex_attention", "paged|eager")
_warned_output_attentions = [False]


@dataclass
class _Unpad:
    """Where the valid queries/keys of a padded batch are, computed once per forward."""

    query_valid: torch.Tensor  # bool (B, Q): which query rows are real
    key_valid: torch.Tensor  # bool (B, K)
    cu_seqlens_q: torch.Tensor  # int32 (B+1,)
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    holes: bool  # some row's valid keys are not contiguous (padding between real tokens)
    no_padding: bool  # every query row and key slot is real
    # the pattern of the mask function transformers asked for: True (causal), False (bidirectional),
    # None (unknown: a 2-D mask read directly). Eager applies the mask whatever the module's
    # is_causal says, so a known pattern overrides it (bigbird_pegasus' decoder declares is_causal=False)
    causal: bool | None = None
    padded: bool = True  # False: a marker without padding, only there to carry the pattern
    # keys only (create_bidirectional_mask: encoder self-attention, cross-attention): every query row is kept
    keys_only: bool = False
    # what the mask's overlays add (see _Overlay): they replace or join the module's own options
    window: tuple | None = None  # (left, right): replaces the window the module's sliding_window gives
    chunk: int | None = None  # chunk_size (docs/api.md section 11); the keys before each row's first chunk are dropped
    prefix_lens: torch.Tensor | None = None  # int32 (B,): prefix-LM (docs/api.md section 11)
    packed: bool = False  # eager separates packed sequences (position_ids restarting, no cache)
    checks: tuple = ()  # the ints read with the lengths (see _unpad_from_validity)
    # The cache read in place (docs/api.md section 12): each row's valid keys are the slots
    # [cache_leftpad[b], cache_leftpad[b] + seqused_k[b]); usable when there are no holes and every
    # query row is real (``queries_full``), with ``cu_seqlens_full`` over all B * Q query rows.
    seqused_k: torch.Tensor | None = None
    cache_leftpad: torch.Tensor | None = None
    queries_full: bool = False
    cu_seqlens_full: torch.Tensor | None = None
    # Every row's padded query rows come first and its real queries are all its keys (a left-padded
    # prompt): under causal masking a padded row then sees no key and outputs zeros, exactly what the
    # packed path gives it, so the cache can be read in place for all B * Q rows too.
    queries_left_padded: bool = False

    def queries_as_keys(self) -> "_Unpad":
        """The same batch with the valid keys as the only queries (self-attention): what a
        bidirectional sliding window needs, since varlen aligns query i with key i + Lk - Lq and
        every query row of a bidirectional mask is otherwise kept. Computed once per mask."""
        view = self.__dict__.get("_as_keys")
        if view is None:
            view = _Unpad(self.key_valid, self.key_valid, self.cu_seqlens_k, self.cu_seqlens_k, self.max_seqlen_k,
                          self.max_seqlen_k, self.holes, self.no_padding, causal=self.causal,
                          keys_only=self.keys_only)
            self.__dict__["_as_keys"] = view
        return view

    # Where the real rows are, for the packed path (gathers straight from (B, H, S, D) and the
    # output's scatter): computed on first use, since reading the cache in place needs none of it.
    def _indices(self, valid: torch.Tensor, name: str) -> torch.Tensor:
        got = self.__dict__.get(name)
        if got is None:
            got = self.__dict__[name] = valid.flatten().nonzero().flatten()
        return got

    @property
    def indices_q(self) -> torch.Tensor:
        """int64 (total_q,): rows of the flattened (B*Q) queries that are real."""
        return self._indices(self.query_valid, "_indices_q")

    @property
    def indices_k(self) -> torch.Tensor:
        return self._indices(self.key_valid, "_indices_k")

    @property
    def rows_q(self) -> tuple:
        """(batch index, position) of each real query."""
        n = max(self.query_valid.shape[1], 1)
        return self.indices_q // n, self.indices_q % n

    @property
    def rows_k(self) -> tuple:
        n = max(self.key_valid.shape[1], 1)
        return self.indices_k // n, self.indices_k % n


def _unpad_from_validity(query_valid: torch.Tensor, key_valid: torch.Tensor, checks=()) -> _Unpad:
    """Unpadding data from bool (B, Q) / (B, K) validity (and the 0-d int ``checks`` the mask's
    overlays need, returned in ``checks``), with one host read of the validity masks: the lengths'
    arithmetic runs in numpy on B x (Q + K) bytes, where the same rules as torch ops cost ~40 small
    kernel calls per forward (0.3 ms of a decode step), and the few int32 vectors the attention
    calls need go back to the masks' device."""
    device = key_valid.device
    qv, kv = query_valid.cpu().numpy(), key_valid.cpu().numpy()
    checked = tuple(int(c) for c in checks)
    B, Q = qv.shape
    K = kv.shape[1]
    lens_q, lens_k = qv.sum(1, dtype=np.int32), kv.sum(1, dtype=np.int32)
    first = kv.argmax(1).astype(np.int32) if K else np.zeros(B, np.int32)
    last = K - 1 - kv[:, ::-1].argmax(1) if K else first
    holes = bool(((lens_k > 0) & (last - first + 1 != lens_k)).any())
    first_q = qv.argmax(1) if Q else np.zeros(B, np.int64)
    left_padded = bool((((lens_q == 0) | (first_q == Q - lens_q)) & ((lens_q == Q) | (lens_k == lens_q))).all())
    to_device = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)
    cumulative = lambda lens: to_device(np.concatenate([[0], np.cumsum(lens)]))
    queries_full = bool((lens_q == Q).all())
    return _Unpad(
        query_valid=query_valid,
        key_valid=key_valid,
        cu_seqlens_q=cumulative(lens_q),
        cu_seqlens_k=cumulative(lens_k),
        max_seqlen_q=int(lens_q.max(initial=0)),
        max_seqlen_k=int(lens_k.max(initial=0)),
        holes=holes,
        no_padding=queries_full and bool((lens_k == K).all()),
        checks=checked,
        seqused_k=to_device(lens_k),
        cache_leftpad=to_device(first) if K > 0 and not holes else None,
        queries_full=queries_full and not holes,
        queries_left_padded=left_padded and not holes,
        cu_seqlens_full=to_device(np.arange(B + 1) * Q),
    )


def _inner_code(factory, name="inner_mask"):
    """The code object of the mask function ``factory`` returns: every function it makes shares it."""
    return next(c for c in factory.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


_AND, _OR = _inner_code(masking_utils.and_masks, "and_mask"), _inner_code(masking_utils.or_masks, "or_mask")
_SLIDING = _inner_code(masking_utils.sliding_window_overlay)
_SLIDING_BIDIRECTIONAL = _inner_code(masking_utils.sliding_window_bidirectional_overlay)
_CHUNKED = _inner_code(masking_utils.chunked_overlay)
_BLOCKWISE = _inner_code(masking_utils.blockwise_overlay)
_PACKED = _inner_code(masking_utils.packed_sequence_mask_function)
_REMAP = _inner_code(masking_utils.remap_positions_for_packed_sequence)
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


def _overlay_refused(what: str) -> ValueError:
    return ValueError(
        f"mask_function: this model adds a custom mask overlay ({what}); jagged attention supports causal, "
        "sliding-window and padding masks, Llama 4's chunked attention, prefix-LM blocks (PaliGemma, Gemma3 "
        "images at the start of a sequence) and Gemma3's bidirectional attention only -- use "
        "attn_implementation='eager' or 'sdpa' for this model"
    )


@dataclass
class _Overlay:
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


def _read_mask_function(fn) -> _Overlay:
    """Read a mask function built by transformers' ``create_*_mask`` into an ``_Overlay``; anything it
    does not recognise exactly (a custom or_mask_function/and_mask_function) is refused."""
    code = getattr(fn, "__code__", None)
    if fn is masking_utils.causal_mask_function:
        return _Overlay(causal=True)
    if fn is masking_utils.bidirectional_mask_function:
        return _Overlay(causal=False, keys_only=True)
    if code is _REMAP:  # packed sequences: positions remapped per sequence, the pattern inside unchanged
        return _Overlay(**{**_read_mask_function(_cells(fn)["mask_function"]).__dict__, "packed": True})
    if code is _AND:
        return _read_and(_cells(fn)["mask_functions"])
    if code is _OR:
        base, *extra = _cells(fn)["mask_functions"]
        overlay = _read_mask_function(base)
        for f in extra:
            overlay = _read_or(overlay, f)
        return overlay
    raise _overlay_refused(f"{getattr(fn, '__qualname__', type(fn).__name__)} is not a transformers mask pattern")


def _cells(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))


def _read_and(functions) -> _Overlay:
    """``and_masks``: transformers' own constructions, recognised by their order -- an overlay first then
    its pattern (``sliding_window_causal_mask_function``, ``chunked_causal_mask_function``,
    ``sliding_window_bidirectional_mask_function``, ``packed_sequence_compatibility_function``), whose
    window the module passes as ``sliding_window``; or a pattern then an ``and_mask_function``, of which
    only Gemma3's window after its image blocks is known."""
    if len(functions) != 2:
        raise _overlay_refused("and_mask_function")
    first, second = functions
    code, cells = getattr(first, "__code__", None), _cells(first) if getattr(first, "__closure__", None) else {}
    if code is _PACKED and getattr(second, "__code__", None) is _REMAP:
        return _read_mask_function(second)  # packed: the remapped pattern is marked packed
    if code is _SLIDING_BIDIRECTIONAL and second is masking_utils.bidirectional_mask_function:
        return _Overlay(causal=False, keys_only=True, windowed=True)  # |q - kv| <= w: the module's (w, w)
    if code in (_SLIDING, _CHUNKED):
        overlay = _read_mask_function(second)
        if overlay.causal is True and overlay.chunk is None and overlay.sliding is None and overlay.blocks is None:
            if code is _SLIDING:
                overlay.sliding = cells["sliding_window"]
            else:
                overlay.chunk = (cells["chunk_size"], cells["left_padding"])
            return overlay
    if getattr(second, "__code__", None) is _SLIDING:
        overlay = _read_mask_function(first)
        if overlay.causal is True and overlay.blocks is not None and overlay.blocks_window is None:
            overlay.blocks_window = _cells(second)["sliding_window"]  # (causal | blocks) & window: Gemma3 images
            return overlay
    raise _overlay_refused("and_mask_function")


def _read_or(overlay: _Overlay, fn) -> _Overlay:
    """``or_masks``: the overlays transformers' families OR on a causal pattern."""
    code = getattr(fn, "__code__", None)
    if overlay.causal is False:
        if overlay.windowed or overlay.window is not None:  # an OR would reach past the window
            raise _overlay_refused(f"or_mask_function {getattr(fn, '__qualname__', type(fn).__name__)} on a "
                                   "bidirectional sliding window")
        _read_or(_Overlay(causal=True), fn)  # bidirectional | anything = bidirectional; unknown ones stay refused
        return overlay
    plain = overlay.causal is True and overlay.chunk is None and overlay.blocks is None and not overlay.packed
    if code is _BLOCKWISE and overlay.causal is True and overlay.blocks is None:
        overlay.blocks = _cells(fn)["block_sequence_ids"]
        return overlay
    if code is not None and _is_all_true(fn, code) and plain and overlay.sliding is None:
        return _Overlay(causal=False)  # Gemma3 use_bidirectional_attention, full layers
    if code is not None and _is_gemma3_window(code) and plain and overlay.sliding == _cells(fn)["sliding_window"]:
        # (q - w < kv <= q) | |q - kv| < w == |q - kv| < w: Gemma3 use_bidirectional_attention, sliding layers
        w = overlay.sliding
        return _Overlay(causal=False, window=(w - 1, w - 1))
    raise _overlay_refused(f"or_mask_function {getattr(fn, '__qualname__', type(fn).__name__)}")


def _no_padding_marker(batch_size: int, Q: int, K: int, device, dtype, **pattern) -> torch.Tensor:
    """A ``(B, 1, 1, Q + K)`` mask without padding whose only job is to carry the mask's pattern
    (``_Unpad`` fields: for encoder-decoder models, whose modules do not always declare it, and for
    the overlays of ``_Overlay``; never on the padding-free path of plain decoder-only masks, which
    stays mask-free for torch.compile). Additive zeros in the model's dtype: model code that reads
    a mask itself (NLLB-MoE's router) sees "nothing masked"."""
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
    mask = torch.zeros(batch_size, 1, 1, Q + K, dtype=dtype, device=device if device is not None else "cpu")
    setattr(mask, _UNPAD_ATTR, _marker_info(Q, K, **pattern))
    return mask


def _marker_info(Q: int, K: int, **pattern) -> _Unpad:
    """Unpadding data of a mask without padding: only the pattern (``_Unpad``'s pattern fields)."""
    empty = torch.empty(0, dtype=torch.int64)
    return _Unpad(torch.ones(1, Q, dtype=torch.bool), torch.ones(1, K, dtype=torch.bool), empty, empty, Q, K, False,
                  True, padded=False, **pattern)


def _chunk_keys(query_valid, key_valid, q_offset, kv_offset, chunk_size, left_padding):
    """Llama 4's chunks (``chunked_overlay``: ``(position - left_padding) // C``, absolute positions, so
    counted from each row's first real token) as varlen's (counted from the first key it is given).
    Drops the keys before the chunk of each row's first query (no query of the row sees them), so the
    first key kept starts that chunk (with one query per row, the keys kept are exactly its chunk). Returns the keys kept and a 0-d flag: some row's chunk ids would
    still differ (padding between its real tokens across chunks, or a cache that lost the chunk's start)."""
    B, K = key_valid.shape
    dev = key_valid.device
    C = int(chunk_size)
    lead = torch.as_tensor(left_padding, device=dev).reshape(-1, 1)
    key_pos = torch.arange(K, device=dev) + kv_offset - lead  # eager's positions (B, K)
    q_pos = query_valid.to(torch.int8).argmax(1, keepdim=True) + q_offset - lead  # each row's first query
    keep = key_valid & (key_pos.div(C, rounding_mode="floor") >= q_pos.div(C, rounding_mode="floor"))
    far = torch.iinfo(torch.int64).max // 2
    first = torch.where(keep, key_pos, far).amin(1)
    last = torch.where(keep, key_pos, -far).amax(1)
    aligned = (first % C == 0) & (last - first + 1 == keep.sum(1))  # same ids, shifted by whole chunks
    one_chunk = first.div(C, rounding_mode="floor") == last.div(C, rounding_mode="floor")  # < C keys: one chunk
    inexact = (query_valid.any(1) & keep.any(1) & ~aligned & ~one_chunk).any()
    return keep, inexact


def _window_keys(query_valid, key_valid, q_offset, kv_offset, window):
    """Drop the keys that no query of the row sees through a causal sliding window (eager: kv > q - w,
    absolute positions): those before the row's first query minus w - 1. Exact always; padding between
    real tokens that lies before every query's window (a right-padded prompt continued by generate)
    then no longer counts in the distances; with one query per row (decoding) the keys kept are exactly
    its window, padding inside it or not, and the hook drops the window."""
    K = key_valid.shape[1]
    first_q = query_valid.to(torch.int8).argmax(1, keepdim=True) + q_offset
    key_pos = torch.arange(K, device=key_valid.device) + kv_offset
    return key_valid & (key_pos > first_q - int(window))


def _prefix_lens(key_valid, blocks, kv_offset, K):
    """PaliGemma's / Gemma3's ``block_sequence_ids`` (``blockwise_overlay``: tokens of one block, id >= 0,
    see each other) as varlen's ``prefix_lens``: the same mask iff each row's real tokens are one block
    then only tokens without one (-1). Returns prefix_lens int32 (B,) counted from each row's first real
    key, a 0-d flag (some row is not such a prefix) and the longest prefix."""
    B = key_valid.shape[0]
    ids = blocks.to(key_valid.device)
    if ids.shape[-1] < kv_offset + K:  # transformers pads them to the key slots with -1 itself
        ids = torch.nn.functional.pad(ids, (0, kv_offset + K - ids.shape[-1]), value=-1)
    g = ids[:, kv_offset:kv_offset + K].expand(B, K)
    first = key_valid.to(torch.int8).argmax(1, keepdim=True)
    g0 = g.gather(1, first)
    rank = key_valid.cumsum(1) - 1  # position among the row's real keys
    run = torch.where(key_valid & (g != g0), rank, key_valid.sum(1, keepdim=True)).amin(1, keepdim=True)
    prefix = torch.where(g0 >= 0, run, 0)
    not_prefix = (key_valid & (g >= 0) & (rank >= prefix)).any()
    return prefix.view(B).to(torch.int32), not_prefix, prefix.max()


def jagged_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                          attention_mask=None, use_vmap=False, device=None, **kwargs):
    """transformers' mask hook for the "jagged" attention (see ``_compact_attention_mask``).

    Model code that uses the mask itself (``_model_reads_mask``) gets what eager would get instead, with
    the same unpadding data attached, so that the calls that do reach jagged attention still unpad."""
    _refuse_compressed_layers(kwargs.get("config"))
    if kwargs.get("config") is not None and _family_computes_attention(kwargs["config"]):
        # only the family's own attention code reads it: eager's mask as eager gets it (overlays
        # included); a jagged attention call, should one come, refuses a mask without unpadding data
        return _eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                           use_vmap, device, **kwargs)
    overlay = _overlay_of(mask_function, use_vmap)
    mask = _compact_attention_mask(overlay, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
                                   device, **kwargs)
    if not _model_reads_mask(kwargs.get("config"), overlay, kwargs):
        return mask
    return _with_eager_layout(mask, overlay, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                              attention_mask, use_vmap, device, **kwargs)


def _overlay_of(mask_function, use_vmap) -> _Overlay:
    """The pattern of the hook's ``mask_function`` (``_read_mask_function``); none given: unknown."""
    if mask_function is None:
        if use_vmap:
            raise _overlay_refused("or_mask_function/and_mask_function")
        return _Overlay()
    return _read_mask_function(mask_function)


def _refuse_compressed_layers(config) -> None:
    """Layers that append compressed KV entries (``config.compress_rates``, DeepSeek-V4's CSA/HCA) extend the
    keys inside the layer, after the mask is built, with a bias of their own for the new slots (or none,
    without padding): jagged attention would see keys it has no pattern for. Refused at the first call."""
    rates = getattr(config, "compress_rates", None) if config is not None else None
    compressed = sorted(set(rates or ()) & set(getattr(config, "layer_types", None) or ()))
    if compressed:
        raise ValueError(
            f"config.compress_rates: this model's {', '.join(compressed)} layers append compressed key/value "
            "entries with their own mask inside the layer, which jagged attention cannot express; use "
            "attn_implementation='eager' or 'sdpa' for this model"
        )


def _model_reads_mask(config, overlay: _Overlay, kwargs) -> bool:
    """Whether the model's own code uses the mask, not only hands it to the attention function:

    - the caller asked for a materialized mask (``allow_is_causal_skip=False``, or
      ``allow_is_bidirectional_skip=False`` for a bidirectional one): transformers' documented way of
      saying the mask is overlaid or concatenated (sparse-attention indexers add it to their scores,
      Doge its dynamic mask), unless transformers set it itself for packed sequences
      (the packed path reads position_ids); the static-cache decode step that transformers also
      materializes is a (B, 1, 1, K) mask, as small as ours;
    - the config says the model's router reads the padding from the mask (NLLB-MoE's
      ``router_ignore_padding_tokens=False``: it reads the last query row of eager's mask);
    - the family's modeling module does not use transformers' attention-function registry
      (``_family_computes_attention``): its own attention code adds the mask to its scores as eager's.
    """
    skip = kwargs.get("allow_is_bidirectional_skip" if overlay.keys_only else "allow_is_causal_skip", True)
    if skip is False and not overlay.packed:
        return True
    if config is None:
        return False
    return getattr(config, "router_ignore_padding_tokens", None) is False or _family_computes_attention(config)


_computes_attention: dict = {}  # config class -> bool


def _family_computes_attention(config) -> bool:
    """True if the config's modeling module (loaded, next to its configuration module) never reads
    transformers' attention-function registry ``ALL_ATTENTION_FUNCTIONS``: the family computes attention
    in its own (eager) code and never calls the jagged attention function (Bloom, MPT, CodeGen, BigBird,
    XGLM, LED, ...). Such a model runs its own attention whatever the name; it is told once."""
    cls = type(config)
    known = _computes_attention.get(cls)
    if known is None:
        module = sys.modules.get(cls.__module__.replace(".configuration_", ".modeling_"))
        known = module is not None and cls.__module__ != module.__name__ \
            and not hasattr(module, "ALL_ATTENTION_FUNCTIONS")
        _computes_attention[cls] = known
        if known:
            _logger.warning(
                "%s computes attention in its own code and does not call registered attention functions: with "
                "attn_implementation='jagged' it gets eager's attention mask and runs its own eager attention",
                getattr(config, "model_type", cls.__name__))
    return known


def _adopt_attention_class_tables(model_cls, name: str) -> None:
    """Families that pick their attention module from a table of their own at construction
    (``FALCON_ATTENTION_CLASSES[config._attn_implementation]``: Falcon, GPT-Neo, GPT-J, GIT) would
    fail with a KeyError for any registered name. Such a table's modules compute attention in their
    own code, so ``name`` gets the family's eager module, and the family is marked as computing its
    own attention (``_family_computes_attention``: it then gets eager's masks); it is told once."""
    module = sys.modules.get(model_cls.__module__)
    tables = [t for attr, t in vars(module).items() if attr.endswith("ATTENTION_CLASSES") and isinstance(t, dict)
              and "eager" in t and name not in t] if module is not None else []
    if not tables:
        return
    for table in tables:
        table[name] = table["eager"]
    config_cls = getattr(model_cls, "config_class", None)
    if config_cls is not None:
        _computes_attention[config_cls] = True
    _logger.warning("%s picks its attention module from its own table (%s): with attn_implementation=%r it runs its "
                    "own eager attention, with eager's attention mask", model_cls.__name__,
                    ", ".join(a for a, t in vars(module).items() if any(t is x for x in tables)), name)


def _correct_attn_implementation(self, requested_attention=None, is_init_check=False):
    """transformers' ``PreTrainedModel.get_correct_attn_implementation``, then, for a name registered
    here, the family's own attention tables adopt it (before any layer is built)."""
    chosen = _original_correct_attn_implementation[0](self, requested_attention, is_init_check)
    if chosen in _registered_names:
        _adopt_attention_class_tables(type(self), chosen)
    return chosen


_registered_names: set = set()
_original_correct_attn_implementation: list = [None]


def _eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, use_vmap, device,
                **kwargs):
    """transformers' own eager mask for the hook's arguments."""
    from transformers.masking_utils import causal_mask_function, eager_mask

    return eager_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                      kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                      attention_mask=attention_mask, use_vmap=use_vmap,
                      device=device if device is not None else "cpu", **kwargs)


def _with_eager_layout(compact, overlay, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                       use_vmap, device, **kwargs):
    """transformers' own eager mask for these arguments, carrying the unpadding data of ``compact`` (the
    pattern alone when there is no padding), so jagged attention reads it as it reads the compact mask."""
    mask = _eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, use_vmap,
                       device, **kwargs)
    if mask is None:
        return None
    info = getattr(compact, _UNPAD_ATTR, None) if compact is not None else None
    if info is None:  # no padding and nothing to carry (overlays are carried by the compact mask itself)
        info = _marker_info(int(q_length), int(kv_length), causal=overlay.causal, keys_only=overlay.keys_only,
                            packed=overlay.packed)
    setattr(mask, _UNPAD_ATTR, info)
    if not torch.compiler.is_compiling():  # a model that edits it in place is refused (_unpad_info)
        setattr(mask, _EAGER_VERSION_ATTR, mask._version)
    return mask


def _compact_attention_mask(overlay: _Overlay, batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                            attention_mask=None, device=None, **kwargs):
    """transformers' mask hook for the "jagged" attention: padding information, without a Q x K mask.

    Called by ``create_causal_mask`` / ``create_sliding_window_causal_mask`` once per forward with
    the 2-D padding mask (columns = absolute token positions) and the cache geometry: query i is at
    absolute position ``q_offset + i``, key slot j at ``kv_offset + j``. Returns ``None`` when every
    query and key slot is a real token, else a bool ``(B, 1, 1, Q + K)`` tensor: query validity then
    key validity (4-D so that transformers passes it through unchanged, e.g. from ``generate``'s
    static-cache mask preparation to the model). Static caches have key slots not yet written: with
    no 2-D mask (``generate`` drops an all-ones mask for non-flash names) the valid keys are
    rebuilt from ``q_offset + q_length``. The causal/sliding pattern itself is applied by the
    attention function (bottom-right causal, window from the module), so ``mask_function`` is not
    evaluated: it is read (``_read_mask_function``) for its pattern and the overlays of the module
    docstring, which travel with the mask (a mask without padding is returned to carry them);
    other overlays (``or_mask_function``/``and_mask_function``) are refused.

    ``create_bidirectional_mask`` (encoder self-attention; cross-attention, where the 2-D mask is the
    encoder's and ``q_length`` the decoder's) gets a keys-only mask instead: every query row is kept
    (as in eager), and the mask is additive ``(B, 1, 1, K)`` (0 / the dtype's min), which model code
    that reads the mask itself can use as it uses eager's.
    """
    if overlay.packed and overlay.blocks is not None:
        raise ValueError(
            "block_sequence_ids: bidirectional blocks (token_type_ids) in packed sequences: transformers numbers "
            "them across the packed row, which jagged attention cannot express -- pad the batch instead"
        )
    config = kwargs.get("config")
    Q, K = int(q_length), int(kv_length)
    causal, keys_only = overlay.causal, overlay.keys_only
    chunk = overlay.chunk
    if chunk is not None and isinstance(kv_offset, int) and kv_offset + K <= chunk[0]:
        chunk = None  # every key slot lies in the first chunk: chunking changes nothing
    if chunk is not None and overlay.blocks is not None:
        raise _overlay_refused("block_sequence_ids with chunked attention")
    pattern = dict(causal=causal, keys_only=keys_only, window=overlay.window,
                   chunk=int(chunk[0]) if chunk is not None else None, packed=overlay.packed)
    # encoder-decoder modules do not always declare the pattern their mask has (bigbird_pegasus'
    # decoder self-attention says is_causal=False and relies on a causal mask, in the encoder-decoder and
    # as BigBirdPegasusForCausalLM): for their causal masks even a mask without padding is returned, as a
    # marker that carries the pattern (is_encoder_decoder or is_decoder configs; other decoder-only
    # models keep getting None without padding: the padding-free path stays mask-free for torch.compile.
    # Families whose own code adds the mask to its scores get eager's mask instead: _model_reads_mask).
    # So do the causal masks of configs whose modules say is_causal=False (use_bidirectional_attention:
    # PaliGemma's Gemma sets it, its eager mask is causal nonetheless), and masks with overlays
    declared = getattr(config, "is_encoder_decoder", False) or getattr(config, "is_decoder", False) \
        or getattr(config, "use_bidirectional_attention", False)
    carry = (causal is True and bool(declared)) or overlay.window is not None or chunk is not None

    def no_padding(prefix_lens=None):
        if not carry and prefix_lens is None:
            return None
        return _no_padding_marker(batch_size, Q, K, device, kwargs.get("dtype"), prefix_lens=prefix_lens, **pattern)

    if attention_mask is None and chunk is None and overlay.blocks is None \
            and (keys_only or (isinstance(q_offset, int) and q_offset + Q == kv_offset + K)):
        # every key slot holds a real token (bidirectional masks have no cache geometry to rebuild):
        # dense path (or packed via position_ids)
        return no_padding()
    total = kv_offset + K
    if attention_mask is None:
        dev = device if device is not None else "cpu"
        positions = torch.arange(total, device=dev)
        valid = (positions < q_offset + Q).unsqueeze(0).expand(batch_size, total)
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
            raise ValueError(
                "attention_mask: jagged attention expects the 2-D padding mask (batch, tokens) "
                f"here, got {type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}"
            )
        if attention_mask.shape[0] != batch_size:
            raise ValueError(
                f"attention_mask: batch size {attention_mask.shape[0]} does not match the inputs' {batch_size}"
            )
        valid = attention_mask.to(torch.bool)
        if valid.shape[1] < total:  # static cache: slots past the mask are not written yet
            valid = torch.nn.functional.pad(valid, (0, total - valid.shape[1]), value=False)
    key_valid = valid[:, kv_offset:total]
    if keys_only:
        # bidirectional (encoder self-attention, or cross-attention: queries are decoder tokens that
        # the encoder's 2-D mask says nothing about): the mask masks keys only, as in eager, and
        # every query row is computed (eager computes padded encoder rows too)
        query_valid = torch.ones(batch_size, Q, dtype=torch.bool, device=valid.device)
    else:
        q_positions = torch.arange(Q, device=valid.device) + q_offset
        query_valid = valid.index_select(1, q_positions)
    checks = []
    if overlay.sliding is not None and overlay.blocks is None:
        key_valid = _window_keys(query_valid, key_valid, q_offset, kv_offset, overlay.sliding)
    if chunk is not None:
        key_valid, inexact = _chunk_keys(query_valid, key_valid, q_offset, kv_offset, *chunk)
        checks.append(inexact)
    if overlay.blocks is not None:
        block_prefix, not_prefix, longest = _prefix_lens(key_valid, overlay.blocks, kv_offset, K)
        checks += [not_prefix, longest]
    info = _unpad_from_validity(query_valid, key_valid, checks)
    read = list(info.checks)
    if chunk is not None and read.pop(0):
        raise ValueError(
            f"attention_mask: with chunked attention (config.attention_chunk_size={chunk[0]}) a row has padding "
            "between real tokens where several of its queries' chunks would count it (e.g. a prompt with padding "
            "inside it), or a cache that no longer holds the start of its chunk: its chunks would differ from "
            "eager's. Decoding one token per row past such padding is supported"
        )
    if chunk is not None and info.max_seqlen_q <= 1:
        # one query per row (decoding): the keys kept are exactly its chunk, so no chunk option (any kernel runs)
        pattern["chunk"] = None
    prefix_lens = None
    if overlay.blocks is not None:
        not_prefix, longest = read
        if not_prefix:
            raise ValueError(
                "block_sequence_ids: a bidirectional block (token_type_ids: image or prefix tokens) that is not at "
                "the start of its sequence, or several blocks; jagged attention supports one block at the start "
                "(prefix-LM) -- use attn_implementation='eager' or 'sdpa' for these inputs"
            )
        if overlay.blocks_window is not None and longest > overlay.blocks_window:
            raise ValueError(
                f"block_sequence_ids: a bidirectional block of {longest} tokens is longer than the sliding window "
                f"({overlay.blocks_window}) it is cut by; jagged attention's prefix is not windowed -- use "
                "attn_implementation='eager' or 'sdpa' for these inputs"
            )
        prefix_lens = block_prefix if longest > 1 else None  # a 1-token block is causal anyway
    if overlay.sliding is not None and overlay.blocks is None and info.max_seqlen_q <= 1:
        pattern["window"] = (-1, -1)  # one query per row (decoding): the keys kept are exactly its window
    if info.no_padding:
        return no_padding(prefix_lens)  # no padding after all: the dense path needs no indices
    for name, value in pattern.items():
        setattr(info, name, value)
    info.prefix_lens = prefix_lens
    if keys_only:
        # keys only: an additive (B, 1, 1, K) mask, 0 for real keys and the dtype's min for padding, which
        # model code that reads the mask itself can use as eager's (bigbird_pegasus' encoder adds it to its
        # scores, NLLB-MoE's router reads its last row); the unpadding data rides along as for every mask
        dtype = kwargs.get("dtype")
        dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
        mask = torch.zeros(batch_size, 1, 1, K, dtype=dtype, device=valid.device)
        mask.masked_fill_(~key_valid.view(batch_size, 1, 1, K), torch.finfo(dtype).min)
        setattr(mask, _UNPAD_ATTR, info)
        return mask
    mask = torch.cat([query_valid, key_valid], dim=1).view(batch_size, 1, 1, Q + K)
    setattr(mask, _UNPAD_ATTR, info)
    return mask


# Packed boundaries derived from the last position_ids tensor seen (every layer of a forward gets the
# same object): one host read per forward instead of one per layer. Holds a weak reference only.
_last_positions: list = [None]  # (weakref to position_ids, (version, B, S), result)


def _packed_from_position_ids(position_ids: torch.Tensor, B: int, S: int):
    """cu_seqlens and max length of the sequences packed in each row: a new one wherever positions
    do not continue by +1 (transformers' ``find_packed_sequence_indices`` rule). None if each row
    is one sequence."""
    compiling = torch.compiler.is_compiling()
    key = (position_ids._version, B, S)
    if not compiling:
        hit = _last_positions[0]
        if hit is not None and hit[0]() is position_ids and hit[1] == key:
            return hit[2]
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[0] != B:
        pos = pos.expand(B, -1)
    starts = torch.ones(B, S, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    begin = starts.flatten().nonzero().flatten().to(torch.int32)
    cu = torch.cat([begin, begin.new_tensor([B * S])])
    n_seqs, max_len = torch.stack([cu.new_tensor(cu.numel() - 1), cu.diff().max()]).tolist()
    result = None if n_seqs == B else (cu, int(max_len))
    if not compiling:
        _last_positions[0] = (weakref.ref(position_ids), key, result)
    return result


def _as_int(x, name):
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name}: expected an int or a one-element tensor, got shape {tuple(x.shape)}")
        return int(x.item())
    if not isinstance(x, int):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    return x


def jagged_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers attention function backed by ``jagged_sdpa.varlen_attention``.

    Same contract as transformers' ``sdpa_attention_forward``: query ``(B, Hq, Q, D)``, key/value
    ``(B, Hkv, K, D)`` (cache included) -> ``(output (B, Q, Hq, Dv), None)``. Attention weights are
    never materialised, so ``output_attentions`` yields ``None`` (as with sdpa/flash).
    """
    if kwargs.get("position_bias") is not None:
        raise ValueError("position_bias: not supported by jagged attention (use attn_implementation='eager')")
    if kwargs.get("indices") is not None:
        # DeepSeek sparse attention and its descendants hand non-eager/sdpa attentions the indexer's selection
        raise ValueError(
            "indices: this model's sparse-attention indexer selects the top-k keys of each query, which jagged "
            "attention cannot restrict itself to (it attends to every key its mask allows); use "
            "attn_implementation='eager' or 'sdpa' for this model"
        )
    if kwargs.get("cache") is not None:
        raise ValueError(
            "cache: a paged (continuous batching) cache reached the 'jagged' attention; transformers' continuous "
            "batching accepts only its built-in names: call jagged_sdpa.integrations.transformers."
            "enable_continuous_batching() and use attn_implementation='sdpa'"
        )
    if kwargs.get("output_attentions", False) and not _warned_output_attentions[0]:
        _warned_output_attentions[0] = True
        _logger.warning("jagged attention does not compute attention weights; output_attentions gives None")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            f"query/key/value: expected (batch, heads, seq, head_dim) tensors, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    B, Hq, Q, D = query.shape
    K, Hkv, Dv = key.shape[2], key.shape[1], value.shape[-1]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # Traced by torch.compile (transformers' static-cache recipe): the mask is read as a tensor only
    # (``_traced_in_place``), so nothing is read on the host and one graph serves every decode step.
    traced = attention_mask is not None and torch.compiler.is_compiling()
    info = _unpad_info(attention_mask, B, Q, K) if attention_mask is not None and not traced else None
    if info is not None and info.causal is not None:
        causal = info.causal  # the mask's pattern is what eager applies (see _Unpad.causal)
    window = (-1, -1)
    if sliding_window is not None:
        sw = _as_int(sliding_window, "sliding_window")
        if sw <= 0:
            raise ValueError(f"sliding_window: must be a positive int, got {sw}")
        # eager: causal keeps kv > q - sw (sw tokens including itself); bidirectional |q - kv| <= sw
        window = (sw - 1, 0) if causal else (sw, sw)
    dropout_p = float(dropout) if module.training else 0.0
    options = dict(dropout_p=dropout_p, softmax_scale=scaling, causal=causal, window_size=window,
                   softcap=float(softcap) if softcap else 0.0)
    if kwargs.get("s_aux") is not None:  # gpt-oss and others: learned per-head sinks (docs/api.md section 11)
        options["sinks"] = kwargs["s_aux"]
    packed_by_eager = False
    if info is not None:  # the mask's overlays (see _Overlay)
        packed_by_eager = info.packed
        if info.window is not None:
            window = options["window_size"] = info.window
        if info.chunk is not None:
            options["chunk_size"] = info.chunk
        if info.prefix_lens is not None:
            options["prefix_lens"] = info.prefix_lens
        if not info.padded:
            info = None  # a marker only: no padding to remove

    q = query.transpose(1, 2)  # (B, Q, Hq, D)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if traced:
        return _traced_in_place(q.reshape(B * Q, Hq, D), k, v, attention_mask, options).view(B, Q, Hq, Dv), None

    if info is not None:
        if info.keys_only and window != (-1, -1):
            # eager's bidirectional window |q - kv| <= w counts positions in the padded row; packed,
            # it holds only when each sequence's queries are its keys. Padded query rows then
            # output zeros (eager's see only padding), real rows equal eager's.
            if Q != K:
                raise ValueError(
                    f"sliding_window: a bidirectional sliding window between {Q} queries and {K} keys "
                    "(cross-attention) with a padding mask is not supported by jagged attention; "
                    "use attn_implementation='eager' or 'sdpa' for this model"
                )
            info = info.queries_as_keys()
        if info.holes and window != (-1, -1):
            raise ValueError(
                "attention_mask: a row has padding between real tokens inside the sliding window of several "
                "of its queries (e.g. a prompt with padding inside it); the distances would differ from "
                "eager. Decoding one token per row past such padding is supported"
            )
        if info.queries_full or (info.queries_left_padded and causal and "prefix_lens" not in options):
            # every query row is real (or a left-padded prompt's, which sees no key under causal
            # masking) and each row's keys are one run of cache slots: read the cache where it lies
            # (docs/api.md section 12), no gather of K/V and no scatter of the output
            out = varlen_attention(query.transpose(1, 2).reshape(B * Q, Hq, D), k, v, info.cu_seqlens_full, None,
                                   Q, info.max_seqlen_k, seqused_k=info.seqused_k, cache_leftpad=info.cache_leftpad,
                                   **options)
            return out.view(B, Q, Hq, Dv), None
        # one gather per tensor, straight from (B, H, S, D): no full (B, S, H, D) copy first
        q = query[info.rows_q[0], :, info.rows_q[1]]  # (total_q, Hq, D)
        k = key[info.rows_k[0], :, info.rows_k[1]]
        v = value[info.rows_k[0], :, info.rows_k[1]]
        out = varlen_attention(q, k, v, info.cu_seqlens_q, info.cu_seqlens_k, info.max_seqlen_q,
                               info.max_seqlen_k, **options)
        full = out.new_zeros(B * Q, Hq, Dv).index_copy(0, info.indices_q, out)
        return full.view(B, Q, Hq, Dv), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)  # no-op when already int32
        max_q, max_k = _as_int(max_q, "max_length_q"), _as_int(max_k, "max_length_k")
    else:
        packed = None
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and Q == K and Q > 1 and position_ids.shape[-1] == Q:
            packed = _packed_from_position_ids(position_ids, B, Q)
        if packed is not None:
            cu_q, max_q = packed
            cu_k, max_k = cu_q, max_q
        elif packed_by_eager:
            # e.g. Llama 4's layers do not pass position_ids on: the boundaries eager used are not known here
            raise ValueError(
                "position_ids: eager separates the sequences packed in a row (position_ids restarting), but this "
                "model does not hand position_ids to its attention; pass DataCollatorWithFlattening's "
                "cu_seq_lens_q/k and max_length_q/k (return_flash_attn_kwargs=True), or pad the batch"
            )
        elif K > Q:  # decoding without padding: the cache is read where it lies (docs/api.md section 12)
            cu_q, used = _dense_lengths(B, Q, K, query.device)
            out = varlen_attention(q.reshape(B * Q, Hq, D), k, v, cu_q, None, Q, K, seqused_k=used, **options)
            return out.view(B, Q, Hq, Dv), None
        else:  # dense: B sequences of Q queries and K keys (new queries are the last keys)
            cu_q = torch.arange(0, (B + 1) * Q, Q, dtype=torch.int32, device=query.device)
            cu_k = cu_q if K == Q else torch.arange(0, (B + 1) * K, K, dtype=torch.int32, device=query.device)
            max_q, max_k = Q, K
    out = varlen_attention(q.reshape(B * Q, Hq, D), k.reshape(B * K, Hkv, D), v.reshape(B * K, Hkv, Dv),
                           cu_q, cu_k, max_q, max_k, **options)
    return out.view(B, Q, Hq, Dv), None


def _traced_in_place(q, k, v, mask, options):
    """The in-place call of a traced forward, from the mask tensor alone: the compact bool
    ``(B, 1, 1, Q + K)`` mask (or the keys-only additive ``(B, 1, 1, K)`` one) gives each row's first
    valid key slot and their count as tensors; ``K`` bounds ``max_seqlen_k``. Every query row is
    computed: a padded one sees no key under causal masking (left padding), and its output is never
    read as a key. Padding between real keys cannot be expressed by a range: a device-side assert
    fails loudly instead of returning other numbers."""
    B, K = k.shape[0], k.shape[1]
    Q = q.shape[0] // max(B, 1)
    if mask.dtype == torch.bool and mask.shape[-1] == Q + K:
        key_valid = mask.reshape(B, Q + K)[:, Q:]
    elif mask.shape[-1] == K:
        key_valid = mask.reshape(B, K) == 0
    else:
        raise ValueError(
            f"attention_mask: under torch.compile jagged attention reads its own compact mask "
            f"(bool (B, 1, 1, Q + K) = ({B}, 1, 1, {Q + K})), got {mask.dtype} of shape {tuple(mask.shape)}; "
            "build the model with attn_implementation=jagged_sdpa.integrations.transformers.register()")
    valid = key_valid.to(torch.int32)
    used = valid.sum(1, dtype=torch.int32)
    first = valid.argmax(1).to(torch.int32)
    last = K - 1 - valid.flip(1).argmax(1).to(torch.int32)
    torch._assert_async(((used == 0) | (last - first + 1 == used)).all(),
                        "jagged_sdpa: under torch.compile a row's real keys must be one run of cache slots "
                        "(left padding); this mask has padding between real tokens")
    cu_q = torch.arange(0, (B + 1) * Q, max(Q, 1), dtype=torch.int32, device=q.device)[:B + 1]
    return varlen_attention(q, k, v, cu_q, None, Q, K, seqused_k=used, cache_leftpad=first, **options)


@functools.lru_cache(maxsize=16)
def _dense_lengths(B: int, Q: int, K: int, device: torch.device) -> tuple:
    """cu_seqlens_q and seqused_k of B rows of Q queries over K cached keys each: the same tensors
    for every layer and step of that shape, so the batch is validated once."""
    cu_q = torch.arange(0, (B + 1) * Q, max(Q, 1), dtype=torch.int32, device=device)[:B + 1]
    return cu_q, torch.full((B,), K, dtype=torch.int32, device=device)


def _unpad_info(mask: torch.Tensor, B: int, Q: int, K: int) -> _Unpad:
    """The unpadding data of a mask: cached on the masks ``jagged_attention_mask`` builds; a bool
    ``(B, 1, 1, Q + K)`` or a 2-D ``(B, L >= K)`` padding mask (keys = its last K columns, queries
    its last Q: the flash convention) is also read directly."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a tensor or None, got {type(mask).__name__}")
    info = getattr(mask, _UNPAD_ATTR, None)
    if info is not None and (mask.shape == (B, 1, 1, Q + K) or (info.keys_only and mask.shape == (B, 1, 1, K))):
        return info  # compact, or keys-only (bidirectional)
    if info is not None and mask.shape == (B, 1, Q, K):  # eager's layout, for model code that reads it
        version = getattr(mask, _EAGER_VERSION_ATTR, None)
        if version is not None and version != mask._version:
            raise ValueError(
                "attention_mask: this model modified its attention mask in place (e.g. added a bias or a "
                "selection to it), which jagged attention cannot apply; use attn_implementation='eager' or 'sdpa'"
            )
        return info
    if mask.dtype == torch.bool and mask.shape == (B, 1, 1, Q + K):
        flat = mask.view(B, Q + K)
        return _unpad_from_validity(flat[:, :Q], flat[:, Q:])
    if mask.ndim == 2 and mask.shape[0] == B and mask.shape[1] >= K >= Q:
        valid = mask.to(torch.bool)
        return _unpad_from_validity(valid[:, -Q:], valid[:, -K:])
    if mask.ndim == 4 and mask.shape[0] == B and mask.shape[-2:] == (Q, K):
        raise ValueError(
            f"attention_mask: jagged attention got a {mask.dtype} mask of shape {tuple(mask.shape)} that its mask "
            "function did not build: a 4-D mask passed in, or one this model's code computed itself (a "
            "sparse-attention indexer's selection, a learned per-head or dynamic mask, a bias added to the mask). "
            "Jagged attention supports causal, sliding-window and padding masks only: pass the 2-D padding mask, "
            "or use attn_implementation='eager' or 'sdpa' for this model"
        )
    raise ValueError(
        f"attention_mask: jagged attention got a {mask.dtype} mask of shape {tuple(mask.shape)}, not one "
        f"built by its mask function (bool (B, 1, 1, Q + K) = ({B}, 1, 1, {Q + K})) nor a 2-D padding mask. "
        "Build the model with attn_implementation=jagged_sdpa.integrations.transformers.register() so that "
        "transformers uses the matching mask function"
    )


def register(name: str = DEFAULT_NAME) -> str:
    """Register the jagged attention and its mask function under ``name`` and return the name.

    Idempotent. Names containing "sdpa" or "flash" are refused (transformers gives them special
    treatment, see the module docstring), and so are transformers' own implementations' names.
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    if not name or name != name.strip():
        raise ValueError(f"name: expected a non-empty name without surrounding spaces, got {name!r}")
    lowered = name.lower()
    if "sdpa" in lowered or "flash" in lowered:
        raise ValueError(
            f"name: {name!r} contains 'sdpa' or 'flash'; transformers would apply its SDPA dispatch rules "
            "or try to load a Hub flash kernel for it. Choose another name (default 'jagged')"
        )
    attn_existing = AttentionInterface._global_mapping.get(name)
    mask_existing = AttentionMaskInterface._global_mapping.get(name)
    if name in _BUILTIN_NAMES or attn_existing not in (None, jagged_attention_forward) \
            or mask_existing not in (None, jagged_attention_mask):
        raise ValueError(f"name: {name!r} is already registered in transformers for another attention")
    AttentionInterface.register(name, jagged_attention_forward)
    AttentionMaskInterface.register(name, jagged_attention_mask)
    _registered_names.add(name)
    from transformers.modeling_utils import PreTrainedModel

    if _original_correct_attn_implementation[0] is None:  # once: families with attention tables of their own
        _original_correct_attn_implementation[0] = PreTrainedModel.get_correct_attn_implementation
        PreTrainedModel.get_correct_attn_implementation = _correct_attn_implementation
    return name


# ---------------------------------------------------------------------------------------------------
# Continuous batching (transformers' generate_batch / serve --continuous-batching): docs/api.md section 8.
#
# transformers accepts only its built-in names there, so jagged attention goes in under "sdpa" (opt-in,
# process-wide). Calls that carry a PagedAttentionCache run ragged attention with varlen_attention;
# every other call, and every continuous-batching call this path does not cover exactly, runs
# transformers' own SDPA (the function that held the "sdpa" entry before).
#
# Per step, once for each cache group (full / sliding attention), and shared by every layer of the
# step: the group's lengths, its block table (derived from transformers' read indices and checked
# against them) and the mode. Per layer: write the new K/V into the cache (transformers' own update,
# write only) and attend. The per-step group is where a ``jagged_sdpa.plan`` (docs/api.md section 10)
# slots in: built in ``_cb_group`` with the group's cu_seqlens_q/block_table/seqused_k/max lengths and
# causal/window, then ``plan.run(q, k_pages, v_pages)`` in ``_cb_attend`` instead of varlen_attention.

try:  # pragma: no branch - transformers 5.x
    from transformers.generation.continuous_batching.cache import PagedAttentionCache as _PagedAttentionCache
except ImportError:  # pragma: no cover - a transformers without continuous batching
    _PagedAttentionCache = None
from transformers.integrations.sdpa_attention import sdpa_attention_forward as _hf_sdpa_attention_forward

_CB_NAME = "sdpa"
_cb_state: dict = {"original": None}
_cb_step: list = [None]  # (weakref to the step's cu_seq_lens_q, (its version, write index id), {layer type: _CBGroup})
# layer calls per mode, and per-step groups built (tests, benchmarks)
_cb_stats = {"paged": 0, "packed": 0, "gather": 0, "fallback": 0, "groups": 0}


@dataclass
class _CBGroup:
    """One step's attention metadata for one cache group (what a plan would hold)."""

    mode: str  # "paged": keys read in place through a block table; "packed": only new keys (no past);
    # "gather": transformers' own cache read (sliding-window ring buffers); "fallback": transformers' SDPA
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    total_q: int = 0
    total_k: int = 0
    block_table: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    write_only: list | None = None  # read indices that make transformers' cache.update write without reading


def _cb_step_version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter: identity alone keys the step
        return None


def _cb_block_table(read_index: torch.Tensor, cu_k: torch.Tensor, seqused: torch.Tensor, max_k: int, page: int,
                    total_k: int):
    """The block table (in pages of the allocator's per-layer page view) that reads exactly what
    transformers' read indices read, or None if they are not whole pages in order (then the cache
    is read through transformers' gather)."""
    if read_index.numel() < total_k or total_k == 0 or max_k <= 0:
        return None
    ri = read_index[:total_k]
    n_blocks = (max_k + page - 1) // page
    B = seqused.numel()
    local = torch.arange(n_blocks, device=ri.device) * page  # (n_blocks,)
    used = local.unsqueeze(0) < seqused.unsqueeze(1)  # (B, n_blocks)
    starts = (cu_k[:-1].to(torch.int64).unsqueeze(1) + local).clamp(max=total_k - 1)
    first = ri[starts]  # physical index of each page's first token
    table = torch.where(used, torch.div(first, page, rounding_mode="floor"), torch.zeros_like(first))
    # the exact read every key token would get through the table: page * block + offset
    seq_of_token = torch.repeat_interleave(torch.arange(B, device=ri.device), seqused.to(torch.int64),
                                           output_size=total_k)
    pos = torch.arange(total_k, device=ri.device) - cu_k[:-1].to(torch.int64)[seq_of_token]
    expected = table[seq_of_token, torch.div(pos, page, rounding_mode="floor")] * page + pos % page
    aligned = bool(((first % page == 0) | ~used).all()) and torch.equal(expected, ri)
    return table.to(torch.int32) if aligned else None


def _cb_group(kwargs: dict, cache, allocator) -> _CBGroup:
    """The step's group for ``allocator``: built at the step's first layer of that group, reused after."""
    # transformers hands every layer of a step the same tensors, and new views of its static buffers at
    # each step: the step is keyed by their identity (weak references) and cu_seq_lens_q's version
    cu_q_in = kwargs.get("cu_seq_lens_q")
    writes = kwargs.get("write_index") or [None]
    key = (_cb_step_version(cu_q_in), id(writes[0]))
    hit = _cb_step[0]
    if hit is not None and hit[0]() is cu_q_in and hit[1] == key:
        groups = hit[2]
    else:
        groups = {}
        _cb_step[0] = (weakref.ref(cu_q_in), key, groups)
    group = groups.get(allocator.layer_type)
    if group is None:
        group = groups[allocator.layer_type] = _cb_build_group(kwargs, cache, allocator)
    return group


def _cb_build_group(kwargs: dict, cache, allocator) -> _CBGroup:
    _cb_stats["groups"] += 1
    cu_k_all, max_k_all = kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_k")
    read_index, write_index = kwargs.get("read_index"), kwargs.get("write_index")
    if not isinstance(cu_k_all, dict) or not isinstance(max_k_all, dict) or read_index is None or write_index is None \
            or allocator.layer_type not in cu_k_all:
        return _CBGroup("fallback")
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = cu_k_all[allocator.layer_type].to(torch.int32)
    max_q = _as_int(kwargs.get("max_length_q"), "max_length_q")
    max_k = _as_int(max_k_all[allocator.layer_type], "max_length_k")
    total_q, total_k = torch.stack([cu_q[-1], cu_k[-1]]).tolist()  # the step's one host read
    reads = read_index[allocator.index]
    no_reads = [r[:0] for r in read_index]
    common = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, total_q=total_q,
                  total_k=total_k, write_only=no_reads)
    if allocator.layer_type != "full_attention" or not getattr(allocator, "supports_block_table", False):
        return _CBGroup("gather", **common)  # sliding window: a ring buffer, read through transformers
    if reads.numel() == 0:
        # no request has a past: the keys are the new tokens (transformers returns them as they are)
        return _CBGroup("packed", **common) if torch.equal(cu_k, cu_q) else _CBGroup("gather", **common)
    seqused = cu_k.diff()
    table = _cb_block_table(reads, cu_k, seqused, max_k, allocator.tokens_per_page, total_k)
    if table is None:
        return _CBGroup("gather", **common)
    return _CBGroup("paged", block_table=table, seqused_k=seqused.to(torch.int32), **common)


def _cb_supported(query, kwargs, dropout, module) -> bool:
    """What this path covers; anything else runs transformers' SDPA, as it would without us."""
    if _PagedAttentionCache is None or not isinstance(kwargs.get("cache"), _PagedAttentionCache):
        return False
    if kwargs.get("block_table") is not None:  # the flash decode fast path (CUDA/XPU): not an SDPA call
        return False
    for name in ("softcap", "position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            return False
    if dropout and getattr(module, "training", False):
        return False
    return query.ndim == 4 and query.shape[0] == 1 and getattr(module, "layer_idx", None) is not None


def continuous_batching_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                     is_causal=None, **kwargs):
    """The "sdpa" entry while continuous batching is enabled: jagged attention on continuous-batching
    calls, transformers' SDPA on every other call (same signature as ``sdpa_attention_forward``)."""
    original = _cb_state["original"] or _hf_sdpa_attention_forward
    if not _cb_supported(query, kwargs, dropout, module):
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    out = _cb_run(module, query, key, value, scaling, kwargs)
    if out is None:
        _cb_stats["fallback"] += 1
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    return out, None


@torch.compiler.disable  # per-step host read and cache; transformers' cache.update is not traced either
def _cb_run(module, query, key, value, scaling, kwargs):
    cache = kwargs["cache"]
    allocator = cache.layer_to_allocator[module.layer_idx]
    group = _cb_group(kwargs, cache, allocator)
    if group.mode == "fallback":
        return None
    return _cb_attend(module, query, key, value, scaling, kwargs, cache, allocator, group)


def _cb_attend(module, query, key, value, scaling, kwargs, cache, allocator, group: _CBGroup) -> torch.Tensor:
    _cb_stats[group.mode] += 1
    T, Hq, Dv = query.shape[2], query.shape[1], value.shape[-1]
    layer = module.layer_idx
    if group.mode == "gather":
        key, value = cache.update(key_states=key, value_states=value, layer_idx=layer, kwargs=dict(kwargs))
    else:  # write the new K/V (transformers' own update, with no read: it returns its inputs)
        cache.update(key_states=key, value_states=value, layer_idx=layer,
                     kwargs=dict(kwargs, read_index=group.write_only))
    q = query[0].transpose(0, 1)[: group.total_q]  # (total_q, Hq, D)
    window = (-1, -1)
    if group.mode == "gather" and allocator.layer_type == "sliding_attention":
        sw = getattr(allocator, "sliding_window", None) or getattr(cache.config, "sliding_window", None)
        window = (int(sw) - 1, 0)  # transformers' CB mask: a query sees the sw keys up to itself
    options = dict(softmax_scale=scaling, causal=True, window_size=window)
    if group.mode == "paged":
        k_pages, v_pages = allocator.get_cache_for_block_table(layer)
        out = varlen_attention(q, k_pages, v_pages, group.cu_seqlens_q, None, group.max_seqlen_q, group.max_seqlen_k,
                               block_table=group.block_table, seqused_k=group.seqused_k, **options)
    else:
        k = key[0].transpose(0, 1)[: group.total_k]
        v = value[0].transpose(0, 1)[: group.total_k]
        out = varlen_attention(q, k, v, group.cu_seqlens_q, group.cu_seqlens_k, group.max_seqlen_q,
                               group.max_seqlen_k, **options)
    if group.total_q < T:  # padded steps (static shapes): padded rows are zeros
        out = torch.cat([out, out.new_zeros(T - group.total_q, Hq, Dv)])
    return out.unsqueeze(0)


def enable_continuous_batching() -> None:
    """Run jagged attention in transformers' continuous batching (``generate_batch``, ``serve``).

    transformers 5.x accepts only its built-in names there, so this replaces the process-wide "sdpa"
    entry of ``AttentionInterface`` with ``continuous_batching_sdpa_forward``: continuous-batching calls
    (a ``PagedAttentionCache`` in the kwargs) run ragged ``varlen_attention`` over the paged cache, every
    other call runs transformers' SDPA. Build or switch the model with ``attn_implementation="sdpa"``.
    Idempotent; undone by ``disable_continuous_batching()``.
    """
    current = AttentionInterface._global_mapping.get(_CB_NAME)
    if current is continuous_batching_sdpa_forward:
        return
    _cb_state["original"] = current
    AttentionInterface.register(_CB_NAME, continuous_batching_sdpa_forward)


def disable_continuous_batching() -> None:
    """Give the "sdpa" entry back to the function that held it before ``enable_continuous_batching``.
    Idempotent; an entry someone else replaced in between is left alone."""
    if AttentionInterface._global_mapping.get(_CB_NAME) is continuous_batching_sdpa_forward:
        AttentionInterface.register(_CB_NAME, _cb_state["original"] or _hf_sdpa_attention_forward)
    _cb_state["original"] = None
    _cb_step[0] = None


def continuous_batching_enabled() -> bool:
    """Whether the "sdpa" entry is jagged's continuous-batching function."""
    return AttentionInterface._global_mapping.get(_CB_NAME) is continuous_batching_sdpa_forward
