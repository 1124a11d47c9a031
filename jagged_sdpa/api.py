"""The public functions ``sdpa``, ``varlen_attention`` and ``explain``: each finds its call's plan
(``plans.Plan``, over the batch of its metadata tensors, validated once while they are unchanged)
and runs or explains it. NJT unwrapping lives here; no backend-specific rule does.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from jagged_sdpa import batch as batches
from jagged_sdpa import layout
from jagged_sdpa import options as opts
from jagged_sdpa import plans
from jagged_sdpa.checks import inputs
from jagged_sdpa.selection import Explanation


# ----------------------------------------------------------------------------------------------
# sdpa


def _sdpa_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
               window_size, softcap, backend, chunk_size=None, prefix_lens=None):
    """Validate an sdpa call; returns its plan and the packed q, k, v (views of the NJTs' buffers)."""
    inputs.validate_attn_mask(attn_mask)
    size_q, size_k, _ = inputs.validate_sdpa_tensors(query, key, value, enable_gqa)
    options = opts.sdpa(dropout_p, is_causal, scale, causal_alignment, window_size, softcap, backend, chunk_size)
    kv_dense = not key.is_nested
    given_q = layout.njt_cached_max_seqlen(query)
    given_k = size_k[2] if kv_dense else layout.njt_cached_max_seqlen(key)
    if query.lengths() is not None or not kv_dense and (key.lengths() is not None or value.lengths() is not None):
        return _sdpa_plan_read(query, key, value, kv_dense, given_q, given_k, options, prefix_lens)
    q_packed, _ = layout.njt_packed(query)
    notes = ()
    if kv_dense:
        k_packed, v_packed = layout.dense_kv_packed(key), layout.dense_kv_packed(value)
        if size_k[1] > 1:
            notes = ("dense key/value copied into packed (B*S, Hkv, D) buffers",)
    else:
        (k_packed, _), (v_packed, _) = layout.njt_packed(key), layout.njt_packed(value)
    offsets_q, offsets_k = query.offsets(), None if kv_dense else key.offsets()
    if not kv_dense and value.offsets() is not offsets_k:
        _check_same_structure(offsets_k, value.offsets(), k_packed.shape[0], v_packed.shape[0])
    refusal = plans.missing_max("query's cached max seqlen", given_q, "key's cached max seqlen", given_k)
    if torch.compiler.is_compiling():  # nothing read: upper bounds to trace with when a max is missing
        b = batches.build(offsets_q, offsets_k, q_packed.shape[0] if given_q is None else given_q,
                          k_packed.shape[0] if given_k is None else given_k, read=False, names=batches.SDPA_NAMES,
                          kv_dense=kv_dense, prefix_lens=prefix_lens)
    else:
        b = batches.cached(offsets_q, offsets_k, given_q, given_k, read=plans.host_read(query.device, given_q, given_k),
                           names=batches.SDPA_NAMES, kv_dense=kv_dense, prefix_lens=prefix_lens)
    return plans.for_call(b, options, refusal, notes, inputs_checked=True), q_packed, k_packed, v_packed


_STRUCTURE = "key and value must have the same ragged structure (sequence lengths)"


def _check_same_structure(offsets_k: Tensor, offsets_v: Tensor, total_k: int, total_v: int) -> None:
    """Key and value built separately (each its own offsets tensor) must hold the same sequences:
    compared in place on the CPU (a ValueError), else as a device-side assert (no sync; and
    torch.compile cannot trace a data-dependent branch)."""
    if total_k != total_v:
        raise ValueError(f"{_STRUCTURE}: key has {total_k} tokens, value {total_v}")
    if offsets_k.device.type == "cpu" and not torch.compiler.is_compiling():
        if not torch.equal(offsets_k, offsets_v):
            raise ValueError(_STRUCTURE)
    else:
        torch._assert_async((offsets_k == offsets_v).all(), f"jagged_sdpa: {_STRUCTURE}")


def _sdpa_plan_read(query, key, value, kv_dense, given_q, given_k, options, prefix_lens=None):
    """An sdpa call whose structure needs a host read: NJTs with holes (``lengths()``), gathered
    into packed copies."""
    plans.host_read(query.device, given_q, given_k, "NJTs with holes (lengths())")
    njts = {"query": query} if kv_dense else {"query": query, "key": key, "value": value}
    tensors, slots = [], {}
    for name, njt in njts.items():
        parts = (njt.offsets(),) if njt.lengths() is None else (njt.offsets(), njt.lengths())
        slots[name] = range(len(tensors), len(tensors) + len(parts))
        tensors += parts
    host = layout.read_host(*tensors)
    notes, packed, cu = [], {}, {}
    for name, njt in njts.items():
        slot = slots[name]
        packed[name], cu[name] = _njt_side(name, njt, host[slot[0]], host[slot[1]] if len(slot) == 2 else None,
                                           notes)
    if kv_dense:
        k_packed, v_packed = layout.dense_kv_packed(key), layout.dense_kv_packed(value)
        cu_k = None
    else:
        if layout.host_lengths(cu["value"][1]) != layout.host_lengths(cu["key"][1]):
            raise ValueError(_STRUCTURE)
        k_packed, v_packed, cu_k = packed["key"], packed["value"], cu["key"][0]
    host_cu = [cu["query"][1]] + ([] if kv_dense else [cu["key"][1]])
    b = batches.build(cu["query"][0], cu_k, given_q, given_k, read=True, names=batches.SDPA_NAMES, kv_dense=kv_dense,
                      host=host_cu, prefix_lens=prefix_lens)
    return plans.for_call(b, options, None, tuple(notes), inputs_checked=True), packed["query"], k_packed, v_packed


def _njt_side(name, njt, offsets_host, lengths_host, notes):
    """Packed buffer of one NJT argument, and its int32 cu_seqlens (device, host); an NJT with
    holes is gathered: sequence b is values[offsets[b] : offsets[b] + lengths[b]]."""
    if lengths_host is None:
        packed, _ = layout.njt_packed(njt)
        return packed, (njt.offsets().to(torch.int32), offsets_host)
    n_values = njt.transpose(1, 2).values().shape[0] if njt.requires_grad else njt._values.shape[1]
    for b, (o, n) in enumerate(zip(offsets_host, lengths_host)):
        if o < 0 or n < 0 or o + n > n_values:
            raise ValueError(f"{name} has a hole-y sequence {b} (offset {o}, length {n}) outside its {n_values} values")
    packed, _ = layout.njt_packed(njt, (offsets_host, lengths_host))
    notes.append(f"{name} has holes (lengths()): gathered into a packed copy")
    cu = [0]
    for n in lengths_host:
        cu.append(cu[-1] + n)
    return packed, (layout.njt_cu_seqlens(njt, tuple(cu)), cu)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
         causal_alignment="top_left", window_size=None, softcap=None, alibi_slopes=None, sinks=None, chunk_size=None,
         prefix_lens=None, backend=None):
    """Scaled dot-product attention on jagged nested tensors, one sequence at a time, unpadded.

    Shapes: query (B, Hq, j_q, D), the ``.transpose(1, 2)`` of a (B, j_q, Hq, D) jagged NJT; key
    (B, Hkv, j_k, D) and value (B, Hkv, j_k, Dv) NJTs (j_k may differ from j_q), or dense
    (B, Hkv, S, D) / (B, Hkv, S, Dv) tensors that every query sequence attends to. Returns an NJT
    (B, Hq, j_q, Dv) sharing query's offsets. For every b the result equals dense SDPA on
    sequence b alone.

    Causal alignment for a sequence with 2 queries and 5 keys (1 = attended)::

        top_left (default, PyTorch)     bottom_right (flash-attn, KV-cache decoding)
            1 0 0 0 0                       1 1 1 1 0
            1 1 0 0 0                       1 1 1 1 1

    ``window_size=(left, right)`` keeps keys j with i' - left <= j <= i' + right (-1 unbounded),
    i' the aligned query position; ``softcap`` maps scores to c * tanh(s / c) after scaling;
    ``alibi_slopes`` (Hq,) or (B, Hq) float32 adds -slope * |i' - j|. Order: scale, softcap, ALiBi,
    masks. A query row that sees no key outputs zeros. Dropout draws from PyTorch's default
    generator. ``sinks`` (Hq,) float: a per-head logit added to every row's softmax denominator;
    ``chunk_size`` C: a row at aligned position i' sees only keys j with j // C == i' // C;
    ``prefix_lens`` int32 (B,): rows at aligned positions < P_b also see every key j < P_b
    (docs/api.md section 11). When the NJTs carry their max seqlen (they do when built by torch) and live on a
    GPU, no host sync happens; on the CPU offsets are always read and validated.

    Example::

        q = torch.nested.nested_tensor([torch.randn(5, 8, 64), torch.randn(3, 8, 64)],
                                       layout=torch.jagged).transpose(1, 2)
        out = jagged_sdpa.sdpa(q, q, q, is_causal=True)

    Raises:
        TypeError: wrong kinds, layouts or dtypes. ValueError: shapes, sizes, devices, contents,
        option values, non-None ``attn_mask``. NoBackendError: no backend (or the forced one)
        can take the call; the message lists every backend's reasons.
    """
    # NJT attribute reads (shape, dtype, device, ...) go through NestedTensor.__torch_function__
    # (~10 us each, dozens per call); with it disabled they are plain C reads. Ops on NJTs still
    # reach their real implementation through __torch_dispatch__.
    with torch._C.DisableTorchFunctionSubclass():
        inputs.validate_not_meta("query", query)  # key/value on another device: the device checks say so
        plan, q, k, v = _sdpa_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                   causal_alignment, window_size, softcap, backend, chunk_size, prefix_lens)
    out = plan._run(q, k, v, alibi_slopes, sinks).out
    with torch._C.DisableTorchFunctionSubclass():
        return layout.packed_to_njt(out, query, plan._batch.cu_seqlens_q, plan._batch.max_seqlen_q)


