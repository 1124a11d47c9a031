"""Regression tests for contract points the differential fuzzer found (support/fuzz.py): each starts from its repro and checks the float64 reference or PyTorch's own SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import jagged_sdpa
from jagged_sdpa import Backend, NoBackendError
from support.cases import cu_of, njt, packed
from support.reference import attention_reference
from support.tolerances import assert_close_packed

BACKENDS = [None, "math", "cpu_fused"]  # None = automatic selection


# --- item 6: window sides that reach past every key are unbounded, never wrapped ------------------

@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math", "cpu_fused"])
@pytest.mark.parametrize("window", [(2**64, 2**64), (2**63, 3), (2, 2**63 - 1), (40, 10**30)])
def test_huge_window_sides_mean_unbounded(window, backend):
    lengths_q, lengths_k = [5, 0, 17], [9, 4, 12]
    q, k, v = packed(lengths_q, 2, 8), packed(lengths_k, 2, 8), packed(lengths_k, 2, 8)
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, window_size=window, backend=backend)
    effective = tuple(-1 if side >= 17 + 12 else side for side in window)
    ref, _ = attention_reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right", window=effective)
    assert_close_packed(out, ref, cu_seqlens=cu_q)
    assert jagged_sdpa.explain(q, k, v, cu_q, cu_k, window_size=window).spec.window == effective


def test_window_side_at_the_reach_is_unbounded_and_one_below_is_kept():
    q = packed([3], 1, 4)
    cu = cu_of([3])
    # max_seqlen_q + max_seqlen_k = 6: a side of 6 reaches every key, 5 is kept as given (and
    # excludes nothing here either, which the reference confirms).
    assert jagged_sdpa.explain(q, q, q, cu, cu, window_size=(6, 5)).spec.window == (-1, 5)


# --- item 7: an empty batch keeps autograd --------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math", "cpu_fused"])
def test_empty_batch_backward_gives_zero_gradients(backend):
    q = torch.randn(0, 2, 8, requires_grad=True)
    k = torch.randn(5, 2, 8, requires_grad=True)
    v = torch.randn(5, 2, 8, requires_grad=True)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_of([0, 0]), cu_of([2, 3]), backend=backend)
    assert out.shape == (0, 2, 8) and out.requires_grad
    out.sum().backward()
    assert q.grad.shape == q.shape
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


# --- item 9: smaller contract points --------------------------------------------------------------

def test_no_backend_error_lists_the_backends_left_out_with_their_reasons():
    q = packed([3, 4], 2, 8)
    cu = cu_of([3, 4])
    with jagged_sdpa.use_backends(Backend.FLASH_VARLEN):
        with pytest.raises(NoBackendError) as info:
            jagged_sdpa.varlen_attention(q, q, q, cu, cu)
    message = str(info.value)
    for backend in Backend:
        assert backend.value in message
    assert "left out by use_backends('flash_varlen')" in message
    with pytest.raises(NoBackendError, match="not tried: backend='efficient' forced") as info:
        jagged_sdpa.varlen_attention(q, q, q, cu, cu, backend="efficient")
    assert all(b.value in str(info.value) for b in Backend)


@pytest.mark.parametrize("name, kwargs", [
    ("max_seqlen_q", dict(max_seqlen_q=3, max_seqlen_k=5)),
    ("max_seqlen_k", dict(max_seqlen_q=5, max_seqlen_k=3)),
])
def test_too_small_max_seqlen_names_the_argument(name, kwargs):
    q = packed([2, 5], 1, 4)
    cu = cu_of([2, 5])
    with pytest.raises(ValueError, match=f"^{name} is 3, smaller than the longest sequence"):
        jagged_sdpa.varlen_attention(q, q, q, cu, cu, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math", "cpu_fused"])
def test_dropout_one_drops_everything_like_torch_sdpa(backend):
    lengths = [4, 6]
    q, k, v = (packed(lengths, 2, 8, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        q[1, 0, 3] = float("nan")  # NaN propagates through P * 0, as in PyTorch's SDPA
    cu = cu_of(lengths)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu, cu, dropout_p=1.0, return_lse=True, backend=backend)
    for b, (start, n) in enumerate(((0, 4), (4, 6))):
        dense = F.scaled_dot_product_attention(*(x[start:start + n].detach().transpose(0, 1) for x in (q, k, v)),
                                               dropout_p=1.0).transpose(0, 1)
        torch.testing.assert_close(out[start:start + n], dense, equal_nan=True)
    assert torch.isnan(out[1, 0]).all() and not out[4:].any()
    _, lse_no_dropout = jagged_sdpa.varlen_attention(q, k, v, cu, cu, return_lse=True, backend=backend)
    torch.testing.assert_close(lse, lse_no_dropout, equal_nan=True)
    out[4:].sum().backward()
    assert not k.grad[4:].any() and not v.grad[4:].any()
    assert "dropout_p=1 drops every probability" in str(jagged_sdpa.explain(q, k, v, cu, cu, dropout_p=1.0))


@pytest.mark.parametrize("bad", [1.0000001, -0.1, float("nan")])
def test_dropout_outside_zero_one_is_refused(bad):
    q = packed([3], 1, 4)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        jagged_sdpa.varlen_attention(q, q, q, cu_of([3]), cu_of([3]), dropout_p=bad)


@pytest.mark.parametrize("kind", ["per_head", "per_batch_head"])
@pytest.mark.parametrize("entry", ["varlen", "sdpa"])
def test_alibi_slopes_that_require_grad_get_their_gradient(kind, entry):
    lengths = [5, 3]
    heads = 2
    slopes = (torch.rand(heads) if kind == "per_head" else torch.rand(len(lengths), heads)).requires_grad_()
    q64 = [torch.randn(n, heads, 8, dtype=torch.float64) for n in lengths]
    grad_out = torch.cat([torch.randn(n, heads, 8, dtype=torch.float64) for n in lengths])
    if entry == "varlen":
        q = torch.cat(q64).float()
        cu = cu_of(lengths)
        e = jagged_sdpa.explain(q, q, q, cu, cu, causal=True, alibi_slopes=slopes)
        out = jagged_sdpa.varlen_attention(q, q, q, cu, cu, causal=True, alibi_slopes=slopes)
        alignment = "bottom_right"
    else:
        q = torch.nested.nested_tensor([x.float() for x in q64], layout=torch.jagged).transpose(1, 2)
        e = jagged_sdpa.explain(q, q, q, is_causal=True, alibi_slopes=slopes)
        out = jagged_sdpa.sdpa(q, q, q, is_causal=True, alibi_slopes=slopes).transpose(1, 2).values()
        alignment = "top_left"
    assert e.chosen is Backend.MATH
    assert "alibi_slopes requires grad" in " ".join(e.reasons[Backend.CPU_FUSED])
    out.backward(grad_out.float())
    ref_slopes = slopes.detach().double().requires_grad_()
    ref, _ = attention_reference(torch.cat(q64), torch.cat(q64), torch.cat(q64), cu_of(lengths), cu_of(lengths),
                                 causal=True, alignment=alignment, alibi_slopes=ref_slopes)
    ref.backward(grad_out)
    torch.testing.assert_close(slopes.grad.double(), ref_slopes.grad, rtol=1e-4, atol=1e-5)


def test_alibi_slopes_without_grad_keep_the_fast_backends():
    q = packed([5, 3], 2, 8)
    cu = cu_of([5, 3])
    assert jagged_sdpa.explain(q, q, q, cu, cu, alibi_slopes=torch.rand(2)).chosen is Backend.CPU_FUSED
    with torch.no_grad():
        slopes = torch.rand(2, requires_grad=True)
        assert jagged_sdpa.explain(q, q, q, cu, cu, alibi_slopes=slopes).chosen is Backend.CPU_FUSED


def test_meta_tensors_are_a_value_error_and_explain_describes_them():
    q = torch.empty(4, 2, 8, device="meta")
    cu = torch.tensor([0, 4], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="q is a meta tensor"):
        jagged_sdpa.varlen_attention(q, q, q, cu, cu, 4, 4)
    e = jagged_sdpa.explain(q, q, q, cu, cu, 4, 4)  # describes the call, no data needed
    assert e.chosen is None and "device meta not supported" in str(e)
    nq = njt([3, 2], 2, 8).to("meta")
    with pytest.raises(ValueError, match="query is a meta tensor"):
        jagged_sdpa.sdpa(nq, nq, nq)
