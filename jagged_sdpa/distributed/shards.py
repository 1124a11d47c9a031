"""The shard plan: which rank owns which rows of a packed ragged batch.

A plan is frozen and host-side: a pure function of the lengths, the world size and the strategy,
identical on every rank and reused by every layer. Each rank owns runs ``(doc, start, end)`` of
consecutive rows of one document, in global order. Device index tensors are cached per device,
so shard/positions cost no host sync after the first call.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from jagged_sdpa.distributed import strategies
from jagged_sdpa.distributed.routes import fetched_rows
from jagged_sdpa.distributed.work import WorkTable


def _lengths_of(cu_seqlens) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype != torch.int32:
            raise TypeError(f"cu_seqlens: expected an int32 tensor, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens: expected a 1-D (B + 1,) tensor, got shape {tuple(cu_seqlens.shape)}")
        cu = [int(x) for x in cu_seqlens.tolist()]  # the plan's one host read
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens: must start at 0, starts at {cu[0]}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if any(n < 0 for n in lengths):
            raise ValueError("cu_seqlens: must be non-decreasing")
        return lengths
    if isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in cu_seqlens):
            raise TypeError("cu_seqlens: a list must hold the sequence lengths as ints")
        if any(n < 0 for n in cu_seqlens):
            raise ValueError(f"cu_seqlens: lengths must be >= 0, got {list(cu_seqlens)}")
        return [int(n) for n in cu_seqlens]
    raise TypeError(f"cu_seqlens: expected an int32 tensor or a list of lengths, got {type(cu_seqlens).__name__}")


def _normalise(pieces) -> tuple:
    """Sort a rank's pieces into global order and merge touching pieces of one document."""
    runs = []
    for doc, s, e in sorted(p for p in pieces if p[2] > p[1]):
        if runs and runs[-1][0] == doc and runs[-1][2] == s:
            runs[-1] = (doc, runs[-1][1], e)
        else:
            runs.append((doc, s, e))
    return tuple(runs)


@dataclass(frozen=True)
class ShardPlan:
    """Which rows each rank owns. ``runs[r]``: rank r's ``(doc, start, end)`` in local order."""

    lengths: tuple[int, ...]
    world_size: int
    strategy: str
    causal: bool
    window_size: tuple[int, int]
    runs: tuple[tuple[tuple[int, int, int], ...], ...]
    work: tuple[int, ...]
    digest: int
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    # ---- sizes
    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)]))

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(sum(e - s for _, s, e in rs) for rs in self.runs)

    @property
    def imbalance(self) -> float:
        """max / mean attention work over ranks (1.0 is perfect)."""
        mean = sum(self.work) / self.world_size
        return max(self.work) / mean if mean > 0 else 1.0

    @property
    def token_imbalance(self) -> float:
        mean = self.total / self.world_size
        return max(self.tokens) / mean if mean > 0 else 1.0

    # ---- host index arrays (cached)
    def rows(self, rank: int) -> np.ndarray:
        """int64 global row indices rank owns, in local order."""
        self._check_rank(rank)
        key = ("rows", rank)
        if key not in self._cache:
            cu = self.cu_seqlens
            parts = [np.arange(cu[d] + s, cu[d] + e, dtype=np.int64) for d, s, e in self.runs[rank]]
            self._cache[key] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._cache[key]

    def owners(self) -> tuple[np.ndarray, np.ndarray]:
        """(owner rank, local index) of every global row."""
        if "owners" not in self._cache:
            owner = np.empty(self.total, dtype=np.int64)
            local = np.empty(self.total, dtype=np.int64)
            for r in range(self.world_size):
                rows = self.rows(r)
                owner[rows] = r
                local[rows] = np.arange(rows.size)
            self._cache["owners"] = (owner, local)
        return self._cache["owners"]

    def device_tensor(self, key, make, device) -> torch.Tensor:
        """A cached device copy of the host array ``make()`` (one upload per plan and device)."""
        full = (key, str(torch.device(device)))
        if full not in self._cache:
            self._cache[full] = torch.as_tensor(make()).to(device)
        return self._cache[full]

    def _check_rank(self, rank):
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TypeError(f"rank: expected an int, got {type(rank).__name__}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: {rank} is not in [0, {self.world_size}) for this plan")

    # ---- public helpers
    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of a packed ``(total, ...)`` tensor that ``rank`` owns, in local order."""
        self._check_rank(rank)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[0] != self.total:
            raise ValueError(f"x: expected {self.total} rows (the plan's total tokens), got shape {tuple(x.shape)}")
        index = self.device_tensor(("rows", rank), lambda: self.rows(rank), x.device)
        return x.index_select(0, index)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """int64 (n_local,): each local row's position in its sequence (for rotary embeddings)."""
        self._check_rank(rank)

        def make():
            parts = [np.arange(s, e, dtype=np.int64) for _, s, e in self.runs[rank]]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self.device_tensor(("positions", rank), make, device or "cpu").clone()

    def unshard(self, x_local: torch.Tensor, group=None) -> torch.Tensor:
        """Collective: every rank's rows back in global order, on every rank (differentiable)."""
        from jagged_sdpa.distributed.gather import unshard
        return unshard(self, x_local, group)

    def __str__(self) -> str:
        lines = [f"ShardPlan: {len(self.lengths)} sequences, {self.total} tokens, world_size={self.world_size}, "
                 f"strategy={self.strategy}, work for causal={self.causal} window={self.window_size}",
                 "  rank   tokens         work  runs"]
        for r in range(self.world_size):
            lines.append(f"  {r:>4} {self.tokens[r]:>8} {self.work[r]:>12}  {len(self.runs[r])}")
        lines.append(f"  max/mean work {self.imbalance:.3f}, max/mean tokens {self.token_imbalance:.3f}")
        return "\n".join(lines)


