"""Context-parallel test cases, shared by the in-process and the gloo tests (imports no
jagged_sdpa.distributed internals: only the public plan/call and the single-process call).

A case builds the global tensors from its seed, the single-process call with gradients, and the
float64 reference (tests/support/reference.py) with gradients; ``check`` compares one rank's results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import jagged_sdpa
from support.cases import cu_of
from support.reference import attention_reference
from support.tolerances import assert_close_lse, assert_close_packed


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple
    hq: int = 4
    hkv: int = 2
    d: int = 16
    dv: int = 16
    dtype: torch.dtype = torch.float32
    strategy: str = "auto"
    algorithm: str = "auto"
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: str = ""              # "", "heads" (Hq,) or "batch" (B, Hq)
    softmax_scale: float | None = None
    grad: bool = True
    seed: int = 0
    opts: dict = field(default_factory=dict, compare=False)

    def kwargs(self, tensors):
        return dict(causal=self.causal, window_size=self.window_size, softcap=self.softcap,
                    alibi_slopes=tensors["alibi"], softmax_scale=self.softmax_scale)


def tensors(case: Case) -> dict:
    gen = torch.Generator().manual_seed(case.seed)
    n = sum(case.lengths)
    q = torch.randn(n, case.hq, case.d, generator=gen).to(case.dtype)
    k = torch.randn(n, case.hkv, case.d, generator=gen).to(case.dtype)
    v = torch.randn(n, case.hkv, case.dv, generator=gen).to(case.dtype)
    grad_out = torch.randn(n, case.hq, case.dv, generator=gen).to(case.dtype)
    alibi = None
    if case.alibi == "heads":
        alibi = torch.rand(case.hq, generator=gen) * 0.5
    elif case.alibi == "batch":
        alibi = torch.rand(len(case.lengths), case.hq, generator=gen) * 0.5
    return dict(q=q, k=k, v=v, grad_out=grad_out, alibi=alibi, cu=cu_of(case.lengths))


def single_process(case: Case, t: dict) -> dict:
    """The single-process call on the whole batch (what every rank's rows must equal)."""
    q, k, v = (t[n].clone().requires_grad_(case.grad) for n in "qkv")
    out, lse = jagged_sdpa.varlen_attention(q, k, v, t["cu"], t["cu"], return_lse=True, **case.kwargs(t))
    result = dict(out=out.detach(), lse=lse)
    if case.grad:
        out.backward(t["grad_out"])
        result.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return result


def reference64(case: Case, t: dict) -> dict:
    q, k, v = (t[n].double().clone().requires_grad_(case.grad) for n in "qkv")
    out, lse = attention_reference(q, k, v, t["cu"], t["cu"], scale=case.softmax_scale, causal=case.causal,
                                   alignment="bottom_right", window=case.window_size, softcap=case.softcap,
                                   alibi_slopes=t["alibi"])
    result = dict(out=out.detach(), lse=lse.detach())
    if case.grad and out.requires_grad:
        out.backward(t["grad_out"].double())
        result.update(dq=q.grad, dk=k.grad, dv=v.grad)
    elif case.grad:  # no tokens at all: nothing to differentiate
        result.update(dq=torch.zeros_like(q), dk=torch.zeros_like(k), dv=torch.zeros_like(v))
    return result


def rank_inputs(plan, rank, case: Case, t: dict):
    return [plan.shard(t[n], rank).requires_grad_(case.grad) for n in "qkv"]


def run_rank(jd, plan, rank, group, case: Case, t: dict) -> dict:
    """This rank's distributed call, with the backward of its rows of the shared grad_out."""
    q, k, v = rank_inputs(plan, rank, case, t)
    out, lse = jd.varlen_attention(q, k, v, plan, group, algorithm=case.algorithm, return_lse=True,
                                   **case.kwargs(t))
    result = dict(out=out.detach(), lse=lse)
    if case.grad:
        out.backward(plan.shard(t["grad_out"], rank))
        result.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return result


def check(plan, rank, case: Case, got: dict, single: dict, ref: dict, *, bitwise: bool):
    """Rank's rows equal the single call's: bitwise, or within the float64-reference tolerance
    (widened, as everywhere in the suite, by the single call's own error: lowp_ref)."""
    rows = torch.as_tensor(plan.rows(rank))
    local_cu = [0, sum(e - s for _, s, e in plan.runs[rank])]
    names = ["out", "lse"] + (["dq", "dk", "dv"] if case.grad else [])
    for name in names:
        mine = single[name].index_select(1 if name == "lse" else 0, rows)
        if bitwise or mine.numel() == 0:
            assert torch.equal(got[name], mine), f"{case.name} rank {rank}: {name} not bitwise equal"
            continue
        expected = ref[name].index_select(1 if name == "lse" else 0, rows)
        if name == "lse":
            assert_close_lse(got[name], expected, name=f"{case.name} rank {rank} lse")
        else:
            assert_close_packed(got[name], expected, cu_seqlens=local_cu, name=f"{case.name} rank {rank} {name}",
                                grad=name != "out", lowp_ref=mine)
