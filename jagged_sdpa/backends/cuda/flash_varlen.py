"""FLASH_VARLEN: PyTorch's FlashAttention-2 varlen kernel (aten._flash_attention_forward/backward).

What the kernel is (PyTorch's copy of flash-attn 2, ``aten/src/ATen/native/transformers/cuda/
flash_attn/flash_api.cpp``, ``mha_varlen_fwd``/``mha_varlen_bwd``): sm80 or newer, fp16/bf16,
head dim <= 256 and a multiple of 8 (we zero-pad, and pad q/k/v to one common width so Dv != D
works too), native GQA, causal and windows always bottom-right aligned, no ALiBi (the op takes
``alibi_slopes`` but PyTorch builds the kernel with ALiBi compiled out: "This flash attention
build does not support alibi", measured on torch 2.11 / H100), dropout from the default CUDA
generator with its
(seed, offset) returned as ``rng_state``, ``seqused_k`` and a paged cache (``block_table``,
block size a multiple of 256) in the forward only. lse is float32 (Hq, total_q) with +inf for
rows that see no key (we report -inf, docs/api.md); such rows' outputs are written as 0.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from jagged_sdpa.backends.cuda import common as cc
from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.checks.capability import Capabilities
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall

FORWARD_OP = "_flash_attention_forward"
BACKWARD_OP = "_flash_attention_backward"
PAGED_BLOCK_MULTIPLE = 256  # flash_api.cpp: "Paged KV cache block size must be divisible by 256"


class FlashState(NamedTuple):
    """What the backward needs besides q/k/v/out/lse: the dropout RNG state, and the op's own lse
    layout (the shape of an empty tensor) to rebuild for its backward."""

    rng_state: Tensor
    unused: Tensor
    lse_like: Tensor


def padded_head_dim(spec: AttnSpec) -> int:
    """One width for q, k and v (the kernel takes a single head size), a multiple of 8."""
    return cc.round_up(max(spec.head_dim, spec.head_dim_v), 8)


def _training_head_dim_reason(spec: AttnSpec) -> Optional[str]:
    # sdp_utils.cpp check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89: these GPUs have
    # too little shared memory for the backward kernels of the largest head dims.
    if not spec.needs_grad or spec.capability is None or not ((8, 6) <= spec.capability <= (8, 9)):
        return None
    d = padded_head_dim(spec)
    if 192 < d <= 224 or (d > 224 and spec.dropout_p > 0):
        return (f"head_dim {d} backward{' with dropout' if spec.dropout_p else ''} on sm{spec.capability[0]}"
                f"{spec.capability[1]} - flash needs sm80/sm90 shared memory for it")
    return None


def _window_kwargs(spec: AttnSpec, max_k: int) -> dict:
    """Window arguments for both ops; empty when the kernel's defaults already mean "no window".

    ``max_k`` is the max_seqlen_k the op gets (``kernel_max_seqlens``). The ops rewrite windows
    twice (flash_api.cpp): ``mha_varlen_fwd``/``mha_varlen_bwd`` turn a side >= max_seqlen_k into
    -1, then ``set_params_fprop`` turns a -1 side facing a bounded one into max_seqlen_k. A right
    side of max_seqlen_k still cuts bottom-right rows i of a sequence with Lq >= max_seqlen_k + 2
    (their bound i + Lk - Lq + max_seqlen_k falls below Lk - 1), so ``kernel_max_seqlens`` passes
    a max_seqlen_k of at least max_seqlen_q when there is a window: then both rewrites only touch
    sides that bound nothing. Sides the first rewrite would reset are passed as -1 here (what the op
    would do, and no int32 narrowing of a huge side), and causal is right = 0 (``is_causal`` sets
    it too, except with max_seqlen_q == 1, where it is dropped and the window is what remains).

    With one query per sequence, GQA and no window, mha_varlen_fwd folds the query heads into the
    sequence dim (``seqlenq_ngroups_swapped``): that reshape fails when a sequence has no query,
    and its lse layout is not the one we document. A left window of max_seqlen_k keeps the kernel
    off that path and means "unbounded" (the op resets windows >= max_seqlen_k to -1).
    """
    if spec.has_window:
        left, right = spec.window
        kept = (_kept_side(left, max_k), _kept_side(right if not spec.causal else 0, max_k))
        if kept != (-1, -1):  # else no side bounds anything: as without a window
            return {"window_size_left": kept[0], "window_size_right": kept[1]}
    swap_possible = (min(spec.max_seqlen_q, spec.total_q) == 1 and spec.heads_q > spec.heads_kv
                     and spec.dropout_p == 0)
    if swap_possible and (spec.return_lse or spec.total_q != spec.batch):
        return {"window_size_left": max(max_k, 1), "window_size_right": -1}
    return {}


def _kept_side(side: int, max_k: int) -> int:
    return side if 0 <= side < max_k else -1


def _prepare(call: PackedCall, width: int,
             cu_k: Optional[cc.PerBatch] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Padded, aligned q/k/v and the cu_seqlens_k the op needs (a paged call has none: the keys'
    cumulative lengths are rebuilt from seqused_k on the device, by ``cu_k`` when given: once per batch)."""
    q = cc.kernel_ready(cc.pad_head_dim(call.q, width))
    k = cc.kernel_ready(cc.pad_head_dim(call.k, width))
    v = cc.kernel_ready(cc.pad_head_dim(call.v, width))
    if call.spec.paged:
        return q, k, v, _paged_cu_k(call) if cu_k is None else cu_k.get(call)
    return q, k, v, call.cu_seqlens_k.contiguous()


