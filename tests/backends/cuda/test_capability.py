"""Eligibility rules of the CUDA backends on tensor-free specs: no GPU needed.

Each rule's source in PyTorch is named in the backend's docstring or next to the rule; here every
reason must fire for its condition, and only then. ``is_available`` is patched to None so that the
rules themselves are exercised on a CPU-only machine.
"""

from __future__ import annotations

import pytest
import torch

from jagged_sdpa.backends import IMPLS, Backend
from jagged_sdpa.backends.cuda import common as cc
from jagged_sdpa.backends.cuda.efficient import EfficientBackend, mask_arguments
from jagged_sdpa.backends.cuda.flash_varlen import FlashVarlenBackend
from jagged_sdpa.selection import select
from jagged_sdpa.spec import AttnSpec


def cuda_spec(**changes) -> AttnSpec:
    """A plausible CUDA varlen call on sm80: bf16, B=3, Hq=Hkv=8, D=64, causal bottom-right."""
    base = AttnSpec(
        entry="varlen", device_type="cuda", capability=(8, 0), dtype=torch.bfloat16, batch=3,
        heads_q=8, heads_kv=8, head_dim=64, head_dim_v=64, total_q=300, total_k=300,
        max_seqlen_q=200, max_seqlen_k=200, has_empty_q=False, has_empty_k=False, lengths_known=True,
        causal=True, alignment="bottom_right",
    )
    return base.replace(**changes)


@pytest.fixture(autouse=True)
def cuda_available(monkeypatch):
    for impl in (FlashVarlenBackend, EfficientBackend):
        monkeypatch.setattr(impl, "is_available", classmethod(lambda cls: None))


def flash(**changes):
    return FlashVarlenBackend.reasons(cuda_spec(**changes))


def efficient(**changes):
    return EfficientBackend.reasons(cuda_spec(**changes))


def has(reasons, fragment: str) -> bool:
    return any(fragment in r for r in reasons)


# ---------------------------------------------------------------------------------------------
# FLASH_VARLEN


@pytest.mark.parametrize("changes", [
    {},
    {"dtype": torch.float16},
    {"head_dim": 256, "head_dim_v": 256},
    {"head_dim": 60, "head_dim_v": 60},                     # padded to 64
    {"head_dim": 64, "head_dim_v": 40},                     # padded to one width
    {"heads_q": 32, "heads_kv": 4},                         # native GQA
    {"dropout_p": 0.1, "needs_grad": True, "return_lse": True},
    {"window": (16, 0)}, {"causal": False, "window": (8, 8)},
    {"seqused_k": True},
    {"paged": True, "block_size": 256, "seqused_k": True},
    {"capability": (9, 0)}, {"capability": (12, 0)},
    {"entry": "sdpa", "alignment": "top_left", "equal_lengths": True, "needs_grad": True},
    {"entry": "sdpa", "alignment": "top_left", "causal": False},   # no positional option: alignment moot
    {"kv_dense": True, "entry": "sdpa"},
    {"has_empty_q": True, "has_empty_k": True, "lengths_known": False},
])
def test_flash_takes(changes):
    assert flash(**changes) == ()


@pytest.mark.parametrize("changes, fragment", [
    ({"capability": (7, 5)}, "compute capability sm75 < sm80"),
    ({"dtype": torch.float32}, "dtype float32 not supported (supported: bfloat16, float16)"),
    ({"head_dim": 320, "head_dim_v": 320}, "head_dim 320 > 256"),
    ({"head_dim_v": 264}, "head_dim_v 264 > 256"),
    ({"device_type": "cpu"}, "device cpu not supported"),
    ({"softcap": 30.0}, "softcap 30 not supported"),
    ({"alibi": "per_head"}, "alibi_slopes not supported"),  # compiled out of PyTorch's flash build
    ({"alibi": "per_batch_head", "causal": False, "needs_grad": True}, "alibi_slopes not supported"),
    ({"seqused_k": True, "needs_grad": True}, "seqused_k with a gradient needed - aten._flash_attention_backward"),
    ({"entry": "sdpa", "alignment": "top_left"}, "causal_alignment top_left with Lq != Lk"),
    ({"entry": "sdpa", "alignment": "top_left", "causal": False, "window": (4, 4)}, "top_left with Lq != Lk"),
    ({"paged": True, "block_size": 16, "seqused_k": True}, "paged block_size 16 not a multiple of 256"),
    ({"paged": True, "block_size": 256, "needs_grad": True}, "takes no block_table"),
    ({"paged": True, "block_size": 256, "head_dim": 60, "head_dim_v": 60}, "padding would copy the whole cache"),
    ({"paged": True, "block_size": 256, "dropout_p": 0.1}, "split-kv kernel has no dropout"),
    ({"capability": (8, 6), "head_dim": 200, "head_dim_v": 200, "needs_grad": True}, "head_dim 200 backward on sm86"),
    ({"capability": (8, 9), "head_dim": 256, "head_dim_v": 256, "needs_grad": True, "dropout_p": 0.1},
     "head_dim 256 backward with dropout on sm89"),
])
def test_flash_refuses(changes, fragment):
    reasons = flash(**changes)
    assert has(reasons, fragment), reasons


