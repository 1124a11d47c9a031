"""Property-based tests of the compiled CPU kernel (``backends/cpu/native.py``, ``csrc/attention.cpp``)
against the float64 reference (``reference.py``), forward, backward and paged forward.

Each example draws a ragged batch (1..5 sequences; query lengths 0..90 and key lengths 0..140, so
empty sequences, Lq > Lk and length-1 decode rows all occur), GQA (Hkv 1..3, group 1..3), head
dims D and Dv independently in 1..72, fp32/fp16/bf16, causal, a window (sides up to 2^40: windows
that start past the last key, or end before the first), either causal alignment (top-left runs the
kernel through ``kernel_calls``: varlen is bottom-right), softcap, ALiBi slopes of
shape (Hq,) or (B, Hq), softmax_scale, strided inputs inside NaN buffers, the thread count, and
the kernel's work split (``native.Q_CHUNK``, ``DIRECT_ROWS``, ``DIRECT_KEYS``, patched on the
module for the duration of one example), so that work items, micro-tile tails, direct rows and
key steps start and end at arbitrary places.

Examples are derandomized (the same ones on every run): 300 forward, 100 backward, 150 paged,
~35 s on two cores. ``JAGGED_SDPA_PROPERTY_SCALE=<k>`` multiplies every count (a longer hunt).
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jagged_sdpa
from jagged_sdpa.backends.cpu import CpuFusedBackend, native
from support.cases import alibi_slopes, cu_of, in_nan_buffer, paged_case
from support.kernel_calls import kernel_backward, kernel_forward, math_forward, packed_call
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason=f"compiled kernel unavailable: {native.unavailable_reason()}")

CPU = "cpu_fused"
LOWP = (torch.float16, torch.bfloat16)
# lowp_ref (the same call on MATH in the same dtype) widens atol to FUDGE * its own error. float32
# needs it too: softmax_scale up to 2 makes logits ~17x the usual (|S| ~ 2 sqrt(D)), whose float32
# rounding alone moves out past the 1e-5 floor (torch's own F.scaled_dot_product_attention: 1.0e-5
# on such a call); the kernel, accumulating in other orders, was seen at up to 2.7x MATH's error,
# and at most 0.52 of the fudge-4 bound over 400 such calls.
FUDGE = {torch.float32: 4.0, torch.float16: 2.0, torch.bfloat16: 2.0}
_SCALE = max(1, int(os.environ.get("JAGGED_SDPA_PROPERTY_SCALE", "1")))


def _settings(examples):
    return settings(max_examples=examples * _SCALE, deadline=None, derandomize=True, database=None,
                    print_blob=False, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                             HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------------------------
# drawing


@st.composite
def calls(draw, *, max_q=90, max_k=140, dtypes=(torch.float32, torch.float16, torch.bfloat16)):
    """One kernel call: lengths, heads, dims, dtype, options and work split (plain values only,
    so that a falsifying example prints as something one can paste)."""
    batch = draw(st.integers(1, 5))
    q_lens = draw(st.lists(st.integers(0, max_q), min_size=batch, max_size=batch))
    k_lens = draw(st.lists(st.integers(0, max_k), min_size=batch, max_size=batch))
    hkv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    hq = hkv * group
    side = st.one_of(st.just(-1), st.integers(0, 50), st.sampled_from([200, 1 << 40]))
    case = {
        "q_lens": q_lens, "k_lens": k_lens, "hq": hq, "hkv": hkv,
        "d": draw(st.integers(1, 72)),
        "dv": draw(st.integers(1, 72)),
        "dtype": draw(st.sampled_from(dtypes)),
        "causal": draw(st.booleans()),
        "window": (draw(side), draw(side)),
        "alignment": draw(st.sampled_from(["bottom_right", "top_left"])),
        "softcap": draw(st.one_of(st.just(0.0), st.floats(0.5, 20.0))),
        "alibi": draw(st.sampled_from([None, "per_head", "per_batch_head"])),
        "scale": draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        "strided": draw(st.booleans()),
        "threads": draw(st.sampled_from([1, 2])),
        "q_chunk": draw(st.integers(1, 256)),
        "direct_rows": draw(st.integers(0, 3)),
        "direct_keys": draw(st.integers(1, 256)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }
    return case


@contextlib.contextmanager
def kernel_setup(case):
    """The drawn work split and thread count, restored afterwards (no monkeypatch: hypothesis runs
    many examples inside one function-scoped fixture)."""
    saved = native.Q_CHUNK, native.DIRECT_ROWS, native.DIRECT_KEYS
    threads = torch.get_num_threads()
    try:
        native.Q_CHUNK, native.DIRECT_ROWS, native.DIRECT_KEYS = case["q_chunk"], case["direct_rows"], \
            case["direct_keys"]
        torch.set_num_threads(case["threads"])
        yield
    finally:
        native.Q_CHUNK, native.DIRECT_ROWS, native.DIRECT_KEYS = saved
        torch.set_num_threads(threads)


def _slopes(case, gen):
    return alibi_slopes(case["alibi"], len(case["q_lens"]), case["hq"], generator=gen)


def _options(case):
    """Keyword arguments of varlen_attention / explain (without alibi_slopes)."""
    return {"causal": case["causal"], "window_size": case["window"], "softcap": case["softcap"],
            "softmax_scale": case["scale"]}


def _reference(q, k, v, cu_q, cu_k, case, slopes, **extra):
    return attention_reference(q, k, v, cu_q, cu_k, scale=case["scale"], causal=case["causal"],
                               alignment=case["alignment"], window=case["window"], softcap=case["softcap"],
                               alibi_slopes=slopes, **extra)


def _lowp(t):
    """A lowp_ref for assert_close_packed: None for an empty tensor (nothing to widen by)."""
    return t if t is not None and t.numel() else None


def _attend(case, q, k, v, cu_q, cu_k, **opts):
    """out, lse of the kernel: varlen_attention (bottom-right), or the packed call top-left."""
    if case["alignment"] == "bottom_right":
        return jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend=CPU, **opts)
    return kernel_forward(packed_call(q, k, v, cu_q, cu_k, alignment="top_left", **opts))


def _check_forward(out, lse, q, k, v, cu_q, cu_k, case, slopes, opts):
    """out and lse of a kernel call against float64 (and MATH in the same dtype for the floor)."""
    ref_out, ref_lse = _reference(q, k, v, cu_q, cu_k, case, slopes)
    lowp = math_forward(packed_call(q, k, v, cu_q, cu_k, alignment=case["alignment"], alibi_slopes=slopes, **opts))
    assert out.dtype == case["dtype"] and out.shape == (q.shape[0], case["hq"], case["dv"])
    assert lse.dtype == torch.float32 and lse.shape == (case["hq"], q.shape[0])
    _check_empty_rows(out, lse, ref_lse)
    assert_close_packed(out, ref_out, cu_seqlens=cu_q, lowp_ref=_lowp(lowp), fudge=FUDGE[case["dtype"]])
    assert_close_lse(lse, ref_lse)


def _check_empty_rows(out, lse, ref_lse):
    """Rows that see no key: exactly 0 out and lse -inf."""
    empty = torch.isinf(ref_lse).T  # (total_q, Hq)
    if empty.any():
        assert (out[empty] == 0).all(), "a row that sees no key is not exactly 0"
        assert (lse.T[empty] == -math.inf).all(), "a row that sees no key has lse != -inf"
    assert torch.isfinite(out).all(), "out has inf/NaN"


# ----------------------------------------------------------------------------------------------
# forward


def run_forward(case):
    gen = torch.Generator().manual_seed(case["seed"])
    q_lens, k_lens, hq, hkv, d, dv, dtype = (case[key] for key in ("q_lens", "k_lens", "hq", "hkv", "d", "dv", "dtype"))
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    k = torch.randn(sum(k_lens), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(k_lens), hkv, dv, generator=gen).to(dtype)
    slopes = _slopes(case, gen)
    cu_q, cu_k = cu_of(q_lens), cu_of(k_lens)
    wrap = in_nan_buffer if case["strided"] else (lambda t: t)
    opts = _options(case)
    with kernel_setup(case):
        qa, ka, va = wrap(q), wrap(k), wrap(v)
        spec = jagged_sdpa.explain(qa, ka, va, cu_q, cu_k, alibi_slopes=slopes, backend=CPU, **opts).spec
        assert not CpuFusedBackend.reasons(spec), CpuFusedBackend.reasons(spec)
        out, lse = _attend(case, qa, ka, va, cu_q, cu_k, alibi_slopes=slopes, **opts)
    _check_forward(out, lse, q, k, v, cu_q, cu_k, case, slopes, opts)


@_settings(300)
@given(calls())
def test_forward_matches_reference(case):
    run_forward(case)


# ----------------------------------------------------------------------------------------------
# backward


def run_backward(case):
    gen = torch.Generator().manual_seed(case["seed"])
    q_lens, k_lens, hq, hkv, d, dv, dtype = (case[key] for key in ("q_lens", "k_lens", "hq", "hkv", "d", "dv", "dtype"))
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    k = torch.randn(sum(k_lens), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(k_lens), hkv, dv, generator=gen).to(dtype)
    slopes = _slopes(case, gen)
    grad_out = torch.randn(sum(q_lens), hq, dv, generator=gen).to(dtype)
    cu_q, cu_k = cu_of(q_lens), cu_of(k_lens)
    opts = _options(case)
    wrap = in_nan_buffer if case["strided"] else (lambda t: t)
    leaves = [wrap(t).requires_grad_(True) for t in (q, k, v)]
    with kernel_setup(case):
        spec = jagged_sdpa.explain(*leaves, cu_q, cu_k, alibi_slopes=slopes, backend=CPU, **opts).spec
        assert spec.needs_grad and not CpuFusedBackend.reasons(spec), CpuFusedBackend.reasons(spec)
        if case["alignment"] == "bottom_right":
            out = jagged_sdpa.varlen_attention(*leaves, cu_q, cu_k, alibi_slopes=slopes, backend=CPU, **opts)
            out.backward(wrap(grad_out))
        else:
            call = packed_call(*(t.detach() for t in leaves), cu_q, cu_k, alignment="top_left", alibi_slopes=slopes,
                               **opts)
            out, lse = kernel_forward(call)
            for leaf, g in zip(leaves, kernel_backward(call, out, lse, wrap(grad_out))):
                leaf.grad = g
    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, ref_lse = _reference(*leaves64, cu_q, cu_k, case, None if slopes is None else slopes.double())
    # The same call on MATH in the same dtype: the low-precision error allowed.
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out2 = math_forward(packed_call(q2, k2, v2, cu_q, cu_k, alignment=case["alignment"], alibi_slopes=slopes, **opts))
    if out2.requires_grad:  # (MATH returns a graph-less empty output when no sequence has a query)
        out2.backward(grad_out)
    lowp = {"dq": q2.grad, "dk": k2.grad, "dv": v2.grad}
    stored = {}
    if ref.requires_grad:  # no visible key anywhere leaves the reference without a graph
        if dtype in LOWP:
            stored = _stored_output_grads(leaves64, ref, ref_lse, grad_out, out2)
        ref.backward(grad_out.double())
    assert_close_packed(out, ref, cu_seqlens=cu_q, lowp_ref=_lowp(out2), fudge=FUDGE[dtype])
    for name, got, leaf, cu in (("dq", leaves[0].grad, leaves64[0], cu_q), ("dk", leaves[1].grad, leaves64[1], cu_k),
                                ("dv", leaves[2].grad, leaves64[2], cu_k)):
        want = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        assert got is not None and got.dtype == dtype, f"{name}: {None if got is None else got.dtype}"
        assert torch.isfinite(got).all(), f"{name} has inf/NaN"
        allowed = [t for t in (lowp[name], stored.get(name)) if t is not None and t.numel()]
        widest = max(allowed, key=lambda t: (t.double() - want).abs().max().item(), default=None)
        assert_close_packed(got, want, cu_seqlens=cu, name=name, grad=True, lowp_ref=widest, fudge=FUDGE[dtype])


def _stored_output_grads(leaves64, ref, ref_lse, grad_out, out_lowp):
    """Float64 gradients of a backward that, as FlashAttention-2's (and the kernel's) does, takes
    delta = rowsum(dO * O) from the output stored in the low dtype (here MATH's, not the kernel's).

    dS = P * (dO.V^T - delta): an error e_i in delta_i shifts dS_i by -e_i * P_i, which is exactly
    the gradient of -sum_i e_i * lse_i. With scale ~2 and a peaked softmax this alone moves dq/dk
    by ~2^-8 of their largest entries (seen: 0.085 on an entry of 0.04 whose row reaches 9.7),
    far past the bf16 floor and past MATH's own error, which uses the exact delta."""
    err = (grad_out.double() * (out_lowp.detach().double() - ref.detach())).sum(-1).T  # (Hq, total_q)
    seen = torch.isfinite(ref_lse.detach())
    shift = (err * torch.where(seen, ref_lse, torch.zeros_like(ref_lse))).sum()
    if not shift.requires_grad:
        return {}
    moved = torch.autograd.grad(shift, leaves64, retain_graph=True, allow_unused=True)
    exact = torch.autograd.grad(ref, leaves64, grad_out.double(), retain_graph=True, allow_unused=True)
    return {name: (torch.zeros_like(leaf) if e is None else e) - (0 if m is None else m)
            for name, leaf, e, m in zip(("dq", "dk", "dv"), leaves64, exact, moved)}


