"""Every rejected input: the exact exception type, and a message naming the argument.

Each case also proves no kernel ran: backends' forward is replaced by one that fails the test.
"""

from __future__ import annotations

import pytest
import torch

import jagged_sdpa
from jagged_sdpa.backends import IMPLS
from support.cases import cu_of, njt


@pytest.fixture(autouse=True)
def no_kernel_runs(monkeypatch):
    def forbidden(call):
        raise AssertionError("a kernel ran for a rejected input")

    for impl in IMPLS.values():
        monkeypatch.setattr(impl, "forward", classmethod(lambda cls, call: forbidden(call)))


def varlen_args(**changes):
    args = dict(
        q=torch.randn(8, 4, 16), k=torch.randn(10, 2, 16), v=torch.randn(10, 2, 12),
        cu_seqlens_q=cu_of([3, 5]), cu_seqlens_k=cu_of([4, 6]),
    )
    args.update(changes)
    return args


def paged_args(**changes):
    args = dict(
        q=torch.randn(3, 4, 16), k=torch.randn(6, 4, 2, 16), v=torch.randn(6, 4, 2, 16),
        cu_seqlens_q=cu_of([1, 2]), cu_seqlens_k=None, block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        seqused_k=torch.tensor([5, 8], dtype=torch.int32),
    )
    args.update(changes)
    return args


