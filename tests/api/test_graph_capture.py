"""CUDA-graph capture and replay, modelled on the CPU.

A captured call replays its kernels on the buffers it read while being captured, and nothing else
runs: no host code, so no checks a later eager call would make. The contract (docs/api.md sections 10
and 12): a call made without a host read (an accelerator given its max lengths) hands its backend
the caller's metadata tensors themselves (``varlen_attention``) or the plan's own buffers, which
``update`` refills in place (``plan.run``); and its device-side checks are queued on those tensors
at every call made while capturing, so that each replay runs them on what the buffers then hold.

Here the machine has no GPU: ``layout.host_read_needed`` is patched to answer as on an accelerator
(nothing read) and ``batch.capturing`` to say a capture is under way; a recording backend keeps
the call each forward receives, and ``DeviceChecks.queue`` records the tensors it checks.
"""

from __future__ import annotations

import pytest
import torch

import jagged_sdpa
from jagged_sdpa import batch as batches
from jagged_sdpa import layout
from jagged_sdpa.backends.math import MathBackend
from jagged_sdpa.checks.device import DeviceChecks
from support.reference import attention_reference
from support.tolerances import assert_close_packed


@pytest.fixture
def capture(monkeypatch):
    """(calls the backend received, tensors the queued device checks read); capturing on."""
    monkeypatch.setattr(layout, "host_read_needed", lambda device, *given: any(m is None for m in given))
    monkeypatch.setattr(batches, "capturing", lambda t: True)
    calls, checked = [], []
    real_forward = MathBackend.forward.__func__
    monkeypatch.setattr(MathBackend, "forward", classmethod(lambda cls, call: calls.append(call) or
                                                            real_forward(cls, call)))
    real_queue = DeviceChecks.queue

    def queue(self):
        checked.append([c[1] for c in self.cu] + [c[1] for c in self.lengths] + [c[0] for c in self.block_ids])
        real_queue(self)

    monkeypatch.setattr(DeviceChecks, "queue", queue)
    batches.clear_cache()
    yield calls, checked
    batches.clear_cache()


def _dense_case(seed=0, B=3, S=24):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, 2, S, 16, generator=g).transpose(1, 2)
    v = torch.randn(B, 2, S, 16, generator=g).transpose(1, 2)
    q = torch.randn(B, 4, 16, generator=g)
    return q, k, v, torch.arange(B + 1, dtype=torch.int32)


def _reference(q, k, v, starts, used):
    ks = torch.cat([k[b, s:s + n] for b, (s, n) in enumerate(zip(starts, used))])
    vs = torch.cat([v[b, s:s + n] for b, (s, n) in enumerate(zip(starts, used))])
    cu_k = [0]
    for n in used:
        cu_k.append(cu_k[-1] + n)
    return attention_reference(q, ks, vs, list(range(len(used) + 1)), cu_k, causal=True, alignment="bottom_right")[0]


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_captured_varlen_call_reads_the_callers_metadata_and_checks_it_every_time(capture):
    calls, checked = capture
    q, k, v, cu_q = _dense_case()
    used = torch.tensor([5, 9, 2], dtype=torch.int32)
    starts = torch.tensor([3, 0, 10], dtype=torch.int32)
    for _ in range(3):  # warm-up, then two captured calls over the same geometry
        out = jagged_sdpa.varlen_attention(q, k, v, cu_q, None, 1, 24, seqused_k=used, cache_leftpad=starts,
                                           causal=True, backend="math")
    assert all(_same_buffer(c.seqused_k, used) and _same_buffer(c.cache_leftpad, starts)
               and _same_buffer(c.cu_seqlens_q, cu_q) for c in calls)
    assert len(checked) == 3, "the device checks must be queued at every captured call"
    assert all(any(_same_buffer(t, used) for t in tensors) for tensors in checked)
    assert_close_packed(out, _reference(q, k, v, [3, 0, 10], [5, 9, 2]), cu_seqlens=[0, 1, 2, 3])
    # what a replay after ``seqused_k.copy_()`` reads: the new lengths, in the buffers captured
    used.copy_(torch.tensor([6, 10, 3], dtype=torch.int32))
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, None, 1, 24, seqused_k=used, cache_leftpad=starts,
                                       causal=True, backend="math")
    assert _same_buffer(calls[-1].seqused_k, used)
    assert_close_packed(out, _reference(q, k, v, [3, 0, 10], [6, 10, 3]), cu_seqlens=[0, 1, 2, 3])


def test_captured_plan_run_reads_the_buffers_update_refills(capture):
    calls, checked = capture
    q, k, v, cu_q = _dense_case(seed=1)
    p = jagged_sdpa.plan(cu_q, None, 1, 24, seqused_k=torch.tensor([5, 9, 2], dtype=torch.int32),
                         cache_leftpad=torch.tensor([3, 0, 10], dtype=torch.int32), causal=True, backend="math")
    p.run(q, k, v)
    p.run(q, k, v)  # captured
    captured = calls[-1]
    assert len(checked) == 2
    p.update(cu_q, None, 1, 24, seqused_k=torch.tensor([6, 10, 3], dtype=torch.int32),
             cache_leftpad=torch.tensor([2, 0, 9], dtype=torch.int32))
    # a replay reads the captured buffers: they now hold the update
    assert captured.seqused_k.tolist() == [6, 10, 3] and captured.cache_leftpad.tolist() == [2, 0, 9]
    out = p.run(q, k, v)
    assert _same_buffer(calls[-1].seqused_k, captured.seqused_k)
    assert_close_packed(out, _reference(q, k, v, [2, 0, 9], [6, 10, 3]), cu_seqlens=[0, 1, 2, 3])


def test_update_keeps_separate_offset_buffers_and_refuses_splitting_shared_ones(capture):
    calls, _ = capture
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(8, 2, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    separate = jagged_sdpa.plan(cu, cu.clone(), 5, 5, causal=True, backend="math")
    separate.run(q, k, v)
    cu_q_buf, cu_k_buf = calls[-1].cu_seqlens_q, calls[-1].cu_seqlens_k
    one = torch.tensor([0, 4, 8], dtype=torch.int32)
    separate.update(one, one, 5, 5)  # one tensor for both now: both buffers refilled, none replaced
    separate.run(q, k, v)
    assert calls[-1].cu_seqlens_q is cu_q_buf and calls[-1].cu_seqlens_k is cu_k_buf
    assert cu_k_buf.tolist() == [0, 4, 8]
    shared = jagged_sdpa.plan(cu, cu, 5, 5, causal=True, backend="math")
    with pytest.raises(ValueError, match="one tensor for cu_seqlens_q and cu_seqlens_k"):
        shared.update(one, one.clone(), 5, 5)
