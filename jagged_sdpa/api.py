"""The public functions: validate -> host read -> spec -> select -> run -> unpack.

Argument normalisation and the order of operations live here; no backend-specific rule does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from jagged_sdpa import layout
from jagged_sdpa import ops
from jagged_sdpa.backends import Backend, keyed_dropout
from jagged_sdpa.checks import inputs
from jagged_sdpa.checks import contents
from jagged_sdpa.selection import Explanation, choose, select, to_backend, with_notes
from jagged_sdpa.spec import AttnSpec, PackedCall


def _forced(backend) -> Optional[Backend]:
    return None if backend is None else to_backend(backend)


def _host_read(max_q: Optional[int], max_k: Optional[int], device: torch.device, why: Optional[str] = None) -> bool:
    """Whether this call reads its lengths on the host now (``layout.host_read_needed``, or ``why``
    one is needed). Inside ``torch.compile`` nothing is read (a read is data the trace cannot
    see: the operator checks the contents when it runs); a call that cannot do without one is
    refused (``_missing_max``)."""
    if not torch.compiler.is_compiling():
        return why is not None or layout.host_read_needed(device, max_q, max_k)
    if why is not None:
        raise ValueError(f"{why} need a host read of the offsets, which torch.compile cannot trace: call it "
                         f"outside the compiled region")
    return False


def _missing_max(name_q: str, max_q: Optional[int], name_k: str, max_k: Optional[int]) -> Optional[str]:
    """Under ``torch.compile``, the refusal of a call whose max lengths are unknown, else None.
    Raised when the operator runs (``PackedCall.refusal``), so the user gets this ValueError
    itself, with or without ``fullgraph``, where raising while tracing would reach them wrapped in
    Dynamo's error or, without ``fullgraph``, break the graph and run the call eagerly."""
    missing = [name for name, m in ((name_q, max_q), (name_k, max_k)) if m is None]
    if not missing or not torch.compiler.is_compiling():
        return None
    return (f"under torch.compile the maximum sequence lengths must be known without reading tensor data: pass "
            f"{' and '.join(missing)} (ints)" + (" (NJTs built by torch.nested carry it)" if "cached" in missing[0]
                                                 else ""))


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------------------------
# sdpa


