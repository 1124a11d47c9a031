"""jagged_sdpa.distributed with in-process ranks (threads in lockstep, local.run_local): every
rank's out, lse, dq, dk, dv against the single-process call (bitwise for Ulysses on the CPU
without KV replication) and the float64 reference, over the options of docs/api.md section 9."""

from __future__ import annotations

import pytest
import torch

from support.distributed_cases import Case, check, reference64, run_rank, single_process, tensors
from jagged_sdpa import distributed as jd
from jagged_sdpa.distributed.local import run_local

RAGGED = (23, 5, 61, 1, 0, 17, 40)
SHORT = (3, 0, 2, 1, 0, 9)        # sequences shorter than the world size, empty ones

CASES = [
    *[(3, Case(f"causal-{s}-{a}", RAGGED, hq=6, hkv=3, causal=True, strategy=s, algorithm=a))
      for s in ("auto", "contiguous", "zigzag", "documents") for a in ("allgather", "ulysses")],
    (2, Case("bidirectional-zigzag-ag", RAGGED, strategy="zigzag", algorithm="allgather")),
    (2, Case("bidirectional-zigzag-ul", RAGGED, strategy="zigzag", algorithm="ulysses")),
    (4, Case("window-softcap-alibi-ag", RAGGED, causal=True, window_size=(8, 0), softcap=3.0, alibi="heads",
             strategy="zigzag", algorithm="allgather", hkv=4)),
    (4, Case("window-softcap-alibi-ul", RAGGED, causal=True, window_size=(8, 0), softcap=3.0, alibi="heads",
             strategy="zigzag", algorithm="ulysses", hkv=4)),
    (3, Case("bidir-window-ag", RAGGED, window_size=(5, 7), strategy="contiguous", algorithm="allgather")),
    (3, Case("bidir-right-only-ag", RAGGED, window_size=(-1, 3), strategy="zigzag", algorithm="allgather")),
    (3, Case("bidir-left-only-ag", RAGGED, window_size=(4, -1), strategy="zigzag", algorithm="allgather")),
    (2, Case("bidir-window-ul", RAGGED, window_size=(5, 7), strategy="contiguous", algorithm="ulysses")),
    (2, Case("alibi-batch-causal-ag", RAGGED, causal=True, alibi="batch", strategy="zigzag", algorithm="allgather")),
    (2, Case("alibi-batch-causal-ul", RAGGED, causal=True, alibi="batch", strategy="zigzag", algorithm="ulysses")),
    (3, Case("alibi-bidir-documents-ag", RAGGED, alibi="batch", strategy="documents", algorithm="allgather")),
    (3, Case("alibi-bidir-auto-picks-ulysses", RAGGED, alibi="heads", hq=6, hkv=3, strategy="zigzag")),
    (4, Case("mqa-ag", RAGGED, hq=4, hkv=1, causal=True, algorithm="allgather", strategy="zigzag")),
    (4, Case("mqa-ul-replicated", RAGGED, hq=4, hkv=1, causal=True, algorithm="ulysses", strategy="zigzag")),
    (2, Case("gqa-straddling-ul", RAGGED, hq=6, hkv=3, causal=True, algorithm="ulysses")),
    (4, Case("heads-not-divisible-auto", RAGGED, hq=6, hkv=2, causal=True)),
    (3, Case("dv-ne-d", RAGGED, d=16, dv=24, hkv=1, causal=True, strategy="zigzag")),
    (3, Case("dv-ne-d-ul", RAGGED, d=16, dv=24, hq=6, hkv=3, causal=True, algorithm="ulysses")),
    (3, Case("bf16-ag", RAGGED, dtype=torch.bfloat16, causal=True, strategy="zigzag", algorithm="allgather", hkv=1)),
    (3, Case("bf16-ul", RAGGED, dtype=torch.bfloat16, hq=6, hkv=3, causal=True, algorithm="ulysses")),
    (2, Case("fp16-ag", RAGGED, dtype=torch.float16, window_size=(9, 2), algorithm="allgather")),
    (2, Case("float64-ag", RAGGED, dtype=torch.float64, causal=True, strategy="zigzag", algorithm="allgather")),
    (4, Case("short-ag", SHORT, causal=True, strategy="zigzag", algorithm="allgather", hkv=4)),
    (4, Case("short-ul", SHORT, causal=True, strategy="zigzag", algorithm="ulysses", hkv=4)),
    (4, Case("short-contiguous-bidir-ag", SHORT, strategy="contiguous", algorithm="allgather")),
    (2, Case("all-empty", (0, 0), causal=True)),
    (1, Case("world-1", RAGGED, causal=True, window_size=(6, 0))),
    (2, Case("scale-no-grad", RAGGED, causal=True, softmax_scale=0.3, grad=False, algorithm="allgather")),
    (3, Case("one-long-sequence", (97,), causal=True, strategy="contiguous", algorithm="allgather")),
]


