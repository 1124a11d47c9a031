"""Plans: a batch validated once, run in every layer (docs/api.md section 10).

A ``Plan`` joins a ``batch.Batch`` (the batch's validated metadata) and ``options.Options`` (the
layer's validated keyword arguments). ``run`` does only per-layer work: the first run of each
kind (dtypes, devices, shapes, gradient or not, ALiBi's form, the backend order in force)
validates the tensors against the plan, builds the ``AttnSpec`` and selects the backend; later
runs of that kind look it up and go straight to ``ops.run``. ``varlen_attention`` and ``sdpa``
are plans too, found again through the Batch of their metadata tensors (``batch.cached``): one
code path for all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from jagged_sdpa import batch as batches
from jagged_sdpa import layout, ops, options as opts
from jagged_sdpa.backends import IMPLS, Backend, keyed_dropout
from jagged_sdpa.checks import inputs
from jagged_sdpa import spec as specs
from jagged_sdpa.selection import Explanation, _ORDER, select, with_notes
from jagged_sdpa.selection import choose as choose_backend
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall


class _Prepared:
    """What the first run of a kind worked out: its spec, backend, explain notes and, once a
    run of the kind goes straight to its backend, that backend's ``forward_runner``."""

    __slots__ = ("spec", "run_spec", "backend", "notes", "runner")

    def __init__(self, spec: AttnSpec, backend: Optional[Backend], notes: tuple):
        self.spec, self.backend, self.notes, self.runner = spec, backend, notes, _NOT_YET
        # A run that needs a gradient keeps the lse for its backward (``ops.keeping_lse_spec``): made once.
        self.run_spec = ops.keeping_lse_spec(spec)


_NOT_YET = object()


_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu", "maia"})


