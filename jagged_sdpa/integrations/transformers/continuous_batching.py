"""Continuous batching (transformers' ``generate_batch``, ``serve --continuous-batching``; docs/api.md
section 8). transformers accepts only its built-in names there, so jagged attention goes in under
"sdpa" (transformers 5.17: "paged|sdpa", the entry its generate_batch switches to; compat.py) (opt-in,
process-wide). Calls that carry a ``PagedAttentionCache`` run ragged attention over the
paged cache; every other call, and every continuous-batching call this path does not cover exactly,
runs transformers' own SDPA (the function that held the "sdpa" entry before).

Per step, once for each cache group (full / sliding attention), and shared by every layer of the
step: the group's lengths, its block table (derived from transformers' read indices and checked
against them) and the mode. Per layer: write the new K/V into the cache (transformers' own update,
write only) and run the group's plan."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from transformers.modeling_utils import AttentionInterface

import jagged_sdpa

from .attention import as_int
from .compat import CB_ENTRY, CB_ENTRY_DEFAULT, cache_update, cb_lengths, paged_kv, paged_layer

try:  # pragma: no branch - transformers 5.x
    from transformers.generation.continuous_batching.cache import PagedAttentionCache as _PagedAttentionCache
except ImportError:  # pragma: no cover - a transformers without continuous batching
    _PagedAttentionCache = None

_NAME = CB_ENTRY  # the entry continuous batching calls: "sdpa" (5.23), "paged|sdpa" (5.17; compat.py)
_hf_sdpa_attention_forward = CB_ENTRY_DEFAULT  # transformers' own function in that entry
_state: dict = {"original": None}
_step: list = [None]  # (weakref to the step's cu_seq_lens_q, (its version, write index id), {layer type: _Group})
# layer calls per mode, and per-step groups built (tests, benchmarks)
stats = {"paged": 0, "packed": 0, "gather": 0, "fallback": 0, "groups": 0}


@dataclass
class _Group:
    """One step's attention for one cache group, shared by every layer of the step: its mode, the
    totals that cut the step's padded tensors, and the batch its plans run (``jagged_sdpa.plan``,
    docs/api.md section 10): made at the group's first layer of the step, run by every other."""

    mode: str  # "paged": keys read in place through a block table; "packed": only new keys (no past);
    # "gather": transformers' own cache read (sliding-window ring buffers); "fallback": transformers' SDPA
    total_q: int = 0
    total_k: int = 0
    write_only: list | None = None  # read indices that make transformers' cache.update write without reading
    batch: dict = field(default_factory=dict)  # jagged_sdpa.plan's arguments but the softmax scale
    plans: dict = field(default_factory=dict)  # softmax scale -> its plan

    def plan(self, scaling):
        found = self.plans.get(scaling)
        if found is None:
            found = self.plans[scaling] = jagged_sdpa.plan(**self.batch, softmax_scale=scaling)
        return found


def _step_version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter: identity alone keys the step
        return None


def block_table_of(read_index: torch.Tensor, cu_k: torch.Tensor, seqused: torch.Tensor, max_k: int, page: int,
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


def _group(kwargs: dict, cache, layer) -> _Group:
    """The step's group for ``layer`` (a ``compat.PagedLayer``): built at the step's first layer of that
    group, reused after."""
    # transformers hands every layer of a step the same tensors, and new views of its static buffers at
    # each step: the step is keyed by their identity (weak references) and cu_seq_lens_q's version
    cu_q_in = kwargs.get("cu_seq_lens_q")
    writes = kwargs.get("write_index") or [None]
    key = (_step_version(cu_q_in), id(writes[0]))
    hit = _step[0]
    if hit is not None and hit[0]() is cu_q_in and hit[1] == key:
        groups = hit[2]
    else:
        groups = {}
        _step[0] = (weakref.ref(cu_q_in), key, groups)
    group = groups.get(layer.layer_type)
    if group is None:
        group = groups[layer.layer_type] = _build_group(kwargs, cache, layer)
    return group


def _build_group(kwargs: dict, cache, layer) -> _Group:
    stats["groups"] += 1
    lengths = cb_lengths(kwargs, layer.layer_type)
    read_index, write_index = kwargs.get("read_index"), kwargs.get("write_index")
    if lengths is None or read_index is None or write_index is None:
        return _Group("fallback")
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = lengths[0].to(torch.int32)
    max_q = as_int(lengths[1], "max_length_q")
    max_k = as_int(lengths[2], "max_length_k")
    total_q, total_k = torch.stack([cu_q[-1], cu_k[-1]]).tolist()  # the step's one host read
    reads = read_index[layer.group]
    common = dict(total_q=total_q, total_k=total_k, write_only=[r[:0] for r in read_index])
    gather = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=True)
    if layer.layer_type != "full_attention" or not layer.block_table:
        # a ring buffer, read through transformers
        if layer.layer_type == "sliding_attention":
            sw = layer.sliding_window
            gather["window_size"] = (int(sw) - 1, 0)  # transformers' CB mask: a query sees the sw keys up to itself
        return _Group("gather", batch=gather, **common)
    if reads.numel() == 0:
        # no request has a past: the keys are the new tokens (transformers returns them as they are)
        return _Group("packed" if torch.equal(cu_k, cu_q) else "gather", batch=gather, **common)
    seqused = cu_k.diff()
    table = block_table_of(reads, cu_k, seqused, max_k, layer.page, total_k)
    if table is None:
        return _Group("gather", batch=gather, **common)
    return _Group("paged", batch=dict(cu_seqlens_q=cu_q, cu_seqlens_k=None, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                      block_table=table, seqused_k=seqused.to(torch.int32), causal=True), **common)


