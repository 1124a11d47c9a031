"""The mask hook (``AttentionMaskInterface``). Without one, transformers hands a custom attention
function ``attention_mask=None`` and padding is silently ignored. Ours turns the 2-D padding mask and
the cache geometry (query/key offsets, static cache slots not yet written) into a compact bool mask
``(B, 1, 1, Q + K)`` -- query validity then key validity, no ``Q x K`` matrix -- carrying the
unpadding data (``unpad.Unpad``) computed once per forward for every layer.

Encoder-decoder models: the hook reads which pattern transformers asked for (causal or bidirectional)
from the mask function; bidirectional masks (encoder self-attention, cross-attention) mask keys only
and keep every query row, as eager does, and a known pattern overrides the module's ``is_causal``
(eager applies the mask whatever the module declares)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .eager import eager_mask, model_reads_mask, with_eager_layout
from .families import family_computes_attention, refuse_compressed_layers
from .mask_functions import Overlay, overlay_of, overlay_refused
from .overlays import block_prefix_lens, chunk_keys, window_keys
from .unpad import RANGES_ATTR, UNPAD_ATTR, marker_info, unpad_from_validity


def jagged_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                          attention_mask=None, use_vmap=False, device=None, **kwargs):
    """transformers' mask hook for the "jagged" attention (see ``_compact_attention_mask``).

    Model code that uses the mask itself (``model_reads_mask``) gets what eager would get instead, with
    the same unpadding data attached, so that the calls that do reach jagged attention still unpad."""
    config = kwargs.get("config")
    flags = _config_flags(config) if config is not None else _NO_CONFIG
    if flags.own_attention:
        # only the family's own attention code reads it: eager's mask as eager gets it (overlays
        # included); a jagged attention call, should one come, refuses a mask without unpadding data
        return eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                          use_vmap, device, **kwargs)
    overlay = overlay_of(mask_function, use_vmap)
    mask = _compact_attention_mask(overlay, flags, batch_size, q_length, kv_length, q_offset, kv_offset,
                                   attention_mask, device, kwargs.get("dtype"))
    if not model_reads_mask(overlay, kwargs, flags.reads_mask):
        return mask
    return with_eager_layout(mask, overlay, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                             attention_mask, use_vmap, device, **kwargs)


@dataclass(frozen=True)
class _ConfigFlags:
    """What the hook reads from a model's config, read once per config object (a transformers
    config's attribute reads cost microseconds each)."""

    own_attention: bool = False  # the family computes attention in its own code (families.py)
    reads_mask: bool = False  # model code reads the padding from the mask (NLLB-MoE's router, own attention)
    # the modules may not declare the pattern their mask has: causal masks carry it (see _compact_attention_mask)
    declares_pattern: bool = False


_NO_CONFIG = _ConfigFlags()
_flags_of: dict = {}  # id(config) -> (weak reference to it, _ConfigFlags)


def _config_flags(config) -> _ConfigFlags:
    hit = _flags_of.get(id(config))
    if hit is not None and hit[0]() is config:
        return hit[1]
    refuse_compressed_layers(config)  # raises at every call, never cached
    own = family_computes_attention(config)
    flags = _ConfigFlags(
        own_attention=own,
        reads_mask=own or getattr(config, "router_ignore_padding_tokens", None) is False,
        declares_pattern=bool(getattr(config, "is_encoder_decoder", False) or getattr(config, "is_decoder", False)
                              or getattr(config, "use_bidirectional_attention", False)))
    if len(_flags_of) >= 64:
        _flags_of.clear()
    try:
        _flags_of[id(config)] = (weakref.ref(config), flags)
    except TypeError:  # not weakly referenceable: read again next time
        pass
    return flags


