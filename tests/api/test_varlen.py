"""varlen_attention against the float64 reference: flash-attn semantics on ragged batches.

Runs through automatic selection and through forced MATH, so whichever CPU backend is chosen
automatically is held to the same reference.
"""

from __future__ import annotations


import pytest
import torch

import jagged_sdpa
from jagged_sdpa import Backend
from support.cases import LENGTHS, cu_of, in_nan_buffer, packed
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed

BACKENDS = [None, Backend.MATH]  # None = automatic selection


def run_case(lengths_q, lengths_k, hq, hkv, d, dv, dtype, backend, *, nan_tails=False, **options):
    q = packed(lengths_q, hq, d, dtype)
    k = packed(lengths_k, hkv, d, dtype)
    v = packed(lengths_k, hkv, dv, dtype)
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    if nan_tails:
        q, k, v = in_nan_buffer(q), in_nan_buffer(k), in_nan_buffer(v)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend=backend, **options)
    ref_options = {name: options[name] for name in ("causal", "window_size", "softcap", "alibi_slopes") if name in options}
    ref_out, ref_lse = attention_reference(
        q, k, v, cu_q, cu_k, scale=options.get("softmax_scale"), causal=ref_options.get("causal", False),
        alignment="bottom_right", window=ref_options.get("window_size", (-1, -1)),
        softcap=ref_options.get("softcap", 0.0), alibi_slopes=ref_options.get("alibi_slopes"))
    assert out.dtype == dtype and out.shape == (q.shape[0], hq, dv)
    assert lse.dtype == torch.float32 and lse.shape == (hq, q.shape[0])
    assert_close_packed(out, ref_out, cu_seqlens=cu_q)
    assert_close_lse(lse, ref_lse)
    return out, lse


OPTION_SETS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 2)),
    "causal-window": dict(causal=True, window_size=(4, 0)),
    "softcap": dict(softcap=2.5),
    "scale": dict(softmax_scale=0.3),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "alibi-per-batch": dict(alibi_slopes=torch.rand(4, 4)),
    "everything": dict(causal=True, window_size=(5, -1), softcap=3.0, alibi_slopes=torch.rand(4)),
}


@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math"])
@pytest.mark.parametrize("options", OPTION_SETS, ids=list(OPTION_SETS))
def test_options_ragged_gqa(options, backend):
    opts = dict(OPTION_SETS[options])
    lengths_q, lengths_k = [5, 0, 17, 1], [9, 4, 12, 0]
    run_case(lengths_q, lengths_k, 4, 2, 16, 16, torch.float32, backend, **opts)


