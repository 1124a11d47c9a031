"""EFFICIENT: PyTorch's memory-efficient (CUTLASS) kernel (aten._efficient_attention_forward/backward).

What the kernel is (``aten/src/ATen/native/transformers/cuda/attention.cu`` and
``attention_backward.cu``, ``mem_eff_attention/kernel_forward.h``): sm50 or newer, fp32/fp16 and
bf16 (bf16 from sm80), any head dim whose size is a multiple of 16 bytes (we zero-pad), Dv != D,
varlen as a batch of 1 with ``cu_seqlens``; ``custom_mask_type`` 0 none, 1 causal top-left,
2 causal bottom-right, and ``window_size`` W only on top of a causal mask (keys i' - W < j <= i',
i.e. our left window W - 1). No GQA (the op wants equal head counts: we expand K/V and sum the
gradients back), no ALiBi (its only bias is a dense (B, H, Lq, Lk) tensor, refused with
cu_seqlens by the backward), no softcap, ``seqlen_k`` (our seqused_k) in the forward only.
Dropout draws (seed, offset) from the default CUDA generator; they come back as tensors.
lse is float32 (B, H, W) with sequence b's rows at [b, :, :Lq_b]. Rows that see no key and keys
no query sees are zeroed from the lengths (device-side), not trusted to the kernel.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from jagged_sdpa.backends.cuda import common as cc
from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.checks.capability import Capabilities
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall

FORWARD_OP = "_efficient_attention_forward"
BACKWARD_OP = "_efficient_attention_backward"

MASK_NONE, MASK_CAUSAL_TOP_LEFT, MASK_CAUSAL_BOTTOM_RIGHT = 0, 1, 2

# The op's lse is (B, Hq, ceil(max_seqlen_q / kAlignLSE) * kAlignLSE) float32 (attention.cu,
# ``_efficient_attention_forward``: "logsumexp = at::empty({seqstart_q->size(0) - 1, num_heads,
# compute_logsumexp ? ceil_div(max_seqlen_q, kAlignLSE) * kAlignLSE : 0}"), built again for the
# backward (``cuda.common.lse_to_native``). Padded to the longest sequence, it can dwarf the call: a
# 128k-token sequence beside 1,000 short ones at Hq = 32 needs 16.8 GB where ours (Hq, total_q) is
# 29 MB. Calls whose padded lse passes both the floor and the factor x ours go elsewhere.
LSE_ALIGN = 32
LSE_BUDGET_FLOOR_BYTES = 256 << 20
LSE_BUDGET_FACTOR = 4


class EfficientState(NamedTuple):
    """The dropout RNG state, and the kernel's own lse layout (the shape of an empty tensor)."""

    philox_seed: Tensor
    philox_offset: Tensor
    lse_like: Tensor


def alignment_elements(dtype: torch.dtype) -> int:
    """Head dims must hold whole 16-byte vectors: 8 halves, 4 floats."""
    return cc.KERNEL_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()


def causal_like(spec: AttnSpec) -> bool:
    """A window (l, 0) without causal masks exactly like causal with a left window."""
    return spec.causal or (spec.has_window and spec.window[1] == 0)


def mask_arguments(spec: AttnSpec) -> tuple[int, Optional[int]]:
    """(custom_mask_type, window_size or None) for ``spec``; only valid when it is eligible.

    With Lq == Lk everywhere both alignments coincide; top-left is then used, being the mask
    whose windowed backward xformers (the kernel's upstream) supports.
    """
    if not causal_like(spec):
        return MASK_NONE, None
    top_left = spec.alignment == "top_left" or spec.equal_lengths
    mask = MASK_CAUSAL_TOP_LEFT if top_left else MASK_CAUSAL_BOTTOM_RIGHT
    left = spec.window[0]
    return mask, (left + 1 if left >= 0 else None)


def padded_lse_bytes(spec: AttnSpec) -> int:
    """Bytes of the lse the op allocates when it computes one (max_seqlen_q as clamped for it)."""
    max_q, _ = cc.clamp_max_seqlens(spec)
    return spec.batch * spec.heads_q * cc.round_up(max_q, LSE_ALIGN) * 4


def _lse_budget_reason(spec: AttnSpec) -> Optional[str]:
    if not (spec.return_lse or spec.needs_grad):  # no lse asked: the op allocates a width of 0
        return None
    padded, packed = padded_lse_bytes(spec), spec.heads_q * spec.total_q * 4
    if padded <= max(LSE_BUDGET_FLOOR_BYTES, LSE_BUDGET_FACTOR * packed):
        return None
    return (f"lse of {padded / 1e9:.1f} GB - the efficient op pads it to (B, Hq, round32(max_seqlen_q)) "
            f"= ({spec.batch}, {spec.heads_q}, {cc.round_up(cc.clamp_max_seqlens(spec)[0], LSE_ALIGN)}) float32, "
            f"{padded / max(packed, 1):.0f}x the packed {packed / 1e6:.1f} MB (budget: the larger of "
            f"{LSE_BUDGET_FLOOR_BYTES >> 20} MiB and {LSE_BUDGET_FACTOR}x packed); a long-tailed batch")


