"""Host reads of lengths: how many a call makes, and that an accelerator call with max lengths makes none.

Policy (``layout.host_read_needed``): ``layout.read_host`` is the only function that reads lengths
on the host, once per call. On the CPU it always runs (a memory read, not a device sync) so
contents are always validated. On an accelerator with ``max_seqlen_q`` and ``max_seqlen_k`` given,
``varlen_attention`` reads nothing, so a decode step can be captured in a CUDA graph. The proof
without a GPU is by construction: ``meta`` tensors have no data and raise on any read, and the
preparation of a call on them (validation, spec, selection) goes through with zero reads.
``paged_append`` always reads once: refusing a bad append before writing needs the lengths.
"""

from __future__ import annotations

import pytest
import torch

from support.described_call import prepare_varlen

import jagged_sdpa
from jagged_sdpa import Backend, api, layout

META = torch.device("meta")


@pytest.fixture
def reads(monkeypatch):
    """Counts calls of ``layout.read_host`` (the real one still runs)."""
    calls = []
    real = layout.read_host

    def counting(*tensors):
        calls.append(tuple(t.device.type for t in tensors))
        return real(*tensors)

    monkeypatch.setattr(layout, "read_host", counting)
    return calls


def packed(device, lengths_q=(3, 1, 0, 5), lengths_k=(7, 4, 2, 5), heads=(4, 2), dim=16):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads[0], dim)
    k = torch.randn(int(cu_k[-1]), heads[1], dim)
    v = torch.randn(int(cu_k[-1]), heads[1], dim)
    return [t.to(device) for t in (q, k, v, cu_q, cu_k)], max(lengths_q), max(lengths_k)


def paged(device, lengths_q=(3, 1, 0, 1), used=(7, 4, 2, 0), block_size=4, width=3):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    batch = len(used)
    q = torch.randn(int(cu_q[-1]), 4, 16)
    k_cache = torch.randn(batch * width, block_size, 2, 16)
    v_cache = torch.randn(batch * width, block_size, 2, 16)
    table = torch.arange(batch * width, dtype=torch.int32).reshape(batch, width)
    seqused = torch.tensor(used, dtype=torch.int32)
    tensors = [t.to(device) for t in (q, k_cache, v_cache, cu_q, table, seqused)]
    return tensors, max(lengths_q), max(used)


def prepare_paged(q, k_cache, v_cache, cu_q, table, seqused, max_q, max_k):
    return prepare_varlen(q, k_cache, v_cache, cu_q, None, max_q, max_k, causal=True, block_table=table,
                          seqused_k=seqused)


def prepare_packed(q, k, v, cu_q, cu_k, max_q, max_k):
    return prepare_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)


def test_policy_reads_on_cpu_and_only_without_max_lengths_elsewhere():
    need = layout.host_read_needed
    assert need(torch.device("cpu"), 5, 7)
    assert not need(torch.device("cuda"), 5, 7)
    assert need(torch.device("cuda"), None, 7) and need(torch.device("cuda"), 5, None)
    assert not need(META, 0, 0)


# ----------------------------------------------------------------------------------------------
# accelerator path, by construction: meta tensors cannot be read


def test_meta_tensors_cannot_be_read():
    """The premise of the tests below: a read of a meta tensor raises (a ValueError saying what to
    pass) instead of returning data."""
    with pytest.raises(ValueError, match="meta tensors hold no lengths to read"):
        layout.read_host(torch.zeros(3, dtype=torch.int32, device=META))


def test_packed_call_with_max_lengths_reads_nothing(reads):
    tensors, max_q, max_k = packed(META)
    call, _, _ = prepare_packed(*tensors, max_q, max_k)
    assert reads == []
    assert not call.spec.lengths_known and call.cu_q_host is None and call.cu_k_host is None
    assert call.spec.max_seqlen_q == max_q and call.spec.max_seqlen_k == max_k
    assert call.spec.has_empty_q and call.spec.has_empty_k, "unknown emptiness must be assumed possible"


def test_paged_decode_call_with_max_lengths_reads_nothing(reads):
    tensors, max_q, max_k = paged(META, lengths_q=(1, 1, 1, 1))
    call, _, _ = prepare_paged(*tensors, 1, max_k)
    assert reads == []
    assert call.spec.paged and not call.spec.lengths_known and call.seqused_k_host is None


def test_paged_mixed_call_with_max_lengths_reads_nothing(reads):
    tensors, max_q, max_k = paged(META)
    call, _, _ = prepare_paged(*tensors, max_q, max_k)
    assert reads == [] and call.spec.max_seqlen_q == max_q


@pytest.mark.parametrize("missing", ["max_seqlen_q", "max_seqlen_k"])
def test_a_missing_max_length_costs_one_read(reads, missing):
    """Without either max the lengths must be read: on meta that read raises, proving it happens."""
    tensors, max_q, max_k = paged(META)
    maxes = {"max_seqlen_q": max_q, "max_seqlen_k": max_k, missing: None}
    with pytest.raises(ValueError, match="meta tensors hold no lengths to read"):
        prepare_paged(*tensors, maxes["max_seqlen_q"], maxes["max_seqlen_k"])
    assert len(reads) == 1


