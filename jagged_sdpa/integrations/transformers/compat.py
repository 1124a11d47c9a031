"""What differs between the transformers versions this integration supports (5.17 to 5.23): one small
rule per difference, each read from transformers itself (what it defines), never from its version
string. The rest of the integration asks these rules and holds no version checks of its own."""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

from transformers import masking_utils


def _inner_code(factory, name="inner_mask"):
    """The code object of the mask function ``factory`` returns: every function it makes shares it."""
    return next(c for c in factory.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


def _cells(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))


_PACKED = _inner_code(masking_utils.packed_sequence_mask_function)

# --- packed sequences' mask function ------------------------------------------------------------------------
# transformers >= 5.18 builds and_masks(packed_sequence_mask_function(ids), remap_positions_for_packed_sequence(
# pattern, position_ids)): the pattern sees per-sequence positions. 5.17 has no remap and builds
# and_masks(pattern, packed_sequence_mask_function(ids)): the pattern sees the packed row's positions, which
# changes nothing for causal, windowed and bidirectional patterns (they depend on q - kv only); jagged attention
# runs each sequence alone (its chunks start at each sequence's first token), as 5.18+'s eager does.
REMAPS_PACKED_POSITIONS = hasattr(masking_utils, "remap_positions_for_packed_sequence")
REMAP = _inner_code(masking_utils.remap_positions_for_packed_sequence) if REMAPS_PACKED_POSITIONS else None


def packed_pattern(first, second):
    """The pattern inside transformers' packed-sequence wrapper ``and_masks(first, second)``, or None if
    it is not that wrapper (5.18+: the remapped pattern, still to be read; 5.17: the pattern itself)."""
    if REMAPS_PACKED_POSITIONS:
        if getattr(first, "__code__", None) is _PACKED and getattr(second, "__code__", None) is REMAP:
            return _cells(second)["mask_function"]
        return None
    return first if getattr(second, "__code__", None) is _PACKED else None


def packed_mask_function(pattern, position_ids, packed_sequence_mask):
    """The mask function ``create_causal_mask`` makes of ``pattern`` for packed sequences (tests)."""
    if REMAPS_PACKED_POSITIONS:
        return masking_utils.packed_sequence_compatibility_function(pattern, position_ids, packed_sequence_mask)
    return masking_utils.and_masks(pattern, masking_utils.packed_sequence_mask_function(packed_sequence_mask))


# --- chunked layers under generate's static-cache mask preparation -------------------------------------------
# transformers 5.17's create_masks_for_generate passes block_sequence_ids to create_chunked_causal_mask, which
# does not take it (5.23's does): Llama 4 generate with a StaticCache raises a TypeError there under any
# attention, eager too.
STATIC_CACHE_CHUNKED_GENERATE = "block_sequence_ids" in inspect.signature(
    masking_utils.create_chunked_causal_mask).parameters


# --- continuous batching ----------------------------------------------------------------------------------------
# The attention entry continuous batching calls: 5.23's "sdpa" function takes the PagedAttentionCache itself;
# 5.17 switches the model to "paged|sdpa" (sdpa_attention_paged_forward) for generate_batch, "sdpa" never sees it.
def _cb_entry():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if "cache" in inspect.signature(sdpa_attention_forward).parameters:
        return "sdpa", sdpa_attention_forward
    from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward

    return "paged|sdpa", sdpa_attention_paged_forward


CB_ENTRY, CB_ENTRY_DEFAULT = _cb_entry()


