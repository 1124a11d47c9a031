"""The call a public function would hand to its backend, without running it: for tests that
inspect what the wrapper built (spec, host lengths, tensors), through the same plan machinery."""

from __future__ import annotations

import torch

from jagged_sdpa import api


def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, return_lse, block_table, seqused_k, backend):
    """(call, forced backend, notes) of a varlen_attention call, positional as its signature."""
    plan = api._varlen_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                            causal, window_size, softcap, return_lse, block_table, seqused_k, backend)
    call, _ = plan._call(q, k, v, alibi_slopes, choose=False)
    return call, plan._options.forced, plan._options.notes + plan._layout_notes


def prepare_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 causal_alignment="top_left", window_size=None, softcap=None, alibi_slopes=None, backend=None):
    """(call, forced backend, notes) of an sdpa call."""
    with torch._C.DisableTorchFunctionSubclass():
        plan, q, k, v = api._sdpa_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                       causal_alignment, window_size, softcap, backend)
        call, _ = plan._call(q, k, v, alibi_slopes, choose=False)
    return call, plan._options.forced, plan._options.notes + plan._layout_notes