@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math"])
@pytest.mark.parametrize("name", LENGTHS, ids=list(LENGTHS))
def test_length_sets(name, backend):
    lengths = LENGTHS[name]
    run_case(lengths, lengths, 2, 2, 24, 24, torch.float32, backend, causal=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math"])
def test_dtypes(dtype, backend):
    run_case([7, 1, 20], [11, 3, 20], 4, 1, 32, 32, dtype, backend, causal=True, softcap=5.0)


@pytest.mark.parametrize("d,dv", [(1, 1), (40, 40), (59, 17), (111, 111), (256, 64)])
def test_head_dims(d, dv):
    run_case([4, 9], [6, 9], 2, 2, d, dv, torch.float32, None, causal=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=["auto", "math"])
def test_nan_tails_never_read(backend):
    out, lse = run_case([3, 8, 0, 5], [6, 2, 4, 5], 4, 2, 16, 8, torch.float32, backend, nan_tails=True, causal=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def test_empty_rows_zero_and_minus_inf():
    # Bottom-right causal with Lq > Lk: the first Lq - Lk queries see no key.
    q, k, v = packed([6], 2, 8), packed([2], 2, 8), packed([2], 2, 8)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_of([6]), cu_of([2]), causal=True, return_lse=True)
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    assert torch.isneginf(lse[:, :4]).all() and torch.isfinite(lse[:, 4:]).all()
    # An empty key sequence.
    out, lse = jagged_sdpa.varlen_attention(packed([3], 2, 8), packed([0], 2, 8), packed([0], 2, 8),
                                            cu_of([3]), cu_of([0]), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_bottom_right_causal_semantics():
    """Query i of Lq sees keys j <= i + Lk - Lq: check it against an explicit dense computation."""
    q, k, v = packed([2], 1, 4), packed([5], 1, 4), packed([5], 1, 4)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_of([2]), cu_of([5]), causal=True)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(out, expected)


def test_max_seqlen_given_matches_computed():
    lengths = [5, 17, 1]
    q, k, v = packed(lengths, 2, 8), packed(lengths, 2, 8), packed(lengths, 2, 8)
    cu = cu_of(lengths)
    a = jagged_sdpa.varlen_attention(q, k, v, cu, cu, causal=True)
    b = jagged_sdpa.varlen_attention(q, k, v, cu, cu, 17, 30, causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sliced_packed_inputs_from_fused_qkv():
    """q/k/v as strided slices of one fused (total, 3, H, D) buffer work without copies."""
    lengths = [4, 0, 9]
    fused = torch.randn(sum(lengths), 3, 2, 16)
    q, k, v = fused[:, 0], fused[:, 1], fused[:, 2]
    cu = cu_of(lengths)
    out = jagged_sdpa.varlen_attention(q, k, v, cu, cu, causal=True)
    ref, _ = attention_reference(q, k, v, cu, cu, causal=True, alignment="bottom_right")
    assert_close_packed(out, ref, cu_seqlens=cu)


def test_seqused_k_limits_keys():
    lengths_q, lengths_k, used = [3, 2], [8, 6], [5, 0]
    q, k, v = packed(lengths_q, 2, 8), packed(lengths_k, 2, 8), packed(lengths_k, 2, 8)
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                            seqused_k=torch.tensor(used, dtype=torch.int32))
    ref, ref_lse = attention_reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right", seqused_k=used)
    assert_close_packed(out, ref, cu_seqlens=cu_q)
    assert_close_lse(lse, ref_lse)


def test_no_lse_by_default():
    q = packed([3], 1, 4)
    out = jagged_sdpa.varlen_attention(q, q, q, cu_of([3]), cu_of([3]))
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


def test_empty_batch():
    q = torch.randn(0, 2, 8)
    out, lse = jagged_sdpa.varlen_attention(q, q, q, torch.zeros(1, dtype=torch.int32),
                                            torch.zeros(1, dtype=torch.int32), return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


def test_dropout_reproducible_and_unbiased():
    lengths = [30, 20]
    q, k, v = packed(lengths, 2, 8), packed(lengths, 2, 8), packed(lengths, 2, 8)
    cu = cu_of(lengths)
    torch.manual_seed(5)
    a = jagged_sdpa.varlen_attention(q, k, v, cu, cu, dropout_p=0.3)
    torch.manual_seed(5)
    b = jagged_sdpa.varlen_attention(q, k, v, cu, cu, dropout_p=0.3)
    c = jagged_sdpa.varlen_attention(q, k, v, cu, cu, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # With v = 1 everywhere each output is (kept probability mass) / (1 - p): its mean over many
    # rows is 1, and some rows differ from 1 (entries were dropped).
    ones = torch.ones_like(v)
    outs = torch.stack([jagged_sdpa.varlen_attention(q, k, ones, cu, cu, dropout_p=0.3) for _ in range(20)])
    assert abs(outs.mean().item() - 1.0) < 0.05
    assert (outs - 1).abs().max() > 0.1


ODD_LAYOUTS = {
    "last-dim-stride-2": lambda: (torch.randn(13, 4, 32)[:, :, ::2], torch.randn(16, 2, 32)[:, :, ::2],
                                  torch.randn(16, 2, 32)[:, :, ::2]),
    "heads-major-storage": lambda: (torch.randn(4, 13, 16).transpose(0, 1), torch.randn(2, 16, 16).transpose(0, 1),
                                    torch.randn(2, 16, 16).transpose(0, 1)),
    "stride-0-kv-heads": lambda: (torch.randn(13, 4, 16), torch.randn(16, 1, 16).expand(16, 2, 16),
                                  torch.randn(16, 1, 16).expand(16, 2, 16)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ODD_LAYOUTS, ids=list(ODD_LAYOUTS))
def test_odd_strides_through_automatic_selection(layout, dtype):
    q, k, v = (t.to(dtype) for t in ODD_LAYOUTS[layout]())
    cu_q, cu_k = cu_of([3, 0, 9, 1]), cu_of([5, 2, 9, 0])
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    ref, _ = attention_reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right")
    assert_close_packed(out, ref, cu_seqlens=cu_q)
