"""What runs a CPU call, against the float64 reference: the compiled kernel (CPU_FUSED) for
fp32/fp16/bf16, and MATH for float64 (CPU_FUSED refuses it: the kernel computes in float32), both
through automatic selection. Forward (out + lse) and backward for every option and dtype, paged and
dense keys, and the things a fast path gets wrong first: empty and length-1 sequences, rows that
see no key, strided inputs, NaN tails, many work items and blocks per sequence, dropout replay in
the backward; and that ``explain``, the log and a forced ``cpu_fused`` say why float64 goes to MATH.
"""

from __future__ import annotations

import logging

import pytest
import torch

import jagged_sdpa
from jagged_sdpa import Backend, NoBackendError
from jagged_sdpa.backends import keyed_dropout
from jagged_sdpa.backends import math as math_backend
from jagged_sdpa.backends.cpu import native
from support.cases import alibi_slopes, cu_of, in_nan_buffer, paged_case
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed

CPU = Backend.CPU_FUSED
FLOAT64_REASON = "dtype float64 not supported (supported: bfloat16, float16, float32): the compiled kernel computes in float32"

# Ragged, with an empty query sequence, an empty key sequence, length 1, and one sequence long
# enough for several work items / blocks once they are shrunk (see ``split``).
Q_LENS = [5, 0, 1, 37, 20, 3]
K_LENS = [7, 3, 0, 37, 45, 1]

OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (4, 2)},
    "causal_window": {"causal": True, "window_size": (6, 0)},
    "softcap": {"softcap": 3.0},
    "alibi": {"alibi_slopes": "per_head"},
    "alibi_batch_causal": {"alibi_slopes": "per_batch_head", "causal": True},
    "scale": {"softmax_scale": 0.3},
    "softcap_alibi_window": {"softcap": 2.0, "alibi_slopes": "per_head", "window_size": (8, 8)},
}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def expected_backend(dtype: torch.dtype) -> Backend:
    """What automatic selection runs on the CPU: the compiled kernel, or MATH for float64 (and
    where the kernel cannot be built)."""
    return Backend.MATH if dtype == torch.float64 or native.library() is None else CPU


@pytest.fixture(params=["shipped", "small"])
def split(request, monkeypatch):
    """The shipped work split, and a small one: the kernel's work items of 8 query rows with direct
    rows up to 3 queries over steps of 16 keys, and MATH's blocks of about 4 query rows (many per
    sequence, so visible-key ranges and per-block masks are exercised on small, fast shapes)."""
    if request.param == "small":
        monkeypatch.setattr(native, "Q_CHUNK", 8)
        monkeypatch.setattr(native, "DIRECT_ROWS", 3)
        monkeypatch.setattr(native, "DIRECT_KEYS", 16)
        monkeypatch.setattr(math_backend, "SCORE_BUDGET_BYTES", 4 * 45 * 4 * 8)
    return request.param


def _inputs(q_lens, k_lens, hq, hkv, d, dv, dtype, requires_grad=False):
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    k = torch.randn(sum(k_lens), hkv, d).to(dtype)
    v = torch.randn(sum(k_lens), hkv, dv).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _reference(q, k, v, q_lens, k_lens, opts, slopes, seqused_k=None):
    return attention_reference(
        q.detach(), k.detach(), v.detach(), cu_of(q_lens), cu_of(k_lens), scale=opts.get("softmax_scale"),
        causal=opts.get("causal", False), alignment="bottom_right", window=opts.get("window_size", (-1, -1)),
        softcap=opts.get("softcap", 0.0), alibi_slopes=slopes, seqused_k=seqused_k)


def _reference_grads(q, k, v, q_lens, k_lens, opts, slopes, grad):
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = attention_reference(
        q64, k64, v64, cu_of(q_lens), cu_of(k_lens), scale=opts.get("softmax_scale"),
        causal=opts.get("causal", False), alignment="bottom_right", window=opts.get("window_size", (-1, -1)),
        softcap=opts.get("softcap", 0.0), alibi_slopes=None if slopes is None else slopes.double())
    out.backward(grad.double())
    return q64.grad, k64.grad, v64.grad


def _run(q, k, v, q_lens, k_lens, opts, slopes, backend=None, **extra):
    """(out, lse) of varlen_attention; chosen automatically unless ``backend`` is forced, and then
    checked to run on ``expected_backend``."""
    call_opts = {key: val for key, val in opts.items() if key != "alibi_slopes"}
    args = (q, k, v, cu_of(q_lens), cu_of(k_lens))
    kwargs = dict(alibi_slopes=slopes, return_lse=True, **call_opts, **extra)
    if backend is None:
        assert jagged_sdpa.explain(*args, **kwargs).chosen == expected_backend(q.dtype)
    return jagged_sdpa.varlen_attention(*args, backend=backend, **kwargs)


def _math_same_dtype(q, k, v, q_lens, k_lens, opts, slopes):
    """The same call on MATH in the same dtype: the low-precision error to compare against."""
    with torch.no_grad():
        return _run(q, k, v, q_lens, k_lens, opts, slopes, backend=Backend.MATH)[0]


