"""The ``torch.library`` operators every attention call runs through: ``jagged_sdpa::attention``,
``jagged_sdpa::attention_backward`` and ``jagged_sdpa::paged_append``.

Why operators: ``torch.compile`` treats them as opaque nodes with fake (shape-only)
implementations and a registered backward, so a model calling ``sdpa``/``varlen_attention``
compiles without graph breaks, and the profiler shows them by name. The public functions and
plans (``plans.py``) check shapes and options, build the tensor-free ``AttnSpec``, select a backend
(at trace time under compile) and call ``run``. What needs tensor *data* of a traced call (reading
cu_seqlens on the host, the device-side checks) happens inside the operator, when it runs
(``_batch_of``, through ``batch.cached``: found again, not redone, for tensors an eager wrapper
or the previous layer's call validated).

The operator's arguments are the call's tensors, the chosen backend's name, the options that
cannot be read off the tensors (one ``options`` string, a constant in a compiled graph) and the
two max lengths (``SymInt``: under dynamic shapes they stay symbolic). The spec is rebuilt from
them (``spec.for_operator``). A call nothing can observe skips the dispatcher and runs the same implementations directly
(``unobserved``).

A backend's ``state`` (what its backward needs beyond q/k/v/out/lse, e.g. a CUDA kernel's RNG
state) crosses the operator as a list of tensors.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils.flop_counter import register_flop_formula

from jagged_sdpa import batch as batches
from jagged_sdpa import layout, paging
from jagged_sdpa.backends import IMPLS, Backend
from jagged_sdpa import spec as specs
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall

_LIB = torch.library.Library("jagged_sdpa", "DEF")

# prefix_lens, sinks (docs/api.md section 11), cache_leftpad (section 12) and an fp8 cache's k_scale/v_scale
# (section 13) come last, with defaults: callers written before them still fit. A dense cache passes no
# block_table (its table is made from B).
_CALL_ARGS = ("Tensor cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? seqused_k, Tensor? block_table, "
              "Tensor? alibi_slopes, Tensor? dropout_key, str backend, str options, SymInt max_seqlen_q, "
              "SymInt max_seqlen_k, Tensor? prefix_lens=None, Tensor? sinks=None, Tensor? cache_leftpad=None, "
              "Tensor? k_scale=None, Tensor? v_scale=None")
_LIB.define(f"attention(Tensor q, Tensor k, Tensor v, {_CALL_ARGS}) -> (Tensor, Tensor, Tensor[])")
_LIB.define(f"attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            f"Tensor[] state, {_CALL_ARGS}) -> Tensor[]")
_LIB.define("paged_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, Tensor seqused_k, "
            "Tensor k_new, Tensor v_new, Tensor cu_seqlens_new, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor")

def split_grads(alibi_grad: bool, sinks_grad: bool, grads) -> tuple:
    """A backward's (dq, dk, dv[, dslopes][, dsinks]) as (dq, dk, dv, dslopes or None, dsinks or None):
    the one reading of a backend's gradients, for both autograd paths."""
    dslopes = grads[3] if alibi_grad else None
    dsinks = grads[3 + alibi_grad] if sinks_grad else None
    return grads[0], grads[1], grads[2], dslopes, dsinks


# ----------------------------------------------------------------------------------------------
# the call of an operator run: its batch validated (``batch.cached``: once for the same tensors)


def _batch_of(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, parsed: dict, max_q, max_k, prefix_lens,
              cache_leftpad) -> batches.Batch:
    """The operator call's batch, its contents checked: read on the CPU (found again when the
    wrapper, or the previous layer's call, read the same tensors), else queued as device-side
    asserts; bound to this call's q length and cache."""
    kv_dense = parsed["kv_dense"]
    b = batches.cached(cu_seqlens_q, None if kv_dense else cu_seqlens_k, int(max_q), int(max_k),
                       block_table=block_table, seqused_k=seqused_k,
                       read=layout.host_read_needed(q.device, int(max_q), int(max_k)),
                       names=batches.VARLEN_NAMES if parsed["entry"] == "varlen" else batches.SDPA_NAMES,
                       kv_dense=kv_dense, prefix_lens=prefix_lens, cache_leftpad=cache_leftpad)
    b.bind(q.shape[0], k)
    return b


