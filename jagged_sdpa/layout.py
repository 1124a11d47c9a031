"""Every reshape, view and copy between NJT, dense and packed ``thd`` buffers, and the host read.

``read_host`` is the one function that reads offsets/cu_seqlens/seqused_k/block_table on the host:
one transfer per call, none on an accelerator when the caller passes (or the NJT caches) the max
lengths. ``seqlen_stats``/``lengths_stats`` validate what it read. This module decides no eligibility.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

try:  # the NJT class: private, used only for cheap type and size reads, with public fallbacks
    from torch.nested._internal.nested_tensor import NestedTensor as NJT_CLASS
except ImportError:  # pragma: no cover - a torch without it takes the public paths
    NJT_CLASS = None


@dataclass(frozen=True)
class SeqlenStats:
    """Per-sequence lengths read on the host, or only what is known without reading them."""

    cu_host: Optional[tuple[int, ...]]  # None when no host read happened
    max_seqlen: int
    has_empty: bool                     # True when unknown (conservative)


def host_read_needed(device: torch.device, *given_max: Optional[int]) -> bool:
    """Read lengths on the host unless the device is an accelerator and every max is given.

    On the CPU reading is not a device sync (microseconds), so it is always done and contents are
    always validated. On an accelerator with every max_seqlen given no read happens, so a step can
    be captured in a CUDA graph (see README, "Host syncs").
    """
    return device.type == "cpu" or any(m is None for m in given_max)


def read_host(*tensors: Tensor) -> list[list[int]]:
    """The only device-to-host read of lengths in the package: one transfer for all ``tensors``.

    A tensor passed twice (self-attention: the same cu_seqlens for q and k) is read once and its
    list returned for both. CPU tensors are read one by one (no transfer to batch; a ``cat``
    would cost more than the reads). Tests count calls to it to prove that a call makes at most
    one read, or none. Meta tensors hold no lengths to read: a ValueError says what to pass.
    """
    try:
        return _read(tensors)
    except NotImplementedError:  # checked here, off the per-call path: what a meta tensor raises
        if not any(t.device.type == "meta" for t in tensors):
            raise
        raise ValueError("meta tensors hold no lengths to read: pass max_seqlen_q/max_seqlen_k (or NJTs with a "
                         "cached max seqlen) to describe a call with explain()") from None


def _flat_list(t: Tensor) -> list[int]:
    return t.tolist() if t.dim() == 1 else t.reshape(-1).tolist()


def _read(tensors: tuple[Tensor, ...]) -> list[list[int]]:
    if len(tensors) == 1:
        return [_flat_list(tensors[0])]
    unique = []
    for t in tensors:
        if not any(t is u for u in unique):
            unique.append(t)
    if not unique:
        return []
    if unique[0].device.type == "cpu" or len(unique) == 1:
        lists = [_flat_list(t) for t in unique]
    else:
        flat = torch.cat([t.reshape(-1).to(torch.int64) for t in unique]).tolist()
        lists, at = [], 0
        for t in unique:
            lists.append(flat[at:at + t.numel()])
            at += t.numel()
    if len(unique) == len(tensors):
        return lists
    return [lists[next(i for i, u in enumerate(unique) if u is t)] for t in tensors]


def host_lengths(cu: list[int]) -> list[int]:
    """Sequence lengths from host-read cumulative offsets."""
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def seqlen_stats(name: str, host: Optional[list[int]], total: Optional[int], given_max: Optional[int],
                 max_name: str = "max_seqlen") -> SeqlenStats:
    """Validate host-read cumulative lengths and return their max and whether any is empty.

    ``host`` comes from ``read_host`` (None when no read happened: ``given_max`` is then taken as
    the max, emptiness is assumed possible, and ``checks.device`` queues the same checks). Contents must start at 0, never decrease and end at
    ``total`` (unless None: ``batch.Batch.bind`` checks it against the layer's tensors), and ``given_max`` may not be smaller than the real longest sequence: ValueError
    otherwise (naming ``max_name``, the argument the caller gave it as), because a kernel must
    never see such offsets.
    """
    if host is None:
        return SeqlenStats(None, given_max, True)
    if host[0] != 0:
        raise ValueError(f"{name} must start at 0, got {host[0]}")
    lengths = host_lengths(host)
    if any(n < 0 for n in lengths):
        bad = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(
            f"{name} must be non-decreasing, but entry {bad + 1} ({host[bad + 1]}) < entry {bad} ({host[bad]})"
        )
    if total is not None and host[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {host[-1]}")
    real_max = max(lengths, default=0)
    if given_max is not None and given_max < real_max:
        raise ValueError(f"{max_name} is {given_max}, smaller than the longest sequence in {name} ({real_max})")
    return SeqlenStats(tuple(host), real_max if given_max is None else int(given_max), any(n == 0 for n in lengths))


def lengths_stats(name: str, host: Optional[list[int]], capacity: Optional[list[int]],
                  given_max: Optional[int]) -> SeqlenStats:
    """Like ``seqlen_stats`` for per-sequence lengths (``seqused_k``), each at most ``capacity[b]``
    (unless None: a paged cache's capacity is checked when its geometry is known).

    ``cu_host`` of the result holds the cumulative sums of the lengths.
    """
    if host is None:
        return SeqlenStats(None, given_max, True)
    for b, n in enumerate(host):
        if n < 0:
            raise ValueError(f"{name}[{b}] must be >= 0, got {n}")
        if capacity is not None and n > capacity[b]:
            raise ValueError(f"{name}[{b}] = {n} exceeds that sequence's capacity {capacity[b]}")
    real_max = max(host, default=0)
    if given_max is not None and given_max < real_max:
        raise ValueError(f"max_seqlen_k is {given_max}, smaller than the longest sequence in {name} ({real_max})")
    cu = [0]
    for n in host:
        cu.append(cu[-1] + n)
    return SeqlenStats(tuple(cu), real_max if given_max is None else int(given_max), any(n == 0 for n in host))


# ----------------------------------------------------------------------------------------------
# NJT <-> packed


def tensor_size(x: Tensor) -> tuple:
    """``tuple(x.shape)``, cheaply for NJTs: their ``.shape`` dispatches to Python (~4 us a read),
    while the sizes it is made of are stored on the object (ragged dim: its nested int). Under
    torch.compile the public ``.shape`` (Dynamo cannot always wrap the stored nested int)."""
    if type(x) is NJT_CLASS and not torch.compiler.is_compiling():
        size = getattr(x, "_size", None)
        if type(size) is tuple:
            return size
    return tuple(x.shape)


def njt_cached_max_seqlen(njt: Tensor) -> Optional[int]:
    """The max seqlen an NJT already knows (a private attribute read in this one place), or None."""
    value = getattr(njt, "_maybe_max_seqlen", None)
    return value if value is None or isinstance(value, torch.SymInt) else int(value)


def njt_offsets(njt: Tensor) -> Tensor:
    return njt.offsets()


def njt_packed(njt: Tensor, holes_host: Optional[tuple[list[int], list[int]]] = None) -> tuple[Tensor, bool]:
    """The packed (total, H, D) buffer of a (B, H, j, D) NJT and whether it was copied.

    A view whenever the NJT has no holes: ``njt.transpose(1, 2).values()`` is a view of the
    buffer (contiguous for ordinary NJTs, strided for chunks of a fused qkv projection). When no
    gradient is needed the underlying buffer is read directly, which skips ~90 us of NJT dispatch.
    NJTs with holes (``lengths()``) are gathered into a new buffer using the host-read
    ``holes_host = (offsets, lengths)``.
    """
    if njt.lengths() is not None:
        offsets, lengths = holes_host
        values = njt.transpose(1, 2).values()
        parts = [values[o:o + n] for o, n in zip(offsets, lengths)]
        return (torch.cat(parts) if parts else values[:0]), True
    if njt.requires_grad and torch.is_grad_enabled():
        return njt.transpose(1, 2).values(), False
    return njt._values.transpose(0, 1), False


def njt_cu_seqlens(njt: Tensor, holes_cu: Optional[tuple[int, ...]] = None) -> Tensor:
    """int32 cumulative lengths of an NJT (no sync: a device-side cast of its offsets)."""
    if njt.lengths() is not None:
        return torch.tensor(holes_cu, dtype=torch.int32, device=njt.device)
    return njt.offsets().to(torch.int32)


def dense_kv_packed(x: Tensor) -> Tensor:
    """Dense (B, H, S, D) key/value -> packed (B*S, H, D); a copy unless H == 1 or already bshd."""
    return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], x.shape[3])


def packed_to_njt(out: Tensor, like: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """Wrap packed (total, H, Dv) as a (B, H, j, Dv) NJT that shares ``like``'s offsets.

    Without autograd the NJT is constructed directly (~15 us) when ``direct_njt_works()``; the
    public ``nested_tensor_from_jagged(...).transpose(1, 2)`` costs ~110 us (two NJT dispatches)
    and is what ``torch.compile`` traces (compiled, it costs nothing per call).
    A result that needs a gradient takes the public path: only its view op records the backward.
    """
    if like.lengths() is not None:
        return _njt_with_holes_like(out, like, cu_seqlens, max_seqlen)
    offsets = like.offsets()
    min_seqlen = getattr(like, "_maybe_min_seqlen", None)
    if not out.requires_grad and not torch.compiler.is_compiling() and direct_njt_works():
        return _direct_njt(out, offsets, min_seqlen, max_seqlen)
    return _public_njt(out, offsets, min_seqlen, max_seqlen)


def _njt_with_holes_like(out: Tensor, like: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """An NJT with ``like``'s own offsets and lengths (holes included), as dense SDPA's output
    shares its query's structure: packed row r of sequence b goes back to ``offsets[b] + r -
    cu_seqlens[b]``; the holes hold zeros. Computed on the device (no sync), differentiable."""
    offsets, lengths = like.offsets(), like.lengths()
    n_values = like.transpose(1, 2).values().shape[0]
    shift = torch.repeat_interleave((offsets[:-1] - cu_seqlens[:-1]).to(torch.int64), lengths.to(torch.int64),
                                    output_size=out.shape[0])
    dest = torch.arange(out.shape[0], device=out.device) + shift
    values = out.new_zeros((n_values,) + tuple(out.shape[1:])).index_copy(0, dest, out)
    njt = _from_jagged(values, offsets=offsets, lengths=lengths, max_seqlen=max_seqlen)
    return njt.transpose(1, 2)


def _public_njt(out: Tensor, offsets: Tensor, min_seqlen: Optional[int], max_seqlen: Optional[int]) -> Tensor:
    njt = _from_jagged(out, offsets=offsets, min_seqlen=min_seqlen, max_seqlen=max_seqlen)
    return njt.transpose(1, 2)


class _FxTracingNote(logging.Filter):
    """Drops torch's "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"
    log line, which ``nested_tensor_from_jagged`` provokes (it asks ``is_fx_tracing()``) and which
    says nothing about the caller's code."""

    dropped = False

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("is_fx_tracing will return true"):
            self.dropped = True
            return False
        return True


def _from_jagged(values: Tensor, **kwargs) -> Tensor:
    """``torch.nested.nested_tensor_from_jagged`` without torch's is_fx_tracing log line: our
    calls (the first ``sdpa`` call's check of the direct path, outputs that need a gradient) do
    not print it. torch logs it once per process; if ours was the first, the once-only state is
    reset, so a user's own call still gets it. Traced (``torch.compile``): the plain call."""
    if torch.compiler.is_compiling():
        return torch.nested.nested_tensor_from_jagged(values, **kwargs)
    logger, note = logging.getLogger("torch.fx._symbolic_trace"), _FxTracingNote()
    logger.addFilter(note)
    try:
        return torch.nested.nested_tensor_from_jagged(values, **kwargs)
    finally:
        logger.removeFilter(note)
        once = getattr(torch.fx._symbolic_trace, "is_fx_tracing_warning", None) if note.dropped else None
        if hasattr(once, "cache_clear"):
            once.cache_clear()


def _seqlen_tensor(value: int) -> Tensor:
    # How NJTs store a cached min/max seqlen: the size of an empty (value, 0) tensor.
    return torch.empty(value, 0)


def _constructed_njt(values: Tensor, offsets: Tensor, min_seqlen: Optional[int], max_seqlen: Optional[int]) -> Tensor:
    """The NJT over ``values`` (H, total, Dv) by the private constructor (~15 us: it looks up the
    offsets' nested int, multiplies symbolic strides, marks dynamic dims)."""
    cache = {}
    if min_seqlen is not None:
        cache["min_seqlen"] = _seqlen_tensor(min_seqlen)
    if max_seqlen is not None:
        cache["max_seqlen"] = _seqlen_tensor(max_seqlen)
    return NJT_CLASS(values, offsets, _ragged_idx=2, _metadata_cache=cache)


# Outputs of one layout (offsets, shape, strides, dtype, device, cached seqlens) -> what the
# constructor made of the first one (sizes, strides, attributes; not its values): later outputs of
# the layout are made like it (every layer of a model returns the same layout).
_RECIPES: dict = {}


class _Recipe:
    """Its attributes hold the layout's offsets: alive while it is, so their id stays theirs."""

    __slots__ = ("size", "strides", "attributes", "values_attributes")

    def __init__(self, njt: Tensor):
        self.size, self.strides = njt._size, njt._strides
        self.attributes = {k: v for k, v in njt.__dict__.items() if k != "_values"}
        self.values_attributes = dict(njt._values.__dict__)


@functools.cache
def _njt_dispatch_keys():
    return torch._C.DispatchKeySet(torch._C.DispatchKey.NestedTensor).add(torch._C.DispatchKey.AutogradNestedTensor)


def _direct_njt(out: Tensor, offsets: Tensor, min_seqlen: Optional[int], max_seqlen: Optional[int]) -> Tensor:
    values = out.transpose(0, 1)
    key = (id(offsets), values.shape, values.stride(), values.dtype, values.device, min_seqlen, max_seqlen)
    recipe = _RECIPES.get(key)
    if recipe is None:
        if len(_RECIPES) >= 64:
            _RECIPES.clear()
        njt = _constructed_njt(values, offsets, min_seqlen, max_seqlen)
        _RECIPES[key] = _Recipe(njt)
        return njt
    return _made_like(recipe, values)


def _copied(value):
    return value.copy() if isinstance(value, (dict, set)) else value


def _made_like(recipe: _Recipe, values: Tensor) -> Tensor:
    """An NJT over ``values`` as the constructor made the recipe's: the wrapper made with the same
    arguments, the attributes copied (containers copied: a lazily filled metadata cache stays its
    own). ``direct_njt_works`` compares the result with the public constructor's once per process."""
    njt = torch.Tensor._make_wrapper_subclass(
        NJT_CLASS, recipe.size, recipe.strides, 0, torch.contiguous_format, values.dtype, torch.jagged,
        values.device, False, False, "sizes", False, True, _njt_dispatch_keys(),
        storage_size=values.untyped_storage().size())
    for name, value in recipe.attributes.items():
        njt.__dict__[name] = _copied(value)
    njt._values = values
    for name, value in recipe.values_attributes.items():
        values.__dict__[name] = _copied(value)
    return njt


def njt_description(njt: Tensor) -> tuple:
    """What makes two (B, H, j, D) NJTs the same object to a user: sizes (nested int included),
    strides, offsets object, values view and cached min/max seqlen."""
    values = njt._values
    return (type(njt), njt._size, njt._strides, njt._ragged_idx, njt.dtype, njt.device, njt.requires_grad,
            id(njt.offsets()), njt.lengths() is None, values.data_ptr(), tuple(values.shape), values.stride(),
            values.storage_offset(), njt._maybe_min_seqlen, njt._maybe_max_seqlen)


@functools.cache
def direct_njt_works() -> bool:
    """Whether the private NJT constructor builds exactly what the public path builds (checked
    once per process on a small NJT; False sends every call to the public path)."""
    if NJT_CLASS is None:
        return False
    try:
        offsets = torch.tensor([0, 2, 5])
        with torch._C.DisableTorchFunctionSubclass():
            _direct_njt(torch.zeros(5, 2, 3), offsets, 2, 3)    # the layout's first output: constructed
            out = torch.randn(5, 2, 3)
            direct = _direct_njt(out, offsets, 2, 3)             # later ones: like it
            public = _public_njt(out, offsets, 2, 3)
            same = njt_description(direct) == njt_description(public)
            same = same and _attributes(direct) == _attributes(public)
            same = same and _attributes(direct._values) == _attributes(public._values)
            same = same and torch.equal(direct.values(), public.values())
        return same and direct.shape == public.shape and direct.is_contiguous() == public.is_contiguous()
    except Exception:  # any change in the private API: take the public path
        return False
    finally:
        _RECIPES.clear()


def _attributes(x: Tensor) -> dict:
    """An object's Python attributes, tensors by their sizes (for ``direct_njt_works``)."""
    return {k: (tuple(v.shape) if isinstance(v, Tensor) else
                {n: tuple(t.shape) if isinstance(t, Tensor) else t for n, t in v.items()} if isinstance(v, dict)
                else v) for k, v in vars(x).items() if k != "_values"}


def last_dim_contiguous(*tensors: Tensor) -> bool:
    return all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in tensors)
