"""FLASH_VARLEN and EFFICIENT: helpers, op marshalling (CPU, with fake aten ops), and GPU runs.

Without a GPU three things are still checked:
- the device-side helpers (row geometry, empty rows, unseen keys, lse layouts, padding,
  alignment) against ``tests/support/reference.py``'s explicit masks;
- the marshalling: the aten ops are replaced by fakes that assert what the kernels require
  (head dims, alignment, int32 contiguous cu_seqlens, argument names, the lse layout and +inf
  convention of each backward, the RNG state handed back) and answer with the float64 reference,
  including the kernels' quirks (flash's causal ALiBi lse, NaN rows and uninitialised gradient
  rows of the efficient kernel), so our conversions are what gets tested;
- the forward/backward glue through ``ops.run`` (the operators).
``@pytest.mark.cuda`` tests run both backends against the reference on a GPU, fp16/bf16 (and
fp32 for EFFICIENT), forward and backward, every option they claim.
"""

from __future__ import annotations

import math
import warnings

import pytest

import torch

from support.cases import cu_of, in_nan_buffer
from support.described_call import prepare_sdpa, prepare_varlen
from support.reference import attention_reference, keep_mask
from support.tolerances import assert_close_packed

import jagged_sdpa
from jagged_sdpa import api
from jagged_sdpa.ops import run
from jagged_sdpa.backends import Backend
from jagged_sdpa.backends.cuda import common as cc
from jagged_sdpa.backends.cuda import flash_varlen
from jagged_sdpa.backends.cuda.efficient import EfficientBackend
from jagged_sdpa.backends.cuda.flash_varlen import FlashVarlenBackend


# ---------------------------------------------------------------------------------------------
# device-side helpers


def geometry(lengths_q, lengths_k):
    cu_q = cu_of(lengths_q)
    return cu_q, cc.row_geometry(cu_q, sum(lengths_q), cc.sequence_lengths(cu_q),
                                 torch.tensor(lengths_k, dtype=torch.int32))


def test_row_geometry_skips_empty_sequences():
    _, geom = geometry([0, 3, 0, 2], [4, 5, 6, 7])
    assert geom.seq.tolist() == [1, 1, 1, 3, 3]
    assert geom.pos.tolist() == [0, 1, 2, 0, 1]
    assert geom.len_q.tolist() == [3, 3, 3, 2, 2] and geom.len_k.tolist() == [5, 5, 5, 7, 7]


MASK_CASES = [
    (causal, alignment, window)
    for causal in (False, True)
    for alignment in ("top_left", "bottom_right")
    for window in ((-1, -1), (2, 0), (0, 3), (3, 1), (-1, 0), (1, -1))
]
LENGTH_PAIRS = ([3, 0, 7, 5, 1, 4], [6, 4, 0, 2, 1, 9])


@pytest.mark.parametrize("causal, alignment, window", MASK_CASES)
def test_empty_rows_and_unseen_keys_match_the_reference_mask(causal, alignment, window):
    lengths_q, lengths_k = LENGTH_PAIRS
    spec = _spec_for_masks(causal, alignment, window)
    cu_q, geom = geometry(lengths_q, lengths_k)
    empty = cc.empty_query_rows(geom, spec)
    cu_k = cu_of(lengths_k)
    key_geom = cc.row_geometry(cu_k, sum(lengths_k), cc.sequence_lengths(cu_q), cc.sequence_lengths(cu_k))
    unseen = cc.unseen_key_rows(key_geom, spec)
    want_empty, want_unseen = [], []
    for lq, lk in zip(lengths_q, lengths_k):
        keep = keep_mask(lq, lk, causal=causal, alignment=alignment, window=window)
        want_empty += (~keep.any(dim=1)).tolist()
        want_unseen += (~keep.any(dim=0)).tolist()
    assert empty.tolist() == want_empty
    assert unseen.tolist() == want_unseen


def _spec_for_masks(causal, alignment, window):
    from test_capability import cuda_spec

    return cuda_spec(causal=causal, alignment=alignment, window=window)


def test_lse_layout_round_trip_with_empty_rows():
    lengths = [2, 0, 3]
    cu_q, geom = geometry(lengths, [1, 1, 0])
    heads, width = 2, 32
    native = torch.randn(3, heads, width)
    native[2] = math.inf  # sequence 2 has no key
    ours = cc.lse_to_packed(native, geom)
    assert ours.shape == (heads, 5)
    assert torch.equal(ours[:, :2], native[0, :, :2]) and torch.equal(ours[:, 2:], native[2, :, :3])
    ours = ours.masked_fill(ours == math.inf, -math.inf)
    back = cc.lse_to_native(ours, (3, heads, width), geom)
    assert torch.equal(back[0, :, :2], native[0, :, :2])
    assert torch.isposinf(back[2, :, :3]).all() and torch.isposinf(back[0, :, 2:]).all()
    assert torch.isposinf(back[1]).all()
    flat = cc.lse_to_native(ours, (heads, 5), None)
    assert flat.shape == (heads, 5) and torch.isposinf(flat[:, 2:]).all()


def test_kernel_ready_copies_only_what_the_kernels_cannot_read():
    aligned = torch.randn(10, 4, 64, dtype=torch.float16)
    assert cc.kernel_ready(aligned) is aligned
    shifted = in_nan_buffer(torch.randn(10, 4, 64, dtype=torch.float16))   # starts 2 elements in
    assert not cc.is_kernel_aligned(shifted)
    fixed = cc.kernel_ready(shifted)
    assert cc.is_kernel_aligned(fixed) and torch.equal(fixed, shifted)
    transposed = torch.randn(64, 4, 10, dtype=torch.float16).transpose(0, 2)
    assert cc.is_kernel_aligned(cc.kernel_ready(transposed))
    odd_rows = torch.randn(10, 4, 60, dtype=torch.float16)   # row stride 120 bytes
    assert not cc.is_kernel_aligned(odd_rows)


def test_kernel_ready_takes_fake_tensors():
    """torch.compile runs a backend's forward on fake tensors for its output shapes (``fake_state``):
    they have no address, and the alignment rule must not ask for one (on an H200, torch 2.11, a
    compiled FLASH_VARLEN training step failed here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # torch 2.13 only warns where 2.11 raised
        fake = torch.empty(10, 4, 64, dtype=torch.float16)
        assert cc.kernel_ready(fake) is fake
        assert not cc.is_kernel_aligned(torch.empty(10, 4, 60, dtype=torch.float16))  # strides still count


def test_kernel_ready_takes_functionalized_fake_tensors():
    """Plain tensors skip ``is_fake``; a functional wrapper (type ``Tensor``) over a fake one does not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(10, 4, 64, dtype=torch.float16)
    wrapped = torch._to_functional_tensor(fake)
    assert type(wrapped) is torch.Tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cc.kernel_ready(wrapped) is wrapped


