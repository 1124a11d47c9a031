"""Plans (docs/api.md section 10): a batch validated once, run in every layer.

``plan.run`` must return what ``varlen_attention`` returns on the same backend, bit for bit,
forward and backward; a plan keeps its own copy of the metadata; ``update`` points it at a new
batch; calls over unchanged metadata tensors validate once, and an in-place change is seen.
Accuracy against float64 is the functions' own (tests/api/test_varlen.py); here the plan is compared
with the function, and with the float64 reference once per option to show the plan is not wrong
in the same way as the function.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.cases import alibi_slopes, cu_of, njt, packed, paged_case
from support.reference import attention_reference
from support.tolerances import assert_close_packed

import jagged_sdpa
from jagged_sdpa import Backend, batch, layout

LQ, LK = [5, 9, 0, 3], [7, 9, 2, 4]
BACKENDS = [Backend.CPU_FUSED, Backend.MATH]


def _layer(grad=False, dtype=torch.float32, gen=None):
    q = packed(LQ, 4, 16, dtype, requires_grad=grad, gen=gen)
    k = packed(LK, 2, 16, dtype, requires_grad=grad, gen=gen)
    v = packed(LK, 2, 16, dtype, requires_grad=grad, gen=gen)
    return q, k, v


OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window-softcap": dict(causal=True, window_size=(3, 1), softcap=5.0, softmax_scale=0.3),
    "lse": dict(causal=True, return_lse=True),
    "dropout": dict(dropout_p=0.3),
}


def _same(a, b):
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_run_equals_the_function_bit_for_bit(backend, name, grad):
    kw = OPTIONS[name]
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    p = jagged_sdpa.plan(cu_q, cu_k, max(LQ), max(LK), backend=backend, **kw)
    for layer in range(3):  # every layer its own tensors; one plan
        q, k, v = _layer(grad, gen=torch.Generator().manual_seed(layer))
        torch.manual_seed(layer)
        got = p.run(q, k, v)
        q2, k2, v2 = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
        torch.manual_seed(layer)
        want = jagged_sdpa.varlen_attention(q2, k2, v2, cu_q, cu_k, max(LQ), max(LK), backend=backend, **kw)
        _same(got, want)
        if grad:
            g = torch.randn_like(want[0] if isinstance(want, tuple) else want)
            (got[0] if isinstance(got, tuple) else got).backward(g)
            (want[0] if isinstance(want, tuple) else want).backward(g)
            for a, b in ((q, q2), (k, k2), (v, v2)):
                _same(a.grad, b.grad)
        if name in ("plain", "causal") and layer == 0:  # and right, not only equal
            ref, _ = attention_reference(q.double(), k.double(), v.double(), cu_q, cu_k, causal=kw.get("causal", False),
                                         alignment="bottom_right")
            assert_close_packed(got.detach(), ref, cu_seqlens=cu_q.tolist())


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_run_with_alibi_per_layer(grad):
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    p = jagged_sdpa.plan(cu_q, cu_k, causal=True)
    q, k, v = _layer(grad)
    slopes = alibi_slopes("per_batch_head", 4, 4).requires_grad_(grad)
    got = p.run(q, k, v, alibi_slopes=slopes)
    q2, k2, v2, s2 = (t.detach().clone().requires_grad_(grad) for t in (q, k, v, slopes))
    want = jagged_sdpa.varlen_attention(q2, k2, v2, cu_q, cu_k, causal=True, alibi_slopes=s2)
    _same(got, want)
    if grad:
        got.sum().backward()
        want.sum().backward()
        _same(slopes.grad, s2.grad)
        _same(q.grad, q2.grad)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_paged_run_equals_the_function(backend):
    q_lens, used = [1, 1, 3, 1], [20, 5, 9, 0]
    k_cache, v_cache, table, seqused, _, _ = paged_case(q_lens, used, 4, 2, 16)
    cu_q = cu_of(q_lens)
    q = packed(q_lens, 4, 16)
    p = jagged_sdpa.plan(cu_q, None, max(q_lens), max(used), causal=True, block_table=table, seqused_k=seqused,
                         backend=backend, return_lse=True)
    want = jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_q, None, max(q_lens), max(used), causal=True,
                                        block_table=table, seqused_k=seqused, backend=backend, return_lse=True)
    _same(p.run(q, k_cache, v_cache), want)


def test_seqused_k_run_equals_the_function():
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    used = torch.tensor([3, 9, 0, 4], dtype=torch.int32)
    q, k, v = _layer()
    p = jagged_sdpa.plan(cu_q, cu_k, seqused_k=used, causal=True)
    _same(p.run(q, k, v), jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, seqused_k=used, causal=True))


def test_dropout_draws_a_new_key_per_run():
    cu = cu_of(LQ)
    q = packed(LQ, 2, 8)
    p = jagged_sdpa.plan(cu, cu, dropout_p=0.5)
    assert not torch.equal(p.run(q, q, q), p.run(q, q, q))


# ---------------------------------------------------------------------------------------------
# snapshot, update


def test_plan_keeps_its_own_copy_of_the_metadata():
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    q, k, v = _layer()
    p = jagged_sdpa.plan(cu_q, cu_k, causal=True)
    want = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    cu_q.copy_(cu_of([9, 5, 3, 0]))   # the caller reuses its buffer
    cu_k.fill_(0)
    _same(p.run(q, k, v), want)


def test_update_points_the_plan_at_a_new_batch():
    p = jagged_sdpa.plan(cu_of(LQ), cu_of(LK), causal=True)
    q, k, v = _layer()
    p.run(q, k, v)
    new_q, new_k = [2, 0, 11, 4], [3, 30, 11, 1]
    p.update(cu_of(new_q), cu_of(new_k))
    assert (p.max_seqlen_q, p.max_seqlen_k) == (11, 30)
    q, k, v = packed(new_q, 4, 16), packed(new_k, 2, 16), packed(new_k, 2, 16)
    _same(p.run(q, k, v), jagged_sdpa.varlen_attention(q, k, v, cu_of(new_q), cu_of(new_k), causal=True))


def test_update_refills_the_plans_buffers_in_place():
    p = jagged_sdpa.plan(cu_of(LQ), cu_of(LK))
    buffer = p._batch.cu_seqlens_q
    p.update(cu_of([1, 1, 1, 1]), cu_of([2, 2, 2, 2]))
    assert p._batch.cu_seqlens_q is buffer and buffer.tolist() == [0, 1, 2, 3, 4]


def test_update_paged_refills_table_and_lengths():
    q_lens, used = [1, 1, 1], [9, 4, 1]
    k_cache, v_cache, table, seqused, _, _ = paged_case(q_lens, used, 4, 2, 16)
    p = jagged_sdpa.plan(cu_of(q_lens), None, 1, 9, block_table=table, seqused_k=seqused, causal=True)
    q = packed(q_lens, 4, 16)
    p.run(q, k_cache, v_cache)
    seqused2 = torch.tensor([10, 5, 2], dtype=torch.int32)   # one decode step later
    p.update(cu_of(q_lens), None, 1, 10, block_table=table, seqused_k=seqused2)
    want = jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_of(q_lens), None, 1, 10, block_table=table,
                                        seqused_k=seqused2, causal=True)
    _same(p.run(q, k_cache, v_cache), want)


def test_update_rejects_another_batch_size_and_bad_metadata():
    p = jagged_sdpa.plan(cu_of(LQ), cu_of(LK))
    with pytest.raises(ValueError, match="update needs a batch like the plan's"):
        p.update(cu_of([1, 2]), cu_of([1, 2]))
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        p.update(cu_of(LQ), torch.tensor([0, 5, 3, 4, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q is 2"):
        p.update(cu_of(LQ), cu_of(LK), 2, None)


# ---------------------------------------------------------------------------------------------
# errors: the same as the function's, before any kernel


BAD_METADATA = {
    "not-int32": (lambda: (cu_of(LQ).long(), cu_of(LK)), {}),
    "not-starting-at-0": (lambda: (torch.tensor([1, 5, 14, 14, 17], dtype=torch.int32), cu_of(LK)), {}),
    "decreasing": (lambda: (torch.tensor([0, 5, 4, 14, 17], dtype=torch.int32), cu_of(LK)), {}),
    "max-too-small": (lambda: (cu_of(LQ), cu_of(LK)), dict(max_seqlen_q=3)),
    "bad-window": (lambda: (cu_of(LQ), cu_of(LK)), dict(window_size=(-2, 0))),
    "bad-dropout": (lambda: (cu_of(LQ), cu_of(LK)), dict(dropout_p=1.5)),
    "bad-causal": (lambda: (cu_of(LQ), cu_of(LK)), dict(causal=1)),
    "batch-mismatch": (lambda: (cu_of(LQ), cu_of(LK[:2])), {}),
}


@pytest.mark.parametrize("name", BAD_METADATA)
def test_plan_raises_what_the_function_raises(name):
    make, kw = BAD_METADATA[name]
    cu_q, cu_k = make()
    q, k, v = _layer()
    with pytest.raises((TypeError, ValueError)) as by_function:
        jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, **kw)
    with pytest.raises(by_function.type) as by_plan:
        jagged_sdpa.plan(cu_q, cu_k, **kw)
    assert str(by_plan.value) == str(by_function.value)


def test_run_checks_what_may_differ_between_layers():
    p = jagged_sdpa.plan(cu_of(LQ), cu_of(LK))
    q, k, v = _layer()
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the packed length 16"):
        p.run(q[:16], k, v)
    with pytest.raises(ValueError, match="cu_seqlens_k must end at the packed length 21"):
        p.run(q, k[:21], v[:21])
    with pytest.raises(TypeError, match="v dtype"):
        p.run(q, k, v.half())
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        p.run(packed(LQ, 3, 16), k, v)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        p.run(q, k, v, alibi_slopes=torch.ones(3))
    p.run(q, k, v)  # and a good layer after the bad ones runs


def test_backend_choice_is_made_and_logged_once_per_kind(caplog):
    p = jagged_sdpa.plan(cu_of(LQ), cu_of(LK), causal=True)
    q, k, v = _layer()
    with caplog.at_level(logging.DEBUG, logger="jagged_sdpa"):
        for _ in range(3):
            p.run(q, k, v)
        p.run(q.double(), k.double(), v.double())   # another kind: float64 goes to math
    lines = [r for r in caplog.records if "selection" in r.getMessage()]
    assert len(lines) == 2 and "chosen: math" in lines[1].getMessage()


def test_explain_says_what_run_would_take():
    p = jagged_sdpa.plan(cu_of(LQ), cu_of(LK), causal=True)
    q, k, v = _layer()
    e = p.explain(q, k, v)
    assert e.chosen == Backend.CPU_FUSED and e.reasons[Backend.MATH] == []
    assert p.explain(q.double(), k.double(), v.double()).chosen == Backend.MATH


# ---------------------------------------------------------------------------------------------
# implicit reuse: calls over the same metadata tensors validate once


@pytest.fixture
def reads(monkeypatch):
    count = []
    real = layout.read_host

    def counting(*tensors):
        count.append(len(tensors))
        return real(*tensors)

    monkeypatch.setattr(layout, "read_host", counting)
    batch.clear_cache()
    return count


def test_varlen_calls_over_the_same_cu_seqlens_read_once(reads):
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    for layer in range(4):
        q, k, v = _layer()
        jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert reads == [2]


def test_sdpa_calls_over_njts_sharing_offsets_read_once(reads):
    x = njt([3, 7, 1], 2, 8)
    offsets = x.offsets()
    for layer in range(4):
        q = torch.nested.nested_tensor_from_jagged(torch.randn(11, 2, 8), offsets).transpose(1, 2)
        jagged_sdpa.sdpa(q, q, q, is_causal=True)
    assert len(reads) == 1


def test_an_in_place_change_between_calls_is_seen(reads):
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    q, k, v = _layer()
    jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    new_q = [9, 5, 3, 0]
    cu_q.copy_(cu_of(new_q))   # same tensor, new lengths
    got = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert len(reads) == 2
    ref, _ = attention_reference(q.double(), k.double(), v.double(), cu_of(new_q), cu_k, causal=True,
                                 alignment="bottom_right")
    assert_close_packed(got, ref, cu_seqlens=cu_of(new_q).tolist())
    cu_q[1] = 100   # and a bad change is refused, not run
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)


def test_inference_mode_tensors_are_compared_by_contents(reads):
    with torch.inference_mode():
        cu_q, cu_k = cu_of(LQ), cu_of(LK)
        q, k, v = _layer()
        jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
        jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)   # re-read, unchanged: reused
        cu_q.copy_(cu_of([9, 5, 3, 0]))
        got = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True, alignment="bottom_right")
    assert_close_packed(got, ref, cu_seqlens=cu_q.tolist())


# ---------------------------------------------------------------------------------------------
# torch.compile


def test_plan_run_compiles_without_graph_breaks():
    torch._dynamo.reset()
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    p = jagged_sdpa.plan(cu_q, cu_k, max(LQ), max(LK), causal=True)
    q, k, v = _layer()

    def layers(q, k, v):
        return p.run(p.run(q, k, v).repeat(1, 1, 1)[:, :2], k, v)

    explained = torch._dynamo.explain(layers)(q, k, v)
    assert explained.graph_break_count == 0
    compiled = torch.compile(layers, fullgraph=True)
    _same(compiled(q, k, v), layers(q, k, v))


# ---------------------------------------------------------------------------------------------
# a call that skips the host read is checked all the same, on every path


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


BAD = {
    "keys-past-the-end": ([0, 3, 6], [0, 5, 2], 3, 5),
    "int32-wrap": ([0, 2**31 - 1, -2**31 + 5, 4, 10], [0, 2**31 - 1, -2**31 + 5, 4, 10], 2**31 - 1, 2**31 - 1),
}


def _bad_call(name):
    cu_q, cu_k, max_q, max_k = BAD[name]
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
    total = int(cu_q[-1])
    q = torch.randn(total, 2, 16)
    kv = torch.randn(int(cu_k[-1]) if name == "int32-wrap" else 6, 2, 16)
    return q, kv, cu_q, cu_k, max_q, max_k


@pytest.fixture
def no_host_read(monkeypatch):
    """Every call takes the decision a CUDA call with max lengths takes: no host read."""
    monkeypatch.setattr(layout, "host_read_needed", lambda device, *given: False)
    batch.clear_cache()


PATHS = ["eager-direct", "eager-operator", "compiled", "plan"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", BAD)
def test_bad_offsets_without_a_host_read_fail_loudly(no_host_read, path, name):
    q, kv, cu_q, cu_k, max_q, max_k = _bad_call(name)
    call = lambda q, k, v: jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k)
    # RuntimeError: the device-side assert (synchronous on the CPU); ValueError: a host check
    with pytest.raises((RuntimeError, ValueError), match="cu_seqlens"):
        if path == "eager-direct":
            call(q, kv, kv)
        elif path == "eager-operator":
            with _Passthrough():
                call(q, kv, kv)
        elif path == "compiled":
            torch._dynamo.reset()
            torch.compile(call, fullgraph=True)(q, kv, kv)
        else:
            jagged_sdpa.plan(cu_q, cu_k, max_q, max_k).run(q, kv, kv)


# ---------------------------------------------------------------------------------------------
# torch.autocast casts the inputs as PyTorch's SDPA does


def test_sdpa_follows_autocast_like_pytorch():
    nt = torch.nested.nested_tensor_from_jagged(torch.randn(64, 4, 16), torch.arange(0, 65, 16)).transpose(1, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.scaled_dot_product_attention(nt, nt, nt)
        got = jagged_sdpa.sdpa(nt, nt, nt)
    assert got.dtype == want.dtype == torch.bfloat16
    ref = jagged_sdpa.sdpa(*(nt.to(torch.bfloat16),) * 3)
    torch.testing.assert_close(got.values(), ref.values(), rtol=0, atol=0)


def test_varlen_and_plan_follow_autocast_with_mixed_inputs():
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    q, k, v = _layer()
    p = jagged_sdpa.plan(cu_q, cu_k, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        by_call = jagged_sdpa.varlen_attention(q, k.bfloat16(), v, cu_q, cu_k, causal=True)  # mixed: cast, no TypeError
        by_plan = p.run(q, k, v)
    want = jagged_sdpa.varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, causal=True)
    assert by_call.dtype == by_plan.dtype == torch.bfloat16
    _same(by_call, want)
    _same(by_plan, want)
    with torch.autocast("cpu", dtype=torch.bfloat16):   # float64 is left alone, as autocast does
        assert jagged_sdpa.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k).dtype == torch.float64


def test_an_observed_call_keeps_no_reference_to_its_tensors():
    """An operator call under a dispatch mode (or a profiler) leaves nothing of
    its q, k, v behind (there is no thread-local handover any more)."""
    import gc
    import weakref

    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    q, k, v = _layer()
    refs = [weakref.ref(t) for t in (q, k, v)]
    with _Passthrough():
        out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs)


# ---------------------------------------------------------------------------------------------
# key and value built separately (their own offsets) compile without a break


def _nj(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(n, 2, 16, generator=g) for n in lengths],
                                      layout=torch.jagged).transpose(1, 2)


def test_key_and_value_with_their_own_offsets_compile_without_a_break():
    torch._dynamo.reset()
    q, k, v = _nj([5, 3], 0), _nj([7, 4], 1), _nj([7, 4], 2)
    assert v.offsets() is not k.offsets()
    f = lambda q, k, v: jagged_sdpa.sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right")
    assert torch._dynamo.explain(f)(q, k, v).graph_break_count == 0
    got = torch.compile(f, fullgraph=True)(q, k, v)
    packed = lambda x: x.transpose(1, 2).values()
    ref, _ = attention_reference(packed(q).double(), packed(k).double(), packed(v).double(), q.offsets(),
                                 k.offsets(), causal=True, alignment="bottom_right")
    assert_close_packed(packed(got), ref, cu_seqlens=q.offsets().tolist())


def test_key_and_value_of_another_structure_are_refused_on_every_path():
    q, k, v = _nj([5, 3], 0), _nj([7, 4], 1), _nj([6, 5], 2)
    f = lambda q, k, v: jagged_sdpa.sdpa(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match="same ragged structure"):
        f(q, k, v)                                  # eager: compared on the host
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="same ragged structure"):
        torch.compile(f, fullgraph=True)(q, k, v)   # compiled: a device-side assert (synchronous on the CPU)
    with pytest.raises(ValueError, match="key has 11 tokens, value 12"):
        f(q, k, _nj([6, 6], 3))


def test_a_change_that_bumps_no_version_never_reaches_a_kernel_unchecked():
    """A change through ``.numpy()`` (no torch op, no version bump) is not seen by implicit reuse,
    but the kernels read the batch's own copies, taken before validation: the call computes with
    the lengths that were checked, never reads past the tensors (here: keys past k's end)."""
    cu_q, cu_k = cu_of(LQ), cu_of(LK)
    q, k, v = _layer()
    want = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    cu_k.numpy()[1:] = 10_000   # far outside k
    with _Passthrough():         # the operator path too
        _same(jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True), want)
    _same(jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True), want)


