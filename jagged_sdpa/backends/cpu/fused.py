"""Engine 1: PyTorch's fused CPU flash kernel, one block of query rows at a time.

``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its backward) never materialises the
score matrix and runs at ~2/3 of this CPU's fp32 matmul peak. It cannot take softcap or dropout,
its ``is_causal`` is top-left only, and it computes whole 512-key blocks even where causal masks
them. So we call it per block of query rows against only the keys that block can see (causal
then costs about half): plain causal as an unmasked call plus an ``is_causal`` call on the
diagonal square, merged by lse; bottom-right alignment with windows or ALiBi as an additive mask
of the block. GQA expands K/V once per sequence (the kernel wants equal head counts).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from jagged_sdpa.backends.cpu import plan
from jagged_sdpa.spec import AttnSpec

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# Rows per block under a causal or window mask: small enough to skip most masked keys, large
# enough that the kernel's per-call cost (~20 us) stays small next to the block's work.
BLOCK_ROWS = 128


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_heads(x: Tensor, group: int) -> Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _bhld(x: Tensor) -> Tensor:
    """(L, H, D) packed slice -> (1, H, L, D) strided view for the kernel."""
    return x.transpose(0, 1).unsqueeze(0)


def _block_mask(spec: AttnSpec, shift: int, block: plan.Block, slopes, dtype, device):
    """Additive (1, 1 or Hq, rows, keys) mask in the query dtype, or None when the block needs none."""
    if block.exact and slopes is None:
        return None
    mask = None
    if not block.exact:
        keep = plan.keep_mask(spec, shift, block, device)
        mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
    if slopes is not None:
        bias = plan.alibi_bias(slopes, shift, block, dtype)
        mask = bias if mask is None else bias + mask
    return mask.unsqueeze(0) if mask.dim() == 3 else mask.view(1, 1, *mask.shape)


# Causal rows per diagonal block (see ``_plan``): measured on W1 causal, 1 thread: 64 rows
# 44.6 ms, 32 rows 46.2, 128 rows 46.2, whole sequences in halves (recursive) 46.3; the 128-row
# masked blocks 49.3 and the loop of dense causal SDPA calls 55.7.
DIAGONAL_ROWS = 64


class _Call(NamedTuple):
    """One kernel call for a block's rows: the keys, the kernel's own top-left ``is_causal`` (on
    a square), and the block whose additive mask it takes (None: no mask). Masks are built only
    when the call runs, so a plan holds no tensors."""

    keys: slice
    causal: bool
    masked: Optional[plan.Block]

    def mask(self, spec: AttnSpec, shift: int, slopes, dtype, device) -> Optional[Tensor]:
        return None if self.masked is None else _block_mask(spec, shift, self.masked, slopes, dtype, device)


def _plan(spec: AttnSpec, slopes, len_q: int, len_k: int) -> list[tuple[plan.Block, list[_Call]]]:
    """Per block of query rows, the kernel calls that together cover the keys its rows see
    (none for a block that sees no key); forward and backward walk the same calls.

    Plain causal with Lq <= Lk: rows [r0, r1) see keys [0, r0 + shift) whole and keys
    [r0 + shift, r1 + shift) as a top-left causal square: one unmasked call and one call with
    the kernel's ``is_causal``, merged by their lse. No mask is built or read, and no masked key
    is computed beyond the squares' upper triangles. Otherwise one call per block against only
    its visible keys, with the block's additive mask (bottom-right, windows, ALiBi).
    """
    if spec.causal and not spec.has_window and slopes is None and len_q <= len_k:
        shift = plan.shift_of(spec, len_q, len_k)
        blocks = []
        for r0 in range(0, len_q, DIAGONAL_ROWS):
            r1 = min(len_q, r0 + DIAGONAL_ROWS)
            calls = [_Call(slice(0, r0 + shift), False, None)] if r0 + shift > 0 else []
            calls.append(_Call(slice(r0 + shift, r1 + shift), True, None))
            blocks.append((plan.Block(r0, r1, 0, r1 + shift, False), calls))
        return blocks
    return [(block, [] if block.empty else [_Call(slice(block.key_lo, block.key_hi), False, block)])
            for block in plan.blocks(spec, len_q, len_k, BLOCK_ROWS)]


def _merge(o_a: Tensor, l_a: Tensor, o_b: Tensor, l_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over two disjoint key sets, from each one's output and lse."""
    lse = torch.logaddexp(l_a, l_b)
    w_a = (l_a - lse).exp_().unsqueeze(-1)
    w_b = (l_b - lse).exp_().unsqueeze(-1)
    return torch.addcmul(o_a * w_a, o_b, w_b), lse