def _supported(query, kwargs, dropout, module) -> bool:
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
    original = _state["original"] or _hf_sdpa_attention_forward
    if not _supported(query, kwargs, dropout, module):
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    out = _run(module, query, key, value, scaling, kwargs)
    if out is None:
        stats["fallback"] += 1
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    return out, None


@torch.compiler.disable  # per-step host read and cache; transformers' cache.update is not traced either
def _run(module, query, key, value, scaling, kwargs):
    cache = kwargs["cache"]
    group = _group(kwargs, cache, paged_layer(cache, module.layer_idx))
    if group.mode == "fallback":
        return None
    return _attend(module, query, key, value, scaling, kwargs, cache, group)


def _attend(module, query, key, value, scaling, kwargs, cache, group: _Group) -> torch.Tensor:
    stats[group.mode] += 1
    T, Hq, Dv = query.shape[2], query.shape[1], value.shape[-1]
    layer = module.layer_idx
    if group.mode == "gather":
        key, value = cache_update(cache, key, value, layer, kwargs)  # (S, Hkv, D)
    else:  # write the new K/V (transformers' own update, with no read: it returns its inputs, (S, Hkv, D))
        key, value = cache_update(cache, key, value, layer, kwargs, read_index=group.write_only)
    q = query[0].transpose(0, 1)[: group.total_q]  # (total_q, Hq, D)
    if group.mode == "paged":
        k, v = paged_kv(cache, layer)
    else:
        k, v = key[: group.total_k], value[: group.total_k]
    out = group.plan(scaling).run(q, k, v)
    if group.total_q < T:  # padded steps (static shapes): padded rows are zeros
        out = torch.cat([out, out.new_zeros(T - group.total_q, Hq, Dv)])
    return out.unsqueeze(0)


def enable_continuous_batching() -> None:
    """Run jagged attention in transformers' continuous batching (``generate_batch``, ``serve``).

    transformers 5.x accepts only its built-in names there, so this replaces the process-wide "sdpa"
    entry of ``AttentionInterface`` (5.17: "paged|sdpa") with ``continuous_batching_sdpa_forward``: continuous-batching calls
    (a ``PagedAttentionCache`` in the kwargs) run ragged ``varlen_attention`` over the paged cache, every
    other call runs transformers' SDPA. Build or switch the model with ``attn_implementation="sdpa"``.
    Idempotent; undone by ``disable_continuous_batching()``.
    """
    current = AttentionInterface._global_mapping.get(_NAME)
    if current is continuous_batching_sdpa_forward:
        return
    _state["original"] = current
    AttentionInterface.register(_NAME, continuous_batching_sdpa_forward)


def disable_continuous_batching() -> None:
    """Give the "sdpa" entry back to the function that held it before ``enable_continuous_batching``.
    Idempotent; an entry someone else replaced in between is left alone."""
    if AttentionInterface._global_mapping.get(_NAME) is continuous_batching_sdpa_forward:
        AttentionInterface.register(_NAME, _state["original"] or _hf_sdpa_attention_forward)
    _state["original"] = None
    _step[0] = None


def continuous_batching_enabled() -> bool:
    """Whether the "sdpa" entry is jagged's continuous-batching function."""
    return AttentionInterface._global_mapping.get(_NAME) is continuous_batching_sdpa_forward
