"""Property-based tests of what runs a CPU call, chosen automatically: the compiled kernel
(CPU_FUSED) for fp32/fp16/bf16 and MATH for float64, against the float64 reference, forward and
backward.

Each example draws the kernel's work split (``native.Q_CHUNK``, ``DIRECT_ROWS``, ``DIRECT_KEYS``)
and MATH's score budget (blocks of a few query rows) small (``_KNOBS``, patched on the modules
for one example), which puts work items, block edges and empty blocks at arbitrary places of short
sequences, and a ragged batch (0..60 queries, 0..80 keys: empty sequences, Lq > Lk, decode rows),
both causal alignments (``sdpa`` top-left, ``varlen`` bottom-right), windows, softcap, ALiBi,
scale, GQA, D != Dv, every dtype, contiguous, row-strided (NaN buffer) and last-dim-strided inputs,
packed keys or a paged cache (shared blocks), with or without a backward, on 1 or 2 threads.

Derandomized (the same examples every run): 150 examples, ~20 s on two cores.
``JAGGED_SDPA_PROPERTY_SCALE=<k>`` multiplies the count (a longer hunt).
"""

from __future__ import annotations

import contextlib
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jagged_sdpa
from jagged_sdpa import Backend
from jagged_sdpa.backends import math as math_backend
from jagged_sdpa.backends.cpu import native
from support.cases import alibi_slopes, cu_of, in_nan_buffer, paged_case
from support.reference import attention_reference
from test_backend_cpu import last_dim_strided
from test_native_properties import _stored_output_grads
from support.tolerances import assert_close_lse, assert_close_packed

LOWP = (torch.float16, torch.bfloat16)
# lowp_ref widens atol to FUDGE * MATH-in-the-same-dtype's own error (float32: scales up to 2 make
# logits large enough that float32 rounding alone passes the 1e-5 floor, see the kernel's tests).
FUDGE = {torch.float64: 2.0, torch.float32: 4.0, torch.float16: 2.0, torch.bfloat16: 2.0}
GRAD_FUDGE = {torch.float64: 2.0, torch.float32: 4.0, torch.float16: 3.0, torch.bfloat16: 3.0}
_SCALE = max(1, int(os.environ.get("JAGGED_SDPA_PROPERTY_SCALE", "1")))

# (module, attribute, strategy): the kernel's work split and MATH's block size each example draws
# (a budget of 4 bytes per head and key is one float32 query row per block).
_KNOBS = (
    (native, "Q_CHUNK", st.integers(1, 256)),
    (native, "DIRECT_ROWS", st.integers(0, 3)),
    (native, "DIRECT_KEYS", st.integers(1, 256)),
    (math_backend, "SCORE_BUDGET_BYTES", st.integers(1, 40000)),
)