def _prepare_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                  causal_alignment, window_size, softcap, alibi_slopes, backend):
    """Validate an sdpa call and build its PackedCall; returns (call, forced, notes)."""
    inputs.validate_attn_mask(attn_mask)
    size_q, size_k, size_v = inputs.validate_sdpa_tensors(query, key, value, enable_gqa)
    inputs.validate_bool("is_causal", is_causal)
    forced = _forced(backend)
    alignment = inputs.validate_alignment(causal_alignment)
    window = inputs.validate_window(window_size)
    cap = inputs.validate_softcap(softcap, zero_means_off=False)
    p = inputs.validate_dropout(dropout_p)
    batch, heads_q, _, head_dim = size_q
    sm_scale = inputs.validate_scale("scale", scale, head_dim)
    alibi = inputs.validate_alibi(alibi_slopes, heads_q, batch, query.device)

    p, drop_notes = inputs.dropout_to_run(p)
    notes = list(drop_notes)
    kv_dense = not key.is_nested
    # Every offsets/lengths tensor of the call, read on the host in one transfer (or not at all);
    # read_host reads a tensor shared by several arguments (self-attention) once.
    njts = {"query": query}
    if not kv_dense:
        njts["key"] = key
        if value.offsets() is not key.offsets() or value.lengths() is not None:
            njts["value"] = value
    tensors, slots = [], {}
    for name, njt in njts.items():
        parts = (njt.offsets(),) if njt.lengths() is None else (njt.offsets(), njt.lengths())
        slots[name] = range(len(tensors), len(tensors) + len(parts))
        tensors += parts
    given_q = layout.njt_cached_max_seqlen(query)
    given_k = size_k[2] if kv_dense else layout.njt_cached_max_seqlen(key)
    has_holes = any(len(slot) == 2 for slot in slots.values())
    # Holes are gathered, and a value with offsets of its own compared to key's, from a host read.
    why_read = ("NJTs with holes (lengths())" if has_holes else
                "value with offsets other than key's" if "value" in njts else None)
    read = _host_read(given_q, given_k, query.device, why_read)
    refusal = _missing_max("query's cached max seqlen", given_q, "key's cached max seqlen", given_k)
    host = layout.read_host(*tensors) if read else None

    def host_of(name):
        if host is None:
            return None, None
        slot = slots[name]
        return host[slot[0]], (host[slot[1]] if len(slot) == 2 else None)

    cu_of = {}  # int32 cu_seqlens and validated stats per offsets, for arguments that share them
    q_packed, stats_q, cu_q = _njt_side("query", query, *host_of("query"), given_q, notes, cu_of)
    if kv_dense:
        seq_k = size_k[2]
        k_packed, v_packed = layout.dense_kv_packed(key), layout.dense_kv_packed(value)
        if size_k[1] > 1:
            notes.append("dense key/value copied into packed (B*S, Hkv, D) buffers")
        cu_k = torch.arange(batch + 1, device=query.device, dtype=torch.int32) * seq_k
        stats_k = layout.SeqlenStats(tuple(b * seq_k for b in range(batch + 1)), seq_k, seq_k == 0 and batch > 0)
    else:
        k_packed, stats_k, cu_k = _njt_side("key", key, *host_of("key"), given_k, notes, cu_of)
        if "value" in njts:
            v_packed, stats_v, _ = _njt_side("value", value, *host_of("value"), given_k, notes, cu_of)
            if stats_v.cu_host is not None and layout.host_lengths(stats_v.cu_host) != layout.host_lengths(stats_k.cu_host):
                raise ValueError("key and value must have the same ragged structure (sequence lengths)")
        else:
            v_packed, _ = layout.njt_packed(value)
    if refusal is not None:  # upper bounds to trace with; the operator refuses the call when it runs
        stats_q = layout.SeqlenStats(None, q_packed.shape[0], True)
        stats_k = layout.SeqlenStats(None, k_packed.shape[0], True)
    if kv_dense:
        # Every Lq <= max_seqlen_q == S and they sum to B * S: all equal S, no read needed.
        equal = stats_q.max_seqlen == seq_k and q_packed.shape[0] == batch * seq_k
    else:
        shared = key.offsets() is query.offsets() and key.lengths() is None and query.lengths() is None
        equal = shared or _equal_lengths(stats_q.cu_host, stats_k.cu_host)
    spec = AttnSpec(
        entry="sdpa",
        **ops.tensor_fields(q_packed, k_packed, v_packed, batch, None, None),
        max_seqlen_q=stats_q.max_seqlen,
        max_seqlen_k=stats_k.max_seqlen,
        has_empty_q=stats_q.has_empty,
        has_empty_k=stats_k.has_empty,
        lengths_known=read,
        kv_dense=kv_dense,
        causal=is_causal,
        alignment=alignment,
        window=inputs.effective_window(window, stats_q.max_seqlen, stats_k.max_seqlen),
        softcap=cap,
        alibi=alibi,
        alibi_grad=alibi is not None and _needs_grad(alibi_slopes),
        dropout_p=p,
        scale=sm_scale,
        needs_grad=_needs_grad(query, key, value, *([alibi_slopes] if alibi else [])),
        return_lse=False,
        equal_lengths=equal,
    )
    call = PackedCall(q_packed, k_packed, v_packed, cu_q, cu_k, spec, alibi_slopes,
                      cu_q_host=stats_q.cu_host, cu_k_host=stats_k.cu_host if read else None, refusal=refusal)
    return call, forced, tuple(notes)


def _equal_lengths(cu_q_host, cu_k_host) -> bool:
    """Whether host-read lengths show Lq == Lk for every sequence (False when not read): the
    fact that makes top-left and bottom-right alignment coincide."""
    return cu_q_host is not None and cu_k_host is not None and tuple(cu_q_host) == tuple(cu_k_host)


