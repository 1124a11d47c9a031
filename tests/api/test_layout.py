"""NJT <-> packed: views, not copies, wherever strides allow; offsets identity; one host read."""

from __future__ import annotations

import pytest
import torch

import jagged_sdpa
from jagged_sdpa import layout
from jagged_sdpa.checks.device import DeviceChecks
from support.described_call import prepare_sdpa, prepare_varlen
from support.cases import cu_of, njt, packed



def test_contiguous_njt_is_packed_as_a_view():
    q = njt([3, 0, 5], 4, 8)
    call, _, notes = prepare_sdpa(q, q, q)
    base = q.transpose(1, 2).values()
    assert call.q.data_ptr() == base.data_ptr() and call.q.shape == (8, 4, 8) and call.q.is_contiguous()
    assert call.cu_q_host == (0, 3, 3, 8) and call.spec.has_empty_q and call.spec.max_seqlen_q == 5
    assert notes == ()


def test_fused_qkv_chunks_are_strided_views():
    x = torch.nested.nested_tensor([torch.randn(n, 3 * 2 * 8) for n in (4, 9)], layout=torch.jagged)
    q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in x.chunk(3, dim=-1))
    call, _, _ = prepare_sdpa(q, k, v)
    buf = x.values()
    assert call.q.data_ptr() == buf.data_ptr()
    assert call.k.data_ptr() == buf.data_ptr() + 16 * buf.element_size()
    assert call.q.stride() == (48, 8, 1)


def test_view_kept_when_grad_needed():
    leaf = torch.nested.nested_tensor([torch.randn(3, 2, 4), torch.randn(5, 2, 4)], layout=torch.jagged,
                                      requires_grad=True)
    q = leaf.transpose(1, 2)
    call, _, _ = prepare_sdpa(q, q, q)
    assert call.q.requires_grad and call.q.data_ptr() == leaf.values().data_ptr()


def test_dense_kv_becomes_packed_with_uniform_offsets():
    q = njt([2, 3], 2, 4)
    k = torch.randn(2, 2, 5, 4)
    call, _, notes = prepare_sdpa(q, k, k)
    assert call.k.shape == (10, 2, 4)
    assert torch.equal(call.cu_seqlens_k, cu_of([5, 5]))
    torch.testing.assert_close(call.k[5:10], k[1].transpose(0, 1))
    assert call.spec.kv_dense and any("dense key/value" in n for n in notes)


def test_output_round_trip_shares_offsets():
    q = njt([4, 1, 6], 2, 8)
    out = jagged_sdpa.sdpa(q, q, q)
    assert out.transpose(1, 2).offsets() is q.transpose(1, 2).offsets()
    assert [t.shape for t in out.unbind()] == [t.shape for t in q.unbind()]


def test_one_host_read_per_cpu_call(monkeypatch):
    calls = []
    original = layout.read_host

    def counting(*tensors):
        calls.append(len(tensors))
        return original(*tensors)

    monkeypatch.setattr(layout, "read_host", counting)
    q, k = packed([3, 4], 2, 8), packed([5, 1], 2, 8)
    jagged_sdpa.varlen_attention(q, k, k, cu_of([3, 4]), cu_of([5, 1]), causal=True)
    assert calls == [2]  # cu_seqlens_q and cu_seqlens_k in one transfer
    calls.clear()
    x = njt([3, 4], 2, 8)
    jagged_sdpa.sdpa(x, njt([2, 2], 2, 8), njt([2, 2], 2, 8))
    assert len(calls) == 1