# ----------------------------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_forward_matches_reference(name, dtype, split):
    opts = OPTIONS[name]
    hq, hkv = 4, 2
    q, k, v = _inputs(Q_LENS, K_LENS, hq, hkv, 16, 16, dtype)
    slopes = alibi_slopes(opts.get("alibi_slopes"), len(Q_LENS), hq)
    out, lse = _run(q, k, v, Q_LENS, K_LENS, opts, slopes)
    ref_out, ref_lse = _reference(q, k, v, Q_LENS, K_LENS, opts, slopes)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (hq, sum(Q_LENS))
    lowp = _math_same_dtype(q, k, v, Q_LENS, K_LENS, opts, slopes) if dtype in (torch.float16, torch.bfloat16) else None
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(Q_LENS), lowp_ref=lowp)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("gqa", [(4, 4), (4, 1), (6, 2)], ids=["mha", "mqa", "gqa3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gqa_and_head_dims(gqa, dtype):
    hq, hkv = gqa
    for d, dv in ((16, 16), (40, 24), (59, 59)):
        q, k, v = _inputs(Q_LENS, K_LENS, hq, hkv, d, dv, dtype)
        out, lse = _run(q, k, v, Q_LENS, K_LENS, {"causal": True}, None)
        ref_out, ref_lse = _reference(q, k, v, Q_LENS, K_LENS, {"causal": True}, None)
        lowp = _math_same_dtype(q, k, v, Q_LENS, K_LENS, {"causal": True}, None) if dtype == torch.bfloat16 else None
        assert_close_packed(out, ref_out, cu_seqlens=cu_of(Q_LENS), lowp_ref=lowp)
        assert_close_lse(lse, ref_lse)


def test_rows_that_see_no_key_are_zero_with_minus_inf_lse(split):
    # Bottom-right with more queries than keys: the first Lq - Lk rows see nothing under causal;
    # a bounded window leaves rows past the keys empty too.
    q_lens, k_lens = [9, 4, 6], [3, 0, 6]
    q, k, v = _inputs(q_lens, k_lens, 2, 2, 8, 8, torch.float32)
    for opts in ({"causal": True}, {"window_size": (0, 0)}, {"causal": True, "window_size": (1, 0)}):
        out, lse = _run(q, k, v, q_lens, k_lens, opts, None)
        ref_out, ref_lse = _reference(q, k, v, q_lens, k_lens, opts, None)
        assert not torch.isnan(out).any()
        assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens))
        assert_close_lse(lse, ref_lse)
        empty = torch.isneginf(ref_lse[0])
        assert empty.any() and (out[empty] == 0).all()


def test_empty_and_single_token_batches():
    for q_lens, k_lens in (([0, 0], [0, 0]), ([1], [1]), ([0, 1, 0], [2, 1, 0]), ([], [])):
        q, k, v = _inputs(q_lens, k_lens, 2, 1, 8, 8, torch.float32)
        out, lse = _run(q, k, v, q_lens, k_lens, {"causal": True}, None)
        ref_out, ref_lse = _reference(q, k, v, q_lens, k_lens, {"causal": True}, None)
        assert out.shape == ref_out.shape
        assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens))
        assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_strided_inputs_in_nan_buffers_are_never_read_outside(dtype, split):
    q, k, v = _inputs(Q_LENS, K_LENS, 4, 2, 16, 16, dtype)
    qn, kn, vn = in_nan_buffer(q), in_nan_buffer(k), in_nan_buffer(v)
    assert not qn.is_contiguous()
    for opts in ({}, {"causal": True, "window_size": (5, 1)}, {"softcap": 4.0}):
        out, lse = _run(qn, kn, vn, Q_LENS, K_LENS, opts, None)
        ref_out, ref_lse = _reference(q, k, v, Q_LENS, K_LENS, opts, None)
        lowp = _math_same_dtype(q, k, v, Q_LENS, K_LENS, opts, None) if dtype == torch.bfloat16 else None
        assert_close_packed(out, ref_out, cu_seqlens=cu_of(Q_LENS), lowp_ref=lowp)
        assert_close_lse(lse, ref_lse)


