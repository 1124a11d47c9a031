"""Engine 3 (forward only): many short sequences padded into a few groups, one matmul pair each.

Per-sequence work on short sequences is dominated by per-call costs (a dozen small ops each),
and on two or more threads small ops leave cores idle. Sequences of similar length are padded
into one (n, Hq, Lq_max, Lk_max) batch; padded keys are masked, padded query rows computed and
dropped. Only the plain fast form is taken here (no softcap, ALiBi or dropout, no row that sees
no key, packed keys), so the results equal the per-sequence blocked engine's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

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
                  lse: Tensor, need_lse: bool) -> None:
    """Attention of ``members`` (packed q/k/v rows) into ``out``/``lse`` at their packed rows."""
    n = len(members)
    hq, hkv = spec.heads_q, spec.heads_kv
    group = hq // hkv
    mm = blocked.matmul_dtype(spec)
    meta = torch.tensor(members, dtype=torch.long)
    len_q, len_k = meta[:, 1], meta[:, 3]
    width_q, width_k = max(m.len_q for m in members), max(m.len_k for m in members)
    rows_q, valid_q = _padded_rows(meta[:, 0], len_q, width_q)
    rows_k, valid_k = _padded_rows(meta[:, 2], len_k, width_k)

    qs = blocked._query_rows(spec, q.index_select(0, rows_q.flatten()), mm)
    qg = qs.view(n, width_q, hkv, group, -1).permute(0, 2, 3, 1, 4).reshape(n * hkv, group * width_q, -1)
    kg = k.index_select(0, rows_k.flatten()).to(mm).view(n, width_k, hkv, -1).transpose(1, 2).reshape(n * hkv, width_k, -1)
    vg = v.index_select(0, rows_k.flatten()).to(mm).view(n, width_k, hkv, -1).transpose(1, 2).reshape(n * hkv, width_k, -1)
    s = torch.bmm(qg, kg.transpose(1, 2)).view(n, hq, width_q, width_k)

    keep = valid_k.view(n, 1, width_k)
    if spec.causal or spec.has_window:
        shift = (len_k - len_q) if spec.alignment == "bottom_right" else torch.zeros_like(len_q)
        pos = torch.arange(width_q).view(1, width_q, 1) + shift.view(n, 1, 1)
        j = torch.arange(width_k).view(1, 1, width_k)
        left, right = spec.window
        if spec.causal:
            keep = keep & (j <= pos)
        if left >= 0:
            keep = keep & (j >= pos - left)
        if right >= 0:
            keep = keep & (j <= pos + right)
    s.masked_fill_(~keep.unsqueeze(1), float("-inf"))
    if need_lse:
        p = torch.softmax(s, dim=-1, dtype=blocked.stats_dtype(s.dtype))
        group_lse = s.amax(dim=-1).to(p.dtype) - torch.log(p.amax(dim=-1))       # (n, Hq, width_q)
        lse[:, rows_q[valid_q]] = group_lse.transpose(0, 1)[:, valid_q].to(lse.dtype)
    else:
        p = torch.softmax(s, dim=-1)
    o = torch.bmm(p.to(mm).view(n * hkv, group * width_q, width_k), vg)
    o = o.view(n, hkv, group, width_q, -1).permute(0, 3, 1, 2, 4).reshape(n, width_q, hq, -1)
    out[rows_q[valid_q]] = o[valid_q].to(out.dtype)
