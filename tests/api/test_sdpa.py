"""sdpa on NJTs against the float64 reference and against PyTorch's own NJT SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import jagged_sdpa
from jagged_sdpa import Backend
from support.cases import cu_of, njt
from support.reference import attention_reference
from support.tolerances import assert_close_packed

BACKENDS = [None, Backend.MATH]


def packed_of(x):
    """(total, H, D) and lengths of a (B, H, j, D) NJT, via public NJT APIs only."""
    parts = [t.transpose(0, 1) for t in x.unbind()]
    return torch.cat(parts), [p.shape[0] for p in parts]


def check_against_reference(out, q, k, v, *, causal=False, alignment="top_left", window=(-1, -1), softcap=0.0,
                            alibi=None, scale=None, dense_kv=False):
    qp, lq = packed_of(q)
    if dense_kv:
        kp = k.transpose(1, 2).reshape(-1, k.shape[1], k.shape[3])
        vp = v.transpose(1, 2).reshape(-1, v.shape[1], v.shape[3])
        lk = [k.shape[2]] * k.shape[0]
    else:
        (kp, lk), (vp, _) = packed_of(k), packed_of(v)
    ref, _ = attention_reference(qp, kp, vp, cu_of(lq), cu_of(lk), scale=scale, causal=causal, alignment=alignment,
                                 window=window, softcap=softcap, alibi_slopes=alibi)
    got, _ = packed_of(out)
    assert_close_packed(got, ref, cu_seqlens=cu_of(lq))


@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math"])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_cross_attention_causal_alignments(alignment, backend):
    q, k, v = njt([3, 9, 1], 4, 16), njt([7, 2, 5], 2, 16), njt([7, 2, 5], 2, 8)
    out = jagged_sdpa.sdpa(q, k, v, is_causal=True, enable_gqa=True, causal_alignment=alignment, backend=backend)
    check_against_reference(out, q, k, v, causal=True, alignment=alignment)


@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math"])
def test_window_softcap_alibi_scale(backend):
    q, k, v = njt([6, 11], 2, 16), njt([6, 11], 2, 16), njt([6, 11], 2, 16)
    slopes = torch.tensor([[0.5, 0.1], [0.2, 0.3]])
    out = jagged_sdpa.sdpa(q, k, v, scale=0.2, window_size=(2, 1), softcap=4.0, alibi_slopes=slopes, backend=backend)
    check_against_reference(out, q, k, v, scale=0.2, window=(2, 1), softcap=4.0, alibi=slopes)


@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math"])
def test_dense_key_value(backend):
    q = njt([4, 0, 7], 4, 16)
    k, v = torch.randn(3, 2, 5, 16), torch.randn(3, 2, 5, 12)
    out = jagged_sdpa.sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right", enable_gqa=True, backend=backend)
    check_against_reference(out, q, k, v, causal=True, alignment="bottom_right", dense_kv=True)


def test_output_shares_query_offsets_and_shape():
    q = njt([3, 5, 2], 4, 16)
    k, v = njt([3, 5, 2], 4, 16), njt([3, 5, 2], 4, 8)
    out = jagged_sdpa.sdpa(q, k, v)
    assert out.is_nested and out.layout == torch.jagged and out._ragged_idx == 2
    assert out.shape[:2] == q.shape[:2] and out.shape[-1] == 8
    assert out.transpose(1, 2).offsets() is q.transpose(1, 2).offsets()
    # The result composes with the query's ragged structure (same symbolic ragged dim).
    ones = torch.nested.nested_tensor_from_jagged(torch.ones(10, 4, 8), offsets=q.transpose(1, 2).offsets())
    assert (out + ones.transpose(1, 2)).shape == out.shape


def test_fused_qkv_projection_strided_njt():
    """NJTs made by a linear projection + view + transpose + chunk, as attention layers do."""
    heads, dim = 2, 8
    x = torch.nested.nested_tensor([torch.randn(n, 12) for n in (4, 9, 1)], layout=torch.jagged)
    proj = torch.nn.Linear(12, 3 * heads * dim)
    with torch.no_grad():
        qkv = proj(x)
    q, k, v = (t.unflatten(-1, (heads, dim)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    assert not q.transpose(1, 2).values().is_contiguous()
    out = jagged_sdpa.sdpa(q, k, v, is_causal=True)
    check_against_reference(out, q, k, v, causal=True)


def test_njt_with_holes():
    values = torch.randn(20, 2, 8)
    offsets, lengths = torch.tensor([0, 5, 12]), torch.tensor([3, 6])
    q = torch.nested.nested_tensor_from_jagged(values, offsets=offsets, lengths=lengths).transpose(1, 2)
    out = jagged_sdpa.sdpa(q, q, q, is_causal=True)
    expected = [F.scaled_dot_product_attention(t, t, t, is_causal=True) for t in
                (values[0:3].transpose(0, 1), values[5:11].transpose(0, 1))]
    for got, exp in zip(out.unbind(), expected):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


def test_empty_sequence_in_njt():
    q = njt([0, 4, 0, 3], 2, 8)
    out = jagged_sdpa.sdpa(q, q, q, is_causal=True)
    check_against_reference(out, q, q, q, causal=True)
    assert [t.shape[1] for t in out.unbind()] == [0, 4, 0, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_agrees_with_torch_njt_sdpa(dtype):
    """docs/api.md: for every input PyTorch's NJT SDPA accepts, results agree with it."""
    q, k, v = njt([5, 17, 2], 2, 16, dtype), njt([5, 17, 2], 2, 16, dtype), njt([5, 17, 2], 2, 16, dtype)
    ours = jagged_sdpa.sdpa(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(ours.unbind(), theirs.unbind()):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_agrees_with_torch_njt_sdpa_cross_attention_and_scale():
    q, k, v = njt([5, 3], 2, 16), njt([2, 9], 2, 16), njt([2, 9], 2, 4)
    ours = jagged_sdpa.sdpa(q, k, v, scale=0.7)
    theirs = F.scaled_dot_product_attention(q, k, v, scale=0.7)
    for a, b in zip(ours.unbind(), theirs.unbind()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_reference_cross_checked_with_dense_sdpa():
    """The reference itself, per sequence, against torch's dense SDPA (features SDPA has)."""
    q, k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    ref, _ = attention_reference(q, k, v, [0, 6], [0, 6], causal=True)
    dense = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k.transpose(0, 1).double(),
                                           v.transpose(0, 1).double(), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(ref, dense)