def last_dim_strided(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a view whose last dim has stride 2, every gap NaN: a kernel that reads the last
    dim as unit-stride reads the gaps, and it shows."""
    buf = torch.full((*x.shape, 2), float("nan"), dtype=x.dtype)
    buf[..., 0] = x
    return buf[..., 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).replace("torch.", ""))
def test_strided_last_dim_forward_and_backward(dtype, split):
    """Last dims with stride 2 (q, k, v and grad_out): the kernel reads rows of D contiguous
    elements, so CPU_FUSED copies such tensors to unit stride first (and says so); MATH's torch
    ops read them as they are."""
    q_lens, k_lens = [200, 3, 40], [200, 5, 60]
    q, k, v = _inputs(q_lens, k_lens, 2, 2, 16, 16, dtype, requires_grad=True)
    grad = torch.randn(sum(q_lens), 2, 16).to(dtype)
    opts = {"causal": True}
    notes = " ".join(jagged_sdpa.explain(*(last_dim_strided(t) for t in (q, k, v)), cu_of(q_lens), cu_of(k_lens),
                                         causal=True).notes)
    assert ("strided last dim are copied to unit stride" in notes) == (expected_backend(dtype) == CPU)
    out, lse = _run(*(last_dim_strided(t) for t in (q, k, v)), q_lens, k_lens, opts, None)
    out.backward(last_dim_strided(grad))
    ref_out, ref_lse = _reference(q, k, v, q_lens, k_lens, opts, None)
    refs = _reference_grads(q, k, v, q_lens, k_lens, opts, None, grad)
    lowp = [None] * 4
    if dtype in (torch.float16, torch.bfloat16):
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out2 = _run(q2, k2, v2, q_lens, k_lens, opts, None, backend=Backend.MATH)[0]
        out2.backward(grad)
        lowp = [out2, q2.grad, k2.grad, v2.grad]
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens), lowp_ref=lowp[0])
    assert_close_lse(lse, ref_lse)
    for name, got, ref, low, lens in (("dq", q.grad, refs[0], lowp[1], q_lens), ("dk", k.grad, refs[1], lowp[2], k_lens),
                                      ("dv", v.grad, refs[2], lowp[3], k_lens)):
        assert_close_packed(got, ref, cu_seqlens=cu_of(lens), name=name, grad=True, lowp_ref=low, fudge=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_strided_last_dim_paged_cache_backward(dtype):
    """A paged cache whose last dim is strided, forward and backward (the kernel in float32, MATH
    in float64): the same numbers as the contiguous call on MATH."""
    q_lens, used = [40, 1, 30], [50, 9, 30]
    k_cache, v_cache, table, seqused, pk, pv = paged_case(q_lens, used, 8, 2, 16, dtype)
    k_cache, v_cache = (torch.nan_to_num(c, nan=0.0) for c in (k_cache, v_cache))
    k_s, v_s = (last_dim_strided(c).requires_grad_(True) for c in (k_cache, v_cache))
    q = torch.randn(sum(q_lens), 4, 16, dtype=dtype, requires_grad=True)
    q_s = last_dim_strided(q.detach()).requires_grad_(True)
    paged = dict(block_table=table, seqused_k=seqused, causal=True)
    assert jagged_sdpa.explain(q_s, k_s, v_s, cu_of(q_lens), None, **paged).chosen == expected_backend(dtype)
    out = jagged_sdpa.varlen_attention(q_s, k_s, v_s, cu_of(q_lens), None, **paged)
    grad = torch.randn_like(out)
    out.backward(last_dim_strided(grad))
    q2, kc2, vc2 = (t.detach().clone().requires_grad_(True) for t in (q, k_cache, v_cache))
    ref = jagged_sdpa.varlen_attention(q2, kc2, vc2, cu_of(q_lens), None, backend="math", **paged)
    ref.backward(grad)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(q_s.grad, q2.grad)
    torch.testing.assert_close(k_s.grad, kc2.grad)
    torch.testing.assert_close(v_s.grad, vc2.grad)


def test_seqused_k_limits_keys_and_tail_is_never_read():
    q_lens, k_caps, used = [4, 6, 1], [10, 6, 9], [7, 0, 9]
    q, k, v = _inputs(q_lens, k_caps, 2, 2, 8, 8, torch.float32)
    cu_k = cu_of(k_caps).tolist()
    for b, n in enumerate(used):  # keys past seqused_k hold NaN: they must not be read
        k.data[cu_k[b] + n:cu_k[b + 1]] = float("nan")
        v.data[cu_k[b] + n:cu_k[b + 1]] = float("nan")
    seqused = torch.tensor(used, dtype=torch.int32)
    out, lse = _run(q, k, v, q_lens, k_caps, {"causal": True}, None, seqused_k=seqused)
    ref_out, ref_lse = _reference(q, k, v, q_lens, k_caps, {"causal": True}, None, seqused_k=used)
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens))
    assert_close_lse(lse, ref_lse)


# ----------------------------------------------------------------------------------------------
# backward


GRAD_OPTIONS = ["plain", "causal", "causal_window", "softcap", "alibi_batch_causal", "softcap_alibi_window"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("name", GRAD_OPTIONS)
def test_backward_matches_reference(name, dtype, split):
    opts = OPTIONS[name]
    hq, hkv = 4, 2
    q, k, v = _inputs(Q_LENS, K_LENS, hq, hkv, 16, 16, dtype, requires_grad=True)
    slopes = alibi_slopes(opts.get("alibi_slopes"), len(Q_LENS), hq)
    out, _ = _run(q, k, v, Q_LENS, K_LENS, opts, slopes)
    grad = torch.randn_like(out)
    out.backward(grad)
    refs = _reference_grads(q, k, v, Q_LENS, K_LENS, opts, slopes, grad)
    lowp = [None] * 3
    if dtype in (torch.float16, torch.bfloat16):
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        _run(q2, k2, v2, Q_LENS, K_LENS, opts, slopes, backend=Backend.MATH)[0].backward(grad)
        lowp = [q2.grad, k2.grad, v2.grad]
    for name_g, got, ref, low, cu in (("dq", q.grad, refs[0], lowp[0], Q_LENS), ("dk", k.grad, refs[1], lowp[1], K_LENS),
                                      ("dv", v.grad, refs[2], lowp[2], K_LENS)):
        assert got.dtype == dtype
        assert_close_packed(got, ref, cu_seqlens=cu_of(cu), name=name_g, grad=True, lowp_ref=low, fudge=3.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("q_len, k_len, opts", [
    (200, 1, {"causal": True}),                              # rows 0..198 see no key, row 199 sees key 0
    (300, 5, {"causal": True}),
    (300, 140, {"causal": True, "window_size": (3, 0)}),
    (200, 60, {"window_size": (0, 0)}),                      # the first 140 rows see none
    (260, 0, {"causal": True}),                              # no key at all
], ids=["one_key_last_block", "lq_gt_lk", "causal_window", "diagonal_window", "no_keys"])
def test_backward_when_leading_blocks_see_no_key(q_len, k_len, opts, dtype, split):
    """Work items (the kernel) or blocks of query rows (MATH) that see no key, before or after
    ones that do: their gradients are 0 and the others' right (a torch-op engine's backward once
    raised IndexError here)."""
    q_lens, k_lens = [q_len, 3], [k_len, 3]
    q, k, v = _inputs(q_lens, k_lens, 2, 1, 8, 8, dtype, requires_grad=True)
    out, _ = _run(q, k, v, q_lens, k_lens, opts, None)
    grad = torch.randn_like(out)
    out.backward(grad)
    refs = _reference_grads(q, k, v, q_lens, k_lens, opts, None, grad)
    for name, got, ref, lens in (("dq", q.grad, refs[0], q_lens), ("dk", k.grad, refs[1], k_lens),
                                 ("dv", v.grad, refs[2], k_lens)):
        assert_close_packed(got, ref, cu_seqlens=cu_of(lens), name=name, grad=True)


@pytest.mark.parametrize("opts", [{"causal": True}, {"softcap": 2.0, "window_size": (3, 3)}],
                         ids=["causal", "softcap_window"])
def test_gradcheck_float64(opts):
    """float64 runs on MATH (selected automatically): its backward is the forward's derivative."""
    q_lens, k_lens = [3, 1, 0, 5], [4, 2, 1, 5]
    q, k, v = _inputs(q_lens, k_lens, 2, 1, 4, 3, torch.float64, requires_grad=True)
    cu_q, cu_k = cu_of(q_lens), cu_of(k_lens)

    def f(q, k, v):
        return jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, **opts)
    assert jagged_sdpa.explain(q, k, v, cu_q, cu_k, **opts).chosen == Backend.MATH
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_dropout_is_reproducible_and_its_backward_replays_the_forward_masks():
    """float64 dropout (MATH, the keyed masks): gradcheck passes only if the backward applies the
    forward's masks."""
    q_lens, k_lens = [3, 6, 1], [5, 6, 2]
    q, k, v = _inputs(q_lens, k_lens, 2, 2, 4, 4, torch.float64, requires_grad=True)
    cu_q, cu_k = cu_of(q_lens), cu_of(k_lens)

    def f(q, k, v):
        torch.manual_seed(1234)
        return jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.3, causal=True)
    first, second = f(q, k, v), f(q, k, v)
    assert torch.equal(first, second)
    with torch.no_grad():
        plain = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert not torch.allclose(first, plain)
    # Same seed before each evaluation = same masks: gradcheck then verifies that the backward
    # replays exactly the forward's dropout masks.
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_dropout_is_unbiased():
    q_lens = [40]
    q, k, v = _inputs(q_lens, q_lens, 1, 1, 8, 8, torch.float32)
    cu = cu_of(q_lens)
    assert jagged_sdpa.explain(q, k, v, cu, cu, dropout_p=0.5).chosen == expected_backend(torch.float32)
    plain = jagged_sdpa.varlen_attention(q, k, v, cu, cu)
    mean = sum(jagged_sdpa.varlen_attention(q, k, v, cu, cu, dropout_p=0.5) for _ in range(400)) / 400
    assert (mean - plain).abs().mean() < 0.05 * plain.abs().mean() + 0.02


