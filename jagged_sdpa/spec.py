"""The data that flows from the public call to a backend: ``AttnSpec``, ``PackedCall``, ``AttnOutput``.

``AttnSpec`` is frozen, hashable and tensor-free: selection, ``explain`` and the capability tests
work on it alone. ``build`` is the one place a spec is made: ``for_layer`` (a plan's call, with the
normalisations that make options which provably change nothing disappear) and ``for_operator``
(the same spec rebuilt where the operator runs, from ``options_of``'s string) call it.
This module imports no backend.

Shape legend: B batch, Hq/Hkv query/kv heads, D/Dv head dims, total_q/total_k packed token counts,
max_seqlen_q/_k longest sequence, num_blocks/block_size the paged KV cache geometry.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import torch
from torch import Tensor

from jagged_sdpa import layout

Alignment = Literal["top_left", "bottom_right"]


def _replaced(obj, changes: dict):
    """``dataclasses.replace`` for our frozen dataclasses (no ``__post_init__``, every field in
    ``__init__``) at half its cost: specs and calls are replaced a few times per call."""
    names = _FIELD_NAMES[type(obj)]
    unknown = [name for name in changes if name not in names]  # not keys() - set: dynamo (torch 2.11) fails on it
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(obj))
    for name in names:
        object.__setattr__(new, name, changes[name] if name in changes else getattr(obj, name))
    return new
ALIGNMENTS: tuple[str, ...] = ("top_left", "bottom_right")


@dataclass(frozen=True, slots=True)
class AttnSpec:
    """Everything selection needs, and nothing that requires reading tensor data."""

    entry: Literal["sdpa", "varlen"]
    device_type: str                      # "cpu", "cuda", ...
    capability: Optional[tuple[int, int]] # CUDA compute capability, cached per device
    dtype: torch.dtype
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    total_q: int
    total_k: int                          # packed keys; for a paged cache: num_blocks * block_size
    max_seqlen_q: int
    max_seqlen_k: int
    has_empty_q: bool                     # conservatively True when lengths were not read
    has_empty_k: bool
    lengths_known: bool                   # the host holds every sequence length of this call
    kv_dense: bool = False                # sdpa's dense K/V shared by every query sequence
    causal: bool = False
    alignment: str = "top_left"
    window: tuple[int, int] = (-1, -1)    # (-1, -1) = unbounded
    softcap: float = 0.0                  # 0.0 = off
    alibi: Optional[str] = None           # None, "per_head" (Hq,), "per_batch_head" (B, Hq)
    alibi_grad: bool = False              # the slopes themselves need a gradient
    dropout_p: float = 0.0
    scale: float = 1.0
    needs_grad: bool = False
    return_lse: bool = False
    last_dim_contiguous: bool = True      # all of q/k/v
    paged: bool = False                   # keys/values live in a block-table KV cache
    block_size: int = 0                   # paged cache block size (0 when not paged)
    seqused_k: bool = False               # a seqused_k tensor limits the keys of each sequence
    equal_lengths: bool = False           # every sequence has Lq == Lk (known without a read, or read)
    chunk_size: Optional[int] = None      # chunked local attention (docs/api.md section 11); None = off (or a no-op)
    prefix: bool = False                  # prefix_lens given (prefix-LM, docs/api.md section 11) and able to change the mask
    sinks: bool = False                   # a per-head sink logit (Hq,) in every row's softmax denominator
    sinks_grad: bool = False              # the sinks themselves need a gradient
    # A dense (B, S, Hkv, D) KV cache read in place (docs/api.md section 12): carried as a paged cache of one
    # block of S slots per sequence (paged=True, block_size=S, block_table[b] = [b]), whose keys
    # start at cache_leftpad[b] when ``leftpad``.
    dense_cache: bool = False
    leftpad: bool = False
    # An fp8 KV cache (docs/api.md section 13): its dtype (float8_e4m3fn or float8_e5m2), read with
    # k_scale/v_scale (per tensor or per kv head); None when K/V are in q's dtype.
    cache_dtype: Optional[torch.dtype] = None

    @property
    def gqa_group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def has_window(self) -> bool:
        return self.window != (-1, -1)

    def replace(self, **changes) -> "AttnSpec":
        return _replaced(self, changes)

    def describe(self) -> str:
        """One line describing the call, the header of explain tables and errors."""
        parts = [
            f"{self.entry} call: B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv}",
            f"D={self.head_dim}" + (f" Dv={self.head_dim_v}" if self.head_dim_v != self.head_dim else ""),
            str(self.dtype).replace("torch.", ""),
            self.device_type,
            f"max_seqlen_q={self.max_seqlen_q} max_seqlen_k={self.max_seqlen_k}",
        ]
        if self.causal:
            parts.append(f"causal={self.alignment}")
        if self.has_window:
            parts.append(f"window={self.window}")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.alibi:
            parts.append(f"alibi={self.alibi}" + ("(grad)" if self.alibi_grad else ""))
        if self.dropout_p:
            parts.append(f"dropout={self.dropout_p:g}")
        if self.chunk_size is not None:
            parts.append(f"chunk_size={self.chunk_size}")
        if self.prefix:
            parts.append("prefix_lens")
        if self.sinks:
            parts.append("sinks" + ("(grad)" if self.sinks_grad else ""))
        if self.dense_cache:
            parts.append(f"dense_cache(S={self.block_size}" + (", cache_leftpad)" if self.leftpad else ")"))
        elif self.paged:
            parts.append(f"paged(block_size={self.block_size})")
        if self.kv_dense:
            parts.append("dense_kv")
        if self.cache_dtype is not None:
            parts.append(f"fp8_cache({str(self.cache_dtype).replace('torch.', '')})")
        parts.append(f"grad={'yes' if self.needs_grad else 'no'}")
        return " ".join(parts)


@dataclass(frozen=True)
class PackedCall:
    """The tensors of one call in packed ``thd`` form, plus its spec.

    q: (total_q, Hq, D); k: (total_k, Hkv, D), or (num_blocks, block_size, Hkv, D) when paged;
    v: likewise with Dv. cu_seqlens_*: int32 (B + 1,) on q's device (cu_seqlens_k is None when
    paged). seqused_k: int32 (B,) or None. block_table: int32 (B, max_blocks) or None.
    *_host: the same lengths read once on the host by ``layout.seqlen_stats`` (None when the call
    was made without a host read, see ``AttnSpec.lengths_known``). dropout_key: int64 CPU (2,)
    [seed, offset] of ``backends.keyed_dropout`` when the call runs with dropout, else None.
    refusal: why the call may not run, raised as a ValueError when its operator runs (a call
    traced by torch.compile without its max lengths, see ``plans.missing_max``), else None.
    prefix_lens: int32 (B,) (docs/api.md section 11) when ``spec.prefix``, else None; prefix_host its values
    read on the host (None when not read). sinks: float (Hq,) when ``spec.sinks``, else None.
    cache_leftpad: int32 (B,) when ``spec.leftpad`` (a dense cache, docs/api.md section 12: sequence b's keys are
    cache slots [cache_leftpad[b], cache_leftpad[b] + seqused_k[b]) of row b), else None;
    leftpad_host its values read on the host. k_scale, v_scale: float32 () or (Hkv,) when the cache
    is fp8 (``spec.cache_dtype``, docs/api.md section 13: the keys are ``k.float() * k_scale``), else None.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Optional[Tensor]
    spec: AttnSpec
    alibi_slopes: Optional[Tensor] = None
    seqused_k: Optional[Tensor] = None
    block_table: Optional[Tensor] = None
    cu_q_host: Optional[tuple[int, ...]] = None
    cu_k_host: Optional[tuple[int, ...]] = None
    seqused_k_host: Optional[tuple[int, ...]] = None
    dropout_key: Optional[Tensor] = None
    refusal: Optional[str] = None
    prefix_lens: Optional[Tensor] = None
    prefix_host: Optional[tuple[int, ...]] = None
    sinks: Optional[Tensor] = None
    cache_leftpad: Optional[Tensor] = None
    leftpad_host: Optional[tuple[int, ...]] = None
    k_scale: Optional[Tensor] = None
    v_scale: Optional[Tensor] = None

    def replace(self, **changes) -> "PackedCall":
        return _replaced(self, changes)

    def slopes_of(self, b: int) -> Optional[Tensor]:
        """ALiBi slopes (Hq,) of sequence b, from either accepted shape, or None."""
        if self.alibi_slopes is None:
            return None
        return self.alibi_slopes if self.alibi_slopes.dim() == 1 else self.alibi_slopes[b]

    def prefixes_host(self) -> Optional[tuple[int, ...]]:
        """Every sequence's prefix length P_b (read now when the call was made without a host
        read), or None without prefix_lens."""
        if self.prefix_lens is None:
            return None
        return self.prefix_host if self.prefix_host is not None else tuple(self.prefix_lens.tolist())

    def key_ranges_host(self) -> list[tuple[int, int]]:
        """(start, length) of every sequence's keys; packed keys only (not paged)."""
        cu = self.cu_k_host
        if cu is None:
            cu = tuple(self.cu_seqlens_k.tolist())
        used = self.seqused_k_host
        if used is None and self.seqused_k is not None:   # a call made without a host read
            used = tuple(self.seqused_k.tolist())
        return [(cu[b], cu[b + 1] - cu[b] if used is None else used[b]) for b in range(len(cu) - 1)]

    def query_ranges_host(self) -> list[tuple[int, int]]:
        cu = self.cu_q_host
        if cu is None:
            cu = tuple(self.cu_seqlens_q.tolist())
        return [(cu[b], cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]


class AttnOutput(NamedTuple):
    """out: (total_q, Hq, Dv). lse: float32 (Hq, total_q), natural log, -inf for rows that see
    no key, or None. state: the tensors a backend's backward needs beyond q/k/v/out/lse (a CUDA
    kernel's RNG state); tensors only, because it crosses the ``jagged_sdpa::attention`` operator."""

    out: Tensor
    lse: Optional[Tensor]
    state: tuple = ()


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def cache_dtype_of(k: Tensor) -> Optional[torch.dtype]:
    """An fp8 KV cache's dtype (docs/api.md section 13), or None when K/V are in q's dtype."""
    return k.dtype if k.dtype in FP8_DTYPES else None


_FIELD_NAMES = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in (AttnSpec, PackedCall)}