def bitwise(case: Case, world_size: int, chosen: str) -> bool:
    """Ulysses on the CPU runs each head exactly as the single call, unless KV heads are replicated."""
    return chosen == "ulysses" and case.hkv % world_size == 0 and case.dtype != torch.float64


@pytest.mark.parametrize("world_size,case", CASES, ids=[f"W{w}-{c.name}" for w, c in CASES])
def test_matches_single_process(world_size, case):
    t = tensors(case)
    single, ref = single_process(case, t), reference64(case, t)
    plan = jd.plan_shards(t["cu"], world_size, strategy=case.strategy, causal=case.causal,
                          window_size=case.window_size)
    q, k, v = (plan.shard(t[n], 0) for n in "qkv")
    chosen = jd.explain(plan, q, k, v, algorithm=case.algorithm, return_lse=True, **case.kwargs(t)).chosen
    results = run_local(lambda comm: run_rank(jd, plan, comm.rank, comm, case, t), world_size)
    for rank, got in enumerate(results):
        if isinstance(got, BaseException):
            raise got
        check(plan, rank, case, got, single, ref, bitwise=bitwise(case, world_size, chosen))
    if case.name == "alibi-bidir-auto-picks-ulysses" or case.name == "heads-not-divisible-auto":
        assert chosen == ("ulysses" if "ulysses" in case.name else "allgather")


@pytest.mark.parametrize("algorithm", ["allgather", "ulysses"])
def test_views_of_a_fused_qkv_and_no_lse(algorithm):
    """Local q, k, v sliced out of one fused projection (strided views) work, and return_lse=False
    returns the same out as return_lse=True."""
    case = Case("fused", RAGGED, hq=4, hkv=2, causal=True, window_size=(9, 0), strategy="zigzag", algorithm=algorithm)
    t = tensors(case)
    single = single_process(case, t)
    plan = jd.plan_shards(t["cu"], 2, strategy="zigzag", causal=True)

    def body(comm):
        q, k, v = (plan.shard(t[n], comm.rank) for n in "qkv")
        fused = torch.cat([q, k, v], dim=1).requires_grad_()          # (n, Hq + 2 Hkv, D)
        ql, kl, vl = fused[:, :4], fused[:, 4:6], fused[:, 6:]
        out = jd.varlen_attention(ql, kl, vl, plan, comm, algorithm=algorithm, causal=True, window_size=(9, 0))
        out.backward(plan.shard(t["grad_out"], comm.rank))
        with_lse, _ = jd.varlen_attention(ql, kl, vl, plan, comm, algorithm=algorithm, causal=True,
                                          window_size=(9, 0), return_lse=True)
        return out.detach(), with_lse.detach(), fused.grad

    for rank, result in enumerate(run_local(body, 2)):
        if isinstance(result, BaseException):
            raise result
        out, with_lse, grad = result
        rows = torch.as_tensor(plan.rows(rank))
        assert torch.equal(out, with_lse)
        torch.testing.assert_close(out, single["out"][rows], atol=1e-5, rtol=1e-5)
        expected = torch.cat([single["dq"][rows], single["dk"][rows], single["dv"][rows]], dim=1)
        torch.testing.assert_close(grad, expected, atol=1e-4, rtol=1e-4)
