"""CPU_FUSED: the fast CPU path, chosen automatically for CPU tensors; takes every option.

Forward and backward run our compiled kernel (``native.py``: one call for the whole batch) whenever
it can: fp32/fp16/bf16 (dropout with ``keyed_dropout``'s mask), packed keys or a paged cache (read in
place; its backward sums the dK/dV of shared cache blocks itself). Otherwise (float64, no C++ compiler, ...) per
sequence it picks one torch-op engine: the fused flash kernel (``fused.py``: fp32/fp64/fp16) or
blocked matmuls (``blocked.py``: bf16, where bf16 matmuls are fast, and softcap/dropout, which the
fused kernel cannot take); both walk a sequence in blocks of query rows that see only their
visible keys. Without grad, one-query rows take the decode engine (``decode.py``) and short
sequences are padded into groups (``grouped.py``). Their backward is our own too: the fused
kernel's backward, or the blocked recomputation, per sequence; ``state`` carries the dropout RNG
state and, for float64, the lse at full precision.
Both directions first copy q/k/v (and out, grad_out) whose last dim is strided (``unit_stride``).
"""

from __future__ import annotations

import functools
from typing import Iterator, NamedTuple, Optional

import torch
from torch import Tensor

from jagged_sdpa import layout
from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.backends.cpu import blocked, decode, fused, grouped, native, schedule
from jagged_sdpa.backends.math import paged_slots
from jagged_sdpa.checks.capability import ALL_FLOAT_DTYPES, Capabilities
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall


def _state(rng: Optional[Tensor], lse_full: Optional[Tensor], like: Tensor) -> tuple:
    """(default generator state before the forward (dropout only), float64 lse of float64 calls
    (the float32 one is too coarse)), empty tensors where absent: state crosses the operator as
    tensors."""
    return (like.new_empty(0) if rng is None else rng, like.new_empty(0) if lse_full is None else lse_full)


def _unpack_state(state: tuple) -> tuple[Optional[Tensor], Optional[Tensor]]:
    return tuple(None if t.numel() == 0 else t for t in state) if state else (None, None)


class _Seq(NamedTuple):
    """One sequence's rows. Its keys are sliced (or, paged, gathered) only when asked for: a
    sequence padded into a group never needs its own views."""

    index: int
    q_start: int
    len_q: int
    len_k: int
    key_rows: object             # slice into packed k/v, or a LongTensor of flat cache slots (paged)
    k_src: Tensor                # packed k/v, or the flattened cache (paged)
    v_src: Tensor

    def kv(self) -> tuple[Tensor, Tensor]:
        if isinstance(self.key_rows, slice):
            return self.k_src[self.key_rows], self.v_src[self.key_rows]
        return self.k_src.index_select(0, self.key_rows), self.v_src.index_select(0, self.key_rows)


def uses_fused_kernel(spec: AttnSpec) -> bool:
    """The fused kernel cannot take softcap, dropout or Dv != D; bf16 is faster as bf16 matmuls;
    fp16 masks would round ALiBi biases, so fp16 with ALiBi goes to the blocked engine too."""
    if spec.softcap or spec.dropout_p or spec.dtype == torch.bfloat16 or spec.head_dim_v != spec.head_dim:
        return False
    return not (spec.dtype == torch.float16 and spec.alibi)


# Up to this many query rows, a sequence runs as blocked matmuls even where the fused kernel could
# take it: the kernel reads strided packed K/V row by row, which costs ~5x a contiguous read when
# a few queries (decoding) face many keys, while the blocked engine copies K/V once per sequence.
SMALL_QUERY_ROWS = 16


# Forward only: sequences with at most this many (query, key) pairs also run as blocked matmuls,
# measured ~10% faster than the fused kernel up to 128 x 128 (one matmul pair and one softmax).
# Their backward stays on the fused kernel's backward, which is faster there than ours; it needs
# only out and a float32-accurate lse, which the blocked forward provides.
SMALL_PAIRS = 128 * 128