def _call_of(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, dropout_key, options,
             max_q, max_k, prefix_lens=None, sinks=None, cache_leftpad=None, k_scale=None, v_scale=None,
             b: Optional[batches.Batch] = None) -> PackedCall:
    """The call the operator runs, over its checked batch (``_batch_of``, unless given)."""
    call = _rebuilt(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, dropout_key, options,
                    max_q, max_k, prefix_lens, sinks, cache_leftpad, k_scale, v_scale)
    spec = call.spec
    if b is None:
        b = _batch_of(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, specs.parse_options(options), max_q,
                      max_k, prefix_lens, cache_leftpad)
    # The kernels read the batch's metadata: copies of what was read and checked on the host, else
    # the caller's tensors (checked on the device).
    own = dict(cu_seqlens_q=b.cu_seqlens_q, cu_seqlens_k=cu_seqlens_k if spec.kv_dense else b.cu_seqlens_k,
               seqused_k=b.seqused_k, block_table=b.block_table, prefix_lens=b.prefix_lens,
               cache_leftpad=b.cache_leftpad)
    if not b.lengths_known:
        return call.replace(**own)
    return call.replace(**own, cu_q_host=b.cu_q_host, cu_k_host=b.cu_k_host, seqused_k_host=b.seqused_host,
                        prefix_host=b.prefix_host, leftpad_host=b.leftpad_host, spec=spec.replace(lengths_known=True))


def _rebuilt(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, dropout_key, options,
             max_q, max_k, prefix_lens=None, sinks=None, cache_leftpad=None, k_scale=None, v_scale=None) -> PackedCall:
    """The call from the operator's arguments alone (contents not checked)."""
    spec = specs.for_operator(q, k, v, cu_seqlens_q, seqused_k, block_table, alibi_slopes, options, max_q, max_k,
                          prefix_lens, sinks, cache_leftpad)
    return PackedCall(q, k, v, cu_seqlens_q, cu_seqlens_k, spec, alibi_slopes, seqused_k, block_table,
                      dropout_key=dropout_key, prefix_lens=prefix_lens, sinks=sinks, cache_leftpad=cache_leftpad,
                      k_scale=k_scale, v_scale=v_scale)


# ----------------------------------------------------------------------------------------------
# attention: forward


# A ``backend`` argument starting with this carries a refusal instead (``PackedCall.refusal``).
_REFUSED = "refused: "


def _impl_of(backend: str):
    """The backend an operator call names; a refused call raises its ValueError here, when the
    operator runs."""
    if backend.startswith(_REFUSED):
        raise ValueError(backend[len(_REFUSED):])
    return IMPLS[Backend(backend)]


def _lse_rows(spec: AttnSpec) -> int:
    """The lse is returned when asked for or needed by the backward; else an empty (Hq, 0)."""
    return spec.total_q if (spec.return_lse or spec.needs_grad) else 0


def keeping_lse_spec(spec: AttnSpec) -> AttnSpec:
    """A call that needs a gradient asks its backend for the lse, which the backward reads."""
    return spec.replace(return_lse=True) if spec.needs_grad and not spec.return_lse else spec


def _keeping_lse(call: PackedCall) -> PackedCall:
    spec = keeping_lse_spec(call.spec)
    return call if spec is call.spec else call.replace(spec=spec)