# ----------------------------------------------------------------------------------------------
# varlen


def _varlen_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 window_size, softcap, return_lse, block_table, seqused_k, backend, chunk_size=None,
                 prefix_lens=None, cache_leftpad=None) -> plans.Plan:
    """The plan of a varlen_attention call: its batch validated (once for the same metadata)."""
    inputs.validate_tensor("q", q)
    options = opts.varlen(dropout_p, softmax_scale, causal, window_size, softcap, return_lse, backend, chunk_size)
    max_q = inputs.validate_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = inputs.validate_max_seqlen("max_seqlen_k", max_seqlen_k)
    if max_k is None and cu_seqlens_k is None and block_table is None and isinstance(k, Tensor) and k.dim() == 4 \
            and (q.device.type != "cpu" or torch.compiler.is_compiling()):
        max_k = k.shape[1]  # a dense cache (docs/api.md section 12): its length S bounds every row, with no host read
    if torch.compiler.is_compiling():  # nothing read: upper bounds to trace with when a max is missing
        refusal = plans.missing_max("max_seqlen_q", max_q, "max_seqlen_k", max_k)
        if refusal is not None:
            inputs.validate_tensor("k", k)
            max_q = q.shape[0] if max_q is None else max_q
            max_k = (k.shape[0] * (k.shape[1] if block_table is not None else 1)) if max_k is None else max_k
        b = batches.build(cu_seqlens_q, cu_seqlens_k, max_q, max_k, block_table=block_table, seqused_k=seqused_k,
                          read=False, prefix_lens=prefix_lens, cache_leftpad=cache_leftpad)
        return plans.for_call(b, options, refusal)
    b = batches.cached(cu_seqlens_q, cu_seqlens_k, max_q, max_k, block_table=block_table, seqused_k=seqused_k,
                       read=plans.host_read(q.device, max_q, max_k), prefix_lens=prefix_lens,
                       cache_leftpad=cache_leftpad)
    return plans.for_call(b, options)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                     dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, sinks=None, chunk_size=None, prefix_lens=None, return_lse=False,
                     block_table=None, seqused_k=None, cache_leftpad=None, k_scale=None, v_scale=None, backend=None):
    """Attention over packed variable-length sequences, with flash-attn's varlen semantics.

    Shapes: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), Hq % Hkv == 0;
    cu_seqlens_q/_k int32 (B + 1,) on q's device, starting at 0, non-decreasing, ending at
    total_q/total_k (zero-length sequences allowed). Paged KV cache: k/v
    (num_blocks, block_size, Hkv, D/Dv), ``block_table`` int32 (B, max_blocks), ``seqused_k``
    int32 (B,) and ``cu_seqlens_k=None``. Dense KV cache read in place (docs/api.md section 12): k/v
    (B, S, Hkv, D/Dv) with any strides whose last is 1 (transformers' ``(B, Hkv, S, D)`` caches as
    ``.transpose(1, 2)``), ``cu_seqlens_k=None``, no ``block_table``, ``seqused_k`` int32 (B,) and
    ``cache_leftpad`` int32 (B,) (default zeros): row b's keys are cache slots
    ``[cache_leftpad[b], cache_leftpad[b] + seqused_k[b])``; ``max_seqlen_k=None`` means S (no read).
    fp8 KV cache (docs/api.md section 13): a paged or dense cache in ``torch.float8_e4m3fn`` or
    ``float8_e5m2`` with ``k_scale``/``v_scale`` float32 () or (Hkv,): the keys are
    ``k.float() * k_scale`` (values likewise); forward only, q in float16/bfloat16/float32.

    ``causal=True`` is bottom-right aligned: query i of a sequence with Lq queries and Lk keys
    sees keys j <= i + Lk - Lq (for Lq=2, Lk=5: rows ``1 1 1 1 0`` and ``1 1 1 1 1``).
    ``window_size``, ``softcap`` (0 = off) and ``alibi_slopes`` use the same alignment.

    ``sinks`` float (Hq,), ``chunk_size`` and ``prefix_lens`` int32 (B,): docs/api.md section 11 (see
    ``sdpa``), with the same alignment.

    Returns out (total_q, Hq, Dv), or (out, lse) with ``return_lse=True``, lse float32
    (Hq, total_q) natural log. A row that sees no key outputs zeros and lse -inf (with sinks:
    sink_h, and every lse includes the sink).

    Host syncs: ``max_seqlen_q/_k=None`` costs one device-to-host read (on the CPU, reading is
    always done to validate cu_seqlens, and costs microseconds).

    ``backend`` forces one backend, by ``jagged_sdpa.Backend`` or name: ``"flash_varlen"`` and
    ``"efficient"`` (PyTorch's CUDA kernels), ``"cpu_fused"`` (the compiled CPU kernel),
    ``"triton"`` (CUDA; the CPU only under ``TRITON_INTERPRET=1``) or ``"math"`` (every device);
    one that cannot take the call raises ``NoBackendError`` with its reasons. ``None`` (default):
    the first eligible in that order (``math`` before ``triton`` on the CPU), or in the order of
    ``use_backends``. ``jagged_sdpa.explain`` shows the choice (docs/api.md section 4).

    Example::

        cu = torch.tensor([0, 5, 8], dtype=torch.int32)
        out = jagged_sdpa.varlen_attention(q, k, v, cu, cu, 5, 5, causal=True)

    Raises:
        TypeError: wrong kinds or dtypes (cu_seqlens, block_table and seqused_k must be int32).
        ValueError: shapes, sizes, contents, devices, option values, max_seqlen_* too small,
        block ids out of range. NoBackendError: no backend (or the forced one) can take the call.
    """
    inputs.validate_not_meta("q", q)  # k/v on another device: the device checks say so
    plan = _varlen_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                        causal, window_size, softcap, return_lse, block_table, seqused_k, backend, chunk_size,
                        prefix_lens, cache_leftpad)
    return plan.run(q, k, v, alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale)