def _pad_widths(spec: AttnSpec) -> tuple[int, int]:
    a = alignment_elements(spec.dtype)
    return cc.round_up(spec.head_dim, a), cc.round_up(spec.head_dim_v, a)


def _prepare(call: PackedCall) -> tuple[Tensor, Tensor, Tensor]:
    """(1, T, Hq, D') views the op takes: padded, GQA-expanded, aligned."""
    spec = call.spec
    d, dv = _pad_widths(spec)
    q = cc.kernel_ready(cc.pad_head_dim(call.q, d))
    k = cc.kernel_ready(cc.expand_kv_heads(cc.pad_head_dim(call.k, d), spec.gqa_group))
    v = cc.kernel_ready(cc.expand_kv_heads(cc.pad_head_dim(call.v, dv), spec.gqa_group))
    return tuple(_no_zero_head_stride(t).unsqueeze(0) for t in (q, k, v))


def _no_zero_head_stride(t: Tensor) -> Tensor:
    """A single head with stride 0 (an expanded view) would switch on the kernel's MQA decode path,
    which drops the causal mask for one-query sequences (wrong for top-left); re-view it."""
    if t.shape[1] == 1 and t.stride(1) == 0:
        return t.squeeze(1).unsqueeze(1)
    return t


class EfficientBackend(cc.StateFromFakeForward, BackendImpl):
    backend = Backend.EFFICIENT
    caps = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        head_dim_max=65536,  # kMaxK of the CUTLASS kernels that stream the head dim from memory
        min_capability=(5, 0),
        softcap=False,
        alibi=False,
        paged=False,
        notes=(
            "top-left and bottom-right causal; windows only as causal + left window",
            "GQA by expanding K/V (costs Hq/Hkv x K/V memory)",
            "head dims padded to 16 bytes; seqused_k forward only",
            "dropout masks from PyTorch's CUDA generator, not the keyed masks math/cpu_fused/triton share",
        ),
    )

    @classmethod
    def is_available(cls) -> Optional[str]:
        if (why := cc.cuda_unavailable_reason()) is not None:
            return why
        if not cc.op_arguments(FORWARD_OP) or not cc.op_arguments(BACKWARD_OP):
            return f"this torch has no aten.{FORWARD_OP}/{BACKWARD_OP}"
        return None

    @classmethod
    def extra_reasons(cls, spec: AttnSpec):
        if spec.dtype == torch.bfloat16 and spec.capability is not None and spec.capability < (8, 0):
            yield "bfloat16 on sm%d%d - the efficient kernel has bfloat16 from sm80" % spec.capability
        if spec.has_window and not causal_like(spec):
            yield (f"window_size {spec.window} without causal and right != 0 - efficient has only causal "
                   "sliding windows; use is_causal or right=0")
        if spec.seqused_k and spec.needs_grad:
            yield "seqused_k with a gradient needed - aten._efficient_attention_backward takes no seqlen_k"
        if (why := _lse_budget_reason(spec)) is not None:
            yield why
        yield from cc.launch_grid_reasons(
            spec, "efficient", "grid(query blocks, Hq, B) (mem_eff_attention/kernel_forward.h getBlocksGrid; "
            "the backward's (key splits, Hq, B), kernel_backward.h)")
        mask, window = mask_arguments(spec)
        if window is not None and mask == MASK_CAUSAL_BOTTOM_RIGHT and spec.needs_grad:
            # xformers' cutlass.py keeps bottom-right local masks out of this backward ("still
            # some infs/nans in the BW pass for local + causal").
            yield ("window_size with bottom_right alignment and a gradient needed - the efficient backward "
                   "is unreliable there; use equal lengths or top_left")
        needed = (
            (window is not None, FORWARD_OP, "window_size", "window_size"),
            (window is not None and spec.needs_grad, BACKWARD_OP, "window_size", "window_size backward"),
            (spec.seqused_k, FORWARD_OP, "seqlen_k", "seqused_k"),
        )
        yield from cc.missing_argument_reasons(needed)

    @classmethod
    def plan_notes(cls, spec: AttnSpec) -> tuple[str, ...]:
        notes = []
        d, dv = _pad_widths(spec)
        if (d, dv) != (spec.head_dim, spec.head_dim_v):
            notes.append(f"efficient: head dims zero-padded to {d}/{dv}")
        if spec.gqa_group > 1:
            notes.append(f"efficient: K/V expanded from {spec.heads_kv} to {spec.heads_q} heads (a copy)")
        mask, window = mask_arguments(spec)
        if mask != MASK_NONE:
            kind = "top-left" if mask == MASK_CAUSAL_TOP_LEFT else "bottom-right"
            notes.append(f"efficient: causal {kind} mask" + (f", window_size {window}" if window else ""))
        return tuple(notes)

    @classmethod
    def forward(cls, call: PackedCall) -> AttnOutput:
        return _Forward(call.spec)(call)

    @classmethod
    def forward_runner(cls, call: PackedCall):
        """``_Forward`` kept for the plan's kind: its row bookkeeping made once (``cc.PerBatch``)."""
        return None if call.spec.needs_grad else _Forward(call.spec)

    @classmethod
    def backward(cls, call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor, state: tuple):
        spec = call.spec
        if not state:
            return cc.zero_grads(call)
        state = EfficientState(*state)
        d, dv = _pad_widths(spec)
        max_q, max_k = cc.clamp_max_seqlens(spec)
        q, k, v = _prepare(call)
        out_p = cc.kernel_ready(cc.pad_head_dim(out, dv)).unsqueeze(0)
        grad_p = cc.kernel_ready(cc.pad_head_dim(grad_out, dv)).unsqueeze(0)
        geom = cc.query_geometry(call)
        mask, window = mask_arguments(spec)
        kwargs = {"scale": spec.scale}
        if window is not None:
            kwargs["window_size"] = window
        dq, dk, dv_, _ = torch.ops.aten._efficient_attention_backward(
            grad_p, q, k, v, None, out_p, call.cu_seqlens_q.contiguous(), call.cu_seqlens_k.contiguous(),
            max_q, max_k, cc.lse_to_native(lse, tuple(state.lse_like.shape[:-1]), geom), spec.dropout_p,
            state.philox_seed, state.philox_offset, mask, False, **kwargs,
        )
        dq = dq[0, :, :, :spec.head_dim]
        dk = cc.sum_kv_head_groups(dk[0], spec.gqa_group)[..., :spec.head_dim]
        dv_ = cc.sum_kv_head_groups(dv_[0], spec.gqa_group)[..., :spec.head_dim_v]
        if cc.rows_may_be_empty(spec):
            dq = dq.masked_fill(cc.empty_query_rows(geom, spec)[:, None, None], 0)
        if cc.keys_may_be_unseen(spec):
            # The kernel may skip key blocks no query reaches; their gradients are 0 by definition.
            unseen = cc.unseen_key_rows(cc.key_geometry(call), spec)[:, None, None]
            dk, dv_ = dk.masked_fill(unseen, 0), dv_.masked_fill(unseen, 0)
        return dq, dk, dv_