def _forward(impl, call: PackedCall) -> tuple:
    """The operator's real implementation, given its backend and call: (out, lse, state list)."""
    spec = call.spec
    with torch.no_grad():
        result = impl.forward(_keeping_lse(call))
    lse = result.lse
    if lse is None:
        lse = torch.empty(spec.heads_q, _lse_rows(spec), dtype=torch.float32, device=call.q.device)
    return result.out, lse, list(result.state or ())


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, dropout_key, backend,
               options, max_seqlen_q, max_seqlen_k, prefix_lens=None, sinks=None, cache_leftpad=None, k_scale=None,
               v_scale=None):
    impl = _impl_of(backend)  # a refused call is refused before its contents are read
    parsed = specs.parse_options(options)
    b = _batch_of(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, parsed, max_seqlen_q, max_seqlen_k,
                  prefix_lens, cache_leftpad)
    # The layers of a compiled model call the operator over one batch with tensors of one kind: the
    # first builds the call and its backend's ``forward_runner`` (kept on the batch, as a plan keeps
    # its kinds), the others swap in their q, k, v, sinks and dropout key.
    kind = (backend, options, q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(),
            v.dtype, alibi_slopes is None, sinks is None, k_scale is None, v_scale is None)
    hit = b.runners.get(kind)
    if hit is None:
        call = _call_of(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, dropout_key,
                        options, max_seqlen_q, max_seqlen_k, prefix_lens, sinks, cache_leftpad, k_scale, v_scale, b)
        runner = None if parsed["needs_grad"] else impl.forward_runner(call)
        if runner is None:
            return _forward(impl, call)
        if len(b.runners) >= 32:
            b.runners.clear()
        # kept without the layer's tensors: a batch found again must not hold a finished model's cache alive
        hit = b.runners[kind] = (call.replace(q=None, k=None, v=None, sinks=None, dropout_key=None), runner)
    template, runner = hit
    call = template.replace(q=q, k=k, v=v, sinks=sinks, dropout_key=dropout_key)
    result = runner(call)
    lse = result.lse
    if lse is None:
        lse = torch.empty(call.spec.heads_q, _lse_rows(call.spec), dtype=torch.float32, device=q.device)
    return result.out, lse, list(result.state or ())


def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, dropout_key,
                    backend, options, max_seqlen_q, max_seqlen_k, prefix_lens=None, sinks=None, cache_leftpad=None,
                    k_scale=None, v_scale=None):
    call = _rebuilt(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, dropout_key, options,
                    max_seqlen_q, max_seqlen_k, prefix_lens, sinks, cache_leftpad, k_scale, v_scale)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    lse = q.new_empty(q.shape[1], _lse_rows(call.spec), dtype=torch.float32)
    state = () if backend.startswith(_REFUSED) else IMPLS[Backend(backend)].fake_state(call)
    return out, lse, list(state)


_LIB.impl("attention", _attention, "CompositeExplicitAutograd")
torch.library.register_fake("jagged_sdpa::attention", _attention_fake, lib=_LIB)


# ----------------------------------------------------------------------------------------------
# attention: backward


def _attention_backward(grad_out, q, k, v, out, lse, state, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                        alibi_slopes, dropout_key, backend, options, max_seqlen_q, max_seqlen_k, prefix_lens=None,
                        sinks=None, cache_leftpad=None, k_scale=None, v_scale=None):
    call = _call_of(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, dropout_key,
                    options, max_seqlen_q, max_seqlen_k, prefix_lens, sinks, cache_leftpad)
    impl = _impl_of(backend)
    grads = impl.backward(call, out, lse, grad_out.contiguous(), tuple(state))
    return list(grads)


def _attention_backward_fake(grad_out, q, k, v, out, lse, state, cu_seqlens_q, cu_seqlens_k, seqused_k,
                             block_table, alibi_slopes, dropout_key, backend, options, max_seqlen_q, max_seqlen_k,
                             prefix_lens=None, sinks=None, cache_leftpad=None, k_scale=None, v_scale=None):
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    parsed = specs.parse_options(options)
    if parsed["alibi_grad"]:
        grads.append(torch.empty_like(alibi_slopes))
    if parsed["sinks_grad"]:
        grads.append(torch.empty_like(sinks))
    return grads


_LIB.impl("attention_backward", _attention_backward, "CompositeExplicitAutograd")
torch.library.register_fake("jagged_sdpa::attention_backward", _attention_backward_fake, lib=_LIB)

