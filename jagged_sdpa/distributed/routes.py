"""Which keys each run of queries reads, where they live, and how the per-rank call stays exact.

A rank's run ``[s, e)`` of a document of length L reads keys ``[ks, ke)``: with a left window
``ks = max(0, s - left)``; causal ``ke = e``; else ``ke = min(L, e + right)`` (L unbounded).
The kernels align bottom-right, so row i sits at ``i - ks + (ke - e)``: true position plus the
shift ``delta = ke - e``. Causal runs have delta = 0 (exact). Otherwise a window ``(l, r)`` becomes
``(l + delta, r - delta)``, exact for masks, one call per distinct delta. ALiBi distances would
be off by delta: such runs need a per-sequence position offset the kernels do not take (refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def key_ranges(plan, rank, causal, window):
    """Per run of ``rank``: (doc, s, e, ks, ke) as int64 arrays."""
    left, right = window
    runs = plan.runs[rank]
    doc = np.array([d for d, _, _ in runs], dtype=np.int64)
    s = np.array([a for _, a, _ in runs], dtype=np.int64)
    e = np.array([b for _, _, b in runs], dtype=np.int64)
    length = np.array(plan.lengths, dtype=np.int64)[doc] if runs else np.zeros(0, dtype=np.int64)
    ks = np.zeros_like(s) if left < 0 else np.maximum(0, s - left)
    if causal:
        ke = e.copy()
    else:
        ke = length.copy() if right < 0 else np.minimum(length, e + right)
    return doc, s, e, ks, ke


def needs_offset(plan, causal, window) -> bool:
    """Whether some run is shifted (delta != 0) in a way the result can observe with ALiBi."""
    if causal:
        return False
    return any(np.any(ke != e) for _, _, e, _, ke in (key_ranges(plan, r, causal, window)
                                                      for r in range(plan.world_size)))


def _key_rows(plan, rank, causal, window) -> np.ndarray:
    doc, _, _, ks, ke = key_ranges(plan, rank, causal, window)
    cu = np.array(plan.cu_seqlens, dtype=np.int64)
    parts = [np.arange(cu[d] + a, cu[d] + b, dtype=np.int64) for d, a, b in zip(doc, ks, ke)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def needed_remote(plan, rank, causal, window) -> np.ndarray:
    """Sorted global rows that ``rank``'s runs read and another rank owns (cached on the plan)."""
    key = ("needed", rank, causal, window)
    if key not in plan._cache:
        owner, _ = plan.owners()
        rows = np.unique(_key_rows(plan, rank, causal, window))
        plan._cache[key] = rows[owner[rows] != rank]
    return plan._cache[key]


def remote_rows(plan, rank, causal, window) -> int:
    """How many rows ``rank`` fetches, by interval arithmetic (no per-row arrays: for big models)."""
    return fetched_rows(plan.lengths, plan.runs[rank], causal, window)


def fetched_rows(lengths, runs, causal, window) -> int:
    """Rows that the runs ``(doc, s, e)`` of one rank read and do not own (they may be unsorted)."""
    left, right = window
    per_doc, owned = {}, {}
    for d, s, e in runs:
        ks = 0 if left < 0 else max(0, s - left)
        ke = e if causal else (lengths[d] if right < 0 else min(lengths[d], e + right))
        per_doc.setdefault(d, []).append((ks, ke))
        owned.setdefault(d, []).append((s, e))
    total = 0
    for d, spans in per_doc.items():
        merged = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in merged:
            total += b - a - sum(max(0, min(b, e) - max(a, s)) for s, e in owned.get(d, ()))
    return total


@dataclass
class Group:
    """Runs sharing one shift: one kernel call."""

    shift: int
    window: tuple[int, int]
    q_rows: np.ndarray        # local query rows, in call order
    q_lens: list
    k_lens: list
    key_offset: int           # slice of the gathered keys this call reads
    n_keys: int
    docs: np.ndarray          # document of each run (for per-sequence ALiBi slopes)


class Route:
    """Everything rank ``rank`` needs to fetch its keys and make its calls exact."""

    def __init__(self, plan, rank, causal, window):
        self.plan, self.rank, self.causal, self.window = plan, rank, causal, window
        owner, local = plan.owners()
        W = plan.world_size
        n_local = plan.tokens[rank]
        mine = needed_remote(plan, rank, causal, window)
        by_src = [mine[owner[mine] == s] for s in range(W)]
        self.recv_rows = [int(x.size) for x in by_src]
        sends = []
        for d in range(W):
            theirs = needed_remote(plan, d, causal, window) if d != rank else np.zeros(0, dtype=np.int64)
            sends.append(local[theirs[owner[theirs] == rank]])
        self.send_rows = [int(x.size) for x in sends]
        self._send_index = np.concatenate(sends) if sends else np.zeros(0, dtype=np.int64)

        # buffer position of every global row this rank can read
        position = np.full(plan.total, -1, dtype=np.int64)
        position[plan.rows(rank)] = np.arange(n_local)
        offset = n_local
        for rows in by_src:
            position[rows] = offset + np.arange(rows.size)
            offset += rows.size

        doc, s, e, ks, ke = key_ranges(plan, rank, causal, window)
        left, right = window
        ignore_shift = not causal and window == (-1, -1)
        shift = np.zeros_like(s) if ignore_shift else ke - e
        run_start = np.concatenate([[0], np.cumsum(e - s)])
        cu = np.array(plan.cu_seqlens, dtype=np.int64)
        self.groups, key_parts, key_offset = [], [], 0
        for delta in sorted(set(shift.tolist())):
            ids = np.nonzero(shift == delta)[0]
            q_rows = [np.arange(run_start[i], run_start[i + 1]) for i in ids]
            keys = [position[np.arange(cu[doc[i]] + ks[i], cu[doc[i]] + ke[i])] for i in ids]
            n_keys = int(sum(k.size for k in keys))
            win = (left + delta if left >= 0 else -1, right - delta if right >= 0 else -1)
            self.groups.append(Group(int(delta), win, np.concatenate(q_rows),
                                     (e - s)[ids].tolist(), (ke - ks)[ids].tolist(),
                                     key_offset, n_keys, doc[ids]))
            key_parts.extend(keys)
            key_offset += n_keys
        self._key_index = np.concatenate(key_parts) if key_parts else np.zeros(0, dtype=np.int64)
        assert not (self._key_index < 0).any(), "a run reads a key no rank sends"

    def tensor(self, name, make, device):
        """A cached device tensor of this route (``make()`` runs once per device)."""
        return self.plan.device_tensor(("route", self.rank, self.causal, self.window, name), make, device)

    def send_index(self, device):
        return self.tensor("send", lambda: self._send_index, device)

    def key_index(self, device):
        return self.tensor("keys", lambda: self._key_index, device)


def route(plan, rank, causal, window) -> Route:
    key = ("route", rank, causal, window)
    if key not in plan._cache:
        plan._cache[key] = Route(plan, rank, causal, window)
    return plan._cache[key]
