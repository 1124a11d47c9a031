"""Engine 2: blocked matmuls, for what the fused kernel cannot do well (bf16, softcap, dropout).

Each block of query rows is multiplied against only the keys it can see (``plan.blocks``), so
causal/window calls skip masked blocks and memory stays at one (Hq, rows, keys) block. GQA is a
reshape: the G query heads of a kv head become G*rows rows of one matmul, K/V are never copied
per head.

Precision: a product from which a row statistic is subtracted (the scores S, before the row max
or lse; dP = dO V^T, before delta) is computed in float32 (float64 for float64). Rounded to bf16,
S carries an absolute error of |S| * 2^-9 (0.1 at |S| = 50), which becomes a relative error of
P: a sharp softmax (large logits, scale > 1) then had outputs 40x and gradients 60x further from
float64 than MATH computing in float32. The products that are only summed (P V, P^T dO, dS K,
dS^T Q) keep bf16 operands with float32 accumulation: their rounding stays relative (this CPU's
bf16 matmul is several times its fp32 one). fp16 is computed in float32 (no fast fp16 matmul on
CPUs without AVX512-FP16); softmax statistics are float32.

Dropout masks are drawn from the default generator block by block; the backward replays them
from a generator restored to the forward's starting state, walking the same blocks in order.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from jagged_sdpa.backends.cpu import plan
from jagged_sdpa.spec import AttnSpec

# A block's float32 scores (Hq, rows, keys) stay under this many elements (~4 MiB), which keeps
# them in L2/L3 and bounds peak memory for long sequences.
BLOCK_ELEMENTS = 1 << 20
MIN_ROWS = 16


def matmul_dtype(spec: AttnSpec, nan_free: bool = True) -> torch.dtype:
    """Operand dtype of the products that are only summed (P V, P^T dO, dS K, dS^T Q).

    Not bf16 when the inputs hold NaN: PyTorch's CPU bf16 bmm (oneDNN) lets a row of NaN in its
    first operand spill into the neighbouring row (measured: rows 6 and 7 of a (44, 17) operand),
    which would put NaN in a query row that never sees the NaN."""
    if spec.dtype == torch.float16 or (spec.dtype == torch.bfloat16 and not nan_free):
        return torch.float32
    return spec.dtype


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, dP and softmax statistics: float32, or float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_rows(spec: AttnSpec, len_k: int) -> int:
    rows = BLOCK_ELEMENTS // max(1, spec.heads_q * max(len_k, 1))
    return max(MIN_ROWS, rows)


def _seq_blocks(spec: AttnSpec, len_q: int, len_k: int):
    rows = block_rows(spec, len_k)
    if not (spec.causal or spec.has_window) and rows < len_q:
        # Unmasked calls get one block per sequence from plan.blocks; split them for memory here.
        for r0 in range(0, len_q, rows):
            yield plan.Block(r0, min(len_q, r0 + rows), 0, len_k, len_k > 0)
        return
    for block in plan.blocks(spec, len_q, len_k, min(rows, 128) if (spec.causal or spec.has_window) else rows):
        yield block


def _grouped(x: Tensor, heads_kv: int, dtype: torch.dtype) -> Tensor:
    """(rows, Hq, D) -> (Hkv, G*rows, D): the G query heads of one kv head stacked as rows."""
    rows, heads_q, dim = x.shape
    return x.to(dtype).permute(1, 0, 2).reshape(heads_kv, (heads_q // heads_kv) * rows, dim)


def _ungrouped(x: Tensor, heads_q: int) -> Tensor:
    """(Hkv, G*rows, D) -> (rows, Hq, D)."""
    return x.reshape(heads_q, -1, x.shape[-1]).transpose(0, 1)


def heads_first(x: Tensor, dtype: torch.dtype, copy: bool) -> Tensor:
    """(L, H, D) -> (H, L, D) in ``dtype``. Copied contiguous when several blocks reuse it;
    otherwise a strided view, which BLAS reads in place (decode is bound by reading K/V once,
    and a copy would triple that traffic)."""
    x = x.to(dtype).permute(1, 0, 2)
    return x.contiguous() if copy else x


def _raw_scores(spec: AttnSpec, qg: Tensor, kh: Tensor, block: plan.Block) -> Tensor:
    kt = kh[:, block.key_lo:block.key_hi].transpose(1, 2)
    return torch.bmm(qg, kt).view(spec.heads_q, block.row_hi - block.row_lo, -1)


def _scores(spec: AttnSpec, qg: Tensor, kh: Tensor, block: plan.Block, shift: int, slopes):
    """Transformed scores of a block, (Hq, rows, keys) in the stats dtype (qg and kh are in it),
    masked with -inf; also tanh(raw / softcap) for the softcap derivative (or None)."""
    s = _raw_scores(spec, qg, kh, block)
    t = None
    if spec.softcap:
        t = torch.tanh(s.div_(spec.softcap))
        s = t * spec.softcap
    if slopes is not None:
        s.add_(plan.alibi_bias(slopes, shift, block, s.dtype))
    if not block.exact:
        s.masked_fill_(~plan.keep_mask(spec, shift, block, s.device), float("-inf"))
    return s, t


def _query_rows(spec: AttnSpec, q: Tensor) -> Tensor:
    """q * scale in the stats dtype (never rounded back): the score matmul then yields scaled
    scores, saving a pass over the (much larger) score block."""
    return q.to(stats_dtype(q.dtype)) * spec.scale


def _dropout_keep(shape, p: float, generator: Optional[torch.Generator], device) -> Tensor:
    return torch.rand(shape, generator=generator, device=device) >= p


def forward_sequence(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, slopes, out: Tensor, lse: Tensor,
                     need_lse: bool, nan_free: bool = True) -> None:
    """One sequence: q (Lq, Hq, D), k/v (Lk, Hkv, D/Dv); writes out (Lq, Hq, Dv), lse (Hq, Lq)."""
    len_q, len_k = q.shape[0], k.shape[0]
    mm, acc = matmul_dtype(spec, nan_free), stats_dtype(spec.dtype)
    shift = plan.shift_of(spec, len_q, len_k)
    hkv = spec.heads_kv
    blocks = list(_seq_blocks(spec, len_q, len_k))
    kh, vg = heads_first(k, acc, len(blocks) > 1), heads_first(v, mm, len(blocks) > 1)
    q_rows = _query_rows(spec, q)
    may_be_empty = plan.may_have_empty_rows(spec, len_q, len_k)
    for block in blocks:
        rows = slice(block.row_lo, block.row_hi)
        if block.empty:
            out[rows] = 0
            lse[:, rows] = float("-inf")
            continue
        s, _ = _scores(spec, _grouped(q_rows[rows], hkv, acc), kh, block, shift, slopes)
        row_max = s.amax(dim=-1, keepdim=True)
        if may_be_empty:  # a row that sees no key has max -inf; 0 instead makes exp() give zeros
            row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
        p = s.sub_(row_max).exp_()  # unnormalised: the (rows x Dv) output is divided instead
        denom = p.sum(dim=-1, keepdim=True)
        if need_lse:
            lse[:, rows] = (row_max + torch.log(denom)).squeeze(-1)
        if may_be_empty:
            denom = torch.where(denom > 0, denom, 1.0)
        p.div_(denom)
        if spec.dropout_p:
            p = p * _dropout_keep(p.shape, spec.dropout_p, None, p.device) / (1.0 - spec.dropout_p)
        o = torch.bmm(p.to(mm).view(hkv, -1, p.shape[-1]), vg[:, block.key_lo:block.key_hi])
        out[rows] = _ungrouped(o, spec.heads_q)


def backward_sequence(spec: AttnSpec, q, k, v, out, lse, grad_out, slopes, dq, dk, dv,
                      generator: Optional[torch.Generator], nan_free: bool = True) -> None:
    """Gradients of one sequence; writes dq (Lq, Hq, D) and dk/dv (Lk, Hkv, D/Dv) (overwritten).

    Recomputes each block's probabilities from the forward's lse: P = exp(S - lse). A block holds
    every key its rows see, so delta_i = sum_j P_ij dP_ij is summed in the block: exact for the P
    used here, where rowsum(dO * out) (``out`` is not read) carries the output's bf16 rounding.
    """
    len_q, len_k = q.shape[0], k.shape[0]
    mm, acc = matmul_dtype(spec, nan_free), stats_dtype(spec.dtype)
    shift = plan.shift_of(spec, len_q, len_k)
    hkv, hq = spec.heads_kv, spec.heads_q
    blocks = list(_seq_blocks(spec, len_q, len_k))
    copy = len(blocks) > 1
    k_s, v_s = heads_first(k, acc, copy), heads_first(v, acc, copy)   # S = Q K^T, dP = dO V^T
    k_m = k_s if mm == acc else heads_first(k, mm, copy)              # dQ = dS K
    q_rows = _query_rows(spec, q)
    dk_acc = torch.zeros(hkv, len_k, k.shape[-1], dtype=acc, device=q.device)
    dv_acc = torch.zeros(hkv, len_k, v.shape[-1], dtype=acc, device=q.device)
    lse = plan.backward_lse(lse, acc)
    for block in blocks:
        rows = slice(block.row_lo, block.row_hi)
        if block.empty:
            dq[rows] = 0
            continue
        keys = slice(block.key_lo, block.key_hi)
        s, t = _scores(spec, _grouped(q_rows[rows], hkv, acc), k_s, block, shift, slopes)
        p = s.sub_(lse[:, rows].unsqueeze(-1)).exp_()
        do = grad_out[rows]
        dog = _grouped(do, hkv, mm)
        dp = torch.bmm(dog if mm == acc else _grouped(do, hkv, acc), v_s[:, keys].transpose(1, 2))
        dp = dp.view(hq, p.shape[1], -1)
        p_used = p
        if spec.dropout_p:
            keep = _dropout_keep(p.shape, spec.dropout_p, generator, p.device)
            p_used = p * keep / (1.0 - spec.dropout_p)
            dp.mul_(keep).div_(1.0 - spec.dropout_p)
        dv_acc[:, keys] += torch.bmm(p_used.to(mm).view(hkv, -1, p.shape[-1]).transpose(1, 2), dog)
        # dS = P * (dP - delta) * scale (* the softcap derivative), in the stats dtype, rounded
        # once to the matmul dtype.
        ds = p * dp
        ds.addcmul_(p, ds.sum(dim=-1, keepdim=True), value=-1.0)
        ds.mul_(spec.scale if t is None else (1.0 - t * t).mul_(spec.scale))
        dsg = ds.to(mm).view(hkv, -1, ds.shape[-1])
        dq[rows] = _ungrouped(torch.bmm(dsg, k_m[:, keys]), hq)
        dk_acc[:, keys] += torch.bmm(dsg.transpose(1, 2), _grouped(q[rows], hkv, mm))
    dk.copy_(dk_acc.transpose(0, 1))
    dv.copy_(dv_acc.transpose(0, 1))