# Sequences with at most this many (query, key) pairs and keys are padded into groups
# (``grouped.py``): there per-sequence op overhead outweighs the padding. Longer key ranges are
# not grouped: decoding reads each key once, and a padded copy would triple that traffic.
# Measured on W2 (64 sequences of 8..128, fp32, 2 threads, median ms): groups up to 32x32 18.3,
# 48x48 12.2, 64x64 11.9, 96x96 13.3, 128x128 14.9; the loop of dense SDPA calls 12.7. With one
# thread all are within 5% of the loop; next to a busy single-threaded process 64x64 is 23.7 ms
# (loop 24.4).
GROUPED_PAIRS = 64 * 64
GROUPED_KEYS = 64


def native_forward_reason(spec: AttnSpec) -> Optional[str]:
    """None when the compiled kernel runs the forward, else why not. With a gradient needed the
    backward must run where the forward ran: it recomputes P = exp(S - lse) from the forward's lse,
    and S rounded by another engine's float32 matmul no longer matches that lse. With large
    logits the mismatch, times the scale, is the whole gradient (the fuzzer measured dq 0.56 where
    float64 gives 0, paged fp32 at scale 198)."""
    why = native.skip_reason(spec)
    if why is None and spec.needs_grad and (backward_why := native.backward_skip_reason(spec)) is not None:
        why = f"its backward cannot run ({backward_why}) and forward and backward must match"
    return why


def nan_free(q: Tensor, k: Tensor) -> bool:
    """Whether the scores can hold no NaN. PyTorch's fused CPU kernel turns a NaN query row into
    zeros (it drops NaN scores from its row max) where dense SDPA gives NaN, and its bf16 bmm
    spills a NaN row into the next (``blocked.matmul_dtype``): calls with NaN in q or k take our
    own matmuls in float32 products. One pass over q and k, on the torch-op path only (the
    compiled kernel propagates NaN itself)."""
    return not (bool(torch.isnan(q).any()) or bool(torch.isnan(k).any()))


def fused_for_sequence(spec: AttnSpec, len_q: int, len_k: int, backward: bool = False,
                       nan_free: bool = True) -> bool:
    if not nan_free or not uses_fused_kernel(spec) or len_q <= SMALL_QUERY_ROWS:
        return False
    return backward or len_q * len_k > SMALL_PAIRS


def _sequences(call: PackedCall) -> Iterator[_Seq]:
    q_ranges = call.query_ranges_host()
    if call.spec.paged:
        used = call.seqused_k_host if call.seqused_k_host is not None else tuple(call.seqused_k.tolist())
        k_flat = call.k.flatten(0, 1)
        v_flat = call.v.flatten(0, 1)
        for b, ((q_start, len_q), length) in enumerate(zip(q_ranges, used)):
            if len_q == 0:
                continue
            yield _Seq(b, q_start, len_q, length, paged_slots(call, b, length), k_flat, v_flat)
        return
    k, v = call.k, call.v
    for b, ((q_start, len_q), (k_start, len_k)) in enumerate(zip(q_ranges, call.key_ranges_host())):
        if len_q:
            yield _Seq(b, q_start, len_q, len_k, slice(k_start, k_start + len_k), k, v)


def _unit_stride(x: Tensor) -> Tensor:
    return x if layout.last_dim_contiguous(x) else x.contiguous()


def unit_stride(call: PackedCall) -> PackedCall:
    """``call`` with q/k/v whose last dim is unit-stride: our kernel refuses other layouts and
    PyTorch's fused CPU kernel misreads them (it reads the gaps: wrong outputs, NaN gradients).
    Forward and backward both pass through here, so no engine ever sees such a layout; one copy
    of the offending tensor lets the compiled kernel run instead of the torch-op engines."""
    if call.spec.last_dim_contiguous:  # measured on these very tensors when the spec was built
        return call
    if layout.last_dim_contiguous(call.q, call.k, call.v):
        return call.replace(spec=call.spec.replace(last_dim_contiguous=True))
    return call.replace(q=_unit_stride(call.q), k=_unit_stride(call.k), v=_unit_stride(call.v),
                        spec=call.spec.replace(last_dim_contiguous=True))


