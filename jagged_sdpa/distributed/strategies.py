"""Where tokens live: the placement strategies behind ``plan_shards``.

Each strategy maps document lengths to pieces ``(doc, start, end)`` per rank. It decides only
placement; the plan (``plan.py``) normalises pieces into runs and serves shard/unshard.
``auto`` tries placements that keep light documents whole (their keys never cross ranks) and cut
heavy ones into zigzag bundles (each balanced in tokens and causal work), plus a work-filled
layout of whole documents and plain zigzag, and keeps the balanced one that moves fewest keys.
"""

from __future__ import annotations

import math

import numpy as np

from jagged_sdpa.distributed.work import WorkTable

STRATEGIES = ("auto", "contiguous", "zigzag", "documents")
# auto's bounds on max/mean attention work (the issue asks <= 1.10) and on max/mean tokens (memory
# and the token-wise rest of the layer); within them it minimises the keys the busiest rank fetches.
AUTO_TARGET = 1.05
AUTO_TOKENS = 1.25
# Heavy-document thresholds auto tries, as fractions of one rank's fair share of the work: a
# document heavier than theta * share is cut into zigzag bundles of at most that work, spread over
# only as many ranks as that takes (so a rank reads the keys of a few documents, not of all:
# communication per rank stays flat as W grows). LPT bounds max/mean by about 1 + theta; plain
# zigzag is the last resort.
AUTO_THRESHOLDS = (float("inf"), 1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125)


