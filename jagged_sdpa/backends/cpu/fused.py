"""Engine 1: PyTorch's fused CPU flash kernel, one block of query rows at a time.

``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its backward) never materialises the
score matrix and runs at ~2/3 of this CPU's fp32 matmul peak. It cannot take softcap or dropout,
its ``is_causal`` is top-left only, and it computes whole 512-key blocks even where causal masks
them. So we call it per block of query rows against only the keys that block can see (causal
then costs about half), and express bottom-right alignment, windows and ALiBi as an additive
mask of that block. GQA expands K/V once per sequence (the kernel wants equal head counts).
"""

from __future__ import annotations

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


def _seq_blocks(spec: AttnSpec, len_q: int, len_k: int):
    return plan.blocks(spec, len_q, len_k, BLOCK_ROWS)


# Causal rows per diagonal block (see ``_diagonal_split``): measured on W1 causal, 1 thread: 64
# rows 44.6 ms, 32 rows 46.2, 128 rows 46.2, whole sequences in halves (recursive) 46.3; the
# 128-row masked blocks 49.3 and the loop of dense causal SDPA calls 55.7.
DIAGONAL_ROWS = 64


def _diagonal_split(spec: AttnSpec, slopes, len_q: int, len_k: int):
    """Plain causal attention as masks-free kernel calls: (rows, exact keys, diagonal keys).

    Under causal alone, with Lq <= Lk, rows [r0, r1) see keys [0, r0 + shift) whole and keys
    [r0 + shift, r1 + shift) as a top-left causal square: one unmasked call and one call with
    the kernel's own ``is_causal``, merged by their lse. No additive mask is built or read, and
    no masked key is computed beyond the squares' upper triangles. None when it does not apply.
    """
    if not spec.causal or spec.has_window or slopes is not None or len_q > len_k:
        return None
    shift = plan.shift_of(spec, len_q, len_k)
    parts = []
    for r0 in range(0, len_q, DIAGONAL_ROWS):
        r1 = min(len_q, r0 + DIAGONAL_ROWS)
        parts.append((slice(r0, r1), slice(0, r0 + shift), slice(r0 + shift, r1 + shift)))
    return parts


