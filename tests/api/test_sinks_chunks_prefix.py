"""docs/api.md section 11: attention sinks, chunked attention (chunk_size) and prefix-LM (prefix_lens).

- MATH against the float64 reference (tests/support/reference.py, written from the contract's formulas),
  forward (out, lse) and backward (dq, dk, dv, and the sinks' gradient by float64 autograd of the
  reference), for mixes of the three with each other and with causal (both alignments), window,
  softcap, ALiBi (and its gradient), GQA, dropout, seqused_k, paged keys and empty sequences, with
  MATH's blocks shrunk so block boundaries fall everywhere; ``gradcheck`` of the sinks.
- Through ``varlen_attention``, ``sdpa`` (NJTs, dense key/value), ``plan.run`` (bit for bit equal
  to ``varlen_attention``, forward and backward; ``update`` with new prefix_lens) and
  ``torch.compile(fullgraph=True)`` (0 graph breaks, equal to eager); ``opcheck`` of the operators.
- ``explain``: the backends that cannot apply them say why (TRITON can), MATH is chosen on the
  CPU; options that change nothing (a chunk covering every key and row, all-zero prefixes) are
  normalised away.
- Every rejected input: a ValueError/TypeError naming ``sinks``, ``chunk_size`` or ``prefix_lens``
  before any kernel; the device-side form of the prefix_lens check.
- TRITON (interpreter), the last section: the mixes forward and backward against the reference.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo

from support.cases import cu_of, njt, packed, paged_case
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed

import jagged_sdpa
from jagged_sdpa import Backend, NoBackendError, batch as batches, ops, spec as specs
from jagged_sdpa.backends import keyed_dropout
from jagged_sdpa.backends import math as math_backend
from jagged_sdpa.backends.cpu import native

HQ, HKV, D = 4, 2, 8
needs_kernel = pytest.mark.skipif(native.library() is None, reason="needs the compiled CPU kernel")
# MATH, and the compiled kernel where this machine builds it (tests of behaviour both must show).
BACKENDS = ["math", pytest.param("cpu_fused", marks=needs_kernel)]
# What automatic selection runs for a fp32/fp16/bf16 CPU call with these options.
CPU_BACKEND = Backend.MATH if native.library() is None else Backend.CPU_FUSED
# Lq > Lk (negative bottom-right positions), Lq < Lk, an empty query and an empty key sequence.
LQ = [5, 9, 0, 3, 6, 2]
LK = [7, 9, 2, 4, 2, 0]
PREFIX = [3, 9, 1, 0, 2, 0]

MIXES = {
    "sinks": dict(sinks=True),
    "sinks_causal_lse": dict(sinks=True, causal=True),
    "chunk_causal": dict(chunk_size=3, causal=True),
    "chunk_window_noncausal": dict(chunk_size=3, window_size=(2, 1)),
    "chunk_noncausal": dict(chunk_size=2),
    "prefix_causal": dict(prefix=True, causal=True),
    "prefix_window": dict(prefix=True, causal=True, window_size=(1, 0)),
    "prefix_window_noncausal": dict(prefix=True, window_size=(1, 2)),   # prefix rows see past P
    "prefix_chunk_noncausal_sinks": dict(prefix=True, chunk_size=4, sinks=True),
    "prefix_chunk_sinks": dict(prefix=True, chunk_size=2, causal=True, sinks=True),
    "everything": dict(prefix=True, chunk_size=3, causal=True, sinks=True, window_size=(4, 0), softcap=3.0,
                       alibi=True),
    "sinks_alibi_grad_softcap": dict(sinks=True, alibi=True, softcap=2.0, window_size=(-1, 1)),
}


def _inputs(dtype=torch.float32, lq=LQ, lk=LK, hq=HQ, hkv=HKV, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = packed(lq, hq, D, gen=gen).to(dtype).requires_grad_()
    k = packed(lk, hkv, D, gen=gen).to(dtype).requires_grad_()
    v = packed(lk, hkv, D, gen=gen).to(dtype).requires_grad_()
    sinks = (torch.randn(hq, generator=gen) * 2).to(dtype).requires_grad_()
    slopes = (torch.rand(hq, generator=gen) * 0.5).requires_grad_()
    return q, k, v, sinks, slopes


def _kwargs(mix, sinks, slopes, prefix_lens):
    kw = {name: mix[name] for name in ("causal", "window_size", "softcap", "chunk_size") if name in mix}
    if mix.get("sinks"):
        kw["sinks"] = sinks
    if mix.get("alibi"):
        kw["alibi_slopes"] = slopes
    if mix.get("prefix"):
        kw["prefix_lens"] = prefix_lens
    return kw


def _reference(q, k, v, cu_q, cu_k, kw, alignment="bottom_right", **extra):
    """float64 out, lse and the float64 leaves (q, k, v[, sinks][, slopes]) for gradients."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    sinks = slopes = None
    if kw.get("sinks") is not None:
        sinks = kw["sinks"].detach().double().requires_grad_()
        leaves.append(sinks)
    if kw.get("alibi_slopes") is not None:
        slopes = kw["alibi_slopes"].detach().double().requires_grad_()
        leaves.append(slopes)
    prefix = kw.get("prefix_lens")
    out, lse = attention_reference(
        *leaves[:3], cu_q, cu_k, causal=kw.get("causal", False), alignment=alignment,
        window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0), alibi_slopes=slopes, sinks=sinks,
        chunk_size=kw.get("chunk_size"), prefix_lens=None if prefix is None else prefix.tolist(), **extra)
    return out, lse, leaves


def _grad_leaves(q, k, v, kw):
    return [q, k, v] + [kw[n] for n in ("sinks", "alibi_slopes") if kw.get(n) is not None]


def _check_grads(got, ref, cu_q, cu_k):
    names = ["dq", "dk", "dv", "dsinks", "dslopes"][:len(got)]
    if len(got) == 4 and len(ref) == 4 and got[3].shape != ref[3].shape:
        names[3] = "dslopes"
    for name, g, r in zip(names, got, ref):
        if g.dim() == 3:
            assert_close_packed(g, r, cu_seqlens=cu_q if name == "dq" else cu_k, name=name, grad=True)
        else:
            assert_close_packed(g.reshape(1, 1, -1), r.reshape(1, 1, -1), cu_seqlens=[0, 1], name=name, grad=True)


@pytest.fixture(params=["blocks_of_1_to_3_rows", "default_blocks"])
def blocks(request, monkeypatch):
    if request.param.startswith("blocks_of"):  # (Hq, rows, keys) float32 scores of 2 rows x 9 keys
        monkeypatch.setattr(math_backend, "SCORE_BUDGET_BYTES", HQ * 2 * 9 * 4)
    return request.param


# ----------------------------------------------------------------------------------------------
# MATH against the reference


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(MIXES))
def test_varlen_matches_reference_forward_and_backward(name, dtype, blocks):
    mix = MIXES[name]
    q, k, v, sinks, slopes = _inputs(dtype)
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    kw = _kwargs(mix, sinks, slopes, torch.tensor(PREFIX, dtype=torch.int32))
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max(LQ), max(LK), return_lse=True, backend="math",
                                            **kw)
    ref, ref_lse, ref_leaves = _reference(q, k, v, cu_q, cu_k, kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_packed(out, ref, cu_seqlens=cu_q)
    assert_close_lse(lse, ref_lse)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, _grad_leaves(q, k, v, kw), grad_out)
    want = torch.autograd.grad(ref, ref_leaves, grad_out.double())
    for g, leaf in zip(got, _grad_leaves(q, k, v, kw)):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
    _check_grads(got, want, cu_q, cu_k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_with_sinks_give_zeros_and_lse_sink(backend):
    """A row that sees no key (empty key sequence; bottom-right chunk -1) outputs 0, lse sink_h."""
    q, k, v, sinks, _ = _inputs()
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_of(LQ), cu_of(LK), sinks=sinks, chunk_size=2,
                                            return_lse=True, backend=backend)
    rows = torch.arange(sum(LQ) - 2, sum(LQ))          # the last sequence has no keys
    assert torch.equal(out[rows], torch.zeros_like(out[rows]))
    assert torch.equal(lse[:, rows], sinks.detach().float().unsqueeze(1).expand(HQ, 2))
    # Lq=6, Lk=2, non-causal bottom-right: rows 0..3 sit at positions -4..-1 (chunks -2, -1)
    start = sum(LQ[:4])
    assert torch.equal(out[start:start + 4], torch.zeros_like(out[start:start + 4]))
    assert torch.isfinite(lse).all()


