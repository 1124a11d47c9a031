"""fp8 KV caches (docs/api.md section 13): paged and dense caches stored in ``float8_e4m3fn`` or
``float8_e5m2``, read with ``k_scale``/``v_scale`` (per tensor or per kv head).

The reference is the float64 attention of the dequantized cache (``k.float() * k_scale``, as the
contract defines the keys). The accuracy rule: a backend's error is at most 2x the error of MATH
run on the dequantized cache cast to q's dtype, plus the dtype's floor. Every cache slot outside
the rows' ranges holds an fp8 NaN byte: a backend that reads one gives NaN. ``paged_append``'s
quantization is checked against nearest-even rounding done by search over the format's 256 codes.
"""

from __future__ import annotations

import pytest
import torch

import jagged_sdpa
from jagged_sdpa import Backend
from jagged_sdpa.backends.cuda.efficient import EfficientBackend
from jagged_sdpa.backends.cuda.flash_varlen import FlashVarlenBackend
from jagged_sdpa.backends.math import MathBackend
from jagged_sdpa.backends.triton import TritonBackend
from jagged_sdpa.spec import AttnSpec
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
NAN_BYTE = 0x7F  # NaN in both formats
BACKENDS = [Backend.MATH, Backend.TRITON, Backend.CPU_FUSED]

# A decode/chunked-prefill step: a prefill chunk, decodes over long and short ranges, a row with
# no keys, a zero-length query, a chunk longer than its keys.
Q_LENS = [5, 1, 1, 3, 0, 1, 4]
K_LENS = [20, 31, 1, 3, 6, 0, 2]
STARTS = [4, 0, 9, 17, 2, 5, 0]
HEADS_Q, HEADS_KV, D = 4, 2, 16


