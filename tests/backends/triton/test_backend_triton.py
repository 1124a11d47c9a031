"""TRITON backend against the float64 reference, forward and backward.

Without a GPU the tests run on CPU tensors under TRITON_INTERPRET=1. Triton reads that variable
when its kernels are decorated, and the backend imports them on first use, so the fixture below sets
it for this module's tests only (before their first TRITON call); other test modules keep seeing
TRITON ineligible on the CPU. With a GPU the same tests run compiled on CUDA tensors. Shapes are
tiny because the interpreter runs every program in Python; bf16 is wrong under the Triton 3.9
interpreter, so bf16 and real sizes are ``cuda`` tests.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Triton reads TRITON_INTERPRET when functions are decorated (tests/support/triton_interpreter.py).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from support.triton_interpreter import interpreter_env, is_interpreted  # noqa: E402

with interpreter_env(DEVICE == "cpu"):
    triton = pytest.importorskip("triton")
# A module collected earlier in the same run may have imported triton compiled (jagged_sdpa itself
# does, through torch): then every case here runs again in a fresh interpreted process
# (``test_module_under_the_interpreter``) instead of being skipped.
TRITON_OK = DEVICE != "cpu" or is_interpreted(triton)

import jagged_sdpa  # noqa: E402
from jagged_sdpa import Backend  # noqa: E402
from jagged_sdpa.backends import IMPLS  # noqa: E402
from jagged_sdpa.backends import triton as triton_backend  # noqa: E402
from support.cases import cu_of, in_nan_buffer  # noqa: E402
from support.reference import attention_reference  # noqa: E402
from support.tolerances import assert_close_lse, assert_close_packed  # noqa: E402

pytestmark = pytest.mark.interpret


@pytest.fixture(autouse=True)
def _interpret_on_cpu(monkeypatch, request):
    if request.node.name == "test_module_under_the_interpreter":
        return
    if not TRITON_OK:
        pytest.skip("triton was imported (compiled) before this module: test_module_under_the_interpreter runs it")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.skipif(TRITON_OK, reason="the TRITON cases run in this process")
def test_module_under_the_interpreter():
    """This module's cases in a fresh process that sets TRITON_INTERPRET=1 before triton is imported
    (in a whole-suite run an earlier module imports it compiled)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-m",
                             "not cuda"], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]


def _tensors(lens_q, lens_k, hq, hkv, d, dv, dtype, device=DEVICE):
    q = torch.randn(sum(lens_q), hq, d, device=device).to(dtype)
    k = torch.randn(sum(lens_k), hkv, d, device=device).to(dtype)
    v = torch.randn(sum(lens_k), hkv, dv, device=device).to(dtype)
    return q, k, v


def _reference(q, k, v, cu_q, cu_k, grad_out=None, **opts):
    """float64 out, lse and (when grad_out is given) gradients, by autograd through the reference."""
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_(grad_out is not None) for x in (q, k, v))
    opts = {name: (x.cpu() if isinstance(x, torch.Tensor) else x) for name, x in opts.items()}
    out, lse = attention_reference(q64, k64, v64, cu_q.tolist(), cu_k.tolist(), **opts)
    grads = None
    if grad_out is not None:
        out.backward(grad_out.detach().cpu().double())
        grads = (q64.grad, k64.grad, v64.grad)
    return out.detach(), lse.detach(), grads


def _check_varlen(lens_q, lens_k, *, hq=2, hkv=2, d=16, dv=None, dtype=torch.float32, backward=True,
                  causal=False, window=(-1, -1), softcap=0.0, alibi=None, seqused=None, device=DEVICE):
    dv = d if dv is None else dv
    q, k, v = _tensors(lens_q, lens_k, hq, hkv, d, dv, dtype, device)
    cu_q, cu_k = cu_of(lens_q).to(device), cu_of(lens_k).to(device)
    slopes = None
    if alibi == "per_head":
        slopes = torch.rand(hq, device=device)
    elif alibi == "per_batch_head":
        slopes = torch.rand(len(lens_q), hq, device=device)
    used = None if seqused is None else torch.tensor(seqused, dtype=torch.int32, device=device)
    for x in (q, k, v):
        x.requires_grad_(backward)
    out, lse = jagged_sdpa.varlen_attention(
        q, k, v, cu_q, cu_k, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
        seqused_k=used, return_lse=True, backend="triton")
    grad_out = torch.randn_like(out) if backward else None
    ref_out, ref_lse, ref_grads = _reference(
        q, k, v, cu_q, cu_k, grad_out, causal=causal, alignment="bottom_right", window=window, softcap=softcap,
        alibi_slopes=slopes, seqused_k=used)
    assert_close_packed(out, ref_out, cu_seqlens=cu_q.tolist(), name="out")
    assert_close_lse(lse, ref_lse)
    if backward:
        out.backward(grad_out)
        for name, x, ref, cu in (("dq", q, ref_grads[0], cu_q), ("dk", k, ref_grads[1], cu_k),
                                 ("dv", v, ref_grads[2], cu_k)):
            assert_close_packed(x.grad, ref, cu_seqlens=cu.tolist(), name=name, grad=True)


# Each option appears at least once, forward and backward; lengths include 0, 1 and a masked D.
VARLEN_CASES = {
    "plain-ragged-empty-gqa-D40-Dv24": dict(lens_q=[0, 1, 5, 17], lens_k=[3, 0, 9, 17], hq=4, hkv=2, d=40, dv=24),
    "causalBR-longer-keys": dict(lens_q=[1, 5, 17], lens_k=[9, 5, 12], causal=True),
    "window-mqa-D64": dict(lens_q=[5, 17], lens_k=[17, 6], hq=4, hkv=1, d=64, window=(3, 2)),
    "causal-window-alibi-per-batch-head": dict(lens_q=[17, 4, 0], lens_k=[17, 9, 2], causal=True,
                                               window=(4, 0), alibi="per_batch_head"),
    "softcap-alibi-per-head-f16": dict(lens_q=[5, 17], lens_k=[17, 5], hq=4, hkv=2, d=40, dtype=torch.float16,
                                       softcap=2.0, alibi="per_head"),
    "causal-gqa-f16": dict(lens_q=[17, 1, 0], lens_k=[17, 8, 3], hq=4, hkv=2, dtype=torch.float16, causal=True),
    "seqused-k": dict(lens_q=[3, 5, 2], lens_k=[9, 17, 4], seqused=[4, 17, 0], causal=True),
    "D256-Dv16": dict(lens_q=[3, 9], lens_k=[9, 4], d=256, dv=16),
    "D8-causal": dict(lens_q=[3, 9], lens_k=[9, 4], d=8, causal=True),
    "wide-window-interior-blocks-alibi": dict(lens_q=[40, 3], lens_k=[40, 35], window=(33, 17), alibi="per_head"),
    "long-tail": dict(lens_q=[1, 1, 1, 1, 40], lens_k=[1, 1, 1, 1, 40], causal=True, backward=False),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES), ids=list(VARLEN_CASES))
def test_varlen_matches_reference(case):
    _check_varlen(**VARLEN_CASES[case])


def _njt(values: torch.Tensor, lengths) -> torch.Tensor:
    offsets = cu_of(lengths).to(torch.int64).to(values.device)
    return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)