def _njt_side(name, njt, offsets_host, lengths_host, given_max, notes, cu_of):
    """Packed buffer, validated stats and int32 cu_seqlens of one NJT argument."""
    if lengths_host is None:
        packed, _ = layout.njt_packed(njt)
        # Offsets read for an argument before (shared with it) are validated once.
        key = (id(offsets_host), packed.shape[0], given_max) if offsets_host is not None else None
        stats = cu_of.get(key) if key is not None else None
        if stats is None:
            stats = layout.seqlen_stats(f"{name}.offsets()", offsets_host, packed.shape[0], given_max,
                                        f"{name}'s cached max seqlen")
            if key is not None:
                cu_of[key] = stats
        offsets = njt.offsets()
        cu = cu_of.get(id(offsets))
        if cu is None:
            cu = cu_of[id(offsets)] = layout.njt_cu_seqlens(njt)
        return packed, stats, cu
    # An NJT with holes: each sequence b is values[offsets[b] : offsets[b] + lengths[b]].
    n_values = njt.transpose(1, 2).values().shape[0] if njt.requires_grad else njt._values.shape[1]
    for b, (o, n) in enumerate(zip(offsets_host, lengths_host)):
        if o < 0 or n < 0 or o + n > n_values:
            raise ValueError(f"{name} has a hole-y sequence {b} (offset {o}, length {n}) outside its {n_values} values")
    packed, _ = layout.njt_packed(njt, (offsets_host, lengths_host))
    notes.append(f"{name} has holes (lengths()): gathered into a packed copy")
    cu = [0]
    for n in lengths_host:
        cu.append(cu[-1] + n)
    stats = layout.seqlen_stats(f"{name} lengths", cu, packed.shape[0], None)
    return packed, stats, layout.njt_cu_seqlens(njt, tuple(cu))


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
         causal_alignment="top_left", window_size=None, softcap=None, alibi_slopes=None, backend=None):
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
    generator. When the NJTs carry their max seqlen (they do when built by torch) and live on a
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
        call, forced, notes = _prepare_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                            causal_alignment, window_size, softcap, alibi_slopes, backend)
    call = _with_dropout_key(call)
    chosen = choose(call.spec, forced, notes) if call.refusal is None else None
    out = _dropped(ops.run(chosen, call).out, dropout_p)
    with torch._C.DisableTorchFunctionSubclass():
        return layout.packed_to_njt(out, query, call.cu_seqlens_q, call.spec.max_seqlen_q)


def _with_dropout_key(call: PackedCall) -> PackedCall:
    """The call with its dropout key (``keyed_dropout.draw_key``) when it runs with dropout. Drawn
    here, by the calls that run, so that ``explain`` leaves the default generator untouched."""
    return call.replace(dropout_key=keyed_dropout.draw_key()) if call.spec.dropout_p else call


def _dropped(out: Tensor, dropout_p) -> Tensor:
    """The output of a call whose dropout drops everything (``inputs.drops_everything``)."""
    return out * 0 if inputs.drops_everything(dropout_p) else out


# ----------------------------------------------------------------------------------------------
# varlen


