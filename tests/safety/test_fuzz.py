"""The differential fuzzer (``tests/support/fuzz.py``) in CI: a fixed seed and call budget (400 calls, ~20 s of CPU here),
and 60 calls of its large-logit mode (~10 s).

Every failure prints a one-line repro (``PYTHONPATH=. python tests/support/fuzz.py --seed S --case I``).
Long hunts: ``JAGGED_SDPA_FUZZ_CALLS=20000 pytest tests/safety/test_fuzz.py`` or the command line
(``python tests/support/fuzz.py --calls 20000 --seed N [--backend X] [--chunk 500] [--mode large]``).

``KNOWN_OPEN`` lists the bug classes of ``fuzz.KNOWN`` still being fixed: a failure matching one
of them is reported, not failed. Delete a name when its fix lands; the run then fails on it again.
"""

from __future__ import annotations

import os

import pytest
import torch

from support import fuzz

SEED = 20261124
CALLS = int(os.environ.get("JAGGED_SDPA_FUZZ_CALLS", "400"))
LARGE_CALLS = int(os.environ.get("JAGGED_SDPA_FUZZ_LARGE_CALLS", "60"))

# One toggle per open bug class (see fuzz.KNOWN for each predicate and its bug).
KNOWN_OPEN: set = set()


def test_known_toggles_name_known_classes():
    assert KNOWN_OPEN <= set(fuzz.KNOWN), KNOWN_OPEN - set(fuzz.KNOWN)


def test_fixed_seed_run_has_no_new_failures(capsys):
    stats = fuzz.fuzz(SEED, CALLS, known=KNOWN_OPEN)
    with capsys.disabled():
        print("\n" + stats.summary())
    new = [f"{fuzz.repro(case)}  # {case['backend']}/{case['entry']} {case['dtype']}: {message}"
           for case, message, classes in stats.failures if not classes]
    assert not new, "fuzz failures:\n" + "\n".join(new)
    calls = stats.rows
    for backend in ("auto", "math", "cpu_fused", "no_kernel"):
        assert calls[backend]["calls"] > 0, f"no call drew backend {backend}"


def test_large_logit_mode_has_no_new_failures(capsys):
    """The large-logit mode: every call with logits of 1e2-1e4, one-key rows, large softcaps."""
    stats = fuzz.fuzz(SEED + 1, LARGE_CALLS, known=KNOWN_OPEN, mode="large")
    with capsys.disabled():
        print("\n" + stats.summary())
    new = [f"{fuzz.repro(case, mode_arg='large')}  # {case['backend']}/{case['entry']} {case['dtype']}: {message}"
           for case, message, classes in stats.failures if not classes]
    assert not new, "fuzz failures:\n" + "\n".join(new)
    assert stats.rows["large"]["calls"] == LARGE_CALLS and stats.rows["large"]["backward"] > 0


def test_large_logit_mode_draws_what_it_says(monkeypatch):
    """Scores ~1e2-1e4 (in the scale or in q), rows with exactly one visible key, large softcaps,
    no float64; the default mode mixes such cases in without redrawing the others."""
    cases = [fuzz.make_case(3, i, mode="large") for i in range(300)]
    assert all(c["scores"] == "large" and c["dtype"] != "float64" for c in cases)
    assert all(100 <= c["logit_size"] <= 1e4 for c in cases)
    assert max(c["logit_size"] for c in cases) > 5e3
    one_key = [c for c in cases if c["window"] == (0, 0) or set(c["k_lens"]) == {1}]
    assert len(one_key) > 150
    caps = [c["softcap"] / c["logit_size"] for c in cases if c["softcap"]]
    assert len(caps) > 60 and all(0.05 <= x <= 2.0 for x in caps)
    assert {c["dtype"] for c in cases} == {"float32", "float16", "bfloat16"}
    assert sum(c["grad"] for c in cases) > 120 and sum(c["q_gain"] > 1 for c in cases) > 100
    b = fuzz.build(next(c for c in cases if c["q_gain"] > 50 and c["q_lens"] and sum(c["q_lens"])))
    assert b["q"].double().abs().max() > 50
    mixed = [fuzz.make_case(3, i) for i in range(300)]
    assert 20 < sum(c["scores"] == "large" for c in mixed) < 90
    monkeypatch.setattr(fuzz, "LARGE_SHARE", 0.0)
    plain = [fuzz.make_case(3, i) for i in range(300)]
    kept = ("backend", "entry", "q_lens", "hq", "hkv", "d", "dv", "causal", "layout", "data_seed", "threads")
    for m, p in zip(mixed, plain):   # a converted case keeps the rest of its draw; the others are equal
        assert all(m[x] == p[x] for x in kept) and (m == p or m["scores"] == "large")