def test_sdpa_top_left_cross_attention_from_fused_qkv_buffer():
    """Strided q/k/v (chunks of one fused projection), top-left causal with unequal lengths."""
    lens_q, lens_k, h, d = [5, 1, 12], [9, 4, 3], 2, 16
    qkv = torch.randn(sum(lens_q), 3, h, d, device=DEVICE, requires_grad=True)
    kv = torch.randn(sum(lens_k), 2, h, d, device=DEVICE, requires_grad=True)
    q_vals, k_vals, v_vals = qkv[:, 0], kv[:, 0], kv[:, 1]
    out = jagged_sdpa.sdpa(_njt(q_vals, lens_q), _njt(k_vals, lens_k), _njt(v_vals, lens_k), is_causal=True,
                           backend="triton")
    packed = out.transpose(1, 2).values()
    grad_out = torch.randn_like(packed)
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    ref_out, _, (dq, dk, dv) = _reference(q_vals, k_vals, v_vals, cu_q, cu_k, grad_out, causal=True,
                                          alignment="top_left")
    assert_close_packed(packed, ref_out, cu_seqlens=cu_q.tolist())
    packed.backward(grad_out)
    assert_close_packed(qkv.grad[:, 0], dq, cu_seqlens=cu_q.tolist(), name="dq", grad=True)
    assert_close_packed(kv.grad[:, 0], dk, cu_seqlens=cu_k.tolist(), name="dk", grad=True)
    assert_close_packed(kv.grad[:, 1], dv, cu_seqlens=cu_k.tolist(), name="dv", grad=True)
    assert torch.count_nonzero(qkv.grad[:, 1:]) == 0


def test_sdpa_dense_kv_gqa_bottom_right_window():
    lens_q, hq, hkv, s, d = [3, 0, 7], 4, 2, 6, 16
    q_vals = torch.randn(sum(lens_q), hq, d, device=DEVICE, requires_grad=True)
    key = torch.randn(len(lens_q), hkv, s, d, device=DEVICE, requires_grad=True)
    value = torch.randn(len(lens_q), hkv, s, d, device=DEVICE, requires_grad=True)
    out = jagged_sdpa.sdpa(_njt(q_vals, lens_q), key, value, enable_gqa=True, causal_alignment="bottom_right",
                           window_size=(2, 1), backend=Backend.TRITON)
    packed = out.transpose(1, 2).values()
    grad_out = torch.randn_like(packed)
    k_packed = key.detach().transpose(1, 2).reshape(-1, hkv, d)
    v_packed = value.detach().transpose(1, 2).reshape(-1, hkv, d)
    cu_q, cu_k = cu_of(lens_q), cu_of([s] * len(lens_q))
    ref_out, _, (dq, dk, dv) = _reference(q_vals, k_packed, v_packed, cu_q, cu_k, grad_out,
                                          alignment="bottom_right", window=(2, 1))
    assert_close_packed(packed, ref_out, cu_seqlens=cu_q.tolist())
    packed.backward(grad_out)
    assert_close_packed(q_vals.grad, dq, cu_seqlens=cu_q.tolist(), name="dq", grad=True)
    assert_close_packed(key.grad.transpose(1, 2).reshape(-1, hkv, d), dk, cu_seqlens=cu_k.tolist(), name="dk",
                        grad=True)
    assert_close_packed(value.grad.transpose(1, 2).reshape(-1, hkv, d), dv, cu_seqlens=cu_k.tolist(), name="dv",
                        grad=True)


def test_nan_tails_are_never_read():
    lens_q, lens_k = [0, 5, 17], [4, 17, 0]
    q, k, v = (in_nan_buffer(x) for x in _tensors(lens_q, lens_k, 2, 1, 40, 24, torch.float32, "cpu"))
    q, k, v = (x.to(DEVICE).requires_grad_() for x in (q, k, v))
    cu_q, cu_k = cu_of(lens_q).to(DEVICE), cu_of(lens_k).to(DEVICE)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True, backend="triton")
    out.sum().backward()
    for t in (out, q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()
    ref_out, ref_lse, _ = _reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right")
    assert_close_packed(out, ref_out, cu_seqlens=cu_q.tolist())
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("lens_q, lens_k, hq, hkv, window", [
    ([14], [1], 4, 2, (-1, -1)),          # GQA-packed decode tile, rows 0-7 see no key
    ([14, 9], [1, 0], 4, 2, (2, 0)),      # the same with a window and an empty key sequence
    ([40, 3], [3, 1], 2, 2, (-1, -1)),    # per-head tiles whose band ends before key 0
    ([30], [2], 4, 1, (0, 1)),            # MQA, window right of the diagonal
], ids=["gqa-packed", "gqa-window-empty-k", "per-head", "mqa-window"])
def test_rows_before_the_first_key_read_nothing(lens_q, lens_k, hq, hkv, window):
    """Bottom-right causal with Lq > Lk: a tile whose band ends before key 0 has a negative upper
    bound; every key range must stay inside [0, Lk), so keys in a NaN buffer are never read and
    rows that see no key are written as 0 / lse -inf (not left unwritten)."""
    q, k, v = (in_nan_buffer(x) for x in _tensors(lens_q, lens_k, hq, hkv, 24, 24, torch.float32, "cpu"))
    q, k, v = (x.to(DEVICE) for x in (q, k, v))
    cu_q, cu_k = cu_of(lens_q).to(DEVICE), cu_of(lens_k).to(DEVICE)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, window_size=window,
                                            return_lse=True, backend="triton")
    ref_out, ref_lse, _ = _reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right", window=window)
    assert not torch.isnan(out).any()
    assert_close_packed(out, ref_out, cu_seqlens=cu_q.tolist())
    assert_close_lse(lse, ref_lse)


def test_all_empty_batch():
    q, k, v = _tensors([0, 0], [0, 3], 2, 2, 16, 16, torch.float32)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_of([0, 0]).to(DEVICE), cu_of([0, 3]).to(DEVICE),
                                            return_lse=True, backend="triton")
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


# ---------------------------------------------------------------------------------------------------
# device-side input checks (checks/device.py): the Triton form agrees with the torch-op form


