"""Dense KV caches read in place: ``varlen_attention``/``plan`` with 4-D ``(B, S, Hkv, D)`` caches,
``seqused_k`` and ``cache_leftpad`` (no ``cu_seqlens_k``, no ``block_table``).

Every backend is tried; one that cannot take a case is skipped with its own reasons. Caches are
laid out as transformers keeps them, ``(B, Hkv, S, D)`` passed as ``.transpose(1, 2)`` (strided),
and every slot outside a row's range holds NaN: a backend that reads one gives NaN. The reference
gathers each row's keys with plain slicing and runs the float64 reference on them. A dispatch
mode that fails on any op producing a tensor as large as the cache proves nothing copies it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import jagged_sdpa
from jagged_sdpa import Backend
from support.cases import feature_call
from support.reference import attention_reference
from support.tolerances import assert_cache_grads_close, assert_close_lse, assert_close_packed, float64_leaves, tolerance

BACKENDS = list(Backend)
NAN = float("nan")


@dataclass
class DenseCase:
    q: torch.Tensor
    k_cache: torch.Tensor      # (B, S, Hkv, D), a transposed view of (B, Hkv, S, D)
    v_cache: torch.Tensor
    cu_q: torch.Tensor
    seqused_k: torch.Tensor
    cache_leftpad: torch.Tensor | None
    q_lens: list
    k_lens: list
    starts: list

    @property
    def max_q(self) -> int:
        return max(self.q_lens, default=0)

    def args(self, max_k=None):
        return (self.q, self.k_cache, self.v_cache, self.cu_q, None, self.max_q, max_k)

    def kwargs(self, **options):
        return dict(seqused_k=self.seqused_k, cache_leftpad=self.cache_leftpad, **options)

    def packed_keys(self, k=None, v=None):
        """(k, v, cu_k) sliced from each row's range."""
        k = self.k_cache if k is None else k
        v = self.v_cache if v is None else v
        ks = [k[b, s:s + n] for b, (s, n) in enumerate(zip(self.starts, self.k_lens))]
        vs = [v[b, s:s + n] for b, (s, n) in enumerate(zip(self.starts, self.k_lens))]
        cu = [0]
        for n in self.k_lens:
            cu.append(cu[-1] + n)
        empty_k = k.new_zeros(0, k.shape[2], k.shape[3])
        empty_v = v.new_zeros(0, v.shape[2], v.shape[3])
        return (torch.cat(ks) if ks else empty_k), (torch.cat(vs) if vs else empty_v), cu


def make_case(q_lens, k_lens, starts=None, *, S=None, heads_q=4, heads_kv=2, head_dim=16, head_dim_v=None,
              dtype=torch.float32, seed=0, poison=True) -> DenseCase:
    g = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim_v or head_dim
    B = len(q_lens)
    starts = list(starts) if starts is not None else [0] * B
    S = S if S is not None else max([s + n for s, n in zip(starts, k_lens)] + [1]) + 3
    kc = torch.randn(B, heads_kv, S, head_dim, generator=g).to(dtype)
    vc = torch.randn(B, heads_kv, S, head_dim_v, generator=g).to(dtype)
    if poison:
        for b, (s, n) in enumerate(zip(starts, k_lens)):
            for c in (kc, vc):
                c[b, :, :s] = NAN
                c[b, :, s + n:] = NAN
    q = torch.randn(sum(q_lens), heads_q, head_dim, generator=g).to(dtype)
    cu_q = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(B)], dtype=torch.int32)
    return DenseCase(q, kc.transpose(1, 2), vc.transpose(1, 2), cu_q, torch.tensor(k_lens, dtype=torch.int32),
                     torch.tensor(starts, dtype=torch.int32) if any(starts) else None, list(q_lens), list(k_lens),
                     starts)


