"""The call a public function would hand to its backend, without running it: for tests that inspect
what the wrapper built (the spec, host lengths, tensors).

Arguments are ``varlen_attention``'s and ``sdpa``'s own, by the same names (options by keyword), so
a test reads like the call it describes::

    call, forced, notes = prepare_varlen(q, k, v, cu, cu, 4, 4, causal=True, block_table=table)
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

import jagged_sdpa
from jagged_sdpa import api
from jagged_sdpa.spec import PackedCall


class Described(NamedTuple):
    call: PackedCall        # what the backend would receive
    forced: object          # the forced backend (``backend=``), or None
    notes: tuple            # explain's notes: the options' and the layout's


def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                   alibi_slopes=None, sinks=None, **options) -> Described:
    """``varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)``
    described: the batch and options go through the public ``jagged_sdpa.plan`` (same validation,
    same errors), and the plan describes its call without choosing a backend."""
    plan = jagged_sdpa.plan(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)
    call, _ = plan._call(q, k, v, alibi_slopes, sinks, choose=False)
    return Described(call, plan._options.forced, plan._options.notes + plan._layout_notes)


_SDPA = inspect.signature(jagged_sdpa.sdpa)


def prepare_sdpa(query, key, value, *, alibi_slopes=None, sinks=None, **options) -> Described:
    """``sdpa(query, key, value, **options)`` described. There is no public plan over NJTs: sdpa's
    own planning step unwraps them (views of their buffers) and validates the options."""
    bound = _SDPA.bind(query, key, value, **options)
    bound.apply_defaults()
    a = bound.arguments
    with torch._C.DisableTorchFunctionSubclass():
        plan, q, k, v = api._sdpa_plan(query, key, value, a["attn_mask"], a["dropout_p"], a["is_causal"], a["scale"],
                                       a["enable_gqa"], a["causal_alignment"], a["window_size"], a["softcap"],
                                       a["backend"], chunk_size=a["chunk_size"], prefix_lens=a["prefix_lens"])
        call, _ = plan._call(q, k, v, alibi_slopes, sinks, choose=False)
    return Described(call, plan._options.forced, plan._options.notes + plan._layout_notes)