def _merge(o_a: Tensor, l_a: Tensor, o_b: Tensor, l_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over two disjoint key sets, from each one's output and lse."""
    lse = torch.logaddexp(l_a, l_b)
    w_a = (l_a - lse).exp_().unsqueeze(-1)
    w_b = (l_b - lse).exp_().unsqueeze(-1)
    return torch.addcmul(o_a * w_a, o_b, w_b), lse


def _forward_diagonal(spec: AttnSpec, q, kx, vx, parts, out, lse, lse_full) -> None:
    for rows, exact, diagonal in parts:
        qb = _bhld(q[rows])
        o, l = _FWD(qb, _bhld(kx[diagonal]), _bhld(vx[diagonal]), 0.0, True, scale=spec.scale)
        if exact.stop > 0:
            o_a, l_a = _FWD(qb, _bhld(kx[exact]), _bhld(vx[exact]), 0.0, False, scale=spec.scale)
            o, l = _merge(o_a, l_a, o, l)
        out[rows] = o[0].transpose(0, 1)
        lse[:, rows] = l[0]
        if lse_full is not None:
            lse_full[:, rows] = l[0]


def forward_sequence(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, slopes, out: Tensor, lse: Tensor,
                     lse_full) -> None:
    """One sequence: q (Lq, Hq, D), k/v (Lk, Hkv, D/Dv); writes out (Lq, Hq, Dv) and lse (Hq, Lq)
    (and ``lse_full``, the kernel's own-precision lse, when not None)."""
    len_q, len_k = q.shape[0], k.shape[0]
    shift = plan.shift_of(spec, len_q, len_k)
    kx, vx = _expand_heads(k, spec.gqa_group), _expand_heads(v, spec.gqa_group)
    parts = _diagonal_split(spec, slopes, len_q, len_k)
    if parts is not None:
        _forward_diagonal(spec, q, kx, vx, parts, out, lse, lse_full)
        return
    check_empty = plan.may_have_empty_rows(spec, len_q, len_k)
    for block in _seq_blocks(spec, len_q, len_k):
        rows = slice(block.row_lo, block.row_hi)
        if block.empty:
            out[rows] = 0
            lse[:, rows] = float("-inf")
            if lse_full is not None:
                lse_full[:, rows] = float("-inf")
            continue
        keys = slice(block.key_lo, block.key_hi)
        mask = _block_mask(spec, shift, block, slopes, q.dtype, q.device)
        o, l = _FWD(_bhld(q[rows]), _bhld(kx[keys]), _bhld(vx[keys]), 0.0, False, attn_mask=mask, scale=spec.scale)
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
    """Gradients of one sequence: writes dq (Lq, Hq, D) and dk/dv (Lk, Hkv, D/Dv) (overwritten)."""
    len_q, len_k = q.shape[0], k.shape[0]
    group = spec.gqa_group
    shift = plan.shift_of(spec, len_q, len_k)
    kx, vx = _expand_heads(k, group), _expand_heads(v, group)
    # Rows that see no key have lse -inf; +inf makes the kernel's exp(s - lse) exactly 0 there.
    lse = torch.where(torch.isneginf(lse), float("inf"), lse).to(lse_dtype(q.dtype))
    parts = _diagonal_split(spec, slopes, len_q, len_k)
    blocks = list(_seq_blocks(spec, len_q, len_k)) if parts is None else []
    if len(blocks) == 1 and not blocks[0].empty and (blocks[0].key_lo, blocks[0].key_hi) == (0, len_k):
        # One call sees every key (unmasked): its dK/dV are the answer, no accumulators.
        block = blocks[0]
        gq, gk, gv = _BWD(_bhld(grad_out), _bhld(q), _bhld(kx), _bhld(vx), _bhld(out), lse.unsqueeze(0), 0.0,
                          False, attn_mask=_block_mask(spec, shift, block, slopes, q.dtype, q.device),
                          scale=spec.scale)
        dq.copy_(gq[0].transpose(0, 1))
        dk.copy_(_sum_groups(gk[0].transpose(0, 1), spec))
        dv.copy_(_sum_groups(gv[0].transpose(0, 1), spec))
        return
    dkx = torch.zeros(kx.shape, dtype=lse_dtype(q.dtype), device=q.device) if len_k else None
    dvx = torch.zeros(vx.shape, dtype=lse_dtype(q.dtype), device=q.device) if len_k else None
    if parts is not None:
        # Given the whole row's out and lse, each key set's gradients are independent: the
        # kernel's backward runs on the same unmasked/is_causal pieces as the forward.
        for rows, exact, diagonal in parts:
            g, o, qb, l = _bhld(grad_out[rows]), _bhld(out[rows]), _bhld(q[rows]), lse[:, rows].unsqueeze(0)
            gq, gk, gv = _BWD(g, qb, _bhld(kx[diagonal]), _bhld(vx[diagonal]), o, l, 0.0, True, scale=spec.scale)
            dkx[diagonal] += gk[0].transpose(0, 1)
            dvx[diagonal] += gv[0].transpose(0, 1)
            if exact.stop > 0:
                gq_a, gk, gv = _BWD(g, qb, _bhld(kx[exact]), _bhld(vx[exact]), o, l, 0.0, False, scale=spec.scale)
                gq = gq + gq_a
                dkx[exact] += gk[0].transpose(0, 1)
                dvx[exact] += gv[0].transpose(0, 1)
            dq[rows] = gq[0].transpose(0, 1)
    for block in blocks:
        rows = slice(block.row_lo, block.row_hi)
        if block.empty:
            dq[rows] = 0
            continue
        keys = slice(block.key_lo, block.key_hi)
        mask = _block_mask(spec, shift, block, slopes, q.dtype, q.device)
        g, o = grad_out[rows], out[rows]
        gq, gk, gv = _BWD(_bhld(g), _bhld(q[rows]), _bhld(kx[keys]), _bhld(vx[keys]), _bhld(o),
                          lse[:, rows].unsqueeze(0), 0.0, False, attn_mask=mask, scale=spec.scale)
        dq[rows] = gq[0].transpose(0, 1)
        dkx[keys] += gk[0].transpose(0, 1)
        dvx[keys] += gv[0].transpose(0, 1)
    if len_k:
        dk.copy_(_sum_groups(dkx, spec))
        dv.copy_(_sum_groups(dvx, spec))


def _sum_groups(grad: Tensor, spec: AttnSpec) -> Tensor:
    """(Lk, Hq, D) gradient of the expanded K/V -> (Lk, Hkv, D): sum over each kv head's group."""
    return grad if spec.gqa_group == 1 else grad.unflatten(1, (spec.heads_kv, spec.gqa_group)).sum(2)