def test_alignment_rule_on_strided_views():
    """The contiguous shortcut of ``is_kernel_aligned`` answers as the rule: unit last stride, a
    16-byte base, 16-byte strides on every dim of more than one element."""
    def rule(t):
        size = t.element_size()
        return ((t.stride(-1) == 1 or t.shape[-1] <= 1) and t.data_ptr() % 16 == 0
                and all(s * size % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))

    base = torch.zeros(4096, dtype=torch.float16)
    gen = torch.Generator().manual_seed(0)
    pick = lambda options: options[int(torch.randint(len(options), (), generator=gen))]  # noqa: E731
    for _ in range(2000):
        shape = [pick([0, 1, 2, 3]), pick([1, 2, 8]), pick([0, 1, 3, 8, 16])]
        strides = [pick([0, 1, 8, 24, 64, 128]), pick([0, 1, 3, 8, 16]), pick([1, 2])]
        t = base.as_strided(shape, strides, pick([0, 1, 8]))
        assert cc.is_kernel_aligned(t) == rule(t), (shape, strides, t.storage_offset())
    for shape in ((8, 8, 64), (5, 3, 59), (7, 1, 8), (1, 1, 3)):
        t = torch.zeros(shape, dtype=torch.float16)
        assert cc.is_kernel_aligned(t) == rule(t) and cc.is_kernel_aligned(t[1:]) == rule(t[1:])