# ----------------------------------------------------------------------------------------------
# explain

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_VARLEN_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def explain(*args, **kwargs) -> Explanation:
    """Which backend a call of ``sdpa`` or ``varlen_attention`` would get, and why not the others.

    Takes exactly the arguments of either function (a call with ``cu_seqlens_q``, or whose first
    argument is not a nested tensor, is a varlen call), validates them like the call would, and
    runs no attention kernel. ``e.chosen`` is the Backend or None, ``e.reasons`` maps every
    backend to its list of reasons (empty = eligible), ``print(e)`` shows a table. The signature
    shown is the union of both forms (the first three by keyword: ``query``/``key``/``value`` or
    ``q``/``k``/``v``); each form takes only its own function's arguments:
    """
    if "cu_seqlens_q" in kwargs or "q" in kwargs:
        is_varlen = True
    elif "query" in kwargs:
        is_varlen = False
    else:
        is_varlen = not (args and isinstance(args[0], Tensor) and args[0].is_nested)
    names = _VARLEN_ARGS if is_varlen else _SDPA_ARGS
    if len(args) > len(names):
        raise TypeError(f"explain takes at most {len(names)} positional arguments for this call, got {len(args)}")
    bound = dict(zip(names, args))
    for key in kwargs:
        if key in bound:
            raise TypeError(f"explain got multiple values for argument {key!r}")
    bound.update(kwargs)
    fn = _explain_varlen if is_varlen else _explain_sdpa
    return fn(**bound)


