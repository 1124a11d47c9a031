"""A ragged batch's metadata, validated once: ``Batch``, built here and nowhere else.

A model runs attention once per layer over the same batch, a server once per layer at every
decode step. What depends only on the batch's metadata (cu_seqlens or NJT offsets, seqused_k,
block_table, the max lengths) is worked out once: the host read and the content checks, the max
lengths, empty sequences, whether Lq == Lk. What depends on a layer's tensors (the packed lengths,
the cache's geometry) is checked by ``Batch.bind``, once per distinct geometry. An accelerator
call given every max length reads nothing: ``bind`` queues the same rules as device-side asserts
(``checks.device``), so no path hands unchecked offsets to a kernel.

``cached`` returns the Batch of earlier calls while their metadata tensors are the same objects
at the same version (torch's in-place counter), so ``varlen_attention``/``sdpa`` over one
``cu_seqlens``/offsets tensor (every layer of a model) validate it once, and an in-place change
made with a torch op in between is seen. Tensors made under ``torch.inference_mode`` carry no
version counter: on the CPU their contents are read again and compared (a memory read), on an
accelerator the batch is validated again. ``plan`` builds a Batch of its own over copies.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from jagged_sdpa import layout
from jagged_sdpa.checks import inputs
from jagged_sdpa.checks.device import DeviceChecks


class Names(NamedTuple):
    """How the caller spelled the metadata, for error messages."""

    cu_q: str
    cu_k: str
    max_q: str
    max_k: str


VARLEN_NAMES = Names("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
SDPA_NAMES = Names("query.offsets()", "key.offsets()", "query's cached max seqlen", "key's cached max seqlen")


@dataclass(eq=False)
class Batch:
    """The validated facts of one batch. Tensors are int32 on the call's device; ``*_host`` hold
    what was read on the host (None when nothing was: an accelerator call given its max lengths,
    or a trace)."""

    size: int
    cu_seqlens_q: Tensor
    cu_seqlens_k: Optional[Tensor]      # None when paged
    seqused_k: Optional[Tensor]
    block_table: Optional[Tensor]
    max_seqlen_q: int
    max_seqlen_k: int
    has_empty_q: bool                   # True when unknown
    has_empty_k: bool
    equal_lengths: bool                 # Lq == Lk for every sequence (known without a read, or read)
    names: Names
    cu_q_host: Optional[tuple] = None
    cu_k_host: Optional[tuple] = None
    seqused_host: Optional[tuple] = None
    table_host: Optional[list] = None   # paged: rows of block ids, read with the lengths
    kv_dense: bool = False              # sdpa's dense key/value: cu_seqlens_k is b * S
    prefix_lens: Optional[Tensor] = None  # int32 (B,), docs/api.md section 11; 0 <= P_b <= key length of b
    prefix_host: Optional[tuple] = None   # its values, read with the lengths
    # A dense cache (docs/api.md section 12): k/v (B, S, Hkv, D) read in place, carried as a paged cache of one
    # block of S slots per sequence (``block_table`` is made here: row b holds [b]), its keys
    # starting at slot ``cache_leftpad[b]`` (None: 0).
    dense_cache: bool = False
    cache_leftpad: Optional[Tensor] = None
    leftpad_host: Optional[tuple] = None
    _bound: set = field(default_factory=set, repr=False)
    plans: dict = field(default_factory=dict, repr=False)   # Options -> the Plan of calls over this batch
    # the operator's calls over this batch, by kind: (call, its backend's forward_runner) (ops._attention)
    runners: dict = field(default_factory=dict, repr=False)

    @property
    def lengths_known(self) -> bool:
        return self.cu_q_host is not None

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def prefix_matters(self) -> bool:
        """prefix_lens given and not known to be all zeros (a zero prefix changes nothing)."""
        return self.prefix_lens is not None and (self.prefix_host is None or any(self.prefix_host))

    def bind(self, total_q: int, k: Tensor) -> None:
        """Check the batch against a layer's packed q length and its k (packed keys, or the
        paged or dense cache): on the host when the lengths were read, else as device-side asserts.
        Once per geometry, except while a CUDA graph is captured: its replays must run the checks
        on what the metadata tensors hold then. Nothing while tracing (the operator checks when it
        runs)."""
        if torch.compiler.is_compiling():
            return
        geometry = (total_q, k.shape[0], k.shape[1] if self.paged else 0)
        if geometry in self._bound and (self.lengths_known or not capturing(k)):
            return
        if self.lengths_known:
            self._check_host(total_q, k)
        else:
            self._queue_device_checks(total_q, k)
        self._bound.add(geometry)

    def _check_host(self, total_q: int, k: Tensor) -> None:
        _check_end(self.names.cu_q, self.cu_q_host, total_q)
        if not self.paged:
            if not self.kv_dense:
                _check_end(self.names.cu_k, self.cu_k_host, k.shape[0])
            return
        num_blocks, block_size = k.shape[0], k.shape[1]
        if self.dense_cache:  # one block per sequence, made here: only the ranges to check
            if self.leftpad_host is None:
                layout.lengths_stats("seqused_k", self.seqused_host, [block_size] * self.size, None)
            else:
                inputs.validate_leftpad_values(self.leftpad_host, self.seqused_host, block_size)
            return
        width = self.block_table.shape[1]  # (prefix_lens were checked against seqused_k in ``build``)
        layout.lengths_stats("seqused_k", self.seqused_host, [width * block_size] * self.size, None)
        inputs.validate_block_ids(self.table_host, self.seqused_host, block_size, num_blocks)

    def _queue_device_checks(self, total_q: int, k: Tensor) -> None:
        names, checks = self.names, DeviceChecks()
        checks.add_cu(names.cu_q, self.cu_seqlens_q, total_q, self.max_seqlen_q, names.max_q)
        if self.dense_cache:
            S = k.shape[1]
            if self.cache_leftpad is None:
                checks.add_lengths("seqused_k", self.seqused_k, S, self.max_seqlen_k)
            else:  # 0 <= cache_leftpad[b] and seqused_k[b] <= S - cache_leftpad[b]
                checks.add_lengths("cache_leftpad", self.cache_leftpad, S, S)
                room = (S - self.cache_leftpad.to(torch.int64)).cumsum(0)
                checks.add_lengths("seqused_k", self.seqused_k, torch.cat([room.new_zeros(1), room]),
                                   self.max_seqlen_k)
        elif self.paged:
            block_size = k.shape[1]
            checks.add_lengths("seqused_k", self.seqused_k, self.block_table.shape[1] * block_size,
                               self.max_seqlen_k)
            checks.add_block_ids(self.block_table, self.seqused_k, block_size, k.shape[0])
        elif not self.kv_dense:
            max_cu_k = self.max_seqlen_k if self.seqused_k is None else k.shape[0]
            checks.add_cu(names.cu_k, self.cu_seqlens_k, k.shape[0], max_cu_k, names.max_k)
            if self.seqused_k is not None:
                checks.add_lengths("seqused_k", self.seqused_k, self.cu_seqlens_k, self.max_seqlen_k)
        if self.prefix_lens is not None:  # 0 <= P_b <= the key length of b, as ``build`` checks on the host
            if self.seqused_k is not None:
                used = self.seqused_k.to(torch.int64).cumsum(0)  # int64: no wrap; both check forms take it
                capacity = torch.cat([used.new_zeros(1), used])
            else:
                capacity = self.max_seqlen_k if self.kv_dense else self.cu_seqlens_k
            checks.add_lengths("prefix_lens", self.prefix_lens, capacity, self.max_seqlen_k)
        checks.queue()


def capturing(t: Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``t``'s (CUDA) device: its
    kernels run only on replay, over what the metadata tensors hold then."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_end(name: str, host: tuple, total: int) -> None:
    if host[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {host[-1]}")


def build(cu_q: Tensor, cu_k: Optional[Tensor], max_q: Optional[int], max_k: Optional[int], *,
          block_table: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None, read: bool,
          names: Names = VARLEN_NAMES, kv_dense: bool = False, host: Optional[list] = None,
          prefix_lens: Optional[Tensor] = None, copy: bool = False, cache_leftpad: Optional[Tensor] = None
          ) -> Batch:
    """Validate a batch's metadata (``read``: on the host now; else its checks wait for ``bind``).
    ``host``: what the caller read of the same tensors already (``layout.read_host``'s lists).

    Raises the ValueError of the first bad content, naming the argument as ``names`` spells it.
    Without a read, ``max_q``/``max_k`` must be given (they bound every length). ``kv_dense``:
    sdpa's dense key/value of length ``max_k`` shared by every sequence (``cu_k`` is made here).
    Neither ``cu_k`` nor ``block_table`` (and not ``kv_dense``): a dense cache (docs/api.md section 12), its
    one-block-per-sequence table made here; ``cache_leftpad`` read with the lengths.
    ``prefix_lens`` (docs/api.md section 11): read with the lengths, each within its sequence's key length.
    ``copy``: the batch keeps (and the kernels read) copies of the metadata, taken before it is
    validated: a batch found again for tensors changed without a torch op (through ``.numpy()``,
    say, which bumps no version) still holds exactly what was validated."""
    if names is VARLEN_NAMES:
        inputs.validate_varlen_metadata(cu_q, cu_k, block_table, seqused_k, cache_leftpad)
    dense_cache = block_table is None and cu_k is None and not kv_dense
    paged = block_table is not None or dense_cache
    size = cu_q.shape[0] - 1
    inputs.validate_prefix_lens(prefix_lens, size, cu_q.device)
    # int32 for the kernels (NJT offsets are int64: one cast, which is the copy too), shared by q and
    # k when they share; with ``copy``, everything copied once before it is read.
    shared = cu_k is cu_q
    cu_q = cu_q.to(torch.int32, copy=copy)
    cu_k = cu_q if shared else None if cu_k is None else cu_k.to(torch.int32, copy=copy)
    if copy:
        block_table, seqused_k, prefix_lens, cache_leftpad = (
            None if t is None else t.clone() for t in (block_table, seqused_k, prefix_lens, cache_leftpad))
    if dense_cache:
        block_table = _dense_table(size, cu_q.device)
    if kv_dense:
        cu_k = torch.arange(size + 1, device=cu_q.device, dtype=torch.int32) * max_k
    if not read:
        empty_k = max_k == 0 and size > 0 if kv_dense else True
        return Batch(size, cu_q, cu_k, seqused_k, block_table, max_q, max_k, True, empty_k,
                     cu_k is cu_q and seqused_k is None, names, kv_dense=kv_dense, prefix_lens=prefix_lens,
                     dense_cache=dense_cache, cache_leftpad=cache_leftpad)
    to_read = [cu_q] + ([seqused_k] if dense_cache else [block_table, seqused_k] if paged else
                        [] if kv_dense else [cu_k] + ([seqused_k] if seqused_k is not None else []))
    extra = [t for t in (prefix_lens, cache_leftpad) if t is not None]
    host = layout.read_host(*to_read, *extra) if host is None else host + (layout.read_host(*extra) if extra else [])
    prefix_host = None if prefix_lens is None else tuple(host[len(to_read)])
    leftpad_host = None if cache_leftpad is None else tuple(host[-1])
    stats_q = layout.seqlen_stats(names.cu_q, host[0], None, max_q, names.max_q)
    table_host = used = None
    if paged:
        used = tuple(host[1 if dense_cache else 2])
        stats_k = layout.lengths_stats("seqused_k", used, None, max_k)
        width = block_table.shape[1]
        table_host = [[b] for b in range(size)] if dense_cache else \
            [host[1][b * width:(b + 1) * width] for b in range(size)]
        cu_k_host = None
    elif kv_dense:
        stats_k = layout.SeqlenStats(tuple(b * max_k for b in range(size + 1)), max_k, max_k == 0 and size > 0)
        cu_k_host = stats_k.cu_host
    else:
        if host[1] is host[0] and seqused_k is None and max_k == max_q:
            stats_k = stats_q  # self-attention: the same tensor, read once, validated once
        else:
            stats_k = layout.seqlen_stats(names.cu_k, host[1], None, None if seqused_k is not None else max_k,
                                          names.max_k)
        cu_k_host = stats_k.cu_host
        if seqused_k is not None:
            used = tuple(host[2])
            stats_k = layout.lengths_stats("seqused_k", used, layout.host_lengths(cu_k_host), max_k)
    equal = (cu_k is cu_q and seqused_k is None) or (
        not paged and seqused_k is None and tuple(stats_q.cu_host) == tuple(cu_k_host))
    if prefix_host is not None:
        inputs.validate_prefix_values(prefix_host, used if used is not None else layout.host_lengths(cu_k_host))
    return Batch(size, cu_q, cu_k, seqused_k, block_table, stats_q.max_seqlen, stats_k.max_seqlen,
                 stats_q.has_empty, stats_k.has_empty, equal, names, stats_q.cu_host, cu_k_host, used, table_host,
                 kv_dense, prefix_lens, prefix_host, dense_cache, cache_leftpad, leftpad_host)


@functools.lru_cache(maxsize=16)
def _dense_table(size: int, device: torch.device) -> Tensor:
    """A dense cache's block table (row b holds [b]): read, never written, so one per B and device
    (``build`` and ``from_ranges`` both take it)."""
    return torch.arange(size, device=device, dtype=torch.int32).view(size, 1)


def from_ranges(cu_seqlens_q: Tensor, queries_per_row: int, seqused_k: Tensor, cache_leftpad: Optional[Tensor],
                used_host, leftpad_host) -> Batch:
    """The Batch of a dense cache (docs/api.md section 12) whose key ranges were derived on the host
    from a validity mask of width S: row b's keys are slots [cache_leftpad[b], cache_leftpad[b] +
    seqused_k[b]), every row has ``queries_per_row`` queries (``cu_seqlens_q`` = b * that). Such
    ranges are valid by construction, so nothing is read or re-checked here; ``bind`` still checks
    them against the cache a layer passes (its S). What the transformers mask hook builds, once per
    forward, where ``build`` would check again what the hook just computed."""
    size = cu_seqlens_q.shape[0] - 1
    used = tuple(int(n) for n in used_host)
    leftpad = None if leftpad_host is None else tuple(int(p) for p in leftpad_host)
    cu_q_host = tuple(range(0, (size + 1) * queries_per_row, max(queries_per_row, 1)))[:size + 1]
    return Batch(size, cu_seqlens_q, None, seqused_k, _dense_table(size, cu_seqlens_q.device), queries_per_row,
                 max(used, default=0), queries_per_row == 0 and size > 0, not all(used), False, VARLEN_NAMES,
                 cu_q_host, None, used, [[b] for b in range(size)], dense_cache=True, cache_leftpad=cache_leftpad,
                 leftpad_host=leftpad)


# ----------------------------------------------------------------------------------------------
# reuse across calls over the same metadata tensors

_CACHE: dict = {}
_CACHE_SIZE = 64


def _versions(tensors: tuple) -> Optional[tuple]:
    """The tensors' in-place versions, or None when one has no counter (an inference tensor)."""
    try:
        return tuple(t._version for t in tensors)
    except (RuntimeError, AttributeError):  # AttributeError: not a tensor (``build`` says so)
        return None