def test_large_logit_mode_catches_a_one_hot_gradient_error(monkeypatch):
    """The checker is tight where the softmax is one-hot: dv off by 5e-4 relative (what the
    compiled kernel's backward gave at |S| ~ 240 before the fix) fails a one-key case."""
    case = next(c for c in (fuzz.make_case(9, i, backend="math", entry="varlen", mode="large") for i in range(500))
                if c["grad"] and set(c["k_lens"]) == {1} and c["dtype"] == "float32" and c["invalid"] is None
                and sum(c["q_lens"]) >= 4 and not c["seqused"] and not c["alibi_grad"])
    assert fuzz.run_case(dict(case))[0] == "ok"
    real = fuzz.jagged_sdpa.varlen_attention

    class Skewed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * (1 + 5e-4)

    def skewed(q, k, v, *args, **kwargs):
        return real(q, k, Skewed.apply(v), *args, **kwargs)

    monkeypatch.setattr(fuzz.jagged_sdpa, "varlen_attention", skewed)
    with pytest.raises(fuzz.Failure, match="dv"):
        fuzz.run_case(dict(case))


def test_cases_are_rebuilt_from_seed_and_index():
    assert fuzz.make_case(7, 3) == fuzz.make_case(7, 3)
    assert fuzz.make_case(7, 3) != fuzz.make_case(7, 4)
    b1, b2 = fuzz.build(fuzz.make_case(7, 3)), fuzz.build(fuzz.make_case(7, 3))
    assert torch.equal(b1["q"], b2["q"]) and torch.equal(b1["grad_out"], b2["grad_out"])


def test_fast_keep_mask_is_the_reference_rule():
    from support import reference
    for lq in (0, 1, 3, 7):
        for lk in (0, 1, 4, 9):
            for causal in (False, True):
                for alignment in ("top_left", "bottom_right"):
                    for window in ((-1, -1), (0, 0), (2, -1), (-1, 1), (3, 5), (2**63 - 1, 2**70)):
                        opts = {"causal": causal, "alignment": alignment, "window": window}
                        assert torch.equal(fuzz.fast_keep_mask(lq, lk, **opts), reference.keep_mask(lq, lk, **opts))


def _find_case(**want):
    for index in range(2000):
        case = fuzz.make_case(5, index, backend="math", entry="varlen")
        if all(case[k] == v for k, v in want.items()) and sum(case["q_lens"]) and sum(case["k_lens"]):
            return case
    raise AssertionError("no such case drawn")


def test_checker_catches_a_wrong_number(monkeypatch):
    """The checker is not vacuous: a 1e-3 relative error in out, a NaN in one element, a missing
    gradient are each a Failure."""
    case = _find_case(dtype="float32", invalid=None, dropout=None, nan=None, grad=True, window=(-1, -1),
                      scores="normal")
    assert fuzz.run_case(dict(case))[0] == "ok"
    real = fuzz.jagged_sdpa.varlen_attention

    def perturbed(*args, **kwargs):
        res = real(*args, **kwargs)
        out = res[0] if isinstance(res, tuple) else res
        out = out * (1 + 1e-3)
        return (out, res[1]) if isinstance(res, tuple) else out

    monkeypatch.setattr(fuzz.jagged_sdpa, "varlen_attention", perturbed)
    with pytest.raises(fuzz.Failure, match="out"):
        fuzz.run_case(dict(case))

    def poisoned(*args, **kwargs):
        res = real(*args, **kwargs)
        out = res[0] if isinstance(res, tuple) else res
        out = out.clone()
        out.view(-1)[0] = float("nan")
        return (out, res[1]) if isinstance(res, tuple) else out

    monkeypatch.setattr(fuzz.jagged_sdpa, "varlen_attention", poisoned)
    with pytest.raises(fuzz.Failure, match="NaN"):
        fuzz.run_case(dict(case))

    def detached(*args, **kwargs):
        res = real(*args, **kwargs)
        return tuple(r.detach() for r in res) if isinstance(res, tuple) else res.detach()

    monkeypatch.setattr(fuzz.jagged_sdpa, "varlen_attention", detached)
    with pytest.raises(fuzz.Failure, match="autograd lost"):
        fuzz.run_case(dict(case))


