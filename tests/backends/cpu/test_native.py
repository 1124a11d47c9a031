"""The compiled CPU kernel (``backends/cpu/native.py``, ``csrc/attention.cpp``) against the float64
reference, on shapes that reach every path of it: several key blocks of 64 and query chunks per
sequence, micro-tiles of 1..6 rows, masked and unmasked blocks, head dims that are not multiples
of 16, Dv != D, GQA/MQA, direct rows (decoding) over several key steps, rows that see no key,
strided inputs inside NaN buffers; plus its build, its switch and its thread independence.
(test_backend_cpu.py runs its option x dtype matrix through the kernel too.)
"""

from __future__ import annotations

import shutil

import pytest
import torch

import jagged_sdpa
from jagged_sdpa import Backend
from jagged_sdpa.backends.cpu import native
from support.cases import alibi_slopes, cu_of, in_nan_buffer, paged_case
from support.kernel_calls import assert_math_takes_over, kernel_backward, kernel_forward, math_forward, packed_call
from support.reference import attention_reference, keep_mask
from support.tolerances import assert_close_lse, assert_close_packed

CPU = Backend.CPU_FUSED
LOWP = (torch.float16, torch.bfloat16)

pytestmark = pytest.mark.skipif(native.library() is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the compiled kernel cannot be built here")

# Long enough for several key blocks (64) and, with Q_CHUNK shrunk, several work items per
# sequence; with empty query and key sequences, length 1 and 2 (direct rows), and Lq != Lk.
Q_LENS = [130, 0, 1, 67, 2, 9, 200]
K_LENS = [130, 5, 70, 0, 300, 140, 65]

OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (40, 7)},
    "causal_window": {"causal": True, "window_size": (70, 0)},
    "softcap": {"softcap": 3.0},
    "alibi_batch_causal": {"alibi_slopes": "per_batch_head", "causal": True},
    "softcap_alibi_window": {"softcap": 2.0, "alibi_slopes": "per_head", "window_size": (90, 20)},
}


@pytest.fixture(params=["shipped_split", "small_split"])
def split(request, monkeypatch):
    """The shipped work split, and a tiny one: work items of 5 query rows (tails of every tile
    size), direct rows up to 2 queries, direct steps of 24 keys."""
    assert native.library() is not None, native.unavailable_reason()
    if request.param == "small_split":
        monkeypatch.setattr(native, "Q_CHUNK", 5)
        monkeypatch.setattr(native, "DIRECT_KEYS", 24)
    return request.param


def _check(q_lens, k_lens, hq, hkv, d, dv, dtype, opts, wrap=lambda t: t):
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    k = torch.randn(sum(k_lens), hkv, d).to(dtype)
    v = torch.randn(sum(k_lens), hkv, dv).to(dtype)
    slopes = alibi_slopes(opts.get("alibi_slopes"), len(q_lens), hq, high=0.3)
    call = {key: val for key, val in opts.items() if key != "alibi_slopes"}
    cu_q, cu_k = cu_of(q_lens), cu_of(k_lens)
    out, lse = jagged_sdpa.varlen_attention(wrap(q), wrap(k), wrap(v), cu_q, cu_k, alibi_slopes=slopes,
                                            return_lse=True, backend=CPU, **call)
    ref_out, ref_lse = attention_reference(
        q, k, v, cu_q, cu_k, scale=opts.get("softmax_scale"), causal=opts.get("causal", False),
        alignment="bottom_right", window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0),
        alibi_slopes=slopes)
    lowp = None
    if dtype in LOWP:
        lowp = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes, backend=Backend.MATH, **call)
    assert out.dtype == dtype and out.shape == (sum(q_lens), hq, dv)
    assert_close_packed(out, ref_out, cu_seqlens=cu_q, lowp_ref=lowp)
    assert_close_lse(lse, ref_lse)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_and_dtype_matches_reference(name, dtype, split):
    _check(Q_LENS, K_LENS, 4, 2, 40, 40, dtype, OPTIONS[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 1), (6, 2)], ids=["mha", "mqa", "gqa3"])
@pytest.mark.parametrize("dims", [(16, 16), (64, 64), (24, 40), (80, 8), (7, 3)], ids=lambda t: f"d{t[0]}_dv{t[1]}")
def test_head_dims_and_gqa(heads, dims, dtype, split):
    """Odd head dims and value dims that are not multiples of 16 (bf16 pairs elements: odd D pads)."""
    _check(Q_LENS, K_LENS, *heads, *dims, dtype, {"causal": True, "window_size": (100, -1)})


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_sdpa_njt_alignments_through_the_kernel(alignment, split):
    q_lens, k_lens = [70, 1, 33], [70, 90, 20]
    parts = lambda lens: [torch.randn(n, 2, 16) for n in lens]
    qs, ks, vs = parts(q_lens), parts(k_lens), parts(k_lens)
    njt = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged).transpose(1, 2)
    out = jagged_sdpa.sdpa(njt(qs), njt(ks), njt(vs), is_causal=True, causal_alignment=alignment, backend=CPU)
    ref, _ = attention_reference(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_of(q_lens), cu_of(k_lens),
                                 causal=True, alignment=alignment)
    assert_close_packed(out.transpose(1, 2).values(), ref, cu_seqlens=cu_of(q_lens))