def autocast(q, k, v) -> tuple:
    """q, k, v as ``torch.autocast`` casts SDPA's inputs (docs/api.md section 1): floating tensors other
    than float64 to the autocast dtype of their device, when autocast is on there."""
    if not isinstance(q, Tensor) or q.device.type not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(
            q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in (q, k, v))


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class Plan:
    """A validated batch and the options of its attention calls; ``run`` it in every layer.

    Built by ``jagged_sdpa.plan`` (over copies of the caller's tensors) or, implicitly, by
    ``varlen_attention``/``sdpa`` (over the caller's tensors, found again while unchanged).
    """

    def __init__(self, batch: batches.Batch, options: opts.Options, refusal: Optional[str] = None,
                 layout_notes: tuple = (), inputs_checked: bool = False):
        self._batch = batch
        self._options = options
        self._refusal = refusal     # a traced call without max lengths: raised when the operator runs
        self._layout_notes = tuple(layout_notes)   # how sdpa's NJTs were unwrapped, for explain
        self._inputs_checked = inputs_checked      # sdpa checked its NJTs' kinds and shapes itself
        self._kinds: dict = {}

    # -- per layer -------------------------------------------------------------------------------

    def run(self, q: Tensor, k: Tensor, v: Tensor, *, alibi_slopes: Optional[Tensor] = None,
            sinks: Optional[Tensor] = None, k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None):
        """``varlen_attention(q, k, v, <the plan's arguments>, alibi_slopes=..., sinks=..., k_scale=...,
        v_scale=...)``: out, or (out, lse) with ``return_lse=True``. The scales read an fp8 cache
        (docs/api.md section 13), per layer."""
        result = self._run(q, k, v, alibi_slopes, sinks, k_scale, v_scale)
        return (result.out, result.lse) if self._options.return_lse else result.out

    def explain(self, q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor] = None,
                sinks: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                v_scale: Optional[Tensor] = None) -> Explanation:
        """Which backend ``run(q, k, v, ...)`` would take, and why not the others; runs nothing."""
        q, k, v = autocast(q, k, v)
        prepared = self._prepare(q, k, v, alibi_slopes, sinks, k_scale, v_scale, choose=False)
        return with_notes(select(prepared.spec, self._options.forced), prepared.notes)

    def _run(self, q, k, v, alibi_slopes, sinks=None, k_scale=None, v_scale=None) -> AttnOutput:
        """The run of a call whose q, k, v are packed: its call (``_call``), then its backend."""
        q, k, v = autocast(q, k, v)
        call, prepared = self._call(q, k, v, alibi_slopes, sinks, k_scale, v_scale)
        runner = prepared.runner
        if runner is _NOT_YET:  # built on the first run that would go straight to the backend
            runner = None
            if prepared.backend is not None and not prepared.spec.needs_grad and ops.unobserved(call):
                runner = prepared.runner = IMPLS[prepared.backend].forward_runner(call)
        result = ops.run(prepared.backend, call, runner)
        if self._options.drops_everything:
            result = AttnOutput(result.out * 0, result.lse)
        return result

    def _call(self, q, k, v, alibi_slopes, sinks=None, k_scale=None, v_scale=None,
              choose: bool = True) -> tuple[PackedCall, _Prepared]:
        """The call ``run`` hands to ``ops.run``, and what its kind's first run prepared; without
        ``choose`` the call is only described (no backend), as tests inspect it."""
        if (choose and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
                and not torch.compiler.is_compiling() and (alibi_slopes is None or type(alibi_slopes) is Tensor)
                and (sinks is None or type(sinks) is Tensor) and (k_scale is None or type(k_scale) is Tensor)
                and (v_scale is None or type(v_scale) is Tensor)):
            grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
                alibi_slopes is not None and alibi_slopes.requires_grad) or (sinks is not None and sinks.requires_grad))
            kind = (q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.shape, k.shape, v.shape,
                    q.stride(), k.stride(), v.stride(), grad, _ORDER.get(),
                    None if alibi_slopes is None else (type(alibi_slopes), alibi_slopes.dtype, alibi_slopes.device,
                                                       alibi_slopes.shape, alibi_slopes.requires_grad),
                    None if sinks is None else (sinks.dtype, sinks.device, sinks.shape, sinks.requires_grad),
                    None if k_scale is None else (k_scale.dtype, k_scale.device, k_scale.shape),
                    None if v_scale is None else (v_scale.dtype, v_scale.device, v_scale.shape))
            prepared = self._kinds.get(kind)
            if prepared is None:
                prepared = self._prepare(q, k, v, alibi_slopes, sinks, k_scale, v_scale)
                if len(self._kinds) >= 32:
                    self._kinds.clear()
                self._kinds[kind] = prepared
            elif not self._batch.lengths_known and batches.capturing(k):
                self._batch.bind(q.shape[0], k)  # a later run of the kind, captured: its replays check too
        else:
            prepared = self._prepare(q, k, v, alibi_slopes, sinks, k_scale, v_scale, choose=choose)
        b = self._batch
        spec = prepared.spec
        call = PackedCall(q, k, v, b.cu_seqlens_q, b.cu_seqlens_k, prepared.run_spec, alibi_slopes, b.seqused_k,
                          b.block_table, b.cu_q_host, b.cu_k_host, b.seqused_host,
                          keyed_dropout.draw_key() if spec.dropout_p else None, self._refusal,
                          b.prefix_lens if spec.prefix else None, b.prefix_host if spec.prefix else None,
                          sinks if spec.sinks else None, b.cache_leftpad, b.leftpad_host, k_scale, v_scale)
        return call, prepared

    def _prepare(self, q, k, v, alibi_slopes, sinks=None, k_scale=None, v_scale=None,
                 choose: bool = True) -> _Prepared:
        """A kind's first run: check the tensors against the plan (the batch's metadata was checked
        when it was built), build the spec, select (unless only describing: ``choose=False``)."""
        b, o = self._batch, self._options
        if b.lengths_known and b.names == batches.VARLEN_NAMES:  # a (H, T, D) q or k: say so, before
            inputs.validate_packed_length(b.names.cu_q, b.cu_q_host, "q", q)  # its heads look wrong
            if not b.paged and not b.kv_dense:
                inputs.validate_packed_length(b.names.cu_k, b.cu_k_host, "k", k)
        if not self._inputs_checked:
            inputs.validate_varlen_tensors(q, k, v, b.cu_seqlens_q.device, dense_cache=b.dense_cache,
                                           paged=b.paged and not b.dense_cache, batch=b.size)
        alibi = inputs.validate_alibi(alibi_slopes, q.shape[1], b.size, q.device)
        has_sinks = inputs.validate_sinks(sinks, q.shape[1], q.device)
        cache_dtype = specs.cache_dtype_of(k)
        inputs.validate_kv_scales(k_scale, v_scale, cache_dtype, k.shape[-2], k.device)
        if cache_dtype is not None and _needs_grad(q, k, v, alibi_slopes, sinks):
            raise ValueError(f"an fp8 KV cache ({cache_dtype}) is read forward only, but this call needs a gradient "
                             f"(q, alibi_slopes or sinks requires grad): run it under torch.no_grad()")
        if choose or b.lengths_known:  # explain queues no device checks (its tensors may be meta)
            b.bind(q.shape[0], k)
        spec = specs.for_layer(b, o, q, k, v, alibi, _needs_grad(alibi_slopes),
                               _needs_grad(q, k, v, alibi_slopes, sinks), has_sinks, _needs_grad(sinks))
        notes = o.notes + self._layout_notes
        if not choose or self._refusal is not None:
            return _Prepared(spec, None, notes)
        return _Prepared(spec, choose_backend(spec, o.forced, notes), notes)

    # -- per batch -------------------------------------------------------------------------------

    def update(self, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor], max_seqlen_q: Optional[int] = None,
               max_seqlen_k: Optional[int] = None, *, block_table: Optional[Tensor] = None,
               seqused_k: Optional[Tensor] = None, prefix_lens: Optional[Tensor] = None,
               cache_leftpad: Optional[Tensor] = None) -> None:
        """Point the plan at a new batch of the same form, validated like ``plan``. The plan's own
        buffers are refilled in place, so a CUDA graph captured over ``run`` reads the new batch
        (and runs its device checks on it) when replayed."""
        old = self._batch
        new = _validated_batch(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k,
                               own=False, prefix_lens=prefix_lens, cache_leftpad=cache_leftpad)
        like = lambda b: (f"B={b.size}" + (", a dense cache" if b.dense_cache else
                                           f", block_table of shape {tuple(b.block_table.shape)}" if b.paged else "")
                          + (", with seqused_k" if b.seqused_k is not None else ", without seqused_k")
                          + (", with prefix_lens" if b.prefix_lens is not None else ", without prefix_lens")
                          + (", with cache_leftpad" if b.cache_leftpad is not None else ""))
        if like(new) != like(old):
            raise ValueError(f"update needs a batch like the plan's ({like(old)}), got {like(new)}")
        shared_old = old.cu_seqlens_k is old.cu_seqlens_q
        if shared_old and new.cu_seqlens_k is not None and new.cu_seqlens_k is not new.cu_seqlens_q:
            # The kernels (and a captured graph) read the keys' offsets from the queries' buffer.
            raise ValueError("update: this plan was made with one tensor for cu_seqlens_q and cu_seqlens_k, so "
                             "its keys' offsets live in the queries' buffer; pass one tensor for both, or make the "
                             "plan with two tensors")
        cu_q = _refill(old.cu_seqlens_q, new.cu_seqlens_q)
        cu_k = cu_q if shared_old else _refill(old.cu_seqlens_k, new.cu_seqlens_k)
        self._batch = dataclasses.replace(new, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                          block_table=old.block_table if new.dense_cache else
                                          _refill(old.block_table, new.block_table),
                                          seqused_k=_refill(old.seqused_k, new.seqused_k),
                                          prefix_lens=_refill(old.prefix_lens, new.prefix_lens),
                                          cache_leftpad=_refill(old.cache_leftpad, new.cache_leftpad))
        self._kinds.clear()

    @property
    def batch_size(self) -> int:
        return self._batch.size

    @property
    def max_seqlen_q(self) -> int:
        return self._batch.max_seqlen_q

    @property
    def max_seqlen_k(self) -> int:
        return self._batch.max_seqlen_k

    def __repr__(self) -> str:
        b, o = self._batch, self._options
        return (f"Plan(B={b.size}, max_seqlen_q={b.max_seqlen_q}, max_seqlen_k={b.max_seqlen_k}"
                + (", paged" if b.paged else "") + (", causal" if o.causal else "")
                + f", lengths {'read' if b.lengths_known else 'checked on the device'})")