# Sharp softmaxes in bf16: logits of ~20-50 (q and k scaled by a power of two, exact in bf16).
SHARP = {"plain": ({}, 4.0), "softcap": ({"softcap": 30.0}, 4.0), "scale": ({"softmax_scale": 1.5}, 2.0)}


def _packed_grads(q, k, v, q_lens, used, opts, grad, dtype):
    """out and dq/dk/dv of the packed call on MATH in ``dtype`` (float64: the reference)."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out = jagged_sdpa.varlen_attention(*leaves, cu_of(q_lens), cu_of(used), causal=True, backend="math", **opts)
    out.backward(grad.to(dtype))
    return [out] + [t.grad for t in leaves]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "packed"])
@pytest.mark.parametrize("name", list(SHARP))
def test_bfloat16_sharp_softmax_matches_reference(name, paged):
    """Scores S and dP must stay float32: rounded to bf16, an absolute error of |S| * 2^-9 in S is
    a relative error in P, and dP - delta cancels (a torch-op engine that did so was 10-70x further
    from float64 than MATH in bf16). Out and gradients within a few times MATH's own bf16 error."""
    opts, amp = SHARP[name]
    q_lens, used, block = [5, 70, 130], [40, 90, 200], 16
    k_cache, v_cache, table, seqused, pk, pv = paged_case(q_lens, used, block, 2, 16, torch.bfloat16)
    k_cache, pk = k_cache * amp, pk * amp
    q = torch.randn(sum(q_lens), 4, 16).to(torch.bfloat16) * amp
    grad = torch.randn(sum(q_lens), 4, 16).to(torch.bfloat16)
    if paged:
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k_cache, v_cache)]
        out = jagged_sdpa.varlen_attention(*leaves, cu_of(q_lens), None, block_table=table, seqused_k=seqused,
                                           causal=True, **opts)
        out.backward(grad)
        slots = torch.cat([(table[b, :-(-n // block)].long().unsqueeze(1) * block + torch.arange(block)).flatten()[:n]
                           for b, n in enumerate(used)])
        got = [out, leaves[0].grad] + [t.grad.flatten(0, 1)[slots] for t in leaves[1:]]
    else:
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, pk, pv)]
        out = jagged_sdpa.varlen_attention(*leaves, cu_of(q_lens), cu_of(used), causal=True, **opts)
        out.backward(grad)
        got = [out] + [t.grad for t in leaves]
    ref = _packed_grads(q, pk, pv, q_lens, used, opts, grad, torch.float64)
    lowp = _packed_grads(q, pk, pv, q_lens, used, opts, grad, torch.bfloat16)
    for what, g, r, low, lens in zip(("out", "dq", "dk", "dv"), got, ref, lowp, (q_lens, q_lens, used, used)):
        assert_close_packed(g, r, cu_seqlens=cu_of(lens), name=what, grad=what != "out", lowp_ref=low,
                            fudge=2.0 if what == "out" else 3.0)


# ----------------------------------------------------------------------------------------------
# sdpa entry, dense and paged keys, selection


def _njt(lengths, heads, dim, dtype=torch.float32, requires_grad=False):
    """A (B, H, j, D) NJT view of a leaf (B, j, H, D) NJT (the leaf is returned for .grad)."""
    parts = [torch.randn(n, heads, dim).to(dtype) for n in lengths]
    leaf = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=requires_grad)
    return leaf.transpose(1, 2), leaf