def test_explain_selects_on_meta_without_reading(reads):
    """Validation, spec and selection (the whole path before a kernel) run on tensors with no data."""
    tensors, max_q, max_k = paged(META)
    q, k_cache, v_cache, cu_q, table, seqused = tensors
    e = jagged_sdpa.explain(q, k_cache, v_cache, cu_q, None, max_q, max_k, block_table=table, seqused_k=seqused,
                            causal=True, return_lse=True)
    assert reads == []
    # meta is no device a kernel runs on: selection completes and says so, without reading.
    assert e.chosen is None and e.reasons[Backend.MATH][0].startswith("device meta not supported")
    assert not e.spec.lengths_known


def test_sdpa_with_njt_cached_max_reads_nothing(reads):
    values = torch.empty(9, 4, 16, device=META)
    offsets = torch.empty(4, dtype=torch.int64, device=META)
    njt = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=1, max_seqlen=5).transpose(1, 2)
    e = jagged_sdpa.explain(njt, njt, njt, is_causal=True)
    assert reads == [] and e.spec.max_seqlen_q == 5 and not e.spec.lengths_known


# ----------------------------------------------------------------------------------------------
# CPU: exactly one read per call, whatever the caller passes


@pytest.mark.parametrize("give_max", [True, False], ids=["max_given", "max_none"])
def test_cpu_packed_call_reads_once(reads, give_max):
    (q, k, v, cu_q, cu_k), max_q, max_k = packed("cpu")
    maxes = (max_q, max_k) if give_max else (None, None)
    jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, *maxes, causal=True)
    assert reads == [("cpu", "cpu")]


@pytest.mark.parametrize("give_max", [True, False], ids=["max_given", "max_none"])
def test_cpu_paged_call_reads_once(reads, give_max):
    (q, k_cache, v_cache, cu_q, table, seqused), max_q, max_k = paged("cpu")
    maxes = (max_q, max_k) if give_max else (None, None)
    jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_q, None, *maxes, block_table=table, seqused_k=seqused,
                                 causal=True, return_lse=True)
    assert reads == [("cpu", "cpu", "cpu")]


def test_cpu_read_validates_contents_even_with_max_lengths(reads):
    """On the CPU the read is always made, so bad contents are caught even when the maxes are given."""
    (q, k, v, cu_q, cu_k), max_q, max_k = packed("cpu")
    bad = cu_k.clone()
    bad[2] = bad[1] - 1
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        jagged_sdpa.varlen_attention(q, k, v, cu_q, bad, max_q, max_k)
    assert len(reads) == 1


def test_cpu_sdpa_call_reads_once(reads):
    q = torch.nested.nested_tensor([torch.randn(3, 4, 16), torch.randn(6, 4, 16)], layout=torch.jagged)
    jagged_sdpa.sdpa(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), is_causal=True)
    assert len(reads) == 1


def test_paged_append_reads_once(reads):
    (_, k_cache, v_cache, _, table, seqused), _, _ = paged("cpu", used=(1, 0, 2, 3))
    cu_new = torch.tensor([0, 2, 2, 3, 4], dtype=torch.int32)
    new = torch.randn(4, 2, 16)
    jagged_sdpa.paged_append(k_cache, v_cache, table, seqused, new, new, cu_new)
    assert reads == [("cpu", "cpu", "cpu")]


def test_paged_append_refuses_meta_tensors(reads):
    """The append must read its lengths to refuse bad ones before writing; meta tensors have none,
    and the operator's meta kernel would silently write nothing: refused before it runs."""
    (_, k_cache, v_cache, _, table, seqused), _, _ = paged(META)
    cu_new = torch.zeros(5, dtype=torch.int32, device=META)
    new = torch.empty(0, 2, 16, device=META)
    with pytest.raises(ValueError, match="meta tensors hold no lengths to read"):
        jagged_sdpa.paged_append(k_cache, v_cache, table, seqused, new, new, cu_new)
    assert reads == []


def test_a_serving_step_reads_twice_per_layer_on_cpu(reads):
    """One decode step of one layer: the append and the attention each read once, nothing else does."""
    (q, k_cache, v_cache, cu_q, table, seqused), _, _ = paged("cpu", lengths_q=(1, 1, 1, 1), used=(7, 4, 2, 0))
    cu_new = torch.arange(5, dtype=torch.int32)
    seqused = jagged_sdpa.paged_append(k_cache, v_cache, table, seqused, torch.randn(4, 2, 16),
                                       torch.randn(4, 2, 16), cu_new)
    jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_q, None, 1, 8, block_table=table, seqused_k=seqused,
                                 causal=True)
    assert len(reads) == 2


# ----------------------------------------------------------------------------------------------
# a real accelerator: CUDA's sync debug mode turns any sync into an error


@pytest.mark.cuda
@pytest.mark.parametrize("backend", [Backend.TRITON, Backend.FLASH_VARLEN], ids=str)
def test_cuda_paged_decode_makes_no_sync(backend):
    (q, k_cache, v_cache, cu_q, table, seqused), _, max_k = paged("cuda", lengths_q=(1, 1, 1, 1),
                                                                  block_size=16, width=2)
    q, k_cache, v_cache = (t.half() for t in (q, k_cache, v_cache))
    args = (q, k_cache, v_cache, cu_q, None, 1, 32)
    kwargs = dict(block_table=table, seqused_k=seqused, causal=True, backend=backend)
    reasons = jagged_sdpa.explain(*args, **kwargs).reasons[backend]
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    jagged_sdpa.varlen_attention(*args, **kwargs)  # warm-up: compilation may sync
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        jagged_sdpa.varlen_attention(*args, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
