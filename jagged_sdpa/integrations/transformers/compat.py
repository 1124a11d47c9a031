"""What differs between the transformers versions this integration supports (5.17 to 5.23): one small
rule per difference, each read from transformers itself (what it defines), never from its version
string. The rest of the integration asks these rules and holds no version checks of its own."""

from __future__ import annotations

import inspect
import types

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