def _refill(mine: Optional[Tensor], theirs: Optional[Tensor]) -> Optional[Tensor]:
    """``theirs`` copied into the plan's buffer ``mine`` (in place: a captured graph reads it)."""
    if theirs is None:
        return None
    if mine is None or mine.shape != theirs.shape:
        return theirs.clone()
    return mine.copy_(theirs)


# ----------------------------------------------------------------------------------------------
# building plans


def host_read(device: torch.device, max_q: Optional[int], max_k: Optional[int], why: Optional[str] = None) -> bool:
    """Whether a batch's lengths are read on the host now (``layout.host_read_needed``, or ``why``
    one is needed). Inside ``torch.compile`` nothing is read (the operator checks the contents
    when it runs); a call that cannot do without a read is refused."""
    if not torch.compiler.is_compiling():
        return why is not None or layout.host_read_needed(device, max_q, max_k)
    if why is not None:
        raise ValueError(f"{why} need a host read of the offsets, which torch.compile cannot trace: call it "
                         f"outside the compiled region")
    return False


def missing_max(name_q: str, max_q: Optional[int], name_k: str, max_k: Optional[int]) -> Optional[str]:
    """Under ``torch.compile``, the refusal of a call whose max lengths are unknown, else None.
    Raised when the operator runs, so the user gets this ValueError itself, with or without
    ``fullgraph``, where raising while tracing would reach them wrapped in Dynamo's error or,
    without ``fullgraph``, break the graph and run the call eagerly."""
    missing = [name for name, m in ((name_q, max_q), (name_k, max_k)) if m is None]
    if not missing or not torch.compiler.is_compiling():
        return None
    return (f"under torch.compile the maximum sequence lengths must be known without reading tensor data: pass "
            f"{' and '.join(missing)} (ints)" + (" (NJTs built by torch.nested carry it)" if "cached" in missing[0]
                                                 else ""))