# The operator's arguments by name, in schema order (the dispatcher hands ``setup_context`` the
# inputs without the trailing ones left at their defaults): tensors saved for the backward, and
# the scalars that describe the call.
_ARG_NAMES = tuple(inspect.signature(_attention).parameters)
_SCALAR_ARGS = ("backend", "options", "max_seqlen_q", "max_seqlen_k")
_TENSOR_ARGS = tuple(name for name in _ARG_NAMES if name not in _SCALAR_ARGS)


def _setup_context(ctx, inputs, output):
    out, lse, state = output
    args = dict(zip(_ARG_NAMES, inputs))
    ctx.save_for_backward(*(args.get(name) for name in _TENSOR_ARGS), out, lse, *state)
    ctx.scalars = {name: args[name] for name in _SCALAR_ARGS}
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse, _grad_state):
    saved = ctx.saved_tensors
    args = dict(zip(_TENSOR_ARGS, saved))
    out, lse, *state = saved[len(_TENSOR_ARGS):]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    grads = torch.ops.jagged_sdpa.attention_backward(grad_out, q, k, v, out, lse, state, **args, **ctx.scalars)
    parsed = specs.parse_options(ctx.scalars["options"])
    dq, dk, dv, dslopes, dsinks = split_grads(parsed["alibi_grad"], parsed["sinks_grad"], grads)
    by_name = {"q": dq, "k": dk, "v": dv, "alibi_slopes": dslopes, "sinks": dsinks}
    return tuple(by_name.get(name) for name in _ARG_NAMES)[:len(ctx.needs_input_grad)]


torch.library.register_autograd("jagged_sdpa::attention", _backward, setup_context=_setup_context, lib=_LIB)


# ----------------------------------------------------------------------------------------------
# FLOP counts (torch.utils.flop_counter.FlopCounterMode), by torch's own convention for attention:
# 2 * m * n * k per matmul, over the full Lq x Lk of each sequence (masks not discounted); forward
# Q.K^T and P.V, backward those recomputed or propagated through five matmuls.


def _pairs(q: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
           max_seqlen_k) -> int:
    """Sum over sequences of Lq * Lk, read from the offsets; with fake or meta offsets (a count
    taken while tracing) an upper bound: every query against ``max_seqlen_k`` keys."""
    index = (cu_seqlens_q, cu_seqlens_k, seqused_k)
    if any(t is not None and (t.device.type == "meta" or is_fake(t)) for t in index):
        return int(q.shape[0]) * int(max_seqlen_k)
    host = layout.read_host(*[t for t in index if t is not None])
    lengths_k = host[-1] if seqused_k is not None else layout.host_lengths(host[1])
    return sum(a * b for a, b in zip(layout.host_lengths(host[0]), lengths_k))


def _flops(q, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k, products_d: int, products_dv: int) -> int:
    """2 * pairs * Hq * (head dim per matmul over D, and over Dv)."""
    pairs = _pairs(q, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k)
    return 2 * q.shape[1] * pairs * (products_d * q.shape[-1] + products_dv * v.shape[-1])


def _max_k_arg(args: tuple, kwargs: dict):
    """max_seqlen_k among the arguments after seqused_k (block_table, ..., max_seqlen_q, max_seqlen_k,
    then the optional prefix_lens and sinks)."""
    return args[6] if len(args) > 6 else kwargs["max_seqlen_k"]


@register_flop_formula(torch.ops.jagged_sdpa.attention, get_raw=True)
def _attention_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, *args, out_val=None, **kwargs) -> int:
    return _flops(q, v, cu_seqlens_q, cu_seqlens_k, seqused_k, _max_k_arg(args, kwargs), 1, 1)  # Q.K^T, P.V


@register_flop_formula(torch.ops.jagged_sdpa.attention_backward, get_raw=True)
def _attention_backward_flops(grad_out, q, k, v, out, lse, state, cu_seqlens_q, cu_seqlens_k, seqused_k, *args,
                              out_val=None, **kwargs) -> int:
    # Q.K^T again, dS.K, dS^T.Q over D; dO.V^T, P^T.dO over Dv
    return _flops(q, v, cu_seqlens_q, cu_seqlens_k, seqused_k, _max_k_arg(args, kwargs), 3, 2)


