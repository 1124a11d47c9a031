"""torch.compile and the torch.library operators (docs/api.md section 7).

- ``torch.library.opcheck`` on every operator: schema, fake implementation against the real one,
  autograd registration, AOT dispatch with dynamic shapes.
- ``torch.compile(fullgraph=True)`` of ``varlen_attention`` (packed, seqused_k, paged) and ``sdpa``
  (NJTs with a cached max seqlen) for every option, forward and backward, equal to eager and to the
  float64 reference; ``torch._dynamo.explain`` finds 0 graph breaks; new batch sizes compile at
  most once more (dynamic shapes); a call without max lengths is a plain ValueError, with or without
  fullgraph; bad cu_seqlens are
  still refused by name when the operator runs; ``paged_append`` mutates the cache in a graph.
Compiles use the ``aot_eager`` backend (the same graphs, without Inductor's codegen time); one test
runs Inductor end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from support.cases import alibi_slopes, cu_of, packed, paged_case
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed

import jagged_sdpa
from jagged_sdpa import ops, spec as specs
from support.described_call import prepare_varlen


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(3, 0)),
    "softcap": dict(softcap=4.0),
    "alibi": dict(alibi_slopes="per_head", causal=True),
    "alibi_batch": dict(alibi_slopes="per_batch_head"),
    "lse": dict(return_lse=True, causal=True),
    "scale": dict(softmax_scale=0.3, window_size=(-1, 2)),
}
LENGTHS_Q, LENGTHS_K = [5, 9, 0, 3], [7, 9, 2, 4]


def _call(options, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, grad=True, gen_seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    q = packed(lengths_q, 4, 16, requires_grad=grad, gen=gen)
    k = packed(lengths_k, 2, 16, requires_grad=grad, gen=gen)
    v = packed(lengths_k, 2, 16, requires_grad=grad, gen=gen)
    kw = dict(options)
    if isinstance(kw.get("alibi_slopes"), str):
        kw["alibi_slopes"] = alibi_slopes(kw["alibi_slopes"], len(lengths_q), 4, generator=gen)
    return (q, k, v, cu_of(lengths_q), cu_of(lengths_k), max(lengths_q), max(lengths_k)), kw


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    return jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def _grads(out, inputs):
    out = out[0] if isinstance(out, tuple) else out
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return torch.autograd.grad((out * weights).sum(), inputs)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_varlen_fullgraph_equals_eager_and_reference(name):
    args, kw = _call(OPTIONS[name])
    compiled = torch.compile(_varlen, fullgraph=True, backend="aot_eager")
    got = compiled(*args, **kw)
    want = _varlen(*args, **kw)
    q, k, v, cu_q, cu_k = args[:5]
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    out, lse = got if isinstance(got, tuple) else (got, None)
    torch.testing.assert_close(out, want[0] if isinstance(want, tuple) else want, rtol=0, atol=0)
    ref, ref_lse = attention_reference(q, k, v, cu_q, cu_k, causal=bool(kw.get("causal")), alignment="bottom_right",
                                       window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                                       alibi_slopes=kw.get("alibi_slopes"), scale=kw.get("softmax_scale"))
    assert_close_packed(out, ref, cu_seqlens=cu_q)
    if lse is not None:
        assert_close_lse(lse, ref_lse)


def test_varlen_has_no_graph_break():
    """The traced forward is one graph; AOT autograd derives the backward graph from the
    registered backward (a break there would fail fullgraph compilation, tested above)."""
    args, kw = _call(OPTIONS["alibi"])

    def loss(q, k, v, cu_q, cu_k, max_q, max_k):
        return _varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw).square().sum()

    explained = torch._dynamo.explain(loss)(*args)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_new_batch_sizes_compile_at_most_once_more():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_varlen, fullgraph=True, backend=counter)
    for i, lengths in enumerate(([5, 7], [3, 4, 9], [2, 6, 6, 8], [9, 2, 3, 4, 5], [4] * 7)):
        args, kw = _call({"causal": True}, lengths, lengths, gen_seed=i)
        args = args[:5] + (9, 9)
        out = compiled(*args, **kw)
        torch.testing.assert_close(out, _varlen(*args, **kw), rtol=0, atol=0)
        _grads(out, args[:3])
    assert counter.frame_count <= 2, counter.frame_count  # the first shapes, then one dynamic graph


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])
def test_compile_without_max_lengths_is_a_value_error(fullgraph):
    """Raised by the operator when it runs: the user's ValueError itself, and no graph break."""
    args, kw = _call({})
    q, k, v, cu_q, cu_k = args[:5]
    fn = lambda q, k, v, a, b: jagged_sdpa.varlen_attention(q, k, v, a, b, max_seqlen_k=9)  # noqa: E731
    torch._dynamo.utils.counters.clear()
    with pytest.raises(ValueError, match="pass max_seqlen_q \\(ints\\)"):
        torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")(q, k, v, cu_q, cu_k)
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])
def test_compile_njt_without_cached_max_seqlen_is_a_value_error(fullgraph):
    values = torch.randn(12, 2, 8)
    offsets = torch.tensor([0, 5, 12])
    fn = lambda values, offsets: jagged_sdpa.sdpa(  # noqa: E731
        *[torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)] * 3)
    with pytest.raises(ValueError, match="pass query's cached max seqlen and key's cached max seqlen"):
        torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")(values, offsets)


def test_bad_cu_seqlens_are_refused_by_name_when_the_operator_runs():
    args, kw = _call({})
    compiled = torch.compile(_varlen, fullgraph=True, backend="aot_eager")
    compiled(*args)
    bad = args[3].clone()
    bad[2] = bad[1] - 1  # decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        compiled(args[0], args[1], args[2], bad, *args[4:])
    with pytest.raises(ValueError, match="max_seqlen_k is 3, smaller than the longest sequence in cu_seqlens_k"):
        compiled(*args[:6], 3)


