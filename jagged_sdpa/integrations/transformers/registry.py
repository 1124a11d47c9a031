"""``register``: the attention function and its mask hook under one name in transformers. The name
avoids "sdpa" and "flash": transformers applies its SDPA dispatch rules to names with "sdpa" (and ~20
model families, e.g. Gemma2, then refuse it), and tries to fetch a Hub kernel for names with "flash"."""

from __future__ import annotations

from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from .attention import jagged_attention_forward
from .families import adopt_attention_tables
from .mask import jagged_attention_mask

DEFAULT_NAME = "jagged"
_BUILTIN_NAMES = ("eager", "sdpa", "flex_attention", "paged|eager")


def register(name: str = DEFAULT_NAME) -> str:
    """Register the jagged attention and its mask function under ``name`` and return the name.

    Idempotent. Names containing "sdpa" or "flash" are refused (transformers gives them special
    treatment, see this module's docstring), and so are transformers' own implementations' names.
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
    adopt_attention_tables(name)  # families with attention tables of their own
    return name