@pytest.mark.parametrize("seed, index", [(6001, 13787), (6001, 19583), (5001, 1978), (4001, 3286)])
def test_paged_backward_with_huge_logits_runs_in_the_compiled_kernel(seed, index):
    """Cases of the long runs where the torch-op backward of a paged call was off at large logits
    (softmax_scale 45-200): paged calls that need a gradient now run the compiled kernel on both
    passes (reading the cache in place), and match float64."""
    case = fuzz.make_case(seed, index, backend="auto")
    assert case["entry"] == "paged" and case["grad"] and case["scores"] == "huge"
    assert fuzz.run_case(case)[0] == "ok"


def test_options_mode_draws_every_option_and_keeps_the_other_draws(monkeypatch):
    """docs/api.md section 11 in the fuzzer: --mode options gives every case of the entries that take them at
    least one of sinks (some with a gradient), chunk_size and prefix_lens; the default mode draws
    them for a share of the cases without changing anything else those cases draw."""
    cases = [fuzz.make_case(4, i, mode="options") for i in range(300)]
    takes = [c for c in cases if c["entry"] in fuzz.OPTION_ENTRIES and not c["meta"]]
    assert takes and all(fuzz._has_options(c) for c in takes)
    assert not any(fuzz._has_options(c) for c in cases if c not in takes)
    assert sum(c["sinks"] == "grad" for c in takes) > 10 and sum(c["chunk_size"] is not None for c in takes) > 50
    assert sum(c["prefix"] for c in takes) > 50
    new_invalid = {"sinks_shape", "sinks_int", "chunk_zero", "chunk_float", "prefix_over", "prefix_int64",
                   "prefix_negative"}
    assert len({c["invalid"] for c in takes} & new_invalid) >= 4
    mixed = [fuzz.make_case(4, i) for i in range(300)]
    assert 30 < sum(map(fuzz._has_options, mixed)) < 150
    monkeypatch.setattr(fuzz, "OPTIONS_SHARE", 0.0)
    plain = [fuzz.make_case(4, i) for i in range(300)]
    drawn = ("sinks", "sinks_dtype", "sinks_size", "chunk_size", "prefix", "invalid")
    for m, p in zip(mixed, plain):
        assert {k: v for k, v in m.items() if k not in drawn} == {k: v for k, v in p.items() if k not in drawn}


def test_fast_masks_are_the_reference_rule_with_chunks_and_prefixes():
    from support import reference
    for lq in (0, 1, 3, 7):
        for lk in (0, 1, 4, 9):
            for alignment in ("top_left", "bottom_right"):
                for chunk, prefix in ((None, 0), (1, 0), (3, 0), (2, 3), (None, 4), (5, 9)):
                    opts = {"causal": True, "alignment": alignment, "window": (2, -1)}
                    want = reference.chunk_prefix_mask(reference.keep_mask(lq, lk, **opts), lq, lk, alignment=alignment,
                                                       chunk_size=chunk, prefix=prefix)
                    assert torch.equal(fuzz.fast_keep_mask(lq, lk, **opts, chunk_size=chunk, prefix=prefix), want)


def _option_case(option):
    for index in range(3000):
        case = fuzz.make_case(8, index, backend="math", entry="varlen", mode="options")
        if case["invalid"] is None and case["dtype"] == "float32" and case["nan"] is None and not case["dropout"] \
                and sum(case["q_lens"]) >= 3 and sum(case["k_lens"]) >= 3 and option(case):
            b = fuzz.build(case)
            if fuzz.run_case(dict(case))[0] == "ok" and (b["prefix_lens"] is None or b["prefix_lens"].sum() > 0):
                return case
    raise AssertionError("no such case drawn")


@pytest.mark.parametrize("name, option", [
    ("sinks", lambda c: c["sinks"] == "grad" and c["grad"]),
    ("chunk_size", lambda c: c["chunk_size"] in (1, 2) and not c["sinks"] and not c["prefix"]),
    ("prefix_lens", lambda c: c["prefix"] and c["causal"] and c["chunk_size"] is None
     and not c["sinks"]),
])
def test_checker_catches_an_ignored_option(monkeypatch, name, option):
    """The options are checked, not merely passed: a library that ignored one of them (or lost the
    sinks' gradient) fails the case."""
    case = _option_case(option)
    real = fuzz.jagged_sdpa.varlen_attention

    def ignoring(*args, **kwargs):
        kwargs.pop(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(fuzz.jagged_sdpa, "varlen_attention", ignoring)
    with pytest.raises(fuzz.Failure):
        fuzz.run_case(dict(case))
    if name == "sinks":
        def detached_sinks(*args, **kwargs):
            return real(*args, **{**kwargs, "sinks": kwargs["sinks"].detach()})

        monkeypatch.setattr(fuzz.jagged_sdpa, "varlen_attention", detached_sinks)
        with pytest.raises(fuzz.Failure, match="dsinks"):
            fuzz.run_case(dict(case))