def test_seqused_k_and_paged_compile_without_breaks():
    gen = torch.Generator().manual_seed(3)
    lengths_q, used = [2, 1, 3], [9, 5, 13]
    k_cache, v_cache, table, seqused, k_packed, v_packed = paged_case(lengths_q, used, 4, 2, 16,
                                                                      shared_first_block=True)
    q = packed(lengths_q, 4, 16, gen=gen)
    cu_q = cu_of(lengths_q)

    def paged(q, k_cache, v_cache, cu_q, table, seqused):
        return jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_q, None, 3, 13, causal=True, block_table=table,
                                            seqused_k=seqused)

    compiled = torch.compile(paged, fullgraph=True, backend="aot_eager")
    out = compiled(q, k_cache, v_cache, cu_q, table, seqused)
    torch.testing.assert_close(out, paged(q, k_cache, v_cache, cu_q, table, seqused), rtol=0, atol=0)
    ref, _ = attention_reference(q, k_packed, v_packed, cu_q, cu_of(used), causal=True, alignment="bottom_right")
    assert_close_packed(out, ref, cu_seqlens=cu_q)
    assert torch._dynamo.explain(paged)(q, k_cache, v_cache, cu_q, table, seqused).graph_break_count == 0


def test_paged_append_mutates_the_cache_inside_a_graph():
    k_cache = torch.zeros(6, 4, 2, 8)
    v_cache = torch.zeros(6, 4, 2, 8)
    table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    seqused = torch.tensor([2, 4], dtype=torch.int32)
    k_new, v_new = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cu_new = torch.tensor([0, 2, 3], dtype=torch.int32)

    def append(k_cache, v_cache, table, seqused, k_new, v_new, cu_new):
        return jagged_sdpa.paged_append(k_cache, v_cache, table, seqused, k_new, v_new, cu_new)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = append(eager_k, eager_v, table, seqused, k_new, v_new, cu_new)
    got = torch.compile(append, fullgraph=True, backend="aot_eager")(k_cache, v_cache, table, seqused, k_new, v_new,
                                                                     cu_new)
    assert got.tolist() == want.tolist() == [4, 5]
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
    assert torch.equal(k_cache[3, 2], k_new[0]) and torch.equal(k_cache[1, 0], k_new[2]) is False
    assert torch.equal(k_cache[5, 0], k_new[2])


def _njt_batch(lengths, grad=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, 4, 16, generator=gen) for n in lengths]
    return torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=grad)


def _njt_attention(x):
    xt = x.transpose(1, 2)
    return jagged_sdpa.sdpa(xt, xt, xt, is_causal=True, softcap=6.0).transpose(1, 2)


def test_sdpa_on_njts_fullgraph_equals_eager_with_dynamic_batches():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_njt_attention, fullgraph=True, backend=counter)
    for i, lengths in enumerate(([5, 7], [3, 4, 9], [2, 2, 3, 8])):  # min length >= 2: torch specialises 0/1
        x = _njt_batch(lengths, seed=i)
        got = compiled(x)
        want = _njt_attention(x)
        torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=0)
        (g,) = torch.autograd.grad(got.values().square().sum(), x)
        (w,) = torch.autograd.grad(want.values().square().sum(), x)
        torch.testing.assert_close(g.values(), w.values(), rtol=0, atol=0)
    assert counter.frame_count <= 2, counter.frame_count
    assert torch._dynamo.explain(_njt_attention)(_njt_batch([3, 5])).graph_break_count == 0
    # A batch the compiled function has seen: its nested int is Dynamo's to wrap again.
    assert torch._dynamo.explain(_njt_attention)(x).graph_break_count == 0


def test_inductor_end_to_end():
    args, kw = _call(OPTIONS["window"])
    compiled = torch.compile(_varlen, fullgraph=True)
    got = compiled(*args, **kw)
    want = _varlen(*args, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(_grads(got, args[:3]), _grads(want, args[:3])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# opcheck: the operators themselves


def _op_args(options, backend, grad=True):
    args, kw = _call(options, grad=grad)
    keep = ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "return_lse")
    call, _, _ = prepare_varlen(*args, **{name: kw[name] for name in keep if name in kw})
    return (call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k, call.block_table,
            call.alibi_slopes, call.dropout_key, backend, specs.options_of(call.spec), call.spec.max_seqlen_q,
            call.spec.max_seqlen_k)


@pytest.mark.parametrize("backend", ["cpu_fused", "math"])
@pytest.mark.parametrize("name", ["causal", "alibi", "softcap"])
def test_opcheck_attention(backend, name):
    args = _op_args(OPTIONS[name], backend)
    torch.library.opcheck(torch.ops.jagged_sdpa.attention.default, args)


def test_opcheck_attention_backward():
    args = _op_args(OPTIONS["causal"], "cpu_fused")
    out, lse, state = torch.ops.jagged_sdpa.attention(*args)
    grad_out = torch.randn_like(out)
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(torch.ops.jagged_sdpa.attention_backward.default,
                          (grad_out, *detached[:3], out.detach(), lse, state, *detached[3:]))


def test_opcheck_paged_append():
    k_cache, v_cache = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    args = (k_cache, v_cache, table, torch.tensor([1, 0], dtype=torch.int32), torch.randn(3, 2, 8),
            torch.randn(3, 2, 8), torch.tensor([0, 1, 3], dtype=torch.int32))
    torch.library.opcheck(torch.ops.jagged_sdpa.paged_append.default, args)
