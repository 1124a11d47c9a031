"""Keyed dropout (``backends/keyed_dropout.py``): one mask, drawn by Philox4x32-10 from the counter
(key j, query i, head h, sequence b), for MATH, CPU_FUSED's compiled kernel and TRITON.

* The generator: Random123's published known-answer vectors, the 32-bit products against Python
  integers, and Triton's own ``tl.philox`` / ``tl.randint`` / ``tl.uint_to_uniform_float`` (run in
  the interpreter) against the torch form, bit for bit.
* The mask: keep rate within binomial bounds, no correlation across heads, rows, keys, sequences
  and keys of the generator (a counter word dropped from the key would fail), uniform words.
* The backends: each one's mask, read off exactly through one-hot values (out[i, h, j] = P_ij Z_ij),
  equals the torch mask, whatever the thread count, the kernel's work split, the sequences packed
  around it or padding; out, lse and dq/dk/dv equal the float64 reference applying the same mask,
  within dtype tolerances, for every option (so each backward recomputes the forward's mask).
"""

from __future__ import annotations

import functools
import math
import os
import shutil

import pytest
import torch

import jagged_sdpa
from jagged_sdpa import Backend
from jagged_sdpa.ops import run
from jagged_sdpa.backends import IMPLS, keyed_dropout
from jagged_sdpa.backends.cpu import CpuFusedBackend
from jagged_sdpa.backends.cpu import native
from jagged_sdpa.spec import PackedCall
from support.cases import alibi_slopes, cu_of, in_nan_buffer, paged_case
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed
from support.triton_interpreter import interpreter_env, is_interpreted

# Triton's library functions are interpreted only if TRITON_INTERPRET is set when triton is
# imported (see test_backend_triton.py); other modules must still see TRITON ineligible on the CPU.
with interpreter_env():
    try:
        import triton
        import triton.language as tl
        from jagged_sdpa.backends.triton import _common as triton_common
    except ImportError:
        triton = None
TRITON_CPU = is_interpreted(triton)
needs_triton = pytest.mark.skipif(not TRITON_CPU, reason="triton missing, or imported compiled before this module")
needs_kernel = pytest.mark.skipif(native.library() is None and shutil.which("g++") is None,
                                  reason="no C++ compiler: the compiled kernel cannot be built here")
P = 0.3


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---------------------------------------------------------------------------------------------------
# the generator


@pytest.mark.parametrize("counter, key, expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
], ids=["zeros", "ones", "pi"])
def test_philox_matches_random123_known_answers(counter, key, expected):
    """Random123's kat_vectors for philox4x32 10 (counter words, key words, output words)."""
    words = keyed_dropout.philox4x32_10(*(torch.tensor(c) for c in counter), *key)
    assert tuple(int(w) for w in words) == expected


def test_32_bit_products_are_exact():
    gen = torch.Generator().manual_seed(1)
    a = torch.cat([torch.tensor([0, 1, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1]),
                   torch.randint(0, 2**32, (2000,), generator=gen)])
    for m in (keyed_dropout.ROUND_A, keyed_dropout.ROUND_B, 0xFFFFFFFF, 1):
        hi, lo = keyed_dropout._mul_hi_lo(a, m)
        exact = [int(x) * m for x in a.tolist()]
        assert hi.tolist() == [e >> 32 for e in exact] and lo.tolist() == [e & 0xFFFFFFFF for e in exact]


def test_uniform_is_tritons_conversion_of_the_word():
    """int32 view, ~x where negative, times the float32 of 4.6566127342e-10: 0 and 2**32 - 1 give
    0, 2**31 - 1 and 2**31 give the largest value, still below 1."""
    words = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32 - 2])
    u = keyed_dropout.uniform(words)
    scale = torch.tensor(4.6566127342e-10, dtype=torch.float32)
    expected = torch.tensor([0, 1, 2**31 - 1, 2**31 - 1, 0, 1]).float() * scale
    assert u.dtype == torch.float32 and torch.equal(u, expected)
    assert u.max() < 1.0 and u[2] > 0.99999