def cached(cu_q: Tensor, cu_k: Optional[Tensor], max_q: Optional[int], max_k: Optional[int], *,
           block_table: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None, read: bool,
           names: Names = VARLEN_NAMES, kv_dense: bool = False, prefix_lens: Optional[Tensor] = None,
           cache_leftpad: Optional[Tensor] = None) -> Batch:
    """``build``, or the Batch an earlier call built over the very same, unchanged tensors.

    A batch read on the host keeps copies of what it validated (the kernels read those). One that
    reads nothing (an accelerator call given its max lengths) keeps the caller's tensors: its
    checks run on the device against them, and a CUDA graph captured over the call reads what the
    caller writes into them before each replay."""
    tensors = tuple(t for t in (cu_q, cu_k, block_table, seqused_k, prefix_lens, cache_leftpad) if t is not None)
    key = (tuple(map(id, tensors)), max_q, max_k, read, names, kv_dense, block_table is not None,
           seqused_k is not None, prefix_lens is not None, cache_leftpad is not None)
    versions = _versions(tensors)
    hit = _CACHE.get(key)
    if hit is not None:
        refs, seen, batch = hit
        if all(r() is t for r, t in zip(refs, tensors)):
            if versions is not None and versions == seen:
                return batch
            if versions is None and read and _same_contents(batch, tensors):
                return batch
    batch = build(cu_q, cu_k, max_q, max_k, block_table=block_table, seqused_k=seqused_k, read=read, names=names,
                  kv_dense=kv_dense, prefix_lens=prefix_lens, copy=read, cache_leftpad=cache_leftpad)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (tuple(weakref.ref(t) for t in tensors), versions, batch)
    return batch


def _same_contents(batch: Batch, tensors: tuple) -> bool:
    """Whether tensors without a version counter still hold what ``batch`` read from them."""
    now = layout.read_host(*tensors)
    held = [batch.cu_q_host]
    if batch.dense_cache:
        held.append(batch.seqused_host)
    elif batch.paged:
        held += [[x for row in batch.table_host for x in row], batch.seqused_host]
    elif not batch.kv_dense:  # a dense key/value's cu_seqlens_k is made, not passed
        held.append(batch.cu_k_host)
        if batch.seqused_k is not None:
            held.append(batch.seqused_host)
    if batch.prefix_lens is not None:
        held.append(batch.prefix_host)
    if batch.cache_leftpad is not None:
        held.append(batch.leftpad_host)
    return all(tuple(a) == tuple(b) for a, b in zip(now, held))


def clear_cache() -> None:
    """Forget every cached Batch (tests)."""
    _CACHE.clear()