def _compact_attention_mask(overlay: Overlay, flags: _ConfigFlags, batch_size, q_length, kv_length, q_offset=0,
                            kv_offset=0, attention_mask=None, device=None, dtype=None):
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
    evaluated: it is read (``read_mask_function``) for its pattern and the overlays ``mask_functions``
    lists, which travel with the mask (a mask without padding is returned to carry them);
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
    Q, K = int(q_length), int(kv_length)
    causal, keys_only = overlay.causal, overlay.keys_only
    chunk = overlay.chunk
    if chunk is not None and isinstance(kv_offset, int) and kv_offset + K <= chunk[0]:
        chunk = None  # every key slot lies in the first chunk: chunking changes nothing
    if chunk is not None and overlay.blocks is not None:
        raise overlay_refused("block_sequence_ids with chunked attention")
    pattern = dict(causal=causal, keys_only=keys_only, window=overlay.window,
                   chunk=int(chunk[0]) if chunk is not None else None, packed=overlay.packed)
    # encoder-decoder modules do not always declare the pattern their mask has (bigbird_pegasus'
    # decoder self-attention says is_causal=False and relies on a causal mask, in the encoder-decoder and
    # as BigBirdPegasusForCausalLM): for their causal masks even a mask without padding is returned, as a
    # marker that carries the pattern (is_encoder_decoder or is_decoder configs; other decoder-only
    # models keep getting None without padding: the padding-free path stays mask-free for torch.compile.
    # Families whose own code adds the mask to its scores get eager's mask instead: model_reads_mask).
    # So do the causal masks of configs whose modules say is_causal=False (use_bidirectional_attention:
    # PaliGemma's Gemma sets it, its eager mask is causal nonetheless), and masks with overlays
    carry = (causal is True and flags.declares_pattern) or overlay.window is not None or chunk is not None

    def no_padding(prefix_lens=None):
        if not carry and prefix_lens is None:
            return None
        return _no_padding_marker(batch_size, Q, K, device, dtype, prefix_lens=prefix_lens, **pattern)

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
    checks, mask = [], None
    if keys_only or chunk is not None or overlay.blocks is not None:
        key_valid = valid[:, kv_offset:total]
        if keys_only:
            # bidirectional (encoder self-attention, or cross-attention: queries are decoder tokens that
            # the encoder's 2-D mask says nothing about): the mask masks keys only, as in eager, and
            # every query row is computed (eager computes padded encoder rows too)
            query_valid = torch.ones(batch_size, Q, dtype=torch.bool, device=valid.device)
        else:
            q_positions = torch.arange(Q, device=valid.device) + q_offset
            query_valid = valid.index_select(1, q_positions)
        if chunk is not None:
            key_valid, inexact = chunk_keys(query_valid, key_valid, q_offset, kv_offset, *chunk)
            checks.append(inexact)
        if overlay.blocks is not None:
            block_prefix, not_prefix, longest = block_prefix_lens(key_valid, overlay.blocks, kv_offset, K)
            checks += [not_prefix, longest]
        info = unpad_from_validity(query_valid, key_valid, checks)
    else:
        # the common case (causal, maybe a sliding window): one host read of the padding; the queries',
        # keys' and window's arithmetic in numpy, the compact mask one tensor made from it
        host = valid.cpu().numpy()
        q0, k0 = int(q_offset), int(kv_offset)
        query_host, key_host = host[:, q0:q0 + Q], host[:, k0:total]
        if overlay.sliding is not None:
            key_host = window_keys(query_host, key_host, q0, k0, overlay.sliding)
        flat = torch.from_numpy(np.concatenate([query_host, key_host], axis=1))
        if flat.device != valid.device:
            flat = flat.to(valid.device)
        mask = flat.view(batch_size, 1, 1, Q + K)
        query_valid, key_valid = flat[:, :Q], flat[:, Q:]
        info = unpad_from_validity(query_valid, key_valid, host=(query_host, key_host))
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
        dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
        mask = torch.zeros(batch_size, 1, 1, K, dtype=dtype, device=valid.device)
        mask.masked_fill_(~key_valid.view(batch_size, 1, 1, K), torch.finfo(dtype).min)
        setattr(mask, UNPAD_ATTR, info)
        return mask
    if mask is None:
        mask = torch.cat([query_valid, key_valid], dim=1).view(batch_size, 1, 1, Q + K)
    setattr(mask, UNPAD_ATTR, info)
    if info.cache_leftpad is not None:
        setattr(mask, RANGES_ATTR, (info.cu_seqlens_full, info.seqused_k, info.cache_leftpad))
    return mask


def _no_padding_marker(batch_size: int, Q: int, K: int, device, dtype, **pattern) -> torch.Tensor:
    """A ``(B, 1, 1, Q + K)`` mask without padding whose only job is to carry the mask's pattern
    (``Unpad`` fields: for encoder-decoder models, whose modules do not always declare it, and for
    the overlays of ``Overlay``; never on the padding-free path of plain decoder-only masks, which
    stays mask-free for torch.compile). Additive zeros in the model's dtype: model code that reads
    a mask itself (NLLB-MoE's router) sees "nothing masked"."""
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
    mask = torch.zeros(batch_size, 1, 1, Q + K, dtype=dtype, device=device if device is not None else "cpu")
    setattr(mask, UNPAD_ATTR, marker_info(Q, K, **pattern))
    return mask