VARLEN_CASES = {
    "q-not-tensor": (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    "q-nested": (dict(q=njt([2, 3], 4, 16).transpose(1, 2)), TypeError, "q must be a dense packed tensor"),
    "q-int-dtype": (dict(q=torch.ones(8, 4, 16, dtype=torch.int64)), TypeError, "q must be float64"),
    "k-dtype-mismatch": (dict(k=torch.randn(10, 2, 16, dtype=torch.float64)), TypeError, "k dtype"),
    "v-dtype-mismatch": (dict(v=torch.randn(10, 2, 12, dtype=torch.float16)), TypeError, "v dtype"),
    "q-2d": (dict(q=torch.randn(8, 64)), ValueError, "q must be 3-D"),
    "k-2d": (dict(k=torch.randn(10, 32)), ValueError, "k must be 3-D"),
    "kv-heads-differ": (dict(v=torch.randn(10, 1, 12)), ValueError, "k and v must agree"),
    "kv-length-differs": (dict(v=torch.randn(9, 2, 12)), ValueError, "k and v must agree"),
    "heads-not-multiple": (dict(k=torch.randn(10, 3, 16), v=torch.randn(10, 3, 12)), ValueError, "multiple of key/value heads"),
    "head-dim-mismatch": (dict(k=torch.randn(10, 2, 8)), ValueError, "q head dim 16 does not match k head dim 8"),
    "zero-head-dim": (dict(q=torch.randn(8, 4, 0), k=torch.randn(10, 2, 0)), ValueError, "head dims must be >= 1"),
    "k-on-other-device": (dict(k=torch.randn(10, 2, 16, device="meta")), ValueError, "k is on meta"),
    "cu-q-int64": (dict(cu_seqlens_q=torch.tensor([0, 3, 8])), TypeError, "cu_seqlens_q must be int32"),
    "cu-k-float": (dict(cu_seqlens_k=torch.tensor([0.0, 4.0, 10.0])), TypeError, "cu_seqlens_k must be int32"),
    "cu-q-not-tensor": (dict(cu_seqlens_q=[0, 3, 8]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    "cu-q-2d": (dict(cu_seqlens_q=torch.zeros(2, 3, dtype=torch.int32)), ValueError, "cu_seqlens_q must be 1-D"),
    "cu-k-wrong-length": (dict(cu_seqlens_k=cu_of([4, 3, 3])), ValueError, "cu_seqlens_k must have 3 entries"),
    "cu-k-missing": (dict(cu_seqlens_k=None), ValueError, "pass cu_seqlens_k for packed keys"),
    "cu-q-not-from-0": (dict(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32)), ValueError, "cu_seqlens_q must start at 0"),
    "cu-q-decreasing": (dict(cu_seqlens_q=torch.tensor([0, 9, 8], dtype=torch.int32)), ValueError, "cu_seqlens_q must be non-decreasing"),
    "cu-k-short-end": (dict(cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32)), ValueError, "cu_seqlens_k must end at the packed length 10"),
    "cu-k-past-end": (dict(cu_seqlens_k=torch.tensor([0, 4, 11], dtype=torch.int32)), ValueError, "cu_seqlens_k must end"),
    # q or k given as (H, T, D), an F.scaled_dot_product_attention layout: named as a layout mistake
    "q-heads-first": (dict(q=torch.randn(4, 8, 16)), ValueError, "cu_seqlens_q must end at the packed length 4, got 8; "
                      "but q has shape (4, 8, 16), whose dim 1 is 8: q looks like (heads, tokens, head_dim)"),
    "k-heads-first": (dict(k=torch.randn(2, 10, 16), v=torch.randn(2, 10, 12)), ValueError,
                      "cu_seqlens_k must end at the packed length 2, got 10; but k has shape (2, 10, 16)"),
    "cu-k-on-other-device": (dict(cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")), ValueError, "cu_seqlens_k is on meta"),
    "max-q-too-small": (dict(max_seqlen_q=4), ValueError, "max_seqlen_q is 4, smaller than the longest sequence in cu_seqlens_q"),
    "max-k-too-small": (dict(max_seqlen_k=5), ValueError, "max_seqlen_k is 5, smaller than the longest sequence in cu_seqlens_k"),
    "max-q-float": (dict(max_seqlen_q=5.0), TypeError, "max_seqlen_q must be a Python int"),
    "max-k-negative": (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
    "max-q-tensor": (dict(max_seqlen_q=torch.tensor(5)), TypeError, "max_seqlen_q"),
    "window-3-items": (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a (left, right) pair"),
    "window-below-minus-1": (dict(window_size=(-2, 0)), ValueError, "window_size entries must be >= 0"),
    "window-floats": (dict(window_size=(1.5, 0)), TypeError, "window_size must hold ints"),
    "softcap-negative": (dict(softcap=-1.0), ValueError, "softcap must be finite"),
    "softcap-inf": (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
    "softcap-string": (dict(softcap="big"), TypeError, "softcap must be a float"),
    "dropout-too-big": (dict(dropout_p=1.5), ValueError, "dropout_p must be in [0, 1]"),
    "dropout-negative": (dict(dropout_p=-0.1), ValueError, "dropout_p must be in [0, 1]"),
    "dropout-not-number": (dict(dropout_p=None), TypeError, "dropout_p must be a float"),
    "scale-nan": (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    "scale-string": (dict(softmax_scale="x"), TypeError, "softmax_scale must be a float"),
    "alibi-float64": (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes must be float32"),
    "alibi-shape": (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape (4,) or (2, 4)"),
    "alibi-not-tensor": (dict(alibi_slopes=[1.0] * 4), TypeError, "alibi_slopes must be a torch.Tensor"),
    "causal-not-bool": (dict(causal="yes"), TypeError, "causal must be a bool"),
    "return-lse-not-bool": (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    "backend-unknown": (dict(backend="cudnn"), ValueError, "backend 'cudnn' is not a Backend"),
    "backend-wrong-type": (dict(backend=3), TypeError, "backend must be a jagged_sdpa.Backend"),
    "seqused-int64": (dict(seqused_k=torch.tensor([1, 2])), TypeError, "seqused_k must be int32"),
    "seqused-too-long": (dict(seqused_k=torch.tensor([5, 2], dtype=torch.int32)), ValueError, "seqused_k[0] = 5 exceeds"),
    "seqused-negative": (dict(seqused_k=torch.tensor([-1, 2], dtype=torch.int32)), ValueError, "seqused_k[0] must be >= 0"),
    "seqused-wrong-length": (dict(seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError, "seqused_k must have 2 entries"),
}

PAGED_CASES = {
    "block-table-int64": (dict(block_table=torch.tensor([[0, 1], [2, 3]])), TypeError, "block_table must be int32"),
    "block-table-1d": (dict(block_table=torch.tensor([0, 1], dtype=torch.int32)), ValueError, "block_table must have shape (2, max_blocks_per_seq)"),
    "block-id-out-of-range": (dict(block_table=torch.tensor([[0, 1], [2, 6]], dtype=torch.int32)), ValueError, "block_table[1, 1] = 6 is out of range"),
    "block-id-negative": (dict(block_table=torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32)), ValueError, "block_table[0, 0] = -1"),
    "seqused-past-capacity": (dict(seqused_k=torch.tensor([5, 9], dtype=torch.int32)), ValueError, "seqused_k[1] = 9 exceeds"),
    "seqused-missing": (dict(seqused_k=None), ValueError, "seqused_k is required with block_table"),
    "seqused-int64": (dict(seqused_k=torch.tensor([5, 8])), TypeError, "seqused_k must be int32"),
    "cu-k-with-block-table": (dict(cu_seqlens_k=cu_of([5, 8])), ValueError, "cu_seqlens_k must be None when block_table"),
    "cache-3d": (dict(k=torch.randn(24, 2, 16), v=torch.randn(24, 2, 16)), ValueError, "k must be 4-D (num_blocks, block_size, Hkv, D)"),
    "block-table-other-device": (dict(block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="meta")), ValueError, "block_table is on meta"),
    "max-k-too-small": (dict(max_seqlen_k=4), ValueError, "max_seqlen_k is 4"),
}


@pytest.mark.parametrize("case", VARLEN_CASES, ids=list(VARLEN_CASES))
def test_varlen_rejects(case):
    changes, exc, text = VARLEN_CASES[case]
    with pytest.raises(exc, match=_literal(text)):
        jagged_sdpa.varlen_attention(**varlen_args(**changes))
    with pytest.raises(exc, match=_literal(text)):
        jagged_sdpa.explain(**varlen_args(**changes))


@pytest.mark.parametrize("case", PAGED_CASES, ids=list(PAGED_CASES))
def test_paged_rejects(case):
    changes, exc, text = PAGED_CASES[case]
    with pytest.raises(exc, match=_literal(text)):
        jagged_sdpa.varlen_attention(**paged_args(**changes))


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def sdpa_args(**changes):
    args = dict(query=njt([3, 5], 4, 16), key=njt([3, 5], 4, 16), value=njt([3, 5], 4, 12))
    args.update(changes)
    return args


def _strided_nested():
    return torch.nested.nested_tensor([torch.randn(4, 3, 16), torch.randn(4, 5, 16)])


SDPA_CASES = {
    "query-dense": (lambda: dict(query=torch.randn(2, 4, 5, 16)), TypeError, "query must be a nested tensor with layout=torch.jagged, got a dense tensor"),
    "query-strided-nested": (lambda: dict(query=_strided_nested()), TypeError, "query must be a nested tensor with layout=torch.jagged, got a strided"),
    "query-bjhd-form": (lambda: dict(query=njt([3, 5], 4, 16).transpose(1, 2)), ValueError, "query must have the (B, H, j, D) form"),
    "query-not-tensor": (lambda: dict(query="q"), TypeError, "query must be a torch.Tensor"),
    "key-njt-value-dense": (lambda: dict(value=torch.randn(2, 4, 5, 12)), TypeError, "key and value must both be jagged NJTs or both dense"),
    "key-dtype": (lambda: dict(key=njt([3, 5], 4, 16, torch.float64)), TypeError, "key dtype"),
    "batch-mismatch": (lambda: dict(key=njt([3, 5, 2], 4, 16), value=njt([3, 5, 2], 4, 12)), ValueError, "key batch size 3 does not match query's 2"),
    "gqa-without-flag": (lambda: dict(key=njt([3, 5], 2, 16), value=njt([3, 5], 2, 12)), ValueError, "pass enable_gqa=True"),
    "gqa-not-multiple": (lambda: dict(key=njt([3, 5], 3, 16), value=njt([3, 5], 3, 12), enable_gqa=True), ValueError, "must be a multiple of key/value heads"),
    "enable-gqa-not-bool": (lambda: dict(enable_gqa="yes"), TypeError, "enable_gqa must be a bool"),
    "head-dim-mismatch": (lambda: dict(key=njt([3, 5], 4, 8)), ValueError, "query head dim 16 does not match key head dim 8"),
    "key-value-heads": (lambda: dict(value=njt([3, 5], 2, 12)), ValueError, "key has 4 heads but value has 2"),
    "kv-ragged-mismatch": (lambda: dict(value=njt([4, 4], 4, 12)), ValueError, "key and value must have the same ragged structure"),
    "attn-mask": (lambda: dict(attn_mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, "attn_mask must be None"),
    "causal-alignment": (lambda: dict(causal_alignment="bottom-right"), ValueError, "causal_alignment must be 'top_left' or 'bottom_right'"),
    "softcap-zero": (lambda: dict(softcap=0.0), ValueError, "softcap must be finite and > 0, or None"),
    "alibi-shape": (lambda: dict(alibi_slopes=torch.ones(2, 3)), ValueError, "alibi_slopes must have shape (4,) or (2, 4)"),
    "alibi-other-device": (lambda: dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, "alibi_slopes is on meta"),
    "is-causal-not-bool": (lambda: dict(is_causal=None), TypeError, "is_causal must be a bool"),
    "scale-inf": (lambda: dict(scale=float("inf")), ValueError, "scale must be finite"),
    "dense-key-3d": (lambda: dict(key=torch.randn(2, 4, 16), value=torch.randn(2, 4, 12)), ValueError, "dense key must be 4-D"),
    "dense-kv-length-differs": (lambda: dict(key=torch.randn(2, 4, 6, 16), value=torch.randn(2, 4, 7, 12)), ValueError, "dense key and value must have the same length S"),
    "window-bad": (lambda: dict(window_size=(3,)), TypeError, "window_size"),
    "dropout-bad": (lambda: dict(dropout_p=2.0), ValueError, "dropout_p"),
    "backend-unknown": (lambda: dict(backend="fast"), ValueError, "backend 'fast' is not a Backend"),
}


@pytest.mark.parametrize("case", SDPA_CASES, ids=list(SDPA_CASES))
def test_sdpa_rejects(case):
    make, exc, text = SDPA_CASES[case]
    with pytest.raises(exc, match=_literal(text)):
        jagged_sdpa.sdpa(**sdpa_args(**make()))
    with pytest.raises(exc, match=_literal(text)):
        jagged_sdpa.explain(**sdpa_args(**make()))


def test_attn_mask_message_names_alternatives():
    with pytest.raises(ValueError) as info:
        jagged_sdpa.sdpa(**sdpa_args(attn_mask=torch.ones(1)))
    for name in ("is_causal", "window_size", "alibi_slopes", "softcap"):
        assert name in str(info.value)


def test_holey_njt_outside_values_rejected():
    values = torch.randn(6, 4, 16)
    bad = torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, 3, 6]),
                                                 lengths=torch.tensor([3, 5])).transpose(1, 2)
    with pytest.raises(ValueError, match="query has a hole-y sequence 1"):
        jagged_sdpa.sdpa(bad, bad, bad)


def test_heads_first_layout_is_named_in_plan_run_and_not_for_plain_length_errors():
    """Issue 33 item 7 (a): a (H, T, D) tensor is named as a layout mistake by ``plan.run`` too
    (with the fix to apply); a cu_seqlens that is simply wrong keeps the plain message."""
    cu = cu_of([3, 5])
    plan = jagged_sdpa.plan(cu, cu)
    with pytest.raises(ValueError, match=_literal("q looks like (heads, tokens, head_dim)")) as info:
        plan.run(torch.randn(4, 8, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16))
    assert "pass q.transpose(0, 1)" in str(info.value)
    with pytest.raises(ValueError) as info:
        jagged_sdpa.varlen_attention(**varlen_args(q=torch.randn(9, 4, 16)))
    assert str(info.value) == "cu_seqlens_q must end at the packed length 9, got 8"


def test_explain_has_a_signature_help_shows():
    """Issue 33 item 7 (b): ``help(jagged_sdpa.explain)`` shows the arguments of both call forms,
    not ``(*args, **kwargs)``; the signature follows ``sdpa``'s and ``varlen_attention``'s."""
    import inspect
    import pydoc

    params = inspect.signature(jagged_sdpa.explain).parameters
    for fn in (jagged_sdpa.sdpa, jagged_sdpa.varlen_attention):
        for name in list(inspect.signature(fn).parameters)[3:]:
            assert name in params, name
    assert list(params)[:4] == ["q", "k", "v", "args"]
    text = pydoc.render_doc(jagged_sdpa.explain)
    assert "explain(query, key, value, attn_mask=None" in text
    assert "explain(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None" in text
    assert "cu_seqlens_q=None" in text and "is_causal=False" in text


def test_docstrings_name_the_backends_and_only_files_in_the_repository():
    """Issue 33 item 7 (c): varlen_attention's docstring names every backend a user can force;
    the public docstrings cite docs/api.md sections, no other file."""
    import re

    doc = jagged_sdpa.varlen_attention.__doc__
    for backend in jagged_sdpa.Backend:
        assert f'"{backend.value}"' in doc, backend
    for fn in (jagged_sdpa.varlen_attention, jagged_sdpa.sdpa, jagged_sdpa.plan, jagged_sdpa.explain,
               jagged_sdpa.Plan, jagged_sdpa.Plan.run, jagged_sdpa.Plan.update, jagged_sdpa.Plan.explain):
        files = set(re.findall(r"[\w./~-]+\.(?:md|py|cpp|txt|html)\b", fn.__doc__)) - {"docs/api.md"}
        assert not files and "http" not in fn.__doc__, (fn, files)


def test_the_first_njt_call_prints_no_is_fx_tracing_note():
    """Issue 33 item 7: the first ``sdpa`` call in a process printed torch's "is_fx_tracing will
    return true ..." log line (our one-time check of the direct NJT path, and outputs that need a
    gradient, call ``nested_tensor_from_jagged``, which asks ``is_fx_tracing()``). A fresh process,
    without pytest's warning filters; a user's own ``nested_tensor_from_jagged`` still gets torch's line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch, jagged_sdpa\n"
        "seqs = [torch.randn(n, 2, 16) for n in (3, 5)]\n"
        "q = torch.nested.nested_tensor(seqs, layout=torch.jagged).transpose(1, 2)\n"
        "jagged_sdpa.sdpa(q, q, q, is_causal=True)\n"
        "g = torch.nested.nested_tensor(seqs, layout=torch.jagged, requires_grad=True).transpose(1, 2)\n"
        "jagged_sdpa.sdpa(g, g, g).values().sum().backward()\n"
        "print('OUR CALLS DONE', file=sys.stderr, flush=True)\n"
        "torch.nested.nested_tensor_from_jagged(torch.randn(5, 3), offsets=torch.tensor([0, 2, 5]))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    ours, marker, users = done.stderr.partition("OUR CALLS DONE")
    assert marker and "is_fx_tracing" not in ours, ours
    import torch.fx._symbolic_trace as fx_trace

    if hasattr(fx_trace, "is_fx_tracing_warning"):  # torch's own note is left to the user's own call
        assert "is_fx_tracing" in users, users