def _device_check_cases():
    """(adder, args, ok) triples: good and bad offsets, lengths and block tables."""
    cu = lambda values, dtype=torch.int32: torch.tensor(values, dtype=dtype)  # noqa: E731
    table = torch.tensor([[0, 1, 9], [2, 7, -1]], dtype=torch.int32)
    return [
        ("add_cu", ("cu", cu([0, 3, 8]), 8, 5, "max"), True),
        ("add_cu", ("cu", cu([0, 3, 8], torch.int64), 8, 5, "max"), True),   # NJT offsets are int64
        ("add_cu", ("cu", cu([0]), 0, 0, "max"), True),                       # no sequence
        ("add_cu", ("cu", cu([0, 0, 0]), 0, 0, "max"), True),
        ("add_cu", ("cu", cu([1, 3, 8]), 8, 5, "max"), False),                # does not start at 0
        ("add_cu", ("cu", cu([0, 3, 7]), 8, 5, "max"), False),                # does not end at total
        ("add_cu", ("cu", cu([0, 5, 3, 8]), 8, 5, "max"), False),             # decreasing
        ("add_cu", ("cu", cu([0, 3, 8]), 8, 4, "max"), False),                # longer than max
        ("add_cu", ("cu", cu(list(range(0, 3001, 1))), 3000, 1, "max"), True),  # several blocks
        ("add_cu", ("cu", cu(list(range(0, 3000, 1)) + [3002]), 3002, 1, "max"), False),
        # int32 differences of out-of-range offsets wrap to "valid" lengths (2**31 - 1,
        # 6, 2**31 - 1, 6); sequence 1 would start at row 2**31 - 1 of a 10-row tensor
        ("add_cu", ("cu", cu([0, 2**31 - 1, -2**31 + 5, 4, 10]), 10, 2**31 - 1, "max"), False),
        ("add_cu", ("cu", cu([0, 2**63 - 1, -2**63 + 5, 4, 10], torch.int64), 10, 2**63 - 1, "max"), False),
        ("add_cu", ("cu", cu([0, 2**31 - 1, -2**31 + 5, 4, 10]), 10, 10, "max"), False),
        ("add_cu", ("cu", cu([0, 11, 10]), 10, 20, "max"), False),              # past the total
        ("add_lengths", ("used", cu([4, 0, 9, 1]), cu([0, 2**31 - 1, -2**31 + 5, 4, 10]), 9), False),
        ("add_lengths", ("used", cu([4, 0, 9]), cu([0, 8, 8, 24]), 9), True),
        ("add_lengths", ("used", cu([4, 1, 9]), cu([0, 8, 8, 24]), 9), False),  # above its capacity
        ("add_lengths", ("used", cu([4, -1, 9]), 16, 9), False),
        ("add_lengths", ("used", cu([4, 0, 9]), 16, 8), False),                 # above max_seqlen_k
        ("add_lengths", ("used", cu([4, 0, 9]), 16, 9), True),
        ("add_block_ids", (table, cu([8, 4]), 4, 8), True),        # 9, 7 and -1 are not read
        ("add_block_ids", (table, cu([9, 4]), 4, 8), False),       # reads 9
        ("add_block_ids", (table, cu([8, 8]), 4, 8), True),        # 7 < 8
        ("add_block_ids", (table, cu([8, 9]), 4, 8), False),       # reads -1
        ("add_block_ids", (table[:, :2], cu([0, 5]), 4, 7), False),  # reads 7
    ]


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter runs the Triton form on CPU tensors")
def test_device_checks_triton_form_agrees_with_torch_ops():
    from jagged_sdpa.checks import device

    kernels = device._triton_kernels()
    assert kernels is not None
    for adder, args, ok in _device_check_cases():
        checks = device.DeviceChecks()
        getattr(checks, adder)(*args)
        assert bool(device._flags_torch(checks).all()) == ok, (adder, args)
        assert bool(device._flags_triton(checks, kernels).all()) == ok, (adder, args)
    wrapped = device.DeviceChecks()   # the wrapping case above, queued as a call queues it: a clear error
    wrapped.add_cu("cu_seqlens_q", torch.tensor([0, 2**31 - 1, -2**31 + 5, 4, 10], dtype=torch.int32), 10,
                   2**31 - 1, "max_seqlen_q")
    with pytest.raises(RuntimeError, match="bad cu_seqlens_q: offsets must start at 0, not decrease, stay within"):
        wrapped.queue()
    both = device.DeviceChecks()
    for adder, args, _ in _device_check_cases()[:3]:
        getattr(both, adder)(*args)
    assert device._flags_triton(both, kernels).tolist() == [1, 1, 1]


# ---------------------------------------------------------------------------------------------------
# paged KV cache and split-k decode


def _paged_cache(lens_k, hkv, d, dv, block_size, dtype=torch.float32):
    """A NaN-filled cache holding each sequence's keys in shuffled blocks (one block shared by no one
    and slots past seqused_k left NaN), plus the packed keys the reference sees."""
    blocks_per_seq = [max(1, -(-n // block_size)) for n in lens_k]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks).tolist()
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, hkv, dv), float("nan"), dtype=dtype)
    table = torch.zeros(len(lens_k), max(blocks_per_seq) + 1, dtype=torch.int32)
    k_packed = torch.randn(sum(lens_k), hkv, d).to(dtype)
    v_packed = torch.randn(sum(lens_k), hkv, dv).to(dtype)
    nxt, start = 0, 0
    for b, n in enumerate(lens_k):
        for i in range(blocks_per_seq[b]):
            blk = perm[nxt]
            nxt += 1
            table[b, i] = blk
            rows = slice(start + i * block_size, start + min(n, (i + 1) * block_size))
            count = rows.stop - rows.start
            if count > 0:
                k_cache[blk, :count] = k_packed[rows]
                v_cache[blk, :count] = v_packed[rows]
        start += n
    # An entry no row needs points at a block that does not exist: it must never be read.
    return k_cache, v_cache, table, k_packed, v_packed


@pytest.mark.parametrize("block_size,opts", [
    (16, dict(causal=True, softcap=3.0)),
    (32, dict(window_size=(5, 0), alibi="per_head")),
    (3, dict(causal=True)),
], ids=["bs16-causal-softcap", "bs32-window-alibi", "bs3-causal"])
def test_paged_mixed_prefill_and_decode(block_size, opts):
    lens_q, lens_k, hq, hkv, d, dv = [5, 1, 0, 1], [20, 33, 7, 1], 4, 2, 40, 16
    k_cache, v_cache, table, k_packed, v_packed = _paged_cache(lens_k, hkv, d, dv, block_size)
    q = torch.randn(sum(lens_q), hq, d)
    slopes = torch.rand(hq) if opts.get("alibi") else None
    used = torch.tensor(lens_k, dtype=torch.int32)
    out, lse = jagged_sdpa.varlen_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), cu_of(lens_q).to(DEVICE), None, max(lens_q),
        max(lens_k), block_table=table.to(DEVICE), seqused_k=used.to(DEVICE), causal=opts.get("causal", False),
        window_size=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0),
        alibi_slopes=None if slopes is None else slopes.to(DEVICE), return_lse=True, backend="triton")
    ref_out, ref_lse, _ = _reference(q, k_packed, v_packed, cu_of(lens_q), cu_of(lens_k),
                                     causal=opts.get("causal", False), alignment="bottom_right",
                                     window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0),
                                     alibi_slopes=slopes)
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(lens_q).tolist())
    assert_close_lse(lse, ref_lse)


def test_paged_decode_uses_split_k_and_explains_it():
    """Few queries over long contexts: the rule picks split-k, explain shows it, results match."""
    lens_q, lens_k, hq, hkv, d = [1, 1], [300, 261], 2, 1, 16
    k_cache, v_cache, table, k_packed, v_packed = _paged_cache(lens_k, hkv, d, d, 64)
    q = torch.randn(sum(lens_q), hq, d)
    args = (q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), cu_of(lens_q).to(DEVICE), None, 1, max(lens_k))
    kwargs = dict(block_table=table.to(DEVICE), seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=DEVICE),
                  causal=True, backend="triton")
    explanation = jagged_sdpa.explain(*args, **kwargs)
    assert any("split-k decode over" in note for note in explanation.notes), str(explanation)
    assert any("query heads of each kv head share one tile" in note for note in explanation.notes)
    assert "split-k" in str(explanation)
    out, lse = jagged_sdpa.varlen_attention(*args, return_lse=True, **kwargs)
    ref_out, ref_lse, _ = _reference(q, k_packed, v_packed, cu_of(lens_q), cu_of(lens_k), causal=True,
                                     alignment="bottom_right")
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(lens_q).tolist())
    assert_close_lse(lse, ref_lse)


