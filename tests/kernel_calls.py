"""Calls of the compiled CPU kernel with either causal alignment on packed (or paged) inputs.

``varlen_attention`` is always bottom-right, and ``sdpa`` (top-left by default) returns no lse and
takes no paged cache: these helpers build the call with ``explain`` (the public validation) and
swap the alignment in, so one test reaches every (alignment, layout) pair with out and lse.
"""

from __future__ import annotations

import jagged_sdpa
import torch
from jagged_sdpa.backends.cpu import native
from jagged_sdpa.backends.math import MathBackend
from jagged_sdpa.spec import PackedCall


def packed_call(q, k, v, cu_q, cu_k, *, alignment="bottom_right", alibi_slopes=None, block_table=None,
                seqused_k=None, **opts) -> PackedCall:
    """The validated PackedCall of varlen_attention(q, k, v, ...), with ``alignment``."""
    spec = jagged_sdpa.explain(q, k, v, cu_q, cu_k, alibi_slopes=alibi_slopes, block_table=block_table,
                               seqused_k=seqused_k, return_lse=True, **opts).spec
    spec = spec.replace(alignment=alignment)
    return PackedCall(q, k, v, cu_q, cu_k, spec, alibi_slopes, seqused_k, block_table)


def kernel_forward(call: PackedCall):
    """(out, lse) of the compiled kernel; fails if the kernel would not take the call."""
    assert native.skip_reason(call.spec) is None, native.skip_reason(call.spec)
    out = call.q.new_empty(call.spec.total_q, call.spec.heads_q, call.spec.head_dim_v)
    lse = torch.empty(call.spec.heads_q, call.spec.total_q)
    native.forward(call, out, lse)
    return out, lse


def kernel_backward(call: PackedCall, out, lse, grad_out):
    """(dq, dk, dv) of the compiled kernel's backward."""
    assert native.backward_skip_reason(call.spec) is None, native.backward_skip_reason(call.spec)
    return native.backward(call, out, lse, grad_out)


def math_forward(call: PackedCall):
    """out of MATH on the same call (the low-precision error bound of a comparison)."""
    return MathBackend.forward(call).out
