"""Bad plans and mismatched inputs raise ValueError/TypeError naming the argument on every rank,
without hanging (in-process ranks; the gloo test repeats the main ones across processes), and
``explain`` says what runs and why the other algorithm does not."""

from __future__ import annotations

import pytest
import torch

from jagged_sdpa import NoBackendError
from jagged_sdpa import distributed as jd
from jagged_sdpa.distributed.local import run_local

LENGTHS = [23, 5, 61, 1, 0, 17]


def shards(plan, rank, hq=4, hkv=2, d=8, dv=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    n = plan.total
    q, k, v = torch.randn(n, hq, d, generator=gen), torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, dv, generator=gen)
    return [plan.shard(t, rank).to(dtype) for t in (q, k, v)]


def every_rank_raises(world_size, call, kind, match):
    results = run_local(call, world_size, timeout=30)
    for rank, result in enumerate(results):
        assert isinstance(result, kind), f"rank {rank} returned {result!r}, expected {kind.__name__}"
        assert match in str(result), f"rank {rank}: {result}"


def test_plan_for_another_world_size():
    plan = jd.plan_shards(LENGTHS, 3)

    def call(comm):
        return jd.varlen_attention(*shards(plan, comm.rank), plan, comm)
    every_rank_raises(2, call, ValueError, "plan")


def test_one_rank_with_wrong_row_count():
    plan = jd.plan_shards(LENGTHS, 3)

    def call(comm):
        q, k, v = shards(plan, comm.rank)
        if comm.rank == 1:
            q = q[:-1]
        return jd.varlen_attention(q, k, v, plan, comm)
    every_rank_raises(3, call, ValueError, "q_local")


def test_one_rank_with_another_dtype():
    plan = jd.plan_shards(LENGTHS, 2)

    def call(comm):
        q, k, v = shards(plan, comm.rank)
        if comm.rank == 0:
            k = k.double()
        return jd.varlen_attention(q, k, v, plan, comm)
    every_rank_raises(2, call, TypeError, "k_local")


def test_one_rank_with_other_options():
    plan = jd.plan_shards(LENGTHS, 3)

    def call(comm):
        return jd.varlen_attention(*shards(plan, comm.rank), plan, comm, causal=comm.rank == 2)
    every_rank_raises(3, call, ValueError, "options")


def test_one_rank_with_another_plan():
    plans = [jd.plan_shards(LENGTHS, 2, strategy=s) for s in ("zigzag", "contiguous")]

    def call(comm):
        plan = plans[comm.rank]
        q, k, v = shards(plans[0], comm.rank)[0], *shards(plans[0], comm.rank)[1:]
        if plan.tokens[comm.rank] != q.shape[0]:
            q, k, v = shards(plan, comm.rank)
        return jd.varlen_attention(q, k, v, plan, comm)
    every_rank_raises(2, call, ValueError, "plan")


def test_one_rank_needing_grad_when_others_do_not():
    plan = jd.plan_shards(LENGTHS, 2)

    def call(comm):
        q, k, v = shards(plan, comm.rank)
        return jd.varlen_attention(q, k.requires_grad_(comm.rank == 0), v, plan, comm)
    every_rank_raises(2, call, ValueError, "k_local")


@pytest.mark.parametrize("kwargs,kind,match", [
    (dict(dropout_p=0.1), ValueError, "dropout_p"),
    (dict(algorithm="ring"), ValueError, "algorithm"),
    (dict(window_size=(3,)), TypeError, "window_size"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes"),
    (dict(return_lse=1), TypeError, "return_lse"),
    (dict(backend="nope"), ValueError, "backend"),
    (dict(algorithm="ulysses", alibi_slopes=None), ValueError, "query heads divisible"),
    (dict(algorithm="allgather", alibi_slopes=torch.ones(4)), ValueError, "ALiBi"),
])
def test_bad_options_raise_on_every_rank(kwargs, kind, match):
    plan = jd.plan_shards(LENGTHS, 3, strategy="zigzag")

    def call(comm):
        return jd.varlen_attention(*shards(plan, comm.rank), plan, comm, **kwargs)
    every_rank_raises(3, call, kind, match)


def test_bad_tensors_raise_on_every_rank():
    plan = jd.plan_shards(LENGTHS, 2)
    for mutate, kind, match in [
        (lambda q, k, v: (q, k, "v"), TypeError, "v_local"),
        (lambda q, k, v: (q[:, 0], k, v), ValueError, "q_local"),
        (lambda q, k, v: (q, k[..., :4], v), ValueError, "k_local"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, "multiple of KV heads"),
        (lambda q, k, v: (q.int(), k, v), TypeError, "q_local"),
    ]:
        def call(comm):
            q, k, v = shards(plan, comm.rank)
            if comm.rank == 0:
                q, k, v = mutate(q, k, v)
            return jd.varlen_attention(q, k, v, plan, comm)
        every_rank_raises(2, call, kind, match)


def test_no_backend_raises_no_backend_error_everywhere():
    plan = jd.plan_shards(LENGTHS, 2)

    def call(comm):
        return jd.varlen_attention(*shards(plan, comm.rank), plan, comm, backend="flash_varlen")
    every_rank_raises(2, call, NoBackendError, "flash_varlen")


def test_plan_argument_must_be_a_plan():
    def call(comm):
        plan = jd.plan_shards(LENGTHS, 2)
        return jd.varlen_attention(*shards(plan, comm.rank), plan.runs, comm)
    every_rank_raises(2, call, TypeError, "plan")


def test_varlen_attention_without_process_group():
    plan = jd.plan_shards(LENGTHS, 1)
    with pytest.raises(ValueError, match="group"):
        jd.varlen_attention(*shards(plan, 0), plan)


def test_explain_prints_work_bytes_and_reasons():
    plan = jd.plan_shards(LENGTHS, 3, strategy="zigzag", causal=True)
    q, k, v = shards(plan, 0)
    e = jd.explain(plan, q, k, v, causal=True)
    assert e.chosen == "allgather"
    assert e.reasons["ulysses"].startswith("needs the query heads divisible")
    text = str(e)
    for word in ("allgather", "ulysses", "MB moved", "max/mean pairs", "chosen: allgather", "cpu_fused"):
        assert word in text, text
    assert e.estimates["allgather"].total_bytes > 0
    e = jd.explain(plan, *shards(plan, 0, hq=6, hkv=3), alibi_slopes=torch.ones(6) * 0.1)
    assert e.chosen == "ulysses" and "ALiBi" in e.reasons["allgather"]


def test_auto_prefers_the_algorithm_that_moves_less():
    """Whole-document plans move no keys: allgather costs nothing to communicate there."""
    plan = jd.plan_shards([40, 40, 40, 40], 2, strategy="documents", causal=True)
    e = jd.explain(plan, *shards(plan, 0, hq=4, hkv=2), causal=True)
    assert e.estimates["allgather"].total_bytes == 0 < e.estimates["ulysses"].total_bytes
    assert e.chosen == "allgather"