@st.composite
def calls(draw):
    """One call as plain values (a falsifying example prints as something one can paste)."""
    batch = draw(st.integers(1, 5))
    paged = draw(st.booleans())
    entry = "varlen" if paged else draw(st.sampled_from(["varlen", "sdpa"]))
    min_len = 1 if entry == "sdpa" else 0
    side = st.one_of(st.just(-1), st.integers(0, 30))
    hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    d = draw(st.integers(1, 24))
    # Mostly without softcap, ALiBi and Dv != D: the plain paths are drawn often too.
    sometimes = lambda strategy, default: st.one_of(st.just(default), st.just(default), strategy)
    return {
        "entry": entry,
        "alignment": "bottom_right" if entry == "varlen" else draw(st.sampled_from(["top_left", "bottom_right"])),
        "q_lens": draw(st.lists(st.integers(min_len, 60), min_size=batch, max_size=batch)),
        "k_lens": draw(st.lists(st.integers(min_len, 80), min_size=batch, max_size=batch)),
        "hq": hkv * group, "hkv": hkv, "d": d,
        "dv": draw(sometimes(st.integers(1, 24), d)),
        "dtype": draw(st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16])),
        "causal": draw(st.booleans()),
        "window": (draw(side), draw(side)),
        "softcap": draw(sometimes(st.floats(0.5, 20.0), 0.0)),
        "alibi": draw(sometimes(st.sampled_from(["per_head", "per_batch_head"]), None)),
        "scale": draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        "layout": draw(st.sampled_from(["contiguous", "nan_buffer", "last_dim_strided"])),
        "grad": draw(st.booleans()),
        "paged": paged,
        "block_size": draw(st.integers(1, 9)),
        "knobs": {name: draw(strategy) for _, name, strategy in _KNOBS},
        "threads": draw(st.sampled_from([1, 2])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@contextlib.contextmanager
def drawn_setup(case):
    """The drawn knobs and thread count on; restored afterwards (no monkeypatch: hypothesis runs
    many examples inside one test)."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in _KNOBS]
    threads = torch.get_num_threads()
    try:
        for module, name, _ in _KNOBS:
            setattr(module, name, case["knobs"][name])
        torch.set_num_threads(case["threads"])
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        torch.set_num_threads(threads)


def _chosen(case, leaves, slopes, paged):
    """The backend automatic selection gives the call (the alignment does not change it)."""
    cu_q, cu_k = cu_of(case["q_lens"]), cu_of(case["k_lens"])
    extra = {"block_table": paged[2], "seqused_k": paged[3]} if paged else {}
    return jagged_sdpa.explain(*leaves, cu_q, None if paged else cu_k, causal=case["causal"],
                               window_size=case["window"], softcap=case["softcap"] or None, alibi_slopes=slopes,
                               **extra).chosen


def _wrap(case, t):
    if case["layout"] == "nan_buffer":  # a paged cache: its (blocks * block_size) rows
        return in_nan_buffer(t.flatten(0, 1)).unflatten(0, t.shape[:2]) if t.dim() == 4 else in_nan_buffer(t)
    return last_dim_strided(t) if case["layout"] == "last_dim_strided" else t


def _inputs(case, gen):
    """Packed q/k/v (float64 leaves of the drawn dtype's values), slopes, grad_out, and for a
    paged call the cache pieces."""
    q_lens, k_lens, hq, hkv, d, dv, dtype = (case[key] for key in ("q_lens", "k_lens", "hq", "hkv", "d", "dv", "dtype"))
    paged = None
    if case["paged"]:
        with torch.random.fork_rng():
            torch.manual_seed(case["seed"])
            k_cache, v_cache, table, used, k, v = paged_case(q_lens, k_lens, case["block_size"], hkv, max(d, dv), dtype)
        k, v = k[..., :d].contiguous(), v[..., :dv].contiguous()
        # NaN slots are never read; zeros keep the cache gradients comparable.
        paged = (torch.nan_to_num(k_cache[..., :d]), torch.nan_to_num(v_cache[..., :dv]), table, used)
    else:
        k = torch.randn(sum(k_lens), hkv, d, generator=gen).to(dtype)
        v = torch.randn(sum(k_lens), hkv, dv, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    grad_out = torch.randn(sum(q_lens), hq, dv, generator=gen).to(dtype)
    slopes = alibi_slopes(case["alibi"], len(q_lens), hq, generator=gen)
    return q, k, v, slopes, grad_out, paged


def _attend(case, q, k, v, slopes, paged, backend_name):
    """out (packed) and lse of the drawn entry point; k/v are the cache when ``paged``."""
    opts = {"window_size": case["window"], "softcap": case["softcap"] or None, "alibi_slopes": slopes}
    cu_q, cu_k = cu_of(case["q_lens"]), cu_of(case["k_lens"])
    if case["entry"] == "varlen":
        extra = {"block_table": paged[2], "seqused_k": paged[3]} if paged else {}
        return jagged_sdpa.varlen_attention(q, k, v, cu_q, None if paged else cu_k, causal=case["causal"],
                                            softmax_scale=case["scale"], return_lse=True, backend=backend_name,
                                            **opts, **extra)
    njt = [torch.nested.nested_tensor_from_jagged(t, cu.long()).transpose(1, 2) for t, cu in ((q, cu_q), (k, cu_k),
                                                                                          (v, cu_k))]
    out = jagged_sdpa.sdpa(*njt, is_causal=case["causal"], scale=case["scale"], enable_gqa=True,
                           causal_alignment=case["alignment"], backend=backend_name, **opts)
    return out.transpose(1, 2).values(), None


def _grads(case, q, k, v, slopes, grad_out, dtype, low_out=None):
    """out, lse and dq/dk/dv of MATH on packed inputs in ``dtype`` (float64: the reference). With
    ``low_out`` (MATH's in fp16/bf16), float64 gradients are widened to those of a backward that
    takes delta = rowsum(dO * O) from that rounded output, as the kernel's does
    (``test_native_properties._stored_output_grads``: at scale ~2 that term alone passes the
    low-precision floor): each gradient returned is the one of the two furthest from the exact."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_reference(*leaves, cu_of(case["q_lens"]), cu_of(case["k_lens"]), scale=case["scale"],
                                   causal=case["causal"], alignment=case["alignment"], window=case["window"],
                                   softcap=case["softcap"],
                                   alibi_slopes=None if slopes is None else slopes.to(dtype)) \
        if dtype == torch.float64 else (_attend(case, *leaves, slopes, None, "math")[0], None)
    grads = [None] * 3
    stored = {}
    if case["grad"] and out.requires_grad:
        if low_out is not None and low_out.numel():
            stored = _stored_output_grads(leaves, out, lse, grad_out, low_out)
        grads = torch.autograd.grad(out, leaves, grad_out.to(dtype), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return out.detach(), lse, grads, [stored.get(name) for name in ("dq", "dk", "dv")]


def run_case(case):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = case["dtype"]
    q, k, v, slopes, grad_out, paged = _inputs(case, gen)
    sources = (q, paged[0], paged[1]) if paged else (q, k, v)
    leaves = [_wrap(case, t).requires_grad_(case["grad"]) for t in sources]
    kernel = native.library() is not None and dtype != torch.float64
    with drawn_setup(case):
        assert _chosen(case, leaves, slopes, paged) == (Backend.CPU_FUSED if kernel else Backend.MATH)
        out, lse = _attend(case, *leaves, slopes, paged, None)
        if case["grad"] and out.requires_grad:
            out.backward(_wrap(case, grad_out))
    low_out, _, low_grads, _ = _grads(case, q, k, v, slopes, grad_out, dtype) if dtype in LOWP else (None,) * 4
    ref_out, ref_lse, ref_grads, stored = _grads(case, q, k, v, slopes, grad_out, torch.float64, low_out)
    cu_q, cu_k = cu_of(case["q_lens"]), cu_of(case["k_lens"])
    assert torch.isfinite(out).all(), "out has inf/NaN"
    assert_close_packed(out, ref_out, cu_seqlens=cu_q, lowp_ref=low_out if out.numel() else None, fudge=FUDGE[dtype])
    if lse is not None:
        assert_close_lse(lse, ref_lse)
    if not case["grad"]:
        return
    got = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    if paged:  # the cache gradients at each sequence's slots, in packed order
        bs, table = case["block_size"], paged[2]
        slots = [(table[b, :-(-n // bs)].long().unsqueeze(1) * bs + torch.arange(bs)).flatten()[:n]
                 for b, n in enumerate(case["k_lens"])]
        slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
        got = [got[0]] + [g.flatten(0, 1)[slots] for g in got[1:]]
    for i, (name, g, ref, cu) in enumerate(zip(("dq", "dk", "dv"), got, ref_grads, (cu_q, cu_k, cu_k))):
        assert g.dtype == dtype and torch.isfinite(g).all(), f"{name}: {g.dtype}, or inf/NaN"
        allowed = [t for t in (low_grads[i] if low_grads else None, stored[i]) if t is not None and t.numel()]
        widest = max(allowed, key=lambda t: (t.double() - ref).abs().max().item(), default=None)
        assert_close_packed(g, ref, cu_seqlens=cu, name=name, grad=True, lowp_ref=widest, fudge=GRAD_FUDGE[dtype])


@settings(max_examples=150 * _SCALE, deadline=None, derandomize=True, database=None, print_blob=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(calls())
def test_cpu_path_matches_reference(case):
    run_case(case)
