"""One generic ``torch.autograd.Function`` for every backend: each brings its own backward
(``BackendImpl.backward``), which returns the ALiBi slopes' gradient too when ``spec.alibi_grad``.
"""

from __future__ import annotations

import torch

from jagged_sdpa.backends.base import BackendImpl
from jagged_sdpa.spec import AttnOutput, PackedCall


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, impl: type[BackendImpl], call: PackedCall, q, k, v, alibi_slopes):
        # Backward always needs the lse, whether or not the caller asked for it.
        result = impl.forward(call.replace(spec=call.spec.replace(return_lse=True)))
        ctx.impl, ctx.call, ctx.state = impl, call, result.state
        ctx.save_for_backward(q, k, v, result.out, result.lse)
        ctx.mark_non_differentiable(result.lse)
        return result.out, result.lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call.replace(q=q, k=k, v=v)
        grads = ctx.impl.backward(call, out, lse, grad_out.contiguous(), ctx.state)
        return None, None, *grads[:3], grads[3] if len(grads) == 4 else None


def run(impl: type[BackendImpl], call: PackedCall) -> AttnOutput:
    """Run ``impl`` on ``call``, attaching autograd when a gradient is needed."""
    if not call.spec.needs_grad:
        with torch.no_grad():
            return impl.forward(call)
    out, lse = _Attention.apply(impl, call, call.q, call.k, call.v, call.alibi_slopes)
    return AttnOutput(out, lse if call.spec.return_lse else None)