def test_sinks_gradcheck():
    lq, lk = [3, 2], [4, 2]
    gen = torch.Generator().manual_seed(3)
    q = packed(lq, 2, 4, torch.float64, gen=gen).requires_grad_()
    k = packed(lk, 1, 4, torch.float64, gen=gen).requires_grad_()
    v = packed(lk, 1, 4, torch.float64, gen=gen).requires_grad_()
    sinks = torch.randn(2, dtype=torch.float64, generator=gen).requires_grad_()
    prefix = torch.tensor([2, 1], dtype=torch.int32)
    fn = lambda q, k, v, s: jagged_sdpa.varlen_attention(q, k, v, cu_of(lq), cu_of(lk), 3, 4, causal=True, sinks=s,
                                                         chunk_size=2, prefix_lens=prefix)
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_low_precision_forward(dtype):
    q, k, v, sinks, _ = _inputs(dtype)
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    kw = dict(causal=True, chunk_size=3, sinks=sinks, prefix_lens=torch.tensor(PREFIX, dtype=torch.int32))
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend="math", **kw)
    ref, ref_lse, _ = _reference(q, k, v, cu_q, cu_k, kw)
    assert out.dtype == dtype
    assert_close_packed(out, ref, cu_seqlens=cu_q)
    assert_close_lse(lse, ref_lse)
    out.float().sum().backward()
    assert sinks.grad.dtype == dtype and torch.isfinite(sinks.grad).all()


def test_dropout_never_drops_the_sink():
    """Keyed dropout scales the key probabilities only; compared exactly to the reference given
    the call's own mask (the key the call draws, drawn again from the same seed)."""
    p = 0.3
    q, k, v, sinks, _ = _inputs(torch.float64)
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    kw = dict(causal=True, sinks=sinks, chunk_size=4, prefix_lens=torch.tensor(PREFIX, dtype=torch.int32))
    torch.manual_seed(11)
    key = keyed_dropout.draw_key()
    torch.manual_seed(11)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=p, **kw)
    keep = lambda b, lq, lk: keyed_dropout.keep_mask(key, b, HQ, torch.arange(lq), torch.arange(lk), p)
    ref, _, leaves = _reference(q, k, v, cu_q, cu_k, kw, dropout_p=p, dropout_keep=keep)
    assert_close_packed(out, ref, cu_seqlens=cu_q)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v, sinks], grad_out)
    _check_grads(got, torch.autograd.grad(ref, leaves, grad_out), cu_q, cu_k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seqused_k_and_paged_keys(backend):
    """prefix_lens are bounded by seqused_k; paged keys give what packed keys give."""
    q_lens, used, block_size = [3, 4, 1], [5, 2, 6], 2
    gen = torch.Generator().manual_seed(5)
    q = packed(q_lens, HQ, D, gen=gen).requires_grad_()
    k = packed([6, 3, 7], HKV, D, gen=gen).requires_grad_()
    v = packed([6, 3, 7], HKV, D, gen=gen).requires_grad_()
    sinks = torch.randn(HQ, generator=gen).requires_grad_()
    prefix = torch.tensor([4, 2, 0], dtype=torch.int32)
    kw = dict(causal=True, chunk_size=2, sinks=sinks, prefix_lens=prefix, return_lse=True, backend=backend)
    seqused = torch.tensor(used, dtype=torch.int32)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_of(q_lens), cu_of([6, 3, 7]), seqused_k=seqused, **kw)
    ref, ref_lse, leaves = _reference(q, k, v, cu_of(q_lens), cu_of([6, 3, 7]), kw, seqused_k=used)
    assert_close_packed(out, ref, cu_seqlens=cu_of(q_lens))
    assert_close_lse(lse, ref_lse)
    gq, gs = torch.autograd.grad(out.sum(), [q, sinks])
    rq, rs = torch.autograd.grad(ref.sum(), [leaves[0], leaves[3]])
    _check_grads([gq, gs], [rq, rs], cu_of(q_lens), None)

    k_cache, v_cache, table, seqused_p, k_ref, v_ref = paged_case(q_lens, used, block_size, HKV, D)
    out_p, lse_p = jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_of(q_lens), None, max(q_lens), max(used),
                                                block_table=table, seqused_k=seqused_p, **kw)
    ref_p, ref_lse_p, _ = _reference(q, k_ref, v_ref, cu_of(q_lens), cu_of(used), kw)
    assert_close_packed(out_p, ref_p, cu_seqlens=cu_of(q_lens))
    assert_close_lse(lse_p, ref_lse_p)


# ----------------------------------------------------------------------------------------------
# the compiled CPU kernel (cpu_fused) against the reference
#
# The mixes again, in fp32, fp16 and bf16, packed and paged keys, forward (out, lse) and backward
# (dq, dk, dv and the sinks' gradient), on the kernel's shipped work split and a small one (work
# items of 2 query rows, direct rows for sequences of up to 3 queries in steps of 2 keys), so
# tiles, sequences of several items, direct rows and paged keys all run these options; a longer
# batch crosses key blocks and chunk boundaries. Errors are bounded by 2x (out) and 3x (gradients)
# MATH's own error in the same dtype plus the dtype's floor; the lse by float32's bound. Every call
# is checked to have run on the kernel (explain and the selection log), not on MATH.

KERNEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PAGED_BLOCK = 3


@pytest.fixture(params=["shipped_split", "small_split"])
def kernel_split(request, monkeypatch):
    if request.param == "small_split":
        monkeypatch.setattr(native, "Q_CHUNK", 2)
        monkeypatch.setattr(native, "DIRECT_ROWS", 3)
        monkeypatch.setattr(native, "DIRECT_KEYS", 2)
    return request.param


def _kernel_and_math(caplog, q, k, v, cu_q, cu_k, kw, grad_out_seed=7, **call):
    """(out, lse, grads) of the kernel (asserted to be what ran) and of MATH on the same call;
    grads are those of every leaf in ``_grad_leaves`` that requires grad."""
    leaves = [x for x in _grad_leaves(q, k, v, kw) if x.requires_grad]
    e = jagged_sdpa.explain(q, k, v, cu_q, cu_k, return_lse=True, **kw, **call)
    assert e.chosen == Backend.CPU_FUSED and e.reasons[Backend.CPU_FUSED] == [], str(e)
    results = {}
    for backend in (None, "math"):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="jagged_sdpa"):
            out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend=backend, **kw,
                                                    **call)
        if backend is None:
            logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "jagged_sdpa")
            assert "chosen: cpu_fused" in logged, logged
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed)).to(out.dtype)
        results[backend] = (out, lse, list(torch.autograd.grad(out, leaves, grad_out)), grad_out)
    return results[None], results["math"]


def _assert_kernel_close(got, math_got, ref, cu_seqlens, name, grad):
    assert got.dtype == math_got.dtype and got.shape == math_got.shape, name
    if got.dim() != 3:
        got, math_got, ref, cu_seqlens = tuple(x.reshape(1, 1, -1) for x in (got, math_got, ref)) + ([0, 1],)
    assert_close_packed(got, ref, cu_seqlens=cu_seqlens, name=name, grad=grad, lowp_ref=math_got,
                        fudge=3.0 if grad else 2.0)


