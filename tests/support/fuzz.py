"""Seeded differential fuzzer: every public entry point and every CPU-runnable backend against the
float64 reference (``reference.py``), with dtype-aware tolerances (``tolerances.py``).

Design
------
* ``make_case(seed, index, backend=None, entry=None, mode=None)`` draws one call from
  ``random.Random(f"{seed}-{index}")``: a plain dict (printable, pasteable). Tensor data comes from
  a ``torch.Generator`` seeded by the case's ``data_seed``, so ``--seed S --case I`` rebuilds the
  exact call. Entry points: ``varlen`` (packed, optional ``seqused_k``), ``paged`` (block table over
  a NaN-filled cache), ``sdpa`` (NJT q/k/v, cross lengths, both causal alignments, GQA) and
  ``sdpa_dense`` (NJT q, dense K/V), ``append`` (``paged_append``, then a paged attention call on
  the appended cache). Backends: ``auto`` (automatic selection), ``math``, ``cpu_fused`` (the
  compiled kernel; it refuses float64), ``no_kernel`` (automatic selection with the compiled kernel
  switched off by ``JAGGED_SDPA_NATIVE=0``, as on a machine without a C++ compiler), ``triton`` (the interpreter,
  ``TRITON_INTERPRET=1`` only around the call; small shapes, fp32/fp16 only).
* Inputs: contiguous, row-strided views into NaN-filled buffers, and last-dim-strided views
  (stride 2) into NaN buffers; a read outside the view poisons the result. Gradients are taken with
  respect to the *buffer*, so a gradient written outside the view (or NaN there) is caught too.
* ``run_case(case)`` executes the call (forward, lse, backward; the library on the case's 1 or 2
  threads, the checks on one) and checks it: shapes and dtypes; NaN where the float64 reference
  has NaN (a NaN injected in q/k/v must propagate as dense math does; one in k or v may also reach
  rows that mask its key, as PyTorch's math SDPA lets it) and nowhere else; rows that see no key
  exactly 0 with lse -inf; values within ``tolerance(dtype)`` widened by ``FUDGE x`` the error of
  the same math in float32 rounded to the dtype (``naive_attention``, independent of the library)
  and by the float32 rounding of the scores (``logit_rounding_bound``; it only matters for logits
  ~1e2-1e3); lse; gradients of every leaf (the q/k/v *buffers*, the paged caches, ALiBi slopes
  when they require grad) against a float64 autograd path checked equal to ``reference.py`` on the
  same case, widened as for the output plus FlashAttention-2's backward error terms
  (``_stored_output_grads``, ``grad_logit_bounds``). Calls that must be refused (``invalid``
  cases) must raise ``ValueError``/``TypeError`` and, for ``paged_append``, write nothing. A
  forced backend may refuse a call with ``NoBackendError`` ("refused"); automatic selection and
  MATH may not. Dropout: same seed -> same output, no NaN; ``dropout_p=1.0`` -> zeros; ``0.0``
  -> the reference. Meta tensors: an output of the right shape on meta (or a clean refusal).
* docs/api.md section 11 (``sinks``, ``chunk_size``, ``prefix_lens``): ``mode="options"`` (``--mode
  options``) gives every case at least one of them; by default a share ``OPTIONS_SHARE`` of the
  ordinary cases draws them (from a stream of its own, so the rest of every case is unchanged).
  ``varlen``, ``paged``, ``sdpa`` and ``sdpa_dense`` take them; the reference and the float32
  naive path apply them; the sinks' gradient is checked like every other leaf's; wrong sinks,
  chunk sizes and prefix lengths are ``invalid`` cases.
* fp8 KV caches (docs/api.md section 13): a share ``FP8_SHARE`` of the forward-only ``paged`` cases
  stores its cache in ``float8_e4m3fn`` or ``float8_e5m2`` with per-tensor or per-kv-head scales
  (drawn from a stream of its own); the reference and the naive path read the dequantized values.
* Failures are collected, never raised: each prints one line with its repro command and the run
  goes on. ``classify`` matches a failure against ``KNOWN`` (open bugs, one entry
  per class; delete an entry once its fix lands).

* Large logits: ``mode="large"`` (``--mode large``) makes every case one with scores of
  magnitude 1e2-1e4, rows that see exactly one key, and a softcap as large as the logits; by
  default a share ``LARGE_SHARE`` of the ordinary cases is made so. Their gradients are held to
  ``grad_logit_bounds``, which vanishes where a row's softmax is one-hot (MATH is exact there, and
  a kernel whose backward recomputes the forward's scores and lse exactly is too).

Command line (from the repository root)::

    PYTHONPATH=. python tests/support/fuzz.py --seed 1 --calls 2000 [--backend cpu_fused] [--entry paged]
    PYTHONPATH=. python tests/support/fuzz.py --seed 1 --case 45            # rebuild, print and run one case
    PYTHONPATH=. python tests/support/fuzz.py --seed 1 --calls 5000 --chunk 200   # child process per chunk

``--chunk`` runs chunks of cases in child processes: a child killed by a signal (segfault) is
reported as a crash of the case it had started, and the parent resumes after it. ``--verbose``
prints every case before running it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
import traceback
import types
from unittest import mock
from collections import defaultdict

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:  # run as a script: the ``support`` package sits in tests/
    sys.path.insert(0, TESTS)
from support.triton_interpreter import interpreter_env, is_interpreted  # noqa: E402


def _import_triton_interpreted() -> bool:
    """Import triton interpreted (``triton_interpreter``) unless something imported it already."""
    with interpreter_env("triton" not in sys.modules):
        try:
            import triton
        except ImportError:
            return False
    return is_interpreted(triton)


TRITON_OK = _import_triton_interpreted()

import jagged_sdpa  # noqa: E402
from jagged_sdpa import NoBackendError  # noqa: E402
from jagged_sdpa.backends.cpu import native  # noqa: E402
from support.cases import cu_of, paged_case  # noqa: E402
from support.reference import attention_reference  # noqa: E402
from support.tolerances import tolerance  # noqa: E402

BACKENDS = ("auto", "math", "cpu_fused", "no_kernel", "triton")
ENTRIES = ("varlen", "paged", "sdpa", "sdpa_dense", "append")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
# Low-precision error allowed: FUDGE x the error of the same math in float32 rounded to the dtype
# (tests/backends/cpu/test_native_properties.py uses the same factors against MATH).
FUDGE = {torch.float32: 4.0, torch.float16: 2.0, torch.bfloat16: 2.0, torch.float64: 2.0}
HUGE_WINDOWS = (2**31, 2**62, 2**63 - 1, 2**63, 2**64 + 5)


# ----------------------------------------------------------------------------------------------
# drawing


def _pick(rng, weighted):
    items, weights = zip(*weighted)
    return rng.choices(items, weights=weights)[0]


# cpu_fused's backward corrects the float32 lse's rounding in rows with |lse| >= this (attention.cpp
# LSE_EXACT); below it P may be off by |lse| 2^-24 (relative).
CPU_LSE_EXACT = 256.0
# Share of the cases with ordinary scores that the default mode turns into large-logit cases.
LARGE_SHARE = 0.2
OPTIONS_SHARE = 0.3
# Share of the forward-only paged cases whose cache is fp8 (docs/api.md section 13), drawn from a
# stream of its own.
FP8_SHARE = 0.3
OPTION_ENTRIES = ("varlen", "paged", "sdpa", "sdpa_dense")
MODES = ("default", "large", "options")


def make_case(seed: int, index: int, backend=None, entry=None, mode=None) -> dict:
    """One call, drawn from (seed, index) only; ``backend``/``entry`` restrict the draw. ``mode``
    "large": every case is a large-logit case (``_large_logits``); default: a share ``LARGE_SHARE``
    of the cases with ordinary scores is (drawn from a stream of its own, so the rest of every case
    is what it was before the mode existed)."""
    rng = random.Random(f"{seed}-{index}")
    be = backend or _pick(rng, [("auto", 40), ("math", 15), ("cpu_fused", 25), ("no_kernel", 10),
                                ("triton", 10 if TRITON_OK else 0)])
    en = entry or _pick(rng, [("varlen", 30), ("paged", 25), ("sdpa", 20), ("sdpa_dense", 10), ("append", 15)])
    small = be == "triton"
    if small:
        dtype = rng.choice(["float32", "float32", "float16"])
    else:
        dtype = _pick(rng, [("float32", 40), ("float16", 20), ("bfloat16", 20), ("float64", 20)])
    regime = _pick(rng, [("tiny", 30), ("small", 35), ("medium", 25), ("large", 0 if small else 10)])
    top = {"tiny": 2, "small": 12, "medium": 48, "large": 210}[regime]
    batch = rng.randint(1, 3 if small else 5)
    if en in ("varlen", "paged") and rng.random() < 0.04:
        batch = 0
    q_lens = [rng.choice([0, 1, rng.randint(0, top)]) if rng.random() < 0.3 else rng.randint(0, top)
              for _ in range(batch)]
    shape = rng.random()
    if shape < 0.3:
        k_lens = list(q_lens)                       # self-attention lengths
    elif shape < 0.4:
        k_lens = [1] * batch                        # single key
    elif shape < 0.5:
        k_lens = [0] * batch if rng.random() < 0.5 else [rng.choice([0, n]) for n in q_lens]
    else:
        k_lens = [rng.randint(0, top + 8) for _ in range(batch)]
    if en == "sdpa_dense":
        s = rng.choice([0, 1, rng.randint(0, top + 8)])
        k_lens = [s] * batch
    if en == "append" and rng.random() < 0.5:
        q_lens = [rng.choice([0, 1]) for _ in range(batch)]   # decode steps
    hkv = rng.randint(1, 3)
    group = rng.choice([1, 1, 2, 3, 4])
    if en == "sdpa" and rng.random() < 0.5:
        group = 1
    d = rng.choice([rng.randint(1, 32 if small else 80), 8, 16, 32] + ([] if small else [64, 128]))
    dv = d if rng.random() < 0.6 else rng.randint(1, 32 if small else 80)

    def side():
        r = rng.random()
        if r < 0.5:
            return -1
        if r < 0.9:
            return rng.randint(0, 2 * top + 2)
        return rng.choice(HUGE_WINDOWS)

    window = (side(), side()) if rng.random() < 0.4 else (-1, -1)
    scores = _pick(rng, [("normal", 80), ("huge", 10), ("tiny", 10)])
    if scores == "huge":
        scale = rng.uniform(100.0, 1000.0) / math.sqrt(d)
    elif scores == "tiny":
        scale = 1e-6 * rng.uniform(0.5, 2.0)
    else:
        scale = rng.choice([None, None, rng.uniform(0.05, 2.0)])
    case = {
        "seed": seed, "index": index, "backend": be, "entry": en, "dtype": dtype,
        "q_lens": q_lens, "k_lens": k_lens, "hq": hkv * group, "hkv": hkv, "d": d, "dv": dv,
        "causal": rng.random() < 0.5,
        "alignment": rng.choice(["top_left", "bottom_right"]) if en in ("sdpa", "sdpa_dense") else "bottom_right",
        "window": window, "scores": scores, "scale": scale,
        "softcap": rng.uniform(0.5, 50.0) if rng.random() < 0.25 else 0.0,
        "alibi": _pick(rng, [(None, 60), ("per_head", 20), ("per_batch_head", 20)]),
        "alibi_high": rng.choice([0.5, 0.5, 4.0]),
        "alibi_grad": False,
        "layout": _pick(rng, [("contiguous", 50), ("nanbuf", 30), ("lastdim", 20)]),
        "grad": en != "append" and rng.random() < 0.3,
        "return_lse": en in ("varlen", "paged", "append") and rng.random() < 0.5,
        "seqused": en == "varlen" and rng.random() < 0.2,
        "dropout": _pick(rng, [(None, 90), ("zero", 4), ("stats", 5), ("one", 1)]),
        "nan": None, "invalid": None, "block_size": rng.randint(1, 17), "shared_first_block": False,
        "max_given": rng.random() < 0.3,
        "data_seed": rng.getrandbits(31),
        "sinks": None, "sinks_dtype": None, "sinks_size": None, "chunk_size": None, "prefix": False,
    }
    if case["alibi"] and case["grad"] and rng.random() < 0.3:
        case["alibi_grad"] = True
    if en == "paged" and k_lens and k_lens[0] >= case["block_size"] and rng.random() < 0.3:
        case["shared_first_block"] = True
    if not case["grad"] and not case["dropout"] and rng.random() < 0.08:
        # NaN in one element of q, k or v (a cache slot shared by several rows, or a key the append
        # call copies, would poison more than one packed row: q only there)
        which = "q" if en == "append" or case["shared_first_block"] else rng.choice("qkv")
        case["nan"] = (which, rng.random(), rng.randrange(case["hq"]), rng.random())
    if rng.random() < 0.06:
        name = rng.choice(_INVALID[en])
        applies = {
            "heads_not_multiple": hkv > 1,
            "max_seqlen_small": max(q_lens + [0]) >= 1,
            "block_id_range": sum(q_lens if en == "append" else k_lens) > 0,
            "seqused_over": len(q_lens) > 0,  # an empty batch has no length to make too long
        }.get(name, True)
        case["invalid"] = name if applies else None
    if not small and en != "sdpa_dense" and case["invalid"] is None and rng.random() < 0.04:
        # stress: long query sequences (several 128-row blocks) over 0-2 keys
        case["q_lens"] = [rng.randint(100, 260) for _ in range(max(batch, 1))][:batch]
        case["k_lens"] = [rng.choice([0, 1, 2]) for _ in range(batch)]
        case["shared_first_block"] = False
    case["meta"] = (en in ("varlen", "sdpa") and not case["grad"] and case["nan"] is None
                    and case["invalid"] is None and not case["dropout"] and rng.random() < 0.02)
    if case["meta"]:
        case["max_given"] = True
    case["threads"] = rng.choice([1, 2])   # intra-op threads of the library call (the checks use 1)
    lrng = random.Random(f"{seed}-{index}-large")
    if mode == "large" or (mode in (None, "default") and scores == "normal" and lrng.random() < LARGE_SHARE):
        _large_logits(case, lrng)
    frng = random.Random(f"{seed}-{index}-fp8")
    if (en == "paged" and not case["grad"] and not case["dropout"] and case["invalid"] is None and not case["meta"]
            and case["nan"] is None and dtype != "float64" and frng.random() < FP8_SHARE):
        case["fp8"] = (frng.choice(["float8_e4m3fn", "float8_e5m2"]), frng.choice(["tensor", "head"]))
    orng = random.Random(f"{seed}-{index}-options")
    if en in OPTION_ENTRIES and not case["meta"] and (
            mode == "options" or (mode in (None, "default") and case["scores"] != "large" and orng.random() < OPTIONS_SHARE)):
        _section11_options(case, orng, top)
    return case


def _section11_options(case, rng, top):
    """docs/api.md section 11: at least one of sinks (a learned logit per head, its gradient with the others'),
    chunk_size (small chunks that cut sequences, or one that covers them) and prefix_lens (values
    drawn in ``build``: 0, the whole key sequence, or anything between); sometimes an invalid one."""
    while not (case["sinks"] or case["chunk_size"] or case["prefix"]):
        if rng.random() < 0.5:
            case["chunk_size"] = rng.choice([1, 2, 3, rng.randint(1, top + 4)])
        if rng.random() < 0.5:
            case["prefix"] = True
        if rng.random() < 0.5:
            case["sinks"] = "grad" if case["grad"] and rng.random() < 0.6 else "fixed"
            case["sinks_dtype"] = rng.choice(["float32", case["dtype"]])
            case["sinks_size"] = rng.choice([0.5, 2.0, 2.0, 20.0])
    if case["invalid"] is None and rng.random() < 0.06:
        name = rng.choice(["sinks_shape", "sinks_int", "chunk_zero", "chunk_float", "prefix_over", "prefix_int64",
                           "prefix_negative"])
        if name.startswith("prefix") and not case["q_lens"]:
            name = "chunk_zero"
        case["invalid"] = name


def _large_logits(case, rng):
    """The large-logit mode: scores of magnitude up to 1e4 (3e3 in float16, whose gradients
    would overflow), put either in softmax_scale or in q (``q_gain``, with scale 1 or the default);
    rows with exactly one visible key (one key per sequence, or a (0, 0) window); softcap with a
    large cap (~ the logits' size, so tanh neither saturates nor stays linear); float32, float16,
    bfloat16; a backward more often than not."""
    if case["dtype"] == "float64":
        case["dtype"] = rng.choice(["float32", "float16", "bfloat16"])
    top = 4.0 if case["dtype"] != "float16" else math.log10(3e3)
    size = 10 ** rng.uniform(2.0, top)
    d = case["d"]
    if rng.random() < 0.5:
        case["scale"], case["q_gain"] = size / math.sqrt(d), 1.0
    else:
        case["scale"] = rng.choice([None, 1.0])
        scale = 1.0 / math.sqrt(d) if case["scale"] is None else case["scale"]
        case["q_gain"] = size / (math.sqrt(d) * scale)
    case["scores"], case["logit_size"] = "large", size
    rows = rng.choice(["one_key", "one_key", "diagonal", "any"])
    if rows == "one_key" and case["entry"] != "append":
        case["k_lens"] = [1] * len(case["q_lens"])
    elif rows != "any":
        case["window"] = (0, 0)   # each row sees at most its aligned key
    case["softcap"] = size * rng.uniform(0.05, 2.0) if rng.random() < 0.35 else 0.0
    case["dropout"] = None
    case["grad"] = case["entry"] != "append" and rng.random() < 0.6
    case["alibi_grad"] = case["alibi_grad"] and case["grad"]
    if case["grad"]:
        case["nan"], case["meta"] = None, False
    if case["entry"] == "paged" and (not case["k_lens"] or case["k_lens"][0] < case["block_size"]):
        case["shared_first_block"] = False


# Mutations that make a call invalid: the library must raise ValueError/TypeError (and write nothing).
_COMMON_INVALID = ["cu_int64", "cu_not_ending", "dtype_mismatch", "heads_not_multiple", "alibi_shape",
                   "window_minus2", "softcap_negative", "alibi_float64", "dv_mismatch"]
_INVALID = {
    "varlen": _COMMON_INVALID + ["cu_decreasing", "max_seqlen_small", "seqused_over"],
    "paged": _COMMON_INVALID + ["block_id_range", "seqused_over", "table_int64"],
    "sdpa": ["dtype_mismatch", "heads_not_multiple", "alibi_shape", "window_minus2", "softcap_negative",
             "gqa_flag_missing", "attn_mask", "dv_mismatch"],
    "sdpa_dense": ["dtype_mismatch", "alibi_shape", "window_minus2", "attn_mask", "dense_batch"],
    "append": ["append_overflow", "cu_int64", "table_int64", "dtype_mismatch", "block_id_range"],
}


# ----------------------------------------------------------------------------------------------
# building tensors


def _view_fn(layout, rows, heads, dim, pad=3):
    """(base shape, fn base -> (rows, heads, dim) view). NaN-filled bases poison any read outside."""
    if layout == "nanbuf":
        return (rows + 2 * pad, heads, dim + 5), lambda b: b[pad:pad + rows, :, 2:2 + dim]
    if layout == "lastdim":
        return (rows, heads, 2 * dim + 1), lambda b: b[:, :, 1:1 + 2 * dim:2]
    return (rows, heads, dim), lambda b: b


class Leaf:
    """A tensor argument: its values (the logical data), the base buffer (the autograd leaf) and
    the view that maps the base to the argument."""

    def __init__(self, values, layout, requires_grad=False):
        self.values = values
        shape, self.fn = _view_fn(layout, *values.shape)
        self.base = torch.full(shape, float("nan"), dtype=values.dtype)
        with torch.no_grad():
            self.fn(self.base).copy_(values)
        self.base.requires_grad_(requires_grad)
        self.arg = self.fn(self.base)

    def expected_grad(self, grad_view):
        g = torch.zeros(self.base.shape, dtype=torch.float64)
        self.fn(g).copy_(grad_view)
        return g


def _randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def build(case):
    """All tensors and arguments of a case. Returns a dict the executor and checker share."""
    dtype = DTYPES[case["dtype"]]
    gen = torch.Generator().manual_seed(case["data_seed"])
    q_lens, k_lens, hq, hkv, d, dv = (case[x] for x in ("q_lens", "k_lens", "hq", "hkv", "d", "dv"))
    batch = len(q_lens)
    grad = case["grad"]
    b = {"dtype": dtype, "cu_q": cu_of(q_lens), "cu_k": cu_of(k_lens)}
    q = (_randn(gen, sum(q_lens), hq, d, dtype=torch.float64) * case.get("q_gain", 1.0)).to(dtype)
    if case["entry"] in ("paged", "append"):
        if case["entry"] == "append":
            _build_append(case, b, gen, dtype)
            k, v = b["pk"], b["pv"]
        else:
            with torch.random.fork_rng():
                torch.manual_seed(case["data_seed"])
                kc, vc, table, used, pk, pv = paged_case(q_lens if batch else [], k_lens, case["block_size"], hkv,
                                                         max(d, dv), dtype,
                                                         shared_first_block=case["shared_first_block"])
            if case.get("fp8"):
                kc, vc, pk, pv = _fp8_cache(case, b, gen, kc, vc, pk, pv)
            b["k_cache_full"], b["v_cache_full"] = kc, vc
            kc, vc = kc[..., :d], vc[..., :dv]
            k, v = pk[..., :d].contiguous(), pv[..., :dv].contiguous()
            b["table"], b["seqused"] = table, used
            b["kc_leaf"], b["vc_leaf"] = kc.clone().requires_grad_(grad), vc.clone().requires_grad_(grad)
            b["k_arg"], b["v_arg"] = b["kc_leaf"], b["vc_leaf"]
    else:
        k = _randn(gen, sum(k_lens), hkv, d, dtype=dtype)
        v = _randn(gen, sum(k_lens), hkv, dv, dtype=dtype)
    if case["nan"] is not None:
        which, frac, head, dfrac = case["nan"]
        t = {"q": q, "k": k, "v": v}[which]
        if t.shape[0]:
            row = int(frac * t.shape[0])
            t[row, head % t.shape[1], int(dfrac * t.shape[2])] = float("nan")
            if case["entry"] == "paged" and which != "q":
                with torch.no_grad():
                    _poke_cache(b, which, row, head % t.shape[1], int(dfrac * t.shape[2]))
    b["q"], b["k"], b["v"] = q, k, v
    if "seqused" in b:
        b["seqused_host"] = b["seqused"].tolist()
    slopes = None
    if case["alibi"]:
        shape = (hq,) if case["alibi"] == "per_head" else (batch, hq)
        slopes = (torch.rand(*shape, generator=gen) * case["alibi_high"]).requires_grad_(case["alibi_grad"])
    b["slopes"] = slopes
    b["grad_out"] = _randn(gen, sum(q_lens), hq, dv, dtype=dtype)
    b["q_leaf"] = Leaf(q, case["layout"], grad)
    if case["entry"] in ("varlen", "sdpa", "sdpa_dense"):
        b["k_leaf"] = Leaf(k, case["layout"], grad)
        b["v_leaf"] = Leaf(v, case["layout"], grad)
        b["k_arg"], b["v_arg"] = b["k_leaf"].arg, b["v_leaf"].arg
    if case["seqused"]:
        used_gen = random.Random(case["data_seed"])
        b["seqused"] = torch.tensor([used_gen.randint(0, n) for n in k_lens], dtype=torch.int32)
        b["seqused_host"] = b["seqused"].tolist()
    b["sinks"] = b["prefix_lens"] = None
    if case.get("sinks"):
        sinks = torch.randn(hq, generator=gen, dtype=torch.float64) * case["sinks_size"]
        b["sinks"] = sinks.to(DTYPES[case["sinks_dtype"]]).requires_grad_(case.get("sinks") == "grad")
    if case.get("prefix"):
        prng = random.Random(case["data_seed"] + 1)
        b["prefix_lens"] = torch.tensor([prng.choice([0, n, prng.randint(0, n)]) for n in _key_lens(case, b)],
                                        dtype=torch.int32)
    return b


def _fp8_cache(case, b, gen, kc, vc, pk, pv):
    """The case's caches stored in fp8 with per-tensor or per-kv-head scales (docs/api.md section 13):
    the caches quantized (NaN slots stay NaN), and the packed keys/values the reference reads, the
    dequantized float32 values ``x.float() * scale``."""
    fp8, kind = getattr(torch, case["fp8"][0]), case["fp8"][1]
    hkv = case["hkv"]
    size = 1 if kind == "tensor" else hkv
    b["k_scale"], b["v_scale"] = (torch.rand(size, generator=gen) * 0.2 + 0.01 for _ in range(2))
    if kind == "tensor":
        b["k_scale"], b["v_scale"] = b["k_scale"][0], b["v_scale"][0]
    largest = torch.finfo(fp8).max

    def quantize(x, scale):
        return (x.float() / scale.reshape(-1, 1)).clamp(-largest, largest).to(fp8)

    def dequantize(x8, scale):
        return x8.float() * scale.reshape(-1, 1)

    kc8, vc8 = quantize(kc, b["k_scale"]), quantize(vc, b["v_scale"])
    return (kc8, vc8, dequantize(quantize(pk, b["k_scale"]), b["k_scale"]),
            dequantize(quantize(pv, b["v_scale"]), b["v_scale"]))


def _key_lens(case, b):
    """Every sequence's key length as the call sees it (seqused_k where given)."""
    used = b.get("seqused_host")
    return list(used) if used is not None else list(case["k_lens"])


def _poke_cache(b, which, row, head, dim):
    """Put a NaN injected into packed k/v row ``row`` at its cache slot too."""
    table, used = b["table"], b["seqused"].tolist()
    bs = b["kc_leaf"].shape[1]
    start = 0
    for s, n in enumerate(used):
        if row < start + n:
            pos = row - start
            blk = int(table[s, pos // bs])
            cache = b["kc_leaf"] if which == "k" else b["vc_leaf"]
            cache[blk, pos % bs, head, dim] = float("nan")
            return
        start += n


def _build_append(case, b, gen, dtype):
    """A cache of distinct shuffled blocks per row holding ``k_lens - new`` old keys; the call appends
    ``q_lens`` new keys per sequence (decode/prefill), then attends with those queries."""
    q_lens, k_lens, hkv, d, dv, bs = (case[x] for x in ("q_lens", "k_lens", "hkv", "d", "dv", "block_size"))
    rng = random.Random(case["data_seed"])
    old = [rng.randint(0, n) for n in k_lens]
    total = [o + n for o, n in zip(old, q_lens)]
    need = [-(-t // bs) for t in total]
    width = max(need + [1]) + rng.randint(0, 1)
    num_blocks = sum(need) + 2 + rng.randint(0, 3)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    table = torch.zeros(len(q_lens), width, dtype=torch.int32)
    for s in range(len(q_lens)):
        row = [ids.pop() for _ in range(need[s])]
        table[s, :len(row)] = torch.tensor(row, dtype=torch.int32)
        table[s, len(row):] = torch.tensor([rng.randrange(num_blocks) for _ in range(width - len(row))],
                                           dtype=torch.int32)
    kc = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    vc = torch.full((num_blocks, bs, hkv, dv), float("nan"), dtype=dtype)
    pk, pv = [], []
    for s in range(len(q_lens)):
        ks = _randn(gen, total[s], hkv, d, dtype=dtype)
        vs = _randn(gen, total[s], hkv, dv, dtype=dtype)
        i = torch.arange(old[s])
        blk, off = table[s].long()[i // bs], i % bs
        kc[blk, off], vc[blk, off] = ks[:old[s]], vs[:old[s]]
        pk.append(ks)
        pv.append(vs)
    pk = torch.cat(pk) if pk else torch.zeros(0, hkv, d, dtype=dtype)
    pv = torch.cat(pv) if pv else torch.zeros(0, hkv, dv, dtype=dtype)
    new_rows = torch.cat([torch.arange(c0 + o, c0 + t) for c0, o, t in
                          zip(cu_of(total).tolist()[:-1], old, total)] or [torch.zeros(0, dtype=torch.long)])
    b.update(table=table, seqused_old=torch.tensor(old, dtype=torch.int32), seqused=torch.tensor(total, dtype=torch.int32),
             kc0=kc, vc0=vc, pk=pk, pv=pv, k_new=pk[new_rows], v_new=pv[new_rows], cu_new=cu_of(q_lens),
             append_total=total)
    b["cu_k"] = cu_of(total)


# ----------------------------------------------------------------------------------------------
# references


def fast_keep_mask(len_q, len_k, *, causal, alignment, window, device=None, chunk_size=None, prefix=0):
    """reference.keep_mask (then reference.chunk_prefix_mask with chunk_size/prefix), vectorised
    (the same rules; test_fuzz.py checks they agree)."""
    shift = len_k - len_q if alignment == "bottom_right" else 0
    pos = torch.arange(len_q, dtype=torch.float64).unsqueeze(1) + shift
    j = torch.arange(len_k, dtype=torch.float64).unsqueeze(0)
    keep = torch.ones(len_q, len_k, dtype=torch.bool)
    if causal:
        keep &= j <= pos
    if window[0] >= 0:
        keep &= j >= pos - float(window[0])
    if window[1] >= 0:
        keep &= j <= pos + float(window[1])
    if chunk_size is not None or prefix:
        keep = fast_chunk_prefix_mask(keep, len_q, len_k, alignment=alignment, chunk_size=chunk_size, prefix=prefix)
    return keep


def fast_chunk_prefix_mask(keep, len_q, len_k, *, alignment, chunk_size=None, prefix=0):
    """reference.chunk_prefix_mask, vectorised: chunk ids by floor division ANDed in, the prefix ORed in."""
    shift = len_k - len_q if alignment == "bottom_right" else 0
    pos = torch.arange(len_q, dtype=torch.int64).unsqueeze(1) + shift
    j = torch.arange(len_k, dtype=torch.int64).unsqueeze(0)
    keep = keep.clone()
    if chunk_size is not None:
        keep &= torch.div(pos, chunk_size, rounding_mode="floor") == torch.div(j, chunk_size, rounding_mode="floor")
    if prefix:
        keep |= (pos < prefix) & (j < prefix)
    return keep


@contextlib.contextmanager
def fast_reference():
    from support import reference as module
    saved = module.keep_mask, module.chunk_prefix_mask
    module.keep_mask, module.chunk_prefix_mask = fast_keep_mask, fast_chunk_prefix_mask
    try:
        yield
    finally:
        module.keep_mask, module.chunk_prefix_mask = saved


def reference(case, b):
    """float64 out/lse from tests/support/reference.py."""
    slopes = None if b["slopes"] is None else b["slopes"].detach().double()
    sinks = None if b.get("sinks") is None else b["sinks"].detach().double()
    prefix = None if b.get("prefix_lens") is None else b["prefix_lens"].tolist()
    cu_k = b["cu_k"]
    seqused = b.get("seqused") if case["entry"] == "varlen" else None
    if case["entry"] == "paged":
        cu_k = cu_of(case["k_lens"])
    with fast_reference():
        return attention_reference(b["q"].double(), b["k"].double(), b["v"].double(), b["cu_q"], cu_k,
                                   scale=case["scale"], causal=case["causal"], alignment=case["alignment"],
                                   window=case["window"], softcap=case["softcap"], alibi_slopes=slopes,
                                   seqused_k=seqused, sinks=sinks, chunk_size=case.get("chunk_size"),
                                   prefix_lens=prefix)


def naive_attention(case, q, k, v, cu_q, cu_k, seqused=None, slopes=None, comp=None, with_lse=False, sinks=None,
                    prefix=None):
    """The same math vectorised per sequence (differentiable): in float32 with the output rounded to
    the input dtype, the error a correct low-precision implementation may make; in float64
    (``comp=torch.float64``), the gradient reference (its forward is checked against
    ``reference.attention_reference`` on every case that uses it). ``with_lse`` also returns the lse
    (Hq, total_q), -inf for rows that see no key (the sink with ``sinks``), with finite gradients
    everywhere. ``sinks`` (Hq,), ``prefix`` (a length per sequence) and ``case["chunk_size"]``:
    docs/api.md section 11."""
    dtype = q.dtype
    comp = comp or (torch.float64 if dtype == torch.float64 else torch.float32)
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        lq = cu_q[s + 1] - cu_q[s]
        ks = cu_k[s]
        lk = (cu_k[s + 1] - ks) if seqused is None else int(seqused[s])
        qb = q[cu_q[s]:cu_q[s + 1]].to(comp)
        if lq == 0:
            continue
        sink = None if sinks is None else sinks.to(comp)
        if lk == 0:
            outs.append(torch.zeros(lq, hq, v.shape[2], dtype=comp) + 0 * qb.sum())
            lses.append(_no_key_lse(hq, lq, comp, sink))
            continue
        kb = k[ks:ks + lk].to(comp).repeat_interleave(group, 1)
        vb = v[ks:ks + lk].to(comp).repeat_interleave(group, 1)
        sc, keep = _masked_scores(case, qb, kb, None if slopes is None else (slopes if slopes.dim() == 1 else slopes[s]),
                                  0 if prefix is None else prefix[s])
        p, lse_s = _softmax_rows(sc, keep, sink)
        outs.append(torch.einsum("hqk,khd->qhd", p, vb))
        lses.append(lse_s)
    if not outs:
        out = torch.zeros(q.shape[0], hq, v.shape[2], dtype=dtype)
        lse = _no_key_lse(hq, q.shape[0], comp, None if sinks is None else sinks.to(comp))
    else:
        out = torch.cat(outs).to(dtype)
        lse = torch.cat(lses, 1)
    return (out, lse) if with_lse else out


# ----------------------------------------------------------------------------------------------
# execution


class Refused(Exception):
    pass


@contextlib.contextmanager
def backend_context(name):
    """Environment of one backend: the interpreter switch for triton, no compiled kernel for no_kernel."""
    if name == "triton":
        with interpreter_env():
            yield
    elif name == "no_kernel":
        with mock.patch.dict(os.environ, {"JAGGED_SDPA_NATIVE": "0"}):
            native.reset()
            try:
                yield
            finally:
                native.reset()
    else:
        yield


def _forced(case):
    return {"auto": None, "math": "math", "cpu_fused": "cpu_fused", "no_kernel": None,
            "triton": "triton"}[case["backend"]]


def _dropout_p(case):
    return {None: 0.0, "zero": 0.0, "stats": 0.3, "one": 1.0}[case["dropout"]]


def _njt(arg, cu):
    return torch.nested.nested_tensor_from_jagged(arg, offsets=cu.long()).transpose(1, 2)


def call_library(case, b, mutate=None):
    """Run the case's call; returns (out packed, lse or None). ``mutate`` edits the arguments."""
    en = case["entry"]
    backend = _forced(case)
    p = _dropout_p(case)
    if en in ("varlen", "paged", "append"):
        args = {"q": b["q_leaf"].arg, "k": b["k_arg"], "v": b["v_arg"], "cu_seqlens_q": b["cu_q"],
                "cu_seqlens_k": b["cu_k"], "max_seqlen_q": None, "max_seqlen_k": None}
        kw = {"dropout_p": p, "softmax_scale": case["scale"], "causal": case["causal"],
              "window_size": case["window"], "softcap": case["softcap"], "alibi_slopes": b["slopes"],
              "return_lse": case["return_lse"], "backend": backend}
        if case["max_given"]:
            args["max_seqlen_q"] = max(case["q_lens"] + [0])
            used = b.get("seqused_host")
            args["max_seqlen_k"] = max((used if used is not None else case["k_lens"]) + [0])
        if en in ("paged", "append"):
            args["cu_seqlens_k"] = None
            kw["block_table"], kw["seqused_k"] = b["table"], b["seqused"]
            if case.get("fp8"):
                kw["k_scale"], kw["v_scale"] = b["k_scale"], b["v_scale"]
        elif case["seqused"]:
            kw["seqused_k"] = b["seqused"]
        kw.update(_section11_kwargs(case, b))
        if mutate:
            mutate(args, kw)
        res = jagged_sdpa.varlen_attention(*args.values(), **kw)
        return (res if case["return_lse"] else (res, None))
    q = _njt(b["q_leaf"].arg, b["cu_q"])
    if en == "sdpa":
        k, v = _njt(b["k_arg"], b["cu_k"]), _njt(b["v_arg"], b["cu_k"])
    else:
        s = case["k_lens"][0] if case["k_lens"] else 0
        k = b["k_arg"].unflatten(0, (len(case["k_lens"]), s)).transpose(1, 2)
        v = b["v_arg"].unflatten(0, (len(case["k_lens"]), s)).transpose(1, 2)
    args = {"query": q, "key": k, "value": v, "attn_mask": None, "dropout_p": p, "is_causal": case["causal"],
            "scale": case["scale"], "enable_gqa": case["hq"] != case["hkv"]}
    kw = {"causal_alignment": case["alignment"], "window_size": case["window"],
          "softcap": case["softcap"] or None, "alibi_slopes": b["slopes"], "backend": backend,
          **_section11_kwargs(case, b)}
    if mutate:
        mutate(args, kw)
    out = jagged_sdpa.sdpa(*args.values(), **kw)
    return out.transpose(1, 2).values(), None


def _section11_kwargs(case, b):
    """The case's docs/api.md section 11 arguments (only those it draws, so the others stay at their defaults)."""
    kw = {}
    if case.get("chunk_size") is not None:
        kw["chunk_size"] = case["chunk_size"]
    if b.get("sinks") is not None:
        kw["sinks"] = b["sinks"]
    if b.get("prefix_lens") is not None:
        kw["prefix_lens"] = b["prefix_lens"]
    return kw


def _mutation(case, b):
    """The argument edit of an ``invalid`` case (a function of (args, kw))."""
    name = case["invalid"]
    first = "q" if case["entry"] in ("varlen", "paged", "append") else "query"

    def m(args, kw):
        if name == "cu_int64":
            args["cu_seqlens_q"] = args["cu_seqlens_q"].long()
        elif name == "cu_not_ending":
            args["cu_seqlens_q"] = torch.cat([args["cu_seqlens_q"], args["cu_seqlens_q"][-1:] + 1])
        elif name == "cu_decreasing":
            cu = args["cu_seqlens_q"].clone()
            cu = torch.cat([cu[:1], cu[:1] + 2, cu[1:]]) if len(cu) > 1 else torch.tensor([0, 2, 0], dtype=torch.int32)
            args["cu_seqlens_q"] = torch.cat([cu, cu[-1:]])
            kw["alibi_slopes"] = None
        elif name == "dtype_mismatch":
            key = "k" if first == "q" else "key"
            other = torch.float64 if b["dtype"] != torch.float64 else torch.float32
            args[key] = args[key].detach().to(other)
        elif name == "heads_not_multiple":
            args[first] = _drop_head(args[first])
            kw["alibi_slopes"] = None
        elif name == "gqa_flag_missing":
            args[first] = _add_heads(args[first])
            args["enable_gqa"] = False
            kw["alibi_slopes"] = None
        elif name == "alibi_shape":
            kw["alibi_slopes"] = torch.rand(case["hq"] + 1)
        elif name == "alibi_float64":
            kw["alibi_slopes"] = torch.rand(case["hq"], dtype=torch.float64)
        elif name == "window_minus2":
            kw["window_size"] = (-2, case["window"][1])
        elif name == "softcap_negative":
            kw["softcap"] = -1.0
        elif name == "max_seqlen_small":
            args["max_seqlen_q"] = max(case["q_lens"] + [1]) - 1
            if args["max_seqlen_q"] < 0:
                args["max_seqlen_q"] = 0
        elif name == "seqused_over":
            used = kw["seqused_k"] if kw.get("seqused_k") is not None else torch.tensor(case["k_lens"], dtype=torch.int32)
            kw["seqused_k"] = used + 10**6
        elif name == "block_id_range":
            kw["block_table"] = kw["block_table"] + 10**6
        elif name == "table_int64":
            kw["block_table"] = kw["block_table"].long()
        elif name == "attn_mask":
            args["attn_mask"] = torch.ones(1, dtype=torch.bool)
        elif name == "dense_batch":
            args["key"] = torch.cat([args["key"], args["key"][:1]])
            args["value"] = torch.cat([args["value"], args["value"][:1]])
        elif name == "dv_mismatch":
            key = "v" if first == "q" else "value"
            args[key] = _drop_rows(args[key], first == "q")
        elif name == "sinks_shape":
            kw["sinks"] = torch.zeros(case["hq"] + 1)
        elif name == "sinks_int":
            kw["sinks"] = torch.zeros(case["hq"], dtype=torch.int32)
        elif name == "chunk_zero":
            kw["chunk_size"] = 0
        elif name == "chunk_float":
            kw["chunk_size"] = 2.0
        elif name.startswith("prefix"):
            lens = torch.tensor(_key_lens(case, b), dtype=torch.int32)
            if name == "prefix_over":
                kw["prefix_lens"] = lens + 1
            elif name == "prefix_int64":
                kw["prefix_lens"] = lens.long()
            else:
                kw["prefix_lens"] = lens - lens - 1
    return m


def _drop_rows(t, packed):
    if packed:
        return torch.cat([t.detach(), t.detach()[:1]]) if t.shape[0] else torch.zeros(1, *t.shape[1:], dtype=t.dtype)
    vals = t.transpose(1, 2).values().detach()
    vals = torch.cat([vals, vals[:1]]) if vals.shape[0] else torch.zeros(1, *vals.shape[1:], dtype=vals.dtype)
    off = t.offsets().clone()
    off[-1] += 1
    return torch.nested.nested_tensor_from_jagged(vals, off).transpose(1, 2)


def _drop_head(t):
    if t.is_nested:
        vals = t.transpose(1, 2).values().detach()
        vals = torch.cat([vals, vals[:, :1]], 1)
        return torch.nested.nested_tensor_from_jagged(vals, t.offsets()).transpose(1, 2)
    return torch.cat([t.detach(), t.detach()[:, :1]], 1)


def _add_heads(t):
    vals = t.transpose(1, 2).values().detach()
    vals = torch.cat([vals, vals], 1)
    return torch.nested.nested_tensor_from_jagged(vals, t.offsets()).transpose(1, 2)


# ----------------------------------------------------------------------------------------------
# checking


class Failure(Exception):
    pass


def _maybe_invalid(case):
    """Options the contract may refuse with ValueError (the fix for them is open): a window entry
    that does not fit int64. (An empty batch, cu_seqlens = [0], is accepted: it stays valid.)"""
    return any(w >= 2**63 for w in case["window"])


def _close(name, got, ref, dtype, *, grad=False, lowp=None, fudge=2.0, may_nan=None, extra=None):
    """NaN where ref has NaN (and, optionally, where ``may_nan``); within tolerance elsewhere."""
    if got.shape != ref.shape:
        raise Failure(f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
    got = got.detach().double()
    ref = ref.detach().double()
    nan_got, nan_ref = torch.isnan(got), torch.isnan(ref)
    allowed = nan_ref if may_nan is None else nan_ref | may_nan
    if (nan_ref & ~nan_got).any() or (nan_got & ~allowed).any():
        extra = (nan_got & ~allowed).sum().item()
        missing = (nan_ref & ~nan_got).sum().item()
        where = ""
        idx = ((nan_got & ~allowed) | (nan_ref & ~nan_got)).nonzero()
        if len(idx):
            where = f" first at {tuple(idx[0].tolist())} (got {got[tuple(idx[0])].item():.4g}, " \
                    f"ref {ref[tuple(idx[0])].item():.4g})"
        raise Failure(f"{name}: NaN mismatch ({extra} unexpected NaN, {missing} NaN not propagated){where}")
    ok = ~nan_got
    atol, rtol = tolerance(dtype, grad=grad)
    if lowp is not None:
        lo = lowp.detach().double()
        both = ok & torch.isfinite(lo)
        if both.any():
            atol = max(atol, fudge * (lo[both] - ref[both]).abs().max().item())
    if torch.isinf(got[ok]).any() != torch.isinf(ref[ok]).any():
        raise Failure(f"{name}: inf mismatch")
    err = torch.where(ok, (got - ref).abs(), torch.zeros_like(got))
    bound = atol + rtol * ref.abs().nan_to_num(0.0)
    if extra is not None:
        bound = bound + extra.nan_to_num(0.0)
    bad = err > bound
    if bad.any():
        flat = int(torch.where(ok, err - bound, torch.full_like(err, -1.0)).flatten().argmax())
        pos = [int(x) for x in torch.unravel_index(torch.tensor(flat), err.shape)]
        raise Failure(f"{name}: {bad.sum().item()} of {bad.numel()} elements beyond atol={atol:.2e} rtol={rtol:.2e};"
                      f" worst at {tuple(pos)}: got {got[tuple(pos)].item():.6g}, expected {ref[tuple(pos)].item():.6g}")


def _check_lse(lse, ref_lse, hq, total_q, may_nan=None):
    if lse.dtype != torch.float32 or tuple(lse.shape) != (hq, total_q):
        raise Failure(f"lse: {lse.dtype} {tuple(lse.shape)}, expected float32 {(hq, total_q)}")
    ref = ref_lse.detach().double()
    got = lse.detach().double()
    nan_got, nan_ref = torch.isnan(got), torch.isnan(ref)
    if may_nan is not None:
        ref = torch.where(nan_got & may_nan, got, ref)   # allowed NaN: compare as equal
        nan_ref = torch.isnan(ref)
    if not torch.equal(nan_got, nan_ref):
        idx = (nan_got != nan_ref).nonzero()[0].tolist()
        raise Failure(f"lse: NaN mismatch at (head, row) {tuple(idx)}: got {got[tuple(idx)].item():.4g}, "
                      f"expected {ref[tuple(idx)].item():.4g}")
    ninf_ref = torch.isneginf(ref)
    if not torch.equal(torch.isneginf(got), ninf_ref):
        raise Failure(f"lse: -inf rows differ ({torch.isneginf(got).sum().item()} vs {ninf_ref.sum().item()})")
    fin = torch.isfinite(ref)
    if fin.any():
        err = (got[fin] - ref[fin]).abs().max().item()
        if not err <= 1e-4 * (1 + ref[fin].abs().max().item()):
            raise Failure(f"lse: max error {err:.3e}")


def _stored_output_grads(leaves64, ref, ref_lse, grad_out, out_lowp, err=None):
    """Float64 gradients of a backward that takes delta = rowsum(dO * O) from an output stored in the
    low dtype (FlashAttention-2's backward; see tests/backends/cpu/test_native_properties.py). ``err`` (Hq, total_q)
    replaces the error of delta."""
    if err is None:
        err = (grad_out.double() * (out_lowp.detach().double() - ref.detach())).sum(-1).T
    seen = torch.isfinite(ref_lse.detach())
    shift = (err * torch.where(seen, ref_lse, torch.zeros_like(ref_lse))).sum()
    leaves = [x for x in leaves64 if x is not None and x.requires_grad]
    if not shift.requires_grad:
        return {}
    moved = torch.autograd.grad(shift, leaves, retain_graph=True, allow_unused=True)
    exact = torch.autograd.grad(ref, leaves, grad_out.double(), retain_graph=True, allow_unused=True)
    return {id(leaf): (torch.zeros_like(leaf) if e is None else e) - (0 if mv is None else mv)
            for leaf, e, mv in zip(leaves, exact, moved)}


@contextlib.contextmanager
def _threads(n):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def run_case(case):
    """Execute and check one case. Returns ("ok" | "refused", detail); raises Failure.
    The checks run on one thread (two spin-waiting OpenMP threads on a busy machine make the
    reference's small ops ~100x slower); the library call uses the case's thread count."""
    with _threads(1):
        return _run_case(case)


def _run_case(case):
    b = build(case)
    dtype = b["dtype"]
    if case["entry"] == "append":
        _run_append(case, b)
    if case.get("meta"):
        return _run_meta(case, b)
    mutate = _mutation(case, b) if case["invalid"] else None
    torch.manual_seed(case["data_seed"])
    try:
        with backend_context(case["backend"]), _threads(case.get("threads", 1)):
            out, lse = call_library(case, b, mutate)
            if case["invalid"]:
                raise Failure(f"invalid input ({case['invalid']}) accepted")
            grads = _backward(case, b, out) if case["grad"] else None
    except Failure:
        raise
    except NoBackendError as exc:
        if case["invalid"]:
            raise Failure(f"invalid input ({case['invalid']}): NoBackendError instead of ValueError/TypeError")
        if case["backend"] in ("cpu_fused", "triton"):
            return "refused", str(exc).splitlines()[0]
        raise Failure(f"NoBackendError on a valid call: {_one_line(exc)}")
    except (ValueError, TypeError) as exc:
        if case["invalid"] or _maybe_invalid(case):
            return "refused", _one_line(exc)
        raise Failure(f"{type(exc).__name__} on a valid call: {_one_line(exc)}")
    except Exception as exc:  # noqa: BLE001 - any other exception is a bug
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        raise Failure(f"{type(exc).__name__}: {_one_line(exc)} [{os.path.basename(tb.filename)}:{tb.lineno}]")

    total_q, hq, dv = sum(case["q_lens"]), case["hq"], case["dv"]
    if out.dtype != dtype or tuple(out.shape) != (total_q, hq, dv):
        raise Failure(f"out: {out.dtype} {tuple(out.shape)}, expected {dtype} {(total_q, hq, dv)}")
    if case["dropout"] in ("stats", "one"):
        return _check_dropout(case, b, out)
    ref, ref_lse = reference(case, b)
    lowp_out = _naive_of(case, b)
    ref_cmp, may_nan = ref, None
    if case["nan"] is not None and case["nan"][0] in "kv":
        ref_cmp, may_nan = _nan_value_reference(case, b, ref)
    _close("out", out, ref_cmp, dtype, lowp=lowp_out, fudge=FUDGE[dtype], may_nan=may_nan,
           extra=logit_rounding_bound(case, b, ref))
    empty = torch.isneginf(ref_lse).T if b["sinks"] is None else _rows_without_keys(case, b)
    seen = out.detach()[empty]
    if empty.any() and not (seen[~torch.isnan(seen)] == 0).all():
        raise Failure("out: a row that sees no key is not exactly 0")
    if lse is not None:
        _check_lse(lse, ref_lse, hq, total_q, may_nan=None if may_nan is None or case["nan"][0] != "k"
                   else may_nan.any(-1).T)
    if case["grad"]:
        _check_grads(case, b, grads, *_gradient_reference(case, b, ref, ref_lse), out)
    return "ok", ""


def _rows_without_keys(case, b):
    """(total_q, Hq) bool: the rows that see no key (with sinks their lse is the sink, not -inf)."""
    rows = []
    cu_q = [int(x) for x in b["cu_q"]]
    prefix = b.get("prefix_lens")
    for s, lk in enumerate(_key_lens(case, b)):
        lq = cu_q[s + 1] - cu_q[s]
        keep = fast_keep_mask(lq, lk, causal=case["causal"], alignment=case["alignment"], window=case["window"],
                              chunk_size=case.get("chunk_size"), prefix=0 if prefix is None else int(prefix[s]))
        rows.append(~keep.any(-1))
    empty = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)
    return empty.unsqueeze(1).expand(-1, case["hq"])


def _gradient_reference(case, b, ref, ref_lse):
    """Differentiable float64 out/lse: naive_attention in float64 (vectorised: autograd through
    reference.py's per-row loops takes seconds), first checked equal to reference.py's forward."""
    leaves = [b[x].double().requires_grad_(True) for x in ("q", "k", "v")]
    slopes = None if b["slopes"] is None else b["slopes"].detach().double().requires_grad_(case["alibi_grad"])
    sinks = None if b["sinks"] is None else b["sinks"].detach().double().requires_grad_(case.get("sinks") == "grad")
    out64, lse64 = _naive_of(case, {**b, "q": leaves[0], "k": leaves[1], "v": leaves[2]}, slopes=slopes,
                             comp=torch.float64, with_lse=True, sinks=sinks)
    if out64.numel() and not torch.allclose(out64, ref, rtol=1e-9, atol=1e-9):
        raise RuntimeError(f"naive float64 forward differs from reference.py by {(out64 - ref).abs().max().item():.3g}")
    if lse64.numel() and not torch.allclose(lse64, ref_lse, rtol=1e-9, atol=1e-9):
        raise RuntimeError("naive float64 lse differs from reference.py")
    return out64, lse64, (*leaves, slopes, sinks)


def _run_meta(case, b):
    """The same call on meta tensors (what torch.compile's fake tensors look like): an output of the
    right shape and dtype on meta, or a clean ValueError/TypeError refusal."""
    meta = {**b}
    for name in ("q_leaf", "k_leaf", "v_leaf"):
        meta[name] = types.SimpleNamespace(arg=b[name].arg.detach().to("meta"))
    meta["k_arg"], meta["v_arg"] = meta["k_leaf"].arg, meta["v_leaf"].arg
    meta["cu_q"], meta["cu_k"] = b["cu_q"].to("meta"), b["cu_k"].to("meta")
    if b["slopes"] is not None:
        meta["slopes"] = b["slopes"].detach().to("meta")
    if "seqused" in b:
        meta["seqused"] = b["seqused"].to("meta")
    try:
        with backend_context(case["backend"]):
            out, lse = call_library(case, meta)
    except NoBackendError as exc:
        if case["backend"] in ("cpu_fused", "triton"):
            return "refused", "meta"
        raise Failure(f"meta tensors: NoBackendError: {_one_line(exc)}")
    except (ValueError, TypeError) as exc:
        return "refused", _one_line(exc)
    except Exception as exc:  # noqa: BLE001
        raise Failure(f"meta tensors: {type(exc).__name__}: {_one_line(exc)}")
    want = (sum(case["q_lens"]), case["hq"], case["dv"])
    if out.device.type != "meta" or tuple(out.shape) != want or out.dtype != b["dtype"]:
        raise Failure(f"meta tensors: out {out.device} {tuple(out.shape)} {out.dtype}, expected meta {want}")
    return "ok", ""


def _nan_value_reference(case, b, ref):
    """A NaN in v or k. Dense math lets it reach rows that mask the key too: v's NaN times their zero
    probabilities, and k's NaN score plus the additive -inf mask (PyTorch's math SDPA adds its
    boolean mask as -inf); a kernel that skips or masked_fills masked keys does not. Both are
    right. So NaN is required where a row *keeps* the key (v: the NaN's dim; k: the whole row),
    allowed anywhere else in that sequence's rows of the kv head's query heads, and a finite value
    there must be the reference without that key. Returns (reference to compare, allowed-NaN mask)."""
    which = case["nan"][0]
    bad = torch.isnan(b[which])
    if which == "k":
        bad = bad.any(-1, keepdim=True).expand(-1, -1, b["v"].shape[-1])
    # q = k = 0 and no ALiBi: uniform probabilities over exactly the keys each row keeps.
    probe = {**b, "q": torch.zeros_like(b["q"]), "k": torch.zeros_like(b["k"]), "v": bad.to(b["v"].dtype),
             "slopes": None}
    plain = {**case, "softcap": 0.0, "alibi": None}
    kept, _ = reference(plain, probe)
    near, _ = reference({**plain, "causal": False, "window": (-1, -1), "alignment": "top_left", "chunk_size": None},
                        {**probe, "prefix_lens": None})
    if which == "k":  # the reference masked_fills a masked key's NaN score: ref is already right
        return ref, (near > 0).any(-1, keepdim=True).expand_as(ref) & ~torch.isnan(ref)
    must = kept > 0
    clean = {**b, "v": b["v"].masked_fill(bad, 0.0)}
    ref_clean, _ = reference(case, clean)
    return torch.where(must, torch.full_like(ref_clean, math.nan), ref_clean), (near > 0) & ~must


def logit_rounding_bound(case, b, ref, c=2.0):
    """Per-element error of the output caused by rounding the scores in the compute dtype (float32,
    float64 for float64): each score s_ij = scale * q_i.k_j is off by up to ~u sqrt(D) scale |q_i||k_j|,
    which moves out_i by sum_j p_ij ds_ij (v_j - out_i). Negligible for ordinary logits; with logits
    ~1e3 it is what a correct float32 kernel may differ by (tail of near-tied keys)."""
    if _dropout_p(case) or ref.numel() == 0:
        return None
    u = 2.0 ** -53 if b["dtype"] == torch.float64 else 2.0 ** -24
    d = case["d"]
    scale = 1.0 / math.sqrt(d) if case["scale"] is None else case["scale"]
    q, k, v = b["q"].double().nan_to_num(0.0), b["k"].double().nan_to_num(0.0), b["v"].double().nan_to_num(0.0)
    # p from the naive path in float64 (the same masks); E = c u sqrt(D) scale sum_j p_ij |q_i||k_j||v_j - out_i|
    group = case["hq"] // case["hkv"]
    cu_q = [int(x) for x in b["cu_q"]]
    cu_k = [int(x) for x in (b["cu_k"] if case["entry"] != "paged" else cu_of(case["k_lens"]))]
    seqused = b.get("seqused") if case["entry"] == "varlen" and case["seqused"] else None
    out64 = naive_attention({**case}, q, k, v, cu_q, cu_k, seqused,
                            None if b["slopes"] is None else b["slopes"].detach().double())
    extra = torch.zeros_like(ref)
    for s in range(len(cu_q) - 1):
        lq, ks = cu_q[s + 1] - cu_q[s], cu_k[s]
        lk = (cu_k[s + 1] - ks) if seqused is None else int(seqused[s])
        if lq == 0 or lk == 0:
            continue
        qb = q[cu_q[s]:cu_q[s + 1]]
        kb = k[ks:ks + lk].repeat_interleave(group, 1)
        vb = v[ks:ks + lk].repeat_interleave(group, 1)
        ob = out64[cu_q[s]:cu_q[s + 1]]
        # probabilities: recompute with the same rule through naive_attention on one-hot values
        p = _probabilities(case, qb, kb, s, b, lq, lk)            # (H, lq, lk)
        w = p * (qb.norm(dim=-1).T.unsqueeze(-1) * kb.norm(dim=-1).T.unsqueeze(1))
        dev = (vb.permute(1, 0, 2).unsqueeze(1) - ob.permute(1, 0, 2).unsqueeze(2)).abs()  # (H, lq, lk, Dv)
        extra[cu_q[s]:cu_q[s + 1]] = torch.einsum("hqk,hqkd->qhd", w, dev)
    return extra * (c * u * math.sqrt(d) * abs(scale))


def grad_logit_bounds(case, b, ref, c=2.0):
    """Per-element error of dq, dk, dv when the backward recomputes the scores in float32 and takes
    P = exp(s - lse) unnormalised (FlashAttention-2): each score s_ij is off by up to
    E_ij = c u sqrt(D) scale |q_i||k_j|, and lse, the logsumexp of the same rounded scores, by the
    p-weighted mean of those errors, so p_ij is off by a factor (1 + e_ij) with
    |e_ij| <= sum_{k != j} p_ik (E_ij + E_ik) = (1 - p_ij) E_ij + sum_k p_ik E_ik - p_ij E_ij: zero
    in a row that sees one key, tiny at the top key of a one-hot row (where MATH is exact too). That
    needs the backward's scores bit for bit the forward's and an lse exact to its own scores
    (cpu_fused; it corrects the float32 lse's rounding where |lse| >= 256, so below that its
    e_ij also takes min(|lse_i|, 256) 2^-24). TRITON has neither: its backward's tl.dot runs other
    tile shapes (under the interpreter, S came out 10 ulps of |S| apart at D = 8, |S| ~ 5e3), and it
    keeps a float32 lse only, so its e_ij also takes E_ij (a second rounding of S) and |lse_i| 2^-24.
    Then
    |d dv_j| <= sum_i p_ij e_ij |dO_i|, and with dS = P (dP - delta),
    |d dq_i| <= scale sum_j p_ij e_ij |dP_ij - delta_i| |k_j| (dk alike)."""
    if b["dtype"] == torch.float64 or ref.numel() == 0:
        return {}
    u = 2.0 ** -24
    d = case["d"]
    scale = 1.0 / math.sqrt(d) if case["scale"] is None else case["scale"]
    factor = c * u * math.sqrt(d) * abs(scale)
    q, k, v, go = (t.double() for t in (b["q"], b["k"], b["v"], b["grad_out"]))
    group = case["hq"] // case["hkv"]
    cu_q = [int(x) for x in b["cu_q"]]
    cu_k = [int(x) for x in (b["cu_k"] if case["entry"] != "paged" else cu_of(case["k_lens"]))]
    seqused = b.get("seqused") if case["entry"] == "varlen" and case["seqused"] else None
    bq, bk, bv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s in range(len(cu_q) - 1):
        lq, ks = cu_q[s + 1] - cu_q[s], cu_k[s]
        lk = (cu_k[s + 1] - ks) if seqused is None else int(seqused[s])
        if lq == 0 or lk == 0:
            continue
        rows = slice(cu_q[s], cu_q[s + 1])
        qb, gob, ob = q[rows], go[rows], ref[rows]
        kb = k[ks:ks + lk].repeat_interleave(group, 1)
        vb = v[ks:ks + lk].repeat_interleave(group, 1)
        p = _probabilities(case, qb, kb, s, b, lq, lk)                                   # (H, lq, lk)
        big = factor * qb.norm(dim=-1).T.unsqueeze(-1) * kb.norm(dim=-1).T.unsqueeze(1)   # E (H, lq, lk)
        e = (1 - p) * big + (p * big).sum(-1, keepdim=True) - p * big
        lse_size = _row_lse(case, qb, kb, s, b).abs().nan_to_num(0.0, 0.0, 0.0).unsqueeze(-1)
        if case["backend"] == "triton":
            e = e + big + lse_size * u
        else:
            e = e + lse_size.clamp(max=CPU_LSE_EXACT) * u
        pe = p * e
        dp = torch.einsum("qhd,khd->hqk", gob, vb)
        delta = (gob * ob).sum(-1).T.unsqueeze(-1)                                        # (H, lq, 1)
        w = pe * (dp - delta).abs()
        bv_seq = torch.einsum("hqk,qhd->khd", pe, gob.abs())
        bk_seq = abs(scale) * torch.einsum("hqk,qhd->khd", w, qb.abs())
        bq[rows] = abs(scale) * torch.einsum("hqk,khd->qhd", w, kb.abs())
        hkv = case["hkv"]
        bv[ks:ks + lk] = bv_seq.reshape(lk, hkv, group, -1).sum(2)
        bk[ks:ks + lk] = bk_seq.reshape(lk, hkv, group, -1).sum(2)
    return {"q": bq, "k": bk, "v": bv}


def _no_key_lse(hq, rows, dtype, sink):
    """The lse of rows that see no key: -inf, or the sink (differentiably)."""
    if sink is None:
        return torch.full((hq, rows), -math.inf, dtype=dtype)
    return sink.view(hq, 1).expand(hq, rows)


def _softmax_rows(sc, keep, sink=None):
    """Probabilities (H, Lq, Lk) and lse (H, Lq) of masked scores, with ``sink`` (H,) one more logit
    in every row's denominator; rows that see no key: p 0 and lse -inf (the sink), with finite
    gradients everywhere."""
    lq = sc.shape[1]
    seen = keep.any(-1).view(1, lq, 1)
    sc = sc.masked_fill(~seen, 0.0)   # unseen rows: finite, dropped below
    if sink is None:
        p, lse = torch.softmax(sc, -1), torch.logsumexp(sc, -1)
    else:
        full = torch.cat([sc, sink.to(sc.dtype).view(-1, 1, 1).expand(sc.shape[0], lq, 1)], -1)
        p, lse = torch.softmax(full, -1)[..., :-1], torch.logsumexp(full, -1)
    empty = _no_key_lse(sc.shape[0], lq, sc.dtype, None if sink is None else sink.to(sc.dtype))
    return torch.where(seen, p, torch.zeros_like(p)), torch.where(seen.view(1, lq), lse, empty)


def _masked_scores(case, qb, kb, slopes_b, prefix=0):
    """Scores (Hq, Lq, Lk) in qb's dtype: scale, softcap, ALiBi (slopes_b (Hq,) or None), then the
    masked keys at -inf (causal, window, chunk_size; the sequence's ``prefix``); and the keep mask
    (Lq, Lk)."""
    lq, lk = qb.shape[0], kb.shape[0]
    scale = 1.0 / math.sqrt(case["d"]) if case["scale"] is None else case["scale"]
    sc = torch.einsum("qhd,khd->hqk", qb, kb) * scale
    if case["softcap"]:
        sc = case["softcap"] * torch.tanh(sc / case["softcap"])
    if slopes_b is not None:
        shift = lk - lq if case["alignment"] == "bottom_right" else 0
        dist = (torch.arange(lq).unsqueeze(1) + shift - torch.arange(lk).unsqueeze(0)).abs().to(qb.dtype)
        sc = sc - slopes_b.to(qb.dtype).view(-1, 1, 1) * dist
    keep = fast_keep_mask(lq, lk, causal=case["causal"], alignment=case["alignment"], window=case["window"],
                          chunk_size=case.get("chunk_size"), prefix=prefix)
    return sc.masked_fill(~keep, -math.inf), keep


def _row_softmax(case, qb, kb, s, b):
    """float64 probabilities (H, lq, lk) and lse (H, lq) of sequence s's rows (docs/api.md section 11 included)."""
    slopes = None if b["slopes"] is None else b["slopes"].detach().double()
    prefix = 0 if b.get("prefix_lens") is None else int(b["prefix_lens"][s])
    sc, keep = _masked_scores(case, qb, kb, None if slopes is None else (slopes if slopes.dim() == 1 else slopes[s]),
                              prefix)
    return _softmax_rows(sc, keep, None if b.get("sinks") is None else b["sinks"].detach().double())


def _row_lse(case, qb, kb, s, b):
    """float64 lse (H, lq) of one sequence's rows (-inf where a row sees no key, or the sink)."""
    return _row_softmax(case, qb, kb, s, b)[1]


def _probabilities(case, qb, kb, s, b, lq, lk):
    return _row_softmax(case, qb, kb, s, b)[0]


def _naive_of(case, b, slopes=None, comp=None, with_lse=False, sinks=None):
    seqused = b.get("seqused") if case["entry"] in ("varlen", "paged", "append") and \
        (case["seqused"] or case["entry"] != "varlen") else None
    cu_k = b["cu_k"] if case["entry"] != "paged" else cu_of(case["k_lens"])
    if case["entry"] in ("paged", "append"):
        seqused = None
    if sinks is None and b.get("sinks") is not None:
        sinks = b["sinks"].detach()
    return naive_attention(case, b["q"], b["k"], b["v"], b["cu_q"], cu_k, seqused,
                           b["slopes"].detach() if slopes is None and b["slopes"] is not None else slopes,
                           comp=comp, with_lse=with_lse, sinks=sinks,
                           prefix=None if b.get("prefix_lens") is None else b["prefix_lens"].tolist())


def _one_line(exc):
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:300]


def _backward(case, b, out):
    if not out.requires_grad:
        raise Failure("out does not require grad although inputs do (autograd lost)")
    out.backward(b["grad_out"])
    grads = {}
    if case["entry"] == "paged":
        grads["k_cache"], grads["v_cache"] = b["kc_leaf"].grad, b["vc_leaf"].grad
    else:
        grads["k"], grads["v"] = b["k_leaf"].base.grad, b["v_leaf"].base.grad
    grads["q"] = b["q_leaf"].base.grad
    if case["alibi_grad"]:
        grads["alibi"] = b["slopes"].grad
    if case.get("sinks") == "grad":
        grads["sinks"] = b["sinks"].grad
    return grads


def _check_grads(case, b, grads, ref, ref_lse, leaves64, out):
    dtype = b["dtype"]
    q64, k64, v64, s64, sinks64 = leaves64
    all64 = (q64, k64, v64, s64, sinks64)
    if not ref.requires_grad:
        ref = ref + 0 * q64.sum()  # no query row at all: every gradient is zero
    stored = {}
    if dtype != torch.float64:
        # delta = rowsum(dO * O) from the output as stored (FlashAttention-2's backward): the error
        # of the library's own (already checked) output moves dq/dk by exactly this much.
        stored = _stored_output_grads(list(all64), ref, ref_lse, b["grad_out"], out)
        # dS = P * (dP - delta) cancels: float32 rounding of the two dot products over Dv (~u sqrt(Dv)
        # |dO||O|) moves dq/dk like an error of delta, by up to scale * |k| times it.
        u = 2.0 ** -24 * 4 * math.sqrt(max(case["dv"], 1))
        mag = (b["grad_out"].double().abs() * ref.detach().abs()).sum(-1).T * u
        rounding = _stored_output_grads(list(all64), ref, ref_lse, b["grad_out"], out, err=mag)
        stored.update({("round", key): g for key, g in rounding.items()})
    want = torch.autograd.grad(ref, [x for x in all64 if x is not None and x.requires_grad],
                               b["grad_out"].double(), allow_unused=True, retain_graph=True)
    want = dict(zip([id(x) for x in all64 if x is not None and x.requires_grad], want))
    # Same math in float32 rounded to the dtype: gradients a correct low-precision backward may have.
    lq = b["q"].float().requires_grad_(True)
    lk = b["k"].float().requires_grad_(True)
    lv = b["v"].float().requires_grad_(True)
    ls = None if b["slopes"] is None else b["slopes"].detach().clone().requires_grad_(case["alibi_grad"])
    lsk = None if b["sinks"] is None else b["sinks"].detach().float().requires_grad_(case.get("sinks") == "grad")
    cast = (lambda t: t) if dtype == torch.float64 else (lambda t: t.to(dtype))
    lo_out = _naive_of(case, {**b, "q": cast(lq), "k": cast(lk), "v": cast(lv)}, slopes=ls, sinks=lsk)
    lo_leaves = [x for x in (lq, lk, lv, ls, lsk) if x is not None and x.requires_grad]
    if lo_out.requires_grad:
        lo = torch.autograd.grad(lo_out, lo_leaves, b["grad_out"].to(lo_out.dtype), allow_unused=True)
    else:
        lo = [None] * len(lo_leaves)
    lo = [None if g is None else cast(g) for g in lo]
    lo_names = ["q", "k", "v"] + ["alibi"] * bool(case["alibi_grad"]) + ["sinks"] * (case.get("sinks") == "grad")
    lo_of = dict(zip(lo_names, lo))
    bounds = grad_logit_bounds(case, b, ref.detach())

    def pick(name, leaf64):
        w = want.get(id(leaf64))
        w = torch.zeros_like(leaf64) if w is None else w
        cands = [t for t in (lo_of.get(name), stored.get(id(leaf64)), stored.get(("round", id(leaf64))))
                 if t is not None and t.numel()]
        widest = max(cands, key=lambda t: (t.double() - w).abs().nan_to_num(0).max().item(), default=None)
        return w, widest

    for name, leaf64 in (("q", q64), ("k", k64), ("v", v64)):
        w, widest = pick(name, leaf64)
        bound = bounds.get(name)
        if case["entry"] == "paged" and name != "q":
            got = grads[name + "_cache"]
            def embed(t):
                return _scatter_cache(b, name, t.double())
            label = f"d{name}_cache"
        else:
            leaf = b[name + "_leaf"]
            got = grads[name]
            def embed(t, leaf=leaf):
                return leaf.expected_grad(t.double())
            label = f"d{name}"
        if got is None:
            raise Failure(f"{label}: no gradient")
        if got.dtype != dtype:
            raise Failure(f"{label}: dtype {got.dtype}")
        _close(label, got, embed(w), dtype, grad=True, lowp=None if widest is None else embed(widest),
               fudge=FUDGE[dtype], extra=None if bound is None else embed(bound))
    if case["alibi_grad"]:
        g = grads.get("alibi")
        if g is None:
            raise Failure("dalibi: alibi_slopes requires grad but got no gradient")
        w, widest = pick("alibi", s64)
        # The slopes are float32 by contract, so their gradient is too, whatever the call's dtype.
        slope_dtype = torch.float32 if dtype == torch.float64 else dtype
        _close("dalibi", g, w, slope_dtype, grad=True, lowp=widest, fudge=FUDGE[slope_dtype])
    if case.get("sinks") == "grad":
        g = grads.get("sinks")
        if g is None:
            raise Failure("dsinks: sinks requires grad but got no gradient")
        if g.dtype != b["sinks"].dtype:
            raise Failure(f"dsinks: dtype {g.dtype}, expected the sinks' {b['sinks'].dtype}")
        w, widest = pick("sinks", sinks64)
        # computed in float32 (float64 for float64 sinks), however the call's dtype rounds the rest
        sink_dtype = max(dtype, b["sinks"].dtype, key=lambda t: torch.finfo(t).eps)
        _close("dsinks", g, w, sink_dtype, grad=True, lowp=widest, fudge=FUDGE[sink_dtype])


def _scatter_cache(b, name, packed_grad):
    """Gradient of a paged cache from the gradient of its packed keys (shared slots accumulate)."""
    cache = b["kc_leaf"] if name == "k" else b["vc_leaf"]
    g = torch.zeros(cache.shape, dtype=torch.float64)
    table, used = b["table"], b["seqused"].tolist()
    bs = cache.shape[1]
    slots = [int(table[s, i // bs]) * bs + i % bs for s, n in enumerate(used) for i in range(n)]
    if slots:
        g.view(-1, *g.shape[2:]).index_add_(0, torch.tensor(slots), packed_grad.double())
    return g


def _check_dropout(case, b, out):
    """dropout_p > 0: same seed -> same output; rows that see no key 0; no NaN; p=1 -> zeros.
    E[out] is the reference: checked loosely on the mean over rows (shape/statistics only)."""
    if case["dropout"] == "one":
        if not (out == 0).all():
            raise Failure("dropout_p=1.0: output not all zeros")
        return "ok", ""
    if torch.isnan(out).any():
        raise Failure("dropout: NaN in output")
    torch.manual_seed(case["data_seed"])
    with backend_context(case["backend"]), _threads(case.get("threads", 1)):   # as the first call ran
        again, _ = call_library(case, b)
    if not torch.equal(out.detach(), again.detach()):
        raise Failure("dropout: same torch.manual_seed gave a different output")
    return "ok", ""


def _run_append(case, b):
    """paged_append against a hand-written copy; a refused append must write nothing."""
    kc, vc = b["kc0"].clone(), b["vc0"].clone()
    k_new, v_new = b["k_new"], b["v_new"]
    if case["layout"] != "contiguous" and k_new.numel():
        k_new = Leaf(k_new, case["layout"]).arg
        v_new = Leaf(v_new, case["layout"]).arg
    table, used_old, cu_new = b["table"], b["seqused_old"], b["cu_new"]
    inv = case["invalid"]
    if inv == "append_overflow":
        # one token too many for every row (a row with nothing to append: seqused_k past capacity)
        capacity = table.shape[1] * case["block_size"]
        used_old = torch.tensor([capacity + 1 - n for n in case["q_lens"]], dtype=torch.int32)
    elif inv == "cu_int64":
        cu_new = cu_new.long()
    elif inv == "table_int64":
        table = table.long()
    elif inv == "dtype_mismatch":
        k_new = k_new.to(torch.float64 if b["dtype"] != torch.float64 else torch.float32)
    elif inv == "block_id_range":
        table = table + 10**6
    try:
        new_used = jagged_sdpa.paged_append(kc, vc, table, used_old, k_new, v_new, cu_new)
    except (ValueError, TypeError) as exc:
        if not inv:
            raise Failure(f"paged_append refused a valid append: {type(exc).__name__}: {_one_line(exc)}")
        if not (_nan_equal(kc, b["kc0"]) and _nan_equal(vc, b["vc0"])):
            raise Failure("paged_append raised but wrote into the cache")
        case["invalid"] = None  # the attention call after it is valid
        b["k_arg"], b["v_arg"] = b["kc0"], b["vc0"]
        _expected_cache(case, b)
        b["k_arg"], b["v_arg"] = b["kc_exp"], b["vc_exp"]
        return
    except Exception as exc:  # noqa: BLE001
        raise Failure(f"paged_append: {type(exc).__name__}: {_one_line(exc)}")
    if inv:
        raise Failure(f"paged_append accepted invalid input ({inv})")
    if new_used.dtype != torch.int32 or new_used.tolist() != b["append_total"]:
        raise Failure(f"paged_append returned {new_used.tolist()} ({new_used.dtype}), expected {b['append_total']}")
    _expected_cache(case, b)
    if not (_nan_equal(kc, b["kc_exp"]) and _nan_equal(vc, b["vc_exp"])):
        raise Failure("paged_append: cache contents differ from the expected copy")
    b["k_arg"], b["v_arg"] = kc, vc


def _expected_cache(case, b):
    kc, vc = b["kc0"].clone(), b["vc0"].clone()
    bs = case["block_size"]
    row = 0
    for s, (o, n) in enumerate(zip(b["seqused_old"].tolist(), case["q_lens"])):
        pos = torch.arange(o, o + n)
        blk, off = b["table"][s].long()[pos // bs], pos % bs
        kc[blk, off] = b["k_new"][row:row + n]
        vc[blk, off] = b["v_new"][row:row + n]
        row += n
    b["kc_exp"], b["vc_exp"] = kc, vc


def _nan_equal(a, c):
    return a.shape == c.shape and torch.equal(torch.isnan(a), torch.isnan(c)) and \
        torch.equal(a.nan_to_num(0.0), c.nan_to_num(0.0))


# ----------------------------------------------------------------------------------------------
# known open bugs: one entry per class, (case, message) -> bool. Delete an entry once its fix
# lands; tests/safety/test_fuzz.py toggles them one by one. Every class found so far is fixed and
# its entry deleted: it fails as a new bug again.


KNOWN: dict = {}


def classify(case, message):
    """The KNOWN class names a failure matches (empty: a new bug)."""
    return [name for name, pred in KNOWN.items() if pred(case, message)]


# ----------------------------------------------------------------------------------------------
# driver


def repro(case, backend_arg=None, entry_arg=None, mode_arg=None):
    line = f"PYTHONPATH=. python tests/support/fuzz.py --seed {case['seed']} --case {case['index']}"
    if mode_arg and mode_arg != "default":
        line += f" --mode {mode_arg}"
    if backend_arg:
        line += f" --backend {backend_arg}"
    if entry_arg:
        line += f" --entry {entry_arg}"
    return line


def _has_options(case):
    return bool(case.get("sinks") or case.get("chunk_size") is not None or case.get("prefix"))


class Stats:
    def __init__(self, out=None):
        self.rows = defaultdict(lambda: defaultdict(int))
        self.failures = []   # (case, message, known classes)
        self.out = out       # --verbose: a DONE line per case (what --chunk's parent counts)

    def add(self, case, status):
        if self.out is not None:
            print(f"DONE {case['index']} {case['backend']} {case['entry']} {int(bool(case['grad']))} {status} "
                  f"{int(case.get('scores') == 'large')} {int(_has_options(case))} {case.get('fp8', ['-'])[0]}",
                  file=self.out, flush=True)
        keys = [case["backend"], f"{case['backend']}/{case['entry']}"]
        if case.get("scores") == "large":   # the large-logit mode, counted apart too
            keys += ["large", f"large/{case['backend']}"]
        if _has_options(case):              # docs/api.md section 11's options, counted apart too
            keys += ["options", f"options/{case['backend']}"]
        if case.get("fp8"):                 # fp8 caches (docs/api.md section 13), counted apart too
            keys += [case["fp8"][0], f"{case['fp8'][0]}/{case['backend']}"]
        for key in keys:
            r = self.rows[key]
            r["calls"] += 1
            r["backward"] += bool(case["grad"]) and status != "refused"
            r["paged"] += case["entry"] in ("paged", "append") and status != "refused"
            r[status] += 1

    def summary(self):
        cols = ["calls", "backward", "paged", "ok", "refused", "fail", "known"]
        lines = [f"{'backend/entry':<24}" + "".join(f"{c:>9}" for c in cols)]
        for key in sorted(self.rows, key=lambda k: (k.split("/")[0], "/" in k, k)):
            r = self.rows[key]
            lines.append(f"{key:<24}" + "".join(f"{r[c]:>9}" for c in cols))
        new = [f for f in self.failures if not f[2]]
        by_class = defaultdict(int)
        for _, _, known in self.failures:
            by_class[known[0] if known else "NEW"] += 1
        lines.append("failures by class: " + (", ".join(f"{k}={v}" for k, v in sorted(by_class.items())) or "none"))
        lines.append(f"new (unclassified) failures: {len(new)}")
        return "\n".join(lines)


def fuzz(seed, calls, *, start=0, backend=None, entry=None, verbose=False, out=sys.stdout, known=None,
         time_budget=None, mode=None):
    """Run cases start..start+calls-1; returns Stats. ``known``: the KNOWN names to classify as known."""
    known = set(KNOWN) if known is None else set(known)
    stats = Stats(out if verbose else None)
    t0 = time.time()
    for index in range(start, start + calls):
        if time_budget is not None and time.time() - t0 > time_budget:
            break
        case = make_case(seed, index, backend, entry, mode)
        if verbose:
            print(f"START {index} {json.dumps(case)}", file=out, flush=True)
        if os.environ.get("JAGGED_SDPA_FUZZ_SELFTEST_CRASH") == str(index):  # tests --chunk's crash report
            os.kill(os.getpid(), 11)
        try:
            status, detail = run_case(case)
            stats.add(case, status)
        except Failure as exc:
            message = str(exc)
        except Exception as exc:  # noqa: BLE001 - a bug of the fuzzer itself: report it and go on
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            message = f"HARNESS {type(exc).__name__}: {_one_line(exc)} [{os.path.basename(tb.filename)}:{tb.lineno}]"
        else:
            continue
        classes = [c for c in classify(case, message) if c in known]
        stats.add(case, "known" if classes else "fail")
        stats.failures.append((case, message, classes))
        tag = f"KNOWN[{classes[0]}]" if classes else "FAIL"
        print(f"{tag} {repro(case, backend, entry, mode)}  # {case['backend']}/{case['entry']} {case['dtype']}: "
              f"{message}", file=out, flush=True)
    return stats


def _run_chunked(args):
    """Children of ``--chunk`` cases each (``--verbose``: a START line before and a DONE line after
    every case). A child that dies (a segfault: exit -11) or hangs is a crash of the case it had
    started; the next child resumes after it."""
    stats = Stats()
    classes = defaultdict(int)
    index, end = args.start, args.start + args.calls
    while index < end:
        n = min(args.chunk, end - index)
        cmd = [sys.executable, os.path.abspath(__file__), "--seed", str(args.seed), "--start", str(index),
               "--calls", str(n), "--verbose"]
        cmd += ["--backend", args.backend] if args.backend else []
        cmd += ["--entry", args.entry] if args.entry else []
        cmd += ["--mode", args.mode] if args.mode else []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60 + 30 * n)
            stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            decode = (lambda x: x.decode() if isinstance(x, bytes) else (x or ""))
            stdout, stderr, code = decode(exc.stdout), decode(exc.stderr) + "\ntimeout", "timeout"
        last = None
        for line in stdout.splitlines():
            if line.startswith("START "):
                last = int(line.split()[1])
            elif line.startswith("DONE "):
                _, _, backend, entry, grad, status, large, options, fp8 = line.split()
                stats.add({"backend": backend, "entry": entry, "grad": grad == "1",
                           "scores": "large" if large == "1" else "normal", "prefix": options == "1",
                           "fp8": None if fp8 == "-" else (fp8,)}, status)
            elif line.startswith(("KNOWN[", "FAIL ")):
                classes[line[6:line.index("]")] if line.startswith("KNOWN[") else "NEW"] += 1
                print(line, flush=True)
        if code != 0:
            crashed = last if last is not None else index
            case = make_case(args.seed, crashed, args.backend, args.entry, args.mode)
            known = classify(case, "CRASH")
            classes[f"CRASH:{known[0]}" if known else "CRASH"] += 1
            stats.add(case, "known" if known else "fail")
            tail = [line for line in stderr.strip().splitlines() if "is_fx_tracing" not in line][-1:] or [""]
            print(f"CRASH (exit {code}){f' KNOWN[{known[0]}]' if known else ''} {repro(case, args.backend, args.entry, args.mode)}"
                  f"  # {case['backend']}/{case['entry']} {case['dtype']}: {tail[0][:200]}", flush=True)
            index = crashed + 1
        else:
            index += n
    print(stats.summary().rsplit("\nfailures by class", 1)[0])
    print("failures by class: " + (", ".join(f"{k}={v}" for k, v in sorted(classes.items())) or "none"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=int(os.environ.get("JAGGED_SDPA_FUZZ_CALLS", "200")))
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--case", type=int, default=None, help="rebuild, print and run one case")
    parser.add_argument("--backend", choices=BACKENDS, default=None)
    parser.add_argument("--entry", choices=ENTRIES, default=None)
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="large: every case has large logits (default: a share LARGE_SHARE of them); "
                             "options: every case draws docs/api.md section 11's sinks/chunk_size/prefix_lens (default: a share "
                             "OPTIONS_SHARE)")
    parser.add_argument("--verbose", action="store_true", help="print each case before running it")
    parser.add_argument("--chunk", type=int, default=0, help="run chunks of this many cases in child processes")
    args = parser.parse_args(argv)
    if args.case is not None:
        case = make_case(args.seed, args.case, args.backend, args.entry, args.mode)
        print(json.dumps(case, indent=1), flush=True)
        try:
            status, detail = run_case(case)
            print(f"{status} {detail}")
        except Failure as exc:
            print(f"FAIL: {exc}  known: {classify(case, str(exc)) or 'no'}")
            return 1
        return 0
    if args.chunk:
        _run_chunked(args)
        return 0
    t0 = time.time()
    stats = fuzz(args.seed, args.calls, start=args.start, backend=args.backend, entry=args.entry,
                 verbose=args.verbose, mode=args.mode)
    print(stats.summary())
    print(f"{args.calls} cases in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
