"""``jd.varlen_attention`` and ``jd.explain``: validate locally, agree collectively, pick an
algorithm by the cost model, run it. Every input error is found before any data moves and is
raised on every rank (agree.py), so a bad call fails everywhere instead of hanging.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from jagged_sdpa.distributed import allgather, cost, ulysses
from jagged_sdpa.distributed.agree import agree, digest
from jagged_sdpa.distributed.comm import Comm, header_device, resolve
from jagged_sdpa.distributed.shards import ShardPlan, _validate_window
from jagged_sdpa.errors import NoBackendError

ALGORITHMS = ("auto", "allgather", "ulysses")
_IMPLS = {"allgather": allgather, "ulysses": ulysses}
DROPOUT_REASON = ("dropout_p: dropout is refused under context parallelism: masks are keyed on each row's "
                  "sequence index and positions in its sequence (keyed_dropout), which the sharded calls do not "
                  "pass to the backends yet, so a sharded call could not equal the single-process call")


def _check_tensors(plan, rank, q, k, v):
    for name, x in (("q_local", q), ("k_local", k), ("v_local", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name}: expected a packed (n_local, heads, head_dim) tensor, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
        if x.shape[0] != plan.tokens[rank]:
            raise ValueError(f"{name}: has {x.shape[0]} rows but the plan gives rank {rank} "
                             f"{plan.tokens[rank]} (shard it with plan.shard(x, {rank}))")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k_local/v_local: dtypes {k.dtype}/{v.dtype} differ from q_local's {q.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"k_local/v_local: devices {k.device}/{v.device} differ from q_local's {q.device}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k_local: head dim {k.shape[2]} differs from q_local's {q.shape[2]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v_local: {v.shape[1]} heads, k_local has {k.shape[1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q_local/k_local: query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]}")


def _options(plan, q, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, return_lse, backend):
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    window = _validate_window(window_size)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise ValueError(DROPOUT_REASON)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes: expected a float32 tensor, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes: expected float32, got {alibi_slopes.dtype}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes: on {alibi_slopes.device}, q_local on {q.device}")
        hq = q.shape[1]
        if tuple(alibi_slopes.shape) not in ((hq,), (len(plan.lengths), hq)):
            raise ValueError(f"alibi_slopes: expected shape ({hq},) or ({len(plan.lengths)}, {hq}) "
                             f"(B sequences of the plan, Hq), got {tuple(alibi_slopes.shape)}")
    return dict(softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
                alibi_slopes=alibi_slopes, return_lse=return_lse, backend=backend)


@dataclass
class Choice:
    """What explain shows and varlen_attention runs."""

    chosen: str | None
    reasons: dict                      # algorithm -> reason it cannot run, or None
    estimates: dict                    # algorithm -> cost.Estimate
    backends: dict                     # algorithm -> [jagged_sdpa Explanation of each local call]
    error: Exception | None = None     # what varlen_attention raises when nothing can run
    header: dict = field(default_factory=dict)


def _choose(plan, rank, q, k, v, algorithm, opts) -> Choice:
    hq, hkv, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    grad = q.requires_grad or k.requires_grad or v.requires_grad
    machine = cost.machine_for(q.device)
    reasons, estimates, backends, no_backend = {}, {}, {}, {}
    for name, impl in _IMPLS.items():
        reason = impl.refusal(plan, plan.world_size, hq, hkv, opts)
        if reason is None:
            expls = impl.explain_calls(q, k, v, plan, rank, opts)
            backends[name] = expls
            blocked = [e for e in expls if e.chosen is None]
            if blocked:
                reason = "no backend takes its local call (see jagged_sdpa.explain)"
                no_backend[name] = blocked[0]
        reasons[name] = reason
        if name == "allgather" or hq % plan.world_size == 0:
            estimates[name] = cost.estimate(plan, name, hq, hkv, d, dv, q.element_size(), causal=opts["causal"],
                                            window=opts["window_size"], grad=grad, machine=machine,
                                            return_lse=opts["return_lse"])
    eligible = [a for a in _IMPLS if reasons[a] is None]
    error = None
    if algorithm == "auto":
        chosen = min(eligible, key=lambda a: (estimates[a].seconds, a)) if eligible else None
        if chosen is None:
            if len(no_backend) == len(_IMPLS):
                error = NoBackendError(no_backend["allgather"], "no backend can take the local attention call")
            else:
                error = ValueError("algorithm: no algorithm can take this call: " + "; ".join(
                    f"{a}: {r}" for a, r in reasons.items()))
    else:
        chosen = algorithm if reasons[algorithm] is None else None
        if chosen is None:
            error = (NoBackendError(no_backend[algorithm], "no backend can take the local attention call")
                     if algorithm in no_backend else
                     ValueError(f"algorithm: {algorithm!r} cannot take this call: {reasons[algorithm]}"))
    return Choice(chosen, reasons, estimates, backends, error)


def _prepare(plan, rank, world_size, q, k, v, algorithm, kw) -> Choice:
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan: expected a ShardPlan from plan_shards, got {type(plan).__name__}")
    if plan.world_size != world_size:
        raise ValueError(f"plan: made for world_size {plan.world_size}, but the group has {world_size} ranks")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    _check_tensors(plan, rank, q, k, v)
    opts = _options(plan, q, **kw)
    choice = _choose(plan, rank, q, k, v, algorithm, opts)
    choice.header = opts
    return choice


def _fields(plan, q, k, v, kw, choice):
    def opt(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype))
        return repr(value)
    options = {name: opt(value) for name, value in sorted(kw.items())}
    return {
        "plan": plan.digest,
        "q_local": digest((str(q.dtype), q.device.type, q.shape[1:], q.requires_grad)),
        "k_local": digest((str(k.dtype), k.shape[1:], k.requires_grad)),
        "v_local": digest((str(v.dtype), v.shape[1:], v.requires_grad)),
        "options (softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse, backend)": digest(options),
        "algorithm": digest(choice.chosen),
    }


def varlen_attention(q_local, k_local, v_local, plan, group=None, *, algorithm="auto", softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     return_lse=False, backend=None):
    """Context-parallel ``jagged_sdpa.varlen_attention`` (self-attention over a packed ragged batch).

    Each rank passes the rows it owns (``plan.shard``): q_local ``(n_local, Hq, D)``, k_local
    ``(n_local, Hkv, D)``, v_local ``(n_local, Hkv, Dv)``. Returns this rank's rows of the
    single-process ``varlen_attention(q, k, v, cu_seqlens, cu_seqlens, ...)``: out
    ``(n_local, Hq, Dv)``, and lse float32 ``(Hq, n_local)`` with ``return_lse=True``
    (-inf and zero output for rows that see no key). Gradients flow to the local q, k, v.

    ``algorithm``: ``"allgather"`` (fetch the keys/values this rank's queries read),
    ``"ulysses"`` (all-to-all over heads; needs Hq % world_size == 0) or ``"auto"`` (the cheaper
    eligible one by the cost model ``explain`` prints). ``group``: a process group (None: the
    default one) or an in-process communicator (``jagged_sdpa.distributed.local``).

    Collective: every rank of the group must call it with the same plan and options. Bad input
    raises ValueError/TypeError (NoBackendError when no backend takes the local call) on every
    rank, naming the argument; ``dropout_p > 0`` is refused with its reason.
    """
    comm = resolve(group)
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=return_lse, backend=backend)
    error, choice, fields = None, None, {}
    try:
        choice = _prepare(plan, comm.rank, comm.world_size, q_local, k_local, v_local, algorithm, kw)
        error = choice.error
        fields = _fields(plan, q_local, k_local, v_local, kw, choice)
    except (ValueError, TypeError, NoBackendError) as exc:
        error = exc
    fields = fields or {name: 0 for name in ("plan", "q_local", "k_local", "v_local", "options", "algorithm")}
    agree(comm, fields, error, device=header_device(comm, q_local))
    impl = _IMPLS[choice.chosen]
    out, lse = impl.attention(q_local, k_local, v_local, plan, comm, choice.header)
    return (out, lse) if return_lse else out


@dataclass
class DistExplanation:
    """What ``jd.varlen_attention`` would do with these arguments, and why."""

    plan: ShardPlan
    rank: int
    shapes: tuple
    options: dict
    choice: Choice
    machine: cost.Machine

    @property
    def chosen(self):
        return self.choice.chosen

    @property
    def reasons(self):
        return self.choice.reasons

    @property
    def estimates(self):
        return self.choice.estimates

    def __str__(self):
        p, c = self.plan, self.choice
        hq, hkv, d, dv, dtype, grad = self.shapes
        work = cost.call_work(p, self.options["causal"], self.options["window_size"])
        mean = sum(work) / p.world_size if p.world_size else 0
        lines = [
            f"context-parallel varlen call: {len(p.lengths)} sequences, {p.total} tokens, world size "
            f"{p.world_size}, this rank {self.rank}, plan strategy {p.strategy}",
            f"Hq={hq} Hkv={hkv} D={d} Dv={dv} {str(dtype).replace('torch.', '')} causal={self.options['causal']} "
            f"window={self.options['window_size']} grad={'yes' if grad else 'no'}; cost model: {self.machine.name}",
            "  rank   tokens  runs      pairs (call mask)",
        ]
        for r in range(p.world_size):
            lines.append(f"  {r:>4} {p.tokens[r]:>8} {len(p.runs[r]):>5} {work[r]:>18}")
        lines.append(f"  max/mean pairs {max(work) / mean if mean else 1.0:.3f} "
                     f"(ulysses: 1.000, it splits heads, not tokens)")
        lines.append("  algorithm  eligible  compute ms   comm ms  local ms  total ms  MB moved (fwd+bwd, all ranks)"
                     "  why not")
        for a in _IMPLS:
            e = c.estimates.get(a)
            nums = (f"{e.t_compute * 1e3:>10.3f} {e.t_comm * 1e3:>9.3f} {e.t_local * 1e3:>9.3f} {e.seconds * 1e3:>9.3f} "
                    f"{e.total_bytes / 2**20:>30.3f}") if e else f"{'-':>10} {'-':>9} {'-':>9} {'-':>9} {'-':>30}"
            lines.append(f"  {a:<10} {'yes' if c.reasons[a] is None else 'no':<9} {nums}  {c.reasons[a] or ''}")
        backend = ""
        if c.chosen and c.backends.get(c.chosen):
            names = sorted({str(e.chosen.value) for e in c.backends[c.chosen] if e.chosen is not None})
            backend = f" (local backend: {', '.join(names)})"
        lines.append(f"chosen: {c.chosen}{backend}" if c.chosen else f"chosen: none ({c.error})")
        return "\n".join(lines)


def explain(plan, q_local, k_local, v_local, group=None, *, algorithm="auto", softmax_scale=None, causal=False,
            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, return_lse=False, backend=None):
    """The arguments of ``varlen_attention``; returns a ``DistExplanation`` (print it). Runs no
    kernel and no collective; without a process group it explains rank 0. Bad input raises here."""
    if isinstance(group, Comm):
        rank = group.rank
    elif dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(group)
    else:
        rank = 0
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=return_lse, backend=backend)
    world = plan.world_size if isinstance(plan, ShardPlan) else -1
    choice = _prepare(plan, rank, world, q_local, k_local, v_local, algorithm, kw)
    grad = q_local.requires_grad or k_local.requires_grad or v_local.requires_grad
    shapes = (q_local.shape[1], k_local.shape[1], q_local.shape[2], v_local.shape[2], q_local.dtype, grad)
    return DistExplanation(plan, rank, shapes, choice.header, choice, cost.machine_for(q_local.device))