def _paged_slots(table, used, block_size):
    """Flat cache slots of every sequence's keys, in packed order."""
    return torch.tensor([int(table[b, i // block_size]) * block_size + i % block_size
                         for b, n in enumerate(used) for i in range(n)], dtype=torch.long)


@needs_kernel
@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
@pytest.mark.parametrize("dtype", list(KERNEL_DTYPES))
@pytest.mark.parametrize("name", list(MIXES))
def test_kernel_matches_reference_forward_and_backward(name, dtype, paged, kernel_split, caplog):
    mix, dtype = MIXES[name], KERNEL_DTYPES[dtype]
    q, k, v, sinks, slopes = _inputs(dtype)
    slopes = slopes.detach()  # the kernel differentiates q, k, v and the sinks; MATH takes the slopes' gradient
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    kw = _kwargs(mix, sinks, slopes, torch.tensor(PREFIX, dtype=torch.int32))
    call, ref_k, ref_v = dict(max_seqlen_q=max(LQ), max_seqlen_k=max(LK)), k, v
    if paged:
        k, v, table, used, ref_k, ref_v = paged_case(LQ, LK, PAGED_BLOCK, HKV, D, dtype)
        k, v = k.requires_grad_(), v.requires_grad_()
        call.update(block_table=table, seqused_k=used)
        cu_k = None
    (out, lse, grads, grad_out), (m_out, _, m_grads, _) = _kernel_and_math(caplog, q, k, v, cu_q, cu_k, kw, **call)
    ref, ref_lse, ref_leaves = _reference(q, ref_k, ref_v, cu_q, cu_of(LK), kw)
    _assert_kernel_close(out, m_out, ref, cu_q, "out", grad=False)
    assert_close_lse(lse, ref_lse)
    want = list(torch.autograd.grad(ref, ref_leaves[:3] + ([ref_leaves[3]] if "sinks" in kw else []),
                                    grad_out.double()))
    if paged:  # cache-shaped: each sequence's slots in packed order; the rest exactly 0
        slots = _paged_slots(table, LK, PAGED_BLOCK)
        for i in (1, 2):
            flat = grads[i].flatten(0, 1)
            rest = torch.ones(flat.shape[0], dtype=torch.bool)
            rest[slots] = False
            assert torch.equal(flat[rest], torch.zeros_like(flat[rest]))
            grads[i], m_grads[i] = flat[slots], m_grads[i].flatten(0, 1)[slots]
    for name_, g, m, r, cu in zip(["dq", "dk", "dv", "dsinks"], grads, m_grads, want, [cu_q, cu_of(LK), cu_of(LK), None]):
        _assert_kernel_close(g, m, r, cu, name_, grad=True)
    if "sinks" in kw:
        assert grads[3].dtype == dtype and grads[3].shape == (HQ,)


LONG_Q, LONG_K, LONG_PREFIX = [70, 1, 130, 2], [130, 150, 90, 0], [70, 30, 20, 0]


@needs_kernel
@pytest.mark.parametrize("opts", [dict(causal=True, chunk_size=48), dict(causal=True, chunk_size=40, window_size=(50, 0)),
                                  dict(chunk_size=64, softcap=4.0), dict(causal=True)],
                         ids=["causal_chunk48", "causal_chunk40_window", "noncausal_chunk64_softcap", "causal"])
@pytest.mark.parametrize("dtype", list(KERNEL_DTYPES))
def test_kernel_across_key_blocks_and_chunks(opts, dtype, kernel_split, caplog):
    """Sequences of several 64-key blocks: chunks that start inside a block and at one, prefixes
    that end inside one, tiles skipped by their rows' ranges, direct rows with long contexts."""
    dtype = KERNEL_DTYPES[dtype]
    gen = torch.Generator().manual_seed(4)
    q = packed(LONG_Q, HQ, 16, gen=gen).to(dtype).requires_grad_()
    k = packed(LONG_K, HKV, 16, gen=gen).to(dtype).requires_grad_()
    v = packed(LONG_K, HKV, 16, gen=gen).to(dtype).requires_grad_()
    sinks = torch.randn(HQ, generator=gen).requires_grad_()   # float32 sinks on fp16/bf16 calls
    kw = dict(opts, sinks=sinks, prefix_lens=torch.tensor(LONG_PREFIX, dtype=torch.int32))
    cu_q, cu_k = cu_of(LONG_Q), cu_of(LONG_K)
    (out, lse, grads, grad_out), (m_out, _, m_grads, _) = _kernel_and_math(caplog, q, k, v, cu_q, cu_k, kw)
    ref, ref_lse, leaves = _reference(q, k, v, cu_q, cu_k, kw)
    _assert_kernel_close(out, m_out, ref, cu_q, "out", grad=False)
    assert_close_lse(lse, ref_lse)
    want = torch.autograd.grad(ref, leaves, grad_out.double())
    assert grads[3].dtype == torch.float32
    # The kernel's dsinks, like its dq and dk, comes from delta = dO . O with O rounded to the call's
    # dtype (as flash attention's backward): float32 sinks on a low-precision call get its precision.
    grads[3], m_grads[3] = grads[3].to(dtype), m_grads[3].to(dtype)
    for name_, g, m, r, cu in zip(["dq", "dk", "dv", "dsinks"], grads, m_grads, want, [cu_q, cu_k, cu_k, None]):
        _assert_kernel_close(g, m, r, cu, name_, grad=True)


@needs_kernel
def test_kernel_dropout_with_sinks_equals_math_and_the_reference(kernel_split):
    """The kernel draws MATH's keyed masks and never drops the sink's share: its out and
    gradients equal the reference given the call's own mask, and MATH's on the same key."""
    p = 0.3
    q, k, v, sinks, _ = _inputs()
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    kw = dict(causal=True, sinks=sinks, chunk_size=4, prefix_lens=torch.tensor(PREFIX, dtype=torch.int32))
    assert jagged_sdpa.explain(q, k, v, cu_q, cu_k, dropout_p=p, **kw).chosen == Backend.CPU_FUSED
    torch.manual_seed(11)
    key = keyed_dropout.draw_key()
    results = []
    for backend in (None, "math"):
        torch.manual_seed(11)
        out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=p, backend=backend, **kw)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        results.append((out, torch.autograd.grad(out, [q, k, v, sinks], grad_out), grad_out))
    (out, grads, grad_out), (m_out, m_grads, _) = results
    keep = lambda b, lq, lk: keyed_dropout.keep_mask(key, b, HQ, torch.arange(lq), torch.arange(lk), p)
    ref, _, leaves = _reference(q, k, v, cu_q, cu_k, kw, dropout_p=p, dropout_keep=keep)
    _assert_kernel_close(out, m_out, ref, cu_q, "out", grad=False)
    want = torch.autograd.grad(ref, leaves, grad_out.double())
    for name_, g, m, r, cu in zip(["dq", "dk", "dv", "dsinks"], grads, m_grads, want, [cu_q, cu_k, cu_k, None]):
        _assert_kernel_close(g, m, r, cu, name_, grad=True)


@needs_kernel
def test_kernel_plan_runs_take_each_layers_sinks(kernel_split):
    """A plan's forward runner (parameters built once) reads each run's own sinks and the plan's
    prefix_lens: every run equals varlen_attention bit for bit, also after ``update``."""
    q, k, v, _, _ = _inputs()
    q, k, v = q.detach(), k.detach(), v.detach()
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    opts = dict(causal=True, chunk_size=3, return_lse=True)
    p = jagged_sdpa.plan(cu_q, cu_k, max(LQ), max(LK), prefix_lens=torch.tensor(PREFIX, dtype=torch.int32), **opts)
    for prefix in (PREFIX, [1, 2, 0, 4, 1, 0]):
        if prefix is not PREFIX:
            p.update(cu_q, cu_k, max(LQ), max(LK), prefix_lens=torch.tensor(prefix, dtype=torch.int32))
        for layer in range(3):
            sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(layer)).to(torch.bfloat16)
            assert p.explain(q, k, v, sinks=sinks).chosen == Backend.CPU_FUSED
            out, lse = p.run(q, k, v, sinks=sinks)
            want, want_lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max(LQ), max(LK), sinks=sinks,
                                                          prefix_lens=torch.tensor(prefix, dtype=torch.int32), **opts)
            assert torch.equal(out, want) and torch.equal(lse, want_lse)
            ref, ref_lse, _ = _reference(q, k, v, cu_q, cu_k, dict(causal=True, chunk_size=3, sinks=sinks,
                                                                   prefix_lens=torch.tensor(prefix)))
            assert_close_packed(out, ref, cu_seqlens=cu_q)
            assert_close_lse(lse, ref_lse)


@needs_kernel
@pytest.mark.parametrize("opts", [dict(is_causal=True, chunk_size=3), dict(chunk_size=4, window_size=(3, 1))],
                         ids=["causal_chunk3", "noncausal_chunk4_window"])
@pytest.mark.parametrize("dtype", list(KERNEL_DTYPES))
def test_kernel_top_left_through_sdpa(opts, dtype, kernel_split):
    """Top-left alignment (sdpa's default) with Lq != Lk and GQA: the kernel's out and gradients
    (sinks included) against the reference, within 2x / 3x MATH's own error."""
    dtype = KERNEL_DTYPES[dtype]
    lq, lk = [4, 9, 2, 7], [6, 5, 9, 7]
    gen = torch.Generator().manual_seed(6)
    q = packed(lq, HQ, D, gen=gen).to(dtype).requires_grad_()
    k = packed(lk, HKV, D, gen=gen).to(dtype).requires_grad_()
    v = packed(lk, HKV, D, gen=gen).to(dtype).requires_grad_()
    sinks = torch.randn(HQ, generator=gen).to(dtype).requires_grad_()
    prefix = torch.tensor([2, 5, 9, 0], dtype=torch.int32)
    nj = lambda x, lens: torch.nested.nested_tensor_from_jagged(x, cu_of(lens).long()).transpose(1, 2)
    kw = dict(opts, enable_gqa=True, sinks=sinks, prefix_lens=prefix)
    assert jagged_sdpa.explain(nj(q, lq), nj(k, lk), nj(v, lk), **kw).chosen == Backend.CPU_FUSED
    grad_out = torch.randn(sum(lq), HQ, D, generator=gen).to(dtype)
    results = []
    for backend in (None, "math"):
        out = jagged_sdpa.sdpa(nj(q, lq), nj(k, lk), nj(v, lk), backend=backend, **kw).transpose(1, 2).values()
        results.append((out, torch.autograd.grad(out, [q, k, v, sinks], grad_out)))
    (out, grads), (m_out, m_grads) = results
    ref_kw = dict(causal=opts.get("is_causal", False), chunk_size=opts["chunk_size"], sinks=sinks, prefix_lens=prefix,
                  window_size=opts.get("window_size", (-1, -1)))
    ref, _, leaves = _reference(q, k, v, cu_of(lq), cu_of(lk), ref_kw, alignment="top_left")
    _assert_kernel_close(out, m_out, ref, cu_of(lq), "out", grad=False)
    want = torch.autograd.grad(ref, leaves, grad_out.double())
    for name_, g, m, r, cu in zip(["dq", "dk", "dv", "dsinks"], grads, m_grads, want,
                                  [cu_of(lq), cu_of(lk), cu_of(lk), None]):
        _assert_kernel_close(g, m, r, cu, name_, grad=True)