def test_a_plan_run_from_several_threads_gives_each_its_own_numbers():
    """Threads sharing a plan (a server's workers, or calls found again over one offsets tensor)
    each get their own call's numbers: the kernel runs with the GIL released, so no run may leave
    its tensors' pointers where another thread's kernel reads them."""
    import threading

    gen = torch.Generator().manual_seed(0)
    B, L, H, D = 4, 256, 4, 64
    cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32)
    p = jagged_sdpa.plan(cu, cu, L, L, causal=True)
    inputs = [tuple(torch.randn(B * L, H, D, generator=gen) for _ in range(3)) for _ in range(2)]
    with torch.no_grad():
        expected = [p.run(*x) for x in inputs]
        wrong = []

        def worker(i):
            with torch.no_grad():
                wrong.extend(n for n in range(20) if not torch.equal(p.run(*inputs[i]), expected[i]))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not wrong


def test_spec_and_call_replace_copy_every_other_field():
    """``replace`` (on the per-call hot path) is ``dataclasses.replace``: the
    named fields changed, every other field the original's, the original untouched, an unknown
    field a TypeError naming it."""
    import dataclasses

    from jagged_sdpa.spec import AttnSpec

    q, cu = packed([3, 5], 2, 16), cu_of([3, 5])
    call, _ = jagged_sdpa.plan(cu, cu, 5, 5, causal=True)._call(q, q, q, None, choose=False)
    for obj, changes in ((call.spec, dict(causal=False, dropout_p=0.5)), (call, dict(q=q[:4], dropout_key=None))):
        new = obj.replace(**changes)
        assert type(new) is type(obj) and new is not obj
        for field in dataclasses.fields(obj):
            want = changes[field.name] if field.name in changes else getattr(obj, field.name)
            assert getattr(new, field.name) is want, field.name
        with pytest.raises(TypeError, match="nope"):
            obj.replace(nope=1)
    assert call.spec.causal and AttnSpec.replace.__qualname__ == "AttnSpec.replace"
