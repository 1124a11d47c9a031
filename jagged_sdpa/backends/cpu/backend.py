"""CPU_FUSED: our compiled kernel (``native.py``, ``csrc/attention.cpp``), chosen automatically for
CPU tensors in fp32/fp16/bf16.

One kernel call runs the forward of the whole ragged batch and one its backward, with every option:
packed keys, or a paged or dense cache read in place (the backward sums the dK/dV of shared cache blocks),
dropout with ``keyed_dropout``'s masks, and docs/api.md section 11's sinks (with their gradient), chunk_size and
prefix_lens. What the kernel cannot run, this backend refuses with the reason, and selection moves on
(to MATH on the CPU): float64 (the kernel computes in float32), head dims above
``native.MAX_HEAD_DIM``, a backward whose scratch would be too large, the ALiBi slopes' own gradient,
and no library at all (no C++ compiler, a failed build, ``JAGGED_SDPA_NATIVE=0``). One implementation of the math on this
path: no second engine to keep equal to it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from jagged_sdpa import layout
from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.backends.cpu import native
from jagged_sdpa.checks import Reason
from jagged_sdpa.checks.capability import Capabilities
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall


@torch.compiler.assume_constant_result
def _library_reason() -> Optional[str]:
    """Why the kernel's library cannot be loaded (None when it can); built on first use. Under
    ``torch.compile`` it runs once, when the call is traced, never inside the graph."""
    return native.unavailable_reason()


def _unit_stride(x: Tensor) -> Tensor:
    return x if layout.last_dim_contiguous(x) else x.contiguous()


def unit_stride(call: PackedCall) -> PackedCall:
    """``call`` with q/k/v whose last dim is unit-stride: the kernel reads rows of D contiguous
    elements, so a tensor with a strided last dim is copied once (forward and backward)."""
    if call.spec.last_dim_contiguous:  # measured on these very tensors when the spec was built
        return call
    if layout.last_dim_contiguous(call.q, call.k, call.v):
        return call.replace(spec=call.spec.replace(last_dim_contiguous=True))
    return call.replace(q=_unit_stride(call.q), k=_unit_stride(call.k), v=_unit_stride(call.v),
                        spec=call.spec.replace(last_dim_contiguous=True))


class CpuFusedBackend(BackendImpl):
    backend = Backend.CPU_FUSED
    caps = Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset(native.DTYPES),
        dtype_why="the compiled kernel computes in float32",
        head_dim_max=native.MAX_HEAD_DIM,
        paged=True,
        dense_cache=True,
        sinks=True,
        sinks_grad=True,
        chunked=True,
        prefix=True,
        fp8_cache=True,
        notes=(
            "our compiled kernel, forward and backward (built on first use; needs a C++ compiler; paged caches "
            "read in place in both directions; dropout masks equal math's and triton's). What it cannot run "
            "(float64, no compiler or a failed build, a backward whose scratch for one sequence and KV head "
            f"would pass {native.BACKWARD_ITEM_BYTES >> 20} MiB) it refuses with the reason, and math runs it",
        ),
    )

    @classmethod
    def reasons(cls, spec: AttnSpec) -> tuple[Reason, ...]:
        """The declared rules and the backward's scratch bound; then, only for a call the kernel
        could otherwise run, whether its library loads (so a float64 or CUDA call never builds it)."""
        reasons = super().reasons(spec)
        if spec.needs_grad and (scratch := native.backward_scratch_reason(spec)) is not None:
            reasons = (*reasons, scratch)
        if reasons:
            return reasons
        why = _library_reason()
        return () if why is None else (f"compiled kernel unavailable ({why})",)

    @classmethod
    def plan_notes(cls, spec: AttnSpec) -> tuple[str, ...]:
        """Silent on the usual path; says when a strided last dim is copied first (``unit_stride``)
        and which target the kernel was built for when ``JAGGED_SDPA_CPU_ARCH`` names one."""
        notes = []
        if not spec.last_dim_contiguous:
            notes.append("cpu_fused: q/k/v with a strided last dim are copied to unit stride first")
        if (target := native.target_note()) is not None:
            notes.append(f"cpu_fused: {target}")
        return tuple(notes)

    @classmethod
    def forward(cls, call: PackedCall) -> AttnOutput:
        call = unit_stride(call)
        spec = call.spec
        if spec.cache_dtype is not None:
            return _forward_fp8(call)
        out = call.q.new_empty(spec.total_q, spec.heads_q, spec.head_dim_v)
        lse = torch.empty(spec.heads_q, spec.total_q, dtype=torch.float32)
        native.forward(call, out, lse)
        return AttnOutput(out, lse if spec.return_lse else None)

    @classmethod
    def forward_runner(cls, call: PackedCall):
        """The kernel's parameters built once (``native.ForwardRunner``); per layer only pointers.
        Calls with ALiBi (slopes come per layer) or strided rows take ``forward``."""
        spec = call.spec
        if call.alibi_slopes is not None or not spec.last_dim_contiguous or spec.needs_grad or spec.cache_dtype:
            return None
        runner, return_lse = native.ForwardRunner(call), spec.return_lse

        def run(call: PackedCall) -> AttnOutput:
            out, lse = runner(call)
            return AttnOutput(out, lse if return_lse else None)

        return run

    @classmethod
    def backward(cls, call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor, state: object):
        return native.backward(unit_stride(call), _unit_stride(out), lse, _unit_stride(grad_out))


def _per_query_head(scale: Tensor, spec: AttnSpec) -> Tensor:
    """An fp8 cache's scale, () or (Hkv,), as (1, Hq, 1): query head h reads kv head h // group."""
    return scale.float().reshape(-1).expand(spec.heads_kv).repeat_interleave(spec.gqa_group).view(1, -1, 1)


def _forward_fp8(call: PackedCall) -> AttnOutput:
    """An fp8 cache (docs/api.md section 13): the kernel reads its bytes in place and widens them
    in registers; k_scale goes into a float32 copy of q (scores = scale * (q k_scale) . k), v_scale
    onto the float32 output (out = v_scale * sum p v), which is then cast to q's dtype."""
    spec = call.spec
    q32 = (call.q.float() * _per_query_head(call.k_scale, spec)).contiguous()
    out = torch.empty(spec.total_q, spec.heads_q, spec.head_dim_v, dtype=torch.float32)
    lse = torch.empty(spec.heads_q, spec.total_q, dtype=torch.float32)
    native.forward(call.replace(q=q32), out, lse)
    out = out.mul_(_per_query_head(call.v_scale, spec)).to(call.q.dtype)
    return AttnOutput(out, lse if spec.return_lse else None)
