"""Which way an eager call reaches its backend (``ops.run``).

An eager call that nothing can observe (plain tensors, no dispatch or function mode, no profiler)
runs the operator's implementations directly, without the dispatcher's round trip and
``register_autograd``'s wrapper; every other call goes through ``jagged_sdpa::attention``. Both
ways must give the same bits, forward and backward, and every observer must see the operator.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.cases import alibi_slopes, cu_of, packed, paged_case
from support.reference import attention_reference
from support.tolerances import assert_close_packed

import jagged_sdpa
from jagged_sdpa import ops

LENGTHS_Q, LENGTHS_K = [5, 9, 0, 3], [7, 9, 2, 4]


class _SeenOps(TorchDispatchMode):
    """Records every operator dispatched while active and runs it unchanged."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def operator_runs(monkeypatch):
    """Counts calls that went through the registered operator (its implementation rebuilds or
    takes over the call in ``_call_of``; the direct path never calls it)."""
    count = {"n": 0}
    real = ops._call_of

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "_call_of", counting)
    return count


def _inputs(grad: bool, options: str):
    gen = torch.Generator().manual_seed(3)
    q = packed(LENGTHS_Q, 4, 16, requires_grad=grad, gen=gen)
    k = packed(LENGTHS_K, 2, 16, requires_grad=grad, gen=gen)
    v = packed(LENGTHS_K, 2, 16, requires_grad=grad, gen=gen)
    kw = dict(causal=True)
    if options == "alibi":
        kw["alibi_slopes"] = alibi_slopes("per_head", 4, 4, generator=gen).requires_grad_(grad)
    if options == "dropout":
        kw["dropout_p"] = 0.3
    return (q, k, v, cu_of(LENGTHS_Q), cu_of(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K)), kw


def _run(args, kw, grad: bool, seed: int = 11):
    torch.manual_seed(seed)  # the dropout key is drawn from the default generator
    out = jagged_sdpa.varlen_attention(*args, **kw)
    if not grad:
        return (out,)
    leaves = [t for t in (*args[:3], kw.get("alibi_slopes")) if t is not None]
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return (out, *torch.autograd.grad((out * weights).sum(), leaves))


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("options", ["causal", "alibi", "dropout"])
def test_direct_and_operator_paths_give_the_same_bits(grad, options, operator_runs):
    args, kw = _inputs(grad, options)
    direct = _run(args, kw, grad)
    assert operator_runs["n"] == 0
    with _SeenOps() as mode:
        through_op = _run(args, kw, grad)
    assert "jagged_sdpa.attention.default" in mode.seen
    assert operator_runs["n"] == (2 if grad else 1)  # forward, and the backward operator
    for a, b in zip(direct, through_op, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if options != "dropout":  # the direct path against the float64 reference
        q, k, v, cu_q, cu_k, _, _ = args
        ref_out, _ = attention_reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right",
                                         alibi_slopes=kw.get("alibi_slopes"))
        assert_close_packed(direct[0], ref_out, cu_seqlens=cu_q)


def test_paged_backward_direct_equals_operator(operator_runs):
    q = packed([3, 1], 2, 8, requires_grad=True, gen=torch.Generator().manual_seed(0))
    k_cache, v_cache, table, used, _, _ = paged_case([3, 1], [9, 5], 4, 2, 8, shared_first_block=True)
    k_cache.requires_grad_(True)
    v_cache.requires_grad_(True)

    def run():
        out = jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_of([3, 1]), None, 3, 9, causal=True,
                                           block_table=table, seqused_k=used)
        return (out, *torch.autograd.grad(out.square().sum(), (q, k_cache, v_cache)))

    direct = run()
    with _SeenOps():
        through_op = run()
    assert operator_runs["n"] == 2
    for a, b in zip(direct, through_op, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_profiler_sees_the_operators():
    args, kw = _inputs(True, "causal")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = jagged_sdpa.varlen_attention(*args, **kw)
        out.sum().backward()
    names = {event.name for event in prof.events()}
    assert {"jagged_sdpa::attention", "jagged_sdpa::attention_backward"} <= names


def test_sdpa_on_njts_takes_the_direct_path_and_matches_the_operator(operator_runs):
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(n, 2, 8, generator=gen) for n in (3, 6, 1)]
    q = torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)
    direct = jagged_sdpa.sdpa(q, q, q, is_causal=True)
    assert operator_runs["n"] == 0
    with _SeenOps():
        through_op = jagged_sdpa.sdpa(q, q, q, is_causal=True)
    assert operator_runs["n"] == 1
    torch.testing.assert_close(direct.values(), through_op.values(), rtol=0, atol=0)