# ----------------------------------------------------------------------------------------------
# building specs


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """CUDA compute capability of ``device`` (cached per device), None elsewhere."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def build(q: Tensor, k: Tensor, v: Tensor, *, batch: int, block_table: Optional[Tensor],
          seqused_k: Optional[Tensor], dense_cache: bool = False, cache_leftpad: Optional[Tensor] = None,
          **fields) -> AttnSpec:
    """The spec of a packed, paged or dense-cache call: what its tensors' metadata decide (a dense
    cache (B, S, Hkv, D) is a paged cache of B blocks of S slots), and ``fields``."""
    paged = block_table is not None or dense_cache
    return AttnSpec(
        device_type=q.device.type,
        capability=device_capability(q.device),
        dtype=q.dtype,
        batch=batch,
        heads_q=q.shape[1],
        heads_kv=k.shape[-2],
        head_dim=q.shape[-1],
        head_dim_v=v.shape[-1],
        total_q=q.shape[0],
        total_k=k.shape[0] * (k.shape[1] if paged else 1),
        last_dim_contiguous=layout.last_dim_contiguous(q, k, v),
        paged=paged,
        block_size=k.shape[1] if paged else 0,
        seqused_k=seqused_k is not None,
        dense_cache=dense_cache,
        leftpad=cache_leftpad is not None,
        cache_dtype=cache_dtype_of(k),
        **fields,
    )


def effective_window(window: tuple[int, int], max_seqlen_q: int, max_seqlen_k: int) -> tuple[int, int]:
    """The window with every side that reaches past all keys written as -1 (unbounded).

    The aligned position i' of any row lies in [-max_seqlen_q, max_seqlen_k), so a side
    >= max_seqlen_q + max_seqlen_k can never exclude a key. Normalising it here means no kernel
    sees a huge value (2**63 and beyond wrapped in int64 arithmetic) and every backend treats it
    alike.
    """
    reach = max_seqlen_q + max_seqlen_k
    return tuple(-1 if side >= reach else side for side in window)


def effective_chunk(chunk_size: Optional[int], causal: bool, alignment: str, max_seqlen_q: int, max_seqlen_k: int,
                    no_negative_positions: bool) -> Optional[int]:
    """chunk_size, or None where it provably changes nothing, so every backend can take the call.

    Keys lie in chunk 0 when chunk_size >= max_seqlen_k. A row is unaffected when its aligned
    position i' is in [0, chunk_size) too: top_left positions lie in [0, max_seqlen_q);
    bottom_right ones lie below max_seqlen_k but are negative where a sequence has more queries
    than keys, and such rows (chunk -1) lose their keys unless causal already hides every key
    from them (j <= i' < 0).
    """
    if chunk_size is None or chunk_size < max_seqlen_k:
        return chunk_size
    if alignment == "top_left":
        return None if chunk_size >= max_seqlen_q else chunk_size
    return None if causal or no_negative_positions else chunk_size


def for_layer(b, o, q: Tensor, k: Tensor, v: Tensor, alibi: Optional[str], alibi_grad: bool, needs_grad: bool,
              sinks: bool = False, sinks_grad: bool = False) -> AttnSpec:
    """The spec of one layer's call over batch ``b`` (``batch.Batch``) with options ``o``
    (``options.Options``): the selection key and run contract of a plan's run.

    Options that provably change nothing are normalised away, so that every backend takes such
    calls: a window side past every key, a chunk_size covering every key and row
    (``effective_chunk``), and prefix_lens that are all 0 or whose rows see every key anyway
    (no causal, window or chunk mask to widen)."""
    equal = b.equal_lengths or (b.kv_dense and b.max_seqlen_q == b.max_seqlen_k
                                and q.shape[0] == b.size * b.max_seqlen_k)
    window = effective_window(o.window, b.max_seqlen_q, b.max_seqlen_k)
    chunk = effective_chunk(o.chunk_size, o.causal, o.alignment, b.max_seqlen_q, b.max_seqlen_k,
                            equal or (b.kv_dense and b.max_seqlen_q <= b.max_seqlen_k))
    return build(
        q, k, v, batch=b.size, block_table=b.block_table, seqused_k=b.seqused_k, dense_cache=b.dense_cache,
        cache_leftpad=b.cache_leftpad,
        entry=o.entry,
        max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k,
        has_empty_q=b.has_empty_q,
        has_empty_k=b.has_empty_k,
        lengths_known=b.lengths_known,
        kv_dense=b.kv_dense,
        causal=o.causal,
        alignment=o.alignment,
        window=window,
        softcap=o.softcap,
        alibi=alibi,
        alibi_grad=alibi is not None and alibi_grad,
        dropout_p=o.run_dropout_p,
        scale=o.scale_for(q.shape[-1]),
        needs_grad=needs_grad,
        return_lse=o.return_lse,
        equal_lengths=equal,
        chunk_size=chunk,
        prefix=b.prefix_matters and (o.causal or window != (-1, -1) or chunk is not None),
        sinks=sinks,
        sinks_grad=sinks and sinks_grad,
    )


# ----------------------------------------------------------------------------------------------
# the operator's spec: its tensors' metadata and an ``options`` string (``ops``)

# The AttnSpec fields an ``options`` string carries: everything not read off the tensors.
_OPTION_FIELDS = ("entry", "has_empty_q", "has_empty_k", "lengths_known", "kv_dense", "causal", "alignment",
                  "window", "softcap", "alibi_grad", "dropout_p", "scale", "needs_grad", "return_lse",
                  "equal_lengths", "chunk_size", "sinks_grad", "dense_cache")


def options_of(spec: AttnSpec) -> str:
    """The operator's ``options`` argument for ``spec``: a Python literal (floats round-trip exactly),
    a constant in a compiled graph."""
    return repr(tuple(getattr(spec, f) for f in _OPTION_FIELDS))


@functools.lru_cache(maxsize=256)
def parse_options(options: str) -> dict:
    return dict(zip(_OPTION_FIELDS, ast.literal_eval(options)))


def for_operator(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, seqused_k: Optional[Tensor],
                 block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], options: str, max_q, max_k,
                 prefix_lens: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                 cache_leftpad: Optional[Tensor] = None) -> AttnSpec:
    """The spec of an operator call, from its tensors' metadata and ``options`` (``options_of``):
    the spec ``for_layer`` built when the call was made, rebuilt where the operator runs."""
    parsed = parse_options(options)
    return build(
        q, k, v, batch=cu_seqlens_q.shape[0] - 1, block_table=block_table, seqused_k=seqused_k,
        dense_cache=parsed["dense_cache"], cache_leftpad=cache_leftpad,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        alibi=None if alibi_slopes is None else ("per_head" if alibi_slopes.dim() == 1 else "per_batch_head"),
        prefix=prefix_lens is not None,
        sinks=sinks is not None,
        **{f: x for f, x in parsed.items() if f != "dense_cache"},
    )