def _validated_batch(cu_q, cu_k, max_q, max_k, block_table, seqused_k, *, own: bool = True,
                     prefix_lens: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None) -> batches.Batch:
    """A plan's batch: metadata checked, copied (``own``: the caller's tensors may change later),
    read on the host unless the device is an accelerator and both max lengths are given."""
    inputs.validate_tensor("cu_seqlens_q", cu_q)  # its device decides the read; ``build`` checks the rest
    max_q = inputs.validate_max_seqlen("max_seqlen_q", max_q)
    max_k = inputs.validate_max_seqlen("max_seqlen_k", max_k)
    return batches.build(cu_q, cu_k, max_q, max_k, block_table=block_table, seqused_k=seqused_k,
                         read=host_read(cu_q.device, max_q, max_k), prefix_lens=prefix_lens, copy=own,
                         cache_leftpad=cache_leftpad)


def plan(cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor], max_seqlen_q: Optional[int] = None,
         max_seqlen_k: Optional[int] = None, *, dropout_p=0.0, softmax_scale=None, causal=False,
         window_size=(-1, -1), softcap=0.0, chunk_size=None, prefix_lens: Optional[Tensor] = None,
         return_lse=False, block_table: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
         cache_leftpad: Optional[Tensor] = None, backend=None) -> Plan:
    """Validate a batch once, for ``run`` in every layer (docs/api.md section 10).

    Arguments mean what they mean in ``varlen_attention``; bad metadata or options raise the same
    errors. The plan keeps copies of ``cu_seqlens_*``, ``block_table``, ``seqused_k`` and
    ``prefix_lens``: later changes to the caller's tensors do not reach it (``update`` points it at a
    new batch). ``chunk_size``, ``prefix_lens`` and ``run``'s ``sinks``: docs/api.md section 11. A dense
    cache (``cu_seqlens_k=None`` without ``block_table``, with ``seqused_k`` and ``cache_leftpad``):
    docs/api.md section 12; the plan cannot see the cache length S, so ``run`` refuses a range past it.

    Example::

        p = jagged_sdpa.plan(cu, cu, 5, 5, causal=True)
        for layer in layers:
            out = p.run(q[layer], k[layer], v[layer])
    """
    options = opts.varlen(dropout_p, softmax_scale, causal, window_size, softcap, return_lse, backend, chunk_size)
    return Plan(_validated_batch(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k,
                                 prefix_lens=prefix_lens, cache_leftpad=cache_leftpad), options)


def over_ranges(cu_seqlens_q: Tensor, queries_per_row: int, seqused_k: Tensor, cache_leftpad: Optional[Tensor],
                used_host, leftpad_host, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, chunk_size=None) -> Plan:
    """``plan`` over a dense cache whose key ranges the caller derived on the host from a validity
    mask (``batch.from_ranges``: valid by construction, not checked again), over the caller's
    tensors: the transformers integration's plan of one forward, where ``plan`` would copy and
    re-check what its mask hook has just computed."""
    options = opts.varlen(dropout_p, softmax_scale, causal, window_size, softcap, False, None, chunk_size)
    return Plan(batches.from_ranges(cu_seqlens_q, queries_per_row, seqused_k, cache_leftpad, used_host, leftpad_host),
                options)


def for_call(b: batches.Batch, options: opts.Options, refusal: Optional[str] = None,
             layout_notes: tuple = (), inputs_checked: bool = False) -> Plan:
    """The plan of a ``varlen_attention``/``sdpa`` call over batch ``b``: kept on the batch, so a
    later call over the same metadata and options finds it, kinds and selections included."""
    if refusal is not None or layout_notes or torch.compiler.is_compiling():
        return Plan(b, options, refusal, layout_notes, inputs_checked)
    plans = b.plans
    found = plans.get(options)
    if found is None:
        if len(plans) >= 16:
            plans.clear()
        found = plans[options] = Plan(b, options, inputs_checked=inputs_checked)
    return found


__all__ = ["Plan", "plan"]