def test_padding_and_gqa_expansion_are_adjoint():
    x = torch.randn(7, 2, 5, dtype=torch.float64)
    assert torch.equal(cc.pad_head_dim(x, 8)[..., :5], x) and (cc.pad_head_dim(x, 8)[..., 5:] == 0).all()
    assert cc.pad_head_dim(x, 5) is x
    expanded = cc.expand_kv_heads(x, 3)
    assert expanded.shape == (7, 6, 5) and torch.equal(expanded[:, 4], x[:, 4 // 3])
    y = torch.randn(7, 6, 5, dtype=torch.float64)
    assert torch.allclose((expanded * y).sum(), (x * cc.sum_kv_head_groups(y, 3)).sum())
    assert cc.cu_seqlens_from_lengths(torch.tensor([3, 0, 2], dtype=torch.int32)).tolist() == [0, 3, 3, 5]


def test_window_arguments_keep_gqa_decode_off_the_head_folding_path():
    from test_capability import cuda_spec

    decode = cuda_spec(heads_q=16, heads_kv=2, max_seqlen_q=1, total_q=3, causal=True, max_seqlen_k=500)
    assert flash_varlen._window_kwargs(decode, 500) == {}
    assert flash_varlen._window_kwargs(decode.replace(return_lse=True), 500) == {
        "window_size_left": 500, "window_size_right": -1}
    assert flash_varlen._window_kwargs(decode.replace(total_q=2), 500)["window_size_left"] == 500
    assert flash_varlen._window_kwargs(decode.replace(window=(4, 0)), 500) == {
        "window_size_left": 4, "window_size_right": 0}


# ---------------------------------------------------------------------------------------------
# fake aten ops: the kernels' contracts as asserts, the float64 reference as the answer


def _lengths(cu):
    return [int(b - a) for a, b in zip(cu[:-1], cu[1:])]


def _gather_paged(k_cache, v_cache, block_table, used):
    """Packed keys of a paged cache (what the kernel reads through the block table)."""
    bs = k_cache.shape[1]
    ks, vs = [], []
    for b, n in enumerate(used):
        blocks = block_table[b, :-(-n // bs)].long()
        ks.append(k_cache[blocks].flatten(0, 1)[:n])
        vs.append(v_cache[blocks].flatten(0, 1)[:n])
    return torch.cat(ks), torch.cat(vs), cu_of(used)


def _assert_kernel_tensor(t):
    assert t.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert cc.is_kernel_aligned(t), "tensor handed to a kernel is not 16-byte aligned"


def _launch(batch, heads):
    """Both kernels launch the batch and the heads on grid axes y/z (flash: grid(num_m_block, b, h),
    flash_fwd_launch_template.h / flash_bwd_launch_template.h; efficient: (blocks, heads, batches),
    mem_eff_attention/kernel_forward.h and kernel_backward.h getBlocksGrid), which hold 65535."""
    if batch > 65535 or heads > 65535:
        raise RuntimeError("CUDA error: invalid configuration argument")


def c_int(x: int) -> int:
    """An int64 narrowed to C++ ``int``: attention.cu's ``_flash_attention_forward`` takes
    ``int64_t max_seqlen_batch_q/_k`` (and windows) and hands them to flash_api.cpp's
    ``mha_varlen_fwd(..., int max_seqlen_q, const int max_seqlen_k, ...)``."""
    return (int(x) + 2**31) % 2**32 - 2**31


def flash_kernel_window(max_q, max_k, is_causal, left, right, *, forward=True, alibi=False):
    """The (left, right) window the flash kernel applies, bottom-right, -1 = unbounded (both -1:
    no mask), from the op's arguments, by PyTorch's flash_api.cpp, in its order:

    - ``mha_varlen_fwd`` only: ``if (max_seqlen_q == 1 && !alibi_slopes_.has_value()) is_causal = false``;
    - ``mha_varlen_fwd``/``mha_varlen_bwd``: ``if (is_causal) window_size_right = 0``;
    - then ``if (window_size_left >= max_seqlen_k) window_size_left = -1`` and the same for the right;
    - ``set_params_fprop``: ``params.is_causal = window_size_left < 0 && window_size_right == 0``, then
      ``if (window_size_left < 0 && window_size_right >= 0) window_size_left = seqlen_k`` and
      ``if (window_size_left >= 0 && window_size_right < 0) window_size_right = seqlen_k``
      (seqlen_k is max_seqlen_k);
    - the kernels (flash_fwd_launch_template.h ``Is_local = window_size_left >= 0 ||
      window_size_right >= 0``, which wins over ``Is_causal``; flash_fwd_kernel.h/mask.h) keep key j of
      row i when ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``.
    """
    left = -1 if left is None else left
    right = -1 if right is None else right
    if forward and max_q == 1 and not alibi:
        is_causal = False
    if is_causal:
        right = 0
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    return left, right


def flash_gqa_swapped(max_q, heads_q, heads_kv, dropout_p, head_dim, alibi, window):
    """mha_varlen_fwd's ``seqlenq_ngroups_swapped`` (after the is_causal rules, before the
    window reset): one query per sequence, GQA, no window, no dropout, no ALiBi."""
    left, right = window
    return (max_q == 1 and heads_q > heads_kv and left < 0 and right < 0 and dropout_p == 0
            and head_dim % 8 == 0 and not alibi)


class FakeFlash:
    """aten._flash_attention_forward/backward as flash_api.cpp's mha_varlen_fwd/bwd behave: the
    window rewrites (``flash_kernel_window``), max_seqlen_* narrowed to int, no kernel for
    max_seqlen_k <= 0 (zeros, lse +inf), and the GQA decode head folding with its lse layout."""

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                alibi_slopes=None, block_table=None, num_splits=None):
        for t in (q, k, v):
            _assert_kernel_tensor(t)
        assert q.dtype in (torch.float16, torch.bfloat16)
        width = q.shape[-1]
        assert width % 8 == 0 and width <= 256 and k.shape[-1] == width and v.shape[-1] == width
        for cu in (cu_q, cu_k):
            assert cu.dtype == torch.int32 and cu.is_contiguous()
        assert isinstance(max_q, int) and isinstance(max_k, int) and scale is not None
        assert not return_debug_mask
        _launch(cu_q.numel() - 1, q.shape[1])
        if alibi_slopes is not None:  # PyTorch builds its flash kernel with FLASHATTENTION_DISABLE_ALIBI
            raise RuntimeError("This flash attention build does not support alibi.")
        self.calls.append({"window": (window_size_left, window_size_right), "max_k": max_k, "max_q": max_q,
                           "seqused": seqused_k is not None, "alibi": False})
        max_q, max_k = c_int(max_q), c_int(max_k)
        lengths_q = _lengths(cu_q)
        assert max(lengths_q, default=0) <= max_q
        heads_q, heads_kv = q.shape[1], (k.shape[2] if block_table is not None else k.shape[1])
        causal_kept = is_causal and max_q != 1  # the first two rules, before the swap test
        pre_reset = (-1 if window_size_left is None else window_size_left,
                     0 if causal_kept else (-1 if window_size_right is None else window_size_right))
        swapped = flash_gqa_swapped(max_q, heads_q, heads_kv, dropout_p, width, False, pre_reset)
        if swapped and q.shape[0] != cu_q.numel() - 1:
            raise RuntimeError("shape '[B, Hkv, G, D]' is invalid for input")  # q.reshape in mha_varlen_fwd
        if block_table is not None:
            assert seqused_k is not None and k.shape[1] % 256 == 0
            k, v, cu_k = _gather_paged(k, v, block_table, seqused_k.tolist())
        left, right = flash_kernel_window(max_q, max_k, is_causal, window_size_left, window_size_right)
        if max_k > 0:
            out, lse = attention_reference(q, k, v, cu_q, cu_k, scale=scale, causal=False, alignment="bottom_right",
                                           window=(left, right), seqused_k=seqused_k)
            lse = lse.float().masked_fill(torch.isneginf(lse), math.inf)
        else:  # "If seqlen_k == 0, then we have an empty tensor": out.zero_(), lse.fill_(inf)
            out = torch.zeros(q.shape[:2] + (v.shape[-1],), dtype=torch.float64)
            lse = torch.full((heads_q, q.shape[0]), math.inf)
        if swapped:  # softmax_lse.reshape({num_heads * max_seqlen_q, batch_size}) of (Hkv, B * G)
            group = heads_q // heads_kv
            lse = lse.view(heads_kv, group, -1).transpose(1, 2).reshape(heads_q, -1)
        rng_state = torch.tensor([1234, len(self.calls)], dtype=torch.int64)
        self.calls[-1]["rng_state"] = rng_state
        return out.to(q.dtype), lse, rng_state, torch.empty(()), torch.empty(0)

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                 rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
        for t in (grad_out, q, k, v, out):
            _assert_kernel_tensor(t)
        assert grad_out.shape == out.shape == q.shape[:2] + (v.shape[-1],)
        _launch(cu_q.numel() - 1, q.shape[1])
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
        assert not torch.isneginf(lse).any(), "empty rows must reach the flash backward as +inf"
        assert rng_state is self.calls[-1]["rng_state"], "the forward's rng_state must come back"
        assert (window_size_left, window_size_right) == self.calls[-1]["window"]
        assert (max_q, max_k) == (self.calls[-1]["max_q"], self.calls[-1]["max_k"])
        max_q, max_k = c_int(max_q), c_int(max_k)
        left, right = flash_kernel_window(max_q, max_k, is_causal, window_size_left, window_size_right,
                                          forward=False)
        return _reference_grads(grad_out, q, k, v, cu_q, cu_k, scale=scale, causal=False,
                                alignment="bottom_right", window=(left, right))


def _reference_grads(grad_out, q, k, v, cu_q, cu_k, **options):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():  # fakes run inside autograd's backward, where grad mode is off
        out, _ = attention_reference(*leaves, cu_q, cu_k, **options)
        grads = torch.autograd.grad(out, leaves, grad_out.double(), allow_unused=True)
    return tuple((g if g is not None else torch.zeros_like(x)).to(q.dtype) for g, x in zip(grads, leaves))


class FakeEfficient:
    """aten._efficient_attention_forward/backward, including what we do not trust them with:
    NaN outputs for rows that see no key and garbage in gradient rows no query reaches."""

    ALIGN_LSE = 32

    def __init__(self):
        self.calls = []

    @staticmethod
    def _options(custom_mask_type, window_size):
        assert custom_mask_type in (0, 1, 2)
        causal = custom_mask_type != 0
        assert window_size is None or (causal and window_size >= 1), "efficient windows need a causal mask"
        alignment = "top_left" if custom_mask_type == 1 else "bottom_right"
        window = (-1, -1) if window_size is None else (window_size - 1, -1)
        return {"causal": causal, "alignment": alignment, "window": window}

    def forward(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, custom_mask_type, compute_log_sumexp,
                *, scale=None, seqlen_k=None, window_size=None):
        assert bias is None
        _launch(cu_q.numel() - 1, q.shape[2])
        for t in (q, k, v):
            assert t.dim() == 4 and t.shape[0] == 1
            _assert_kernel_tensor(t)
        align = 16 // q.element_size()
        assert q.shape[-1] % align == 0 and v.shape[-1] % align == 0 and k.shape[-1] == q.shape[-1]
        assert q.shape[2] == k.shape[2] == v.shape[2], "the efficient op needs equal head counts"
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
        assert 0 < max_q <= q.shape[1] and 0 < max_k <= k.shape[1]
        options = self._options(custom_mask_type, window_size)
        q3, k3, v3 = q[0], k[0], v[0]
        out, lse = attention_reference(q3, k3, v3, cu_q, cu_k, scale=scale, seqused_k=seqlen_k, **options)
        out = out.to(q.dtype)
        out[torch.isneginf(lse).any(dim=0)] = math.nan                    # 0 / 0
        batch = cu_q.numel() - 1
        width = -(-max_q // self.ALIGN_LSE) * self.ALIGN_LSE if compute_log_sumexp else 0
        native = torch.full((batch, q.shape[2], width), math.inf)
        if compute_log_sumexp:
            for b, (qs, lq) in enumerate(zip(cu_q[:-1].tolist(), _lengths(cu_q))):
                native[b, :, :lq] = lse[:, qs:qs + lq].float()
        seed, offset = torch.tensor(7), torch.tensor(len(self.calls))
        self.calls.append({"seed": seed, "offset": offset, "options": options, "shape": native.shape})
        return out.unsqueeze(0), native, seed, offset, max_q, max_k

    def backward(self, grad_out, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, dropout_p, philox_seed,
                 philox_offset, custom_mask_type, bias_requires_grad, *, scale=None, num_splits_key=None,
                 window_size=None, shared_storage_dqdkdv=False):
        assert bias is None and not bias_requires_grad
        _launch(cu_q.numel() - 1, q.shape[2])
        for t in (grad_out, q, k, v, out):
            assert t.dim() == 4 and t.shape[0] == 1
            _assert_kernel_tensor(t)
        assert 0 < max_q <= q.shape[1] and 0 < max_k <= k.shape[1]
        last = self.calls[-1]
        assert philox_seed is last["seed"] and philox_offset is last["offset"]
        assert tuple(lse.shape) == tuple(last["shape"]) and not torch.isneginf(lse).any()
        options = self._options(custom_mask_type, window_size)
        assert options == last["options"]
        dq, dk, dv = _reference_grads(grad_out[0], q[0], k[0], v[0], cu_q, cu_k, scale=scale, **options)
        _, ref_lse = attention_reference(q[0], k[0], v[0], cu_q, cu_k, scale=scale, **options)
        dq[torch.isneginf(ref_lse).any(dim=0)] = math.nan                  # never written
        for b, (ks, lk) in enumerate(zip(cu_k[:-1].tolist(), _lengths(cu_k))):
            if _lengths(cu_q)[b] == 0:
                dk[ks:ks + lk] = math.nan
                dv[ks:ks + lk] = math.nan
        return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0), None


def _read_real_schemas():
    """Probe the real ops' schemas before a fake shadows them (the probe is cached)."""
    for name in ("_flash_attention_forward", "_flash_attention_backward",
                 "_efficient_attention_forward", "_efficient_attention_backward"):
        assert cc.op_arguments(name), name


@pytest.fixture
def fake_flash(monkeypatch):
    _read_real_schemas()
    fake = FakeFlash()
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake.forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", fake.backward)
    return fake


@pytest.fixture
def fake_efficient(monkeypatch):
    _read_real_schemas()
    fake = FakeEfficient()
    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_forward", fake.forward)
    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_backward", fake.backward)
    return fake


def varlen_call(lengths_q, lengths_k, heads_q, heads_kv, dim, dim_v=None, dtype=torch.float16, *,
                requires_grad=True, nan_buffers=False, **options):
    """A PackedCall built by the public path on CPU, then labelled as CUDA sm80 (specs are data)."""
    dim_v = dim if dim_v is None else dim_v
    make = (lambda x: in_nan_buffer(x)) if nan_buffers else (lambda x: x)
    q = make(torch.randn(sum(lengths_q), heads_q, dim).to(dtype)).requires_grad_(requires_grad)
    k = make(torch.randn(sum(lengths_k), heads_kv, dim).to(dtype)).requires_grad_(requires_grad)
    v = make(torch.randn(sum(lengths_k), heads_kv, dim_v).to(dtype)).requires_grad_(requires_grad)
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    return_lse = options.pop("return_lse", True)
    call, _, _ = prepare_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=return_lse, **options)
    return call.replace(spec=call.spec.replace(device_type="cuda", capability=(8, 0)))


def check_against_reference(impl, call, *, alignment="bottom_right"):
    spec = call.spec
    assert impl.reasons(spec) == () or impl.is_available() is not None
    result = run(impl.backend, call)
    ref_out, ref_lse = attention_reference(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k,
                                           scale=spec.scale, causal=spec.causal, alignment=alignment,
                                           window=spec.window, alibi_slopes=call.alibi_slopes,
                                           seqused_k=call.seqused_k)
    assert_close_packed(result.out, ref_out, cu_seqlens=call.cu_seqlens_q.tolist(), name="out")
    if spec.return_lse:
        assert torch.equal(torch.isneginf(result.lse), torch.isneginf(ref_lse))
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(result.lse[finite].double(), ref_lse[finite], atol=1e-4, rtol=1e-4)
    if spec.needs_grad:
        grad = torch.randn_like(result.out)
        got = torch.autograd.grad(result.out, (call.q, call.k, call.v), grad)
        want = _reference_grads(grad, call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k,
                                scale=spec.scale, causal=spec.causal, alignment=alignment, window=spec.window)
        for name, g, w, cu in zip(("dq", "dk", "dv"), got, want,
                                  (call.cu_seqlens_q, call.cu_seqlens_k, call.cu_seqlens_k)):
            assert g.shape == w.shape, name
            assert_close_packed(g, w.double(), cu_seqlens=cu.tolist(), name=name, grad=True)
    return result


@pytest.fixture
def available(monkeypatch):
    for impl in (FlashVarlenBackend, EfficientBackend):
        monkeypatch.setattr(impl, "is_available", classmethod(lambda cls: None))


FLASH_CASES = {
    "causal-gqa": dict(lengths_q=[5, 0, 9, 1], lengths_k=[7, 3, 9, 4], heads_q=4, heads_kv=2, dim=16, causal=True),
    "pad-d59": dict(lengths_q=[4, 6], lengths_k=[4, 6], heads_q=2, heads_kv=2, dim=59, causal=True),
    "dv-differs": dict(lengths_q=[3, 5], lengths_k=[6, 2], heads_q=2, heads_kv=1, dim=16, dim_v=40),
    "window": dict(lengths_q=[6, 8], lengths_k=[9, 8], heads_q=2, heads_kv=2, dim=16, window_size=(2, 1)),
    "lq-gt-lk": dict(lengths_q=[7, 2], lengths_k=[3, 0], heads_q=2, heads_kv=2, dim=16, causal=True),
    "nan-buffers": dict(lengths_q=[3, 4], lengths_k=[5, 4], heads_q=2, heads_kv=2, dim=16, causal=True,
                        nan_buffers=True),
    "dropout-plumbing": dict(lengths_q=[3, 4], lengths_k=[3, 4], heads_q=2, heads_kv=2, dim=16, dropout_p=0.25),
}


@pytest.mark.usefixtures("available")
@pytest.mark.parametrize("case", FLASH_CASES, ids=list(FLASH_CASES))
def test_flash_marshalling(fake_flash, case):
    call = varlen_call(**FLASH_CASES[case])
    check_against_reference(FlashVarlenBackend, call)
    assert len(fake_flash.calls) == 1


# flash's two window rewrites, Lq = 6, Lk = 2 (max_seqlen_k 2). "applied" is what
# flash_api.cpp makes of the window when it is passed through unchanged; "rows" are the rows whose
# keys then differ from docs/api.md's window.
ISSUE_23_WINDOWS = {
    (1, -1): {"applied": (1, 2), "rows": [0, 1, 2]},
    (-1, 2): {"applied": (-1, -1), "rows": [0, 1, 2]},
    (1, 3): {"applied": (1, 2), "rows": [1, 2]},
    (0, 5): {"applied": (0, 2), "rows": [0, 1, 2]},
}


def _row_keys(len_q, len_k, i, causal, window):
    """The keys row i sees, bottom-right (docs/api.md): a range, as a tuple (empty when none)."""
    pos = i + len_k - len_q
    lo = 0 if window[0] < 0 else max(0, pos - window[0])
    hi = len_k - 1
    if causal:
        hi = min(hi, pos)
    if window[1] >= 0:
        hi = min(hi, pos + window[1])
    return (lo, hi) if lo <= hi else ()


@pytest.mark.parametrize("window", ISSUE_23_WINDOWS, ids=str)
def test_flash_model_reproduces_flashs_window_rewrites(window):
    """The fake's rules, given the window unchanged (what FLASH_VARLEN must not pass),
    give the windows and the wrong rows it would produce."""
    applied = flash_kernel_window(6, 2, False, *window)
    assert applied == ISSUE_23_WINDOWS[window]["applied"]
    wrong = [i for i in range(6) if _row_keys(6, 2, i, False, window) != _row_keys(6, 2, i, False, applied)]
    assert wrong == ISSUE_23_WINDOWS[window]["rows"]
    backward = flash_kernel_window(6, 2, False, *window, forward=False)
    assert backward == applied  # mha_varlen_bwd applies the same rewrites


@pytest.mark.usefixtures("available")
@pytest.mark.parametrize("window", ISSUE_23_WINDOWS, ids=str)
def test_flash_window_survives_the_op_rewrites(fake_flash, window):
    """Forward and backward of the issue's cases through the fake op match docs/api.md's window."""
    call = varlen_call([6, 3], [2, 2], 2, 2, 16, window_size=window)
    check_against_reference(FlashVarlenBackend, call)
    max_q, max_k = fake_flash.calls[0]["max_q"], fake_flash.calls[0]["max_k"]
    assert (max_q, max_k) == (6, 6)
    assert any("max_seqlen_k passed as 6" in n for n in FlashVarlenBackend.plan_notes(call.spec))


def test_flash_window_arguments_give_the_contract_mask_everywhere():
    """Every small batch shape, window and causal flag: what the ops make of the arguments
    FLASH_VARLEN passes (``flash_kernel_window``, forward and backward rules) keeps, row by row,
    the keys docs/api.md's window keeps."""
    from test_capability import cuda_spec

    sides = (-1, 0, 1, 2, 3, 5, 8)
    shapes = [(lq, lk) for lq in range(8) for lk in range(8)]
    for other, slack in (((0, 0), 0), ((7, 1), 0), ((1, 7), 0), ((2, 3), 4)):   # slack: loose max bounds
        for len_q, len_k in shapes:
            lengths = [(len_q, len_k), other]
            max_q, max_k = max(len_q, other[0]) + slack, max(len_k, other[1]) + slack
            for causal in (False, True):
                for window in ((left, right) for left in sides for right in sides):
                    window = tuple(-1 if s >= max_q + max_k else s for s in window)  # effective_window
                    if window == (-1, -1):
                        continue
                    spec = cuda_spec(causal=causal, window=window, batch=2, total_q=len_q + other[0],
                                     total_k=len_k + other[1], max_seqlen_q=max_q, max_seqlen_k=max_k)
                    kernel_q, kernel_k = flash_varlen.kernel_max_seqlens(spec)
                    kwargs = flash_varlen._window_kwargs(spec, kernel_k)
                    args = (kwargs.get("window_size_left"), kwargs.get("window_size_right"))
                    for forward in (True, False):
                        applied = flash_kernel_window(kernel_q, kernel_k, causal, *args, forward=forward)
                        for lq, lk in lengths:
                            for i in range(lq):
                                want = _row_keys(lq, lk, i, causal, window)
                                got = _row_keys(lq, lk, i, False, applied)
                                assert got == want, (lengths, causal, window, args, applied, forward, i)


@pytest.mark.usefixtures("available")
def test_flash_gqa_decode_with_lse_avoids_head_folding(fake_flash):
    call = varlen_call([1, 1, 0], [5, 9, 3], 8, 2, 16, causal=True, requires_grad=False)
    check_against_reference(FlashVarlenBackend, call)
    assert fake_flash.calls[0]["window"] == (9, -1)


@pytest.mark.usefixtures("available")
def test_fake_flash_models_the_gqa_head_folding(fake_flash, monkeypatch):
    """Without the window argument, the fake folds GQA decode heads as mha_varlen_fwd does: the
    reshape fails when a sequence has no query, and the lse comes back in the folded layout."""
    monkeypatch.setattr(flash_varlen, "_window_kwargs", lambda spec, max_k: {})
    with pytest.raises(RuntimeError, match="invalid for input"):
        run(Backend.FLASH_VARLEN, varlen_call([1, 1, 0], [5, 9, 3], 8, 2, 16, causal=True, requires_grad=False))
    call = varlen_call([1, 1, 1], [5, 9, 3], 8, 2, 16, causal=True, requires_grad=False)
    result = run(Backend.FLASH_VARLEN, call)
    ref_out, ref_lse = attention_reference(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k,
                                           scale=call.spec.scale, causal=True, alignment="bottom_right")
    assert_close_packed(result.out, ref_out, cu_seqlens=call.cu_seqlens_q.tolist())
    assert not torch.allclose(result.lse.double(), ref_lse, atol=1e-3)   # (Hkv * G, B) of (Hkv, B * G)


@pytest.mark.usefixtures("available")
def test_flash_seqused_k_forward(fake_flash):
    used = torch.tensor([3, 0, 5], dtype=torch.int32)
    call = varlen_call([2, 3, 4], [4, 2, 6], 2, 2, 16, causal=True, seqused_k=used, requires_grad=False)
    check_against_reference(FlashVarlenBackend, call)
    assert fake_flash.calls[0]["seqused"]


@pytest.mark.usefixtures("available")
@pytest.mark.parametrize("max_seqlen_k", [300, 2**31, 2**32, 2**32 + 3], ids=str)
def test_flash_paged_forward(fake_flash, max_seqlen_k):
    """A loose max_seqlen_k (servers pass a static bound) is clamped to the block
    table's width x block size; unclamped, the op's int narrowed 2**31 to a negative value and
    2**32 to 0 (no kernel: zeros, lse +inf) and 2**32 + 3 to 3 (windows reset against it)."""
    bs, heads, dim = 256, 2, 16
    k_cache = torch.randn(4, bs, heads, dim, dtype=torch.float16)
    v_cache = torch.randn(4, bs, heads, dim, dtype=torch.float16)
    block_table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    used = torch.tensor([300, 7], dtype=torch.int32)
    q = torch.randn(3, heads, dim, dtype=torch.float16)
    cu_q = cu_of([2, 1])
    call, _, _ = prepare_varlen(q, k_cache, v_cache, cu_q, None, 2, max_seqlen_k, causal=True, return_lse=True,
                                block_table=block_table, seqused_k=used)
    call = call.replace(spec=call.spec.replace(device_type="cuda", capability=(8, 0)))
    assert call.spec.max_seqlen_k == max_seqlen_k
    result = run(Backend.FLASH_VARLEN, call)
    k, v, cu_k = _gather_paged(k_cache, v_cache, block_table, [300, 7])
    ref_out, ref_lse = attention_reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right")
    assert_close_packed(result.out, ref_out, cu_seqlens=cu_q.tolist())
    torch.testing.assert_close(result.lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    assert fake_flash.calls[0]["max_k"] == min(max_seqlen_k, 2 * bs)



@pytest.mark.usefixtures("available")
def test_flash_paged_runner_makes_cu_seqlens_k_once_per_batch(fake_flash, monkeypatch):
    """A paged call's cu_seqlens_k (rebuilt from seqused_k on the device) is made by a plan kind's
    runner at its first call and reused by the later layers; never kept while a graph is captured."""
    from jagged_sdpa import batch as batches

    bs, heads, dim = 256, 2, 16
    caches = [(torch.randn(4, bs, heads, dim, dtype=torch.float16), torch.randn(4, bs, heads, dim,
                                                                                dtype=torch.float16))
              for _ in range(3)]
    block_table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    used = torch.tensor([300, 7], dtype=torch.int32)
    q, cu_q = torch.randn(3, heads, dim, dtype=torch.float16), cu_of([2, 1])
    call, _, _ = prepare_varlen(q, *caches[0], cu_q, None, 2, 512, causal=True, return_lse=True,
                                block_table=block_table, seqused_k=used)
    call = call.replace(spec=call.spec.replace(device_type="cuda", capability=(8, 0)))
    made = []
    real = cc.cu_seqlens_from_lengths
    monkeypatch.setattr(cc, "cu_seqlens_from_lengths", lambda t: made.append(t) or real(t))
    runner = FlashVarlenBackend.forward_runner(call)
    for k_cache, v_cache in caches:
        layer = call.replace(k=k_cache, v=v_cache)
        got, want = runner(layer), FlashVarlenBackend.forward(layer)
        assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
    assert len(made) == 1 + len(caches)
    monkeypatch.setattr(batches, "capturing", lambda t: True)
    runner(call), runner(call)
    assert len(made) == 3 + len(caches)

EFFICIENT_CASES = {
    "causal-top-left": dict(lengths_q=[5, 0, 9, 3], lengths_k=[7, 3, 6, 0], heads_q=2, heads_kv=2, dim=16,
                            causal=True, alignment="top_left"),
    "causal-bottom-right-gqa": dict(lengths_q=[5, 2, 9], lengths_k=[3, 6, 9], heads_q=4, heads_kv=1, dim=16,
                                    causal=True),
    "window-top-left": dict(lengths_q=[6, 8], lengths_k=[9, 3], heads_q=2, heads_kv=2, dim=16,
                            window_size=(2, 0), alignment="top_left"),
    "window-bottom-right": dict(lengths_q=[6, 8], lengths_k=[9, 3], heads_q=2, heads_kv=2, dim=16,
                                window_size=(1, 0), causal=True, requires_grad=False),
    "window-equal-lengths": dict(lengths_q=[6, 8], lengths_k=[6, 8], heads_q=2, heads_kv=2, dim=16,
                                 window_size=(3, 0), causal=True),
    "pad-59-111-fp32": dict(lengths_q=[4, 6], lengths_k=[5, 6], heads_q=2, heads_kv=2, dim=59, dim_v=111,
                            dtype=torch.float32),
    "full-nan-buffers": dict(lengths_q=[3, 4], lengths_k=[5, 4], heads_q=2, heads_kv=2, dim=16, nan_buffers=True),
}


@pytest.mark.usefixtures("available")
@pytest.mark.parametrize("case", EFFICIENT_CASES, ids=list(EFFICIENT_CASES))
def test_efficient_marshalling(fake_efficient, case):
    options = dict(EFFICIENT_CASES[case])
    alignment = options.pop("alignment", "bottom_right")
    call = varlen_call(**options)
    call = call.replace(spec=call.spec.replace(alignment=alignment))
    result = check_against_reference(EfficientBackend, call, alignment=alignment)
    assert not torch.isnan(result.out).any()


@pytest.mark.usefixtures("available")
def test_efficient_runner_makes_the_row_bookkeeping_once_per_batch_and_never_while_capturing(fake_efficient,
                                                                                          monkeypatch):
    """A plan kind's runner (one batch) makes the rows' bookkeeping at its first call and hands it to
    the later ones (a decode step's layers); a call made while a CUDA graph is captured makes its
    own, inside the graph, and neither keeps it nor takes a kept one (a replay reads what the
    metadata then holds)."""
    from jagged_sdpa import batch as batches

    call = varlen_call([1, 1, 0, 2], [5, 0, 3, 9], 4, 4, 16, causal=True, requires_grad=False)  # a row sees no key
    made = []
    real = cc.query_geometry
    monkeypatch.setattr(cc, "query_geometry", lambda c: made.append(c) or real(c))
    layers = [call.replace(q=torch.randn_like(call.q)) for _ in range(3)]
    runner = EfficientBackend.forward_runner(call)
    for layer in layers:
        got, want = runner(layer), EfficientBackend.forward(layer)
        assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
        assert not torch.isnan(got.out).any() and (got.out[1] == 0).all() and torch.isneginf(got.lse[:, 1]).all()
    assert len(made) == 1 + len(layers)   # the runner's once, and every forward's own
    made.clear()
    monkeypatch.setattr(batches, "capturing", lambda t: True)
    runner(layers[0]), runner(layers[1])
    assert len(made) == 2                 # made inside the capture, each time
    fresh = EfficientBackend.forward_runner(call)
    fresh(layers[0])                      # a first call captured: nothing kept
    monkeypatch.setattr(batches, "capturing", lambda t: False)
    fresh(layers[0]), fresh(layers[1])
    assert len(made) == 4


@pytest.mark.usefixtures("available")
def test_efficient_decode_layers_through_varlen_attention_make_the_bookkeeping_once(fake_efficient, monkeypatch):
    """The public path, as on a GPU given its max lengths (nothing read): the layers of a decode
    step over one batch run the plan's runner, which makes the rows' bookkeeping once."""
    from jagged_sdpa import batch as batches, layout
    from jagged_sdpa import spec as specs

    real_build = specs.build
    monkeypatch.setattr(specs, "build", lambda *a, **kw: real_build(*a, **kw).replace(device_type="cuda",
                                                                                      capability=(8, 0)))
    monkeypatch.setattr(layout, "host_read_needed", lambda device, *given: any(m is None for m in given))
    made = []
    real = cc.query_geometry
    monkeypatch.setattr(cc, "query_geometry", lambda c: made.append(c) or real(c))
    batches.clear_cache()
    lengths_q, lengths_k = [1, 1, 0, 1], [5, 0, 3, 9]
    cu_q, cu_k = cu_of(lengths_q), cu_of(lengths_k)
    for _ in range(3):
        q = torch.randn(sum(lengths_q), 4, 16, dtype=torch.float16)
        k, v = (torch.randn(sum(lengths_k), 4, 16, dtype=torch.float16) for _ in range(2))
        out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 1, 9, causal=True, return_lse=True,
                                                backend="efficient")
        ref_out, ref_lse = attention_reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right")
        assert_close_packed(out, ref_out, cu_seqlens=cu_q.tolist(), name="out")
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert len(made) == 1 and not made[0].spec.lengths_known
    batches.clear_cache()


@pytest.mark.usefixtures("available")
def test_efficient_lse_budget_counts_what_the_op_allocates(fake_efficient):
    """The padded-lse memory budget counts the lse the op returns (the fake's, attention.cu's shape)."""
    from jagged_sdpa.backends.cuda.efficient import padded_lse_bytes

    call = varlen_call([40, 1, 3], [5, 9, 33], 4, 2, 16, causal=True, requires_grad=False)
    call = call.replace(spec=call.spec.replace(max_seqlen_q=2**40))   # a loose bound, clamped to total_q
    run(Backend.EFFICIENT, call)
    shape = fake_efficient.calls[0]["shape"]
    assert tuple(shape) == (3, 4, 64) and padded_lse_bytes(call.spec) == 3 * 4 * 64 * 4


@pytest.mark.usefixtures("available")
def test_more_sequences_than_the_grid_holds_are_refused_not_launched(fake_flash, fake_efficient):
    """65536 one-token sequences (the grid axis holds 65535). The ops fail at launch (the fakes, as the
    kernels' grids do); selection refuses both with the reason and takes a backend that can."""
    from jagged_sdpa.selection import select

    call = varlen_call([1] * 65536, [1] * 65536, 2, 2, 16, requires_grad=False)
    for backend in (Backend.FLASH_VARLEN, Backend.EFFICIENT):
        with pytest.raises(RuntimeError, match="invalid configuration argument"):
            run(backend, call)
    explanation = select(call.spec)
    assert explanation.chosen == Backend.MATH
    for backend in (Backend.FLASH_VARLEN, Backend.EFFICIENT):
        assert any("batch 65536 > 65535 sequences" in r for r in explanation.reasons[backend])


@pytest.mark.usefixtures("available")
def test_efficient_seqused_k_forward(fake_efficient):
    used = torch.tensor([3, 0, 5], dtype=torch.int32)
    call = varlen_call([2, 3, 4], [4, 2, 6], 2, 2, 16, causal=True, seqused_k=used, requires_grad=False)
    check_against_reference(EfficientBackend, call)


@pytest.mark.usefixtures("available")
def test_no_query_or_no_key_anywhere_runs_no_kernel(fake_flash, fake_efficient):
    for impl in (FlashVarlenBackend, EfficientBackend):
        call = varlen_call([0, 0], [3, 2], 2, 2, 16)
        result = run(impl.backend, call)
        assert result.out.shape == (0, 2, 16) and result.lse.shape == (2, 0)
    call = varlen_call([2, 3], [0, 0], 2, 2, 16)
    result = run(Backend.EFFICIENT, call)
    assert (result.out == 0).all() and torch.isneginf(result.lse).all()
    dq, = torch.autograd.grad(result.out.sum(), (call.q,))
    assert (dq == 0).all()
    assert not fake_efficient.calls and not fake_flash.calls


# ---------------------------------------------------------------------------------------------
# GPU: both backends against the float64 reference


CUDA_OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (8, 0), "causal": True},
    "window-sym": {"window_size": (4, 4)},
    # sequences with more queries than max_seqlen_k + 1 (flash's window rewrites)
    "window-lq-gt-lk": {"lengths": ([6, 70, 3], [2, 5, 9]), "window_size": (1, 3)},
    "window-left-only-lq-gt-lk": {"lengths": ([6, 70, 3], [2, 5, 9]), "window_size": (1, -1)},
    "window-right-only-lq-gt-lk": {"lengths": ([6, 70, 3], [2, 5, 9]), "window_size": (-1, 2)},
    "gqa": {"gqa": 4, "causal": True},
    "d59": {"dim": 59},
    "dv40": {"dim_v": 40},
    "empty": {"lengths": ([0, 17, 0, 64, 5], [3, 0, 0, 64, 70]), "causal": True},
    "decode-gqa": {"lengths": ([1, 1, 1], [100, 7, 300]), "gqa": 8, "causal": True},
}


