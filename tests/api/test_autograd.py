"""Gradients with respect to q, k and v against the float64 reference (itself differentiable)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import jagged_sdpa
from jagged_sdpa import Backend
from support.cases import cu_of, njt, packed
from support.reference import attention_reference
from support.tolerances import assert_close_packed

BACKENDS = [None, Backend.MATH]


def reference_grads(q, k, v, cu_q, cu_k, grad_out, **options):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out, _ = attention_reference(*leaves, cu_q, cu_k, **options)
    out.backward(grad_out.double())
    return [t.grad for t in leaves]


OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window-softcap": dict(window_size=(3, 1), softcap=2.0),
    "alibi": dict(alibi_slopes=torch.tensor([0.3, 0.1, 0.7, 0.2])),
}


@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math"])
@pytest.mark.parametrize("name", OPTIONS, ids=list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_varlen_grads(name, dtype, backend):
    options = OPTIONS[name]
    lengths_q, lengths_k = [4, 0, 9, 1], [6, 3, 9, 0]
    q = packed(lengths_q, 4, 8, dtype, requires_grad=True)
    k = packed(lengths_k, 2, 8, dtype, requires_grad=True)
    v = packed(lengths_k, 2, 6, dtype, requires_grad=True)
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, backend=backend, **options)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref = reference_grads(q, k, v, cu_q, cu_k, grad_out, alignment="bottom_right",
                          causal=options.get("causal", False), window=options.get("window_size", (-1, -1)),
                          softcap=options.get("softcap", 0.0), alibi_slopes=options.get("alibi_slopes"))
    for name_, got, exp, cu in (("dq", q.grad, ref[0], cu_q), ("dk", k.grad, ref[1], cu_k), ("dv", v.grad, ref[2], cu_k)):
        assert_close_packed(got, exp, cu_seqlens=cu, name=name_, grad=True)


def test_math_gradcheck_float64():
    q = packed([3, 2], 2, 4, torch.float64, requires_grad=True)
    k = packed([4, 2], 1, 4, torch.float64, requires_grad=True)
    v = packed([4, 2], 1, 3, torch.float64, requires_grad=True)
    cu_q, cu_k = cu_of([3, 2]), cu_of([4, 2])

    def fn(q, k, v):
        return jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, softcap=3.0,
                                            alibi_slopes=torch.tensor([0.2, 0.4]), backend="math")

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_empty_rows_get_zero_grads_without_nan():
    q = packed([5], 2, 4, requires_grad=True)
    k = packed([2], 2, 4, requires_grad=True)
    v = packed([2], 2, 4, requires_grad=True)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_of([5]), cu_of([2]), causal=True)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:3], torch.zeros_like(q.grad[:3]))  # rows that see no key


def test_all_keys_empty_still_differentiable():
    q = packed([3], 2, 4, requires_grad=True)
    kv = packed([0], 2, 4, requires_grad=True)
    out = jagged_sdpa.varlen_attention(q, kv, kv, cu_of([3]), cu_of([0]))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_sdpa_njt_grads_match_torch_njt_sdpa():
    lengths = [5, 11, 2]
    leaves = [torch.nested.nested_tensor([torch.randn(n, 2, 8) for n in lengths], layout=torch.jagged,
                                         requires_grad=True) for _ in range(3)]
    out = jagged_sdpa.sdpa(*(t.transpose(1, 2) for t in leaves))
    out.values().pow(2).sum().backward()
    ours = [t.grad.values().clone() for t in leaves]
    for t in leaves:
        t.grad = None
    theirs_out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves))
    theirs_out.values().pow(2).sum().backward()
    for a, t in zip(ours, leaves):
        torch.testing.assert_close(a, t.grad.values(), rtol=1e-4, atol=1e-5)


def test_sdpa_dense_kv_grads():
    q = njt([3, 6], 2, 8, requires_grad=True)
    k = torch.randn(2, 2, 4, 8, requires_grad=True)
    v = torch.randn(2, 2, 4, 8, requires_grad=True)
    out = jagged_sdpa.sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right")
    out.values().sum().backward()
    kd, vd = k.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    total = 0
    for b, seq in enumerate(q.detach().unbind()):
        total = total + F.scaled_dot_product_attention(
            seq.double(), kd[b], vd[b],
            attn_mask=torch.ones(seq.shape[1], 4, dtype=torch.bool).tril(4 - seq.shape[1])).sum()
    total.backward()
    torch.testing.assert_close(k.grad.double(), kd.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(v.grad.double(), vd.grad, rtol=1e-4, atol=1e-5)


def test_dropout_backward_uses_forward_mask():
    """Same seed -> same forward and same gradients; the gradient of sum(out) w.r.t. v then equals
    the column sums of the dropped-out probabilities, which must reproduce out when v = I."""
    q = packed([6], 1, 4)
    k = packed([6], 1, 4)
    eye = torch.eye(6).unsqueeze(1).requires_grad_(True)   # v = identity: out row = its P row
    cu = cu_of([6])
    torch.manual_seed(3)
    out = jagged_sdpa.varlen_attention(q, k, eye, cu, cu, dropout_p=0.4)
    out.sum().backward()
    # d sum(P @ V) / dV = column sums of P: with V = I, out is P itself.
    torch.testing.assert_close(eye.grad.squeeze(1), out.squeeze(1).sum(0, keepdim=True).T.expand(6, 6))