def forward_sequence(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, slopes, out: Tensor, lse: Tensor,
                     lse_full) -> None:
    """One sequence: q (Lq, Hq, D), k/v (Lk, Hkv, D/Dv); writes out (Lq, Hq, Dv) and lse (Hq, Lq)
    (and ``lse_full``, the kernel's own-precision lse, when not None)."""
    len_q, len_k = q.shape[0], k.shape[0]
    shift = plan.shift_of(spec, len_q, len_k)
    kx, vx = _expand_heads(k, spec.gqa_group), _expand_heads(v, spec.gqa_group)
    check_empty = plan.may_have_empty_rows(spec, len_q, len_k)
    for block, calls in _plan(spec, slopes, len_q, len_k):
        rows = slice(block.row_lo, block.row_hi)
        if not calls:
            out[rows] = 0
            lse[:, rows] = float("-inf")
            if lse_full is not None:
                lse_full[:, rows] = float("-inf")
            continue
        qb, o, l = _bhld(q[rows]), None, None
        for call in calls:
            o_c, l_c = _FWD(qb, _bhld(kx[call.keys]), _bhld(vx[call.keys]), 0.0, call.causal,
                            attn_mask=call.mask(spec, shift, slopes, q.dtype, q.device), scale=spec.scale)
            o, l = (o_c, l_c) if o is None else _merge(o, l, o_c, l_c)
        out[rows] = o[0].transpose(0, 1)
        lse[:, rows] = l[0]
        if lse_full is not None:
            lse_full[:, rows] = l[0]
        if check_empty and (empty := plan.empty_rows(spec, shift, len_k, block)) is not None:
            idx = torch.tensor(empty, device=q.device) + block.row_lo
            out.index_fill_(0, idx, 0)
            lse.index_fill_(1, idx, float("-inf"))
            if lse_full is not None:
                lse_full.index_fill_(1, idx, float("-inf"))


def backward_sequence(spec: AttnSpec, q, k, v, out, lse, grad_out, slopes, dq, dk, dv) -> None:
    """Gradients of one sequence: writes dq (Lq, Hq, D) and dk/dv (Lk, Hkv, D/Dv) (overwritten).

    Given each row's final out and lse, the gradients of disjoint key sets are independent, so
    the kernel's backward runs on the forward's calls one by one.
    """
    len_q, len_k = q.shape[0], k.shape[0]
    shift = plan.shift_of(spec, len_q, len_k)
    kx, vx = _expand_heads(k, spec.gqa_group), _expand_heads(v, spec.gqa_group)
    lse = plan.backward_lse(lse, lse_dtype(q.dtype))
    blocks = _plan(spec, slopes, len_q, len_k)
    # One call that sees every key: its dK/dV are the answer, no accumulators. (It may belong to
    # any block: the blocks before it can see no key.)
    all_calls = [call for _, calls in blocks for call in calls]
    direct = len(all_calls) == 1 and all_calls[0].keys == slice(0, len_k)
    dkx = dvx = None
    if len_k and not direct:
        dkx = torch.zeros(kx.shape, dtype=lse_dtype(q.dtype), device=q.device)
        dvx = torch.zeros(vx.shape, dtype=lse_dtype(q.dtype), device=q.device)
    for block, calls in blocks:
        rows = slice(block.row_lo, block.row_hi)
        if not calls:
            dq[rows] = 0
            continue
        g, qb, o, l = _bhld(grad_out[rows]), _bhld(q[rows]), _bhld(out[rows]), lse[:, rows].unsqueeze(0)
        dq_rows = None
        for call in calls:
            gq, gk, gv = _BWD(g, qb, _bhld(kx[call.keys]), _bhld(vx[call.keys]), o, l, 0.0, call.causal,
                              attn_mask=call.mask(spec, shift, slopes, q.dtype, q.device), scale=spec.scale)
            dq_rows = gq if dq_rows is None else dq_rows + gq
            if direct:
                dk.copy_(_sum_groups(gk[0].transpose(0, 1), spec))
                dv.copy_(_sum_groups(gv[0].transpose(0, 1), spec))
            else:
                dkx[call.keys] += gk[0].transpose(0, 1)
                dvx[call.keys] += gv[0].transpose(0, 1)
        dq[rows] = dq_rows[0].transpose(0, 1)
    if dkx is not None:
        dk.copy_(_sum_groups(dkx, spec))
        dv.copy_(_sum_groups(dvx, spec))


def _sum_groups(grad: Tensor, spec: AttnSpec) -> Tensor:
    """(Lk, Hq, D) gradient of the expanded K/V -> (Lk, Hkv, D): sum over each kv head's group."""
    return grad if spec.gqa_group == 1 else grad.unflatten(1, (spec.heads_kv, spec.gqa_group)).sum(2)