def _torch_convention(lengths_q, lengths_k, hq, hkv, d, dv):
    """FLOPs of each sequence as one dense attention call, by torch's own formulas."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    fwd = bwd = 0
    for lq, lk in zip(lengths_q, lengths_k):
        shapes_q, shapes_k, shapes_v = (1, hq, lq, d), (1, hkv, lk, d), (1, hkv, lk, dv)
        fwd += sdpa_flop_count(shapes_q, shapes_k, shapes_v)
        bwd += sdpa_backward_flop_count((1, hq, lq, dv), shapes_q, shapes_k, shapes_v)
    return fwd, bwd


def test_flop_counter_counts_each_sequence_by_torchs_convention():
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(1)
    q = packed(LENGTHS_Q, 4, 16, requires_grad=True, gen=gen)
    k = packed(LENGTHS_K, 2, 16, requires_grad=True, gen=gen)
    v = packed(LENGTHS_K, 2, 8, requires_grad=True, gen=gen)
    with FlopCounterMode(display=False) as counter:
        out = jagged_sdpa.varlen_attention(q, k, v, cu_of(LENGTHS_Q), cu_of(LENGTHS_K), 9, 9, causal=True)
        out.sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    fwd, bwd = _torch_convention(LENGTHS_Q, LENGTHS_K, 4, 2, 16, 8)
    assert counts == {"jagged_sdpa.attention": fwd, "jagged_sdpa.attention_backward": bwd}


def test_flop_counter_reads_seqused_k_of_a_paged_cache():
    from torch.utils.flop_counter import FlopCounterMode

    q = packed([3, 1], 2, 8, gen=torch.Generator().manual_seed(0))
    k_cache, v_cache, table, used, _, _ = paged_case([3, 1], [9, 5], 4, 2, 8)
    with FlopCounterMode(display=False) as counter:
        jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_of([3, 1]), None, 3, 9, block_table=table,
                                     seqused_k=used)
    assert counter.get_total_flops() == _torch_convention([3, 1], [9, 5], 2, 2, 8, 8)[0]


def test_flop_count_without_readable_offsets_is_an_upper_bound():
    """While tracing (fake or meta offsets) every query is counted against max_seqlen_k keys."""
    q = torch.empty(17, 4, 16, device="meta")
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    assert ops._pairs(q, cu, cu, None, 9) == 17 * 9
    exact = ops._pairs(torch.empty(17, 4, 16), cu_of(LENGTHS_Q), cu_of(LENGTHS_K), None, 9)
    assert exact == sum(a * b for a, b in zip(LENGTHS_Q, LENGTHS_K)) < 17 * 9


def test_operator_calls_of_one_batch_reuse_the_first_layers_runner(operator_runs):
    """A compiled model's layers call the operator over one batch: the first call of a kind builds
    the call and its runner (kept on the batch), the others swap in their own q, k, v and sinks;
    each layer's numbers equal the direct path's, and the batch keeps no layer's tensors alive."""
    import gc
    import weakref

    gen = torch.Generator().manual_seed(4)
    cu_q, cu_k = cu_of(LENGTHS_Q), cu_of(LENGTHS_K)
    layers = [(packed(LENGTHS_Q, 4, 16, gen=gen), packed(LENGTHS_K, 2, 16, gen=gen), packed(LENGTHS_K, 2, 16, gen=gen),
               torch.randn(4, generator=gen)) for _ in range(3)]
    direct = [jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 9, 9, causal=True, sinks=s) for q, k, v, s in layers]
    calls_before = operator_runs["n"]
    with _SeenOps():
        through_op = [jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 9, 9, causal=True, sinks=s)
                      for q, k, v, s in layers]
    assert operator_runs["n"] == calls_before + 1  # one call built, two runs of its runner
    for a, b in zip(direct, through_op, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    first_k = weakref.ref(layers[0][1])
    del layers, through_op, direct
    gc.collect()
    assert first_k() is None
