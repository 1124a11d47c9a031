"""Plumbing shared by FLASH_VARLEN and EFFICIENT, the backends built on PyTorch's private CUDA ops.

It owns: availability and op-schema probes (the ops gained keyword arguments across releases,
so a feature is offered only where this torch's op takes it), head-dim padding and 16-byte
alignment, and the device-side row bookkeeping (sequence and position of every packed row, rows
that see no key, keys no query sees) that converts each kernel's lse layout into ours. Every
function runs without a device-to-host sync. Nothing here decides eligibility.
"""

from __future__ import annotations

import functools
import math
from typing import Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake  # no public spelling; present since torch 2.1

from jagged_sdpa import batch as batches
from jagged_sdpa.spec import AttnSpec, PackedCall

# Vectorised 128-bit loads in both kernels: base pointers and row strides must be 16-byte aligned.
KERNEL_ALIGN_BYTES = 16

# A CUDA grid holds at most 65535 blocks along y and z (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"); a launch past that fails with "invalid configuration
# argument".
GRID_YZ_MAX = 65535


@functools.cache
def cuda_unavailable_reason() -> Optional[str]:
    """Why this process cannot run PyTorch's CUDA attention ops at all, or None. Cached."""
    if torch.version.cuda is None:
        if getattr(torch.version, "hip", None):
            return "PyTorch built for ROCm (torch.version.hip) - these backends wrap the CUDA builds' kernels"
        return "PyTorch built without CUDA (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


@functools.cache
def op_arguments(name: str) -> frozenset[str]:
    """Argument names of ``torch.ops.aten.<name>.default``; empty when this torch has no such op."""
    try:
        schema = getattr(torch.ops.aten, name).default._schema
    except (AttributeError, RuntimeError):
        return frozenset()
    return frozenset(arg.name for arg in schema.arguments)


def missing_argument_reason(feature: str, op: str, argument: str) -> Optional[str]:
    if argument in op_arguments(op):
        return None
    return f"{feature} needs aten.{op}({argument}=...), absent in torch {torch.__version__} - upgrade torch"


def missing_argument_reasons(needed) -> Iterator[str]:
    """For each (wanted, op, argument, feature) that is wanted, the reason when this torch's op
    lacks the argument (ops gained windows, seqused_k, ALiBi and block_table over releases)."""
    for wanted, op, argument, feature in needed:
        if wanted and (why := missing_argument_reason(feature, op, argument)) is not None:
            yield why


def launch_grid_reasons(spec: AttnSpec, kernel: str, grid: str) -> Iterator[str]:
    """Why ``kernel``, whose grid puts the sequences and the query heads on its y/z axes
    (``grid`` says how, with the PyTorch file that launches it), cannot launch this call."""
    if spec.batch > GRID_YZ_MAX:
        yield (f"batch {spec.batch} > {GRID_YZ_MAX} sequences - {kernel} launches {grid}, and a CUDA grid's y/z "
               f"hold at most {GRID_YZ_MAX}; split the batch")
    if spec.heads_q > GRID_YZ_MAX:
        yield (f"heads_q {spec.heads_q} > {GRID_YZ_MAX} - {kernel} launches {grid}, and a CUDA grid's y/z "
               f"hold at most {GRID_YZ_MAX}")


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def pad_head_dim(t: Tensor, size: int) -> Tensor:
    """Zero-pad the last dim to ``size``: zeros in q/k leave every score unchanged, zeros in v
    give output columns that are sliced off. The scale stays the caller's (from the original D)."""
    d = t.shape[-1]
    return t if d == size else F.pad(t, (0, size - d))


def _address(t: Tensor) -> int:
    """``t.data_ptr()``; 0 for a fake tensor (torch.compile runs a backend's forward on them for its
    output shapes; whether the real call copies changes no shape). torch 2.11 raises on a fake
    tensor's data_ptr, 2.13 warns.

    A plain eager tensor (exactly ``Tensor``, neither functionalized nor functorch-wrapped) is what
    ``is_fake`` answers False for after those very tests; asking them first skips its ~3 us (three
    tensors a call)."""
    if (type(t) is Tensor and not torch._is_functional_tensor(t)
            and not torch._C._functorch.is_functorch_wrapped_tensor(t)):
        return t.data_ptr()
    return 0 if is_fake(t) else t.data_ptr()


