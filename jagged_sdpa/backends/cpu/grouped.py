"""Engine 3 (forward only): many short sequences padded into a few groups, a few ops per group.

Per-sequence work on short sequences is dominated by per-call costs (a dozen small ops each),
and on two or more threads small ops leave cores idle. Sequences of similar length are padded
into one (n, Hq, Lq_max, Lk_max) batch; padded keys are masked, padded query rows computed and
dropped. Only the plain fast form is taken here (no softcap, ALiBi or dropout, no row that sees
no key, packed keys). A group runs as one call of PyTorch's fused CPU kernel with an additive
mask (~7 ops a group: gathers, kernel, scatters), or, where that kernel cannot take it (Dv != D,
or a torch without it), as a bmm/softmax/bmm pair (~35 ops).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from jagged_sdpa.backends import positions
from jagged_sdpa.backends.cpu import blocked, plan
from jagged_sdpa.spec import AttnSpec

# Lengths in one group differ by at most this factor (plus a few rows): bounds padding waste.
LENGTH_RATIO = 1.3
LENGTH_SLACK = 4


class Member(NamedTuple):
    q_start: int
    len_q: int
    k_start: int
    len_k: int


def eligible(spec: AttnSpec, len_q: int, len_k: int) -> bool:
    if spec.softcap or spec.alibi or spec.dropout_p or spec.paged:
        return False
    return len_q > 0 and not plan.may_have_empty_rows(spec, len_q, len_k)


def groups(members: list[Member], heads_q: int) -> list[list[Member]]:
    """Sort by key length and cut where lengths grow past the ratio or the block budget."""
    ordered = sorted(members, key=lambda m: (m.len_k, m.len_q))
    out, current, lo = [], [], 0
    max_q = max_k = 0
    for m in ordered:
        new_q, new_k = max(max_q, m.len_q), max(max_k, m.len_k)
        too_long = current and new_k > LENGTH_RATIO * lo + LENGTH_SLACK
        too_big = current and (len(current) + 1) * heads_q * new_q * new_k > blocked.BLOCK_ELEMENTS
        if too_long or too_big:
            out.append(current)
            current, max_q, max_k = [], 0, 0
            new_q, new_k = m.len_q, m.len_k
        if not current:
            lo = m.len_k
        current.append(m)
        max_q, max_k = new_q, new_k
    if current:
        out.append(current)
    return out


def _padded_rows(starts: Tensor, lengths: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """(n, width) packed row indices (padding repeats each sequence's last row) and validity."""
    offs = torch.arange(width, device=starts.device)
    valid = offs.unsqueeze(0) < lengths.unsqueeze(1)
    rows = starts.unsqueeze(1) + torch.minimum(offs.unsqueeze(0), (lengths - 1).unsqueeze(1))
    return rows, valid


def forward_group(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, members: list[Member], out: Tensor,
                  lse: Tensor, need_lse: bool, nan_free: bool = True) -> None:
    """Attention of ``members`` (packed q/k/v rows) into ``out``/``lse`` at their packed rows;
    inputs holding NaN (``backend.nan_free``) keep to the bmm form, in float32 products."""
    if nan_free and spec.head_dim_v == spec.head_dim and fused_kernel_works():
        _forward_group_fused(spec, q, k, v, members, out, lse, need_lse)
    else:
        _forward_group_bmm(spec, q, k, v, members, out, lse, need_lse, nan_free)


# ----------------------------------------------------------------------------------------------
# fused-kernel form


class _Layout(NamedTuple):
    """Index tensors and mask of one group geometry: a pure function of the host-read lengths."""

    rows_q: Tensor            # (n * width_q,) packed query row of each padded row
    rows_k: Tensor            # (n * width_k,)
    src: Tensor               # padded rows (flat) that are real queries, in packed order
    dst: Tensor               # their packed rows
    mask: Optional[Tensor]    # (n, 1, width_q, width_k) additive, or None when nothing is masked
    width_q: int
    width_k: int
    all_rows: bool            # dst is 0, 1, ..., len(dst) - 1


_LAYOUTS: dict = {}
_LAYOUTS_MAX = 256


def _layout(spec: AttnSpec, members: tuple[Member, ...]) -> _Layout:
    key = (members, spec.causal, spec.alignment, spec.window, spec.dtype)
    found = _LAYOUTS.get(key)
    if found is None:
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        found = _LAYOUTS[key] = _build_layout(spec, members)
    return found


def _build_layout(spec: AttnSpec, members: tuple[Member, ...]) -> _Layout:
    n = len(members)
    meta = torch.tensor(members, dtype=torch.long)
    len_q, len_k = meta[:, 1], meta[:, 3]
    width_q, width_k = max(m.len_q for m in members), max(m.len_k for m in members)
    rows_q, valid_q = _padded_rows(meta[:, 0], len_q, width_q)
    rows_k, valid_k = _padded_rows(meta[:, 2], len_k, width_k)
    src = valid_q.flatten().nonzero().flatten()
    dst = rows_q.flatten()[src]
    dst, order = dst.sort()  # packed order: a group holding the whole call is written in one op
    src = src[order]
    keep = valid_k.view(n, 1, width_k).expand(n, width_q, width_k)
    if spec.causal or spec.has_window:
        # Padded query rows (dropped later) see every real key, so no row is fully masked.
        keep = keep & (_position_keep(spec, len_q, len_k, width_q, width_k) | ~valid_q.view(n, width_q, 1))
    mask = None
    if not bool(keep.all()):
        mask = torch.zeros(n, 1, width_q, width_k, dtype=spec.dtype)
        mask.masked_fill_(~keep.unsqueeze(1), float("-inf"))
    all_rows = dst.tolist() == list(range(dst.shape[0]))
    return _Layout(rows_q.flatten(), rows_k.flatten(), src, dst, mask, width_q, width_k, all_rows)


def _position_keep(spec: AttnSpec, len_q: Tensor, len_k: Tensor, width_q: int, width_k: int) -> Tensor:
    """(n, width_q, width_k) causal/window keep-mask at the aligned positions of each member."""
    n = len_q.shape[0]
    shift = (len_k - len_q) if spec.alignment == "bottom_right" else torch.zeros_like(len_q)
    pos = torch.arange(width_q).view(1, width_q, 1) + shift.view(n, 1, 1)
    j = torch.arange(width_k).view(1, 1, width_k)
    return positions.keep_mask(spec, pos, j)


def _fused_kernel():
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def fused_kernel_works() -> bool:
    """Whether this torch's fused CPU kernel takes an additive mask and returns the natural-log
    lse (checked once per process against explicit math); else the bmm form runs."""
    return _kernel_support()[0]


def fused_kernel_gqa() -> bool:
    """Whether the kernel also takes fewer key/value heads than query heads (else K/V are expanded)."""
    return _kernel_support()[1]


@functools.cache
def _kernel_support() -> tuple[bool, bool]:
    def agrees(heads_kv: int) -> bool:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, 3, 8, generator=gen, dtype=torch.float64)
        k = torch.randn(2, heads_kv, 5, 8, generator=gen, dtype=torch.float64)
        v = torch.randn(2, heads_kv, 5, 8, generator=gen, dtype=torch.float64)
        mask = torch.zeros(2, 1, 3, 5, dtype=torch.float64)
        mask[0, :, :, 3:] = float("-inf")
        out, lse = _fused_kernel()(q, k, v, 0.0, False, attn_mask=mask, scale=0.5)
        k, v = k.repeat_interleave(4 // heads_kv, 1), v.repeat_interleave(4 // heads_kv, 1)
        s = q @ k.transpose(-1, -2) * 0.5 + mask
        return bool(torch.allclose(out, torch.softmax(s, -1) @ v, atol=1e-9)
                    and torch.allclose(lse, s.logsumexp(-1), atol=1e-9))

    try:
        if not agrees(4):
            return False, False
    except Exception:  # missing op, or a signature or behaviour of another torch: use bmm
        return False, False
    try:
        return True, agrees(2)
    except Exception:  # GQA refused: expand K/V to the query heads
        return True, False


def _gather(x: Tensor, rows: Tensor, n: int, width: int) -> Tensor:
    """(n, H, width, D) view of the padded rows of packed (total, H, D) ``x`` (one copy)."""
    return x.index_select(0, rows).view(n, width, x.shape[1], x.shape[2]).transpose(1, 2)


def _forward_group_fused(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, members: list[Member], out: Tensor,
                         lse: Tensor, need_lse: bool) -> None:
    n = len(members)
    lay = _layout(spec, tuple(members))
    qp = _gather(q, lay.rows_q, n, lay.width_q)
    kp = _gather(k, lay.rows_k, n, lay.width_k)
    vp = _gather(v, lay.rows_k, n, lay.width_k)
    if spec.heads_q != spec.heads_kv and not fused_kernel_gqa():
        kp, vp = (x.repeat_interleave(spec.gqa_group, 1) for x in (kp, vp))
    o, group_lse = _fused_kernel()(qp, kp, vp, 0.0, False, attn_mask=lay.mask, scale=spec.scale)
    # (n, Hq, width_q, .) -> padded rows first; a view for the kernel's (n, width_q, Hq, .) layout.
    _write_rows(spec, lay, o.transpose(1, 2).reshape(n * lay.width_q, spec.heads_q, -1),
                group_lse if need_lse else None, out, lse)


def _write_rows(spec: AttnSpec, lay: _Layout, o: Tensor, group_lse: Optional[Tensor], out: Tensor,
                lse: Tensor) -> None:
    """Scatter the real rows of padded output o (n * width_q, Hq, Dv) (and of group_lse
    (n, Hq, width_q), when not None) to their packed rows of out/lse."""
    if lay.all_rows and out.shape[0] == lay.src.shape[0] and o.dtype == out.dtype and out.is_contiguous():
        torch.index_select(o, 0, lay.src, out=out)  # the group is the whole call: written in place
    else:
        out.index_copy_(0, lay.dst, o.index_select(0, lay.src).to(out.dtype))
    if group_lse is not None:
        rows_lse = group_lse.transpose(1, 2).reshape(-1, spec.heads_q).index_select(0, lay.src)
        lse.index_copy_(1, lay.dst, rows_lse.t().to(lse.dtype))


# ----------------------------------------------------------------------------------------------
# bmm form


def _forward_group_bmm(spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor, members: list[Member], out: Tensor,
                       lse: Tensor, need_lse: bool, nan_free: bool = True) -> None:
    n = len(members)
    hq, hkv = spec.heads_q, spec.heads_kv
    group = hq // hkv
    mm, acc = blocked.matmul_dtype(spec, nan_free), blocked.stats_dtype(spec.dtype)   # see blocked.py: precision
    lay = _layout(spec, tuple(members))
    width_q, width_k = lay.width_q, lay.width_k
    qs = blocked._query_rows(spec, q.index_select(0, lay.rows_q))
    qg = qs.view(n, width_q, hkv, group, -1).permute(0, 2, 3, 1, 4).reshape(n * hkv, group * width_q, -1)
    kg = k.index_select(0, lay.rows_k).to(acc).view(n, width_k, hkv, -1).transpose(1, 2).reshape(n * hkv, width_k, -1)
    vg = v.index_select(0, lay.rows_k).to(mm).view(n, width_k, hkv, -1).transpose(1, 2).reshape(n * hkv, width_k, -1)
    s = torch.bmm(qg, kg.transpose(1, 2)).view(n, hq, width_q, width_k)
    if lay.mask is not None:
        s.add_(lay.mask)
    group_lse = None
    p = torch.softmax(s, dim=-1)
    if need_lse:
        group_lse = s.amax(dim=-1) - torch.log(p.amax(dim=-1))                   # (n, Hq, width_q)
    o = torch.bmm(p.to(mm).view(n * hkv, group * width_q, width_k), vg)
    o = o.view(n, hkv, group, width_q, -1).permute(0, 3, 1, 2, 4).reshape(n * width_q, hq, -1)
    _write_rows(spec, lay, o, group_lse, out, lse)