def _explain_signature() -> inspect.Signature:
    """``explain``'s signature for ``help()``: q, k, v, then every argument of ``sdpa`` and of
    ``varlen_attention`` (by keyword, or positionally in the order of the function called)."""
    P = inspect.Parameter
    forms = [list(inspect.signature(fn).parameters.values())[3:] for fn in (varlen_attention, sdpa)]
    defaults: dict = {}
    for param in forms[0] + forms[1]:
        default = None if param.default is P.empty else param.default
        defaults[param.name] = default if defaults.get(param.name, default) == default else None  # differ: None
    params = [P(name, P.POSITIONAL_ONLY) for name in ("q", "k", "v")] + [P("args", P.VAR_POSITIONAL)]
    params += [P(name, P.KEYWORD_ONLY, default=default) for name, default in defaults.items()]
    return inspect.Signature(params, return_annotation=Explanation)


explain.__signature__ = _explain_signature()
if explain.__doc__:  # (None under python -OO)
    explain.__doc__ += "".join(f"\n        explain{inspect.signature(fn)}  # {fn.__name__}\n"
                               for fn in (sdpa, varlen_attention))


def _explain_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  *, causal_alignment="top_left", window_size=None, softcap=None, alibi_slopes=None, sinks=None,
                  chunk_size=None, prefix_lens=None, backend=None):
    with torch._C.DisableTorchFunctionSubclass():
        plan, q, k, v = _sdpa_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                   causal_alignment, window_size, softcap, backend, chunk_size, prefix_lens)
        return plan.explain(q, k, v, alibi_slopes, sinks)


def _explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, dropout_p=0.0,
                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    sinks=None, chunk_size=None, prefix_lens=None, return_lse=False, block_table=None,
                    seqused_k=None, cache_leftpad=None, k_scale=None, v_scale=None, backend=None):
    plan = _varlen_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                        causal, window_size, softcap, return_lse, block_table, seqused_k, backend, chunk_size,
                        prefix_lens, cache_leftpad)
    return plan.explain(q, k, v, alibi_slopes, sinks, k_scale, v_scale)