def _spy_launches(monkeypatch):
    """Record the spec each launcher gets, asserting first that its max lengths fit the call (an
    unclamped 2**35 would launch cdiv(2**35, BLOCK_M) programs: under the interpreter, forever)."""
    from jagged_sdpa.backends.triton import bwd, fwd

    seen = []

    def spy(name, launch):
        def launched(call, *args, **kwargs):
            spec = call.spec
            seen.append((name, spec.max_seqlen_q, spec.max_seqlen_k, kwargs))
            assert spec.max_seqlen_q <= spec.total_q and (spec.paged or spec.max_seqlen_k <= spec.total_k), spec
            return launch(call, *args, **kwargs)
        return launched

    monkeypatch.setattr(fwd, "launch_fwd", spy("fwd", fwd.launch_fwd))
    monkeypatch.setattr(bwd, "launch_bwd", spy("bwd", bwd.launch_bwd))
    return seen


def test_static_max_seqlen_q_bound_gets_the_decode_plan(monkeypatch):
    """A decode step called with a static bound (131072, as servers and CUDA graphs
    pass) is planned from min(bound, total_q): split-K and GQA packing, as with the true bound."""
    seen = _spy_launches(monkeypatch)
    lens_q, lens_k, hq, hkv, d = [1, 1, 1], [300, 261, 5], 4, 1, 16
    q, k, v = _tensors(lens_q, lens_k, hq, hkv, d, d, torch.float32)
    cu_q, cu_k = cu_of(lens_q).to(DEVICE), cu_of(lens_k).to(DEVICE)
    args = (q, k, v, cu_q, cu_k, 131072, 131072)
    explanation = jagged_sdpa.explain(*args, causal=True, backend="triton")
    assert any("split-k decode over" in note for note in explanation.notes), str(explanation)
    assert any("query heads of each kv head share one tile (max_seqlen_q 3 <= 16)" in note
               for note in explanation.notes), str(explanation)
    out, lse = jagged_sdpa.varlen_attention(*args, causal=True, return_lse=True, backend="triton")
    (_, max_q, max_k, launch), = seen
    assert (max_q, max_k) == (3, 566) and launch["num_splits"] > 1 and launch["pack_gqa"]
    ref_out, ref_lse, _ = _reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right")
    assert_close_packed(out, ref_out, cu_seqlens=cu_q.tolist())
    assert_close_lse(lse, ref_lse)


def test_max_seqlen_bounds_past_the_grid_are_clamped(monkeypatch):
    """Bounds around 2**35 would make a grid no GPU launches: forward and backward from the packed totals and match the reference."""
    seen = _spy_launches(monkeypatch)
    lens_q, lens_k = [5, 3, 0], [4, 6, 2]
    q, k, v = _tensors(lens_q, lens_k, 2, 1, 16, 16, torch.float32)
    cu_q, cu_k = cu_of(lens_q).to(DEVICE), cu_of(lens_k).to(DEVICE)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 2**35, 2**35 + 1, causal=True, backend="triton")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert [(name, max_q, max_k) for name, max_q, max_k, _ in seen] == [("fwd", 8, 12), ("bwd", 8, 12)]
    ref_out, _, ref_grads = _reference(q, k, v, cu_q, cu_k, grad_out, causal=True, alignment="bottom_right")
    assert_close_packed(out, ref_out, cu_seqlens=cu_q.tolist())
    for name, x, ref, cu in (("dq", q, ref_grads[0], cu_q), ("dk", k, ref_grads[1], cu_k), ("dv", v, ref_grads[2], cu_k)):
        assert_close_packed(x.grad, ref, cu_seqlens=cu.tolist(), name=name, grad=True)


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["per-head", "gqa-packed"])
def test_split_k_merge_with_every_option(pack_gqa):
    """Forced splits on a packed call with empty splits, masked rows, window, softcap and ALiBi."""
    from jagged_sdpa.backends.triton.fwd import merge_splits
    from jagged_sdpa.backends.triton.fwd import launch_fwd
    from support.described_call import prepare_varlen

    lens_q, lens_k, hq, hkv, d = [2, 0, 3], [150, 40, 300], 3, 1, 16
    q, k, v = _tensors(lens_q, lens_k, hq, hkv, d, 24, torch.float32)
    cu_q, cu_k = cu_of(lens_q).to(DEVICE), cu_of(lens_k).to(DEVICE)
    slopes = torch.rand(len(lens_q), hq, device=DEVICE)
    call, _, _ = prepare_varlen(q, k, v, cu_q, cu_k, causal=True, window_size=(100, -1), softcap=4.0,
                                alibi_slopes=slopes, return_lse=True, backend="triton")
    parts = launch_fwd(call, num_splits=3, pack_gqa=pack_gqa)
    assert parts.out.shape[0] == 3
    out, lse = merge_splits(parts.out, parts.lse, q.dtype)
    ref_out, ref_lse, _ = _reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right", window=(100, -1),
                                     softcap=4.0, alibi_slopes=slopes)
    assert_close_packed(out, ref_out, cu_seqlens=cu_q.tolist())
    assert_close_lse(lse, ref_lse)

    # Dropout draws from (key, row, head, sequence) counters, so splitting the keys keeps the mask.
    dropped = call.replace(spec=call.spec.replace(dropout_p=0.4), dropout_key=torch.tensor([11, 3_000_000_005]))
    whole = launch_fwd(dropped)
    split = launch_fwd(dropped, num_splits=3, pack_gqa=pack_gqa)
    out_split, lse_split = merge_splits(split.out, split.lse, q.dtype)
    torch.testing.assert_close(out_split, whole.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_split, whole.lse, atol=1e-5, rtol=1e-5)
    assert (out_split - out).abs().max() > 0.1  # the mask did change the result


def _merge_reference(out_parts, lse_parts, dtype):
    """The torch merge the kernel replaced (12 ops), kept as its reference: empty splits (lse -inf)
    weigh 0, a row empty in every split stays 0 with lse -inf."""
    lse = torch.logsumexp(lse_parts, dim=0)
    finite = torch.isfinite(lse)
    weights = torch.exp(lse_parts - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(0))
    weights = torch.where(torch.isfinite(lse_parts), weights, torch.zeros_like(weights))
    out = torch.einsum("sht,sthd->thd", weights, out_parts)
    return out.to(dtype), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("splits,dv", [(1, 16), (3, 24), (5, 16), (64, 8)], ids=["s1", "s3-dv24", "s5", "s64"])