def scales(kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    if kind == "tensor":
        return torch.tensor(0.05), torch.tensor(0.03)
    return torch.rand(HEADS_KV, generator=g) * 0.1 + 0.01, torch.rand(HEADS_KV, generator=g) * 0.1 + 0.01


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    largest = torch.finfo(dtype).max
    return (x / scale.view(-1, 1)).clamp(-largest, largest).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() * scale.view(-1, 1)


class Case:
    """A dense fp8 cache (B, S, Hkv, D) as transformers lays it out, or the same keys in a paged
    cache with shuffled blocks; NaN bytes everywhere outside the rows' ranges."""

    def __init__(self, dtype, q_dtype, scale_kind, *, paged: bool, seed: int = 0, magnitude: float = 1.0,
                 q_magnitude: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        self.paged = paged
        self.k_scale, self.v_scale = scales(scale_kind, seed)
        B = len(Q_LENS)
        S = max(s + n for s, n in zip(STARTS, K_LENS)) + 3
        k = torch.randn(B, HEADS_KV, S, D, generator=g) * magnitude
        v = torch.randn(B, HEADS_KV, S, D, generator=g)
        k8 = quantize(k.transpose(1, 2), self.k_scale, dtype)   # (B, S, Hkv, D)
        v8 = quantize(v.transpose(1, 2), self.v_scale, dtype)
        for c in (k8, v8):
            bytes_ = c.view(torch.uint8)
            for b, (s, n) in enumerate(zip(STARTS, K_LENS)):
                bytes_[b, :s] = NAN_BYTE
                bytes_[b, s + n:] = NAN_BYTE
        # each row's used keys, dequantized (the reference's keys)
        self.k_rows = [dequantize(k8[b, s:s + n], self.k_scale) for b, (s, n) in enumerate(zip(STARTS, K_LENS))]
        self.v_rows = [dequantize(v8[b, s:s + n], self.v_scale) for b, (s, n) in enumerate(zip(STARTS, K_LENS))]
        self.q = (torch.randn(sum(Q_LENS), HEADS_Q, D, generator=g) * q_magnitude).to(q_dtype)
        self.cu_q = torch.tensor([0] + [sum(Q_LENS[:i + 1]) for i in range(B)], dtype=torch.int32)
        self.seqused_k = torch.tensor(K_LENS, dtype=torch.int32)
        if not paged:
            self.k, self.v = k8, v8
            self.extra = dict(cache_leftpad=torch.tensor(STARTS, dtype=torch.int32))
            self.max_k = S
            return
        block = 4
        width = -(-max(K_LENS) // block) + 1
        num_blocks = B * width + 3
        order = torch.randperm(num_blocks, generator=g)
        table = order[:B * width].view(B, width).to(torch.int32)
        kp = torch.full((num_blocks, block, HEADS_KV, D), NAN_BYTE, dtype=torch.uint8).view(dtype)
        vp = kp.clone()
        for b, (s, n) in enumerate(zip(STARTS, K_LENS)):
            for j in range(n):
                blk, off = table[b, j // block], j % block
                kp[blk, off] = k8[b, s + j]
                vp[blk, off] = v8[b, s + j]
        self.k, self.v = kp, vp
        self.extra = dict(block_table=table)
        self.max_k = max(K_LENS)

    def args(self, k=None, v=None):
        return (self.q, self.k if k is None else k, self.v if v is None else v, self.cu_q, None, max(Q_LENS),
                self.max_k)

    def kwargs(self, **options):
        return dict(seqused_k=self.seqused_k, k_scale=self.k_scale, v_scale=self.v_scale, **self.extra, **options)

    def reference(self, **options):
        cu_k = [0]
        for n in K_LENS:
            cu_k.append(cu_k[-1] + n)
        k = torch.cat(self.k_rows).double()
        v = torch.cat(self.v_rows).double()
        return attention_reference(self.q.double(), k, v, self.cu_q.tolist(), cu_k, alignment="bottom_right",
                                   **options)

    def math_in_q_dtype(self, **options):
        """MATH on the dequantized cache cast to q's dtype: the error the rule compares against."""
        dq = self.q.dtype
        k = torch.full(self.k.shape, float("nan"), dtype=dq)
        v = torch.full(self.v.shape, float("nan"), dtype=dq)
        if self.paged:
            table = self.extra["block_table"]
            block = k.shape[1]
            for b, n in enumerate(K_LENS):
                for j in range(n):
                    k[table[b, j // block], j % block] = self.k_rows[b][j].to(dq)
                    v[table[b, j // block], j % block] = self.v_rows[b][j].to(dq)
        else:
            for b, (s, n) in enumerate(zip(STARTS, K_LENS)):
                k[b, s:s + n], v[b, s:s + n] = self.k_rows[b].to(dq), self.v_rows[b].to(dq)
        kwargs = self.kwargs(backend=Backend.MATH, return_lse=True, **options)
        del kwargs["k_scale"], kwargs["v_scale"]
        return jagged_sdpa.varlen_attention(*self.args(k, v), **kwargs)


def require(backend, case, **options):
    reasons = jagged_sdpa.explain(*case.args(), **case.kwargs(backend=backend, **options)).reasons[backend]
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    if backend is Backend.TRITON and case.q.dtype == torch.bfloat16:
        pytest.skip("triton: bf16 gives wrong numbers under the Triton interpreter (CPU); runs on CUDA")


@pytest.fixture(autouse=True)
def _triton_interpreted(monkeypatch):
    """TRITON runs CPU tensors under its interpreter (triton was imported interpreted by conftest)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def check(backend, case, **options):
    require(backend, case, **options)
    out, lse = jagged_sdpa.varlen_attention(*case.args(), **case.kwargs(backend=backend, return_lse=True, **options))
    reference_options = {("window" if name == "window_size" else name): x for name, x in options.items()}
    ref_out, ref_lse = case.reference(**reference_options)
    math_out, _ = case.math_in_q_dtype(**options)
    assert out.dtype == case.q.dtype
    assert_close_packed(out, ref_out, cu_seqlens=case.cu_q.tolist(), name=f"{backend} out", lowp_ref=math_out)
    assert_close_lse(lse, ref_lse, name=f"{backend} lse")


OPTIONS = {
    "causal": dict(causal=True),
    "none": dict(causal=False),
    "window": dict(causal=True, window_size=(6, 0)),
    "softcap": dict(causal=True, softcap=2.5),
    "alibi": dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "sinks": dict(causal=True, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
}


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale_kind", ["tensor", "head"])
def test_fp8_cache_matches_the_dequantized_reference(backend, paged, dtype, q_dtype, scale_kind):
    check(backend, Case(dtype, q_dtype, scale_kind, paged=paged), causal=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_fp8_cache_with_every_option(backend, option):
    check(backend, Case(torch.float8_e4m3fn, torch.float32, "head", paged=True, seed=1), **OPTIONS[option])


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_cache_huge_logits(backend, dtype):
    """Keys near the format's largest values: logits in the thousands, one-hot softmax rows."""
    check(backend, Case(dtype, torch.float32, "tensor", paged=False, seed=2, magnitude=60.0), causal=True)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("q_magnitude", [1e3, 1e5], ids=["q-1e3", "q-1e5"])
def test_fp8_cache_large_queries(paged, q_magnitude):
    """The compiled kernel folds 2^120 into q (times the softmax scale and k_scale: 1e3 gives ~40)
    while that cannot overflow, else 2^8 (1e5 gives ~4,000) with another widening of the e4m3 keys;
    both sides, with tiny keys (many subnormal codes). A build that always took 2^120 fails 1e5."""
    check(Backend.CPU_FUSED, Case(torch.float8_e4m3fn, torch.float32, "tensor", paged=paged, seed=5, magnitude=0.05,
                                  q_magnitude=q_magnitude), causal=True)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_cache_with_denormals_flushed(dtype):
    """Under ``torch.set_flush_denormal(True)`` (DAZ and FTZ on x86) the kernel cannot widen e4m3
    codes into float32 subnormals (DAZ would read them as 0): it takes another widening. Keys small
    enough that many codes are subnormal; one thread, so the flag is the kernel's thread's."""
    threads = torch.get_num_threads()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        torch.set_num_threads(1)
        check(Backend.CPU_FUSED, Case(dtype, torch.float32, "head", paged=True, seed=6, magnitude=0.01), causal=True)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def test_plan_reads_fp8_caches_per_layer():
    """``plan.run`` takes each layer's scales; layers differ only in their scales here."""
    case = Case(torch.float8_e4m3fn, torch.float32, "head", paged=True, seed=3)
    plan = jagged_sdpa.plan(case.cu_q, None, max(Q_LENS), case.max_k, causal=True, seqused_k=case.seqused_k,
                            **case.extra)
    for factor in (1.0, 2.0):
        k_scale, v_scale = case.k_scale * factor, case.v_scale * factor
        out = plan.run(case.q, case.k, case.v, k_scale=k_scale, v_scale=v_scale)
        want = jagged_sdpa.varlen_attention(*case.args(), **{**case.kwargs(causal=True), "k_scale": k_scale,
                                                             "v_scale": v_scale})
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        plan.run(case.q, case.k, case.v)


def test_explain_says_who_reads_fp8(monkeypatch):
    """The call's description names the fp8 cache; PyTorch's CUDA kernels refuse it with the reason
    (their availability faked: this machine has no CUDA), MATH takes it."""
    case = Case(torch.float8_e5m2, torch.float16, "tensor", paged=True)
    e = jagged_sdpa.explain(*case.args(), **case.kwargs(causal=True))
    assert "fp8_cache(float8_e5m2)" in str(e)
    assert e.reasons[Backend.MATH] == []
    spec = AttnSpec(entry="varlen", device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=2, heads_q=8,
                    heads_kv=2, head_dim=128, head_dim_v=128, total_q=2, total_k=64 * 16, max_seqlen_q=1,
                    max_seqlen_k=100, has_empty_q=False, has_empty_k=False, lengths_known=True, causal=True,
                    alignment="bottom_right", paged=True, block_size=16, seqused_k=True,
                    cache_dtype=torch.float8_e4m3fn)
    for impl in (FlashVarlenBackend, EfficientBackend):
        monkeypatch.setattr(impl, "is_available", classmethod(lambda cls: None))
        assert any("fp8 KV cache (float8_e4m3fn" in r for r in impl.reasons(spec)), impl.reasons(spec)
        assert not any("fp8" in r for r in impl.reasons(spec.replace(cache_dtype=None)))
    assert TritonBackend.caps.fp8_cache and MathBackend.caps.fp8_cache


# ----------------------------------------------------------------------------------------------
# paged_append quantizes


def nearest_even(x: torch.Tensor, dtype) -> torch.Tensor:
    """Round each float32 of ``x`` to ``dtype`` by search over its finite codes: the nearest value,
    ties to the even code; beyond the largest finite value (inf included) the largest; NaN stays NaN."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    values = codes.double()
    finite = torch.isfinite(values)
    values, codes = values[finite], codes[finite].view(torch.uint8)
    largest = values.max().item()
    out = []
    for t in x.double().flatten().tolist():
        if t != t:
            out.append(float("nan"))
            continue
        t = max(-largest, min(largest, t))
        dist = (values - t).abs()
        best = dist.min()
        tied = (dist == best).nonzero().flatten()
        even = [i for i in tied.tolist() if int(codes[i]) % 2 == 0]
        out.append(values[(even or tied.tolist())[0]].item())
    return torch.tensor(out, dtype=torch.float32).view(x.shape)


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("scale_kind", ["tensor", "head"])
def test_paged_append_rounds_to_nearest_even_and_saturates(dtype, scale_kind):
    g = torch.Generator().manual_seed(4)
    k_scale, v_scale = scales(scale_kind, 4)
    B, block = 2, 4
    k_cache = torch.zeros(6, block, HEADS_KV, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[3, 0, 5], [1, 2, 4]], dtype=torch.int32)
    used = torch.tensor([2, 5], dtype=torch.int32)
    cu_new = torch.tensor([0, 3, 7], dtype=torch.int32)
    k_new = torch.randn(7, HEADS_KV, D, generator=g) * torch.logspace(-6, 6, D)  # subnormals to saturation
    k_new[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    v_new = torch.randn(7, HEADS_KV, D, generator=g).to(torch.bfloat16)
    new_used = jagged_sdpa.paged_append(k_cache, v_cache, table, used, k_new, v_new, cu_new, k_scale=k_scale,
                                        v_scale=v_scale)
    assert new_used.tolist() == [5, 9]
    want_k = nearest_even(k_new / k_scale.view(-1, 1), dtype)
    want_v = nearest_even(v_new.float() / v_scale.view(-1, 1), dtype)
    slots = [(b, pos) for b in range(B) for pos in range(used[b], new_used[b])]
    for t, (b, pos) in enumerate(slots):
        blk, off = table[b, pos // block], pos % block
        for got, want in ((k_cache[blk, off].float(), want_k[t]), (v_cache[blk, off].float(), want_v[t])):
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            assert torch.equal(got.nan_to_num(0), want.nan_to_num(0)), (t, got, want)
    assert not torch.isinf(k_cache.float()).any()


# ----------------------------------------------------------------------------------------------
# rejected inputs, before anything runs


def _dense(dtype=torch.float8_e4m3fn, q_dtype=torch.float32):
    return Case(dtype, q_dtype, "tensor", paged=False)


def test_rejects_fp8_cache_without_scales():
    case = _dense()
    kwargs = case.kwargs()
    del kwargs["v_scale"]
    with pytest.raises(ValueError, match="needs k_scale and v_scale.*v_scale missing"):
        jagged_sdpa.varlen_attention(*case.args(), **kwargs)


def test_rejects_scales_with_a_cache_that_is_not_fp8():
    case = _dense()
    k, v = case.k.float(), case.v.float()
    with pytest.raises(ValueError, match="k_scale is given but the KV cache is not fp8"):
        jagged_sdpa.varlen_attention(*case.args(k, v), **case.kwargs())


@pytest.mark.parametrize("bad, error, match", [
    (torch.tensor(0.05, dtype=torch.float64), TypeError, "k_scale must be float32"),
    (torch.ones(3), ValueError, r"k_scale must have shape \(\) .* or \(2,\)"),
    (torch.ones(1, 2), ValueError, "k_scale must have shape"),
    (0.05, TypeError, "k_scale must be a torch.Tensor"),
    (torch.tensor(0.05, device="meta"), ValueError, "k_scale is on meta"),
])
def test_rejects_bad_scales(bad, error, match):
    case = _dense()
    with pytest.raises(error, match=match):
        jagged_sdpa.varlen_attention(*case.args(), **{**case.kwargs(), "k_scale": bad})


def test_rejects_fp8_call_that_needs_gradients():
    case = _dense()
    q = case.q.clone().requires_grad_(True)
    args = (q,) + case.args()[1:]
    with pytest.raises(ValueError, match="forward only"):
        jagged_sdpa.varlen_attention(*args, **case.kwargs())


def test_rejects_float64_q_with_fp8_cache():
    case = _dense()
    args = (case.q.double(),) + case.args()[1:]
    with pytest.raises(TypeError, match="q must be float16, bfloat16 or float32 with an fp8 KV cache"):
        jagged_sdpa.varlen_attention(*args, **case.kwargs())


def test_rejects_fp8_packed_keys_and_mixed_dtypes():
    case = _dense()
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    q = torch.randn(4, HEADS_Q, D)
    k = torch.randn(4, HEADS_KV, D).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="must be a paged cache .* or a dense cache"):
        jagged_sdpa.varlen_attention(q, k, k, cu, cu, 2, 2, k_scale=case.k_scale, v_scale=case.v_scale)
    with pytest.raises(TypeError, match="v dtype torch.float8_e5m2 does not match k dtype torch.float8_e4m3fn"):
        jagged_sdpa.varlen_attention(*case.args(case.k, case.v.view(torch.uint8).view(torch.float8_e5m2)),
                                     **case.kwargs())


def test_paged_append_rejects_bad_fp8_inputs():
    k_cache = torch.zeros(4, 4, HEADS_KV, D, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    used = torch.tensor([0], dtype=torch.int32)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    new = torch.randn(2, HEADS_KV, D)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        jagged_sdpa.paged_append(k_cache, v_cache, table, used, new, new, cu)
    with pytest.raises(ValueError, match="k_scale must have shape"):
        jagged_sdpa.paged_append(k_cache, v_cache, table, used, new, new, cu, k_scale=torch.ones(3),
                                 v_scale=torch.ones(()))
    with pytest.raises(TypeError, match="v_cache dtype torch.float8_e5m2 does not match"):
        jagged_sdpa.paged_append(k_cache, v_cache.view(torch.float8_e5m2), table, used, new, new, cu,
                                 k_scale=torch.ones(()), v_scale=torch.ones(()))
    with pytest.raises(ValueError, match="not fp8"):
        jagged_sdpa.paged_append(k_cache.float(), v_cache.float(), table, used, new, new, cu, k_scale=torch.ones(()),
                                 v_scale=torch.ones(()))
    assert (k_cache.view(torch.uint8) == 0).all()  # nothing written by a rejected call


def test_fp8_cache_under_torch_compile():
    """The scales cross the operator: a compiled decode step equals the eager one, no graph break."""
    case = _dense()
    kwargs = case.kwargs(causal=True)

    def step(q, k, v, k_scale, v_scale):
        return jagged_sdpa.varlen_attention(q, k, v, case.cu_q, None, max(Q_LENS), case.max_k,
                                            **{**kwargs, "k_scale": k_scale, "v_scale": v_scale})

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    got = compiled(case.q, case.k, case.v, case.k_scale, case.v_scale)
    want = step(case.q, case.k, case.v, case.k_scale, case.v_scale)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