class CpuFusedBackend(BackendImpl):
    backend = Backend.CPU_FUSED
    caps = Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        paged=True,
        notes=(
            "fp32/fp16/bf16: our compiled kernel, forward and backward (built on first use; needs a C++ "
            "compiler; paged caches read in place in both directions; dropout masks equal math's and "
            "triton's). Otherwise: fp32/fp64/fp16: PyTorch's fused CPU flash kernel per block of query rows; "
            "bf16, softcap and dropout (masks from the default generator): blocked matmuls; decode rows (one "
            "query, no grad): elementwise passes over key chunks; short sequences without grad: padded groups",
        ),
    )

    @classmethod
    def fake_state(cls, call: PackedCall) -> tuple:
        spec = unit_stride(call).spec
        if native_forward_reason(spec) is None:
            return ()
        rng = torch.empty(torch.get_rng_state().shape, dtype=torch.uint8) if spec.dropout_p and spec.needs_grad else None
        lse_full = (call.q.new_empty(spec.heads_q, spec.total_q, dtype=torch.float64)
                    if spec.dtype == torch.float64 and (spec.return_lse or spec.needs_grad) else None)
        return _state(rng, lse_full, call.q)

    @classmethod
    def plan_notes(cls, spec: AttnSpec) -> tuple[str, ...]:
        """Silent on the usual path (the compiled kernel's forward, built for this CPU); says which
        target the kernel was built for when ``JAGGED_SDPA_CPU_ARCH`` names one, why the call runs
        on the torch-op engines instead, when an option moves it to the slower of those, and when a
        strided last dim is copied first (see ``unit_stride``)."""
        notes = []
        if not spec.last_dim_contiguous:
            notes.append("cpu_fused: q/k/v with a strided last dim are copied to unit stride first")
            spec = spec.replace(last_dim_contiguous=True)
        why_not_native = native_forward_reason(spec)
        if why_not_native is None:
            target = native.target_note()
            return tuple(notes) if target is None else (*notes, f"cpu_fused: {target}")
        notes.append(f"cpu_fused: compiled kernel not used ({why_not_native}): torch-op engines run per sequence")
        if uses_fused_kernel(spec):
            return tuple(notes)
        if spec.dtype == torch.bfloat16 and not (spec.softcap or spec.dropout_p or spec.head_dim_v != spec.head_dim):
            return tuple(notes)
        why = " and ".join(n for n, on in (("softcap", spec.softcap), ("dropout", spec.dropout_p),
                                           ("head_dim_v != head_dim", spec.head_dim_v != spec.head_dim),
                                           ("float16 with alibi", spec.dtype == torch.float16 and spec.alibi)) if on)
        note = f"cpu_fused: {why} run as blocked matmuls (the fused kernel cannot take them)"
        if spec.dtype != torch.bfloat16:
            note += "; expect about 1.5-2x the time of the same call without them"
        return (*notes, note)

    @classmethod
    def forward(cls, call: PackedCall) -> AttnOutput:
        call = unit_stride(call)
        spec = call.spec
        q = call.q
        out = q.new_empty(spec.total_q, spec.heads_q, spec.head_dim_v)
        lse = torch.empty(spec.heads_q, spec.total_q, dtype=torch.float32, device=q.device)
        if native_forward_reason(spec) is None:
            native.forward(call, out, lse)
            return AttnOutput(out, lse if spec.return_lse else None)
        lse_full = None
        if spec.dtype == torch.float64 and spec.return_lse:
            lse_full = torch.empty(spec.heads_q, spec.total_q, dtype=torch.float64, device=q.device)
        rng = torch.get_rng_state() if spec.dropout_p and spec.needs_grad else None
        clean = nan_free(q, call.k)
        short, tasks, weights, decode_rows = [], [], [], []
        for seq in _sequences(call):
            rows = slice(seq.q_start, seq.q_start + seq.len_q)
            len_k = seq.len_k
            if len_k and decode.eligible(spec, seq.len_q):
                decode_rows.append(seq)
                continue
            if len_k and not fused_for_sequence(spec, seq.len_q, len_k, nan_free=clean) \
                    and grouped.eligible(spec, seq.len_q, len_k) \
                    and seq.len_q * len_k <= GROUPED_PAIRS and len_k <= GROUPED_KEYS and lse_full is None:
                short.append(grouped.Member(seq.q_start, seq.len_q, seq.key_rows.start, len_k))
                continue
            if len_k == 0:
                out[rows] = 0
                lse[:, rows] = float("-inf")
                if lse_full is not None:
                    lse_full[:, rows] = float("-inf")
                continue
            q_b, slopes = q[rows], call.slopes_of(seq.index)
            k_b, v_b = seq.kv()
            if fused_for_sequence(spec, seq.len_q, len_k, nan_free=clean):
                tasks.append(functools.partial(
                    fused.forward_sequence, spec, q_b, k_b, v_b, slopes, out[rows], lse[:, rows],
                    None if lse_full is None else lse_full[:, rows]))
            else:
                target = lse[:, rows] if lse_full is None else lse_full[:, rows]
                tasks.append(functools.partial(
                    blocked.forward_sequence, spec, q_b, k_b, v_b, slopes, out[rows], target, spec.return_lse,
                    clean))
            weights.append(seq.len_q * len_k)
        for members in grouped.groups(short, spec.heads_q) if short else ():
            if len(members) == 1:
                m = members[0]
                rows, keys = slice(m.q_start, m.q_start + m.len_q), slice(m.k_start, m.k_start + m.len_k)
                tasks.append(functools.partial(blocked.forward_sequence, spec, q[rows], call.k[keys], call.v[keys],
                                               None, out[rows], lse[:, rows], spec.return_lse, clean))
            else:
                tasks.append(functools.partial(grouped.forward_group, spec, q, call.k, call.v, members, out, lse,
                                               spec.return_lse, clean))
            weights.append(sum(m.len_q * m.len_k for m in members))
        if decode_rows:
            decode.forward_rows(spec, q, [(seq.q_start, *seq.kv(), call.slopes_of(seq.index)) for seq in decode_rows],
                                out, lse if lse_full is None else lse_full, spec.return_lse)
        schedule.run(tasks, weights, ordered=bool(spec.dropout_p))
        if lse_full is not None:
            lse.copy_(lse_full)
        return AttnOutput(out, lse if spec.return_lse else None, _state(rng, lse_full, q))

    @classmethod
    def backward(cls, call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor, state: object):
        call = unit_stride(call)
        out, grad_out = _unit_stride(out), _unit_stride(grad_out)
        spec = call.spec
        if native.backward_skip_reason(spec) is None:
            return native.backward(call, out, lse, grad_out)
        rng, lse_full = _unpack_state(state)
        if lse_full is not None:
            lse = lse_full
        generator = None
        if rng is not None:
            generator = torch.Generator(device="cpu")
            generator.set_state(rng)
        dq = torch.zeros_like(call.q)
        dk = torch.zeros_like(call.k)
        dv = torch.zeros_like(call.v)
        dk_flat, dv_flat = (dk.flatten(0, 1), dv.flatten(0, 1)) if spec.paged else (dk, dv)
        tasks, weights, parts = [], [], []
        clean = nan_free(call.q, call.k)
        for seq in _sequences(call):
            rows = slice(seq.q_start, seq.q_start + seq.len_q)
            if seq.len_k == 0:
                continue
            k_b, v_b = seq.kv()
            if spec.paged:   # sequences may share cache blocks: accumulated below
                dk_b, dv_b = torch.empty_like(k_b), torch.empty_like(v_b)
                parts.append((seq.key_rows, dk_b, dv_b))
            else:            # packed key ranges are disjoint: written in place
                dk_b, dv_b = dk[seq.key_rows], dv[seq.key_rows]
            args = (spec, call.q[rows], k_b, v_b, out[rows], lse[:, rows], grad_out[rows],
                    call.slopes_of(seq.index), dq[rows], dk_b, dv_b)
            if fused_for_sequence(spec, seq.len_q, seq.len_k, backward=True, nan_free=clean):
                tasks.append(functools.partial(fused.backward_sequence, *args))
            else:
                tasks.append(functools.partial(blocked.backward_sequence, *args, generator, clean))
            weights.append(seq.len_q * seq.len_k)
        schedule.run(tasks, weights, ordered=bool(spec.dropout_p))
        # Accumulated here, in order: sequences may share cache blocks (prefix caching).
        for key_rows, dk_b, dv_b in parts:
            dk_flat.index_add_(0, key_rows, dk_b)
            dv_flat.index_add_(0, key_rows, dv_b)
        return dq, dk, dv
