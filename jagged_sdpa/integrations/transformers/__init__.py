"""Hugging Face transformers integration: ``attn_implementation="jagged"`` (docs/api.md section 8).

    from jagged_sdpa.integrations import transformers as jt
    name = jt.register()                      # "jagged"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

``register`` installs a mask hook (``jagged_attention_mask``) that computes where the real tokens are
once per forward, and an attention function (``jagged_attention_forward``) that every layer calls
with it; results equal "eager" on each sequence alone. ``enable_continuous_batching`` puts jagged
attention in transformers' continuous batching. The modules, one idea each:

- ``registry``: ``register``, the name and its rules;
- ``mask``: the mask hook: padding and cache geometry into a compact mask carrying ``unpad.Unpad``;
- ``unpad``: the unpadding data itself, computed once per forward and read by every layer;
- ``mask_functions``: transformers' ``mask_function`` read (never evaluated) into an ``Overlay``;
- ``overlays``: what those overlays mean for each row's keys (chunks, windows, prefix blocks);
- ``eager``: eager's own mask for model code that uses the mask itself;
- ``families``: families that bypass the attention registry (their own attention code or tables);
- ``packing``: sequences packed without padding, from ``position_ids``;
- ``attention``: the attention function;
- ``continuous_batching``: ``generate_batch`` over transformers' paged cache, in the "sdpa" entry.
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401  (the real package: absolute import)
except ImportError as _err:  # pragma: no cover - exercised by a test that hides transformers
    raise ImportError(
        "jagged_sdpa.integrations.transformers needs Hugging Face transformers, which is not "
        "installed: pip install \"jagged_sdpa[transformers]\" (or pip install transformers)"
    ) from _err

from .attention import jagged_attention_forward
from .continuous_batching import (continuous_batching_enabled, continuous_batching_sdpa_forward,
                                  disable_continuous_batching, enable_continuous_batching)
from .mask import jagged_attention_mask
from .registry import DEFAULT_NAME, register

__all__ = ["register", "jagged_attention_forward", "jagged_attention_mask", "DEFAULT_NAME",
           "enable_continuous_batching", "disable_continuous_batching", "continuous_batching_enabled",
           "continuous_batching_sdpa_forward"]