def _validate_window(window_size):
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    if any(w < -1 for w in window_size):
        raise ValueError(f"window_size: entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    return (int(window_size[0]), int(window_size[1]))


def plan_shards(cu_seqlens, world_size: int, *, strategy: str = "auto", causal: bool = False,
                window_size=(-1, -1)) -> ShardPlan:
    """Plan which rows of a packed ragged batch each of ``world_size`` ranks owns.

    Args:
        cu_seqlens: int32 ``(B + 1,)`` tensor (read once on the host) or a list of B lengths.
        world_size: number of ranks.
        strategy: ``"contiguous"`` (equal slices of the packed stream), ``"zigzag"`` (each sequence
            in 2W chunks, rank r takes chunks r and 2W-1-r), ``"documents"`` (whole sequences,
            heaviest first onto the least-loaded rank) or ``"auto"`` (max/mean work <= 1.05 and
            tokens <= 1.25 where reachable, with the fewest keys fetched by the busiest rank: whole
            sequences where balance allows, zigzag bundles of heavy ones).
        causal, window_size: the mask whose attention work the plan balances. They only weigh
            work; a call with other options is still exact.

    Raises TypeError/ValueError naming the argument.
    """
    lengths = _lengths_of(cu_seqlens)
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
        raise TypeError(f"world_size: expected an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if strategy not in strategies.STRATEGIES:
        raise ValueError(f"strategy: expected one of {strategies.STRATEGIES}, got {strategy!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    window = _validate_window(window_size)
    world_size = int(world_size)
    table = WorkTable(lengths, causal, window)
    def fetched(pieces):   # keys the busiest rank would fetch for the plan's mask
        return max(fetched_rows(lengths, ps, causal, window) for ps in pieces)
    pieces = strategies.place(strategy, lengths, world_size, table, fetched)
    runs = tuple(_normalise(p) for p in pieces)
    work = tuple(sum(table.piece(*run) for run in rs) for rs in runs)
    digest_src = repr((tuple(lengths), world_size, runs)).encode()
    digest = int.from_bytes(hashlib.blake2b(digest_src, digest_size=8).digest(), "little") & (2**62 - 1)
    return ShardPlan(tuple(lengths), world_size, strategy, causal, window, runs, work, digest)
