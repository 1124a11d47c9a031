"""Engine 2: blocked matmuls, for what the fused kernel cannot do well (bf16, softcap, dropout).

Each block of query rows is multiplied against only the keys it can see (``plan.blocks``), so
causal/window calls skip masked blocks and memory stays at one (Hq, rows, keys) block. GQA is a
reshape: the G query heads of a kv head become G*rows rows of one matmul, K/V are never copied
per head. bf16 matmuls run in bf16 (this CPU's bf16 matmul is several times its fp32 one), with
float32 accumulation inside the matmul; softmax statistics are float32. fp16 is computed in
float32 (no fast fp16 matmul on CPUs without AVX512-FP16).

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


def matmul_dtype(spec: AttnSpec) -> torch.dtype:
    """bf16 matmuls round the scores to bf16 (~3 significant digits), which is fine for bf16
    outputs and gradients but not for an lse the caller asked for: a no-grad call that returns
    the lse computes its scores in float32."""
    if spec.dtype == torch.float16:
        return torch.float32
    if spec.dtype == torch.bfloat16 and spec.return_lse and not spec.needs_grad:
        return torch.float32
    return spec.dtype


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
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


def heads_first(x: Tensor, mm: torch.dtype, copy: bool) -> Tensor:
    """(L, H, D) -> (H, L, D) in the matmul dtype. Copied contiguous when several blocks reuse
    it; otherwise a strided view, which BLAS reads in place (decode is bound by reading K/V
    once, and a copy would triple that traffic)."""
    x = x.to(mm).permute(1, 0, 2)
    return x.contiguous() if copy else x


def _raw_scores(spec: AttnSpec, qg: Tensor, kh: Tensor, block: plan.Block) -> Tensor:
    kt = kh[:, block.key_lo:block.key_hi].transpose(1, 2)
    return torch.bmm(qg, kt).view(spec.heads_q, block.row_hi - block.row_lo, -1)


def _scores(spec: AttnSpec, qg: Tensor, kh: Tensor, block: plan.Block, shift: int, slopes, mm: torch.dtype):
    """Transformed scores of a block, (Hq, rows, keys) in float32 (float64 for float64), masked
    with -inf; also tanh(raw / softcap) for the softcap derivative (or None)."""
    s = _raw_scores(spec, qg, kh, block)
    s = s.to(stats_dtype(s.dtype))
    t = None
    if spec.softcap:
        t = torch.tanh(s / spec.softcap)
        s = t * spec.softcap
    if slopes is not None:
        s = s + plan.alibi_bias(slopes, shift, block, s.dtype)
    if not block.exact:
        s = s.masked_fill(~plan.keep_mask(spec, shift, block, s.device), float("-inf"))
    return s, t


def _query_rows(spec: AttnSpec, q: Tensor, mm: torch.dtype) -> Tensor:
    """q * scale, computed in float32 or better and rounded once to the matmul dtype: the matmul
    then yields scaled scores, saving a pass over the (much larger) score block."""
    return (q.to(stats_dtype(q.dtype)) * spec.scale).to(mm)


def _dropout_keep(shape, p: float, generator: Optional[torch.Generator], device) -> Tensor:
    return torch.rand(shape, generator=generator, device=device) >= p


def forward_sequence(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, slopes, out: Tensor, lse: Tensor,
                     need_lse: bool) -> None:
    """One sequence: q (Lq, Hq, D), k/v (Lk, Hkv, D/Dv); writes out (Lq, Hq, Dv), lse (Hq, Lq)."""
    len_q, len_k = q.shape[0], k.shape[0]
    mm = matmul_dtype(spec)
    shift = plan.shift_of(spec, len_q, len_k)
    hkv = spec.heads_kv
    blocks = list(_seq_blocks(spec, len_q, len_k))
    kh, vg = heads_first(k, mm, len(blocks) > 1), heads_first(v, mm, len(blocks) > 1)
    q_rows = _query_rows(spec, q, mm)
    # The fast form: scores straight into one softmax (no float32 copy of bf16 scores).
    fast = (not spec.softcap and slopes is None
            and not plan.may_have_empty_rows(spec, len_q, len_k))
    for block in blocks:
        rows = slice(block.row_lo, block.row_hi)
        if block.empty:
            out[rows] = 0
            lse[:, rows] = float("-inf")
            continue
        qg = _grouped(q_rows[rows], hkv, mm)
        denom = None  # row sums of unnormalised probabilities: they divide the (rows x Dv) output
        if fast:
            s = _raw_scores(spec, qg, kh, block)
            if not block.exact:
                s = s.masked_fill_(~plan.keep_mask(spec, shift, block, s.device), float("-inf"))
            if need_lse and not spec.dropout_p:
                # In place, in the matmul dtype: four passes over the block instead of a float32
                # softmax, two amax and a cast.
                row_max = s.amax(dim=-1, keepdim=True)
                p = s.sub_(row_max).exp_()
                denom = p.sum(dim=-1, keepdim=True, dtype=stats_dtype(s.dtype))
                lse[:, rows] = (row_max.to(denom.dtype) + torch.log(denom)).squeeze(-1)
            elif spec.dropout_p:
                p = torch.softmax(s, dim=-1, dtype=stats_dtype(s.dtype))
                if need_lse:
                    # p's row max is exp(max - lse), accurate to float32 rounding.
                    lse[:, rows] = s.amax(dim=-1).to(p.dtype) - torch.log(p.amax(dim=-1))
            else:
                p = torch.softmax(s, dim=-1)
        else:
            s, _ = _scores(spec, qg, kh, block, shift, slopes, mm)
            row_max = s.amax(dim=-1, keepdim=True)
            # A row that sees no key has max -inf; 0 instead makes exp() give exact zeros.
            row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
            p = torch.exp(s - row_max)
            denom = p.sum(dim=-1, keepdim=True)
            if need_lse:
                lse[:, rows] = (row_max + torch.log(denom)).squeeze(-1)
            denom = torch.where(denom > 0, denom, 1.0)
        if spec.dropout_p:
            p = p * _dropout_keep(p.shape, spec.dropout_p, None, p.device) / (1.0 - spec.dropout_p)
        o = torch.bmm(p.to(mm).view(hkv, -1, p.shape[-1]), vg[:, block.key_lo:block.key_hi])
        if denom is not None:
            o = o.to(denom.dtype).div_(denom.view(hkv, -1, 1))
        out[rows] = _ungrouped(o, spec.heads_q)


def backward_sequence(spec: AttnSpec, q, k, v, out, lse, grad_out, slopes, dq, dk, dv,
                      generator: Optional[torch.Generator]) -> None:
    """Gradients of one sequence; writes dq (Lq, Hq, D) and dk/dv (Lk, Hkv, D/Dv) (overwritten).

    Recomputes each block's probabilities from the forward's lse: P = exp(S - lse).
    """
    len_q, len_k = q.shape[0], k.shape[0]
    mm = matmul_dtype(spec)
    acc = stats_dtype(q.dtype)
    shift = plan.shift_of(spec, len_q, len_k)
    hkv, hq = spec.heads_kv, spec.heads_q
    blocks = list(_seq_blocks(spec, len_q, len_k))
    kg, vg = heads_first(k, mm, len(blocks) > 1), heads_first(v, mm, len(blocks) > 1)
    q_rows = _query_rows(spec, q, mm)
    dk_acc = torch.zeros(hkv, len_k, k.shape[-1], dtype=acc, device=q.device)
    dv_acc = torch.zeros(hkv, len_k, v.shape[-1], dtype=acc, device=q.device)
    lse = plan.backward_lse(lse, acc)
    # Without softcap or ALiBi, every pass over a block reads the matmul dtype and writes the next
    # operand directly (bf16: four passes over the block instead of eight).
    fast = not spec.softcap and slopes is None
    softmax_recompute = fast and mm != acc and not plan.may_have_empty_rows(spec, len_q, len_k)
    for block in blocks:
        rows = slice(block.row_lo, block.row_hi)
        if block.empty:
            dq[rows] = 0
            continue
        keys = slice(block.key_lo, block.key_hi)
        qg = _grouped(q_rows[rows], hkv, mm)
        block_lse = lse[:, rows].unsqueeze(-1)
        do = grad_out[rows]
        t = None
        if fast:
            s = _raw_scores(spec, qg, kg, block)
            if not block.exact:
                s = s.masked_fill_(~plan.keep_mask(spec, shift, block, s.device), float("-inf"))
            if softmax_recompute:
                # A block holds every key its rows see, so P = softmax(S): one pass, computed in
                # float32 and rounded once to the matmul dtype (bf16 s - lse would round first).
                p = torch.softmax(s, dim=-1)
            elif mm == acc:
                p = s.sub_(block_lse).exp_()
            else:
                p = torch.sub(s, block_lse).exp_()   # float32: bf16 (s - lse) would round first
        else:
            s, t = _scores(spec, qg, kg, block, shift, slopes, mm)
            p = torch.exp(s.sub_(block_lse))
        delta = (do.to(acc) * out[rows].to(acc)).sum(-1).transpose(0, 1).unsqueeze(-1)
        # dS = P * (dP - delta) in place, in the matmul dtype (bf16: no widening copy), unless
        # softcap's derivative or a float32 P needs the wider form.
        in_place = t is None and p.dtype == mm
        if in_place:
            delta = delta.to(mm)
        dog = _grouped(do, hkv, mm)
        keep = None
        if spec.dropout_p:
            keep = _dropout_keep(p.shape, spec.dropout_p, generator, p.device)
            p_used = p * keep / (1.0 - spec.dropout_p)
        else:
            p_used = p
        dv_acc[:, keys] += torch.bmm(p_used.to(mm).view(hkv, -1, p.shape[-1]).transpose(1, 2), dog)
        dp = torch.bmm(dog, vg[:, keys].transpose(1, 2)).view(hq, p.shape[1], -1)
        if keep is not None:
            dp = dp * keep / (1.0 - spec.dropout_p)
        if in_place:
            dsg = dp.sub_(delta).mul_(p).view(hkv, -1, dp.shape[-1])
        else:
            ds = torch.sub(dp, delta)                    # promoted to float32/float64
            if t is not None:
                ds.mul_(1.0 - t * t)
            dsg = torch.mul(ds, p, out=torch.empty(ds.shape, dtype=mm)).view(hkv, -1, ds.shape[-1])
        dq[rows] = _ungrouped(torch.bmm(dsg, kg[:, keys]).mul_(spec.scale), hq)
        # qg holds q * scale, so this is scale * dS^T q.
        dk_acc[:, keys] += torch.bmm(dsg.transpose(1, 2), qg)
    dk.copy_(dk_acc.transpose(0, 1))
    dv.copy_(dv_acc.transpose(0, 1))