def test_rows_that_see_no_key_are_zero_with_minus_inf_lse(split):
    # Lq > Lk bottom-right: the first rows see no key; a window leaves rows empty in the middle.
    out, lse = _check([9, 4, 120], [3, 0, 120], 2, 2, 16, 16, torch.float32, {"causal": True})
    assert torch.isfinite(out).all()
    assert (out[:6] == 0).all() and torch.isinf(lse[:, :6]).all() and (lse[:, :6] < 0).all()
    assert (out[9:13] == 0).all() and (lse[:, 9:13] == float("-inf")).all()
    out, lse = _check([100], [100], 2, 2, 16, 16, torch.float32, {"window_size": (-1, -1)})
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_strided_inputs_in_nan_buffers_are_never_read_outside(dtype, split):
    for opts in ({}, {"causal": True, "window_size": (50, 3)}, {"softcap": 4.0, "alibi_slopes": "per_head"}):
        _check(Q_LENS, K_LENS, 4, 2, 24, 24, dtype, opts, wrap=in_nan_buffer)


def test_decode_rows_over_many_key_steps(split):
    """Direct rows (one query each) with GQA and every option, one of them past 2 key steps."""
    q_lens, k_lens = [1] * 5, [1, 40, 300, 77, 0]
    for opts in OPTIONS.values():
        _check(q_lens, k_lens, 8, 2, 64, 64, torch.float32, opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_rows_with_wide_kv_heads_take_short_key_steps(dtype, split):
    """32 kv heads of D=128 (16 KB of K per key in float32): a direct row's steps shrink to 16-32 keys
    so that a step's K stays in L2 (DIRECT_STEP_BYTES); many steps, every option, against float64."""
    q_lens, k_lens = [1] * 4, [1, 300, 77, 0]
    for opts in OPTIONS.values():
        _check(q_lens, k_lens, 32, 32, 128, 128, dtype, opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_threads_do_not_change_a_bit(split, dtype):
    """Forward (out, lse) and backward (dq, dk, dv) on one thread and on two: the same bits."""
    q = torch.randn(sum(Q_LENS), 4, 32).to(dtype).requires_grad_()
    k = torch.randn(sum(K_LENS), 4, 32).to(dtype).requires_grad_()
    v = torch.randn(sum(K_LENS), 4, 32).to(dtype).requires_grad_()
    dout = torch.randn(sum(Q_LENS), 4, 32).to(dtype)

    def run():
        out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_of(Q_LENS), cu_of(K_LENS), causal=True,
                                                return_lse=True, backend=CPU)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        return (out, lse, *grads)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_bf16_runs_on_the_widest_tiles_this_cpu_has():
    """bf16 inputs run on AMX tiles (forward and backward) where the CPU has AMX (amx_bf16 in
    /proc/cpuinfo: Linux offers the tile state), on vdpbf16ps tiles (forward and backward) where it
    has AVX512-BF16 alone, else on float32 FMAs: the bf16 tests here ran on this CPU's best tiles.
    test_portable_build.py runs them on the other two."""
    lib = native.library()
    if lib is None or native.target_arch() != "native":
        pytest.skip("the compiled kernel is not the native build")
    flags = set(native._cpu_flags().split())
    if {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"} <= flags:
        expected = 2
    elif {"avx512_bf16", "avx512bw"} <= flags:
        expected = 1
    else:
        expected = 0
    assert lib.js_bf16_tiles() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("name", ["plain", "causal", "softcap_alibi_window"])
def test_paged_cache_prefill_and_decode(name, block_size, dtype, split):
    """Keys read through a shuffled block table (NaN elsewhere, a block shared by two sequences):
    prefill chunks, decode rows and an empty sequence in one call."""
    opts = OPTIONS[name]
    q_lens, used = [70, 1, 2, 1, 9], [150, 77, 40, 0, 9]
    k_cache, v_cache, table, seqused, pk, pv = paged_case(q_lens, used, block_size, 2, 24, dtype,
                                                          shared_first_block=True)
    q = torch.randn(sum(q_lens), 4, 24).to(dtype)
    slopes = alibi_slopes(opts.get("alibi_slopes"), len(q_lens), 4, high=0.3)
    call = {key: val for key, val in opts.items() if key != "alibi_slopes"}
    explained = jagged_sdpa.explain(q, k_cache, v_cache, cu_of(q_lens), None, block_table=table, seqused_k=seqused,
                                    **call)
    assert explained.chosen == CPU, explained
    out, lse = jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_of(q_lens), None, alibi_slopes=slopes,
                                            block_table=table, seqused_k=seqused, return_lse=True, backend=CPU,
                                            **call)
    ref_out, ref_lse = attention_reference(
        q, pk, pv, cu_of(q_lens), cu_of(used), causal=opts.get("causal", False), alignment="bottom_right",
        window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0), alibi_slopes=slopes)
    lowp = None
    if dtype == torch.bfloat16:
        lowp = jagged_sdpa.varlen_attention(q, pk, pv, cu_of(q_lens), cu_of(used), alibi_slopes=slopes,
                                            backend=Backend.MATH, **call)
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(q_lens), lowp_ref=lowp)
    assert_close_lse(lse, ref_lse)


