"""Model families that do not go through transformers' attention-function registry: some compute
attention in their own code (they get eager's masks), some pick their attention module from a table
of their own (that table learns the registered name, with its eager module), and some extend the keys
inside the layer (refused). Decided per config class, once, and logged once."""

from __future__ import annotations

import logging
import sys

_logger = logging.getLogger("jagged_sdpa")


def refuse_compressed_layers(config) -> None:
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


_computes_attention: dict = {}  # config class -> bool


def family_computes_attention(config) -> bool:
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
    own attention (``family_computes_attention``: it then gets eager's masks); it is told once."""
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


def adopt_attention_tables(name: str) -> None:
    """Route ``name`` through ``_correct_attn_implementation`` (a wrapper of transformers'
    ``PreTrainedModel.get_correct_attn_implementation``, installed once), so that families with
    attention tables of their own adopt it before any layer is built."""
    from transformers.modeling_utils import PreTrainedModel

    _registered_names.add(name)
    if _original_correct_attn_implementation[0] is None:
        _original_correct_attn_implementation[0] = PreTrainedModel.get_correct_attn_implementation
        PreTrainedModel.get_correct_attn_implementation = _correct_attn_implementation