def _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, window_size, softcap, alibi_slopes, return_lse, block_table, seqused_k, backend):
    """Validate a varlen_attention call and build its PackedCall; returns (call, forced, notes)."""
    inputs.validate_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k)
    inputs.validate_bool("causal", causal)
    inputs.validate_bool("return_lse", return_lse)
    forced = _forced(backend)
    max_q = inputs.validate_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = inputs.validate_max_seqlen("max_seqlen_k", max_seqlen_k)
    window = inputs.validate_window(window_size)
    cap = inputs.validate_softcap(softcap, zero_means_off=True)
    p, notes = inputs.dropout_to_run(inputs.validate_dropout(dropout_p))
    sm_scale = inputs.validate_scale("softmax_scale", softmax_scale, q.shape[-1])
    batch = cu_seqlens_q.shape[0] - 1
    alibi = inputs.validate_alibi(alibi_slopes, q.shape[1], batch, q.device)
    paged = block_table is not None

    read = _host_read(max_q, max_k, q.device)
    refusal = _missing_max("max_seqlen_q", max_q, "max_seqlen_k", max_k)
    if refusal is not None:  # upper bounds to trace with; the operator refuses the call when it runs
        max_q = q.shape[0] if max_q is None else max_q
        max_k = (k.shape[0] * (k.shape[1] if paged else 1)) if max_k is None else max_k
    if read:
        to_read = [cu_seqlens_q] + ([block_table, seqused_k] if paged else
                                    [cu_seqlens_k] + ([seqused_k] if seqused_k is not None else []))
        found = contents.varlen_lengths(layout.read_host(*to_read), q.shape[0], k, max_q, max_k, paged,
                                        seqused_k is not None)
        stats_q, stats_k, cu_k_host, seqused_host = found
    else:  # checked when the operator runs (checks.contents)
        stats_q = layout.SeqlenStats(None, max_q, True)
        stats_k = layout.SeqlenStats(None, max_k, True)
        cu_k_host = seqused_host = None
    spec = AttnSpec(
        entry="varlen",
        **ops.tensor_fields(q, k, v, batch, block_table, seqused_k),
        max_seqlen_q=stats_q.max_seqlen,
        max_seqlen_k=stats_k.max_seqlen,
        has_empty_q=stats_q.has_empty,
        has_empty_k=stats_k.has_empty,
        lengths_known=read,
        causal=causal,
        alignment="bottom_right",
        window=inputs.effective_window(window, stats_q.max_seqlen, stats_k.max_seqlen),
        softcap=cap,
        alibi=alibi,
        alibi_grad=alibi is not None and _needs_grad(alibi_slopes),
        dropout_p=p,
        scale=sm_scale,
        needs_grad=_needs_grad(q, k, v, *([alibi_slopes] if alibi else [])),
        return_lse=return_lse,
        equal_lengths=_equal_lengths(stats_q.cu_host, stats_k.cu_host) or (cu_seqlens_k is cu_seqlens_q and seqused_k is None),
    )
    call = PackedCall(q, k, v, cu_seqlens_q, cu_seqlens_k, spec, alibi_slopes, seqused_k, block_table,
                      cu_q_host=stats_q.cu_host, cu_k_host=cu_k_host, seqused_k_host=seqused_host, refusal=refusal)
    return call, forced, notes


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                     dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, return_lse=False, block_table=None, seqused_k=None, backend=None):
    """Attention over packed variable-length sequences, with flash-attn's varlen semantics.

    Shapes: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), Hq % Hkv == 0;
    cu_seqlens_q/_k int32 (B + 1,) on q's device, starting at 0, non-decreasing, ending at
    total_q/total_k (zero-length sequences allowed). Paged KV cache: k/v
    (num_blocks, block_size, Hkv, D/Dv), ``block_table`` int32 (B, max_blocks), ``seqused_k``
    int32 (B,) and ``cu_seqlens_k=None``.

    ``causal=True`` is bottom-right aligned: query i of a sequence with Lq queries and Lk keys
    sees keys j <= i + Lk - Lq (for Lq=2, Lk=5: rows ``1 1 1 1 0`` and ``1 1 1 1 1``).
    ``window_size``, ``softcap`` (0 = off) and ``alibi_slopes`` use the same alignment.

    Returns out (total_q, Hq, Dv), or (out, lse) with ``return_lse=True``, lse float32
    (Hq, total_q) natural log. A row that sees no key outputs zeros and lse -inf.

    Host syncs: ``max_seqlen_q/_k=None`` costs one device-to-host read (on the CPU, reading is
    always done to validate cu_seqlens, and costs microseconds).

    Example::

        cu = torch.tensor([0, 5, 8], dtype=torch.int32)
        out = jagged_sdpa.varlen_attention(q, k, v, cu, cu, 5, 5, causal=True)

    Raises:
        TypeError: wrong kinds or dtypes (cu_seqlens, block_table and seqused_k must be int32).
        ValueError: shapes, sizes, contents, devices, option values, max_seqlen_* too small,
        block ids out of range. NoBackendError: no backend (or the forced one) can take the call.
    """
    inputs.validate_not_meta("q", q)  # k/v on another device: the device checks say so
    call, forced, notes = _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                          return_lse, block_table, seqused_k, backend)
    call = _with_dropout_key(call)
    chosen = choose(call.spec, forced, notes) if call.refusal is None else None
    result = ops.run(chosen, call)
    out = _dropped(result.out, dropout_p)
    return (out, result.lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# explain

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_VARLEN_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def explain(*args, **kwargs) -> Explanation:
    """Which backend a call of ``sdpa`` or ``varlen_attention`` would get, and why not the others.

    Takes exactly the arguments of either function (a call with ``cu_seqlens_q``, or whose first
    argument is not a nested tensor, is a varlen call), validates them like the call would, and
    runs no attention kernel. ``e.chosen`` is the Backend or None, ``e.reasons`` maps every
    backend to its list of reasons (empty = eligible), ``print(e)`` shows a table.
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


def _explain_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  *, causal_alignment="top_left", window_size=None, softcap=None, alibi_slopes=None, backend=None):
    call, forced, notes = _prepare_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        causal_alignment, window_size, softcap, alibi_slopes, backend)
    return with_notes(select(call.spec, forced), notes)


def _explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, dropout_p=0.0,
                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    return_lse=False, block_table=None, seqused_k=None, backend=None):
    call, forced, notes = _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                          return_lse, block_table, seqused_k, backend)
    return with_notes(select(call.spec, forced), notes)