GRAD_Q_LENS = [130, 0, 1, 67, 9, 3]
GRAD_K_LENS = [130, 5, 70, 0, 140, 2]


def _backward_matches_reference(q, k, v, opts):
    """The kernel's gradients of one call over GRAD_Q_LENS / GRAD_K_LENS against float64, within 3x
    the error of the same call on MATH in the same dtype (fp16/bf16), all finite."""
    dtype, hq = q.dtype, q.shape[1]
    slopes = alibi_slopes(opts.get("alibi_slopes"), len(GRAD_Q_LENS), hq, high=0.3)
    call = {key: val for key, val in opts.items() if key != "alibi_slopes"}
    cu_q, cu_k = cu_of(GRAD_Q_LENS), cu_of(GRAD_K_LENS)
    assert jagged_sdpa.explain(q, k, v, cu_q, cu_k, **call).chosen == CPU
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes, backend=CPU, **call)
    grad = torch.randn_like(out)
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, cu_q, cu_k, causal=opts.get("causal", False), alignment="bottom_right",
                                 window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0),
                                 alibi_slopes=None if slopes is None else slopes.double())
    ref.backward(grad.double())
    lowp = {}
    if dtype in LOWP:  # the same call on MATH in the same dtype: the low-precision error allowed
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        jagged_sdpa.varlen_attention(q2, k2, v2, cu_q, cu_k, alibi_slopes=slopes, backend=Backend.MATH,
                                     **call).backward(grad)
        lowp = {"dq": q2.grad, "dk": k2.grad, "dv": v2.grad}
    for name_, got, want, cu in (("dq", q.grad, q64.grad, cu_q), ("dk", k.grad, k64.grad, cu_k),
                                 ("dv", v.grad, v64.grad, cu_k)):
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert_close_packed(got, want, cu_seqlens=cu, name=name_, grad=True, lowp_ref=lowp.get(name_))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_backward_matches_reference(name, dtype):
    """The kernel's backward (several key blocks and row chunks of 64, GQA, D = 40) against float64."""
    hq, hkv, d = 4, 2, 40
    q, k, v = (torch.randn(sum(lens), h, d).to(dtype).requires_grad_(True)
               for lens, h in ((GRAD_Q_LENS, hq), (GRAD_K_LENS, hkv), (GRAD_K_LENS, hkv)))
    _backward_matches_reference(q, k, v, OPTIONS[name])


@pytest.mark.parametrize("dims", [(16, 16), (64, 64), (24, 40), (7, 3)], ids=lambda t: f"d{t[0]}_dv{t[1]}")
@pytest.mark.parametrize("heads", [(4, 4), (6, 1)], ids=["mha", "mqa"])
def test_backward_head_dims_gqa_and_nan_buffers(heads, dims):
    hq, hkv = heads
    d, dv = dims
    q, k, v = (torch.randn(sum(lens), h, e) for lens, h, e in
               ((GRAD_Q_LENS, hq, d), (GRAD_K_LENS, hkv, d), (GRAD_K_LENS, hkv, dv)))
    leaves = [in_nan_buffer(t).requires_grad_(True) for t in (q, k, v)]
    views = [t for t in leaves]
    cu_q, cu_k = cu_of(GRAD_Q_LENS), cu_of(GRAD_K_LENS)
    out = jagged_sdpa.varlen_attention(*views, cu_q, cu_k, causal=True, window_size=(50, -1), backend=CPU)
    grad = in_nan_buffer(torch.randn(out.shape))
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, cu_q, cu_k, causal=True, alignment="bottom_right", window=(50, -1))
    ref.backward(grad.double())
    for name_, got, want, cu in (("dq", leaves[0].grad, q64.grad, cu_q), ("dk", leaves[1].grad, k64.grad, cu_k),
                                 ("dv", leaves[2].grad, v64.grad, cu_k)):
        assert torch.isfinite(got).all()
        assert_close_packed(got, want, cu_seqlens=cu, name=name_, grad=True)