@pytest.fixture(autouse=True)
def _triton_interpreted(monkeypatch):
    """TRITON runs CPU tensors under its interpreter (triton was imported interpreted by conftest)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def require(backend: Backend, case: DenseCase, **options) -> None:
    reasons = jagged_sdpa.explain(*case.args(), **case.kwargs(backend=backend, **options)).reasons[backend]
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    if backend is Backend.TRITON and case.q.device.type == "cpu" and case.q.dtype == torch.bfloat16:
        pytest.skip("triton: bf16 gives wrong numbers under the Triton interpreter (CPU); runs on CUDA")


def reference(case: DenseCase, **options):
    k, v, cu_k = case.packed_keys()
    return attention_reference(case.q, k, v, case.cu_q.tolist(), cu_k, alignment="bottom_right", **options)


def check(backend, case, *, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
          chunk_size=None, prefix_lens=None):
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   sinks=sinks, chunk_size=chunk_size, prefix_lens=prefix_lens)
    require(backend, case, **options)
    out, lse = jagged_sdpa.varlen_attention(*case.args(), **case.kwargs(backend=backend, return_lse=True, **options))
    ref_out, ref_lse = reference(case, causal=causal, window=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 sinks=sinks, chunk_size=chunk_size, prefix_lens=prefix_lens)
    assert out.dtype == case.q.dtype and lse.dtype == torch.float32
    assert_close_packed(out, ref_out, cu_seqlens=case.cu_q.tolist(), name=f"{backend} out")
    assert_close_lse(lse, ref_lse, name=f"{backend} lse")
    return out, lse


# A decode/chunked-prefill step over a left-padded cache: a prefill chunk, decodes over long and
# short ranges, a row with no keys, a zero-length query, a chunk longer than its keys.
Q_LENS = [5, 1, 1, 3, 0, 1, 4]
K_LENS = [20, 31, 1, 3, 6, 0, 2]
STARTS = [4, 0, 9, 17, 2, 5, 0]


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("leftpad", [True, False], ids=["leftpad", "from_zero"])
def test_step_matches_reference(backend, leftpad):
    check(backend, make_case(Q_LENS, K_LENS, STARTS if leftpad else None))


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_dtypes(backend, dtype):
    check(backend, make_case(Q_LENS, K_LENS, STARTS, dtype=dtype, head_dim=32))


FEATURES = {
    "noncausal": dict(causal=False),
    "gqa4": dict(heads=(8, 2)),
    "mqa": dict(heads=(4, 1)),
    "window": dict(window_size=(6, 0)),
    "softcap": dict(softcap=2.5),
    "alibi_per_batch_head": dict(alibi="per_batch_head"),
    "sinks": dict(sinks=True),
    "chunk_size": dict(chunk_size=4),
    "prefix_lens": dict(prefix=True),
    "head_dim_v": dict(head_dim_v=24),
}


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(backend, feature):
    options, (heads_q, heads_kv), head_dim_v = feature_call(FEATURES[feature], len(Q_LENS), K_LENS)
    case = make_case(Q_LENS, K_LENS, STARTS, heads_q=heads_q, heads_kv=heads_kv, head_dim_v=head_dim_v, seed=1)
    check(backend, case, **options)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_equals_packed_keys_bit_for_bit_on_cpu_fused_and_close_elsewhere(backend):
    """The same keys read in place or packed: one backend, the same answer."""
    case = make_case(Q_LENS, K_LENS, STARTS, seed=3)
    require(backend, case, causal=True)
    dense = jagged_sdpa.varlen_attention(*case.args(), **case.kwargs(backend=backend, causal=True))
    k, v, cu_k = case.packed_keys()
    packed = jagged_sdpa.varlen_attention(case.q, k, v, case.cu_q, torch.tensor(cu_k, dtype=torch.int32),
                                          case.max_q, max(K_LENS), causal=True, backend=backend)
    if backend is Backend.CPU_FUSED:
        assert torch.equal(dense, packed)
    atol, rtol = tolerance(case.q.dtype)
    torch.testing.assert_close(dense, packed, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("contiguous", [False, True], ids=["transposed", "contiguous"])
def test_gradients_wrt_query_and_cache(backend, contiguous):
    """dq and d(cache) against autograd through the float64 reference; slots outside the ranges
    get exactly zero gradient."""
    case = make_case(Q_LENS, K_LENS, STARTS, seed=4, poison=False)
    if contiguous:
        case.k_cache, case.v_cache = case.k_cache.contiguous(), case.v_cache.contiguous()
    for t in (case.q, case.k_cache, case.v_cache):
        t.requires_grad_(True)
    require(backend, case, causal=True)
    out = jagged_sdpa.varlen_attention(*case.args(), **case.kwargs(backend=backend, causal=True))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    q64, kc64, vc64 = float64_leaves(case.q, case.k_cache, case.v_cache)
    k, v, cu_k = case.packed_keys(kc64, vc64)
    ref_out, _ = attention_reference(q64, k, v, case.cu_q.tolist(), cu_k, causal=True, alignment="bottom_right")
    ref_out.backward(grad_out.double())
    assert_cache_grads_close(case.q, case.k_cache, case.v_cache, q64, kc64, vc64, case.cu_q.tolist())
    for name, got in (("dk_cache", case.k_cache.grad), ("dv_cache", case.v_cache.grad)):
        for b, (s, n) in enumerate(zip(case.starts, case.k_lens)):
            assert not got[b, :s].any() and not got[b, s + n:].any(), f"{name}: gradient outside row {b}'s range"


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("q_lens,k_lens,S", [([0, 0], [0, 0], 4), ([1, 1, 1], [0, 0, 0], 0), ([0, 2], [5, 0], 5),
                                             ([], [], 3)],
                         ids=["all_empty", "empty_cache_S0", "mixed_empty", "no_sequences"])
def test_empty_rows_and_caches(backend, q_lens, k_lens, S):
    case = make_case(q_lens, k_lens, S=S)
    out, lse = check(backend, case)
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        start = sum(q_lens[:b])
        if nk == 0 and nq:
            assert not out[start:start + nq].any()
            assert torch.isneginf(lse[:, start:start + nq]).all()


class _NoCacheSizedTensors(TorchDispatchMode):
    """Fails on any op that produces a tensor with as many elements as the cache (a copy)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit \
                    and t.untyped_storage().data_ptr() not in self.allowed:
                raise AssertionError(f"{func} made a tensor of {t.numel()} elements (the cache has {self.limit})")
        return result


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_no_copy_of_the_cache(backend):
    """Forward through varlen_attention, explain and a plan: nothing as large as the cache is made."""
    case = make_case([1, 1, 1, 1], [40, 3, 77, 12], [30, 0, 3, 60], S=150, heads_q=8, heads_kv=2, head_dim=32)
    require(backend, case, causal=True)
    mode = _NoCacheSizedTensors(case.k_cache.numel())
    mode.allowed = {case.k_cache.untyped_storage().data_ptr(), case.v_cache.untyped_storage().data_ptr()}
    ref_out, _ = reference(case, causal=True)
    with mode:
        out = jagged_sdpa.varlen_attention(*case.args(), **case.kwargs(backend=backend, causal=True))
        p = jagged_sdpa.plan(case.cu_q, None, 1, 150, seqused_k=case.seqused_k, cache_leftpad=case.cache_leftpad,
                             causal=True, backend=backend)
        again = p.run(case.q, case.k_cache, case.v_cache)
    assert_close_packed(out, ref_out, cu_seqlens=case.cu_q.tolist())
    assert torch.equal(out, again)