def is_kernel_aligned(t: Tensor) -> bool:
    size = t.element_size()
    if _address(t) % KERNEL_ALIGN_BYTES:
        return False
    if t.is_contiguous() and t.numel():  # every stride a multiple of the row's: the row decides (fast)
        if t.shape[-1] * size % KERNEL_ALIGN_BYTES == 0:
            return True
    elif t.stride(-1) != 1 and t.shape[-1] > 1:
        return False
    return all((s * size) % KERNEL_ALIGN_BYTES == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def kernel_ready(t: Tensor) -> Tensor:
    """``t`` when the kernels can read it, else a fresh contiguous copy.

    A misaligned vectorised load raises "misaligned address", a sticky CUDA error that kills the
    context; a fresh allocation from the caching allocator is always aligned.
    """
    if is_kernel_aligned(t):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def expand_kv_heads(t: Tensor, group: int) -> Tensor:
    """(T, Hkv, D) -> (T, Hkv * group, D): kv head h // group serves query head h (GQA by copy)."""
    if group == 1:
        return t
    total, heads, dim = t.shape
    return t.unsqueeze(2).expand(total, heads, group, dim).reshape(total, heads * group, dim)


def sum_kv_head_groups(grad: Tensor, group: int) -> Tensor:
    """The adjoint of ``expand_kv_heads``: sum the gradients of each kv head's query group."""
    if group == 1:
        return grad
    total, heads, dim = grad.shape
    return grad.view(total, heads // group, group, dim).sum(dim=2)


def cu_seqlens_from_lengths(lengths: Tensor) -> Tensor:
    """int32 (B + 1,) cumulative lengths of int32 (B,) lengths, on the device."""
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def sequence_lengths(cu_seqlens: Tensor) -> Tensor:
    return cu_seqlens[1:] - cu_seqlens[:-1]


class RowGeometry(NamedTuple):
    """Where every packed row sits: its sequence, its index in it, and that sequence's lengths."""

    seq: Tensor    # int64 (N,)
    pos: Tensor    # int64 (N,)
    len_q: Tensor  # int64 (N,)
    len_k: Tensor  # int64 (N,)


def row_geometry(cu_rows: Tensor, total_rows: int, len_q_seq: Tensor, len_k_seq: Tensor) -> RowGeometry:
    """Geometry of the ``total_rows`` packed rows described by ``cu_rows`` (int32 (B + 1,)).

    Empty sequences own no row: ``searchsorted(right=True) - 1`` skips them.
    """
    rows = torch.arange(total_rows, device=cu_rows.device, dtype=cu_rows.dtype)
    seq = torch.searchsorted(cu_rows, rows, right=True) - 1
    pos = rows.long() - cu_rows.long()[seq]
    return RowGeometry(seq, pos, len_q_seq.long()[seq], len_k_seq.long()[seq])


def aligned_query_position(geom: RowGeometry, alignment: str) -> Tensor:
    """i' of docs/api.md: the query index, shifted by Lk - Lq when bottom-right aligned."""
    if alignment == "bottom_right":
        return geom.pos + geom.len_k - geom.len_q
    return geom.pos


def visible_key_range(i: Tensor, len_k: Tensor, causal: bool, window: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """[lo, hi] of the keys aligned query position(s) ``i`` may see (empty when lo > hi)."""
    left, right = window
    lo = torch.zeros_like(i) if left < 0 else (i - left).clamp_min(0)
    hi = len_k - 1
    if causal:
        hi = torch.minimum(hi, i)
    if right >= 0:
        hi = torch.minimum(hi, i + right)
    return lo, hi


def empty_query_rows(geom: RowGeometry, spec: AttnSpec) -> Tensor:
    """bool (total_q,): rows that see no key (output 0, lse -inf by docs/api.md)."""
    lo, hi = visible_key_range(aligned_query_position(geom, spec.alignment), geom.len_k, spec.causal, spec.window)
    return lo > hi


def unseen_key_rows(key_geom: RowGeometry, spec: AttnSpec) -> Tensor:
    """bool (total_k,): keys that no query of their sequence sees (their gradients are 0).

    The visible ranges of consecutive queries are monotone and overlap (a left bound moves by one
    per query), so a sequence's seen keys are one interval: from the first query's lower bound to
    the last query's upper bound.
    """
    len_q, len_k = key_geom.len_q, key_geom.len_k
    shift = len_k - len_q if spec.alignment == "bottom_right" else torch.zeros_like(len_q)
    lo, _ = visible_key_range(shift, len_k, spec.causal, spec.window)
    _, hi = visible_key_range(shift + len_q - 1, len_k, spec.causal, spec.window)
    j = key_geom.pos
    return (len_q == 0) | (j < lo) | (j > hi)


def rows_may_be_empty(spec: AttnSpec) -> bool:
    """False only when the spec proves every query row sees at least one key."""
    bottom_right_short_keys = spec.causal and spec.alignment == "bottom_right" and not spec.equal_lengths
    return spec.has_empty_k or spec.has_window or spec.seqused_k or spec.paged or bottom_right_short_keys


def keys_may_be_unseen(spec: AttnSpec) -> bool:
    """False only when the spec proves every key is seen by some query of its sequence."""
    return spec.has_empty_q or spec.causal or spec.has_window


def lse_to_packed(native: Tensor, geom: Optional[RowGeometry]) -> Tensor:
    """A kernel's float32 lse as ours: (Hq, total_q).

    Flash (varlen) already writes (Hq, total_q); the efficient kernel writes (B, Hq, W) with
    sequence b's rows at [b, :, :Lq_b] (W is max_seqlen_q rounded up), gathered with ``geom``.
    """
    if native.dim() == 2:
        return native
    return native[geom.seq, :, geom.pos].transpose(0, 1).contiguous()


def lse_to_native(lse: Tensor, like_shape: tuple[int, ...], geom: Optional[RowGeometry]) -> Tensor:
    """Ours -> the kernel's layout for its backward, with +inf for rows that see no key.

    Both backwards compute P = exp(S - lse); +inf makes those rows' P exactly 0, where -inf
    would give exp(-inf + inf) = NaN. Padding slots get +inf too (what the efficient kernel
    writes there itself).
    """
    lse = torch.where(lse == -math.inf, math.inf, lse)
    if len(like_shape) == 2:
        return lse.contiguous()
    native = torch.full(like_shape, math.inf, dtype=torch.float32, device=lse.device)
    native[geom.seq, :, geom.pos] = lse.transpose(0, 1)
    return native


def slopes_per_row(slopes: Tensor, geom: RowGeometry) -> Tensor:
    """ALiBi slopes as (Hq, total_q) or (Hq, 1) for broadcasting."""
    if slopes.dim() == 1:
        return slopes.unsqueeze(1)
    return slopes[geom.seq].transpose(0, 1)


def query_geometry(call: PackedCall) -> RowGeometry:
    """Row geometry of the queries of ``call`` (keys from cu_seqlens_k or seqused_k)."""
    len_q = sequence_lengths(call.cu_seqlens_q)
    len_k = call.seqused_k if call.seqused_k is not None else sequence_lengths(call.cu_seqlens_k)
    return row_geometry(call.cu_seqlens_q, call.spec.total_q, len_q, len_k)


def key_geometry(call: PackedCall) -> RowGeometry:
    """Row geometry of the packed keys of ``call`` (not paged)."""
    len_q = sequence_lengths(call.cu_seqlens_q)
    len_k = sequence_lengths(call.cu_seqlens_k)
    return row_geometry(call.cu_seqlens_k, call.spec.total_k, len_q, len_k)


class PerBatch:
    """A value made on the device from a call's batch metadata (cu_seqlens, seqused_k), once for
    the calls of a plan's kind (``BackendImpl.forward_runner``: one batch, so the same metadata):
    ``get`` makes it at the first call and hands it to the later ones, saving their kernel launches
    (~20 tiny ops of row bookkeeping in a decode step, each a launch).

    Never kept from, nor handed to, a call made while a CUDA graph is captured: the graph's
    kernels run on replay, over whatever the metadata tensors then hold (a caller's in-place
    writes, ``Plan.update``), so a captured call makes its own, inside the graph.
    """

    __slots__ = ("_make", "_value", "_made")

    def __init__(self, make):
        self._make, self._value, self._made = make, None, False

    def get(self, call: PackedCall):
        if batches.capturing(call.q):
            return self._make(call)
        if not self._made:
            self._value, self._made = self._make(call), True
        return self._value


def clamp_max_seqlens(spec: AttnSpec) -> tuple[int, int]:
    """max_seqlen_* as the kernels want them: a caller may pass a bound above the packed total,
    which the efficient backward rejects and which only widens the flash grid."""
    return min(spec.max_seqlen_q, spec.total_q), min(spec.max_seqlen_k, spec.total_k)


def empty_result(call: PackedCall) -> tuple[Tensor, Tensor]:
    """out zeros and lse -inf: what every row gets when no sequence has a query or a key."""
    spec = call.spec
    out = call.q.new_zeros(spec.total_q, spec.heads_q, spec.head_dim_v)
    lse = torch.full((spec.heads_q, spec.total_q), -math.inf, dtype=torch.float32, device=call.q.device)
    return out, lse


def zero_grads(call: PackedCall) -> tuple[Tensor, Tensor, Tensor]:
    return torch.zeros_like(call.q), torch.zeros_like(call.k), torch.zeros_like(call.v)


class StateFromFakeForward:
    """``fake_state`` of a backend over aten ops that have fake kernels: the forward itself, run on
    fake tensors, gives the state's shapes (flash's rng state, efficient's seed and offset)."""

    @classmethod
    def fake_state(cls, call: PackedCall) -> tuple:
        return cls.forward(call).state