@pytest.mark.parametrize("dims", [(1, 1), (24, 40), (33, 21), (72, 72), (80, 8), (200, 96)],
                         ids=lambda t: f"d{t[0]}_dv{t[1]}")
@pytest.mark.parametrize("heads", [(6, 2), (6, 1)], ids=["gqa3", "mqa"])
@pytest.mark.parametrize("opts", [{"causal": True, "window_size": (50, -1)},
                                  {"softcap": 2.0, "alibi_slopes": "per_head", "window_size": (90, 20)}],
                         ids=["causal_window", "softcap_alibi_window"])
def test_bf16_backward_head_dims_and_gqa(opts, heads, dims):
    """The bf16 backward's products (vdpbf16ps or AMX tiles: P and dS rounded to bf16, sums float32)
    at head dims that are no multiple of 16 or 32 (a zero beside the last element pair), Dv != D,
    GQA and MQA, odd chunks of rows (67, 9, 3: a half pair over rows), against float64 within 3x
    MATH's own bf16 error."""
    hq, hkv = heads
    d, dv = dims
    q, k, v = (torch.randn(sum(lens), h, e).to(torch.bfloat16).requires_grad_(True)
               for lens, h, e in ((GRAD_Q_LENS, hq, d), (GRAD_K_LENS, hkv, d), (GRAD_K_LENS, hkv, dv)))
    _backward_matches_reference(q, k, v, opts)


