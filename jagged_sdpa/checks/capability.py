"""Generic eligibility rules, generated from a backend's declared ``Capabilities``.

This is the only place those rules live. Every function returns a short reason string or None and
never raises; messages put the observed value first and the remedy after a dash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from jagged_sdpa.checks import Reason, collect
from jagged_sdpa.spec import ALIGNMENTS, AttnSpec

ALL_FLOAT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _names(items) -> str:
    return ", ".join(sorted(dtype_name(i) if isinstance(i, torch.dtype) else str(i) for i in items))


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared once as data (drives reasons, README table and tests)."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    dtype_why: str = ""               # why the other dtypes are refused, appended to the reason
    head_dim_max: int = 1 << 30
    head_dim_min: int = 1
    head_dim_multiple: int = 1
    min_capability: Optional[tuple[int, int]] = None
    alignments: frozenset[str] = frozenset(ALIGNMENTS)
    window: bool = True
    softcap: bool = True
    alibi: bool = True
    alibi_backward: bool = True
    alibi_slopes_grad: bool = False   # differentiates the slopes themselves
    dropout: bool = True
    backward: bool = True
    lse: bool = True
    dense_kv: bool = True
    gqa: bool = True
    head_dim_v_differs: bool = True
    empty_sequences: bool = True
    paged: bool = False
    dense_cache: bool = False         # a dense (B, S, Hkv, D) cache read in place (docs/api.md section 12)
    seqused_k: bool = True
    # docs/api.md section 11. Off unless declared: a backend applies these only once it says so.
    sinks: bool = False               # per-head sink logits (forward, and backward with ``backward``)
    sinks_grad: bool = False          # differentiates the sinks themselves
    chunked: bool = False             # chunk_size
    prefix: bool = False              # prefix_lens
    fp8_cache: bool = False           # an fp8 KV cache with k_scale/v_scale (docs/api.md section 13), forward only
    notes: tuple[str, ...] = field(default=())


def device_reason(spec: AttnSpec, caps: Capabilities) -> Optional[Reason]:
    if spec.device_type in caps.devices:
        return None
    return f"device {spec.device_type} not supported (supported: {_names(caps.devices)})"


def dtype_reason(spec: AttnSpec, caps: Capabilities) -> Optional[Reason]:
    if spec.dtype in caps.dtypes:
        return None
    why = f": {caps.dtype_why}" if caps.dtype_why else ""
    return f"dtype {dtype_name(spec.dtype)} not supported (supported: {_names(caps.dtypes)}){why}"


def head_dim_reasons(spec: AttnSpec, caps: Capabilities):
    for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)):
        if d > caps.head_dim_max:
            yield f"{name} {d} > {caps.head_dim_max}"
        if d < caps.head_dim_min:
            yield f"{name} {d} < {caps.head_dim_min}"
        if d % caps.head_dim_multiple:
            yield f"{name} {d} not a multiple of {caps.head_dim_multiple}"
    if spec.head_dim_v != spec.head_dim and not caps.head_dim_v_differs:
        yield f"head_dim_v {spec.head_dim_v} != head_dim {spec.head_dim} not supported"


def capability_reason(spec: AttnSpec, caps: Capabilities) -> Optional[Reason]:
    if caps.min_capability is None or spec.device_type != "cuda":
        return None
    if spec.capability is None or spec.capability < caps.min_capability:
        have = "unknown" if spec.capability is None else "sm%d%d" % spec.capability
        need = "sm%d%d" % caps.min_capability
        return f"compute capability {have} < {need}"
    return None


def feature_reasons(spec: AttnSpec, caps: Capabilities):
    if spec.causal and spec.alignment not in caps.alignments:
        yield f"causal_alignment {spec.alignment} not supported (supported: {_names(caps.alignments)})"
    if spec.has_window and not caps.window:
        yield f"window_size {spec.window} not supported"
    if spec.softcap and not caps.softcap:
        yield f"softcap {spec.softcap:g} not supported"
    if spec.alibi and not caps.alibi:
        yield "alibi_slopes not supported"
    if spec.alibi and spec.needs_grad and caps.alibi and not caps.alibi_backward:
        yield "alibi_slopes with a gradient needed: backward has no alibi"
    if spec.alibi_grad and caps.alibi and not caps.alibi_slopes_grad:
        yield "alibi_slopes requires grad: no gradient for the slopes here (math computes it)"
    if spec.dropout_p and not caps.dropout:
        yield f"dropout_p {spec.dropout_p:g} not supported"
    if spec.needs_grad and not caps.backward:
        yield "gradient needed but backward not implemented"
    if spec.return_lse and not caps.lse:
        yield "return_lse not supported"
    if spec.kv_dense and not caps.dense_kv:
        yield "dense key/value not supported"
    if spec.heads_q != spec.heads_kv and not caps.gqa:
        yield f"heads_q {spec.heads_q} != heads_kv {spec.heads_kv} (GQA) not supported"
    if (spec.has_empty_q or spec.has_empty_k) and not caps.empty_sequences:
        known = "" if spec.lengths_known else " (lengths not read: assumed possible)"
        yield f"zero-length sequences not supported{known}"
    if spec.dense_cache:
        if not caps.dense_cache:
            yield "dense KV cache read in place (seqused_k/cache_leftpad, docs/api.md section 12) not supported"
    elif spec.paged and not caps.paged:
        yield "paged KV cache (block_table) not supported"
    if spec.seqused_k and not caps.seqused_k:
        yield "seqused_k not supported"
    if spec.sinks and not caps.sinks:
        yield "sinks not supported (attention sinks, docs/api.md section 11)"
    if spec.sinks_grad and caps.sinks and not caps.sinks_grad:
        yield "sinks requires grad: no gradient for the sinks here"
    if spec.chunk_size is not None and not caps.chunked:
        yield f"chunk_size {spec.chunk_size} not supported (chunked attention, docs/api.md section 11)"
    if spec.prefix and not caps.prefix:
        yield "prefix_lens not supported (prefix-LM, docs/api.md section 11)"
    if spec.cache_dtype is not None and not caps.fp8_cache:
        yield (f"fp8 KV cache ({dtype_name(spec.cache_dtype)}, docs/api.md section 13) not supported: this backend "
               f"reads K/V in q's dtype")


def capability_reasons(spec: AttnSpec, caps: Capabilities) -> tuple[Reason, ...]:
    """Every generic reason why ``caps`` cannot serve ``spec``; empty when eligible."""
    return collect(
        (
            device_reason(spec, caps),
            dtype_reason(spec, caps),
            capability_reason(spec, caps),
            *head_dim_reasons(spec, caps),
            *feature_reasons(spec, caps),
        )
    )
