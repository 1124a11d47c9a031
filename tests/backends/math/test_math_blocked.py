"""MATH in blocks of query rows and its own blocked backward, against the float64 reference.

``SCORE_BUDGET_BYTES`` is shrunk so that blocks of one to a few rows put block boundaries
everywhere on small shapes: results and gradients (q, k, v, the paged cache, the ALiBi slopes) must
not depend on where they fall. The backward is explicit formulas, not autograd, so it also runs
inside a TorchDispatchMode (which turns autograd off below it). The memory test runs a long
sequence in a child process and reads its peak resident memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jagged_sdpa import ops
from jagged_sdpa.backends import keyed_dropout
from jagged_sdpa.backends import math as math_backend
from jagged_sdpa.backends.math import MathBackend
from support.cases import alibi_slopes, cu_of, paged_case
from support.kernel_calls import packed_call
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed, tolerance

TINY = {"rows1": 1, "rows3": 3}  # rows per block (set through the budget, per call)


def set_rows(monkeypatch, spec, rows: int, len_k: int) -> None:
    """A budget that gives ``rows`` rows per block to sequences of about ``len_k`` keys."""
    itemsize = torch.finfo(math_backend.compute_dtype(spec.dtype)).bits // 8
    monkeypatch.setattr(math_backend, "SCORE_BUDGET_BYTES", rows * len_k * spec.heads_q * itemsize)


def run_math(call):
    """out, lse of MATH through the library's autograd Function (its own backward)."""
    result = ops.run(MathBackend.backend, call)
    return result.out, result.lse


def reference_grads(q, k, v, cu_q, cu_k, grad_out, slopes=None, **options):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    s64 = None if slopes is None else slopes.detach().double().requires_grad_(True)
    out, lse = attention_reference(*leaves, cu_q, cu_k, alibi_slopes=s64, **options)
    out.backward(grad_out.double())
    return out, lse, [t.grad for t in leaves], None if s64 is None else s64.grad


CASES = {
    # name: (q lengths, k lengths, options)
    "plain": ([4, 0, 9, 1], [6, 3, 9, 0], dict()),
    "causal": ([7, 0, 9, 12], [7, 5, 4, 12], dict(causal=True)),
    "window": ([7, 3, 11], [9, 3, 6], dict(window_size=(2, 1))),
    "causal-window-left": ([12, 5], [12, 9], dict(causal=True, window_size=(3, -1))),
    "softcap-alibi": ([5, 8], [8, 3], dict(causal=True, softcap=2.0, alibi="per_head")),
    "alibi-batch": ([5, 0, 8], [8, 2, 3], dict(window_size=(4, 2), alibi="per_batch_head")),
}