class _Forward:
    """The forward of the calls of one spec: the op's arguments worked out once, and the rows'
    bookkeeping (rows that see no key, lse layout) made once per batch (``cc.PerBatch``) - in a
    decode step that bookkeeping was most of a call's host time (~20 tiny ops, each a launch)."""

    __slots__ = ("spec", "max_q", "max_k", "mask", "kwargs", "rows")

    def __init__(self, spec: AttnSpec):
        self.spec = spec
        self.max_q, self.max_k = cc.clamp_max_seqlens(spec)
        self.mask, window = mask_arguments(spec)
        self.kwargs = {"scale": spec.scale} if window is None else {"scale": spec.scale, "window_size": window}
        self.rows = cc.PerBatch(_rows) if spec.return_lse or cc.rows_may_be_empty(spec) else None

    def __call__(self, call: PackedCall) -> AttnOutput:
        spec = self.spec
        if self.max_q == 0 or self.max_k == 0:
            # No query, or no key anywhere: the backward op refuses max_seqlen 0 and there is
            # nothing to compute.
            out, lse = cc.empty_result(call)
            return AttnOutput(out, lse if spec.return_lse else None)
        q, k, v = _prepare(call)
        kwargs = self.kwargs
        if call.seqused_k is not None:
            kwargs = {**kwargs, "seqlen_k": call.seqused_k.contiguous()}
        out, lse, seed, offset, *_ = torch.ops.aten._efficient_attention_forward(
            q, k, v, None, call.cu_seqlens_q.contiguous(), call.cu_seqlens_k.contiguous(), self.max_q, self.max_k,
            spec.dropout_p, self.mask, spec.return_lse, **kwargs,
        )
        out = out[0] if out.shape[-1] == spec.head_dim_v else out[0, :, :, :spec.head_dim_v]
        state = EfficientState(seed, offset, lse.new_empty(*lse.shape, 0))
        geom, empty_out, empty_lse = self.rows.get(call) if self.rows is not None else (None, None, None)
        if empty_out is not None:
            # 0 / 0 in the kernel's final normalisation: set from the lengths, not from its output.
            out = out.masked_fill(empty_out, 0)
        if not spec.return_lse:
            return AttnOutput(out, None, state)
        lse = cc.lse_to_packed(lse, geom)
        if empty_lse is not None:
            lse = lse.masked_fill(empty_lse, -math.inf)
        return AttnOutput(out, lse, state)


def _rows(call: PackedCall) -> tuple:
    """(query geometry, rows that see no key as (total_q, 1, 1) and (1, total_q) masks, or None
    when the spec proves there are none)."""
    geom = cc.query_geometry(call)
    if not cc.rows_may_be_empty(call.spec):
        return geom, None, None
    empty = cc.empty_query_rows(geom, call.spec)
    return geom, empty[:, None, None], empty.unsqueeze(0)