def test_merge_kernel_matches_the_torch_merge(splits, dv, dtype):
    """``fwd.merge_splits`` (one kernel) against the torch formula on random partials: empty splits,
    rows empty in every split, NaN and inf lses, NaN outs under finite and -inf lses, lses far
    from 0, and strided partials."""
    from jagged_sdpa.backends.triton.fwd import merge_splits

    gen = torch.Generator().manual_seed(splits * 100 + dv)
    total_q, heads = 7, 3
    out_parts = torch.randn(splits, total_q, heads, dv, generator=gen)
    lse_parts = torch.randn(splits, heads, total_q, generator=gen) * 4
    lse_parts[:, :, 1] += 1000.0                                         # exp would overflow unshifted
    lse_parts[torch.rand(lse_parts.shape, generator=gen) < 0.3] = float("-inf")  # empty splits
    lse_parts[:, 0, 2] = float("-inf")                                    # a row empty in every split
    out_parts[:, 2, 0] = 0.0                                              # (the kernel writes zeros there)
    lse_parts[0, 1, 3] = float("nan")                                     # a NaN score
    out_parts[0, 3, 1] = float("nan")
    lse_parts[-1, 2, 4] = float("inf")
    out_parts[-1, 5, 2, 0] = float("nan")                                 # a NaN value under a finite lse
    lse_parts[-1, 2, 5] = 0.5
    out_parts[0, 6, 1, 1] = float("nan")                                  # a NaN value under an empty split
    lse_parts[0, 1, 6] = float("-inf")
    cases = [(out_parts, lse_parts)]
    # Strided partials: the kernel reads every stride.
    cases.append((out_parts.transpose(1, 2).contiguous().transpose(1, 2),
                  lse_parts.transpose(1, 2).contiguous().transpose(1, 2)))
    for out_in, lse_in in cases:
        out, lse = merge_splits(out_in.to(DEVICE), lse_in.to(DEVICE), dtype)
        ref_out, ref_lse = _merge_reference(out_in, lse_in, dtype)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert out.shape == (total_q, heads, dv) and lse.shape == (heads, total_q)
        torch.testing.assert_close(lse.cpu(), ref_lse, equal_nan=True, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(out.cpu(), ref_out, equal_nan=True)
        assert torch.equal(out[2, 0].cpu(), torch.zeros(dv, dtype=dtype)) and lse[0, 2] == float("-inf")
        assert lse.isnan().cpu().equal(ref_lse.isnan()) and out.isnan().cpu().equal(ref_out.isnan())
    # No rows: nothing to launch.
    out, lse = merge_splits(out_parts[:, :0].to(DEVICE), lse_parts[:, :, :0].to(DEVICE), dtype)
    assert out.shape == (0, heads, dv) and lse.shape == (heads, 0)


@pytest.mark.parametrize("batch", [1, 5, 150], ids=["b1", "b5", "b150"])
@pytest.mark.parametrize("seqused", [False, True], ids=["cu-k", "seqused"])
def test_sequence_order_kernel_is_a_stable_descending_argsort(batch, seqused):
    """``sequence_order`` (one kernel) against argsort of Lq * (Lk + 1), ties by index: equal works,
    empty sequences, more sequences than one program's block."""
    from types import SimpleNamespace

    from jagged_sdpa.backends.triton._common import sequence_order

    gen = torch.Generator().manual_seed(batch)
    lens_q = torch.randint(0, 3, (batch,), generator=gen)
    lens_k = torch.randint(0, 4, (batch,), generator=gen)
    used = torch.randint(0, 5, (batch,), generator=gen)
    call = SimpleNamespace(cu_seqlens_q=cu_of(lens_q.tolist()).to(DEVICE), cu_seqlens_k=cu_of(lens_k.tolist()).to(DEVICE),
                           seqused_k=used.to(torch.int32).to(DEVICE) if seqused else None)
    work = lens_q * ((used if seqused else lens_k) + 1)
    expected = torch.argsort(work, descending=True, stable=True).to(torch.int32)
    order = sequence_order(call)
    assert order.dtype == torch.int32 and torch.equal(order.cpu(), expected)
    paged = SimpleNamespace(cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=None, seqused_k=used.to(torch.int32).to(DEVICE))
    assert torch.equal(sequence_order(paged).cpu(), torch.argsort(lens_q * (used + 1), descending=True, stable=True).int())


def test_paged_split_k_bounds_past_2_32(monkeypatch):
    """A loose paged max_seqlen_k of 2**32 + 3 (as the flash tests pass): the kernel's split bounds
    are int64 and sized by each sequence's keys (16 forced splits of the unclamped bound once wrapped
    in int32 and counted the keys twice, and sized by the bound they put every key in split 0), and
    the backend clamps the bound to the table's width x block size before planning."""
    from jagged_sdpa.backends.triton.fwd import launch_fwd
    from jagged_sdpa.backends.triton.fwd import merge_splits
    from support.described_call import prepare_varlen

    lens_q, lens_k, hq, hkv, d = [1], [300], 2, 1, 16
    k_cache, v_cache, table, k_packed, v_packed = _paged_cache(lens_k, hkv, d, d, 64)
    q = torch.randn(sum(lens_q), hq, d)
    used = torch.tensor(lens_k, dtype=torch.int32)
    args = (q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), cu_of(lens_q).to(DEVICE), None, 1, 2**32 + 3)
    ref_out, ref_lse, _ = _reference(q, k_packed, v_packed, cu_of(lens_q), cu_of(lens_k))
    call, _, _ = prepare_varlen(*args, return_lse=True, block_table=table.to(DEVICE), seqused_k=used.to(DEVICE),
                                backend="triton")
    assert call.spec.max_seqlen_k == 2**32 + 3
    parts = launch_fwd(call, num_splits=16)
    # Splits are sized by the sequence's 300 keys (128 each), not by the bound: three carry keys.
    assert torch.isfinite(parts.lse).flatten(1).any(dim=1).tolist() == [True] * 3 + [False] * 13
    out, lse = merge_splits(parts.out, parts.lse, q.dtype)
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(lens_q).tolist())
    assert_close_lse(lse, ref_lse)

    seen = _spy_launches(monkeypatch)
    out, lse = jagged_sdpa.varlen_attention(*args, block_table=table.to(DEVICE), seqused_k=used.to(DEVICE),
                                            return_lse=True, backend="triton")
    assert [(name, max_k) for name, _, max_k, _ in seen] == [("fwd", table.shape[1] * 64)]
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(lens_q).tolist())
    assert_close_lse(lse, ref_lse)


def test_strided_block_table_and_alibi_slopes():
    """A column-major block table and slopes ``s[::2]`` (per head and per batch and head) are read
    with their strides, forward and (slopes) backward."""
    lens_q, lens_k, hq, hkv, d = [3, 1], [40, 21], 2, 1, 16
    k_cache, v_cache, table, k_packed, v_packed = _paged_cache(lens_k, hkv, d, d, 16)
    table_cm = table.t().contiguous().t()
    assert table_cm.stride(1) != 1
    wide = torch.rand(2 * hq)
    slopes = wide[::2]
    q = torch.randn(sum(lens_q), hq, d)
    out, lse = jagged_sdpa.varlen_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), cu_of(lens_q).to(DEVICE), None, max(lens_q),
        max(lens_k), block_table=table_cm.to(DEVICE), seqused_k=torch.tensor(lens_k, dtype=torch.int32).to(DEVICE),
        causal=True, alibi_slopes=slopes.to(DEVICE), return_lse=True, backend="triton")
    ref_out, ref_lse, _ = _reference(q, k_packed, v_packed, cu_of(lens_q), cu_of(lens_k), causal=True,
                                     alignment="bottom_right", alibi_slopes=slopes.contiguous())
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(lens_q).tolist())
    assert_close_lse(lse, ref_lse)

    lens = [5, 9]
    q, k, v = _tensors(lens, lens, hq, hq, d, d, torch.float32)
    for x in (q, k, v):
        x.requires_grad_(True)
    per_batch = torch.rand(len(lens), 2 * hq, device=DEVICE)[:, ::2]
    cu = cu_of(lens).to(DEVICE)
    out = jagged_sdpa.varlen_attention(q, k, v, cu, cu, causal=True, alibi_slopes=per_batch, backend="triton")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, _, ref_grads = _reference(q, k, v, cu, cu, grad_out, causal=True, alibi_slopes=per_batch.contiguous())
    assert_close_packed(out, ref_out, cu_seqlens=cu.tolist())
    for name, x, ref in (("dq", q, ref_grads[0]), ("dk", k, ref_grads[1]), ("dv", v, ref_grads[2])):
        assert_close_packed(x.grad, ref, cu_seqlens=cu.tolist(), name=name, grad=True)