def unobserved(call: PackedCall) -> bool:
    """Whether nothing could see the operator run: eager, plain tensors, no dispatch or function
    mode, no profiler. Such a call runs the operator's implementations directly (the same
    functions, the same results), which saves the dispatcher's round trip into Python (~10 us of a
    ~65 us tiny call) and, with a gradient, ``register_autograd``'s generic wrapper (pytrees over
    the ``Tensor[]`` state and the schema's defaults: ~190 us of a ~370 us tiny training call)."""
    return (not torch.compiler.is_compiling() and all(type(t) is Tensor for t in (call.q, call.k, call.v))
            and not torch._C._len_torch_dispatch_stack() and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._autograd._profiler_enabled())


class _UnobservedAttention(torch.autograd.Function):
    """An unobserved call that needs a gradient: the backend's forward and backward, as the
    operator runs them, under one plain autograd Function (whose forward runs without grad)."""

    @staticmethod
    def forward(ctx, impl, call: PackedCall, q, k, v, alibi_slopes, sinks):
        result = impl.forward(_keeping_lse(call))
        ctx.impl, ctx.call = impl, call
        ctx.save_for_backward(q, k, v, result.out, result.lse, *(result.state or ()))
        ctx.mark_non_differentiable(result.lse)
        return result.out, result.lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, *state = ctx.saved_tensors
        call = ctx.call
        if not (q is call.q and k is call.k and v is call.v):
            call = call.replace(q=q, k=k, v=v)
        grads = ctx.impl.backward(call, out, lse, grad_out.contiguous(), tuple(state))
        dq, dk, dv, dslopes, dsinks = split_grads(call.spec.alibi_grad, call.spec.sinks_grad, grads)
        return None, None, dq, dk, dv, dslopes, dsinks


def run(backend: Optional[Backend], call: PackedCall, runner=None) -> AttnOutput:
    """Run ``call`` on ``backend`` through the operator: (out, lse or None). A call with a
    ``refusal`` (and no backend) is traced all the same and raises it when the operator runs.
    ``runner``: the backend's ``forward_runner`` for calls of this kind (a plan's), used where
    the call would run the backend's forward directly."""
    spec = call.spec
    if call.refusal is None and unobserved(call):
        if runner is not None and not spec.needs_grad:
            return runner(call)
        if spec.needs_grad:
            out, lse = _UnobservedAttention.apply(IMPLS[backend], call, call.q, call.k, call.v, call.alibi_slopes,
                                                  call.sinks)
            return AttnOutput(out, lse if spec.return_lse else None)
        result = IMPLS[backend].forward(call)  # what ``_forward`` does, without the lse it must return
        return result if spec.return_lse or result.lse is None else AttnOutput(result.out, None)
    compiling = torch.compiler.is_compiling()
    args = (call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k,
            None if spec.dense_cache else call.block_table,
            call.alibi_slopes, call.dropout_key, _REFUSED + call.refusal if call.refusal else backend.value,
            specs.options_of(spec), spec.max_seqlen_q, spec.max_seqlen_k, call.prefix_lens, call.sinks,
            call.cache_leftpad, call.k_scale, call.v_scale)
    if spec.needs_grad or compiling:
        out, lse, _ = torch.ops.jagged_sdpa.attention(*args)
    else:  # nothing to record: skip the autograd layer's Python wrapper (~10 us a call)
        with torch._C._AutoDispatchBelowAutograd():
            out, lse, _ = torch.ops.jagged_sdpa.attention.default(*args)
    return AttnOutput(out, lse if spec.return_lse else None)


# ----------------------------------------------------------------------------------------------
# paged_append


def _paged_append_fake(k_cache, v_cache, block_table, seqused_k, k_new, v_new, cu_seqlens_new, k_scale=None,
                       v_scale=None):
    return torch.empty_like(seqused_k)


_LIB.impl("paged_append", paging.append_checked, "CompositeExplicitAutograd")
torch.library.register_fake("jagged_sdpa::paged_append", _paged_append_fake, lib=_LIB)