@needs_kernel
def test_kernel_sinks_gradient_is_the_same_bits_on_any_thread_count():
    q, k, v, sinks, _ = _inputs()
    kw = dict(causal=True, chunk_size=3, sinks=sinks, prefix_lens=torch.tensor(PREFIX, dtype=torch.int32))
    threads = torch.get_num_threads()
    grads = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = jagged_sdpa.varlen_attention(q, k, v, cu_of(LQ), cu_of(LK), **kw)
            grads.append(torch.autograd.grad(out.square().sum(), [sinks])[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(g, grads[0]) for g in grads)


@needs_kernel
def test_kernel_a_sink_of_plus_infinity_takes_the_whole_row():
    """e^{+inf} in the denominator: every key's probability is 0, out 0, lse +inf (as MATH)."""
    q, k, v, _, _ = _inputs()
    sinks = torch.tensor([float("inf"), 0.0, float("-inf"), 1.0])
    for backend in ("cpu_fused", "math"):
        out, lse = jagged_sdpa.varlen_attention(q.detach(), k.detach(), v.detach(), cu_of(LQ), cu_of(LK), causal=True,
                                                sinks=sinks, return_lse=True, backend=backend)
        assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and (lse[0] == float("inf")).all(), backend
        assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------------
# sdpa


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_sdpa_njt_and_dense_kv(alignment):
    lq, lk = [4, 6, 3], [5, 6, 2]
    query = njt(lq, HQ, D, requires_grad=True)
    key, value = njt(lk, HKV, D, requires_grad=True), njt(lk, HKV, D, requires_grad=True)
    sinks = (torch.randn(HQ) * 2).requires_grad_()
    prefix = torch.tensor([2, 6, 1], dtype=torch.int32)
    kw = dict(is_causal=True, causal_alignment=alignment, enable_gqa=True, sinks=sinks, chunk_size=2,
              prefix_lens=prefix)
    out = jagged_sdpa.sdpa(query, key, value, **kw)
    assert out.is_nested and out.shape[1] == HQ
    q, k, v = (x.transpose(1, 2).values() for x in (query, key, value))
    ref, _, leaves = _reference(q, k, v, cu_of(lq), cu_of(lk), dict(causal=True, sinks=sinks, chunk_size=2,
                                                                     prefix_lens=prefix), alignment=alignment)
    got = out.transpose(1, 2).values()
    assert_close_packed(got, ref, cu_seqlens=cu_of(lq))
    grad_out = torch.randn_like(got)
    (gs,) = torch.autograd.grad(got, [sinks], grad_out)
    (rs,) = torch.autograd.grad(ref, [leaves[3]], grad_out.double())
    _check_grads([gs], [rs], None, None)

    dense_k, dense_v = torch.randn(3, HKV, 5, D), torch.randn(3, HKV, 5, D)   # every query sees 5 keys
    out_d = jagged_sdpa.sdpa(query, dense_k, dense_v, **dict(kw, prefix_lens=torch.tensor([5, 0, 3],
                                                                                          dtype=torch.int32)))
    k_p, v_p = (x.transpose(1, 2).reshape(15, HKV, D) for x in (dense_k, dense_v))
    ref_d, _, _ = _reference(q, k_p, v_p, cu_of(lq), cu_of([5, 5, 5]),
                             dict(causal=True, sinks=sinks, chunk_size=2, prefix_lens=torch.tensor([5, 0, 3])),
                             alignment=alignment)
    assert_close_packed(out_d.transpose(1, 2).values(), ref_d, cu_seqlens=cu_of(lq))


# ----------------------------------------------------------------------------------------------
# plans


def test_plan_run_is_varlen_bit_for_bit_and_update_takes_new_prefixes():
    q, k, v, sinks, slopes = _inputs()
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    prefix = torch.tensor(PREFIX, dtype=torch.int32)
    opts = dict(causal=True, chunk_size=3, window_size=(5, 0), return_lse=True)
    p = jagged_sdpa.plan(cu_q, cu_k, max(LQ), max(LK), prefix_lens=prefix, **opts)
    prefix.fill_(0)   # the plan keeps its own copy
    out, lse = p.run(q, k, v, sinks=sinks, alibi_slopes=slopes)
    want, want_lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max(LQ), max(LK),
                                                  prefix_lens=torch.tensor(PREFIX, dtype=torch.int32), sinks=sinks,
                                                  alibi_slopes=slopes, **opts)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    g_out = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [q, k, v, sinks, slopes], g_out),
                    torch.autograd.grad(want, [q, k, v, sinks, slopes], g_out)):
        assert torch.equal(a, b)
    assert p.explain(q, k, v, sinks=sinks, alibi_slopes=slopes).chosen == Backend.MATH   # the slopes' gradient
    assert p.explain(q, k, v, sinks=sinks).chosen == CPU_BACKEND

    new_prefix = torch.tensor([1, 2, 0, 4, 1, 0], dtype=torch.int32)
    p.update(cu_q, cu_k, max(LQ), max(LK), prefix_lens=new_prefix)
    out2, _ = p.run(q, k, v, sinks=sinks)
    want2, _ = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max(LQ), max(LK), prefix_lens=new_prefix,
                                            sinks=sinks, **opts)
    assert torch.equal(out2, want2)
    with pytest.raises(ValueError, match="prefix_lens"):
        p.update(cu_q, cu_k, max(LQ), max(LK))                   # the plan was made with prefix_lens
    with pytest.raises(ValueError, match=r"prefix_lens\[3\] = 5 exceeds"):
        p.update(cu_q, cu_k, prefix_lens=torch.tensor([0, 0, 0, 5, 0, 0], dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# torch.compile and the operators


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _varlen(q, k, v, cu_q, cu_k, sinks, prefix):
    return jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max(LQ), max(LK), causal=True, chunk_size=3,
                                        sinks=sinks, prefix_lens=prefix, return_lse=True)


def test_compile_fullgraph_equals_eager_without_graph_breaks(fresh_dynamo):
    q, k, v, sinks, _ = _inputs()
    args = (q, k, v, cu_of(LQ), cu_of(LK), sinks, torch.tensor(PREFIX, dtype=torch.int32))
    explained = torch._dynamo.explain(lambda *a: _varlen(*a)[0].square().sum())(*args)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    torch._dynamo.reset()
    got, got_lse = torch.compile(_varlen, fullgraph=True, backend="aot_eager")(*args)
    want, want_lse = _varlen(*args)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, [q, k, v, sinks], g), torch.autograd.grad(want, [q, k, v, sinks], g)):
        assert torch.equal(a, b)


def test_compile_sdpa_on_njts_fullgraph_equals_eager(fresh_dynamo):
    query = njt([4, 6, 3], HQ, D, requires_grad=True)
    sinks = torch.randn(HQ, requires_grad=True)
    prefix = torch.tensor([2, 6, 1], dtype=torch.int32)

    def f(x, s, p):
        return jagged_sdpa.sdpa(x, x, x, is_causal=True, sinks=s, chunk_size=2, prefix_lens=p)

    explained = torch._dynamo.explain(lambda *a: f(*a).values().sum())(query, sinks, prefix)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(query, sinks, prefix).values()
    want = f(query, sinks, prefix).values()
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got.sum(), [sinks])[0], torch.autograd.grad(want.sum(), [sinks])[0])