def test_no_host_read_on_accelerator_with_max_lengths(monkeypatch):
    """On a non-CPU device with max lengths given nothing is read: meta tensors cannot be read."""
    monkeypatch.setattr(layout, "read_host", lambda *t: (_ for _ in ()).throw(AssertionError("host read")))
    q = torch.empty(7, 2, 8, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    call, _, _ = prepare_varlen(q, q, q, cu, cu, 4, 4, causal=True)
    assert call.spec.max_seqlen_q == 4 and not call.spec.lengths_known and call.spec.has_empty_k


def test_output_of_a_query_with_holes_shares_its_structure():
    """Like dense SDPA, the output has the query's structure: its offsets, lengths and nested int
    (holes hold zeros), so it composes with the query (e.g. a residual add)."""
    values = torch.randn(10, 2, 4)
    q = torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, 4, 8]),
                                               lengths=torch.tensor([2, 2])).transpose(1, 2)
    out = jagged_sdpa.sdpa(q, q, q)
    assert out.offsets() is q.offsets() and out.lengths() is q.lengths() and out.shape == q.shape
    assert [t.shape[1] for t in out.unbind()] == [2, 2]
    assert (q + out).shape == q.shape
    values_out = out.transpose(1, 2).values()
    assert values_out.shape == values.shape and not values_out[[2, 3, 6, 7]].any()


def _queue(kind, *args):
    checks = DeviceChecks()
    getattr(checks, kind)(*args)
    checks.queue()


def test_device_side_checks_catch_what_the_host_read_would():
    """Without a host read (accelerator + max lengths) the same checks are queued on the device;
    on CPU tensors torch._assert_async raises at once, which lets us test them here."""
    good = cu_of([3, 5])
    _queue("add_cu", "cu_seqlens_q", good, 8, 5, "max_seqlen_q")
    for bad, total, max_len in ((cu_of([3, 6]), 8, 6), (good, 8, 4), (torch.tensor([1, 3, 8], dtype=torch.int32), 8, 5),
                                (torch.tensor([0, 5, 3, 8], dtype=torch.int32), 8, 5)):
        with pytest.raises(RuntimeError, match="bad cu_seqlens_q: offsets must start at 0"):
            _queue("add_cu", "cu_seqlens_q", bad, total, max_len, "max_seqlen_q")
    used = torch.tensor([4, 9], dtype=torch.int32)
    _queue("add_lengths", "seqused_k", used, cu_of([8, 16]), 9)
    _queue("add_lengths", "seqused_k", used, 9, 9)
    with pytest.raises(RuntimeError, match="bad seqused_k: .*lengths within capacity"):
        _queue("add_lengths", "seqused_k", used, cu_of([8, 8]), 9)
    with pytest.raises(RuntimeError, match="bad seqused_k: .*lengths within capacity"):
        _queue("add_lengths", "seqused_k", used, 8, 9)
    table = torch.tensor([[0, 1], [2, 7]], dtype=torch.int32)
    _queue("add_block_ids", table, torch.tensor([8, 4], dtype=torch.int32), 4, 4)  # [1, 1] unread
    with pytest.raises(RuntimeError, match="bad block_table: .*block ids in range"):
        _queue("add_block_ids", table, torch.tensor([8, 5], dtype=torch.int32), 4, 4)


def test_device_checks_queue_one_assert_for_the_whole_call():
    checks = DeviceChecks()
    cu = cu_of([3, 5])
    checks.add_cu("cu_seqlens_q", cu, 8, 5, "max_seqlen_q")
    checks.add_cu("cu_seqlens_k", cu, 8, 5, "max_seqlen_k")  # the same tensor and bounds: checked once
    checks.add_cu("cu_seqlens_k", cu_of([2, 2]), 4, 2, "max_seqlen_k")
    assert len(checks.cu) == 2
    checks.queue()
    checks.add_cu("query.offsets()", cu_of([1, 9]), 10, 8, "query's cached max seqlen")
    with pytest.raises(RuntimeError, match=r"bad cu_seqlens_q, cu_seqlens_k, query.offsets\(\):"):
        checks.queue()
    checks.add_lengths("seqused_k", torch.tensor([1], dtype=torch.int32), 4, 4)
    checks.add_block_ids(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 4, 1)
    assert len(checks.message()) < 255  # CUDA's torch._assert_async refuses longer messages


def test_no_read_path_with_seqused_k_builds_a_spec():
    q = torch.empty(7, 2, 8, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    used = torch.empty(2, dtype=torch.int32, device="meta")
    call, _, _ = prepare_varlen(q, q, q, cu, cu, 4, 3, causal=True, seqused_k=used)
    assert call.spec.max_seqlen_k == 3 and call.spec.seqused_k