def _paged_cu_k(call: PackedCall) -> Tensor:
    return cc.cu_seqlens_from_lengths(call.seqused_k)


def kernel_max_seqlens(spec: AttnSpec, block_table_width: Optional[int] = None) -> tuple[int, int]:
    """(max_seqlen_q, max_seqlen_k) as the ops get them.

    Both are clamped to what the call can hold: the packed totals, or for a paged cache the block
    table's width x block_size (total_k is the cache's capacity there, and a block table may name
    a block twice). The op takes ``int64_t`` and ``mha_varlen_fwd`` narrows it to ``int``
    (attention.cu -> flash_api.cpp): an unclamped bound of 2**31 became negative, and the op then
    ran no kernel ("if (max_seqlen_k > 0)") and returned zeros with lse +inf. With a window,
    max_seqlen_k is raised to max_seqlen_q when that is larger, so that no rewrite of
    ``_window_kwargs`` cuts a row's keys; a larger max_seqlen_k only adds dK/dV programs that
    exit at once (flash_bwd_kernel.h: ``if (n_block * kBlockN >= binfo.actual_seqlen_k) return``).
    """
    max_q, max_k = cc.clamp_max_seqlens(spec)
    if spec.paged:
        max_k = spec.max_seqlen_k
        if block_table_width is not None:
            max_k = min(max_k, block_table_width * spec.block_size)
    if spec.has_window:
        max_k = max(max_k, max_q)
    return max_q, max_k


def _call_max_seqlens(call: PackedCall) -> tuple[int, int]:
    width = call.block_table.shape[1] if call.spec.paged else None
    return kernel_max_seqlens(call.spec, width)


class FlashVarlenBackend(cc.StateFromFakeForward, BackendImpl):
    backend = Backend.FLASH_VARLEN
    caps = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dim_max=256,
        min_capability=(8, 0),
        softcap=False,
        alibi=False,  # compiled out of PyTorch's flash build (see the module docstring)
        paged=True,
        notes=(
            "bottom-right causal/window; top-left only when every Lq == Lk",
            "head dims padded to a multiple of 8; Dv != D padded to one width",
            "seqused_k and paged KV (block size % 256 == 0) forward only",
            "dropout masks from PyTorch's CUDA generator, not the keyed masks math/cpu_fused/triton share",
        ),
    )

    @classmethod
    def is_available(cls) -> Optional[str]:
        return _availability()

    @classmethod
    def extra_reasons(cls, spec: AttnSpec):
        positional = spec.causal or spec.has_window
        if spec.alignment == "top_left" and positional and not spec.equal_lengths:
            yield ("causal_alignment top_left with Lq != Lk (or lengths unknown) - flash aligns "
                   "bottom-right only; use bottom_right or equal lengths")
        if spec.seqused_k and spec.needs_grad:
            yield "seqused_k with a gradient needed - aten._flash_attention_backward takes no seqused_k"
        if spec.paged:
            if spec.needs_grad:
                yield "paged kv cache with a gradient needed - aten._flash_attention_backward takes no block_table"
            if spec.block_size % PAGED_BLOCK_MULTIPLE:
                yield f"paged block_size {spec.block_size} not a multiple of {PAGED_BLOCK_MULTIPLE} (flash kernel rule)"
            if spec.head_dim % 8 or spec.head_dim_v != spec.head_dim:
                yield (f"paged kv cache with head_dim {spec.head_dim}/head_dim_v {spec.head_dim_v} - flash "
                       "needs equal multiples of 8 here (padding would copy the whole cache)")
            if spec.dropout_p:
                yield f"dropout_p {spec.dropout_p:g} with a paged kv cache - flash's split-kv kernel has no dropout"
        if (why := _training_head_dim_reason(spec)) is not None:
            yield why
        yield from cc.launch_grid_reasons(
            spec, "flash", "grid(num_m_block, B, Hq) (flash_fwd_launch_template.h; the backward's "
            "grid_n/grid_m likewise, flash_bwd_launch_template.h)")
        # Training forces the lse on (``ops._attention``), which can make the forward pass a window.
        # (For a paged cache the spec does not know the block table's width: its max_seqlen_k is
        # an upper bound of the run's, which can only keep more window sides.)
        windowed = bool(_window_kwargs(spec.replace(return_lse=spec.return_lse or spec.needs_grad),
                                       kernel_max_seqlens(spec)[1]))
        needed = (
            (windowed, FORWARD_OP, "window_size_left", "window_size"),
            (windowed and spec.needs_grad, BACKWARD_OP, "window_size_left", "window_size backward"),
            (spec.seqused_k, FORWARD_OP, "seqused_k", "seqused_k"),
            (spec.paged, FORWARD_OP, "block_table", "paged kv cache"),
        )
        yield from cc.missing_argument_reasons(needed)

    @classmethod
    def plan_notes(cls, spec: AttnSpec) -> tuple[str, ...]:
        notes = []
        width = padded_head_dim(spec)
        if width != spec.head_dim or width != spec.head_dim_v:
            notes.append(f"flash: q/k/v head dims zero-padded to {width}")
        if spec.alignment == "top_left" and (spec.causal or spec.has_window):
            notes.append("flash: top-left run as bottom-right (every Lq == Lk)")
        max_q, max_k = cc.clamp_max_seqlens(spec)
        if spec.has_window and max_q > max_k and not spec.paged:
            notes.append(f"flash: max_seqlen_k passed as {max_q} (max_seqlen_q), so that the op's window "
                         "rewrites cut no row")
        return tuple(notes)

    @classmethod
    def forward(cls, call: PackedCall) -> AttnOutput:
        return _Forward(call)(call)

    @classmethod
    def forward_runner(cls, call: PackedCall):
        """``_Forward`` kept for the plan's kind: a paged call's cu_seqlens_k made once (``cc.PerBatch``)."""
        return None if call.spec.needs_grad else _Forward(call)

    @classmethod
    def backward(cls, call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor, state: tuple):
        spec = call.spec
        if not state or spec.total_k == 0:
            return cc.zero_grads(call)
        state = FlashState(*state)
        width = padded_head_dim(spec)
        q, k, v, cu_k = _prepare(call, width)
        max_q, max_k = _call_max_seqlens(call)
        out_p = cc.kernel_ready(cc.pad_head_dim(out, width))
        grad_p = cc.kernel_ready(cc.pad_head_dim(grad_out, width))
        lse_shape = tuple(state.lse_like.shape[:-1])
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_p, q, k, v, out_p, cc.lse_to_native(lse, lse_shape, _geometry_if_padded(call, lse_shape)),
            call.cu_seqlens_q.contiguous(), cu_k, max_q, max_k, spec.dropout_p, spec.causal,
            state.rng_state, state.unused, scale=spec.scale, **_window_kwargs(spec, max_k),
        )
        return dq[..., :spec.head_dim], dk[..., :spec.head_dim], dv[..., :spec.head_dim_v]


