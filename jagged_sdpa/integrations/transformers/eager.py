"""Eager's own mask for model code that uses the mask itself (``model_reads_mask``: a caller that asks
for a materialized mask to overlay, e.g. sparse-attention indexers; NLLB-MoE's padding-aware router;
families whose code never calls a registered attention function, e.g. Bloom, MPT, XGLM). That code
gets what eager would get, carrying the same unpadding data, so that any call reaching jagged
attention still unpads; a mask the model then edits in place is refused (``unpad.unpad_info``)."""

from __future__ import annotations

import torch
from transformers import masking_utils

from .mask_functions import Overlay
from .unpad import EAGER_VERSION_ATTR, RANGES_ATTR, UNPAD_ATTR, marker_info


def model_reads_mask(overlay: Overlay, kwargs, config_reads_mask: bool) -> bool:
    """Whether the model's own code uses the mask, not only hands it to the attention function:

    - the caller asked for a materialized mask (``allow_is_causal_skip=False``, or
      ``allow_is_bidirectional_skip=False`` for a bidirectional one): transformers' documented way of
      saying the mask is overlaid or concatenated (sparse-attention indexers add it to their scores,
      Doge its dynamic mask), unless transformers set it itself for packed sequences
      (the packed path reads position_ids); the static-cache decode step that transformers also
      materializes is a (B, 1, 1, K) mask, as small as ours;
    - ``config_reads_mask``: the config says the model's router reads the padding from the mask
      (NLLB-MoE's ``router_ignore_padding_tokens=False``: it reads the last query row of eager's mask),
      or the family's modeling module does not use transformers' attention-function registry
      (``families.family_computes_attention``): its own attention code adds the mask to its scores.
    """
    skip = kwargs.get("allow_is_bidirectional_skip" if overlay.keys_only else "allow_is_causal_skip", True)
    return (skip is False and not overlay.packed) or config_reads_mask


def eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, use_vmap, device,
               **kwargs):
    """transformers' own eager mask for the hook's arguments."""
    return masking_utils.eager_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                    q_offset=q_offset, kv_offset=kv_offset,
                                    mask_function=mask_function or masking_utils.causal_mask_function,
                                    attention_mask=attention_mask, use_vmap=use_vmap,
                                    device=device if device is not None else "cpu", **kwargs)


def with_eager_layout(compact, overlay, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                      attention_mask, use_vmap, device, **kwargs):
    """transformers' own eager mask for these arguments, carrying the unpadding data of ``compact`` (the
    pattern alone when there is no padding), so jagged attention reads it as it reads the compact mask."""
    mask = eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, use_vmap,
                      device, **kwargs)
    if mask is None:
        return None
    info = getattr(compact, UNPAD_ATTR, None) if compact is not None else None
    if info is None:  # no padding and nothing to carry (overlays are carried by the compact mask itself)
        info = marker_info(int(q_length), int(kv_length), causal=overlay.causal, keys_only=overlay.keys_only,
                           packed=overlay.packed)
    setattr(mask, UNPAD_ATTR, info)
    ranges = getattr(compact, RANGES_ATTR, None) if compact is not None else None
    if ranges is not None:  # what a traced layer reads (the static-cache decode step gets this layout)
        setattr(mask, RANGES_ATTR, ranges)
    if not torch.compiler.is_compiling():  # a model that edits it in place is refused (unpad_info)
        setattr(mask, EAGER_VERSION_ATTR, mask._version)
    return mask