def test_compiled_call_checks_prefix_lens_when_the_operator_runs(fresh_dynamo):
    q, k, v, sinks, _ = _inputs()
    bad = torch.tensor([3, 10, 1, 0, 2, 0], dtype=torch.int32)   # 10 > 9 keys of sequence 1
    with pytest.raises(ValueError, match=r"prefix_lens\[1\] = 10 exceeds"):
        torch.compile(_varlen, fullgraph=True, backend="aot_eager")(q, k, v, cu_of(LQ), cu_of(LK), sinks, bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_with_sinks_chunk_and_prefix(backend):
    q, k, v, sinks, _ = _inputs()
    p = jagged_sdpa.plan(cu_of(LQ), cu_of(LK), max(LQ), max(LK), causal=True, chunk_size=3,
                         prefix_lens=torch.tensor(PREFIX, dtype=torch.int32))
    call, prepared = p._call(q, k, v, None, sinks)
    assert prepared.backend == CPU_BACKEND and call.spec.sinks_grad and call.spec.prefix and call.spec.chunk_size == 3
    args = (call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k, call.block_table,
            call.alibi_slopes, call.dropout_key, backend, specs.options_of(call.spec), call.spec.max_seqlen_q,
            call.spec.max_seqlen_k, call.prefix_lens, call.sinks)
    torch.library.opcheck(torch.ops.jagged_sdpa.attention.default, args)
    out, lse, state = torch.ops.jagged_sdpa.attention(*args)
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    grads = torch.ops.jagged_sdpa.attention_backward(torch.randn_like(out), *detached[:3], out.detach(), lse, state,
                                                     *detached[3:])
    assert len(grads) == 4 and grads[3].shape == sinks.shape
    torch.library.opcheck(torch.ops.jagged_sdpa.attention_backward.default,
                          (torch.randn_like(out), *detached[:3], out.detach(), lse, state, *detached[3:]))


# ----------------------------------------------------------------------------------------------
# explain, and options that change nothing


def test_explain_names_every_other_backends_reason_and_takes_the_kernel_or_math():
    """On the CPU the compiled kernel takes the three options (MATH where it cannot be built, and
    for float64, which it refuses for its dtype alone); the CUDA-only backends say why not."""
    q, k, v, sinks, _ = _inputs()
    kw = dict(causal=True, sinks=sinks, chunk_size=3, prefix_lens=torch.tensor(PREFIX, dtype=torch.int32))
    e = jagged_sdpa.explain(q, k, v, cu_of(LQ), cu_of(LK), max(LQ), max(LK), **kw)
    assert e.chosen == CPU_BACKEND and e.reasons[Backend.MATH] == []
    if native.library() is not None:
        assert e.reasons[Backend.CPU_FUSED] == []
    for backend in (Backend.FLASH_VARLEN, Backend.EFFICIENT):
        assert e.reasons[backend]
    # TRITON takes the three options (its tests are the TRITON section below); here only the CPU
    # without TRITON_INTERPRET=1 may rule it out.
    assert not any(word in r for r in e.reasons[Backend.TRITON] for word in ("sinks", "chunk_size", "prefix_lens"))
    text = str(e)
    assert "sinks" in text and "chunk_size=3" in text
    q64, k64, v64 = (x.double() for x in (q, k, v))
    e64 = jagged_sdpa.explain(q64, k64, v64, cu_of(LQ), cu_of(LK), max(LQ), max(LK), **kw)
    assert e64.chosen == Backend.MATH
    assert all(r.startswith("dtype float64 not supported") for r in e64.reasons[Backend.CPU_FUSED])
    with pytest.raises(NoBackendError, match="dtype float64 not supported"):
        jagged_sdpa.varlen_attention(q64, k64, v64, cu_of(LQ), cu_of(LK), backend="cpu_fused", **kw)


def test_options_that_change_nothing_are_normalised_away():
    q, k, v, _, _ = _inputs()
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    spec = lambda **kw: jagged_sdpa.explain(q, k, v, cu_q, cu_k, max(LQ), max(LK), **kw).spec
    # bottom-right causal: a chunk covering every key changes nothing (negative rows see no key anyway)
    assert spec(causal=True, chunk_size=max(LK)).chunk_size is None
    # non-causal with Lq > Lk: rows at negative positions are in chunk -1, so the chunk matters
    assert spec(chunk_size=100).chunk_size == 100
    assert spec(causal=True, chunk_size=max(LK) - 1).chunk_size == max(LK) - 1
    zeros = torch.zeros(len(LQ), dtype=torch.int32)
    assert not spec(causal=True, prefix_lens=zeros).prefix                     # all-zero prefixes
    assert not spec(prefix_lens=torch.tensor(PREFIX, dtype=torch.int32)).prefix  # no mask to widen
    assert spec(causal=True, prefix_lens=torch.tensor(PREFIX, dtype=torch.int32)).prefix
    e = jagged_sdpa.explain(q, k, v, cu_q, cu_k, max(LQ), max(LK), causal=True, chunk_size=64, prefix_lens=zeros)
    assert not any("chunk_size" in r or "prefix_lens" in r for rs in e.reasons.values() for r in rs)
    # and the results agree with the reference all the same
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, chunk_size=64, prefix_lens=zeros)
    ref, _, _ = _reference(q, k, v, cu_q, cu_k, dict(causal=True, chunk_size=64, prefix_lens=zeros))
    assert_close_packed(out, ref, cu_seqlens=cu_q)
    # sdpa top_left: the chunk must also cover every query row
    query, key = njt([6, 2], 2, 4), njt([3, 2], 2, 4)
    sdpa_spec = lambda c: jagged_sdpa.explain(query, key, key, is_causal=True, chunk_size=c).spec
    assert sdpa_spec(6).chunk_size is None and sdpa_spec(3).chunk_size == 3


# ----------------------------------------------------------------------------------------------
# rejected inputs


def _call(**kw):
    q, k, v, _, _ = _inputs()
    return jagged_sdpa.varlen_attention(q, k, v, cu_of(LQ), cu_of(LK), **kw)


@pytest.mark.parametrize("sinks, error, match", [
    (torch.zeros(HQ + 1), ValueError, r"sinks must have shape \(4,\)"),
    (torch.zeros(1, HQ), ValueError, r"sinks must have shape \(4,\)"),
    (torch.zeros(HQ, dtype=torch.int64), TypeError, "sinks must be a float tensor"),
    ([0.0] * HQ, TypeError, "sinks must be a torch.Tensor"),
    (torch.zeros(HQ, device="meta"), ValueError, "sinks is on meta"),
])
def test_bad_sinks(sinks, error, match):
    with pytest.raises(error, match=match):
        _call(sinks=sinks)
    q, k, v, _, _ = _inputs()
    p = jagged_sdpa.plan(cu_of(LQ), cu_of(LK))
    with pytest.raises(error, match=match):
        p.run(q, k, v, sinks=sinks)


@pytest.mark.parametrize("chunk_size, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError),
                                               (True, TypeError), ("4", TypeError)])