@pytest.mark.skipif(native.library() is None, reason="needs the compiled kernel")
def test_automatic_selection_picks_cpu_fused_on_cpu():
    q, _ = _njt([3, 8], 2, 8)
    assert jagged_sdpa.explain(q, q, q, is_causal=True).chosen == CPU
    x = torch.randn(11, 2, 8)
    cu = cu_of([3, 8])
    for extra in ({}, {"softcap": 2.0, "dropout_p": 0.1}, {"window_size": (2, 0)}):
        assert jagged_sdpa.explain(x, x, x, cu, cu, **extra).chosen == CPU
    paged = torch.randn(4, 16, 2, 8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    used = torch.tensor([20, 5], dtype=torch.int32)
    assert jagged_sdpa.explain(x, paged, paged, cu, None, block_table=table, seqused_k=used).chosen == CPU


def test_explain_is_silent_when_the_compiled_kernel_runs_every_option():
    if native.library() is None:
        pytest.skip(f"compiled kernel unavailable: {native.unavailable_reason()}")
    x = torch.randn(11, 2, 8)
    cu = cu_of([3, 8])
    for opts in ({"causal": True}, {"softcap": 2.0}, {"window_size": (2, 1)}, {"dropout_p": 0.1}):
        assert not jagged_sdpa.explain(x, x, x, cu, cu, **opts).notes


def test_float64_runs_on_math_and_every_report_says_why(caplog):
    """float64 on the CPU: cpu_fused refuses it with its reason, selection takes MATH, and the
    explain table, the DEBUG log line and a forced cpu_fused's error all say so."""
    x = torch.randn(11, 2, 8, dtype=torch.float64)
    cu = cu_of([3, 8])
    explained = jagged_sdpa.explain(x, x, x, cu, cu, causal=True, dropout_p=0.1)
    assert explained.chosen == Backend.MATH and explained.reasons[CPU] == [FLOAT64_REASON]
    assert f"cpu_fused      no        {FLOAT64_REASON}" in str(explained) and "chosen: math" in str(explained)
    with caplog.at_level(logging.DEBUG, logger="jagged_sdpa"):
        jagged_sdpa.varlen_attention(x, x, x, cu, cu, causal=True)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "jagged_sdpa")
    assert FLOAT64_REASON in logged and "chosen: math" in logged
    with pytest.raises(NoBackendError) as info:
        jagged_sdpa.varlen_attention(x, x, x, cu, cu, backend="cpu_fused")
    text = str(info.value)
    assert "forced backend cpu_fused cannot take this call" in text and FLOAT64_REASON in text
    assert "math           yes" in text  # the left-out table names what would take it