def test_kernels_launch_their_config_directly_without_autotuning():
    """Without JAGGED_SDPA_TRITON_AUTOTUNE the kernels are plain JIT functions launched with the
    config the rule picks (an autotuner over one config benchmarks it per new key in Triton < 3.7);
    the rule picks decode and prefill tiles by the row width."""
    from triton.runtime.autotuner import Autotuner
    from jagged_sdpa.backends.triton import bwd, fwd

    assert not fwd.AUTOTUNE and not bwd.AUTOTUNE
    for kernel in (fwd._attn_fwd, bwd._attn_bwd_dkdv, bwd._attn_bwd_dq):
        assert not isinstance(kernel, Autotuner), kernel
    q16 = torch.empty(1, 1, 128, dtype=torch.float16)
    q32 = torch.empty(1, 1, 256, dtype=torch.float32)

    def pick(q, bucket, **kwargs):
        (config,) = fwd._prune(fwd.default_configs(), {"Q": q, "max_seqlen_q_bucket": bucket}, autotune=False,
                               HEAD_DIM_PAD=q.shape[-1], HEAD_DIM_V_PAD=q.shape[-1], **kwargs)
        return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_stages

    assert pick(q16, 4096) == (128, 64, 3)
    assert pick(q16, 1) == (16, 128, 2)
    assert pick(q16, 2, GROUP=8, PACK_GQA=True) == (16, 128, 2)
    assert pick(q32, 1) == (16, 32, 1)
    (config,) = bwd._prune(bwd.bwd_configs() if not bwd.INTERPRETED else [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st, _ in
        bwd.DEFAULT_TILES], {"Q": q32}, autotune=False, HEAD_DIM_PAD=256, HEAD_DIM_V_PAD=256)
    assert (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]) == (16, 32)


def test_autotune_mode_still_runs():
    """With JAGGED_SDPA_TRITON_AUTOTUNE=1 the kernels are autotuners again (fresh process: the
    kernel modules read the variable when imported), forward and backward."""
    code = (
        "import sys, torch, jagged_sdpa\n"
        "from triton.runtime.autotuner import Autotuner\n"
        "from jagged_sdpa.backends.triton import bwd, fwd\n"
        "assert all(isinstance(k, Autotuner) for k in (fwd._attn_fwd, bwd._attn_bwd_dkdv, bwd._attn_bwd_dq))\n"
        "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "q, k, v = (torch.randn(14, 2, 16, device=dev, requires_grad=True) for _ in range(3))\n"
        "cu = torch.tensor([0, 5, 14], dtype=torch.int32, device=dev)\n"
        "out = jagged_sdpa.varlen_attention(q, k, v, cu, cu, causal=True, backend='triton')\n"
        "out.sum().backward()\n"
        "ref = jagged_sdpa.varlen_attention(q.double(), k.double(), v.double(), cu, cu, causal=True, backend='math')\n"
        "assert (out.double() - ref).abs().max().item() < 1e-5 and q.grad is not None\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, JAGGED_SDPA_TRITON_AUTOTUNE="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


def test_autotune_prunes_configs_by_the_devices_shared_memory(monkeypatch):
    """fp32 D=256 decode with autotuning: every decode config of the tuned set needs more than an
    H100's 227 KB at 2+ stages; the prune keeps only configs that fit, else the default tile."""
    from jagged_sdpa.backends.triton import _common, bwd, fwd

    h100 = 232448
    monkeypatch.setattr(fwd, "shared_memory_limit", lambda q: h100)
    monkeypatch.setattr(bwd, "shared_memory_limit", lambda q: h100)
    decode = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=st)
              for bm in (16, 32) for bn in (64, 128) for st in (2, 3)]
    configs = decode + fwd.default_configs()
    q32 = torch.empty(1, 1, 256, dtype=torch.float32)
    named, dims = {"Q": q32, "max_seqlen_q_bucket": 1}, dict(HEAD_DIM_PAD=256, HEAD_DIM_V_PAD=256)
    kept = fwd._prune(configs, named, autotune=True, **dims)
    assert kept and all(fwd.shared_bytes(c, named, dims) <= h100 for c in kept), kept
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages) for c in kept] == [(16, 32, 1)]
    # bf16 D=128 decode fits: the tuned set stays.
    q16 = torch.empty(1, 1, 128, dtype=torch.float16)
    dims16 = dict(HEAD_DIM_PAD=128, HEAD_DIM_V_PAD=128)
    assert len(fwd._prune(configs, {"Q": q16, "max_seqlen_q_bucket": 1}, autotune=True, **dims16)) > len(decode) // 2
    kept = bwd._prune([triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2),
                       triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)],
                      {"Q": q32}, autotune=True, **dims)
    assert all(bwd.shared_bytes(c, {"Q": q32}, dims) <= h100 for c in kept) and kept
    assert _common.shared_memory_limit(q32) is None   # CPU tensors: nothing to prune by


@pytest.mark.parametrize("case", ["fp32-varlen-causal", "fp16-decode-alibi"])
def test_one_hot_gradients_at_large_logits(case):
    """q x 300 makes every row's softmax one-hot: P is 1 at the top key, O its value row, and
    MATH's dq/dk are exact (dS = 0). delta is computed as dP is (the diagonal of dO O^T by the same
    dot), so TRITON's dS is 0 too instead of dP's and delta's rounding difference times scale |q|."""
    gen = torch.Generator().manual_seed(0)
    if case == "fp32-varlen-causal":
        lens_q = lens_k = [3, 7]
        hq, hkv, d, dtype, scale, slopes = 1, 1, 32, torch.float32, 1.95, None
    else:
        lens_q, lens_k = [1, 1, 1], [9, 17, 30]
        hq, hkv, d, dtype, scale, slopes = 4, 2, 32, torch.float16, None, torch.rand(4, generator=gen).to(DEVICE)
    q = (torch.randn(sum(lens_q), hq, d, generator=gen) * 300).to(dtype).to(DEVICE).requires_grad_(True)
    k = torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype).to(DEVICE).requires_grad_(True)
    v = torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype).to(DEVICE).requires_grad_(True)
    cu_q, cu_k = cu_of(lens_q).to(DEVICE), cu_of(lens_k).to(DEVICE)
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, softmax_scale=scale, alibi_slopes=slopes,
                                       backend="triton")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, _, ref_grads = _reference(q, k, v, cu_q, cu_k, grad_out, causal=True, alignment="bottom_right",
                                       scale=scale, alibi_slopes=slopes)
    assert_close_packed(out, ref_out, cu_seqlens=cu_q.tolist())
    for name, x, ref, cu in (("dq", q, ref_grads[0], cu_q), ("dk", k, ref_grads[1], cu_k),
                             ("dv", v, ref_grads[2], cu_k)):
        assert_close_packed(x.grad, ref, cu_seqlens=cu.tolist(), name=name, grad=True)


# ---------------------------------------------------------------------------------------------------
# dense KV cache read in place (docs/api.md section 12): a paged call of one block of S slots per sequence


