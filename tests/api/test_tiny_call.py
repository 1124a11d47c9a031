"""The per-call fast paths of a tiny call (a few short sequences, where host overhead dominates), each checked against the slow path it replaces.

Cheap NJT size reads (``layout.tensor_size``), the direct NJT output constructor
(``layout.packed_to_njt``): the fast path must give the same object or the same numbers as the
public path, and a call whose offsets changed in place is read and validated again.
"""

from __future__ import annotations

import pytest
import torch

import jagged_sdpa
from jagged_sdpa import layout
from support.cases import cu_of, njt
from support.reference import attention_reference
from support.tolerances import assert_close_packed

TINY_LENGTHS = [6, 8, 10, 7]


def njt_on(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)


def packed_of(x):
    parts = [t.transpose(0, 1) for t in x.unbind()]
    return torch.cat(parts), [p.shape[0] for p in parts]


def reference_of(q, k, v, **kw):
    (qp, lq), (kp, lk), (vp, _) = packed_of(q), packed_of(k), packed_of(v)
    out, lse = attention_reference(qp, kp, vp, cu_of(lq), cu_of(lk), **kw)
    return out, lse, lq


# ----------------------------------------------------------------------------------------------
# sizes


def test_tensor_size_equals_shape_for_every_kind_of_njt():
    x = torch.nested.nested_tensor([torch.randn(n, 3 * 2 * 8) for n in (4, 9)], layout=torch.jagged)
    chunks = [t.unflatten(-1, (2, 8)).transpose(1, 2) for t in x.chunk(3, dim=-1)]
    holes = torch.nested.narrow(torch.randn(2, 6, 8), 1, torch.tensor([0, 2]), torch.tensor([3, 4]),
                                layout=torch.jagged)
    for t in [njt([3, 0, 5], 4, 8), njt([3], 1, 2).transpose(1, 2), *chunks, holes, torch.randn(2, 3, 4)]:
        assert layout.tensor_size(t) == tuple(t.shape)


# ----------------------------------------------------------------------------------------------
# output NJT


def test_direct_njt_works_on_this_torch():
    """A silent fallback would hide a 7x slower output path: this torch must take the direct one."""
    assert layout.direct_njt_works()


@pytest.mark.parametrize("min_max", [(None, None), (2, 7)], ids=["no_cache", "cached_seqlens"])
def test_direct_output_njt_is_identical_to_public_path(min_max):
    offsets = torch.tensor([0, 2, 9, 9, 12])
    out = torch.randn(12, 3, 5)
    direct = layout._direct_njt(out, offsets, *min_max)
    public = layout._public_njt(out, offsets, *min_max)
    assert layout.njt_description(direct) == layout.njt_description(public)
    assert direct.shape == public.shape and direct.stride() == public.stride()
    assert direct.offsets() is offsets and direct._values.data_ptr() == out.data_ptr()
    assert (direct._maybe_min_seqlen, direct._maybe_max_seqlen) == min_max
    for a, b in zip(direct.unbind(), public.unbind()):
        assert torch.equal(a, b)


def test_sdpa_output_shares_query_nested_int_on_both_paths(monkeypatch):
    values = torch.randn(sum(TINY_LENGTHS), 2, 16)
    q = njt_on(values, cu_of(TINY_LENGTHS).long())
    fast = jagged_sdpa.sdpa(q, q, q)
    monkeypatch.setattr(layout, "direct_njt_works", lambda: False)
    slow = jagged_sdpa.sdpa(q, q, q)
    for out in (fast, slow):
        assert out.shape == q.shape and out.shape[2] is q.shape[2]  # the same nested int
        assert out.offsets() is q.offsets()
        assert out._maybe_max_seqlen == 10
        (out + q).sum()  # composes with the query: same ragged structure
    a, b = layout.njt_description(fast), layout.njt_description(slow)
    assert a[:9] + a[10:] == b[:9] + b[10:]  # all but the values' address (two results)
    assert torch.equal(fast._values, slow._values) and fast.stride() == slow.stride()


def test_output_needing_grad_takes_the_differentiable_path():
    leaf = torch.nested.nested_tensor([torch.randn(n, 2, 16) for n in TINY_LENGTHS], layout=torch.jagged,
                                      requires_grad=True)
    q = leaf.transpose(1, 2)
    out = jagged_sdpa.sdpa(q, q, q)
    assert out.requires_grad and out.grad_fn is not None
    out.values().sum().backward()
    assert leaf.grad is not None and leaf.grad.values().abs().sum() > 0


def test_tiny_call_matches_reference_top_left_causal():
    q, k, v = (njt(TINY_LENGTHS, 2, 16) for _ in range(3))
    k, v = (njt_on(t.transpose(1, 2).values(), q.offsets()) for t in (k, v))
    out = jagged_sdpa.sdpa(q, k, v, is_causal=True)
    ref, _, lq = reference_of(q, k, v, causal=True, alignment="top_left")
    assert_close_packed(packed_of(out)[0], ref, cu_seqlens=cu_of(lq))


# ----------------------------------------------------------------------------------------------
# offsets changed in place: read and validated again


def test_mutated_offsets_are_validated_again():
    values = torch.randn(sum(TINY_LENGTHS), 2, 16)
    offsets = cu_of(TINY_LENGTHS).long()
    q = njt_on(values, offsets)
    jagged_sdpa.sdpa(q, q, q)
    offsets[2] = 3  # now decreasing: 0, 6, 3, ...
    with pytest.raises(ValueError, match="non-decreasing"):
        jagged_sdpa.sdpa(q, q, q)
    offsets[2] = 40  # past the values' end
    with pytest.raises(ValueError, match="query.offsets"):
        jagged_sdpa.sdpa(q, q, q)


def test_mutated_offsets_give_the_new_lengths_results():
    """Same tensors, offsets changed in place to other valid lengths: the new lengths are used."""
    values = torch.randn(sum(TINY_LENGTHS), 2, 16)
    offsets = cu_of(TINY_LENGTHS).long()
    q = njt_on(values, offsets)
    first = jagged_sdpa.sdpa(q, q, q, is_causal=True)._values.clone()
    offsets.copy_(cu_of([9, 5, 10, 7]).long())
    second = jagged_sdpa.sdpa(q, q, q, is_causal=True)
    ref, _ = attention_reference(values, values, values, cu_of([9, 5, 10, 7]), cu_of([9, 5, 10, 7]), causal=True)
    assert_close_packed(second._values.transpose(0, 1), ref, cu_seqlens=cu_of([9, 5, 10, 7]))
    assert not torch.equal(first, second._values)