@pytest.mark.parametrize("changes", [
    {"capability": (8, 0), "head_dim": 200, "head_dim_v": 200, "needs_grad": True, "dropout_p": 0.1},
    {"capability": (8, 6), "head_dim": 256, "head_dim_v": 256, "needs_grad": True},
    {"capability": (8, 6), "head_dim": 200, "head_dim_v": 200},
    {"capability": (9, 0), "head_dim": 224, "head_dim_v": 224, "needs_grad": True},
])
def test_flash_large_head_dim_training_rule_is_narrow(changes):
    assert flash(**changes) == ()


def test_flash_gathers_every_reason():
    reasons = flash(capability=(7, 5), dtype=torch.float32, head_dim=320, head_dim_v=320, softcap=5.0)
    for fragment in ("sm75 < sm80", "dtype float32", "head_dim 320 > 256", "head_dim_v 320 > 256", "softcap 5"):
        assert has(reasons, fragment), reasons
    assert all(r == r.lower() or "aten." in r for r in reasons)
    assert not any(r.endswith(".") for r in reasons)


def test_flash_reasons_for_arguments_this_torch_lacks(monkeypatch):
    old = frozenset({"query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                     "is_causal", "return_debug_mask", "scale"})
    monkeypatch.setattr(cc, "op_arguments", lambda name: old)
    reasons = flash(window=(8, 0), seqused_k=True)
    for feature in ("window_size needs aten._flash_attention_forward(window_size_left=...)",
                    "seqused_k needs aten._flash_attention_forward(seqused_k=...)"):
        assert has(reasons, feature), reasons
    assert has(flash(paged=True, block_size=256), "paged kv cache needs aten._flash_attention_forward(block_table=...)")
    assert flash() == ()


def test_gqa_decode_needs_the_window_argument_only_when_lse_matters(monkeypatch):
    # One query per sequence + GQA: the op's head-folding fast path must be avoided for lse.
    monkeypatch.setattr(cc, "op_arguments", lambda name: frozenset({"scale"}))
    decode = dict(heads_q=32, heads_kv=4, max_seqlen_q=1, total_q=3, causal=False)
    assert flash(**decode) == ()
    assert has(flash(**decode, return_lse=True), "window_size")
    assert has(flash(**{**decode, "total_q": 2}), "window_size")   # a sequence without a query
    assert has(flash(**decode, needs_grad=True), "aten._flash_attention_backward(window_size_left=...)")


# ---------------------------------------------------------------------------------------------
# EFFICIENT


@pytest.mark.parametrize("changes", [
    {},
    {"dtype": torch.float32, "capability": (7, 5)},
    {"dtype": torch.float16, "capability": (5, 0)},
    {"head_dim": 320, "head_dim_v": 320},
    {"head_dim": 59, "head_dim_v": 111},
    {"heads_q": 32, "heads_kv": 4},                              # GQA by expansion
    {"entry": "sdpa", "alignment": "top_left"},                  # top-left causal, unequal lengths
    {"window": (16, 0)}, {"causal": False, "window": (16, 0)}, {"causal": False, "window": (-1, 0)},
    {"alignment": "top_left", "window": (3, 7)},                 # causal makes the right bound moot
    {"dropout_p": 0.2, "needs_grad": True, "return_lse": True},
    {"seqused_k": True},
    {"kv_dense": True, "entry": "sdpa", "alignment": "top_left"},
    {"has_empty_q": True, "has_empty_k": True},
    {"window": (8, 0), "needs_grad": True, "equal_lengths": True},
    {"window": (8, 0), "needs_grad": True, "alignment": "top_left", "entry": "sdpa"},
])
def test_efficient_takes(changes):
    assert efficient(**changes) == ()


@pytest.mark.parametrize("changes, fragment", [
    ({"capability": (3, 7)}, "compute capability sm37 < sm50"),
    ({"dtype": torch.float64}, "dtype float64 not supported"),
    ({"capability": (7, 5)}, "bfloat16 on sm75"),
    ({"alibi": "per_head"}, "alibi_slopes not supported"),
    ({"softcap": 50.0}, "softcap 50 not supported"),
    ({"paged": True, "block_size": 256}, "paged KV cache (block_table) not supported"),
    ({"causal": False, "window": (4, 4)}, "window_size (4, 4) without causal"),
    ({"causal": False, "window": (4, -1)}, "only causal sliding windows"),
    ({"seqused_k": True, "needs_grad": True}, "takes no seqlen_k"),
    ({"window": (8, 0), "needs_grad": True}, "window_size with bottom_right alignment and a gradient needed"),
])
def test_efficient_refuses(changes, fragment):
    reasons = efficient(**changes)
    assert has(reasons, fragment), reasons


def test_efficient_reasons_for_arguments_this_torch_lacks(monkeypatch):
    monkeypatch.setattr(cc, "op_arguments", lambda name: frozenset({"query", "scale"}))
    assert has(efficient(window=(8, 0)), "window_size needs aten._efficient_attention_forward(window_size=...)")
    assert has(efficient(window=(8, 0), needs_grad=True), "aten._efficient_attention_backward(window_size=...)")
    assert has(efficient(seqused_k=True), "seqlen_k=...")
    assert efficient() == ()


@pytest.mark.parametrize("changes, expected", [
    ({"causal": False}, (0, None)),
    ({}, (2, None)),
    ({"alignment": "top_left"}, (1, None)),
    ({"window": (7, 0)}, (2, 8)),
    ({"window": (7, 0), "equal_lengths": True}, (1, 8)),
    ({"equal_lengths": True}, (1, None)),
    ({"causal": False, "alignment": "top_left", "window": (0, 0)}, (1, 1)),
    ({"causal": False, "window": (-1, 0)}, (2, None)),
])
def test_efficient_mask_arguments(changes, expected):
    # window_size W keeps keys i' - W < j <= i': our left window L is W = L + 1.
    assert mask_arguments(cuda_spec(**changes)) == expected


# ---------------------------------------------------------------------------------------------
# availability and selection


@pytest.fixture
def fresh_probes():
    from jagged_sdpa.backends.cuda import flash_varlen

    for probe in (cc.cuda_unavailable_reason, flash_varlen._flash_build_reason):
        probe.cache_clear()
    yield
    for probe in (cc.cuda_unavailable_reason, flash_varlen._flash_build_reason):
        probe.cache_clear()


@pytest.mark.usefixtures("fresh_probes")
def test_availability_reasons(monkeypatch):
    from jagged_sdpa.backends.cuda import flash_varlen

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert flash_varlen._availability() == "PyTorch built without CUDA (torch.version.cuda is None)"
    cc.cuda_unavailable_reason.cache_clear()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flash_varlen._availability() == "no CUDA device (torch.cuda.is_available() is False)"
    cc.cuda_unavailable_reason.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert "PyTorch built without flash attention" in flash_varlen._availability()


def test_unavailable_backend_gives_one_reason(monkeypatch):
    monkeypatch.setattr(FlashVarlenBackend, "is_available", classmethod(lambda cls: "no CUDA device"))
    assert FlashVarlenBackend.reasons(cuda_spec(dtype=torch.float64)) == ("no CUDA device",)


def test_this_cpu_build_reports_why(monkeypatch):
    monkeypatch.undo()
    if torch.version.cuda is None:
        assert IMPLS[Backend.FLASH_VARLEN].reasons(cuda_spec()) == ("PyTorch built without CUDA (torch.version.cuda is None)",)


@pytest.mark.parametrize("impl", [FlashVarlenBackend, EfficientBackend], ids=lambda i: i.backend.value)
def test_cuda_grid_limits_are_reasons(impl):
    """Both kernels put the batch on a grid axis of at most 65535 (flash: y,
    efficient: z) and the heads on the other; beyond, the launch fails ("invalid configuration
    argument"), so the call goes to a backend that takes it."""
    many = cuda_spec(batch=65536, total_q=65536 * 3, total_k=65536 * 3, max_seqlen_q=3, max_seqlen_k=3)
    assert has(impl.reasons(many), "batch 65536 > 65535 sequences"), impl.reasons(many)
    assert impl.reasons(many.replace(batch=65535)) == ()
    assert has(impl.reasons(cuda_spec(heads_q=65536, heads_kv=65536)), "heads_q 65536 > 65535")
    explanation = select(many)
    assert explanation.chosen == Backend.MATH
    for backend in (Backend.FLASH_VARLEN, Backend.EFFICIENT, Backend.TRITON):
        assert has(explanation.reasons[backend], "65535"), explanation.reasons[backend]


def _long_tail(**changes):
    """One 128k-token sequence and 1,000 of 100 tokens, Hq = 32, float32."""
    total = 131072 + 1000 * 100
    return cuda_spec(dtype=torch.float32, batch=1001, heads_q=32, heads_kv=32, total_q=total, total_k=total,
                     max_seqlen_q=131072, max_seqlen_k=131072, **changes)


def test_efficient_refuses_a_padded_lse_over_its_memory_budget():
    from jagged_sdpa.backends.cuda.efficient import padded_lse_bytes

    spec = _long_tail(return_lse=True)
    assert padded_lse_bytes(spec) == 1001 * 32 * 131072 * 4   # 16.8 GB
    reasons = EfficientBackend.reasons(spec)
    assert has(reasons, "lse of 16.8 GB - the efficient op pads it to (B, Hq, round32(max_seqlen_q)) = "
                        "(1001, 32, 131072) float32, 568x the packed 29.6 MB"), reasons
    assert has(EfficientBackend.reasons(_long_tail(needs_grad=True)), "lse of 16.8 GB")
    assert EfficientBackend.reasons(_long_tail()) == ()                  # no lse asked: width 0
    explanation = select(spec)                                           # float32: flash refuses too
    assert explanation.chosen not in (Backend.FLASH_VARLEN, Backend.EFFICIENT)
    assert has(explanation.reasons[Backend.EFFICIENT], "lse of 16.8 GB")
    # Equal lengths, decode and modest tails stay: the padding is at most the floor or 4x ours.
    assert efficient(return_lse=True, needs_grad=True) == ()
    assert efficient(dtype=torch.float32, batch=4096, heads_q=32, heads_kv=8, total_q=4096, max_seqlen_q=1,
                     max_seqlen_k=4096, total_k=4096 * 4096, return_lse=True) == ()
    assert efficient(dtype=torch.float32, batch=64, heads_q=32, heads_kv=32, total_q=64 * 2048, total_k=64 * 2048,
                     max_seqlen_q=4096, max_seqlen_k=4096, needs_grad=True) == ()
    # A loose max_seqlen_q is clamped to total_q as the op gets it.
    assert efficient(max_seqlen_q=2**40, return_lse=True) == ()


def test_selection_prefers_flash_then_efficient():
    assert select(cuda_spec()).chosen == Backend.FLASH_VARLEN
    top_left = select(cuda_spec(entry="sdpa", alignment="top_left", needs_grad=True))
    assert top_left.chosen == Backend.EFFICIENT
    assert has(top_left.reasons[Backend.FLASH_VARLEN], "top_left")
    fp32 = select(cuda_spec(dtype=torch.float32))
    assert fp32.chosen == Backend.EFFICIENT and has(fp32.reasons[Backend.FLASH_VARLEN], "dtype float32")
    alibi_grad = select(cuda_spec(alibi="per_head", needs_grad=True))
    assert alibi_grad.chosen not in (Backend.FLASH_VARLEN, Backend.EFFICIENT)
    assert has(alibi_grad.reasons[Backend.EFFICIENT], "alibi_slopes not supported")


def test_plan_notes_say_what_the_backend_will_do():
    assert FlashVarlenBackend.plan_notes(cuda_spec()) == ()
    notes = FlashVarlenBackend.plan_notes(cuda_spec(head_dim=59, head_dim_v=40, alignment="top_left",
                                                    equal_lengths=True))
    assert notes == ("flash: q/k/v head dims zero-padded to 64", "flash: top-left run as bottom-right (every Lq == Lk)")
    notes = EfficientBackend.plan_notes(cuda_spec(head_dim=59, heads_q=16, heads_kv=4, window=(7, 0)))
    assert notes == ("efficient: head dims zero-padded to 64/64", "efficient: K/V expanded from 4 to 16 heads (a copy)",
                     "efficient: causal bottom-right mask, window_size 8")
    assert select(cuda_spec(head_dim=60, head_dim_v=60)).notes == ("flash: q/k/v head dims zero-padded to 64",)