def _paged_grad_case(dtype, block_size, d=24, dv=16, hq=4, hkv=2):
    """A paged call for the backward: sequences 0 and 1 share two full blocks (prefix caching),
    sequence 4 (one decode row) shares sequence 0's first block partly, sequence 2 lists one block
    twice, sequence 3 has no query (its blocks get nothing from it), sequence 5 no key. NaN in every
    slot no sequence reads; block ids shuffled."""
    q_lens, k_lens = [20, 9, 5, 0, 1, 3], [150, 100, 2 * block_size, 40, 9, 0]
    need = [-(-n // block_size) for n in k_lens]
    ids = torch.randperm(sum(need) + 3).tolist()
    rows = []
    for b, n in enumerate(need):
        row = [ids.pop() for _ in range(n)]
        if b == 1:
            row[:2] = rows[0][:2]
        if b == 2:
            row[1] = row[0]
        if b in (3, 4):
            row[0] = rows[0][0]
        rows.append(row)
    table = torch.tensor([row + [-1] * (max(need) - len(row)) for row in rows], dtype=torch.int32)
    num_blocks = max(max(row) for row in rows if row) + 2
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    v_cache = torch.full((num_blocks, block_size, hkv, dv), float("nan"))
    slots = []
    for b, n in enumerate(k_lens):
        slots += [rows[b][j // block_size] * block_size + j % block_size for j in range(n)]
    slots = torch.tensor(slots, dtype=torch.long)
    k_cache.flatten(0, 1)[slots] = torch.randn(len(slots), hkv, d)
    v_cache.flatten(0, 1)[slots] = torch.randn(len(slots), hkv, dv)
    q = torch.randn(sum(q_lens), hq, d)
    return [t.to(dtype) for t in (q, k_cache, v_cache)], table, q_lens, k_lens, slots


PAGED_GRAD_OPTIONS = {"causal": {"causal": True},
                      "softcap_alibi_window": {"softcap": 2.0, "alibi_slopes": "per_head", "window_size": (60, 5)}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("name,block_size", [("causal", 16), ("softcap_alibi_window", 24)])
def test_paged_backward_accumulates_shared_blocks(name, block_size, dtype):
    """The kernel's backward reads the cache through the block table and writes cache-shaped
    dK/dV: blocks several sequences read (or one reads twice) get the sum, blocks and slots no
    sequence reads 0; against float64 autograd through a plain gather from the cache. The same
    bits twice and with 1 or 2 threads."""
    opts = PAGED_GRAD_OPTIONS[name]
    (q, k_cache, v_cache), table, q_lens, k_lens, slots = _paged_grad_case(dtype, block_size)
    slopes = alibi_slopes(opts.get("alibi_slopes"), len(q_lens), 4, high=0.3)
    call = {key: val for key, val in opts.items() if key != "alibi_slopes"}
    cu_q, used = cu_of(q_lens), torch.tensor(k_lens, dtype=torch.int32)
    paged = dict(block_table=table, seqused_k=used, alibi_slopes=slopes, **call)
    assert jagged_sdpa.explain(q.requires_grad_(True), k_cache, v_cache, cu_q, None, **paged).chosen == CPU
    grad = torch.randn(sum(q_lens), 4, 16).to(dtype)

    def run(backend=CPU):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k_cache, v_cache)]
        out = jagged_sdpa.varlen_attention(*leaves, cu_q, None, backend=backend, **paged)
        out.backward(grad)
        return [out] + [t.grad for t in leaves]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        runs = [run(), run()]
        torch.set_num_threads(1)
        runs.append(run())
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    out, dq, dkc, dvc = runs[0]

    q64, kc64, vc64 = (t.detach().double().requires_grad_(True) for t in (q, k_cache, v_cache))
    ref, _ = attention_reference(q64, kc64.flatten(0, 1)[slots], vc64.flatten(0, 1)[slots], cu_q, cu_of(k_lens),
                                 causal=opts.get("causal", False), alignment="bottom_right",
                                 window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0),
                                 alibi_slopes=None if slopes is None else slopes.double())
    ref.backward(grad.double())
    lowp = {}
    if dtype in LOWP:  # MATH's paged backward in the same dtype: the low-precision error allowed
        lowp = dict(zip(("out", "dq", "dk", "dv"), run(Backend.MATH)))
    assert_close_packed(out, ref, cu_seqlens=cu_q, lowp_ref=lowp.get("out"))
    assert_close_packed(dq, q64.grad, cu_seqlens=cu_q, name="dq", grad=True, lowp_ref=lowp.get("dq"))
    flat = list(range(dkc.shape[0] * block_size + 1))
    for name_, got, want in (("dk_cache", dkc, kc64.grad), ("dv_cache", dvc, vc64.grad)):
        assert got.shape == want.shape and got.dtype == dtype
        lp = lowp.get(name_[:2])
        assert_close_packed(got.flatten(0, 1), want.flatten(0, 1), cu_seqlens=flat, name=name_, grad=True,
                            lowp_ref=None if lp is None else lp.flatten(0, 1))
    unread = torch.ones(dkc.shape[0] * block_size, dtype=torch.bool)
    unread[slots] = False
    assert not dkc.flatten(0, 1)[unread].any() and not dvc.flatten(0, 1)[unread].any()


# ----------------------------------------------------------------------------------------------
# build and switch


def test_switched_off_by_environment_falls_back_and_explains(monkeypatch):
    monkeypatch.setenv("JAGGED_SDPA_NATIVE", "0")
    native.reset()
    try:
        assert native.library() is None
        assert native.unavailable_reason() == "disabled by JAGGED_SDPA_NATIVE=0"
        assert_math_takes_over("compiled kernel unavailable (disabled by JAGGED_SDPA_NATIVE=0)")
    finally:
        monkeypatch.delenv("JAGGED_SDPA_NATIVE")
        native.reset()
    assert native.library() is not None


def test_missing_compiler_is_a_reason_not_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("JAGGED_SDPA_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    native.reset()
    try:
        assert native.library() is None
        assert "no C++ compiler" in native.unavailable_reason()
        assert_math_takes_over("compiled kernel unavailable (no C++ compiler: CXX=no-such-compiler not found)")
    finally:
        monkeypatch.undo()
        native.reset()


def test_unwritable_cache_is_a_reason_not_an_error(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("JAGGED_SDPA_CACHE", str(blocker / "cache"))
    native.reset()
    try:
        assert native.library() is None
        assert "cannot write the build cache" in native.unavailable_reason()
        assert_math_takes_over("compiled kernel unavailable (cannot write the build cache")
    finally:
        monkeypatch.undo()
        native.reset()


def test_huge_head_dims_go_to_math():
    d = native.MAX_HEAD_DIM + 1
    assert_math_takes_over(f"head_dim {d} > {native.MAX_HEAD_DIM}", head_dim=d)


def test_backward_scratch_bound_is_a_reason_for_gradient_calls_only(monkeypatch):
    """A backward whose per-item scratch would pass the bound refuses calls that need a gradient
    (forward and backward must run on one backend) and keeps inference calls."""
    x = torch.randn(12, 2, 16)
    cu = cu_of([5, 7])
    monkeypatch.setattr(native, "BACKWARD_ITEM_BYTES", 7 * 48 * 4 - 1)  # 7 rows of q, dO, dQ (D = 16)
    assert jagged_sdpa.explain(x, x, x, cu, cu).chosen == CPU
    assert_math_takes_over("gradient needed: the backward's scratch for one sequence and KV head would take")
    monkeypatch.setattr(native, "BACKWARD_ITEM_BYTES", 7 * 48 * 4)
    assert jagged_sdpa.explain(x.requires_grad_(True), x, x, cu, cu).chosen == CPU


def test_builds_into_its_cache_once(monkeypatch, tmp_path):
    """An empty cache gets one library, which loads; the next load takes it from the cache without
    a second build (nor a stray file). The compiler is a stand-in that logs its arguments and copies
    the suite's own library (the same g++ with the same flags built it, and every kernel test loads
    it) to where ``-o`` points: the build's bookkeeping is what is tested here, not a second ~40 s
    compile of the same source."""
    built = native.library_path()
    assert built is not None, native.unavailable_reason()
    real = native._compiler()
    runs = tmp_path / "runs"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then exec {real} --version; fi\n'
                   f'echo "$@" >> {runs}\n'
                   'out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
                   f'cp {built} "$out"\n')
    cxx.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("JAGGED_SDPA_CACHE", str(cache))
    monkeypatch.setenv("CXX", str(cxx))
    native.reset()
    try:
        assert native.library() is not None, native.unavailable_reason()
        built = list(cache.glob("attention-*.so"))
        assert len(built) == 1 and native.library_path() == built[0]
        assert runs.read_text().split() == [*native._flags(native.target_arch())[0], "-o",
                                            runs.read_text().split()[-2], str(native.SOURCE)]
        stamp = built[0].stat().st_mtime_ns
        native.reset()
        assert native.library() is not None
        assert built[0].stat().st_mtime_ns == stamp and list(cache.glob("*")) == built
        assert len(runs.read_text().splitlines()) == 1
    finally:
        monkeypatch.undo()
        native.reset()


# ----------------------------------------------------------------------------------------------
# key ranges at and past the ends of the keys (issue 11)

# Lq > Lk (top-left windows start past the last key), Lk = 0 under queries, Lq = 0, decode rows,
# several key blocks and query chunks.
EDGE_Q_LENS = [10, 3, 0, 70, 2, 40, 1, 9]
EDGE_K_LENS = [2, 0, 4, 3, 70, 100, 0, 150]
INT64_MAX = (1 << 63) - 1
EDGE_WINDOWS = [(0, 0), (3, 0), (0, 2), (5, 5), (1 << 40, 0), (0, 1 << 40), (INT64_MAX, INT64_MAX), (-1, 0),
                (0, -1), (-1, -1)]


def _edge_check(alignment, causal, window, dtype, hq=2, hkv=1, d=24):
    q = torch.randn(sum(EDGE_Q_LENS), hq, d).to(dtype)
    k = torch.randn(sum(EDGE_K_LENS), hkv, d).to(dtype)
    v = torch.randn(sum(EDGE_K_LENS), hkv, d).to(dtype)
    cu_q, cu_k = cu_of(EDGE_Q_LENS), cu_of(EDGE_K_LENS)
    # Keys inside a buffer of NaN rows: a read past a sequence's last key turns its rows NaN.
    ka, va = in_nan_buffer(k, extra_rows=80), in_nan_buffer(v, extra_rows=80)
    call = packed_call(q, ka, va, cu_q, cu_k, alignment=alignment, causal=causal, window_size=window)
    out, lse = kernel_forward(call)
    ref_out, ref_lse = attention_reference(q, k, v, cu_q, cu_k, causal=causal, alignment=alignment, window=window)
    lowp = math_forward(call) if dtype in LOWP else None
    assert_close_packed(out, ref_out, cu_seqlens=cu_q, lowp_ref=lowp)
    assert_close_lse(lse, ref_lse)
    empty = torch.isinf(ref_lse).T
    assert (out[empty] == 0).all()
    return call, out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_windows_past_the_keys_match_reference(alignment, causal, dtype, split):
    """Every row's key range is clamped to [0, Lk): a top-left window starting past the last key
    (it read the keys after the sequence: NaN rows, or a segfault with Lk = 0), Lq > Lk
    bottom-right (positions before the first key), windows up to INT64_MAX (no overflow)."""
    for window in EDGE_WINDOWS:
        _edge_check(alignment, causal, window, dtype)


def test_backward_windows_past_the_keys_match_reference():
    for alignment in ("top_left", "bottom_right"):
        for window in [(0, 0), (3, 1), (INT64_MAX, 0), (-1, -1)]:
            call, out, lse = _edge_check(alignment, True, window, torch.float32)
            grad = torch.randn(out.shape)
            dq, dk, dv = kernel_backward(call, out, lse, grad)
            q64, k64, v64 = (t.detach().double().contiguous().requires_grad_(True) for t in (call.q, call.k, call.v))
            ref, _ = attention_reference(q64, k64, v64, call.cu_seqlens_q, call.cu_seqlens_k, causal=True,
                                         alignment=alignment, window=window)
            ref.backward(grad.double())
            for name_, got, want, cu in (("dq", dq, q64.grad, call.cu_seqlens_q), ("dk", dk, k64.grad, call.cu_seqlens_k),
                                         ("dv", dv, v64.grad, call.cu_seqlens_k)):
                assert_close_packed(got, want, cu_seqlens=cu, name=name_, grad=True)


def test_issue_repros_window_past_keys_through_sdpa():
    """The issue's two repros: a key NJT whose values sit in a NaN buffer (every row came out NaN),
    and an empty key sequence under three queries (segfault)."""
    buf = torch.full((64, 1, 8), float("nan"))
    buf[:2] = torch.randn(2, 1, 8)
    qv = torch.randn(10, 1, 8)
    q = torch.nested.nested_tensor_from_jagged(qv, torch.tensor([0, 10])).transpose(1, 2)
    k = torch.nested.nested_tensor_from_jagged(buf[:2], torch.tensor([0, 2])).transpose(1, 2)
    out = jagged_sdpa.sdpa(q, k, k, window_size=(0, 0), backend=CPU).transpose(1, 2).values()
    ref, _ = attention_reference(qv, buf[:2], buf[:2], [0, 10], [0, 2], window=(0, 0))
    assert_close_packed(out, ref, cu_seqlens=[0, 10])
    assert (out[2:] == 0).all()
    q = torch.nested.nested_tensor_from_jagged(torch.randn(3, 1, 8), torch.tensor([0, 3])).transpose(1, 2)
    k = torch.nested.nested_tensor_from_jagged(torch.randn(0, 1, 8), torch.tensor([0, 0])).transpose(1, 2)
    assert (jagged_sdpa.sdpa(q, k, k, window_size=(0, 0), backend=CPU).values() == 0).all()


# ----------------------------------------------------------------------------------------------
# NaN propagation (issue 11): NaN that enters a visible score or value gives NaN, as in dense SDPA


def _nan_case(where, dtype, q_lens=(70, 2, 1, 9, 40), k_lens=(100, 70, 0, 3, 90)):
    """q, k, v with one NaN element: in query row 1 of the first sequence (head 1), or in key 40
    of the first sequence (kv head 0), which causal rows < 40 do not see."""
    hq, hkv, d = 4, 2, 24
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    k = torch.randn(sum(k_lens), hkv, d).to(dtype)
    v = torch.randn(sum(k_lens), hkv, d).to(dtype)
    t, index = {"q": (q, (1, 1, 5)), "k": (k, (40, 0, 5)), "v": (v, (40, 0, 5))}[where]
    t[index] = float("nan")
    return q, k, v, cu_of(q_lens), cu_of(k_lens)


def _assert_nan_between(got, must, may, name):
    """NaN exactly somewhere between must (NaN the input reaches through a visible score or value)
    and may (NaN in the float64 reference, whose matmuls also multiply masked zeros by NaN)."""
    nan = torch.isnan(got)
    if got.dim() == 3:
        nan = nan.any(-1)
    assert (nan | ~must).all(), f"{name}: NaN lost at {(~nan & must).nonzero()[:5].tolist()}"
    assert (~nan | may).all(), f"{name}: NaN where the reference has none at {(nan & ~may).nonzero()[:5].tolist()}"


def _finite_close(got, want, cu, name, grad=False, lowp=None):
    """got against want on the rows where neither is NaN (the NaN rows were checked by
    _assert_nan_between)."""
    keep = ~(torch.isnan(got).any(-1, keepdim=True) | torch.isnan(want).any(-1, keepdim=True))
    assert torch.isfinite(got[keep.expand_as(got)]).all(), f"{name}: inf"
    mask = lambda t: None if t is None else torch.where(keep, t.double().nan_to_num(0.0), 0.0)
    assert_close_packed(torch.where(keep, got, 0).to(got.dtype), mask(want), cu_seqlens=cu, name=name, grad=grad,
                        lowp_ref=mask(lowp))


def _sees(cu_q, cu_k, causal, total_q, total_k):
    """Boolean (total_q, total_k): packed query row i sees packed key j (bottom-right)."""
    sees = torch.zeros(total_q, total_k, dtype=torch.bool)
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        sees[qs:qe, ks:ke] = keep_mask(qe - qs, ke - ks, causal=causal, alignment="bottom_right", window=(-1, -1))
    return sees


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_in_a_visible_score_or_value_is_nan(where, causal, dtype, split):
    """A NaN query row came out 0 with lse -inf (a NaN score read as "masked"). Now: a NaN in q
    (its row), in k (the rows that see the key) or in v (the rows that see it; others may take
    0 * NaN as the reference does) is NaN in out, and in lse for q and k; rows that see no key
    stay exactly 0 / -inf; everything else matches the float64 reference."""
    q, k, v, cu_q, cu_k = _nan_case(where, dtype)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, backend=CPU)
    ref_out, ref_lse = attention_reference(q, k, v, cu_q, cu_k, causal=causal, alignment="bottom_right")
    sees = _sees(cu_q, cu_k, causal, q.shape[0], k.shape[0])
    group = q.shape[1] // k.shape[1]
    must = torch.zeros(q.shape[0], q.shape[1], dtype=torch.bool)
    if where == "q":
        must[1, 1] = sees[1].any()
    else:
        must[:, :group] = sees[:, 40:41]
    _assert_nan_between(out, must, torch.isnan(ref_out).any(-1), "out")
    lse_must = must if where != "v" else torch.zeros_like(must)
    _assert_nan_between(lse.T, lse_must, torch.isnan(ref_lse).T, "lse")
    if where != "v":
        assert torch.equal(torch.isnan(out).any(-1), torch.isnan(ref_out).any(-1))
    empty = ~sees.any(1)
    assert (out[empty] == 0).all() and (lse.T[empty] == float("-inf")).all()
    lowp = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, backend="math") if dtype in LOWP else None
    _finite_close(out, ref_out, cu_q, "out", lowp=lowp)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_nan_in_a_visible_score_or_value_is_nan(where, causal):
    """The backward of the same calls: the NaN reaches the gradients of what its row/key touches
    (dq of the row and dk/dv of the keys it sees; dq/dk/dv of the rows and keys around a NaN key)
    and never more than the float64 reference's NaN; finite gradients match it."""
    q, k, v, cu_q, cu_k = _nan_case(where, torch.float32)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = jagged_sdpa.varlen_attention(qg, kg, vg, cu_q, cu_k, causal=causal, backend=CPU)
    grad = torch.randn(out.shape)
    out.backward(grad)
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, cu_q, cu_k, causal=causal, alignment="bottom_right")
    ref.backward(grad.double())
    sees = _sees(cu_q, cu_k, causal, q.shape[0], k.shape[0])
    group = q.shape[1] // k.shape[1]
    must_q = torch.zeros(q.shape[0], q.shape[1], dtype=torch.bool)
    must_k = torch.zeros(k.shape[0], k.shape[1], dtype=torch.bool)
    if where == "q":
        must_q[1, 1] = sees[1].any()
        must_k[:, 0] = sees[1]
    else:  # the rows that see the key; its dk (and dv for a NaN k: dv = P^T dO, no v in it)
        rows = sees[:, 40]
        must_q[:, :group] = rows[:, None]
        must_k[40, 0] = rows.any()
    for name_, got, want, must, cu in (("dq", qg.grad, q64.grad, must_q, cu_q), ("dk", kg.grad, k64.grad, must_k, cu_k),
                                       ("dv", vg.grad, v64.grad, must_k if where != "v" else must_k & False, cu_k)):
        _assert_nan_between(got, must, torch.isnan(want).any(-1), name_)
        _finite_close(got, want, cu, name_, grad=True)