def test_max_seqlen_k_none_means_the_cache_length():
    case = make_case(Q_LENS, K_LENS, STARTS)
    e = jagged_sdpa.explain(*case.args(), **case.kwargs(causal=True))
    assert f"dense_cache(S={case.k_cache.shape[1]}, cache_leftpad)" in e.spec.describe()


def test_plan_over_layers_and_update():
    """A decode loop: one plan per step over per-layer caches, ``update`` as the rows grow."""
    layers, B, S = 3, 3, 32
    g = torch.Generator().manual_seed(5)
    caches = [(torch.randn(B, 2, S, 16, generator=g).transpose(1, 2), torch.randn(B, 2, S, 16, generator=g).transpose(1, 2))
              for _ in range(layers)]
    starts = torch.tensor([3, 0, 10], dtype=torch.int32)
    used = torch.tensor([5, 9, 2], dtype=torch.int32)
    cu_q = torch.arange(B + 1, dtype=torch.int32)
    p = jagged_sdpa.plan(cu_q, None, 1, S, seqused_k=used, cache_leftpad=starts, causal=True)
    for step in range(3):
        for k, v in caches:
            q = torch.randn(B, 4, 16, generator=g)
            case = DenseCase(q, k, v, cu_q, used, starts, [1] * B, used.tolist(), starts.tolist())
            ref, _ = reference(case, causal=True)
            assert_close_packed(p.run(q, k, v), ref, cu_seqlens=cu_q.tolist())
        used = used + 1
        p.update(cu_q, None, 1, S, seqused_k=used, cache_leftpad=starts)
    with pytest.raises(ValueError, match="with cache_leftpad"):
        p.update(cu_q, None, 1, S, seqused_k=used)


