"""Calls of the compiled CPU kernel with either causal alignment on packed (or paged) inputs.

``varlen_attention`` is always bottom-right, and ``sdpa`` (top-left by default) returns no lse and
takes no paged cache: these helpers build the call with ``explain`` (the public validation) and
swap the alignment in, so one test reaches every (alignment, layout) pair with out and lse.
"""

from __future__ import annotations

import jagged_sdpa
import torch
from jagged_sdpa import layout
from jagged_sdpa.backends.cpu import CpuFusedBackend, native
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
    assert not CpuFusedBackend.reasons(call.spec), CpuFusedBackend.reasons(call.spec)
    assert layout.last_dim_contiguous(call.q, call.k, call.v)  # the backend copies others first
    out = call.q.new_empty(call.spec.total_q, call.spec.heads_q, call.spec.head_dim_v)
    lse = torch.empty(call.spec.heads_q, call.spec.total_q)
    native.forward(call, out, lse)
    return out, lse


def kernel_backward(call: PackedCall, out, lse, grad_out):
    """(dq, dk, dv) of the compiled kernel's backward."""
    spec = call.spec.replace(needs_grad=True)
    assert not CpuFusedBackend.reasons(spec), CpuFusedBackend.reasons(spec)
    return native.backward(call, out, lse, grad_out)


def math_forward(call: PackedCall):
    """out of MATH on the same call (the low-precision error bound of a comparison)."""
    return MathBackend.forward(call).out


def assert_math_takes_over(reason: str, head_dim: int = 16) -> None:
    """A CPU call CPU_FUSED refuses with ``reason`` (in its reasons, ``explain`` and the forced
    backend's error) runs on MATH, and its out, lse and gradients equal the float64 reference."""
    from jagged_sdpa import Backend, NoBackendError
    from support.cases import cu_of
    from support.reference import attention_reference
    from support.tolerances import assert_close_lse, assert_close_packed

    x = torch.randn(12, 2, head_dim, requires_grad=True)
    cu = cu_of([5, 7])
    explained = jagged_sdpa.explain(x, x, x, cu, cu, causal=True)
    refused = "; ".join(explained.reasons[Backend.CPU_FUSED])
    assert explained.chosen == Backend.MATH and reason in refused, str(explained)
    try:
        jagged_sdpa.varlen_attention(x, x, x, cu, cu, backend="cpu_fused")
        raise AssertionError("a forced cpu_fused ran a call it refuses")
    except NoBackendError as error:
        assert "forced backend cpu_fused cannot take this call" in str(error) and reason in str(error)
    out, lse = jagged_sdpa.varlen_attention(x, x, x, cu, cu, causal=True, return_lse=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    x64 = x.detach().double().requires_grad_(True)
    ref, ref_lse = attention_reference(x64, x64, x64, cu, cu, causal=True)
    ref.backward(grad.double())
    assert_close_packed(out, ref, cu_seqlens=cu)
    assert_close_lse(lse, ref_lse)
    assert_close_packed(x.grad, x64.grad, cu_seqlens=cu, name="dx", grad=True)
