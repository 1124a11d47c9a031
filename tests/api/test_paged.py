"""Paged KV cache: ``varlen_attention`` with ``block_table``/``seqused_k``, and ``paged_append``.

Every backend is tried; one that cannot take a case is skipped with its own reasons, so backends
that learn paging are covered as they land. Caches are filled with NaN everywhere a call must not
read (unused blocks, slots past ``seqused_k``) and block-table entries past the needed ones hold
out-of-range ids: a backend that reads either produces NaN or an error. The reference keys are
gathered from the cache with plain Python indexing, independently of jagged_sdpa.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import jagged_sdpa
from jagged_sdpa import Backend
from support.cases import feature_call
from support.reference import attention_reference
from support.tolerances import assert_cache_grads_close, assert_close_lse, assert_close_packed, float64_leaves, tolerance
from support.triton_interpreter import is_interpreted

# TRITON serves CPU tensors only under TRITON_INTERPRET=1, with triton imported interpreted. Where this
# process imported it so (the conftest does, without a GPU), the TRITON cases run here with the
# variable set around each (as test_dropout.py's ``interpret``); elsewhere a fresh interpreted
# process runs them (test_paged_cases_under_the_interpreter).
TRITON_HERE = is_interpreted(sys.modules.get("triton"))


@pytest.fixture(autouse=True)
def _interpret_triton_cases(request, monkeypatch):
    callspec = getattr(request.node, "callspec", None)
    if TRITON_HERE and callspec is not None and callspec.params.get("backend") is Backend.TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "1")

BACKENDS = list(Backend)
NAN = float("nan")


@dataclass
class PagedCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_q: torch.Tensor
    block_table: torch.Tensor
    seqused_k: torch.Tensor
    q_lens: list[int]
    k_lens: list[int]

    @property
    def max_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_k(self) -> int:
        return max(self.k_lens, default=0)

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.cu_q, None, self.max_q, self.max_k)

    def kwargs(self, **options):
        return dict(block_table=self.block_table, seqused_k=self.seqused_k, **options)

    def packed_keys(self):
        """(k, v, cu_k) gathered from the cache by plain indexing, one slot at a time."""
        bs = self.k_cache.shape[1]
        table = self.block_table.tolist()
        ks, vs, cu = [], [], [0]
        for b, n in enumerate(self.k_lens):
            for pos in range(n):
                blk = table[b][pos // bs]
                ks.append(self.k_cache[blk, pos % bs])
                vs.append(self.v_cache[blk, pos % bs])
            cu.append(cu[-1] + n)
        hkv, d, dv = self.k_cache.shape[2], self.k_cache.shape[3], self.v_cache.shape[3]
        k = torch.stack(ks) if ks else self.k_cache.new_zeros(0, hkv, d)
        v = torch.stack(vs) if vs else self.v_cache.new_zeros(0, hkv, dv)
        return k, v, cu


def make_case(q_lens, k_lens, *, block_size, heads_q=4, heads_kv=2, head_dim=16, head_dim_v=None,
              dtype=torch.float32, shared_prefix_blocks=0, spare_blocks=3, table_pad=2, seed=0) -> PagedCase:
    """A cache with blocks assigned in shuffled order, NaN wherever the call must not read.

    With ``shared_prefix_blocks`` = n, sequences 0 and 1 share their first n blocks (prefix caching).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    need = [-(-n // block_size) for n in k_lens]
    shared = shared_prefix_blocks
    if shared:
        assert need[0] >= shared and need[1] >= shared
    num_blocks = sum(need) - shared + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    rows, taken = [], 0
    for b, n in enumerate(need):
        if b == 1 and shared:
            row = rows[0][:shared] + ids[taken:taken + n - shared]
            taken += n - shared
        else:
            row = ids[taken:taken + n]
            taken += n
        rows.append(row)
    width = max(need, default=0) + table_pad
    garbage = [-7, num_blocks + 100]
    table = [row + [garbage[i % 2] for i in range(width - len(row))] for row in rows]

    k_cache = torch.full((num_blocks, block_size, heads_kv, head_dim), NAN, dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, heads_kv, head_dim_v), NAN, dtype=dtype)
    for b, n in enumerate(k_lens):
        for pos in range(n):
            blk, off = rows[b][pos // block_size], pos % block_size
            if b == 1 and pos < shared * block_size:
                continue  # the shared prefix holds sequence 0's keys
            k_cache[blk, off] = torch.randn(heads_kv, head_dim, generator=gen).to(dtype)
            v_cache[blk, off] = torch.randn(heads_kv, head_dim_v, generator=gen).to(dtype)
    cu_q = [0]
    for n in q_lens:
        cu_q.append(cu_q[-1] + n)
    q = torch.randn(cu_q[-1], heads_q, head_dim, generator=gen).to(dtype)
    return PagedCase(
        q=q, k_cache=k_cache, v_cache=v_cache,
        cu_q=torch.tensor(cu_q, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32).reshape(len(k_lens), width),
        seqused_k=torch.tensor(k_lens, dtype=torch.int32),
        q_lens=list(q_lens), k_lens=list(k_lens),
    )


def require(backend: Backend, case: PagedCase, **options) -> None:
    """Skip with the backend's own reasons when it cannot take this call."""
    reasons = jagged_sdpa.explain(*case.args(), **case.kwargs(backend=backend, **options)).reasons[backend]
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    skip_interpreter_bf16(backend, case.q)


def skip_interpreter_bf16(backend: Backend, q: torch.Tensor) -> None:
    if backend is Backend.TRITON and q.device.type == "cpu" and q.dtype == torch.bfloat16:
        pytest.skip("triton: bf16 gives wrong numbers under the Triton 3.9 interpreter (CPU); runs on CUDA")


def reference(case: PagedCase, *, causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None, scale=None):
    k, v, cu_k = case.packed_keys()
    return attention_reference(case.q, k, v, case.cu_q.tolist(), cu_k, scale=scale, causal=causal,
                               alignment="bottom_right", window=window, softcap=softcap,
                               alibi_slopes=alibi_slopes)


def check(backend, case, *, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    require(backend, case, **options)
    out, lse = jagged_sdpa.varlen_attention(*case.args(), **case.kwargs(backend=backend, return_lse=True, **options))
    ref_out, ref_lse = reference(case, causal=causal, window=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    assert out.dtype == case.q.dtype and lse.dtype == torch.float32
    assert_close_packed(out, ref_out, cu_seqlens=case.cu_q.tolist(), name=f"{backend} out")
    assert_close_lse(lse, ref_lse, name=f"{backend} lse")
    return out, lse


# A serving step: a long prefill chunk, decodes over long and short contexts, a first prompt
# chunk (q == k), a zero-length query, an empty cache with one query (sees no key), and a
# chunk longer than its keys (its first rows see no key under bottom-right causal).
MIXED_Q = [9, 1, 1, 5, 0, 1, 4, 1]
MIXED_K = [30, 47, 1, 5, 12, 0, 2, 16]


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
def test_mixed_step_matches_reference(backend, block_size):
    check(backend, make_case(MIXED_Q, MIXED_K, block_size=block_size))


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_mixed_step_dtypes(backend, dtype):
    check(backend, make_case(MIXED_Q, MIXED_K, block_size=16, dtype=dtype, head_dim=32))


FEATURES = {
    "noncausal": dict(causal=False),
    "gqa4": dict(heads=(8, 2)),
    "mqa": dict(heads=(4, 1)),
    "window_left": dict(window_size=(6, 0)),
    "window_both_noncausal": dict(causal=False, window_size=(3, 2)),
    "softcap": dict(softcap=2.5),
    "alibi_per_head": dict(alibi="per_head"),
    "alibi_per_batch_head": dict(alibi="per_batch_head"),
    "all_together": dict(heads=(8, 2), window_size=(10, 0), softcap=4.0, alibi="per_head"),
    "head_dim_v_differs": dict(head_dim_v=24),
}


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(backend, feature):
    options, (heads_q, heads_kv), head_dim_v = feature_call(FEATURES[feature], len(MIXED_Q), MIXED_K)
    case = make_case(MIXED_Q, MIXED_K, block_size=16, heads_q=heads_q, heads_kv=heads_kv, head_dim_v=head_dim_v,
                     seed=1)
    check(backend, case, **options)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_shared_prefix_blocks(backend, block_size):
    """Rows 0 and 1 share their first blocks (prefix caching) and diverge after them."""
    shared = 2
    k_lens = [2 * block_size + 5, 2 * block_size + 9, 7]
    case = make_case([3, 1, 2], k_lens, block_size=block_size, shared_prefix_blocks=shared, seed=2)
    table = case.block_table.tolist()
    assert table[0][:shared] == table[1][:shared]
    out, _ = check(backend, case)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("q_lens,k_lens", [([0, 0], [0, 0]), ([1, 1, 1], [0, 0, 0]), ([0, 2], [5, 0]), ([], [])],
                         ids=["all_empty", "decode_without_keys", "mixed_empty", "no_sequences"])
def test_empty_sequences(backend, q_lens, k_lens):
    case = make_case(q_lens, k_lens, block_size=4)
    out, lse = check(backend, case)
    assert out.shape == (sum(q_lens), 4, 16)
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        start = sum(q_lens[:b])
        if nk == 0 and nq:
            assert torch.equal(out[start:start + nq], torch.zeros_like(out[start:start + nq]))
            assert torch.isneginf(lse[:, start:start + nq]).all()


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_return_lse_false_gives_out_only(backend):
    case = make_case(MIXED_Q, MIXED_K, block_size=16)
    require(backend, case, causal=True)
    out = jagged_sdpa.varlen_attention(*case.args(), **case.kwargs(backend=backend, causal=True))
    assert isinstance(out, torch.Tensor)
    ref_out, _ = reference(case)
    assert_close_packed(out, ref_out, cu_seqlens=case.cu_q.tolist())


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_max_lengths_may_be_upper_bounds(backend):
    """A server passes bounds (its chunk size, its context limit), not this step's exact maxima."""
    case = make_case(MIXED_Q, MIXED_K, block_size=16, seed=7)
    require(backend, case, causal=True)
    args = list(case.args())
    args[5], args[6] = case.max_q + 7, case.block_table.shape[1] * 16
    out = jagged_sdpa.varlen_attention(*args, **case.kwargs(backend=backend, causal=True))
    ref_out, _ = reference(case)
    assert_close_packed(out, ref_out, cu_seqlens=case.cu_q.tolist())


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_paged_equals_packed_keys(backend):
    """The same keys, paged or packed, give the same answer on one backend."""
    case = make_case(MIXED_Q, MIXED_K, block_size=16, seed=3)
    require(backend, case, causal=True)
    paged = jagged_sdpa.varlen_attention(*case.args(), **case.kwargs(backend=backend, causal=True))
    k, v, cu_k = case.packed_keys()
    packed = jagged_sdpa.varlen_attention(case.q, k, v, case.cu_q, torch.tensor(cu_k, dtype=torch.int32),
                                          case.max_q, case.max_k, causal=True, backend=backend)
    atol, rtol = tolerance(case.q.dtype)
    torch.testing.assert_close(paged, packed, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_gradients_wrt_query_and_cache(backend):
    """dq and d(cache) against autograd through the float64 reference; unused slots get zero grad."""
    case = make_case(MIXED_Q, MIXED_K, block_size=4, seed=4)
    case.k_cache.requires_grad_(True)
    case.v_cache.requires_grad_(True)
    case.q.requires_grad_(True)
    require(backend, case, causal=True)
    out = jagged_sdpa.varlen_attention(*case.args(), **case.kwargs(backend=backend, causal=True))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    q64, kc64, vc64 = float64_leaves(case.q, case.k_cache, case.v_cache)
    ref_case = PagedCase(q64, kc64, vc64, case.cu_q, case.block_table, case.seqused_k, case.q_lens, case.k_lens)
    ref_out, _ = reference(ref_case)
    ref_out.backward(grad_out.double())
    assert_cache_grads_close(case.q, case.k_cache, case.v_cache, q64, kc64, vc64, case.cu_q.tolist())


# ----------------------------------------------------------------------------------------------
# rejected paged varlen_attention calls


def _paged_call(case, **changes):
    kwargs = case.kwargs(causal=True)
    args = list(case.args())
    for key, value in changes.items():
        if key in kwargs:
            kwargs[key] = value
        else:
            args[{"k": 1, "v": 2, "cu_seqlens_k": 4, "max_seqlen_k": 6}[key]] = value
    return jagged_sdpa.varlen_attention(*args, **kwargs)


def _bad_table(case, b, i, value):
    table = case.block_table.clone()
    table[b, i] = value
    return table


@pytest.mark.parametrize("value", [-1, 10_000])
def test_rejects_needed_block_id_out_of_range(value):
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(ValueError, match=r"block_table\[0, 2\]"):
        _paged_call(case, block_table=_bad_table(case, 0, 2, value))


def test_accepts_garbage_in_entries_no_row_needs():
    case = make_case([1, 2], [9, 5], block_size=4, table_pad=3)
    table = case.block_table.clone()
    table[1, 2:] = 10_000
    out = _paged_call(case, block_table=table)
    assert torch.isfinite(out).all()


def test_rejects_seqused_k_past_capacity():
    case = make_case([1, 2], [9, 5], block_size=4, table_pad=0)
    capacity = case.block_table.shape[1] * 4
    with pytest.raises(ValueError, match="seqused_k"):
        _paged_call(case, seqused_k=torch.tensor([capacity + 1, 5], dtype=torch.int32), max_seqlen_k=capacity + 1)


def test_rejects_negative_seqused_k():
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(ValueError, match="seqused_k"):
        _paged_call(case, seqused_k=torch.tensor([-1, 5], dtype=torch.int32))


def test_rejects_max_seqlen_k_below_seqused_k():
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        _paged_call(case, max_seqlen_k=8)


@pytest.mark.parametrize("name", ["block_table", "seqused_k"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.float32], ids=str)
def test_rejects_index_tensor_dtype(name, dtype):
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(TypeError, match=name):
        _paged_call(case, **{name: getattr(case, name).to(dtype)})


@pytest.mark.parametrize("name", ["block_table", "seqused_k"])
def test_rejects_index_tensor_on_another_device(name):
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(ValueError, match=name):
        _paged_call(case, **{name: getattr(case, name).to("meta")})


def test_rejects_cu_seqlens_k_with_block_table():
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        _paged_call(case, cu_seqlens_k=torch.tensor([0, 9, 14], dtype=torch.int32))


def test_rejects_block_table_without_seqused_k():
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(ValueError, match="seqused_k"):
        _paged_call(case, seqused_k=None)


def test_rejects_block_table_of_wrong_batch():
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(ValueError, match="block_table"):
        _paged_call(case, block_table=case.block_table[:1])


def test_rejects_cache_of_wrong_rank():
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(ValueError, match=r"\bk\b"):
        _paged_call(case, k=case.k_cache.flatten(0, 1))


def test_rejects_cache_dtype_mismatch():
    case = make_case([1, 2], [9, 5], block_size=4)
    with pytest.raises(TypeError, match=r"\bv\b"):
        _paged_call(case, v=case.v_cache.double())


# ----------------------------------------------------------------------------------------------
# paged_append


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A bitwise view, so NaN slots compare equal to themselves."""
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]).clone()


def _append_case(used=(5, 0, 8), new=(3, 4, 1), block_size=4, width=3, dtype=torch.float32, seed=0):
    """Row b owns blocks b*width ... (b+1)*width - 1 in reverse order, plus one spare; NaN where unwritten."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(used)
    num_blocks = width * batch + 1
    k_cache = torch.full((num_blocks, block_size, 2, 8), NAN, dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, 2, 6), NAN, dtype=dtype)
    table = torch.tensor([[width * (b + 1) - 1 - i for i in range(width)] for b in range(batch)],
                         dtype=torch.int32).reshape(batch, width)
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    k_new = torch.randn(cu[-1], 2, 8, generator=gen).to(dtype)
    v_new = torch.randn(cu[-1], 2, 6, generator=gen).to(dtype)
    return dict(k_cache=k_cache, v_cache=v_cache, block_table=table,
                seqused_k=torch.tensor(used, dtype=torch.int32), k_new=k_new, v_new=v_new,
                cu_seqlens_new=torch.tensor(cu, dtype=torch.int32))


def _manual_append(a):
    """The expected caches, written one token at a time with plain indexing."""
    k, v = a["k_cache"].clone(), a["v_cache"].clone()
    bs = k.shape[1]
    table, used, cu = a["block_table"].tolist(), a["seqused_k"].tolist(), a["cu_seqlens_new"].tolist()
    for b in range(len(used)):
        for t in range(cu[b], cu[b + 1]):
            pos = used[b] + t - cu[b]
            k[table[b][pos // bs], pos % bs] = a["k_new"][t]
            v[table[b][pos // bs], pos % bs] = a["v_new"][t]
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_append_matches_manual_indexing(dtype, block_size):
    width = -(-12 // block_size) + 1
    a = _append_case(used=(5, 0, 8), new=(3, 4, 0), block_size=block_size, width=width, dtype=dtype)
    want_k, want_v = _manual_append(a)
    used_before = a["seqused_k"].clone()
    new_used = jagged_sdpa.paged_append(**a)
    assert new_used.dtype == torch.int32 and new_used.tolist() == [8, 4, 8]
    assert torch.equal(a["seqused_k"], used_before), "the seqused_k argument must not be modified"
    assert torch.equal(_bits(a["k_cache"]), _bits(want_k))
    assert torch.equal(_bits(a["v_cache"]), _bits(want_v))


def test_append_with_no_tokens_and_no_sequences():
    a = _append_case(used=(2, 3), new=(0, 0))
    before = _bits(a["k_cache"])
    assert jagged_sdpa.paged_append(**a).tolist() == [2, 3]
    assert torch.equal(_bits(a["k_cache"]), before)
    empty = _append_case(used=(), new=())
    assert jagged_sdpa.paged_append(**empty).shape == (0,)


def test_append_into_caches_that_are_views_of_a_larger_buffer():
    """k/v caches sliced out of one (num_blocks, block_size, 2, Hkv, D) buffer: writes land in the views."""
    a = _append_case(used=(5, 0, 8), new=(3, 4, 1))
    big = torch.full(a["k_cache"].shape[:2] + (3,) + a["k_cache"].shape[2:], NAN)
    a["k_cache"] = big[:, :, 0]
    a["v_cache"] = big[:, :, 1, :, :6]
    spare_before = _bits(big[:, :, 2])
    want_k, want_v = _manual_append(a)
    jagged_sdpa.paged_append(**a)
    assert torch.equal(_bits(big[:, :, 0]), _bits(want_k))
    assert torch.equal(_bits(big[:, :, 1, :, :6]), _bits(want_v))
    assert torch.equal(_bits(big[:, :, 2]), spare_before)


def test_append_to_blocks_past_a_shared_prefix():
    """Two rows sharing their first block may each append into their own later blocks."""
    a = _append_case(used=(4, 4), new=(2, 3), block_size=4, width=2)
    a["block_table"][1, 0] = a["block_table"][0, 0]
    want_k, want_v = _manual_append(a)
    jagged_sdpa.paged_append(**a)
    assert torch.equal(_bits(a["k_cache"]), _bits(want_k))
    assert torch.equal(_bits(a["v_cache"]), _bits(want_v))


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("block_size", [4, 16])
def test_append_then_attend_over_a_serving_timeline(backend, block_size):
    """Chunked prefill then decoding, appended step by step; every step read back by attention."""
    heads_q, heads_kv, head_dim = 4, 2, 16
    prompts, outputs = [21, 3, 14], [3, 6, 2]
    chunk = 8
    width = -(-max(p + o for p, o in zip(prompts, outputs)) // block_size)
    gen = torch.Generator().manual_seed(5)
    num_blocks = width * len(prompts) + 2
    k_cache = torch.full((num_blocks, block_size, heads_kv, head_dim), NAN)
    v_cache = torch.full((num_blocks, block_size, heads_kv, head_dim), NAN)
    ids = torch.randperm(num_blocks, generator=gen)[: width * len(prompts)]
    table = ids.reshape(len(prompts), width).to(torch.int32)
    used = torch.zeros(len(prompts), dtype=torch.int32)
    history_k = [torch.zeros(0, heads_kv, head_dim) for _ in prompts]
    history_v = [torch.zeros(0, heads_kv, head_dim) for _ in prompts]
    done = [0] * len(prompts)
    steps = 0
    while any(d < p + o for d, p, o in zip(done, prompts, outputs)):
        n_new = []
        for b, (d, p, o) in enumerate(zip(done, prompts, outputs)):
            n_new.append(min(chunk, p - d) if d < p else (1 if d < p + o else 0))
        cu = torch.tensor([0, *itertools.accumulate(n_new)], dtype=torch.int32)
        total = int(cu[-1])
        k_new = torch.randn(total, heads_kv, head_dim, generator=gen)
        v_new = torch.randn(total, heads_kv, head_dim, generator=gen)
        q = torch.randn(total, heads_q, head_dim, generator=gen)
        used = jagged_sdpa.paged_append(k_cache, v_cache, table, used, k_new, v_new, cu)
        for b, n in enumerate(n_new):
            history_k[b] = torch.cat([history_k[b], k_new[int(cu[b]):int(cu[b]) + n]])
            history_v[b] = torch.cat([history_v[b], v_new[int(cu[b]):int(cu[b]) + n]])
            done[b] += n
        assert used.tolist() == done
        kwargs = dict(block_table=table, seqused_k=used, causal=True, return_lse=True, backend=backend)
        args = (q, k_cache, v_cache, cu, None, max(n_new), max(done))
        reasons = jagged_sdpa.explain(*args, **kwargs).reasons[backend]
        if reasons:
            pytest.skip(f"{backend}: " + "; ".join(reasons))
        out, lse = jagged_sdpa.varlen_attention(*args, **kwargs)
        cu_k = [0]
        for h in history_k:
            cu_k.append(cu_k[-1] + h.shape[0])
        ref_out, ref_lse = attention_reference(q, torch.cat(history_k), torch.cat(history_v), cu.tolist(), cu_k,
                                               causal=True, alignment="bottom_right")
        assert_close_packed(out, ref_out, cu_seqlens=cu.tolist(), name=f"step {steps}")
        assert_close_lse(lse, ref_lse, name=f"step {steps} lse")
        steps += 1
    assert steps == max(-(-p // chunk) + o for p, o in zip(prompts, outputs))


def _assert_rejected(a, exc, pattern, **changes):
    """The call raises ``exc`` naming the argument, and neither cache nor seqused_k changes."""
    call = dict(a, **changes)
    k_before, v_before = _bits(a["k_cache"]), _bits(a["v_cache"])
    used_before = a["seqused_k"].clone()
    with pytest.raises(exc, match=pattern):
        jagged_sdpa.paged_append(**call)
    assert torch.equal(_bits(a["k_cache"]), k_before), "k_cache was written by a rejected call"
    assert torch.equal(_bits(a["v_cache"]), v_before), "v_cache was written by a rejected call"
    assert torch.equal(a["seqused_k"], used_before)


def _with_entry(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def test_append_rejects_block_id_out_of_range():
    """Row 2's append needs its second block, whose id is out of range; rows 0 and 1 are valid."""
    a = _append_case(used=(5, 0, 4), new=(3, 4, 2))
    for value in (-1, a["k_cache"].shape[0]):
        _assert_rejected(a, ValueError, r"block_table\[2, 1\]",
                         block_table=_with_entry(a["block_table"], (2, 1), value))


def test_append_rejects_overflow_of_assigned_blocks():
    a = _append_case(used=(5, 0, 10), new=(3, 4, 3), width=3)
    _assert_rejected(a, ValueError, r"overflows its block_table row")


def test_append_rejects_seqused_k_past_capacity():
    a = _append_case(used=(5, 0, 8))
    _assert_rejected(a, ValueError, r"seqused_k\[1\]", seqused_k=torch.tensor([5, 13, 8], dtype=torch.int32))
    _assert_rejected(a, ValueError, r"seqused_k\[0\]", seqused_k=torch.tensor([-1, 0, 8], dtype=torch.int32))


def test_append_rejects_two_tokens_aimed_at_one_slot():
    a = _append_case(used=(5, 5), new=(1, 1), width=2)
    table = a["block_table"].clone()
    table[1] = table[0]
    _assert_rejected(a, ValueError, r"block_table rows 0 and 1", block_table=table)


@pytest.mark.parametrize("name", ["block_table", "seqused_k", "cu_seqlens_new"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32], ids=str)
def test_append_rejects_index_dtype(name, dtype):
    a = _append_case()
    _assert_rejected(a, TypeError, name, **{name: a[name].to(dtype)})


@pytest.mark.parametrize("name", ["k_new", "v_new"])
def test_append_rejects_new_dtype_mismatch(name):
    a = _append_case()
    _assert_rejected(a, TypeError, name, **{name: a[name].double()})


def test_append_rejects_cache_dtype_mismatch():
    a = _append_case()
    _assert_rejected(a, TypeError, "v_cache", v_cache=a["v_cache"].double(), v_new=a["v_new"].double())


@pytest.mark.parametrize("name", ["block_table", "seqused_k", "cu_seqlens_new", "k_new", "v_new"])
def test_append_rejects_other_device(name):
    a = _append_case()
    _assert_rejected(a, ValueError, name, **{name: a[name].to("meta")})


@pytest.mark.parametrize("name,value,pattern", [
    ("k_new", torch.zeros(8, 3, 8), "k_new"),
    ("v_new", torch.zeros(8, 2, 5), "v_new"),
    ("v_new", torch.zeros(7, 2, 6), "k_new and v_new"),
    ("k_new", torch.zeros(8, 16), "k_new"),
    ("block_table", torch.zeros(9, dtype=torch.int32), "block_table"),
    ("seqused_k", torch.zeros(2, dtype=torch.int32), "seqused_k"),
    ("cu_seqlens_new", torch.tensor([0, 3, 7], dtype=torch.int32), "cu_seqlens_new"),
])
def test_append_rejects_shapes(name, value, pattern):
    _assert_rejected(_append_case(), ValueError, pattern, **{name: value})


def test_append_rejects_cache_shapes():
    a = _append_case()
    _assert_rejected(a, ValueError, "k_cache", k_cache=a["k_cache"][0])
    _assert_rejected(a, ValueError, "k_cache and v_cache", v_cache=a["v_cache"][:, :2])


@pytest.mark.parametrize("cu,pattern", [
    ([1, 4, 8, 8], "start at 0"),
    ([0, 5, 3, 8], "non-decreasing"),
    ([0, 3, 7, 7], "end at"),
])
def test_append_rejects_cu_seqlens_new_contents(cu, pattern):
    a = _append_case()
    _assert_rejected(a, ValueError, f"cu_seqlens_new.*{pattern}", cu_seqlens_new=torch.tensor(cu, dtype=torch.int32))


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "block_table", "seqused_k", "k_new", "v_new", "cu_seqlens_new"])
def test_append_rejects_non_tensors(name):
    a = _append_case()
    call = dict(a, **{name: a[name].tolist()})
    with pytest.raises(TypeError, match=name):
        jagged_sdpa.paged_append(**call)


def test_reference_gather_is_independent_of_layout():
    """Sanity of the test helper itself: keys gathered from a shuffled cache equal the ones written."""
    case = make_case([1], [7], block_size=3, seed=6)
    k, _, cu = case.packed_keys()
    assert cu == [0, 7] and torch.isfinite(k).all()
    table = case.block_table[0].tolist()
    assert torch.equal(k[4], case.k_cache[table[1], 1])
    assert math.isnan(float(case.k_cache[table[2], 1, 0, 0]))  # slot past seqused_k stays NaN


@pytest.mark.interpret
@pytest.mark.skipif(TRITON_HERE or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the TRITON cases run in this process")
def test_paged_cases_under_the_interpreter():
    """This module's TRITON cases in a fresh process that sets TRITON_INTERPRET=1 before triton is
    imported (this one imported it compiled)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                             "-k", "triton"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout, result.stdout[-2000:]


# ----------------------------------------------------------------------------------------------
# the serving example and its benchmark (examples/serving.py, benchmarks/bench_serving.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(relative_path: str, name: str):
    import importlib.util

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_serving_example_steps_match_the_reference_and_free_every_block():
    serving = _load("examples/serving.py", "serving")
    shape = serving.ModelShape(layers=2, heads_q=4, heads_kv=2, head_dim=16, dtype=torch.float32)
    workload = serving.Workload(requests=6, arrivals_per_step=1.0, prompt_median=12, prompt_max=40,
                                output_min=1, output_max=6).generate(3)
    block_size, budget = 4, 16
    num_blocks = sum(-(-r.max_tokens // block_size) for r in workload)
    allocator = serving.BlockAllocator(num_blocks, block_size)
    scheduler = serving.Scheduler(workload, allocator, token_budget=budget, max_running=4)
    stack = serving.PagedAttentionStack(shape, num_blocks, block_size, backend=Backend.MATH)
    history = {r.rid: [([], []) for _ in range(shape.layers)] for r in workload}
    gen = torch.Generator().manual_seed(0)
    steps = 0
    while not scheduler.done:
        plan = scheduler.plan()
        if plan is None:
            continue
        assert plan.total_new <= budget and len(plan.requests) <= 4
        inputs = serving.random_layer_inputs(plan, shape, gen)
        outs = stack.step(plan, inputs)
        cu = [0, *itertools.accumulate(plan.new_tokens)]
        for layer, (q, k_new, v_new) in enumerate(inputs):
            ks, vs, cu_k = [], [], [0]
            for b, req in enumerate(plan.requests):
                keys, values = history[req.rid][layer]
                keys.append(k_new[cu[b]:cu[b + 1]])
                values.append(v_new[cu[b]:cu[b + 1]])
                ks.append(torch.cat(keys))
                vs.append(torch.cat(values))
                cu_k.append(cu_k[-1] + ks[-1].shape[0])
            ref, _ = attention_reference(q, torch.cat(ks), torch.cat(vs), cu, cu_k, causal=True,
                                         alignment="bottom_right")
            assert_close_packed(outs[layer], ref, cu_seqlens=cu, name=f"step {plan.step} layer {layer}")
        scheduler.commit(plan)
        steps += 1
    assert steps > 0
    assert all(r.generated == r.output_len and r.cached == r.max_tokens for r in workload)
    assert sorted(allocator.free) == list(range(num_blocks)), "every block is back in the free list"


def test_serving_benchmark_runs_and_agrees():
    bench = _load("benchmarks/bench_serving.py", "bench_serving")
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--requests", "3", "--layers", "1", "--check-every", "2"]) == 0
    finally:
        torch.set_num_threads(threads)  # main() sets one thread for the whole process