def continuous_batching_config(page_size: int, **kwargs):
    """transformers' ``ContinuousBatchingConfig`` with ``page_size`` tokens per page: 5.23 calls the field
    ``page_size`` (``block_size`` deprecated), 5.17 ``block_size``."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    return ContinuousBatchingConfig(**{"page_size" if "page_size" in fields else "block_size": page_size}, **kwargs)


def cb_lengths(kwargs: dict, layer_type: str):
    """(cu_seq_lens_k, max_q, max_k) of a continuous-batching call for ``layer_type``, or None if absent: 5.23
    names the maxima max_length_q / max_length_k and always keys the key lengths by layer type; 5.17 names them
    max_seqlen_q / max_seqlen_k and passes bare tensors when the model has one layer type."""
    suffix = "length" if "max_length_q" in kwargs else "seqlen"
    cu_k, max_k, max_q = kwargs.get("cu_seq_lens_k"), kwargs.get(f"max_{suffix}_k"), kwargs.get(f"max_{suffix}_q")
    if isinstance(cu_k, dict) or isinstance(max_k, dict):
        if not isinstance(cu_k, dict) or not isinstance(max_k, dict) or layer_type not in cu_k:
            return None
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    if cu_k is None or max_k is None or max_q is None:
        return None
    return cu_k, max_q, max_k


@dataclass(frozen=True)
class PagedLayer:
    """Where one layer's keys live in a ``PagedAttentionCache``."""

    layer_type: str  # "full_attention" or "sliding_attention" (the keys of the step's cu_seq_lens_k)
    group: int  # its index in the step's read_index / write_index lists
    page: int  # tokens per page
    block_table: bool  # its pages can be read through a block table (not a sliding ring buffer)
    sliding_window: int | None


def paged_layer(cache, layer_idx: int) -> PagedLayer:
    """5.23: per-layer allocators (``cache.layer_to_allocator``); 5.17: layer groups
    (``cache.layer_index_to_group_indices``, a sliding window of 1 for full attention, ``cache.block_size``)."""
    allocators = getattr(cache, "layer_to_allocator", None)
    if allocators is not None:
        a = allocators[layer_idx]
        return PagedLayer(a.layer_type, a.index, a.tokens_per_page, bool(getattr(a, "supports_block_table", False)),
                          getattr(a, "sliding_window", None) or getattr(cache.config, "sliding_window", None))
    group = cache.layer_index_to_group_indices[layer_idx][0]
    window = cache.sliding_windows[layer_idx]
    sliding = window != 1
    return PagedLayer("sliding_attention" if sliding else "full_attention", group, cache.block_size, not sliding,
                      window if sliding else None)


def paged_kv(cache, layer_idx: int):
    """The layer's K and V cache as pages ``(n_pages, page, Hkv, D)``, indexed as its read indices count
    (token ``page * block + offset``)."""
    allocators = getattr(cache, "layer_to_allocator", None)
    if allocators is not None:
        return allocators[layer_idx].get_cache_for_block_table(layer_idx)
    j = cache.layer_index_to_group_indices[layer_idx][1]
    k, v = cache.key_cache[j], cache.value_cache[j]
    return (x.view(-1, cache.block_size, *x.shape[1:]) for x in (k, v))


def cache_update(cache, key, value, layer_idx: int, kwargs: dict, read_index=None):
    """transformers' own ``cache.update`` for one layer (``read_index``: the step's, or one that makes it write
    only); the keys and values it returns as ``(S, Hkv, D)``. 5.23 takes the call's kwargs and returns
    ``(1, Hkv, S, D)``; 5.17 takes read_index / write_index and returns ``(S, Hkv, D)``."""
    read_index = kwargs["read_index"] if read_index is None else read_index
    if getattr(cache, "layer_to_allocator", None) is not None:
        k, v = cache.update(key_states=key, value_states=value, layer_idx=layer_idx,
                            kwargs=dict(kwargs, read_index=read_index))
        return k[0].transpose(0, 1), v[0].transpose(0, 1)
    return cache.update(key_states=key, value_states=value, layer_idx=layer_idx, read_index=read_index,
                        write_index=kwargs["write_index"])


def continuous_batching_sees_memory() -> bool:
    """Whether transformers can size continuous batching's cache here: it reads the device's memory, and 5.17
    reads a CPU's through psutil only (without psutil it sees 0 bytes and generate_batch raises a MemoryError
    whatever the attention); 5.23 also reads it from the OS."""
    try:
        from transformers.generation.continuous_batching.utils import get_device_and_memory_breakdown
    except ImportError:  # 5.17
        from transformers.generation.continuous_batching.requests import get_device_and_memory_breakdown
    return get_device_and_memory_breakdown()[1] > 0