class _Forward:
    """The forward of the calls of one spec and batch: the op's arguments worked out once (head
    width, max lengths, window), a paged call's cu_seqlens_k made once per batch (``cc.PerBatch``)."""

    __slots__ = ("spec", "width", "max_q", "max_k", "kwargs", "cu_k")

    def __init__(self, call: PackedCall):
        spec = self.spec = call.spec
        self.width = padded_head_dim(spec)
        self.max_q, self.max_k = _call_max_seqlens(call)
        self.kwargs = {"scale": spec.scale, **_window_kwargs(spec, self.max_k)}
        self.cu_k = cc.PerBatch(_paged_cu_k) if spec.paged else None

    def __call__(self, call: PackedCall) -> AttnOutput:
        spec = self.spec
        if spec.total_q == 0:  # a zero-size grid is a CUDA launch error, not an empty result
            out, lse = cc.empty_result(call)
            return AttnOutput(out, lse if spec.return_lse else None)
        q, k, v, cu_k = _prepare(call, self.width, self.cu_k)
        kwargs = self.kwargs
        if call.seqused_k is not None or spec.paged:
            kwargs = dict(kwargs)  # (the kept one stays the spec's)
            if call.seqused_k is not None:
                kwargs["seqused_k"] = call.seqused_k.contiguous()
            if spec.paged:
                kwargs["block_table"] = call.block_table.contiguous()
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, call.cu_seqlens_q.contiguous(), cu_k, self.max_q, self.max_k, spec.dropout_p, spec.causal,
            False, **kwargs,
        )
        if self.width != spec.head_dim_v:
            out = out[..., :spec.head_dim_v]
        state = FlashState(rng_state, unused, lse.new_empty(*lse.shape, 0))
        if not spec.return_lse:
            return AttnOutput(out, None, state)
        # Rows that see no key come back as out 0 and lse +inf (flash's convention for its backward).
        lse = cc.lse_to_packed(lse, None if lse.dim() == 2 else cc.query_geometry(call))
        lse = lse.masked_fill(lse == math.inf, -math.inf)
        return AttnOutput(out, lse, state)


def _geometry_if_padded(call: PackedCall, lse_shape: tuple[int, ...]):
    return None if len(lse_shape) == 2 else cc.query_geometry(call)


def _availability() -> Optional[str]:
    if (why := cc.cuda_unavailable_reason()) is not None:
        return why
    return _flash_build_reason()


@functools.cache
def _flash_build_reason() -> Optional[str]:
    if not cc.op_arguments(FORWARD_OP) or not cc.op_arguments(BACKWARD_OP):
        return f"this torch has no aten.{FORWARD_OP}/{BACKWARD_OP}"
    if not torch.backends.cuda.is_flash_attention_available():
        return "PyTorch built without flash attention (torch.backends.cuda.is_flash_attention_available() is False)"
    return None