@functools.cache
def _probe():
    """The probe kernel, decorated on first use: under the ``interpret`` fixture, so interpreted."""

    @triton.jit
    def probe(Words, Uniform, Rand, Keep, key_seed, key_offset, b, head, dropout_p, ROWS: tl.constexpr,
              KEYS: tl.constexpr):
        """Words: tl.philox's four words of counter (j, i, head, b) under the 64-bit seed
        key_seed | key_offset << 32; Uniform: tl.uint_to_uniform_float of word 0; Rand:
        tl.randint(that seed, i * KEYS + j); Keep: the kernels' _dropout_keep."""
        i = tl.arange(0, ROWS)
        j = tl.arange(0, KEYS)
        seed = key_seed.to(tl.uint32, bitcast=True).to(tl.uint64)
        seed = seed | (key_offset.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
        zeros = tl.zeros([ROWS, KEYS], dtype=tl.uint32)
        w0, w1, w2, w3 = tl.philox(seed, zeros + j[None, :].to(tl.uint32), zeros + i[:, None].to(tl.uint32),
                                   zeros + head.to(tl.uint32), zeros + b.to(tl.uint32))
        at = i[:, None] * KEYS + j[None, :]
        tl.store(Words + at, w0.to(tl.int64) & 0xFFFFFFFF)
        tl.store(Words + ROWS * KEYS + at, w1.to(tl.int64) & 0xFFFFFFFF)
        tl.store(Words + 2 * ROWS * KEYS + at, w2.to(tl.int64) & 0xFFFFFFFF)
        tl.store(Words + 3 * ROWS * KEYS + at, w3.to(tl.int64) & 0xFFFFFFFF)
        tl.store(Uniform + at, tl.uint_to_uniform_float(w0))
        tl.store(Rand + at, tl.randint(seed, at.to(tl.uint32)).to(tl.int64) & 0xFFFFFFFF)
        keep = triton_common._dropout_keep(key_seed, key_offset, b, i, head, j, dropout_p)
        tl.store(Keep + at, keep.to(tl.int8))

    return probe


@needs_triton
@pytest.mark.parametrize("key", [(0, 0), (12345, 678), (2**32 - 1, 2**31), (3_000_000_000, 7)],
                         ids=["zero", "small", "high-bits", "mixed"])
def test_torch_philox_equals_tritons(key, interpret):
    """tl.philox and tl.randint (Triton's own generator, interpreted) give the torch form's words,
    and the kernels' _dropout_keep (key words passed as int32 bit patterns) the torch keep mask."""
    rows, keys, b, head, p = 8, 32, 5, 3, 0.37
    words = torch.zeros(4, rows, keys, dtype=torch.int64)
    rand = torch.zeros(rows, keys, dtype=torch.int64)
    keep = torch.zeros(rows, keys, dtype=torch.int8)
    uniform = torch.zeros(rows, keys)
    call = PackedCall(*(torch.zeros(1),) * 5, spec=_spec_with_dropout(p), dropout_key=torch.tensor(key))
    _probe()[(1,)](words, uniform, rand, keep, *triton_common.dropout_key_args(call), b, head, p, ROWS=rows,
                   KEYS=keys)
    j, i = torch.arange(keys).view(1, -1), torch.arange(rows).view(-1, 1)
    expected = keyed_dropout.philox4x32_10(j, i, torch.tensor(head), torch.tensor(b), *key)
    for got, want in zip(words, expected):
        assert torch.equal(got, want.expand(rows, keys))
    flat = (i * keys + j)
    assert torch.equal(rand, keyed_dropout.philox4x32_10(flat, flat * 0, flat * 0, flat * 0, *key)[0])
    mask = keyed_dropout.keep_mask(torch.tensor(key), b, torch.tensor([head]), i.flatten(), j.flatten(), p)[0]
    assert torch.equal(keep.bool(), mask) and 0 < mask.sum() < mask.numel()
    assert torch.equal(uniform, keyed_dropout.uniform(expected[0].expand(rows, keys)))


def _spec_with_dropout(p):
    x = torch.zeros(2, 1, 4)
    return jagged_sdpa.explain(x, x, x, cu_of([2]), cu_of([2]), dropout_p=p).spec


def test_draw_key_is_two_uint32_words_from_the_default_generator():
    torch.manual_seed(7)
    a = keyed_dropout.draw_key()
    torch.manual_seed(7)
    b = keyed_dropout.draw_key()
    assert a.dtype == torch.int64 and a.shape == (2,) and a.device.type == "cpu" and torch.equal(a, b)
    draws = torch.stack([keyed_dropout.draw_key() for _ in range(200)])
    assert draws.min() >= 0 and draws.max() < 2**32 and draws.max() >= 2**31  # the full 32-bit range
    assert len({tuple(d) for d in draws.tolist()}) == 200


# ---------------------------------------------------------------------------------------------------
# statistics of the mask


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_within_binomial_bounds(p):
    mask = keyed_dropout.keep_mask(torch.tensor([99, 5]), 3, 2, torch.arange(64), torch.arange(128), p)
    n = mask.numel()
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(mask.sum().item() - n * (1 - p)) < 5 * sigma


def _both_kept_bound(a: torch.Tensor, b: torch.Tensor, p: float) -> None:
    """Independent Bernoulli(1 - p) masks are both kept at rate (1 - p)^2 (5 sigma)."""
    n = a.numel()
    q = (1 - p) ** 2
    both = (a & b).sum().item()
    assert abs(both - n * q) < 5 * math.sqrt(n * q * (1 - q)), (both, n * q)


def test_masks_are_independent_across_every_counter_word_and_the_key():
    """A mask must change with each counter word and each key word: neighbouring heads, rows,
    keys and sequences, swapped roles of i and j, swapped seed and offset. Each pair is compared
    as two independent draws would be; a word left out of the key makes the pair identical."""
    key, p, n = torch.tensor([2024, 11]), 0.5, 64
    rows, keys = torch.arange(n), torch.arange(n)
    m = keyed_dropout.keep_mask(key, 0, 2, rows, keys, p)
    _both_kept_bound(m[0], m[1], p)                                                       # heads
    _both_kept_bound(m[0, :-1], m[0, 1:], p)                                              # rows
    _both_kept_bound(m[0, :, :-1], m[0, :, 1:], p)                                        # keys
    _both_kept_bound(m[0], m[0].T, p)                                                     # i <-> j
    _both_kept_bound(m, keyed_dropout.keep_mask(key, 1, 2, rows, keys, p), p)             # sequences
    _both_kept_bound(m, keyed_dropout.keep_mask(torch.tensor([2024, 12]), 0, 2, rows, keys, p), p)
    _both_kept_bound(m, keyed_dropout.keep_mask(torch.tensor([11, 2024]), 0, 2, rows, keys, p), p)
    # The uniform values themselves: a chi-square over 32 equal bins (df 31, p < 1e-6 beyond 80).
    words = keyed_dropout.philox4x32_10(keys.view(1, -1), rows.view(-1, 1), torch.tensor(0), torch.tensor(0),
                                        2024, 11)[0]
    counts = torch.bincount((keyed_dropout.uniform(words) * 32).long().flatten(), minlength=32).double()
    expected = words.numel() / 32
    assert ((counts - expected) ** 2 / expected).sum().item() < 80


# ---------------------------------------------------------------------------------------------------
# the backends' masks, read off exactly


def _one_hot_values(lens_k, hkv, dtype=torch.float32):
    """v[key j of its sequence, head] = e_j, so out[i, h, j] = P_ij * Z_ij exposes the mask."""
    v = torch.zeros(sum(lens_k), hkv, max(lens_k + [1]), dtype=dtype)
    start = 0
    for n in lens_k:
        v[start + torch.arange(n), :, torch.arange(n)] = 1.0
        start += n
    return v


def _visible(len_q, len_k, causal, window):
    """(Lq, Lk) pairs a bottom-right aligned row sees (reference.keep_mask, vectorised)."""
    pos = torch.arange(len_q).view(-1, 1) + len_k - len_q
    j = torch.arange(len_k).view(1, -1)
    seen = torch.ones(len_q, len_k, dtype=torch.bool)
    if causal:
        seen &= j <= pos
    if window[0] >= 0:
        seen &= j >= pos - window[0]
    if window[1] >= 0:
        seen &= j <= pos + window[1]
    return seen


def _backend_masks(backend, q_lens, k_lens, hq, hkv, *, seed=11, **options):
    """Each sequence's (Hq, Lq, Lk) keep mask as ``backend`` applied it, and the visible-pair mask.
    Small scores keep every visible probability well above 0."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, 8, generator=gen) * 0.3
    k = torch.randn(sum(k_lens), hkv, 8, generator=gen) * 0.3
    v = _one_hot_values(k_lens, hkv)
    torch.manual_seed(seed)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_of(q_lens), cu_of(k_lens), dropout_p=P, backend=backend,
                                       **options)
    masks, visible, start = [], [], 0
    for lq, lk in zip(q_lens, k_lens):
        block = out[start:start + lq, :, :lk].permute(1, 0, 2)                       # (h, i, j)
        seen = _visible(lq, lk, options.get("causal", False), options.get("window_size", (-1, -1)))
        masks.append(block > 0)
        visible.append(seen.expand(hq, lq, lk))
        start += lq
    return masks, visible


def _expected_masks(q_lens, k_lens, hq, seed=11, first_b=0):
    torch.manual_seed(seed)
    key = keyed_dropout.draw_key()
    return [keyed_dropout.keep_mask(key, first_b + b, hq, torch.arange(lq), torch.arange(lk), P)
            for b, (lq, lk) in enumerate(zip(q_lens, k_lens))]


MASK_Q = [5, 0, 70, 1, 2, 19]
MASK_K = [9, 4, 70, 130, 0, 12]


@pytest.fixture
def small_split(monkeypatch):
    """The compiled kernel's smallest work split: items of 5 query rows, direct steps of 24 keys."""
    monkeypatch.setattr(native, "Q_CHUNK", 5)
    monkeypatch.setattr(native, "DIRECT_KEYS", 24)


def _assert_masks(backend, q_lens, k_lens, hq, hkv, **options):
    got, visible = _backend_masks(backend, q_lens, k_lens, hq, hkv, **options)
    for b, (mask, seen, want) in enumerate(zip(got, visible, _expected_masks(q_lens, k_lens, hq))):
        assert torch.equal(mask, want & seen), f"sequence {b}: {(mask != (want & seen)).sum()} pairs differ"


@pytest.mark.parametrize("backend", ["math", "cpu_fused"])
@pytest.mark.parametrize("options", [{}, {"causal": True, "window_size": (30, 0)}], ids=["plain", "causal-window"])
def test_mask_read_off_each_backend_is_the_keyed_mask(backend, options):
    if backend == "cpu_fused" and native.library() is None:
        pytest.skip(f"compiled kernel unavailable: {native.unavailable_reason()}")
    _assert_masks(backend, MASK_Q, MASK_K, 4, 2, **options)


@needs_kernel
def test_kernel_mask_ignores_threads_and_work_split(small_split):
    """Items of 5 rows and direct steps of 24 keys, on 1 and on 2 threads: the same mask."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            _assert_masks("cpu_fused", MASK_Q, MASK_K, 4, 2, causal=True)
    finally:
        torch.set_num_threads(threads)


@needs_triton
def test_triton_mask_is_the_keyed_mask(interpret):
    """Prefill tiles, and a decode-shaped call whose forward packs GQA heads and splits keys."""
    _assert_masks("triton", [5, 0, 12, 2], [9, 4, 12, 20], 4, 2, causal=True)
    _assert_masks("triton", [1, 0], [256, 5], 4, 2)


def test_packing_and_padding_leave_a_sequence_mask_alone():
    """Sequence b = 2 alone (empty sequences before it keep its index), packed with others around
    it, and with padded keys past seqused_k in a NaN-filled buffer: the same mask."""
    backend = "cpu_fused" if native.library() is not None else "math"
    alone, _ = _backend_masks(backend, [0, 0, 37], [0, 0, 50], 2, 1, seed=3)
    packed, _ = _backend_masks(backend, [4, 9, 37, 6], [7, 1, 50, 66], 2, 1, seed=3)
    assert torch.equal(alone[2], packed[2])
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(37, 2, 8, generator=gen) * 0.3
    k = torch.randn(50, 1, 8, generator=gen) * 0.3
    padded_k = torch.cat([k, torch.full((30, 1, 8), float("nan"))])
    v = torch.cat([_one_hot_values([50], 1), torch.full((30, 1, 50), float("nan"))])
    cu_q, cu_k = cu_of([0, 0, 37]), cu_of([0, 0, 80])
    torch.manual_seed(3)
    out = jagged_sdpa.varlen_attention(in_nan_buffer(q), in_nan_buffer(padded_k), in_nan_buffer(v), cu_q, cu_k,
                                       dropout_p=P, seqused_k=torch.tensor([0, 0, 50], dtype=torch.int32),
                                       backend=backend)
    assert torch.equal(out.permute(1, 0, 2) > 0, alone[2])


def test_a_sequence_index_is_part_of_the_key():
    masks = _expected_masks([16, 16], [16, 16], 2)
    assert not torch.equal(masks[0], masks[1])


# ---------------------------------------------------------------------------------------------------
# out, lse and gradients against the float64 reference applying the same mask


CASES = {
    "plain-gqa-empty-direct-rows": dict(hq=4, hkv=2),
    "causal-top-left": dict(causal=True, alignment="top_left"),
    "causal-bottom-right-mqa": dict(causal=True, hq=3, hkv=1),
    "window-softcap": dict(window_size=(6, 2), softcap=3.0),
    "alibi-causal": dict(alibi="per_batch_head", causal=True),
    "dv-ne-d-seqused": dict(d=24, dv=8, seqused=True),
    "paged-causal": dict(paged=16, causal=True),
}
REF_Q = [5, 0, 37, 1, 2, 19]
REF_K = [9, 4, 37, 70, 0, 12]
TRITON_Q = [5, 0, 12, 2]
TRITON_K = [9, 4, 20, 0]


def _call(backend, q, k, v, cu_q, cu_k, key, *, alignment="bottom_right", slopes=None, table=None, used=None,
          **options) -> PackedCall:
    """The validated call of ``backend`` with this dropout key and alignment; fails if ineligible."""
    e = jagged_sdpa.explain(q, k, v, cu_q, cu_k, dropout_p=P, alibi_slopes=slopes, block_table=table,
                            seqused_k=used, return_lse=True, backend=backend, **options)
    assert e.reasons[Backend(backend)] == [], e.reasons[Backend(backend)]
    return PackedCall(q, k, v, cu_q, cu_k, e.spec.replace(alignment=alignment), slopes, used, table,
                      dropout_key=key)


def _run_case(backend, case, dtype, q_lens, k_lens, key, grad_seed=0):
    """(out, lse, dq, dk, dv) of one backend, and the float64 reference's, for one case."""
    hq, hkv, d = case.get("hq", 2), case.get("hkv", 2), case.get("d", 16)
    dv = case.get("dv", d)
    gen = torch.Generator().manual_seed(grad_seed)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    options = {name: case[name] for name in ("causal", "window_size", "softcap") if name in case}
    slopes = alibi_slopes(case.get("alibi"), len(q_lens), hq, high=0.3, generator=gen)
    used = table = None
    if "paged" in case:
        k, v, table, used, k_ref, v_ref = paged_case(q_lens, k_lens, case["paged"], hkv, d, dtype)
        cu_k, cu_k_ref = None, cu_of(k_lens)
    else:
        pad = 3 if case.get("seqused") else 0   # keys past seqused_k: NaN, never read
        k_ref = torch.randn(sum(k_lens), hkv, d, generator=gen).to(dtype)
        v_ref = torch.randn(sum(k_lens), hkv, dv, generator=gen).to(dtype)
        k, v = k_ref, v_ref
        cu_k = cu_k_ref = cu_of(k_lens)
        if pad:
            k = torch.cat([torch.cat([k_ref[s:e], torch.full((pad, hkv, d), float("nan"), dtype=dtype)])
                           for s, e in zip(cu_k[:-1].tolist(), cu_k[1:].tolist())])
            v = torch.cat([torch.cat([v_ref[s:e], torch.full((pad, hkv, dv), float("nan"), dtype=dtype)])
                           for s, e in zip(cu_k[:-1].tolist(), cu_k[1:].tolist())])
            cu_k = cu_of([n + pad for n in k_lens])
            used = torch.tensor(k_lens, dtype=torch.int32)
    cu_q = cu_of(q_lens)
    grad_out = torch.randn(sum(q_lens), hq, dv, generator=gen).to(dtype)
    backward = not (backend == "triton" and "paged" in case)  # TRITON's paged cache is forward-only
    leaves = [x.detach().clone().requires_grad_(backward) for x in (q, k, v)]
    call = _call(backend, *leaves, cu_q, cu_k, key, alignment=case.get("alignment", "bottom_right"),
                 slopes=slopes, table=table, used=used, **options)
    if backend == "cpu_fused":  # the compiled kernel takes it
        assert not CpuFusedBackend.reasons(call.spec), CpuFusedBackend.reasons(call.spec)
    result = run(Backend(backend), call)
    grads = [None] * 3
    if backward:
        grads = torch.autograd.grad(result.out, leaves, grad_out)
        if "paged" in case:   # cache gradients, gathered like the reference's packed keys
            grads = [grads[0], *(_gather_cache(g, table, k_lens) for g in grads[1:])]
        elif used is not None:
            keep_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_k[:-1].tolist(), k_lens)])
            grads = [grads[0], grads[1][keep_rows], grads[2][keep_rows]]
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k_ref, v_ref)]
    keep = lambda b, lq, lk: keyed_dropout.keep_mask(key, b, hq, torch.arange(lq), torch.arange(lk), P)
    ref_out, ref_lse = attention_reference(
        *ref_leaves, cu_q, cu_k_ref, scale=call.spec.scale, causal=case.get("causal", False),
        alignment=case.get("alignment", "bottom_right"), window=case.get("window_size", (-1, -1)),
        softcap=case.get("softcap", 0.0), alibi_slopes=slopes, dropout_p=P, dropout_keep=keep)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, grad_out.double()) if backward else [None] * 3
    return (result.out, result.lse, *grads), (ref_out, ref_lse, *ref_grads), (cu_q, cu_k_ref)


