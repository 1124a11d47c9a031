"""Property-based: random ragged batches (lengths 0 and 1 among them), heads, odd head dims,
options and dtypes; automatic selection must match the float64 reference, forward and backward."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jagged_sdpa
from support.cases import cu_of
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@st.composite
def calls(draw):
    batch = draw(st.integers(1, 4))
    lengths_q = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 13]), min_size=batch, max_size=batch))
    cross = draw(st.booleans())
    lengths_k = draw(st.lists(st.sampled_from([0, 1, 2, 4, 7, 12]), min_size=batch, max_size=batch)) if cross \
        else lengths_q
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([1, 3, 8, 17, 32]))
    dv = draw(st.sampled_from([d, 5]))
    dtype = draw(st.sampled_from(DTYPES))
    options = {}
    if draw(st.booleans()):
        options["causal"] = True
    if draw(st.booleans()):
        options["window_size"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        options["softcap"] = draw(st.floats(0.5, 10.0))
    if draw(st.booleans()):
        shape = (hkv * group,) if draw(st.booleans()) else (batch, hkv * group)
        options["alibi_slopes"] = torch.rand(shape)
    grad = draw(st.booleans()) and dtype in (torch.float32, torch.float64)
    return lengths_q, lengths_k, hkv, group, d, dv, dtype, options, grad


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_varlen_matches_reference(call):
    lengths_q, lengths_k, hkv, group, d, dv, dtype, options, grad = call
    hq = hkv * group
    q = torch.randn(sum(lengths_q), hq, d).to(dtype).requires_grad_(grad)
    k = torch.randn(sum(lengths_k), hkv, d).to(dtype).requires_grad_(grad)
    v = torch.randn(sum(lengths_k), hkv, dv).to(dtype).requires_grad_(grad)
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **options)
    ref_opts = dict(causal=options.get("causal", False), alignment="bottom_right",
                    window=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0),
                    alibi_slopes=options.get("alibi_slopes"))
    leaves = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    ref, ref_lse = attention_reference(*leaves, cu_q, cu_k, **ref_opts)
    assert_close_packed(out, ref, cu_seqlens=cu_q)
    assert_close_lse(lse, ref_lse)
    if grad and out.numel():
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        if ref.requires_grad:  # no visible key anywhere leaves the reference without a graph
            ref.backward(grad_out.double())
        for name, got, leaf, cu in (("dq", q.grad, leaves[0], cu_q), ("dk", k.grad, leaves[1], cu_k),
                                    ("dv", v.grad, leaves[2], cu_k)):
            expected = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            assert_close_packed(got, expected, cu_seqlens=cu, name=name, grad=True)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 6, 11]), min_size=1, max_size=4), st.booleans(),
       st.sampled_from(["top_left", "bottom_right"]))
def test_sdpa_matches_reference(lengths, causal, alignment):
    parts = [torch.randn(n, 2, 8) for n in lengths]
    q = torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)
    out = jagged_sdpa.sdpa(q, q, q, is_causal=causal, causal_alignment=alignment)
    packed = torch.cat(parts)
    ref, _ = attention_reference(packed, packed, packed, cu_of(lengths), cu_of(lengths), causal=causal,
                                 alignment=alignment)
    got = torch.cat([t.transpose(0, 1) for t in out.unbind()])
    assert_close_packed(got, ref, cu_seqlens=cu_of(lengths))