@pytest.mark.parametrize("seed", range(4))
def test_ranges_batch_equals_the_validated_one(seed):
    """``plans.over_ranges`` (the transformers hook's plan: ranges derived on the host from a
    validity mask, not checked again) holds the same batch facts as ``plan`` over the same tensors,
    and runs the same numbers."""
    from jagged_sdpa import batch as batches, plans

    g = torch.Generator().manual_seed(seed)
    B, S, Q = 5, 24, 1 + seed % 2
    starts = torch.randint(0, S, (B,), generator=g, dtype=torch.int32)
    used = torch.minimum(torch.randint(0, S + 1, (B,), generator=g, dtype=torch.int32), S - starts)
    starts[0], used[0] = S - 3, 3  # row 0 ends at the cache's last slot
    if seed == 0:
        used[1] = 0  # an empty row
    cu_q = torch.arange(0, (B + 1) * Q, Q, dtype=torch.int32)
    mine = plans.over_ranges(cu_q, Q, used, starts, used.numpy(), starts.numpy(), causal=True)
    theirs = jagged_sdpa.plan(cu_q, None, Q, int(used.max()), seqused_k=used, cache_leftpad=starts, causal=True)
    a, b = mine._batch, theirs._batch
    for name in ("size", "max_seqlen_q", "max_seqlen_k", "has_empty_q", "has_empty_k", "equal_lengths", "names",
                 "cu_q_host", "cu_k_host", "seqused_host", "table_host", "kv_dense", "dense_cache", "leftpad_host",
                 "lengths_known", "paged"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("cu_seqlens_q", "seqused_k", "block_table", "cache_leftpad"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    k = torch.randn(B, 2, S, 16, generator=g).transpose(1, 2)
    v = torch.randn(B, 2, S, 16, generator=g).transpose(1, 2)
    q = torch.randn(B * Q, 4, 16, generator=g)
    assert torch.equal(mine.run(q, k, v), theirs.run(q, k, v))
    with pytest.raises(ValueError, match=r"cache_leftpad\[0\] \+ seqused_k\[0\] = 21 \+ 3 exceeds the cache length S = 23"):
        mine.run(q, k[:, :S - 1], v[:, :S - 1])  # ``bind`` still checks the ranges against a layer's cache


def test_plan_run_refuses_a_range_past_the_cache():
    cu_q = torch.arange(3, dtype=torch.int32)
    p = jagged_sdpa.plan(cu_q, None, 1, 64, seqused_k=torch.tensor([4, 8], dtype=torch.int32),
                         cache_leftpad=torch.tensor([0, 6], dtype=torch.int32))
    k = torch.randn(2, 12, 2, 16)
    with pytest.raises(ValueError, match=r"cache_leftpad\[1\] \+ seqused_k\[1\] = 6 \+ 8 exceeds the cache length S = 12"):
        p.run(torch.randn(2, 2, 16), k, k)


# ----------------------------------------------------------------------------------------------
# rejected calls


def _call(case, **changes):
    kwargs = case.kwargs(causal=True)
    args = list(case.args())
    names = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    for key, value in changes.items():
        if key in names:
            args[names.index(key)] = value
        else:
            kwargs[key] = value
    return jagged_sdpa.varlen_attention(*args, **kwargs)


I32 = torch.int32
REJECTED = {
    "no_seqused_k": (dict(seqused_k=None), ValueError, "seqused_k .* is required"),
    "leftpad_with_block_table": (dict(block_table=torch.zeros(7, 1, dtype=I32)), ValueError,
                                 "cache_leftpad must be None with a block_table"),
    "leftpad_with_cu_seqlens_k": (dict(cu_seqlens_k=torch.zeros(8, dtype=I32)), ValueError,
                                  "cache_leftpad must be None with cu_seqlens_k"),
    "leftpad_dtype": (dict(cache_leftpad=torch.zeros(7, dtype=torch.int64)), TypeError, "cache_leftpad must be int32"),
    "leftpad_shape": (dict(cache_leftpad=torch.zeros(6, dtype=I32)), ValueError, "cache_leftpad must have 7 entries"),
    "leftpad_2d": (dict(cache_leftpad=torch.zeros(7, 1, dtype=I32)), ValueError, "cache_leftpad must be 1-D"),
    "leftpad_device": (dict(cache_leftpad=torch.zeros(7, dtype=I32, device="meta")), ValueError,
                       "cache_leftpad is on meta"),
    "leftpad_negative": (dict(cache_leftpad=torch.tensor([0, 0, 0, 0, -1, 0, 0], dtype=I32)), ValueError,
                         r"cache_leftpad\[4\] = -1 must be >= 0"),
    "leftpad_past_S": (dict(cache_leftpad=torch.tensor([20, 0, 0, 0, 0, 0, 0], dtype=I32)), ValueError,
                       r"cache_leftpad\[0\] \+ seqused_k\[0\] = 20 \+ 20 exceeds the cache length S = 34"),
    "seqused_past_S": (dict(seqused_k=torch.tensor([20, 35, 1, 3, 6, 0, 2], dtype=I32), cache_leftpad=None),
                       ValueError, r"seqused_k\[1\]"),
    "seqused_negative": (dict(seqused_k=torch.tensor([20, -1, 1, 3, 6, 0, 2], dtype=I32)), ValueError,
                         r"seqused_k\[1\] must be >= 0"),
    "max_seqlen_k_too_small": (dict(max_seqlen_k=10), ValueError, "max_seqlen_k"),
    "cache_3d": (dict(k=torch.randn(10, 2, 16), v=torch.randn(10, 2, 16)), ValueError,
                 r"k must be 4-D \(B, S, Hkv, D\) \(a dense cache"),
    "cache_wrong_batch": (dict(k=torch.randn(6, 34, 2, 16), v=torch.randn(6, 34, 2, 16)), ValueError,
                          "one row per sequence"),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_rejects(name):
    changes, exc, pattern = REJECTED[name]
    case = make_case(Q_LENS, K_LENS, STARTS)
    assert case.k_cache.shape[1] == 34
    with pytest.raises(exc, match=pattern):
        _call(case, **changes)