@pytest.mark.parametrize("rows", list(TINY.values()), ids=list(TINY))
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("name", list(CASES))
def test_tiny_blocks_match_reference(monkeypatch, name, alignment, rows):
    """out, lse, dq, dk, dv and dslopes, GQA (4 query heads on 2 kv heads), Dv != D, Lq != Lk and
    empty sequences; float32 with blocks of 1 and 3 rows."""
    lens_q, lens_k, options = CASES[name]
    options = dict(options)
    kind = options.pop("alibi", None)
    q = torch.randn(sum(lens_q), 4, 8, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 8, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 6, requires_grad=True)
    slopes = alibi_slopes(kind, len(lens_q), 4)
    if slopes is not None:
        slopes.requires_grad_(True)
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    call = packed_call(q, k, v, cu_q, cu_k, alignment=alignment, alibi_slopes=slopes, **options)
    assert call.spec.needs_grad and call.spec.alibi_grad == (slopes is not None)
    set_rows(monkeypatch, call.spec, rows, max(lens_k))
    assert math_backend.block_rows(call.spec, max(lens_q), max(lens_k)) <= 2 * rows
    out, lse = run_math(call)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, ref_lse, ref, ref_slopes = reference_grads(
        q, k, v, cu_q, cu_k, grad_out, slopes, causal=options.get("causal", False), alignment=alignment,
        window=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0))
    assert_close_packed(out, ref_out, cu_seqlens=cu_q)
    assert_close_lse(lse, ref_lse)
    for label, got, want, cu in (("dq", q.grad, ref[0], cu_q), ("dk", k.grad, ref[1], cu_k),
                                 ("dv", v.grad, ref[2], cu_k)):
        assert_close_packed(got, want, cu_seqlens=cu, name=label, grad=True)
    if slopes is not None:
        atol, rtol = tolerance(torch.float32, grad=True)
        torch.testing.assert_close(slopes.grad.double(), ref_slopes, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_tiny_blocks_other_dtypes(monkeypatch, dtype):
    """float64 at its own tight tolerance (dK/dV accumulate over blocks in float64); fp16/bf16
    accumulate in float32 and round once."""
    lens_q, lens_k = [6, 1, 9], [9, 4, 9]
    q = torch.randn(sum(lens_q), 4, 16).to(dtype).requires_grad_(True)
    k = torch.randn(sum(lens_k), 2, 16).to(dtype).requires_grad_(True)
    v = torch.randn(sum(lens_k), 2, 16).to(dtype).requires_grad_(True)
    slopes = (torch.rand(4) * 0.5).requires_grad_(True)
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    call = packed_call(q, k, v, cu_q, cu_k, causal=True, softcap=3.0, alibi_slopes=slopes)
    set_rows(monkeypatch, call.spec, 2, 9)
    out, lse = run_math(call)
    assert out.dtype == dtype and lse.dtype == torch.float32
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, ref_lse, ref, ref_slopes = reference_grads(q, k, v, cu_q, cu_k, grad_out, slopes, causal=True,
                                                        alignment="bottom_right", softcap=3.0)
    assert_close_packed(out, ref_out, cu_seqlens=cu_q)
    assert_close_lse(lse, ref_lse)
    for label, got, want, cu in (("dq", q.grad, ref[0], cu_q), ("dk", k.grad, ref[1], cu_k),
                                 ("dv", v.grad, ref[2], cu_k)):
        assert got.dtype == dtype
        assert_close_packed(got, want, cu_seqlens=cu, name=label, grad=True)
    atol, rtol = tolerance(torch.float32 if dtype == torch.float64 else dtype, grad=True)
    torch.testing.assert_close(slopes.grad.double(), ref_slopes, atol=atol, rtol=rtol)


def test_float64_gradcheck_with_tiny_blocks(monkeypatch):
    """Finite differences of the blocked float64 path (blocks of 2 rows)."""
    monkeypatch.setattr(math_backend, "SCORE_BUDGET_BYTES", 2 * 4 * 2 * 8)
    q = torch.randn(7, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(9, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 1, 3, dtype=torch.float64, requires_grad=True)
    cu_q, cu_k = cu_of([5, 2]), cu_of([4, 5])

    def fn(q, k, v):
        call = packed_call(q, k, v, cu_q, cu_k, causal=True, softcap=3.0, window_size=(2, -1),
                           alibi_slopes=torch.tensor([0.2, 0.4]))
        return run_math(call)[0]

    assert torch.autograd.gradcheck(fn, (q, k, v))


class _SeenOps(TorchDispatchMode):
    """Runs every operator unchanged and records its name. Below ``__torch_dispatch__`` the
    autograd keys are excluded: a backward that ran autograd inside would record no graph."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


DISPATCH_CASES = {
    # name: (q lengths, k lengths (paged: seqused_k), options); GQA 4 query heads on 2 kv heads
    "causal-top-left-alibi": ([7, 0, 3], [4, 2, 6], dict(causal=True, alignment="top_left", alibi="per_head")),
    # bottom-right with Lq > Lk: sequence 0's first three rows see no key
    "causal-bottom-right-window-softcap-alibi-batch": (
        [7, 2], [4, 9], dict(causal=True, window_size=(3, -1), softcap=2.0, alibi="per_batch_head")),
    "window-dropout-alibi": ([6, 5], [8, 3], dict(window_size=(2, 1), dropout_p=0.3, alibi="per_head")),
    "paged-shared-causal-dropout-alibi": ([5, 3, 4], [7, 6, 5], dict(causal=True, dropout_p=0.3, alibi="per_head",
                                                                      paged=True)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(DISPATCH_CASES))
def test_backward_inside_a_dispatch_mode(monkeypatch, name, dtype):
    """Forward and backward of MATH inside a TorchDispatchMode (as FlopCounterMode or selective
    activation checkpointing run it), blocks of 2 rows and dropout masks drawn a row at a time:
    dq, dk, dv (the cache's, shared blocks summed) and the slopes' gradient against float64."""
    lens_q, lens_k, options = DISPATCH_CASES[name]
    options = dict(options)
    kind, paged = options.pop("alibi"), options.pop("paged", False)
    alignment = options.pop("alignment", "bottom_right")
    q = torch.randn(sum(lens_q), 4, 8, dtype=dtype, requires_grad=True)
    if paged:
        k, v, table, used, ref_k, ref_v = paged_case(lens_q, lens_k, 3, 2, 8, dtype, shared_first_block=True)
        k.requires_grad_(True)
        v.requires_grad_(True)
        extra = dict(block_table=table, seqused_k=used, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
        cu_k = None
    else:
        k = torch.randn(sum(lens_k), 2, 8, dtype=dtype, requires_grad=True)
        v = torch.randn(sum(lens_k), 2, 6, dtype=dtype, requires_grad=True)
        ref_k, ref_v, extra, cu_k = k, v, {}, cu_of(lens_k)
    slopes = alibi_slopes(kind, len(lens_q), 4).requires_grad_(True)
    cu_q = cu_of(lens_q)
    call = packed_call(q, k, v, cu_q, cu_k, alignment=alignment, alibi_slopes=slopes, **extra, **options)
    key = None
    if call.spec.dropout_p:
        key = keyed_dropout.draw_key()
        call = call.replace(dropout_key=key)
    assert call.spec.alibi_grad and call.spec.paged == paged
    set_rows(monkeypatch, call.spec, 2, max(lens_k))
    monkeypatch.setattr(math_backend, "MASK_CHUNK_ELEMENTS", 1)
    grad_out = torch.randn(sum(lens_q), 4, v.shape[-1], dtype=dtype)
    with _SeenOps() as mode:
        out, _ = run_math(call)
        dq, dk, dv, ds = torch.autograd.grad(out, (q, k, v, slopes), grad_out)
    assert "jagged_sdpa.attention_backward.default" in mode.seen
    keep = None
    if key is not None:
        keep = lambda b, lq, lk: keyed_dropout.keep_mask(key, b, 4, torch.arange(lq), torch.arange(lk), options["dropout_p"])
    ref_out, _, ref, ref_slopes = reference_grads(
        q, ref_k, ref_v, cu_q, cu_of(lens_k), grad_out, slopes, causal=options.get("causal", False),
        alignment=alignment, window=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0),
        dropout_p=options.get("dropout_p", 0.0), dropout_keep=keep)
    assert_close_packed(out, ref_out, cu_seqlens=cu_q)
    assert_close_packed(dq, ref[0], cu_seqlens=cu_q, name="dq", grad=True)
    assert dq.dtype == dk.dtype == dv.dtype == dtype and ds.dtype == torch.float32
    if paged:  # the reference's packed key rows, summed into the cache slots they came from
        slots = torch.cat([math_backend.paged_slots(call, b, n) for b, n in enumerate(lens_k)])
        assert len(set(slots.tolist())) < len(slots)
        dk, dv = dk.flatten(0, 1), dv.flatten(0, 1)
        ref[1], ref[2] = (torch.zeros(g.shape, dtype=torch.float64).index_add_(0, slots, r)
                          for g, r in ((dk, ref[1]), (dv, ref[2])))
        cu_k = list(range(dk.shape[0] + 1))
    assert_close_packed(dk, ref[1], cu_seqlens=cu_k, name="dk", grad=True)
    assert_close_packed(dv, ref[2], cu_seqlens=cu_k, name="dv", grad=True)
    atol, rtol = tolerance(torch.float32, grad=True)
    torch.testing.assert_close(ds.double(), ref_slopes, atol=atol, rtol=rtol)


def test_float64_gradcheck_inside_a_dispatch_mode(monkeypatch):
    """Finite differences of q, k, v inside a TorchDispatchMode: GQA, causal with a window,
    softcap, ALiBi whose slopes need a gradient too (float32 by the API, so their gradient is
    checked against the reference above, not by finite differences), a fixed dropout mask,
    blocks of 2 rows."""
    monkeypatch.setattr(math_backend, "SCORE_BUDGET_BYTES", 2 * 4 * 4 * 8)
    q = torch.randn(7, 4, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(9, 2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 2, 3, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.2, 0.4, 0.1, 0.3], requires_grad=True)
    cu_q, cu_k = cu_of([5, 2]), cu_of([4, 5])

    def fn(q, k, v):
        call = packed_call(q, k, v, cu_q, cu_k, causal=True, softcap=3.0, window_size=(2, -1), dropout_p=0.25,
                           alibi_slopes=slopes)
        assert call.spec.alibi_grad
        return run_math(call.replace(dropout_key=torch.tensor([5, 77])))[0]

    with _SeenOps() as mode:
        assert torch.autograd.gradcheck(fn, (q, k, v))
    assert "jagged_sdpa.attention_backward.default" in mode.seen


def test_dropout_masks_are_drawn_a_few_rows_at_a_time(monkeypatch):
    """One block of 64 rows x 300 keys x 4 heads: its mask is drawn in chunks of at most
    MASK_CHUNK_ELEMENTS (Philox's int64 temporaries are 8 bytes per element each), rows in order."""
    monkeypatch.setattr(math_backend, "MASK_CHUNK_ELEMENTS", 4 * 300 * 5)
    drawn, real = [], keyed_dropout.keep_mask

    def recording(key, b, heads, rows, keys, p):
        drawn.append((heads, rows.tolist(), keys.numel()))
        return real(key, b, heads, rows, keys, p)

    monkeypatch.setattr(keyed_dropout, "keep_mask", recording)
    q, k = torch.randn(64, 4, 8), torch.randn(300, 2, 8)
    call = packed_call(q, k, k, cu_of([64]), cu_of([300]), dropout_p=0.2).replace(dropout_key=torch.tensor([1, 2]))
    assert len(list(math_backend.blocks(call.spec, 64, 300))) == 1
    run_math(call)
    assert all(heads == 4 and len(rows) <= 5 and keys == 300 for heads, rows, keys in drawn)
    assert [r for _, rows, _ in drawn for r in rows] == list(range(64))


@pytest.mark.parametrize("shared", [False, True], ids=["own_blocks", "shared_first_block"])
def test_paged_gradients_accumulate_into_the_cache(monkeypatch, shared):
    """A paged cache (NaN in every slot no row reads): dK/dV of the cache rows each sequence
    read, summed over the sequences that share a block; equal bits when run twice."""
    q_lens, used = [5, 3, 0, 4], [7, 6, 2, 5]
    k_cache, v_cache, table, seqused, pk, pv = paged_case(q_lens, used, 3, 2, 8, shared_first_block=shared)
    q = torch.randn(sum(q_lens), 4, 8, requires_grad=True)
    slopes = (torch.rand(4) * 0.5).requires_grad_(True)
    cu_q = cu_of(q_lens)
    grad_out = torch.randn(sum(q_lens), 4, 8)
    runs = []
    for _ in range(2):
        kc, vc = k_cache.clone().requires_grad_(True), v_cache.clone().requires_grad_(True)
        call = packed_call(q, kc, vc, cu_q, None, max_seqlen_q=max(q_lens), max_seqlen_k=max(used), causal=True,
                           alibi_slopes=slopes, block_table=table, seqused_k=seqused)
        set_rows(monkeypatch, call.spec, 2, max(used))
        out, _ = run_math(call)
        q.grad = slopes.grad = None
        out.backward(grad_out)
        runs.append((out, q.grad, kc.grad, vc.grad, slopes.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    out, dq, dkc, dvc, ds = runs[0]
    ref_out, _, ref, ref_slopes = reference_grads(q, pk, pv, cu_q, cu_of(used), grad_out, slopes, causal=True,
                                                  alignment="bottom_right")
    assert_close_packed(out, ref_out, cu_seqlens=cu_q)
    assert_close_packed(dq, ref[0], cu_seqlens=cu_q, name="dq", grad=True)
    # The reference's packed key rows, summed into the cache slots they came from.
    slots = torch.cat([math_backend.paged_slots(call, b, n) for b, n in enumerate(used)])
    for label, got, want in (("dk_cache", dkc, ref[1]), ("dv_cache", dvc, ref[2])):
        expected = torch.zeros(got.shape, dtype=torch.float64).flatten(0, 1).index_add_(0, slots, want)
        assert_close_packed(got.flatten(0, 1), expected, cu_seqlens=list(range(expected.shape[0] + 1)),
                            name=label, grad=True)
    assert (len(set(slots.tolist())) < len(slots)) == shared
    atol, rtol = tolerance(torch.float32, grad=True)
    torch.testing.assert_close(ds.double(), ref_slopes, atol=atol, rtol=rtol)


def test_nan_rows_stay_where_the_reference_has_them(monkeypatch):
    """A NaN query row: its outputs are NaN exactly where the reference's are; gradients are NaN
    only where the reference's are, and equal to it everywhere else."""
    lens = [6, 5]
    q = torch.randn(11, 2, 8)
    q[2, 1, 3] = float("nan")
    q.requires_grad_(True)
    k = torch.randn(11, 2, 8, requires_grad=True)
    v = torch.randn(11, 2, 8, requires_grad=True)
    cu = cu_of(lens)
    call = packed_call(q, k, v, cu, cu, causal=True)
    set_rows(monkeypatch, call.spec, 2, 6)
    out, _ = run_math(call)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, _, ref, _ = reference_grads(q, k, v, cu, cu, grad_out, causal=True, alignment="bottom_right")
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out)) and torch.isnan(out).any()
    for got, want in ((out, ref_out), (q.grad, ref[0]), (k.grad, ref[1]), (v.grad, ref[2])):
        nan = torch.isnan(got)
        assert not (nan & ~torch.isnan(want)).any()
        finite = ~torch.isnan(want)
        torch.testing.assert_close(got.double()[finite], want[finite], atol=1e-4, rtol=1e-4)


def test_empty_batch_gives_zero_gradients():
    """No query row at all: an empty output, and zero gradients for q, k, v and the slopes."""
    q = torch.randn(0, 2, 4, requires_grad=True)
    k = torch.randn(5, 2, 4, requires_grad=True)
    v = torch.randn(5, 2, 4, requires_grad=True)
    slopes = torch.rand(2, requires_grad=True)
    call = packed_call(q, k, v, cu_of([0, 0]), cu_of([2, 3]), alibi_slopes=slopes)
    out, _ = run_math(call)
    assert out.shape == (0, 2, 4)
    out.sum().backward()
    for t in (q, k, v, slopes):
        assert torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("window,causal", [((-1, -1), False), ((-1, -1), True), ((40, 0), True), ((16, 16), False)])
def test_blocks_respect_the_budget(monkeypatch, window, causal):
    """Every block's scores fit the budget (or the block is one row), rows are covered once,
    in order, and each block's key range holds every key its rows see."""
    monkeypatch.setattr(math_backend, "SCORE_BUDGET_BYTES", 64 << 10)
    len_q, len_k = 700, 900
    call = packed_call(torch.randn(len_q, 4, 8), torch.randn(len_k, 2, 8), torch.randn(len_k, 2, 8),
                       cu_of([len_q]), cu_of([len_k]), causal=causal, window_size=window)
    spec = call.spec
    blocks = list(math_backend.blocks(spec, len_q, len_k))
    shift = len_k - len_q
    assert blocks[0].r0 == 0 and all(a.r1 == b.r0 for a, b in zip(blocks, blocks[1:]))
    assert blocks[-1].r1 == len_q
    for block in blocks:
        rows, keys = block.r1 - block.r0, block.hi - block.lo
        assert rows == 1 or spec.heads_q * rows * keys * 4 <= math_backend.SCORE_BUDGET_BYTES
        for i in (block.r0, block.r1 - 1):
            keep = [j for j in range(len_k) if (not causal or j <= i + shift)
                    and (window[0] < 0 or j >= i + shift - window[0]) and (window[1] < 0 or j <= i + shift + window[1])]
            assert not keep or (block.lo <= keep[0] and keep[-1] < block.hi)
    if window != (-1, -1):  # windowed rows take far larger blocks than len_k alone allows
        assert blocks[1].r1 - blocks[1].r0 > (64 << 10) // (4 * 4 * len_k)


CHILD = textwrap.dedent("""
    import resource, sys, torch
    from jagged_sdpa import ops
    from jagged_sdpa.backends import math as math_backend
    from jagged_sdpa.backends.math import MathBackend
    sys.path.insert(0, "tests")
    from support.kernel_calls import packed_call
    torch.set_num_threads(1)
    n = 8192
    math_backend.SCORE_BUDGET_BYTES = 4 << 20
    cu = torch.tensor([0, n], dtype=torch.int32)
    q, k, v = (torch.randn(n, 1, 16, requires_grad=True) for _ in range(3))
    small = packed_call(q[:64], k[:64], v[:64], torch.tensor([0, 64], dtype=torch.int32), cu.new_tensor([0, 64]))
    ops.run(MathBackend.backend, small).out.sum().backward()        # warm up every op once
    call = packed_call(q, k, v, cu, cu, causal=True, softcap=5.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = ops.run(MathBackend.backend, call).out
    out.backward(torch.ones_like(out))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert torch.isfinite(q.grad).all() and k.grad.abs().sum() > 0
    print((after - before) * 1024)
""")


def test_long_sequence_peak_memory_is_a_few_blocks():
    """8k tokens, 1 head, D = 16, float32, forward and backward: the peak resident memory grows by a
    few 4 MiB blocks (measured: 8 MiB forward, 25 MiB both), never by the 256 MiB of one Lq x Lk
    score matrix (the unblocked MATH kept several such matrices for autograd). glibc is told to map
    every large allocation on its own, so that freed blocks leave the resident set at once
    (otherwise its heap keeps the holes of differently sized blocks and the peak measures those)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
               MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    grew = int(proc.stdout.split()[-1])
    assert grew < 64 << 20, f"peak memory grew by {grew >> 20} MiB"


def test_bench_math_runs_a_case():
    """``benchmarks/bench_math.py`` end to end on its smallest case (a fresh child process)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_math.py"), "medium-causal"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert line.startswith("medium-causal") and " ms   peak RSS +" in line and line.endswith("MiB"), line