def _dense_cache(used, leftpad, s, hkv, d, dv, dtype):
    """(B, S, Hkv, D) caches as transposed views of (B, Hkv, S, D) tensors (transformers' layout),
    NaN outside each row's range [leftpad, leftpad + used), plus the packed keys the reference sees."""
    b = len(used)
    k_store = torch.full((b, hkv, s, d), float("nan"), dtype=dtype)
    v_store = torch.full((b, hkv, s, dv), float("nan"), dtype=dtype)
    k_packed = torch.randn(sum(used), hkv, d).to(dtype)
    v_packed = torch.randn(sum(used), hkv, dv).to(dtype)
    start = 0
    for row, (n, lp) in enumerate(zip(used, leftpad)):
        k_store[row, :, lp:lp + n] = k_packed[start:start + n].transpose(0, 1)
        v_store[row, :, lp:lp + n] = v_packed[start:start + n].transpose(0, 1)
        start += n
    return k_store.transpose(1, 2), v_store.transpose(1, 2), k_packed, v_packed


def _dense_call(q, k_cache, v_cache, lens_q, used, leftpad, *, causal=False, window=(-1, -1), softcap=0.0,
                slopes=None, needs_grad=False, sinks=None, chunk_size=None, prefix_lens=None):
    """The PackedCall a dense-cache varlen call arrives as (spec.dense_cache, block_table [[b]])."""
    from support.described_call import prepare_varlen

    b, s = k_cache.shape[0], k_cache.shape[1]
    table = torch.arange(b, dtype=torch.int32).unsqueeze(1).to(DEVICE)
    used_t = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    call, _, _ = prepare_varlen(q, k_cache, v_cache, cu_of(lens_q).to(DEVICE), None, max(lens_q), s, causal=causal,
                                window_size=window, softcap=softcap, alibi_slopes=slopes, return_lse=True,
                                block_table=table, seqused_k=used_t, backend="triton")
    spec = call.spec.replace(dense_cache=True, leftpad=True, needs_grad=needs_grad, sinks=sinks is not None,
                             chunk_size=chunk_size, prefix=prefix_lens is not None)
    return call.replace(spec=spec, cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=DEVICE),
                        sinks=sinks, prefix_lens=prefix_lens)


def _scatter_to_cache(packed, used, leftpad, s):
    """Packed (total, H, D) gradients placed at each row's range of a zero (B, S, H, D) cache."""
    cache = torch.zeros(len(used), s, *packed.shape[1:], dtype=packed.dtype)
    start = 0
    for row, (n, lp) in enumerate(zip(used, leftpad)):
        cache[row, lp:lp + n] = packed[start:start + n]
        start += n
    return cache


DENSE_CASES = {
    "gqa-causal-leftpad-prefill-and-decode": dict(lens_q=[3, 1, 0, 5], used=[7, 20, 0, 5], leftpad=[2, 0, 5, 11],
                                                  s=24, hq=4, hkv=2, causal=True),
    "window-alibi-softcap-f16": dict(lens_q=[4, 1], used=[19, 9], leftpad=[5, 0], s=24, hq=2, hkv=1,
                                     window=(6, 0), softcap=3.0, alibi=True, dtype=torch.float16),
    "sinks-chunk-prefix": dict(lens_q=[6, 2], used=[20, 11], leftpad=[3, 9], s=24, hq=2, hkv=2, causal=True,
                               sinks=True, chunk_size=8, prefix=[4, 0]),
    "split-k-decode-gqa-packed": dict(lens_q=[1, 1], used=[300, 261], leftpad=[7, 40], s=320, hq=4, hkv=2,
                                      causal=True, backward=False),
}


@pytest.mark.parametrize("case", list(DENSE_CASES), ids=list(DENSE_CASES))
def test_dense_cache_read_in_place(case):
    """A dense cache, strided as transformers holds it, with leftpad and NaN outside each row's
    range, through ``varlen_attention(..., seqused_k=, cache_leftpad=)``: out, lse and the
    cache-shaped gradients (exactly zero outside the ranges) match the float64 reference over the
    packed keys, and no key outside a range is read."""
    opts = dict(DENSE_CASES[case])
    lens_q, used, leftpad, s = opts.pop("lens_q"), opts.pop("used"), opts.pop("leftpad"), opts.pop("s")
    hq, hkv, d, dtype = opts.pop("hq"), opts.pop("hkv"), 16, opts.pop("dtype", torch.float32)
    backward = opts.pop("backward", True)
    causal, window, softcap = opts.get("causal", False), opts.get("window", (-1, -1)), opts.get("softcap", 0.0)
    k_cache, v_cache, k_packed, v_packed = _dense_cache(used, leftpad, s, hkv, d, d, dtype)
    assert k_cache.stride(2) == s * d  # a view of (B, Hkv, S, D), read in place
    q = torch.randn(sum(lens_q), hq, d).to(dtype)
    slopes = torch.rand(hq) if opts.get("alibi") else None
    sinks = torch.randn(hq) if opts.get("sinks") else None
    prefix = torch.tensor(opts["prefix"], dtype=torch.int32) if "prefix" in opts else None
    extra = dict(sinks=sinks, chunk_size=opts.get("chunk_size"), prefix_lens=prefix)
    leaves = [x.to(DEVICE).requires_grad_(backward) for x in (q, k_cache, v_cache)]
    dev = {name: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for name, x in extra.items()}
    out, lse = jagged_sdpa.varlen_attention(
        *leaves, cu_of(lens_q).to(DEVICE), None, max(lens_q), None, causal=causal, window_size=window,
        softcap=softcap, alibi_slopes=None if slopes is None else slopes.to(DEVICE),
        seqused_k=torch.tensor(used, dtype=torch.int32, device=DEVICE),
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=DEVICE), return_lse=True, backend="triton",
        **dev)
    grad_out = torch.randn_like(out) if backward else None
    ref_out, ref_lse, ref_grads = _reference(q, k_packed, v_packed, cu_of(lens_q), cu_of(used), grad_out,
                                             causal=causal, alignment="bottom_right", window=window,
                                             softcap=softcap, alibi_slopes=slopes, **extra)
    assert_close_packed(out, ref_out, cu_seqlens=cu_of(lens_q).tolist())
    assert_close_lse(lse, ref_lse)
    if not backward:
        return
    out.backward(grad_out)
    dq, dk, dv = (x.grad for x in leaves)
    assert dk.shape == k_cache.shape and dv.shape == v_cache.shape
    assert_close_packed(dq, ref_grads[0], cu_seqlens=cu_of(lens_q).tolist(), name="dq", grad=True)
    for name, got, ref in (("dk", dk, ref_grads[1]), ("dv", dv, ref_grads[2])):
        expected = _scatter_to_cache(ref, used, leftpad, s)
        assert not torch.isnan(got).any(), name
        for row, (n, lp) in enumerate(zip(used, leftpad)):
            assert not got[row, :lp].any() and not got[row, lp + n:].any(), f"{name}: outside row {row}'s range"
        assert_close_packed(got.reshape(-1, *got.shape[2:]), expected.reshape(-1, *expected.shape[2:]),
                            cu_seqlens=[0, len(used) * s], name=name, grad=True)