def test_bad_chunk_size(chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        _call(chunk_size=chunk_size)
    with pytest.raises(error, match="chunk_size"):
        jagged_sdpa.plan(cu_of(LQ), cu_of(LK), chunk_size=chunk_size)
    query = njt([2, 3], 2, 4)
    with pytest.raises(error, match="chunk_size"):
        jagged_sdpa.sdpa(query, query, query, chunk_size=chunk_size)


@pytest.mark.parametrize("prefix, error, match", [
    (torch.tensor(PREFIX, dtype=torch.int64), TypeError, "prefix_lens must be int32"),
    (torch.tensor(PREFIX[:-1], dtype=torch.int32), ValueError, r"prefix_lens must have shape \(6,\)"),
    (torch.tensor([PREFIX], dtype=torch.int32), ValueError, r"prefix_lens must have shape \(6,\)"),
    (PREFIX, TypeError, "prefix_lens must be a torch.Tensor"),
    (torch.tensor([0, -1, 0, 0, 0, 0], dtype=torch.int32), ValueError, r"prefix_lens\[1\] = -1 must be >= 0"),
    (torch.tensor([0, 0, 0, 0, 0, 1], dtype=torch.int32), ValueError, r"prefix_lens\[5\] = 1 exceeds the key length 0"),
    (torch.tensor([8, 0, 0, 0, 0, 0], dtype=torch.int32), ValueError, r"prefix_lens\[0\] = 8 exceeds the key length 7"),
    (torch.zeros(6, dtype=torch.int32, device="meta"), ValueError, "prefix_lens is on meta"),
])
def test_bad_prefix_lens(prefix, error, match, monkeypatch):
    ran = []
    monkeypatch.setattr(math_backend.MathBackend, "forward", classmethod(lambda cls, call: ran.append(call)))
    with pytest.raises(error, match=match):
        _call(causal=True, prefix_lens=prefix)
    with pytest.raises(error, match=match):
        jagged_sdpa.plan(cu_of(LQ), cu_of(LK), causal=True, prefix_lens=prefix)
    assert not ran


def test_bad_prefix_lens_against_seqused_k_paged_and_sdpa():
    q, k, v, _, _ = _inputs()
    seqused = torch.tensor([7, 3, 2, 4, 2, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"prefix_lens\[1\] = 4 exceeds the key length 3"):
        jagged_sdpa.varlen_attention(q, k, v, cu_of(LQ), cu_of(LK), seqused_k=seqused,
                                     prefix_lens=torch.tensor([0, 4, 0, 0, 0, 0], dtype=torch.int32))
    k_cache, v_cache, table, used, _, _ = paged_case([2, 1], [3, 1], 2, HKV, D)
    with pytest.raises(ValueError, match=r"prefix_lens\[1\] = 2 exceeds the key length 1"):
        jagged_sdpa.varlen_attention(packed([2, 1], HQ, D), k_cache, v_cache, cu_of([2, 1]), None,
                                     block_table=table, seqused_k=used,
                                     prefix_lens=torch.tensor([3, 2], dtype=torch.int32))
    query, key = njt([2, 3], 2, 4), njt([4, 1], 2, 4)
    with pytest.raises(ValueError, match=r"prefix_lens\[1\] = 2 exceeds the key length 1"):
        jagged_sdpa.sdpa(query, key, key, is_causal=True, prefix_lens=torch.tensor([4, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="prefix_lens must be int32"):
        jagged_sdpa.sdpa(query, key, key, prefix_lens=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        jagged_sdpa.sdpa(njt([2, 3], 4, 4), njt([2, 3], 4, 4), njt([2, 3], 4, 4), sinks=torch.zeros(2))


def test_prefix_lens_checked_on_the_device_without_a_host_read():
    """The device-side form (a call that reads nothing on the host): bad values fail the assert."""
    cu = cu_of([3, 2])
    k = torch.zeros(5, 1, 4)
    good = batches.build(cu, cu, 3, 3, read=False, prefix_lens=torch.tensor([3, 2], dtype=torch.int32))
    good.bind(5, k)
    bad = batches.build(cu, cu, 3, 3, read=False, prefix_lens=torch.tensor([3, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="prefix_lens"):
        bad.bind(5, k)
    used = torch.tensor([1, 2], dtype=torch.int32)
    bad_used = batches.build(cu, cu, 3, 2, read=False, seqused_k=used,
                             prefix_lens=torch.tensor([2, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="prefix_lens"):
        bad_used.bind(5, k)


# ----------------------------------------------------------------------------------------------
# the position rules: MATH's key ranges are exact and monotone, its mask is the reference's


def test_visible_key_ranges_are_exact_monotone_and_match_the_reference_mask():
    """For every row, ``positions.visible_keys`` is exactly the range of keys the mask keeps (one
    range per row, both ends non-decreasing in the row), and ``positions.keep_mask`` equals the
    reference's mask, over causal x alignment x windows x chunk sizes x prefixes x lengths."""
    from itertools import product

    from jagged_sdpa.backends import positions
    from jagged_sdpa.spec import AttnSpec
    from support.reference import chunk_prefix_mask, keep_mask

    base = AttnSpec(entry="varlen", device_type="cpu", capability=None, dtype=torch.float32, batch=1, heads_q=1,
                    heads_kv=1, head_dim=4, head_dim_v=4, total_q=1, total_k=1, max_seqlen_q=1, max_seqlen_k=1,
                    has_empty_q=False, has_empty_k=False, lengths_known=True)
    checked = 0
    for causal, alignment, window, chunk, (len_q, len_k) in product(
            (False, True), ("top_left", "bottom_right"), ((-1, -1), (1, 0), (0, 2), (2, -1)), (None, 1, 2, 3),
            ((4, 4), (6, 3), (2, 7), (5, 0))):
        spec = base.replace(causal=causal, alignment=alignment, window=window, chunk_size=chunk)
        shift = positions.shift_of(spec, len_q, len_k)
        for prefix in sorted({0, min(1, len_k), len_k // 2, len_k}):
            want = chunk_prefix_mask(keep_mask(len_q, len_k, causal=causal, alignment=alignment, window=window),
                                     len_q, len_k, alignment=alignment, chunk_size=chunk, prefix=prefix)
            pos, j = positions.aligned_positions(0, len_q, 0, len_k, shift, "cpu")
            assert torch.equal(positions.keep_mask(spec, pos, j, prefix), want), (spec.describe(), prefix)
            last = (0, 0)
            for i in range(len_q):
                lo, hi = positions.visible_keys(spec, i + shift, len_k, prefix)
                keys = want[i].nonzero().flatten().tolist()
                if keys:
                    assert (lo, hi) == (keys[0], keys[-1] + 1) and len(keys) == hi - lo, (spec.describe(), prefix, i)
                else:
                    assert hi <= lo, (spec.describe(), prefix, i)
                assert lo >= last[0] and hi >= last[1], (spec.describe(), prefix, i)
                last = (lo, hi)
                checked += 1
    assert checked > 1000


def test_only_the_sinks_need_a_gradient():
    q, k, v, sinks, _ = _inputs()
    q, k, v = q.detach(), k.detach(), v.detach()
    out = jagged_sdpa.varlen_attention(q, k, v, cu_of(LQ), cu_of(LK), causal=True, sinks=sinks)
    (got,) = torch.autograd.grad(out.square().sum(), [sinks])
    ref, _, leaves = _reference(q, k, v, cu_of(LQ), cu_of(LK), dict(causal=True, sinks=sinks))
    (want,) = torch.autograd.grad(ref.square().sum(), [leaves[3]])
    _check_grads([got], [want], None, None)


def test_sdpa_with_holes_takes_prefix_lens():
    """NJTs with holes (``lengths()``) are gathered; prefix_lens is validated and applied all the same."""
    values = torch.randn(12, HQ, D)
    offsets = torch.tensor([0, 5, 9], dtype=torch.int64)
    lengths = torch.tensor([4, 3], dtype=torch.int64)
    x = torch.nested.nested_tensor_from_jagged(values, offsets, lengths=lengths).transpose(1, 2)
    prefix = torch.tensor([2, 3], dtype=torch.int32)
    out = jagged_sdpa.sdpa(x, x, x, is_causal=True, prefix_lens=prefix, chunk_size=2)
    packed_x = torch.cat([values[0:4], values[5:8]])
    ref, _, _ = _reference(packed_x, packed_x, packed_x, cu_of([4, 3]), cu_of([4, 3]),
                           dict(causal=True, prefix_lens=prefix, chunk_size=2), alignment="top_left")
    got = torch.cat([out[0].transpose(0, 1), out[1].transpose(0, 1)])
    assert_close_packed(got, ref, cu_seqlens=cu_of([4, 3]))
    with pytest.raises(ValueError, match=r"prefix_lens\[0\] = 5 exceeds the key length 4"):
        jagged_sdpa.sdpa(x, x, x, is_causal=True, prefix_lens=torch.tensor([5, 0], dtype=torch.int32))


def test_a_sink_of_minus_infinity_is_no_sink():
    q, k, v, _, _ = _inputs()
    q, k, v = q.detach(), k.detach(), v.detach()
    sinks = torch.full((HQ,), float("-inf"), requires_grad=True)
    kw = dict(causal=True, chunk_size=2, return_lse=True)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_of(LQ), cu_of(LK), sinks=sinks, **kw)
    want, want_lse = jagged_sdpa.varlen_attention(q, k, v, cu_of(LQ), cu_of(LK), **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    (grad,) = torch.autograd.grad(out.sum(), [sinks])
    assert torch.equal(grad, torch.zeros(HQ))


# ----------------------------------------------------------------------------------------------
# TRITON (interpreter)
#
# The TRITON backend, forced, against the same float64 reference: every mix forward and backward
# (dq, dk, dv and dsinks; the ALiBi slopes are constants: TRITON does not differentiate them), on
# the short shapes above and on longer ones whose windows, chunks and prefixes are scaled up so the
# interpreter's 16 x 16 tiles cut sequences, chunks and prefixes in the middle and some key blocks
# run unmasked; fp16; split-K decode with GQA packing, paged keys, seqused_k, dropout, the plan
# path; and the kernels' range helpers against ``positions.visible_keys``. Without a GPU these run
# on CPU tensors under TRITON_INTERPRET=1, set around triton's import as in test_dropout.py.

import functools  # noqa: E402
import os  # noqa: E402

from support.triton_interpreter import interpreter_env, is_interpreted  # noqa: E402

with interpreter_env(not torch.cuda.is_available()):
    try:
        import triton
        import triton.language as tl
        from jagged_sdpa.backends.triton import _common as triton_common
        from jagged_sdpa.backends.triton._common import _visible_keys, _visible_rows
    except ImportError:
        triton = None
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = triton is not None and (TRITON_DEVICE == "cuda" or is_interpreted(triton))
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="triton missing, or imported compiled before this module")

LQ_LONG = [30, 0, 40]
LK_LONG = [45, 5, 18]               # Lq > Lk in the last: bottom-right positions down to -22
PREFIX_LONG = [20, 5, 17]
SCALE_LONG = 8                      # chunk 2..4 -> 16..32, window sides x 8


def _long(mix):
    """The mix with chunk_size and window sides scaled by SCALE_LONG (unbounded sides stay -1)."""
    mix = dict(mix)
    if "chunk_size" in mix:
        mix["chunk_size"] *= SCALE_LONG
    if "window_size" in mix:
        mix["window_size"] = tuple(s * SCALE_LONG if s > 0 else s for s in mix["window_size"])
    return mix


@pytest.fixture
def triton_launches(monkeypatch):
    """TRITON_INTERPRET=1 on the CPU, and the launches TRITON makes, recorded ([(name, kwargs)])."""
    if TRITON_DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from jagged_sdpa.backends.triton import bwd, fwd

    seen = []

    def spy(name, launch):
        def launched(call, *args, **kwargs):
            seen.append((name, kwargs))
            return launch(call, *args, **kwargs)
        return launched

    monkeypatch.setattr(fwd, "launch_fwd", spy("fwd", fwd.launch_fwd))
    monkeypatch.setattr(bwd, "launch_bwd", spy("bwd", bwd.launch_bwd))
    return seen


def _on(device, *tensors):
    return [t.detach().to(device).requires_grad_(t.requires_grad) for t in tensors]


def _triton_case(mix, lq, lk, prefix, dtype, hq=HQ, hkv=HKV, seed=0):
    q, k, v, sinks, slopes = _inputs(dtype, lq, lk, hq, hkv, seed=seed)
    q, k, v, sinks = _on(TRITON_DEVICE, q, k, v, sinks)
    slopes = slopes.detach().to(TRITON_DEVICE)
    kw = _kwargs(mix, sinks, slopes, torch.tensor(prefix, dtype=torch.int32, device=TRITON_DEVICE))
    return q, k, v, kw


def _triton_vs_reference(mix, lq, lk, prefix, dtype, launches, lowp=False, hq=HQ, hkv=HKV):
    q, k, v, kw = _triton_case(mix, lq, lk, prefix, dtype, hq, hkv)
    cu_q, cu_k = cu_of(lq).to(TRITON_DEVICE), cu_of(lk).to(TRITON_DEVICE)
    args = (q, k, v, cu_q, cu_k, max(lq), max(lk))
    out, lse = jagged_sdpa.varlen_attention(*args, return_lse=True, backend="triton", **kw)
    assert [name for name, _ in launches] == ["fwd"]
    ref, ref_lse, ref_leaves = _reference(*(x.cpu() for x in (q, k, v)), cu_q.cpu(), cu_k.cpu(),
                                          {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()})
    grad_out = torch.randn(out.shape).to(out)
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])   # the reference's leaves start alike
    got = torch.autograd.grad(out, leaves, grad_out)
    assert [name for name, _ in launches] == ["fwd", "bwd"]
    want = torch.autograd.grad(ref, ref_leaves[:len(leaves)], grad_out.cpu().double())
    lowp_out = lowp_grads = None
    if lowp:  # MATH in the same dtype: its own error widens the bound (2x out and lse, 3x gradients)
        lowp_out, _ = jagged_sdpa.varlen_attention(*args, return_lse=True, backend="math", **kw)
        lowp_grads = torch.autograd.grad(lowp_out, leaves, grad_out)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_packed(out, ref, cu_seqlens=cu_q, lowp_ref=lowp_out, fudge=2.0)
    assert_close_lse(lse, ref_lse)
    names = ["dq", "dk", "dv", "dsinks"]
    for i, (name, g, r) in enumerate(zip(names, got, want)):
        assert g.dtype == leaves[i].dtype and g.shape == leaves[i].shape
        low = None if lowp_grads is None else lowp_grads[i]
        if g.dim() == 3:
            assert_close_packed(g, r, cu_seqlens=cu_q if name == "dq" else cu_k, name=name, grad=True,
                                lowp_ref=low, fudge=3.0)
        else:
            assert_close_packed(g.reshape(1, 1, -1), r.reshape(1, 1, -1), cu_seqlens=[0, 1], name=name, grad=True,
                                lowp_ref=None if low is None else low.reshape(1, 1, -1), fudge=3.0)


@needs_triton
@pytest.mark.interpret
@pytest.mark.parametrize("shape", ["short", "long"])
@pytest.mark.parametrize("name", list(MIXES))
def test_triton_matches_reference_forward_and_backward(name, shape, triton_launches):
    if shape == "short":
        _triton_vs_reference(MIXES[name], LQ, LK, PREFIX, torch.float32, triton_launches)
    else:
        _triton_vs_reference(_long(MIXES[name]), LQ_LONG, LK_LONG, PREFIX_LONG, torch.float32, triton_launches,
                             hq=2, hkv=1)


@needs_triton
@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)],
                         ids=["float16", "bfloat16"])   # bf16 is wrong under the Triton 3.9 interpreter
@pytest.mark.parametrize("name", ["everything", "prefix_chunk_noncausal_sinks"])
def test_triton_low_precision(name, dtype, triton_launches):
    _triton_vs_reference(MIXES[name], LQ, LK, PREFIX, dtype, triton_launches, lowp=True)


@needs_triton
@pytest.mark.interpret
def test_triton_split_k_decode_with_gqa_packing_packed_and_paged(triton_launches):
    """Decode-shaped calls take split-K (the first split carries the sink) and GQA packing; paged keys
    (forward-only on TRITON) give what the reference gives on the packed keys."""
    q_lens, k_lens, hq, hkv = [1, 3, 2], [300, 270, 40], 4, 1
    gen = torch.Generator().manual_seed(7)
    q = packed(q_lens, hq, D, gen=gen).to(TRITON_DEVICE)
    k, v = (packed(k_lens, hkv, D, gen=gen).to(TRITON_DEVICE) for _ in range(2))
    sinks = torch.randn(hq, generator=gen).to(TRITON_DEVICE)
    prefix = torch.tensor([150, 10, 40], dtype=torch.int32, device=TRITON_DEVICE)
    kw = dict(causal=True, chunk_size=100, sinks=sinks, prefix_lens=prefix)
    cu_q, cu_k = cu_of(q_lens).to(TRITON_DEVICE), cu_of(k_lens).to(TRITON_DEVICE)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), return_lse=True,
                                            backend="triton", **kw)
    (_, launch), = triton_launches
    assert launch["num_splits"] > 1 and launch["pack_gqa"]
    ref, ref_lse, _ = _reference(q.cpu(), k.cpu(), v.cpu(), cu_of(q_lens), cu_of(k_lens),
                                 dict(kw, sinks=sinks.cpu(), prefix_lens=prefix.cpu()))
    assert_close_packed(out, ref, cu_seqlens=cu_of(q_lens))
    assert_close_lse(lse, ref_lse)

    k_cache, v_cache, table, used, k_ref, v_ref = paged_case(q_lens, k_lens, 16, hkv, D)
    out_p, lse_p = jagged_sdpa.varlen_attention(
        q, k_cache.to(TRITON_DEVICE), v_cache.to(TRITON_DEVICE), cu_q, None, max(q_lens), max(k_lens),
        block_table=table.to(TRITON_DEVICE), seqused_k=used.to(TRITON_DEVICE), return_lse=True, backend="triton",
        **kw)
    assert len(triton_launches) == 2 and triton_launches[1][1]["num_splits"] > 1
    ref_p, ref_lse_p, _ = _reference(q.cpu(), k_ref, v_ref, cu_of(q_lens), cu_of(k_lens),
                                     dict(kw, sinks=sinks.cpu(), prefix_lens=prefix.cpu()))
    assert_close_packed(out_p, ref_p, cu_seqlens=cu_of(q_lens))
    assert_close_lse(lse_p, ref_lse_p)


@needs_triton
@pytest.mark.interpret
def test_triton_dropout_never_drops_the_sink_with_seqused_k(triton_launches):
    """TRITON draws MATH's keyed mask; compared to the reference given that mask, forward and backward
    (dsinks too), with seqused_k bounding the keys (and the prefixes)."""
    p = 0.3
    q_lens, k_lens, used = [5, 20, 3], [9, 24, 4], [7, 18, 0]
    gen = torch.Generator().manual_seed(9)
    q, k, v = (packed(lens, h, D, gen=gen).to(TRITON_DEVICE).requires_grad_()
               for lens, h in ((q_lens, HQ), (k_lens, HKV), (k_lens, HKV)))
    sinks = torch.randn(HQ, generator=gen).to(TRITON_DEVICE).requires_grad_()
    kw = dict(causal=True, chunk_size=6, sinks=sinks,
              prefix_lens=torch.tensor([3, 17, 0], dtype=torch.int32, device=TRITON_DEVICE))
    seqused = torch.tensor(used, dtype=torch.int32, device=TRITON_DEVICE)
    cu_q, cu_k = cu_of(q_lens).to(TRITON_DEVICE), cu_of(k_lens).to(TRITON_DEVICE)
    torch.manual_seed(11)
    key = keyed_dropout.draw_key()
    torch.manual_seed(11)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), dropout_p=p,
                                       seqused_k=seqused, backend="triton", **kw)
    keep = lambda b, lq, lk: keyed_dropout.keep_mask(key, b, HQ, torch.arange(lq), torch.arange(lk), p)
    ref, _, leaves = _reference(q.cpu(), k.cpu(), v.cpu(), cu_of(q_lens), cu_of(k_lens),
                                dict(kw, sinks=sinks.cpu(), prefix_lens=kw["prefix_lens"].cpu()), dropout_p=p,
                                dropout_keep=keep, seqused_k=used)
    assert_close_packed(out, ref, cu_seqlens=cu_of(q_lens))
    grad_out = torch.randn(out.shape).to(out)
    got = torch.autograd.grad(out, [q, k, v, sinks], grad_out)
    assert [name for name, _ in triton_launches] == ["fwd", "bwd"]
    _check_grads([g.cpu() for g in got], torch.autograd.grad(ref, leaves, grad_out.cpu().double()),
                 cu_of(q_lens), cu_of(k_lens))


@needs_triton
@pytest.mark.interpret
def test_triton_plan_runs_take_each_runs_sinks_and_updated_prefixes(triton_launches):
    """A TRITON plan passes each run's sinks and the prefix_lens of its latest update to the kernels."""
    q, k, v, kw0 = _triton_case(MIXES["prefix_chunk_sinks"], LQ, LK, PREFIX, torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    cu_q, cu_k = cu_of(LQ).to(TRITON_DEVICE), cu_of(LK).to(TRITON_DEVICE)
    opts = dict(causal=True, chunk_size=2, return_lse=True)
    p = jagged_sdpa.plan(cu_q, cu_k, max(LQ), max(LK), prefix_lens=kw0["prefix_lens"], backend="triton", **opts)
    sinks_runs = [torch.randn(HQ), torch.tensor([float("-inf"), 0.5, -1.0, 3.0])]   # -inf: no sink for head 0
    prefixes = [PREFIX, PREFIX, [1, 2, 0, 4, 1, 0]]
    for run, (sinks, prefix) in enumerate(zip(sinks_runs + sinks_runs[:1], prefixes)):
        if run == 2:
            p.update(cu_q, cu_k, max(LQ), max(LK), prefix_lens=torch.tensor(prefix, dtype=torch.int32,
                                                                              device=TRITON_DEVICE))
        out, lse = p.run(q, k, v, sinks=sinks.to(TRITON_DEVICE))
        assert len(triton_launches) == run + 1
        ref, ref_lse, _ = _reference(q.cpu(), k.cpu(), v.cpu(), cu_of(LQ), cu_of(LK),
                                     dict(causal=True, chunk_size=2, sinks=sinks, prefix_lens=torch.tensor(prefix)))
        assert_close_packed(out, ref, cu_seqlens=cu_of(LQ))
        assert_close_lse(lse, ref_lse)


@needs_triton
@pytest.mark.interpret
def test_triton_sdpa_top_left_with_gqa(triton_launches):
    """sdpa's top-left alignment (Lq > Lk: rows past the keys; Lq < Lk: keys past the rows) with GQA,
    a window, chunks and prefixes cut by the tiles, forward and backward with dsinks."""
    lq, lk = [35, 12], [20, 33]
    gen = torch.Generator().manual_seed(13)
    q, k, v = (packed(lens, h, D, gen=gen).to(TRITON_DEVICE).requires_grad_()
               for lens, h in ((lq, HQ), (lk, HKV), (lk, HKV)))
    sinks = torch.randn(HQ, generator=gen).to(TRITON_DEVICE).requires_grad_()
    prefix = torch.tensor([18, 5], dtype=torch.int32, device=TRITON_DEVICE)
    as_njt = lambda x, lens: torch.nested.nested_tensor_from_jagged(
        x, cu_of(lens).to(torch.int64).to(TRITON_DEVICE)).transpose(1, 2)
    out = jagged_sdpa.sdpa(as_njt(q, lq), as_njt(k, lk), as_njt(v, lk), is_causal=True, causal_alignment="top_left",
                           enable_gqa=True, window_size=(24, 0), sinks=sinks, chunk_size=16, prefix_lens=prefix,
                           backend="triton")
    got_out = out.transpose(1, 2).values()
    grad_out = torch.randn(got_out.shape).to(got_out)
    got = torch.autograd.grad(got_out, [q, k, v, sinks], grad_out)
    assert [name for name, _ in triton_launches] == ["fwd", "bwd"]
    ref, _, leaves = _reference(q.cpu(), k.cpu(), v.cpu(), cu_of(lq), cu_of(lk),
                                dict(causal=True, window_size=(24, 0), sinks=sinks.cpu(), chunk_size=16,
                                     prefix_lens=prefix.cpu()), alignment="top_left")
    assert_close_packed(got_out, ref, cu_seqlens=cu_of(lq))
    _check_grads([g.cpu() for g in got], torch.autograd.grad(ref, leaves, grad_out.cpu().double()), cu_of(lq),
                 cu_of(lk))


@functools.cache
def _range_probe():
    """A kernel writing ``_visible_keys`` of each position and ``_visible_rows`` of each key range."""
    @triton.jit
    def probe(Pos, Lo, Hi, N0, N1, RowLo, RowHi, n_pos, n_pairs, len_k, left, right, chunk, prefix,
              HAS_CHUNK: tl.constexpr, HAS_PREFIX: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        pos = tl.load(Pos + offs, mask=offs < n_pos, other=0)
        lo, hi = _visible_keys(pos, len_k, left, right, chunk, prefix, HAS_CHUNK, HAS_PREFIX)
        tl.store(Lo + offs, lo, mask=offs < n_pos)
        tl.store(Hi + offs, hi, mask=offs < n_pos)
        n0 = tl.load(N0 + offs, mask=offs < n_pairs, other=0)
        n1 = tl.load(N1 + offs, mask=offs < n_pairs, other=1)
        row_lo, row_hi = _visible_rows(n0, n1, left, right, chunk, prefix, HAS_CHUNK, HAS_PREFIX)
        tl.store(RowLo + offs, row_lo, mask=offs < n_pairs)
        tl.store(RowHi + offs, row_hi, mask=offs < n_pairs)
    return probe


@needs_triton
@pytest.mark.interpret
def test_triton_key_and_row_ranges_are_the_position_rules(triton_launches):
    """The kernels' masks and loop bounds come from ``_visible_keys`` (each row's keys) and
    ``_visible_rows`` (the rows that see a key range, for dK/dV): the first equals
    ``positions.visible_keys`` for every position (negative ones too), the second is exactly the
    hull of the rows whose keys meet the range, over causal x windows x chunk sizes x prefixes."""
    from itertools import product
    from types import SimpleNamespace

    from jagged_sdpa.backends import positions
    from jagged_sdpa.spec import AttnSpec

    base = AttnSpec(entry="varlen", device_type="cpu", capability=None, dtype=torch.float32, batch=1, heads_q=1,
                    heads_kv=1, head_dim=4, head_dim_v=4, total_q=1, total_k=1, max_seqlen_q=1, max_seqlen_k=1,
                    has_empty_q=False, has_empty_k=False, lengths_known=True)
    probe = _range_probe()
    pos = torch.arange(-12, 30, dtype=torch.int32)
    for causal, window, chunk, len_k in product((False, True), ((-1, -1), (1, 0), (0, 2), (2, -1), (3, 1)),
                                                (None, 1, 2, 3, 5), (3, 9)):
        pairs = [(n0, n1) for n0 in range(len_k) for n1 in range(n0 + 1, len_k + 1)]
        n0, n1 = (torch.tensor(x, dtype=torch.int32) for x in zip(*pairs))
        for prefix in sorted({0, 1, len_k // 2, len_k}):
            spec = base.replace(causal=causal, window=window, chunk_size=chunk, prefix=prefix > 0)
            (left, right, chunk_arg, _), flags = triton_common.mask_args(
                SimpleNamespace(spec=spec, prefix_lens=None, cu_seqlens_q=None))
            out = [torch.zeros(n, dtype=torch.int32, device=TRITON_DEVICE)
                   for n in (len(pos), len(pos), len(pairs), len(pairs))]
            probe[(1,)](pos.to(TRITON_DEVICE), *out[:2], n0.to(TRITON_DEVICE), n1.to(TRITON_DEVICE), *out[2:],
                        len(pos), len(pairs), len_k, left, right, chunk_arg, prefix, HAS_CHUNK=flags["HAS_CHUNK"],
                        HAS_PREFIX=prefix > 0, BLOCK=64)
            lo, hi, row_lo, row_hi = (t.tolist() for t in out)
            where = (spec.describe(), prefix)
            seen = []
            for i, p in enumerate(pos.tolist()):
                want = positions.visible_keys(spec, p, len_k, prefix)
                assert set(range(lo[i], hi[i])) == set(range(*want)), (where, p, (lo[i], hi[i]), want)
                seen.append(set(range(*want)))
            for i, (a, b) in enumerate(pairs):
                rows = [p for p, keys in zip(pos.tolist(), seen) if keys & set(range(a, b))]
                clip = lambda x: min(max(x, pos[0].item()), pos[-1].item() + 1)
                if rows:
                    assert rows == list(range(rows[0], rows[-1] + 1)), (where, a, b)
                    assert (clip(row_lo[i]), clip(row_hi[i])) == (rows[0], rows[-1] + 1), (where, a, b, row_lo[i],
                                                                                           row_hi[i])
                else:
                    assert clip(row_hi[i]) <= clip(row_lo[i]), (where, a, b, row_lo[i], row_hi[i])


@pytest.mark.interpret
@pytest.mark.skipif(TRITON_OK or triton is None, reason="the TRITON cases run in this process")
def test_triton_section_under_the_interpreter():
    """torch._dynamo (imported above) imports triton compiled, so when this module runs before any
    module that imports triton interpreted (test_backend_triton.py, test_dropout.py), its TRITON
    cases run again in a fresh process that sets TRITON_INTERPRET=1 from the start."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                             "triton and not under_the_interpreter", "-m", "not cuda"], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