# (Lq, Lk): the issue's 4 tokens (one partial key block), tiles over one and two key blocks, a
# decode row, direct rows.
DENSE_SHAPES = [(4, 4), (9, 30), (70, 70), (1, 90), (2, 130)]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_nonfinite_inputs_give_what_dense_sdpa_gives(shape, where, value, split):
    """NaN/inf in q, k or v, without masks: out equals torch's dense SDPA (math, float64) element
    for element, NaN and inf included (a row whose scores are all -inf is 0, as dense SDPA's safe
    softmax gives), and lse is NaN, inf or -inf where the float64 reference's is. Under masks dense SDPA adds -inf to masked scores (NaN + -inf = NaN) and
    multiplies masked zeros by every value, so a NaN anywhere in a sequence reaches every row: the
    kernel reads only the keys a row's tile sees; test_nan_in_a_visible_score_or_value_is_nan
    bounds it there."""
    (len_q, len_k), causal = shape, False
    q, k, v = torch.randn(len_q, 4, 20), torch.randn(len_k, 2, 20), torch.randn(len_k, 2, 20)
    {"q": q, "k": k, "v": v}[where][min(1, len_q - 1) if where == "q" else 2 * len_k // 3, 0, 3] = value
    cu_q, cu_k = cu_of([len_q]), cu_of([len_k])
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, backend=CPU)
    _, ref_lse = attention_reference(q, k, v, cu_q, cu_k)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), "lse NaN pattern differs from the reference"
    assert torch.equal(lse[torch.isinf(lse)], ref_lse[torch.isinf(ref_lse)].float())
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1), is_causal=causal,
        enable_gqa=True).transpose(0, 1)
    assert torch.equal(torch.isnan(out), torch.isnan(dense)), "NaN pattern differs from dense SDPA"
    assert torch.equal(torch.isinf(out), torch.isinf(dense)) and torch.equal(out[torch.isinf(out)],
                                                                           dense[torch.isinf(dense)].float())
    finite = torch.isfinite(dense)
    assert_close_packed(torch.where(finite, out, 0.0), torch.where(finite, dense, 0.0), cu_seqlens=cu_q)