def _cuda_case(backend, dtype, name, grad):
    options = dict(CUDA_OPTIONS[name])
    lengths_q, lengths_k = options.pop("lengths", ([5, 130, 1, 67], [9, 130, 40, 67]))
    group = options.pop("gqa", 1)
    dim = options.pop("dim", 64)
    dim_v = options.pop("dim_v", dim)
    heads_kv = 2
    dev = "cuda"
    q = torch.randn(sum(lengths_q), heads_kv * group, dim, device=dev, dtype=dtype, requires_grad=grad)
    k = torch.randn(sum(lengths_k), heads_kv, dim, device=dev, dtype=dtype, requires_grad=grad)
    v = torch.randn(sum(lengths_k), heads_kv, dim_v, device=dev, dtype=dtype, requires_grad=grad)
    cu_q, cu_k = cu_of(lengths_q).to(dev), cu_of(lengths_k).to(dev)
    window = options.get("window_size", (-1, -1))
    explanation = jagged_sdpa.explain(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), backend=backend,
                                      return_lse=True, **options)
    if explanation.chosen is None:
        pytest.skip("; ".join(explanation.reasons[Backend(backend)]))
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                            return_lse=True, backend=backend, **options)
    ref_out, ref_lse = attention_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=options.get("causal", False),
                                           alignment="bottom_right", window=window)
    assert_close_packed(out, ref_out, cu_seqlens=cu_q.tolist())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=2e-3, rtol=2e-3)
    if grad:
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        want = _reference_grads(g, q, k, v, cu_q.tolist(), cu_k.tolist(), causal=options.get("causal", False),
                                alignment="bottom_right", window=window)
        for name_, a, b, cu in zip(("dq", "dk", "dv"), got, want, (cu_q, cu_k, cu_k)):
            assert_close_packed(a, b.double(), cu_seqlens=cu.tolist(), name=name_, grad=True)


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("name", CUDA_OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("backend", [Backend.FLASH_VARLEN, Backend.EFFICIENT], ids=str)
def test_cuda_backend_matches_reference(backend, dtype, name, grad):
    _cuda_case(backend, dtype, name, grad)


@pytest.mark.cuda
def test_cuda_efficient_float32_top_left_through_sdpa():
    lengths_q, lengths_k = [5, 40, 0, 9], [9, 12, 3, 9]
    q = torch.randn(sum(lengths_q), 4, 40, device="cuda", requires_grad=True)
    k = torch.randn(sum(lengths_k), 4, 40, device="cuda", requires_grad=True)
    nq = torch.nested.nested_tensor_from_jagged(q, offsets=cu_of(lengths_q).long().cuda()).transpose(1, 2)
    nk = torch.nested.nested_tensor_from_jagged(k, offsets=cu_of(lengths_k).long().cuda()).transpose(1, 2)
    with _no_tf32():
        out = jagged_sdpa.sdpa(nq, nk, nk, is_causal=True, backend="efficient").transpose(1, 2).values()
        ref, _ = attention_reference(q, k, k, cu_of(lengths_q), cu_of(lengths_k), causal=True, alignment="top_left")
    # float32 on tensor-core GPUs goes through CUTLASS's fast-accurate (3xTF32) path: a little
    # looser than the float32 floor of tolerances.py.
    torch.testing.assert_close(out.double(), ref, atol=2e-4, rtol=2e-4)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k), g)
    want = _reference_grads(g, q, k, k, cu_of(lengths_q), cu_of(lengths_k), causal=True, alignment="top_left")
    torch.testing.assert_close(got[0].double(), want[0].double(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got[1].double(), (want[1] + want[2]).double(), atol=1e-3, rtol=1e-3)


class _no_tf32:
    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["flash_varlen", "efficient"])