@_settings(100)
@given(calls(max_q=70, max_k=70, dtypes=(torch.float32, torch.bfloat16)))
def test_backward_matches_reference(case):
    run_backward(case)


# ----------------------------------------------------------------------------------------------
# paged KV cache forward


@st.composite
def paged_calls(draw):
    case = draw(calls())
    case["block_size"] = draw(st.integers(1, 17))
    # paged_case's shared first block holds sequence 0's first keys, which must fill it
    case["shared_first_block"] = case["k_lens"][0] >= case["block_size"] and draw(st.booleans())
    return case


def run_paged(case):
    """Keys read through a shuffled block table over a NaN-filled cache. paged_case makes K and V
    of one width: it is built at max(D, Dv) and sliced, so Dv != D caches are strided views."""
    q_lens, used, hq, hkv, d, dv, dtype = (case[key] for key in ("q_lens", "k_lens", "hq", "hkv", "d", "dv", "dtype"))
    with torch.random.fork_rng():
        torch.manual_seed(case["seed"])
        k_cache, v_cache, table, seqused, pk, pv = paged_case(q_lens, used, case["block_size"], hkv, max(d, dv),
                                                              dtype, shared_first_block=case["shared_first_block"])
    k_cache, v_cache, pk, pv = k_cache[..., :d], v_cache[..., :dv], pk[..., :d], pv[..., :dv]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    slopes = _slopes(case, gen)
    cu_q = cu_of(q_lens)
    opts = _options(case)
    with kernel_setup(case):
        qa = in_nan_buffer(q) if case["strided"] else q
        spec = jagged_sdpa.explain(qa, k_cache, v_cache, cu_q, None, block_table=table, seqused_k=seqused,
                                   alibi_slopes=slopes, backend=CPU, **opts).spec
        assert spec.paged and not CpuFusedBackend.reasons(spec), CpuFusedBackend.reasons(spec)
        out, lse = _attend(case, qa, k_cache, v_cache, cu_q, None, block_table=table, seqused_k=seqused,
                           alibi_slopes=slopes, **opts)
    _check_forward(out, lse, q, pk.contiguous(), pv.contiguous(), cu_q, cu_of(used), case, slopes, opts)


@_settings(150)
@given(paged_calls())
def test_paged_forward_matches_reference(case):
    run_paged(case)