def contiguous(lengths, world_size):
    """Equal slices of the packed stream (llama3-style): rank r owns rows [rN/W, (r+1)N/W)."""
    total = sum(lengths)
    bounds = [r * total // world_size for r in range(world_size + 1)]
    pieces = [[] for _ in range(world_size)]
    offset = 0
    for doc, n in enumerate(lengths):
        for r in range(world_size):
            s, e = max(bounds[r], offset), min(bounds[r + 1], offset + n)
            if s < e:
                pieces[r].append((doc, s - offset, e - offset))
        offset += n
    return pieces


def _zigzag_doc(doc, n, world_size, pieces):
    """Cut a document into 2W floor-split chunks; rank r takes chunks r and 2W-1-r."""
    cuts = [k * n // (2 * world_size) for k in range(2 * world_size + 1)]
    for r in range(world_size):
        for c in (r, 2 * world_size - 1 - r):
            if cuts[c] < cuts[c + 1]:
                pieces[r].append((doc, cuts[c], cuts[c + 1]))


def zigzag(lengths, world_size):
    pieces = [[] for _ in range(world_size)]
    for doc, n in enumerate(lengths):
        _zigzag_doc(doc, n, world_size, pieces)
    return pieces


def _bundles(doc, n, k):
    """A document as k zigzag bundles: 2k floor-split chunks, bundle j = chunks j and 2k-1-j, so
    every bundle has ~n/k tokens and ~1/k of the causal work."""
    cuts = [c * n // (2 * k) for c in range(2 * k + 1)]
    return [[(doc, cuts[c], cuts[c + 1]) for c in (j, 2 * k - 1 - j) if cuts[c] < cuts[c + 1]] for j in range(k)]


def _lpt(items, world_size):
    """Longest-processing-time on two loads: items ``(work, tokens, pieces)``, heaviest first, each
    onto the rank whose larger relative load (work or tokens, over its fair share) stays smallest.
    Work is what attention costs; tokens are what memory and the rest of the layer cost."""
    pieces = [[] for _ in range(world_size)]
    share_w = max(sum(it[0] for it in items) / world_size, 1)
    share_t = max(sum(it[1] for it in items) / world_size, 1)
    work = np.zeros(world_size)
    tokens = np.zeros(world_size)
    for w, t, parts in sorted(items, key=lambda it: (-it[0], -it[1], it[2])):
        after = np.maximum((work + w) / share_w, (tokens + t) / share_t)
        r = int(np.argmin(after + 1e-9 * work / share_w))
        pieces[r].extend(parts)
        work[r] += w
        tokens[r] += t
    return pieces


def documents(lengths, world_size, work: WorkTable):
    """Whole documents by LPT on work: no key crosses a rank, balance only as good as the sizes allow."""
    items = [(work.doc(d), n, [(d, 0, n)]) for d, n in enumerate(lengths) if n > 0]
    return _lpt(items, world_size)


def hybrid(lengths, world_size, work: WorkTable, theta: float):
    """Documents heavier than theta * (total work / W) become as few zigzag bundles as keep each
    under that bound (at most W); then LPT places bundles and whole documents."""
    bound = theta * work.total() / world_size
    items = []
    for doc, n in enumerate(lengths):
        if n == 0:
            continue
        w = work.doc(doc)
        if w <= bound or n == 1:
            items.append((w, n, [(doc, 0, n)]))
            continue
        k = min(world_size, n, max(2, math.ceil(w / bound)) if bound > 0 else world_size)
        for parts in _bundles(doc, n, k):
            items.append((sum(work.piece(*p) for p in parts), sum(e - s for _, s, e in parts), parts))
    return _lpt(items, world_size)


def imbalance(pieces, work: WorkTable) -> float:
    loads = [sum(work.piece(*p) for p in ps) for ps in pieces]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _loads(pieces, work: WorkTable):
    loads = [sum(work.piece(*p) for p in ps) for ps in pieces]
    tokens = [sum(e - s for _, s, e in ps) for ps in pieces]
    mean_w, mean_t = sum(loads) / len(loads), sum(tokens) / len(tokens)
    return (max(loads) / mean_w if mean_w else 1.0), (max(tokens) / mean_t if mean_t else 1.0)


def auto(lengths, world_size, work: WorkTable, fetched):
    """Among candidates within AUTO_TARGET work and AUTO_TOKENS tokens (max/mean), the one whose
    busiest rank fetches the fewest keys (``fetched(pieces)``); else the best balanced one."""
    candidates = [hybrid(lengths, world_size, work, t) for t in AUTO_THRESHOLDS]
    candidates += [filled(lengths, world_size, work), zigzag(lengths, world_size)]
    scored = []
    for i, pieces in enumerate(candidates):
        imb, tok = _loads(pieces, work)
        feasible = imb <= AUTO_TARGET and tok <= AUTO_TOKENS
        scored.append(((0, fetched(pieces), imb, i) if feasible else (1, tok > AUTO_TOKENS, imb, i), pieces))
    return min(scored, key=lambda x: x[0])[1]


def place(strategy, lengths, world_size, work: WorkTable, fetched=None):
    if strategy == "contiguous":
        return contiguous(lengths, world_size)
    if strategy == "zigzag":
        return zigzag(lengths, world_size)
    if strategy == "documents":
        return documents(lengths, world_size, work)
    return auto(lengths, world_size, work, fetched)


def filled(lengths, world_size, work: WorkTable):
    """Whole documents by two-load LPT, laid end to end rank after rank, then the boundaries moved
    so every rank gets the same work: at most one document is cut at each boundary, so a rank
    fetches at most one document prefix, whatever the world size."""
    order = [p for ps in documents(lengths, world_size, work) for p in sorted(ps, key=lambda p: -work.doc(p[0]))]
    if not order:
        return [[] for _ in range(world_size)]
    per_row = np.concatenate([np.diff(work.prefix(d)) for d, _, _ in order])
    prefix = np.concatenate([[0], np.cumsum(per_row)])
    targets = np.arange(world_size + 1) * (prefix[-1] / world_size)
    bounds = np.searchsorted(prefix, targets, side="left").tolist()
    bounds[-1] = len(per_row)
    starts = np.concatenate([[0], np.cumsum([e - s for _, s, e in order])])
    pieces = [[] for _ in range(world_size)]
    for r in range(world_size):
        lo, hi = bounds[r], bounds[r + 1]
        first = max(int(np.searchsorted(starts, lo, side="right")) - 1, 0)
        for i in range(first, len(order)):
            if starts[i] >= hi:
                break
            a, b = max(lo, starts[i]), min(hi, starts[i + 1])
            if a < b:
                pieces[r].append((order[i][0], int(a - starts[i]), int(b - starts[i])))
    return pieces