def test_dense_cache_length_is_not_a_constexpr(monkeypatch):
    """A cache growing by a slot per decode step must not compile a kernel per step: the launch
    carries S only in strides and runtime bounds (PAGE_SIZE stays fixed, DENSE is the mode)."""
    from jagged_sdpa.backends.triton import fwd

    seen = []
    real = fwd.launch

    def spy(kernel, configs, prune, grid, args, kwargs, named, autotune):
        seen.append({name: kwargs[name] for name in ("PAGED", "DENSE", "PAGE_SIZE", "HAS_LEFTPAD")})
        return real(kernel, configs, prune, grid, args, kwargs, named, autotune)

    monkeypatch.setattr(fwd, "launch", spy)
    for s in (9, 10):
        k_cache, v_cache, _, _ = _dense_cache([5, 9], [1, 0], s, 1, 16, 16, torch.float32)
        call = _dense_call(torch.randn(2, 2, 16, device=DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), [1, 1],
                           [5, 9], [1, 0])
        IMPLS[Backend.TRITON].forward(call)
    assert seen == [dict(PAGED=False, DENSE=True, PAGE_SIZE=16, HAS_LEFTPAD=True)] * 2


# ---------------------------------------------------------------------------------------------------
# eligibility


def _spec(**changes):
    from jagged_sdpa.spec import AttnSpec

    base = AttnSpec(entry="varlen", device_type="cpu", capability=None, dtype=torch.float32, batch=2, heads_q=2,
                    heads_kv=2, head_dim=64, head_dim_v=64, total_q=8, total_k=8, max_seqlen_q=4,
                    max_seqlen_k=4, has_empty_q=False, has_empty_k=False, lengths_known=True)
    return base.replace(**changes)


def test_reasons(monkeypatch):
    triton_impl = IMPLS[Backend.TRITON]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_backend, "_interpreted_state", lambda: True)
    assert triton_impl.reasons(_spec()) == ()
    assert triton_impl.reasons(_spec(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, head_dim=80,
                                     head_dim_v=96)) == ()
    assert triton_impl.reasons(_spec(device_type="cuda", capability=(7, 5))) == ("compute capability sm75 < sm80",)
    assert any("dtype float64 not supported" in r for r in triton_impl.reasons(_spec(dtype=torch.float64)))
    assert any("head_dim 320 > 256" in r for r in triton_impl.reasons(_spec(head_dim=320)))
    assert triton_impl.reasons(_spec(paged=True, block_size=24, seqused_k=True)) == ()
    assert triton_impl.reasons(_spec(paged=True, block_size=16, seqused_k=True, needs_grad=True)) == (
        "paged KV cache with a gradient needed not supported - use packed keys for training",)
    assert any(r.startswith("batch 70000 > 65535") for r in triton_impl.reasons(_spec(batch=70000)))
    monkeypatch.setattr(triton_backend, "_interpreted_state", lambda: False)
    assert triton_impl.reasons(_spec()) == (
        "triton was imported (compiled) before TRITON_INTERPRET=1 was set - set it before importing triton",)
    monkeypatch.setattr(triton_backend, "_interpreted_state", lambda: None)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_impl.reasons(_spec()) == (
        "cpu tensors need TRITON_INTERPRET=1 (set: unset) - set it before importing triton",)
    assert triton_impl.reasons(_spec(device_type="cuda", capability=(8, 0))) == ()


_MODE_CHILD = """
import os, sys, torch
with_interp = sys.argv[1] == "interpreted"
if with_interp:
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # triton's own functions take this mode
os.environ.pop("TRITON_INTERPRET", None)
if not with_interp:
    os.environ["TRITON_INTERPRET"] = "1"  # the opposite, set before our kernels are first imported
from jagged_sdpa.backends.triton import _common, bwd, fwd
from jagged_sdpa.checks import _device_kernels
kinds = {type(f).__name__ for f in (_common._sequence_bounds, _common._scores, fwd._attn_fwd, bwd._attn_bwd_dq,
                                    _device_kernels.cu_ok, triton.language.cdiv)}
print(sorted(kinds), fwd.INTERPRETED)
if with_interp:
    import jagged_sdpa
    os.environ["TRITON_INTERPRET"] = "1"
    q = torch.randn(5, 2, 16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = jagged_sdpa.varlen_attention(q, q, q, cu, cu, 3, 3, causal=True, backend="triton")
    ref = jagged_sdpa.varlen_attention(q, q, q, cu, cu, 3, 3, causal=True, backend="math")
    torch.testing.assert_close(out, ref)
    print("ran")
"""


@pytest.mark.parametrize("mode", ["interpreted", "compiled"])
def test_kernels_take_tritons_own_mode(mode):
    """A process whose triton was imported in one mode and whose TRITON_INTERPRET says the other when
    our kernel modules are first imported (a GPU machine's test run) still gets kernels it can
    launch: every one of ours is decorated like triton's own ``tl.cdiv``."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _MODE_CHILD, mode], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    kind = "InterpretedFunction" if mode == "interpreted" else "JITFunction"
    first = run.stdout.splitlines()[0]
    assert first == f"{[kind]} {mode == 'interpreted'}", run.stdout
    assert mode == "compiled" or run.stdout.splitlines()[1] == "ran"


def test_split_rule_reads_only_the_spec():
    from jagged_sdpa.backends.triton.launch_rules import plan_splits

    assert plan_splits(_spec(max_seqlen_q=1, max_seqlen_k=4096)) > 1
    assert plan_splits(_spec(max_seqlen_q=64, max_seqlen_k=4096)) == 1
    assert plan_splits(_spec(max_seqlen_q=1, max_seqlen_k=100)) == 1
    assert IMPLS[Backend.TRITON].plan_notes(_spec()) == ()
    from jagged_sdpa.backends.triton.launch_rules import plan_group_splits

    mqa = _spec(heads_q=4, heads_kv=1, batch=1, max_seqlen_q=17, max_seqlen_k=17, needs_grad=True)
    assert plan_group_splits(mqa) == 4
    assert plan_group_splits(mqa.replace(heads_q=6)) == 2
    assert plan_group_splits(mqa.replace(batch=64)) == 1
    assert any("backward splits each kv head's 4 query heads over 4" in n for n in IMPLS[Backend.TRITON].plan_notes(mqa))


# ---------------------------------------------------------------------------------------------------
# compiled mode without a GPU


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter cannot catch compiler-only errors: compile every-option variants for sm_90."""
    from packaging.version import Version

    if Version(triton.__version__) < Version("3.9"):
        pytest.skip(f"triton {triton.__version__}: the ASTSource API compile_check uses is verified on 3.9+")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-m", "jagged_sdpa.backends.triton.compile_check", "--arch", "90",
                          "--quick"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("OK ") == 11, run.stdout  # quick variants: 3 fp8 decodings, split-k merge, sequence order


# ---------------------------------------------------------------------------------------------------
# CUDA at real sizes (a later GPU session)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 96], ids=["D64", "D128", "D96"])
def test_cuda_real_sizes(dtype, causal, d):
    _check_varlen([0, 1, 77, 300, 513], [5, 1, 77, 320, 513], hq=8, hkv=2, d=d, dtype=dtype, causal=causal,
                  device="cuda")


@pytest.mark.cuda
def test_cuda_all_options_bf16():
    _check_varlen([17, 130, 0, 64], [40, 130, 5, 200], hq=4, hkv=2, d=80, dv=48, dtype=torch.bfloat16,
                  causal=True, window=(32, 8), softcap=5.0, alibi="per_batch_head", seqused=[40, 100, 0, 150],
                  device="cuda")