def test_cuda_dropout_is_reproducible_and_differentiable(backend):
    q, k, v = (torch.randn(300, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = cu_of([100, 200]).cuda()
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(jagged_sdpa.varlen_attention(q, k, v, cu, cu, 200, 200, dropout_p=0.3, backend=backend))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    grads = torch.autograd.grad(outs[0].float().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.cuda
def test_cuda_flash_alibi_is_compiled_out_and_seqused_forward():
    heads, dim = 4, 64
    slopes = torch.rand(heads, device="cuda")
    lengths_q, lengths_k = [3, 0, 50], [10, 4, 60]
    q = torch.randn(sum(lengths_q), heads, dim, device="cuda", dtype=torch.float16)
    k = torch.randn(sum(lengths_k), heads, dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    cu_q, cu_k = cu_of(lengths_q).cuda(), cu_of(lengths_k).cuda()
    # The premise of FLASH_VARLEN's "alibi_slopes not supported": PyTorch's flash op refuses slopes.
    # If a torch release ever accepts them, this fails and the capability can be widened again.
    with pytest.raises(RuntimeError, match="does not support alibi"):
        torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, 50, 60, 0.0, True, False,
                                                scale=dim ** -0.5, alibi_slopes=slopes)
    explanation = jagged_sdpa.explain(q, k, v, cu_q, cu_k, 50, 60, causal=True, alibi_slopes=slopes)
    assert "alibi_slopes not supported" in " ".join(explanation.reasons[Backend.FLASH_VARLEN])
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 50, 60, causal=True, alibi_slopes=slopes)
    ref, _ = attention_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=True, alignment="bottom_right",
                                 alibi_slopes=slopes)
    assert_close_packed(out, ref, cu_seqlens=cu_q.tolist())
    used = torch.tensor([7, 0, 33], dtype=torch.int32, device="cuda")
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 50, 33, causal=True, seqused_k=used,
                                       backend="flash_varlen")
    ref, _ = attention_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=True, alignment="bottom_right",
                                 seqused_k=used.tolist())
    assert_close_packed(out, ref, cu_seqlens=cu_q.tolist())


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["flash_varlen", "efficient"])
def test_cuda_no_host_sync_when_max_lengths_are_given(backend):
    q, k, v = (torch.randn(300, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    cu = cu_of([100, 0, 200]).cuda()
    jagged_sdpa.varlen_attention(q, k, v, cu, cu, 200, 200, causal=True, backend=backend)  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = jagged_sdpa.varlen_attention(q, k, v, cu, cu, 200, 200, causal=True, backend=backend)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---------------------------------------------------------------------------------------------
# the sdpa entry: NJT self-attention and dense K/V reach the same backends


def sdpa_call(query, key, value, **options):
    call, _, _ = prepare_sdpa(query, key, value, **options)
    return call.replace(spec=call.spec.replace(device_type="cuda", capability=(8, 0)))


@pytest.mark.usefixtures("available")
def test_sdpa_self_attention_top_left_goes_to_flash(fake_flash):
    values = torch.randn(11, 4, 32, dtype=torch.float16)
    nested = torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, 3, 11])).transpose(1, 2)
    call = sdpa_call(nested, nested, nested, is_causal=True)
    assert call.spec.equal_lengths and FlashVarlenBackend.reasons(call.spec) == ()
    result = run(Backend.FLASH_VARLEN, call)
    ref, _ = attention_reference(values, values, values, [0, 3, 11], [0, 3, 11], causal=True, alignment="top_left")
    assert_close_packed(result.out, ref, cu_seqlens=[0, 3, 11])


@pytest.mark.usefixtures("available")
def test_sdpa_dense_kv_top_left_goes_to_efficient(fake_efficient):
    values = torch.randn(8, 4, 32, dtype=torch.float16)
    nested = torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, 3, 8])).transpose(1, 2)
    key, value = torch.randn(2, 2, 6, 32, dtype=torch.float16), torch.randn(2, 2, 6, 24, dtype=torch.float16)
    call = sdpa_call(nested, key, value, is_causal=True, enable_gqa=True)
    assert call.spec.kv_dense and not call.spec.equal_lengths
    assert any("top_left" in r for r in FlashVarlenBackend.reasons(call.spec))
    result = run(Backend.EFFICIENT, call)
    k = key.transpose(1, 2).reshape(12, 2, 32)
    v = value.transpose(1, 2).reshape(12, 2, 24)
    ref, _ = attention_reference(values, k, v, [0, 3, 8], [0, 6, 12], causal=True, alignment="top_left")
    assert_close_packed(result.out, ref, cu_seqlens=[0, 3, 8])