def test_float64_paged_dropout_call_runs_on_math_and_matches_the_reference():
    """A float64 paged call with dropout and shared cache blocks (automatic selection: MATH) against
    the float64 reference applying the same keyed mask, forward (out, lse) and backward (q and the
    cache, shared blocks summed)."""
    q_lens, used, p = [3, 5, 2, 0], [20, 9, 17, 4], 0.3
    k_cache, v_cache, table, seqused, pk, pv = paged_case(q_lens, used, 8, 1, 8, torch.float64,
                                                          shared_first_block=True)
    k_cache, v_cache = (torch.nan_to_num(c, nan=0.0).requires_grad_(True) for c in (k_cache, v_cache))
    q = torch.randn(sum(q_lens), 2, 8, dtype=torch.float64, requires_grad=True)
    kwargs = dict(block_table=table, seqused_k=seqused, causal=True, softcap=5.0, dropout_p=p, return_lse=True)
    explained = jagged_sdpa.explain(q, k_cache, v_cache, cu_of(q_lens), None, **kwargs)
    assert explained.chosen == Backend.MATH and explained.reasons[CPU] == [FLOAT64_REASON]
    torch.manual_seed(11)
    key = keyed_dropout.draw_key()
    torch.manual_seed(11)
    out, lse = jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_of(q_lens), None, **kwargs)
    grad = torch.randn_like(out)
    out.backward(grad)
    slots = torch.cat([(table[b, :-(-n // 8)].long().unsqueeze(1) * 8 + torch.arange(8)).flatten()[:n]
                       for b, n in enumerate(used)])
    q64, kc64, vc64 = (t.detach().clone().requires_grad_(True) for t in (q, k_cache, v_cache))
    keep = lambda b, lq, lk: keyed_dropout.keep_mask(key, b, 2, torch.arange(lq), torch.arange(lk), p)
    ref, ref_lse = attention_reference(q64, kc64.flatten(0, 1)[slots], vc64.flatten(0, 1)[slots], cu_of(q_lens),
                                       cu_of(used), causal=True, alignment="bottom_right", softcap=5.0,
                                       dropout_p=p, dropout_keep=keep)
    ref.backward(grad)
    assert_close_packed(out, ref, cu_seqlens=cu_of(q_lens))
    assert_close_lse(lse, ref_lse)
    assert_close_packed(q.grad, q64.grad, cu_seqlens=cu_of(q_lens), name="dq", grad=True)
    for name, got, want in (("dk_cache", k_cache.grad, kc64.grad), ("dv_cache", v_cache.grad, vc64.grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8, msg=name)


def test_long_float64_sequence_runs_in_math_blocks(monkeypatch):
    """A long float64 sequence goes to MATH, which never holds more than one block of scores
    (its budget), forward and backward, and still equals dense SDPA in float64."""
    sizes = []
    original = math_backend.attend_block

    def recording(spec, q, k, *args, **kwargs):
        sizes.append(spec.heads_q * q.shape[0] * k.shape[0] * 8)
        return original(spec, q, k, *args, **kwargs)
    monkeypatch.setattr(math_backend, "attend_block", recording)
    n = 3000
    x = torch.randn(n, 4, 8, dtype=torch.float64, requires_grad=True)
    cu = cu_of([n])
    assert jagged_sdpa.explain(x, x, x, cu, cu, causal=True).chosen == Backend.MATH
    out = jagged_sdpa.varlen_attention(x, x, x, cu, cu, causal=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert len(sizes) > 2 and max(sizes) <= math_backend.SCORE_BUDGET_BYTES
    x64 = x.detach().transpose(0, 1).requires_grad_(True)
    dense = torch.nn.functional.scaled_dot_product_attention(x64, x64, x64, is_causal=True)
    dense.backward(grad.transpose(0, 1))
    torch.testing.assert_close(out, dense.transpose(0, 1))
    torch.testing.assert_close(x.grad, x64.grad.transpose(0, 1))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_sdpa_njt_forward_and_backward(alignment):
    lengths_q, lengths_k = [5, 1, 30], [9, 4, 30]
    (q, q_leaf), (k, k_leaf), (v, v_leaf) = (_njt(lengths_q, 4, 16, requires_grad=True),
                                             _njt(lengths_k, 2, 16, requires_grad=True),
                                             _njt(lengths_k, 2, 16, requires_grad=True))
    out = jagged_sdpa.sdpa(q, k, v, is_causal=True, enable_gqa=True, causal_alignment=alignment,
                           window_size=(7, -1))
    packed_out = out.transpose(1, 2).values()
    grad = torch.randn_like(packed_out)
    packed_out.backward(grad)
    leaves = [t.values().detach().double().requires_grad_(True) for t in (q_leaf, k_leaf, v_leaf)]
    ref, _ = attention_reference(*leaves, cu_of(lengths_q), cu_of(lengths_k), causal=True, alignment=alignment,
                                 window=(7, -1))
    assert_close_packed(packed_out, ref, cu_seqlens=cu_of(lengths_q))
    ref.backward(grad.double())
    for name, leaf, ref_leaf, lens in (("dq", q_leaf, leaves[0], lengths_q), ("dk", k_leaf, leaves[1], lengths_k),
                                       ("dv", v_leaf, leaves[2], lengths_k)):
        assert_close_packed(leaf.grad.values(), ref_leaf.grad, cu_seqlens=cu_of(lens), name=name, grad=True)


def test_sdpa_dense_kv_matches_reference():
    lengths = [3, 12, 1]
    q, _ = _njt(lengths, 2, 8)
    k, v = torch.randn(3, 2, 7, 8), torch.randn(3, 2, 7, 8)
    out = jagged_sdpa.sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right")
    pk = k.transpose(1, 2).reshape(21, 2, 8)
    pv = v.transpose(1, 2).reshape(21, 2, 8)
    ref, _ = attention_reference(q.transpose(1, 2).values(), pk, pv, cu_of(lengths), [0, 7, 14, 21],
                                 causal=True, alignment="bottom_right")
    assert_close_packed(out.transpose(1, 2).values(), ref, cu_seqlens=cu_of(lengths))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_paged_decode_few_queries_long_contexts(dtype):
    q_lens, used = [1, 1, 2, 1], [70, 1, 33, 0]
    k_cache, v_cache, table, seqused, pk, pv = paged_case(q_lens, used, 16, 2, 16, dtype)
    q = torch.randn(sum(q_lens), 4, 16).to(dtype)
    out, lse = jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_of(q_lens), None, 2, 70, causal=True,
                                            block_table=table, seqused_k=seqused, return_lse=True)
    ref_out, ref_lse = attention_reference(q, pk, pv, cu_of(q_lens), cu_of(used), causal=True, alignment="bottom_right")
    lowp = None
    if dtype == torch.bfloat16:
        lowp = jagged_sdpa.varlen_attention(q, pk, pv, cu_of(q_lens), cu_of(used), causal=True, backend="math")
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens), lowp_ref=lowp)
    assert_close_lse(lse, ref_lse)


@pytest.mark.skipif(native.library() is None, reason="needs the compiled kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_call_with_a_gradient_runs_the_kernel_in_place(dtype, monkeypatch):
    """Paged calls that need a gradient run the compiled kernel on both passes, reading the cache
    through the block table; its backward sums the dK/dV of shared blocks, the same way on every run."""
    kernel_calls = []
    original = native.backward

    def recording(call, *args):
        kernel_calls.append(call.block_table is not None and call.k.dim() == 4)
        return original(call, *args)
    monkeypatch.setattr(native, "backward", recording)
    q_lens, used = [3, 5, 2, 0], [20, 9, 17, 4]
    k_cache, v_cache, table, seqused, pk, pv = paged_case(q_lens, used, 8, 2, 16, torch.float64,
                                                          shared_first_block=True)
    k_cache, v_cache = (torch.nan_to_num(t, nan=0.0) for t in (k_cache, v_cache))
    q = torch.randn(sum(q_lens), 4, 16, dtype=torch.float64)
    grad = torch.randn(sum(q_lens), 4, 16, dtype=torch.float64)
    runs = []
    for _ in range(2):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k_cache, v_cache)]
        args = (*leaves, cu_of(q_lens), None)
        kwargs = dict(block_table=table, seqused_k=seqused, causal=True, softcap=20.0, backend=CPU)
        assert not jagged_sdpa.explain(*args, **kwargs).notes
        jagged_sdpa.varlen_attention(*args, **kwargs).backward(grad.to(dtype))
        runs.append([t.grad for t in leaves])
    assert kernel_calls == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ref = [t.detach().clone().requires_grad_(True) for t in (q, k_cache, v_cache)]
    jagged_sdpa.varlen_attention(ref[0], ref[1], ref[2], cu_of(q_lens), None, block_table=table, seqused_k=seqused,
                                 causal=True, softcap=20.0, backend="math").backward(grad)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    for got, want in zip(runs[0], (t.grad for t in ref)):
        torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
def test_bfloat16_lse_is_float32_accurate(requires_grad, split):
    """Scores are never rounded to bf16, so the lse is float32-accurate."""
    q, k, v = _inputs(Q_LENS, K_LENS, 4, 2, 32, 32, torch.bfloat16, requires_grad=requires_grad)
    _, lse = _run(q, k, v, Q_LENS, K_LENS, {"softcap": 20.0}, None)
    _, ref_lse = _reference(q, k, v, Q_LENS, K_LENS, {"softcap": 20.0}, None)
    assert_close_lse(lse, ref_lse)


# ----------------------------------------------------------------------------------------------
# decode rows (one query row): the kernel's direct rows (with ``split=small``, over key steps of 16)

DECODE_K_LENS = [7, 1, 37, 130, 20, 3]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_decode_rows_match_reference(name, dtype, split):
    opts = OPTIONS[name]
    q_lens = [1] * len(DECODE_K_LENS)
    hq, hkv = 4, 2
    q, k, v = _inputs(q_lens, DECODE_K_LENS, hq, hkv, 16, 16, dtype)
    slopes = alibi_slopes(opts.get("alibi_slopes"), len(q_lens), hq)
    out, lse = _run(q, k, v, q_lens, DECODE_K_LENS, opts, slopes)
    ref_out, ref_lse = _reference(q, k, v, q_lens, DECODE_K_LENS, opts, slopes)
    lowp = _math_same_dtype(q, k, v, q_lens, DECODE_K_LENS, opts, slopes) if dtype in (torch.float16, torch.bfloat16) else None
    assert out.dtype == dtype
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens), lowp_ref=lowp)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("gqa", [(4, 1), (6, 2), (3, 3)], ids=["mqa", "gqa3", "mha"])
@pytest.mark.parametrize("dims", [(16, 16), (40, 24), (24, 40)], ids=["d16", "dv24", "dv40"])
def test_decode_rows_gqa_and_value_dims(gqa, dims, dtype):
    hq, hkv = gqa
    q_lens = [1] * len(DECODE_K_LENS)
    q, k, v = _inputs(q_lens, DECODE_K_LENS, hq, hkv, *dims, dtype)
    out, lse = _run(q, k, v, q_lens, DECODE_K_LENS, {"causal": True}, None)
    ref_out, ref_lse = _reference(q, k, v, q_lens, DECODE_K_LENS, {"causal": True}, None)
    lowp = _math_same_dtype(q, k, v, q_lens, DECODE_K_LENS, {"causal": True}, None) if dtype == torch.bfloat16 else None
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens), lowp_ref=lowp)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_decode_rows_mixed_with_prefill_and_strided_nan_buffers(dtype, split):
    """Decode rows beside longer sequences and empty ones; the packed buffers sit inside
    NaN-filled storage, so any read past a row's keys shows."""
    q_lens, k_lens = [1, 9, 1, 0, 1, 30], [12, 9, 0, 4, 50, 30]
    q, k, v = _inputs(q_lens, k_lens, 4, 2, 16, 16, dtype)
    qn, kn, vn = (in_nan_buffer(t) for t in (q, k, v))
    out, lse = _run(qn, kn, vn, q_lens, k_lens, {"causal": True}, None)
    ref_out, ref_lse = _reference(q, k, v, q_lens, k_lens, {"causal": True}, None)
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens))
    assert_close_lse(lse, ref_lse)
    assert torch.equal(out[1 + 9], torch.zeros_like(out[10]))  # a row with no keys


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_decode_rows_through_sdpa_njt(alignment, split):
    """One-query NJT sequences, causal in both alignments (top-left: each row sees key 0 only)."""
    lengths_q, lengths_k = [1, 1, 1], [9, 1, 40]
    (q, q_leaf), (k, k_leaf), (v, v_leaf) = (_njt(lengths_q, 4, 16), _njt(lengths_k, 2, 16), _njt(lengths_k, 2, 16))
    out = jagged_sdpa.sdpa(q, k, v, is_causal=True, enable_gqa=True, causal_alignment=alignment,
                           window_size=(7, -1))
    ref, _ = attention_reference(*(t.values() for t in (q_leaf, k_leaf, v_leaf)), cu_of(lengths_q),
                                 cu_of(lengths_k), causal=True, alignment=alignment, window=(7, -1))
    assert_close_packed(out.transpose(1, 2).values(), ref, cu_seqlens=cu_of(lengths_q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_decode_rows_with_a_gradient(dtype, split):
    q_lens = [1] * len(DECODE_K_LENS)
    q, k, v = _inputs(q_lens, DECODE_K_LENS, 4, 2, 16, 16, dtype, requires_grad=True)
    out, _ = _run(q, k, v, q_lens, DECODE_K_LENS, {"causal": True}, None)
    grad = torch.randn_like(out)
    out.backward(grad)
    refs = _reference_grads(q, k, v, q_lens, DECODE_K_LENS, {"causal": True}, None, grad)
    for name, got, ref, lens in (("dq", q.grad, refs[0], q_lens), ("dk", k.grad, refs[1], DECODE_K_LENS),
                                 ("dv", v.grad, refs[2], DECODE_K_LENS)):
        assert_close_packed(got, ref, cu_seqlens=cu_of(lens), name=name, grad=True)


# Direct rows over several steps of keys, in every input dtype, with GQA and head dims that are
# not multiples of 16 or 32 (the kernel's bf16 pairs and masked row tails), Dv != D, and with the
# per-score options; fp16/bf16 against MATH's own error in the same dtype.
DECODE_LONG_K_LENS = [300, 1, 37, 0, 600, 19]
DECODE_DIMS = [(1, 1), (24, 24), (37, 45), (72, 80), (96, 96), (200, 72)]
DECODE_OPTIONS = {
    "causal": {"causal": True},
    "softcap_alibi_window": {"causal": True, "softcap": 5.0, "alibi_slopes": "per_head", "window_size": (250, 0)},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dims", DECODE_DIMS, ids=lambda d: f"d{d[0]}_dv{d[1]}")
@pytest.mark.parametrize("name", list(DECODE_OPTIONS))
def test_decode_rows_long_gqa_odd_dims(name, dims, dtype, split):
    opts = DECODE_OPTIONS[name]
    q_lens = [1] * len(DECODE_LONG_K_LENS)
    hq, hkv = 8, 2
    q, k, v = _inputs(q_lens, DECODE_LONG_K_LENS, hq, hkv, *dims, dtype)
    slopes = alibi_slopes(opts.get("alibi_slopes"), len(q_lens), hq)
    out, lse = _run(q, k, v, q_lens, DECODE_LONG_K_LENS, opts, slopes)
    ref_out, ref_lse = _reference(q, k, v, q_lens, DECODE_LONG_K_LENS, opts, slopes)
    lowp = _math_same_dtype(q, k, v, q_lens, DECODE_LONG_K_LENS, opts, slopes) if dtype != torch.float32 else None
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens), lowp_ref=lowp)
    assert_close_lse(lse, ref_lse)
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # the row with no keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_decode_rows_same_bits_on_one_and_two_threads(dtype):
    q_lens = [1] * len(DECODE_LONG_K_LENS)
    q, k, v = _inputs(q_lens, DECODE_LONG_K_LENS, 8, 2, 37, 45, dtype)
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_run(q, k, v, q_lens, DECODE_LONG_K_LENS, {"causal": True}, None))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_decode_rows_nan_key_reaches_only_its_rows(split):
    """A NaN in one key of a long sequence: that row's out and lse are NaN (as in dense attention),
    every other row matches the reference."""
    q_lens = [1] * len(DECODE_LONG_K_LENS)
    q, k, v = _inputs(q_lens, DECODE_LONG_K_LENS, 4, 2, 24, 24, torch.bfloat16)
    k[300 + 1 + 20, 1, 5] = float("nan")  # sequence 2, key 20, kv head 1 (query heads 2, 3)
    out, lse = _run(q, k, v, q_lens, DECODE_LONG_K_LENS, {"causal": True}, None)
    assert torch.isnan(out[2, 2:]).all() and torch.isnan(lse[2:, 2]).all()
    keep = [0, 1, 4, 5]
    ref_out, ref_lse = _reference(q, k, v, q_lens, DECODE_LONG_K_LENS, {"causal": True}, None)
    assert_close_packed(out[keep], ref_out[keep], cu_seqlens=cu_of([1] * 4),
                        lowp_ref=_math_same_dtype(q, k, v, q_lens, DECODE_LONG_K_LENS, {"causal": True}, None)[keep])
    assert not torch.isnan(out[2, :2]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_rows_gradient_odd_dims_gqa(dtype, split):
    """The backward of direct sequences recomputes their scores with the forward's function."""
    q_lens = [1] * len(DECODE_LONG_K_LENS)
    q, k, v = _inputs(q_lens, DECODE_LONG_K_LENS, 6, 2, 37, 45, dtype, requires_grad=True)
    out, _ = _run(q, k, v, q_lens, DECODE_LONG_K_LENS, {"causal": True, "softcap": 4.0}, None)
    grad = torch.randn_like(out)
    out.backward(grad)
    refs = _reference_grads(q, k, v, q_lens, DECODE_LONG_K_LENS, {"causal": True, "softcap": 4.0}, None, grad)
    lowp = [None] * 3
    if dtype != torch.float32:
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out2, _ = _run(q2, k2, v2, q_lens, DECODE_LONG_K_LENS, {"causal": True, "softcap": 4.0}, None,
                       backend=Backend.MATH)
        out2.backward(grad)
        lowp = [q2.grad, k2.grad, v2.grad]
    for i, (name, got, ref, lens) in enumerate((("dq", q.grad, refs[0], q_lens), ("dk", k.grad, refs[1], DECODE_LONG_K_LENS),
                                                ("dv", v.grad, refs[2], DECODE_LONG_K_LENS))):
        assert_close_packed(got, ref, cu_seqlens=cu_of(lens), name=name, grad=True, lowp_ref=lowp[i], fudge=3.0)