def _gather_cache(grad, table, lens):
    bs = grad.shape[1]
    rows = [grad[int(table[b, j // bs]), j % bs] for b, n in enumerate(lens) for j in range(n)]
    return torch.stack(rows) if rows else grad.flatten(0, 1)[:0]


def _compare(got, ref, lowp, cus):
    cu_q, cu_k = cus
    names = ("out", "lse", "dq", "dk", "dv")
    for i, (name, x, r) in enumerate(zip(names, got, ref)):
        if x is None:
            continue
        if name == "lse":
            assert_close_lse(x, r)
            continue
        assert_close_packed(x, r, cu_seqlens=cu_q if name in ("out", "dq") else cu_k, name=name,
                            grad=name != "out", lowp_ref=None if lowp is None else lowp[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("name", list(CASES))
def test_math_and_kernel_match_the_reference_exactly(name, dtype):
    """MATH and the compiled kernel, forward and backward, against float64 with the same mask. In
    fp16/bf16 the kernel's bound widens to twice MATH's own error in that dtype."""
    key = torch.tensor([2**32 - 5, 123456789])
    got, ref, cus = _run_case("math", CASES[name], dtype, REF_Q, REF_K, key)
    _compare(got, ref, None, cus)
    if native.library() is not None:
        kernel, ref, cus = _run_case("cpu_fused", CASES[name], dtype, REF_Q, REF_K, key)
        _compare(kernel, ref, None if dtype == torch.float32 else got, cus)


# Every case in float32, one in float16 (the interpreter is slow; TRITON's bf16 is a CUDA test).
TRITON_RUNS = [(name, torch.float32) for name in CASES] + [("alibi-causal", torch.float16)]


@needs_triton
@pytest.mark.parametrize("name, dtype", TRITON_RUNS, ids=[f"{n}-{str(d)[6:]}" for n, d in TRITON_RUNS])
def test_triton_matches_the_reference_exactly(name, dtype, interpret):
    case = CASES[name]
    key = torch.tensor([77, 2**31 + 9])
    got, ref, cus = _run_case("triton", case, dtype, TRITON_Q, TRITON_K, key)
    lowp = None
    if dtype != torch.float32:
        lowp, _, _ = _run_case("math", case, dtype, TRITON_Q, TRITON_K, key)
    _compare(got, ref, lowp, cus)


# ---------------------------------------------------------------------------------------------------
# reproducibility


def test_manual_seed_reproduces_and_explain_draws_nothing():
    q = torch.randn(20, 2, 8)
    cu = cu_of([20])
    backends = ["math"] + (["cpu_fused"] if native.library() is not None else [])
    outs = {}
    for backend in backends:
        torch.manual_seed(5)
        first = jagged_sdpa.varlen_attention(q, q, q, cu, cu, dropout_p=P, backend=backend)
        torch.manual_seed(5)
        jagged_sdpa.explain(q, q, q, cu, cu, dropout_p=P)   # leaves the generator alone
        again = jagged_sdpa.varlen_attention(q, q, q, cu, cu, dropout_p=P, backend=backend)
        other = jagged_sdpa.varlen_attention(q, q, q, cu, cu, dropout_p=P, backend=backend)
        assert torch.equal(first, again) and not torch.allclose(first, other)
        outs[backend] = first
    for backend in backends[1:]:
        torch.testing.assert_close(outs[backend], outs["math"])   # the same mask in both


@needs_kernel
def test_kernel_refuses_a_dropout_p_outside_zero_one():
    q = torch.randn(4, 1, 8)
    call = _call("cpu_fused", q, q, q, cu_of([4]), cu_of([4]), torch.tensor([1, 2]))
    out, lse = torch.empty(4, 1, 8), torch.empty(1, 4)
    with pytest.raises(RuntimeError, match="code 4"):
        native.forward(call.replace(spec=call.spec.replace(dropout_p=1.0)), out, lse)


def test_a_backend_call_without_its_key_is_refused():
    """Only the public functions draw keys: a call built elsewhere without one fails loudly."""
    q = torch.randn(4, 1, 8)
    call = _call("math", q, q, q, cu_of([4]), cu_of([4]), None)
    with pytest.raises(RuntimeError, match="dropout_key"):
        IMPLS[Backend.MATH].forward(call)
