"""CPU benchmark (issue 3): jagged_sdpa against what a CPU user can run today, side by side.

Contenders, timed interleaved in one process (round r times every contender once, in turn):
  ours      jagged_sdpa.varlen_attention (automatic selection: CPU_FUSED on CPU tensors)
  njt       torch's NJT SDPA (refuses is_causal=True)
  padded    pad to (B, H, max_len, D) + boolean mask, one dense SDPA call
  loop      one dense SDPA call per sequence (views of the packed buffer)
  bucketed  sort by length, pad within buckets of similar length, one SDPA call per bucket
Every contender's output (and gradients, for forward+backward rows) is checked against ours.

Disturbed rounds: the machine is shared. Each sample reads /proc/stat around the call; CPU time
spent by other processes (system busy time minus this process's CPU time), beyond the CPUs our
threads leave free, above 10% of the machine marks the round disturbed, and the round is repeated
(up to a limit; how many were repeated is printed). Peak extra memory is the rise of the process's peak RSS during one call
(/proc/self/clear_refs resets the peak), measured after all timings in a fresh process per
contender where glibc is told to return large blocks to the OS at once.

Run: python benchmarks/bench_cpu.py [--quick] [--only W1,W2] [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jagged_sdpa  # noqa: E402
from workloads import TINY, Workload, make_tensors, standard_workloads  # noqa: E402

CONTENDERS = ("ours", "njt", "padded", "loop", "bucketed")
ANCHORS = CONTENDERS[1:]
CLK_TCK = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------
# the contenders: each builds a closure that runs one call (forward, or forward+backward)


def _anchor_causal(w: Workload) -> bool:
    """Decode rows (one query, bottom-right causal) see every key: the anchors run them unmasked,
    which is the same attention and the only form NJT SDPA accepts."""
    if w.causal and w.alignment == "bottom_right" and all(n == 1 for n in w.q_lengths):
        return False
    return w.causal


def _mask_for(lq: int, lk: int, causal: bool, alignment: str) -> Optional[torch.Tensor]:
    if not causal:
        return None
    shift = lk - lq if alignment == "bottom_right" else 0
    return torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + shift


def make_ours(w, q, k, v, cu_q, cu_k):
    max_q, max_k = max(w.q_lengths), max(w.keys)

    def run():
        return jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=w.causal)
    return run


def make_loop(w, q, k, v, cu_q, cu_k):
    causal = _anchor_causal(w)
    cq, ck = cu_q.tolist(), cu_k.tolist()

    def run():
        outs = []
        for b in range(len(cq) - 1):
            qb = q[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
            kb = k[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
            vb = v[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, enable_gqa=w.heads != w.heads_kv)[0].transpose(0, 1))
        return torch.cat(outs)
    return run


def _padded_group(w, q, k, v, cq, ck, members, causal):
    """One dense SDPA call over ``members`` padded to their longest; returns packed outputs."""
    lq = [cq[b + 1] - cq[b] for b in members]
    lk = [ck[b + 1] - ck[b] for b in members]
    mq, mk = max(lq), max(lk)
    qi = torch.cat([torch.arange(cq[b], cq[b] + mq).clamp(max=max(cq[-1] - 1, 0)) for b in members])
    ki = torch.cat([torch.arange(ck[b], ck[b] + mk).clamp(max=max(ck[-1] - 1, 0)) for b in members])
    n = len(members)
    valid_k = torch.arange(mk).unsqueeze(0) < torch.tensor(lk).unsqueeze(1)           # (n, mk)
    mask = valid_k.view(n, 1, 1, mk).expand(n, 1, mq, mk)
    if causal:
        rows = []
        for a, bk in zip(lq, lk):
            shift = bk - a if w.alignment == "bottom_right" else 0
            rows.append(torch.arange(mk).unsqueeze(0) <= torch.arange(mq).unsqueeze(1) + shift)
        mask = mask & torch.stack(rows).unsqueeze(1)
    keep_rows = torch.cat([torch.arange(i * mq, i * mq + a) for i, a in enumerate(lq)])

    def run():
        qp = q[qi].view(n, mq, w.heads, -1).transpose(1, 2)
        kp = k[ki].view(n, mk, w.heads_kv, -1).transpose(1, 2)
        vp = v[ki].view(n, mk, w.heads_kv, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=w.heads != w.heads_kv)
        return o.transpose(1, 2).reshape(n * mq, w.heads, -1)[keep_rows]
    return run


def make_padded(w, q, k, v, cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return _padded_group(w, q, k, v, cq, ck, list(range(len(cq) - 1)), _anchor_causal(w))


def buckets(lengths, waste: float = 1.25) -> list[list[int]]:
    """Sequences sorted by length, cut into groups whose longest is at most ``waste`` x shortest."""
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    groups, current = [], []
    for b in order:
        if current and lengths[b] > waste * max(1, lengths[current[0]]):
            groups.append(current)
            current = []
        current.append(b)
    if current:
        groups.append(current)
    return groups


def make_bucketed(w, q, k, v, cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    causal = _anchor_causal(w)
    groups = buckets([max(a, b) for a, b in zip(w.q_lengths, w.keys)])
    runs = [_padded_group(w, q, k, v, cq, ck, g, causal) for g in groups]
    inverse = torch.argsort(torch.cat([torch.arange(cq[b], cq[b + 1]) for g in groups for b in g]))

    def run():
        return torch.cat([r() for r in runs])[inverse]
    return run


def make_njt(w, q, k, v, cu_q, cu_k):
    if _anchor_causal(w):
        return None  # NJT SDPA refuses is_causal=True
    if w.heads != w.heads_kv:
        return None

    def to_njt(x, cu):
        return torch.nested.nested_tensor_from_jagged(x, offsets=cu.long()).transpose(1, 2)
    qn, kn, vn = to_njt(q, cu_q), to_njt(k, cu_k), to_njt(v, cu_k)

    def run():
        return F.scaled_dot_product_attention(qn, kn, vn).transpose(1, 2).values()
    return run


MAKERS: dict[str, Callable] = {
    "ours": make_ours, "njt": make_njt, "padded": make_padded, "loop": make_loop, "bucketed": make_bucketed,
}


def with_backward(forward: Callable, grad: torch.Tensor, inputs) -> Callable:
    def run():
        for t in inputs:
            t.grad = None
        out = forward()
        out.backward(grad)
        return out
    return run


# ----------------------------------------------------------------------------------------------
# measurement


def _system_busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle


@dataclass
class Sample:
    seconds: float          # per call
    disturbed: bool


def timed(fn: Callable, reps: int) -> Sample:
    busy0, cpu0, t0 = _system_busy_ticks(), time.process_time(), time.perf_counter()
    for _ in range(reps):
        fn()
    t1, cpu1, busy1 = time.perf_counter(), time.process_time(), _system_busy_ticks()
    wall = t1 - t0
    others = (busy1 - busy0) / CLK_TCK - (cpu1 - cpu0)
    # Others may use the CPUs our threads leave free; beyond that, more than 10% of the machine
    # is a disturbance. /proc/stat counts in ticks: one tick per CPU of slack.
    free_cpus = max(0, NCPU - torch.get_num_threads())
    disturbed = others > (free_cpus + 0.10 * NCPU) * wall + NCPU / CLK_TCK
    return Sample(wall / reps, disturbed)


def peak_extra_bytes(fn: Callable) -> int:
    """Rise of peak RSS during one call (after a warm-up call)."""
    fn()

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0
    if platform.system() == "Linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so reuse shows as growth
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    result = fn()
    peak = status("VmHWM:")
    del result
    return max(0, peak - before)


def agree(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """Max abs difference relative to the reference's scale."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if a.numel() else 0.0


AGREE_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass
class Row:
    workload: Workload
    medians: dict
    memory: dict
    errors: dict
    repeated: int
    rounds: int
    slow: set


def build(w: Workload):
    """Inputs and every contender's closure for one workload (None where it cannot run)."""
    q, k, v, cu_q, cu_k = make_tensors(w, requires_grad=w.backward)
    grad = torch.randn(q.shape[0], w.heads, w.head_dim, generator=torch.Generator().manual_seed(1)).to(w.dtype)
    fns = {}
    for name in CONTENDERS:
        f = MAKERS[name](w, q, k, v, cu_q, cu_k)
        if f is not None and w.backward:
            f = with_backward(f, grad, (q, k, v))
        fns[name] = f
    return fns, (q, k, v)


def run_workload(w: Workload, rounds: int, min_sample_s: float, max_retries: int, skip_slow_s: float) -> Row:
    fns, (q, k, v) = build(w)

    # Agreement (outputs, and dq/dk/dv for backward rows) and calibration.
    ref_out = fns["ours"]()
    ref_grads = [t.grad.clone() for t in (q, k, v)] if w.backward else []
    errors, reps, cost = {}, {}, {}
    for name, f in fns.items():
        if f is None:
            continue
        t0 = time.perf_counter()
        out = f()
        cost[name] = time.perf_counter() - t0
        err = agree(out, ref_out, w.dtype)
        if w.backward:
            err = max([err] + [agree(t.grad, g, w.dtype) for t, g in zip((q, k, v), ref_grads)])
        errors[name] = err
        if err > AGREE_TOL[w.dtype]:
            raise AssertionError(f"{w.name}: {name} disagrees with ours (relative error {err:.2e})")
        reps[name] = max(1, math.ceil(min_sample_s / max(cost[name], 1e-6)))
    active = [n for n in CONTENDERS if fns[n] is not None]
    slow = {n for n in active if n != "ours" and cost[n] > skip_slow_s}

    # A contender slower than skip_slow_s per call is timed once: its calibration call.
    samples = {n: ([cost[n]] if n in slow else []) for n in active}
    repeated = 0
    for r in range(rounds):
        for attempt in range(max_retries + 1):
            round_samples = {}
            for name in active:
                if name not in slow:
                    round_samples[name] = timed(fns[name], reps[name])
            if not any(s.disturbed for s in round_samples.values()) or attempt == max_retries:
                break
            repeated += 1
        for name, s in round_samples.items():
            samples[name].append(s.seconds)
    medians = {n: statistics.median(s) for n, s in samples.items()}
    return Row(w, medians, {}, errors, repeated, rounds, slow)


def _memory_child(w: Workload, name: str, threads: int) -> int:
    """In a fresh process: one contender's peak extra memory (see ``measure_memory``)."""
    from jagged_sdpa.__main__ import _quiet_torch_notices
    _quiet_torch_notices()  # the parent printed torch's NJT notices once already
    torch.set_num_threads(threads)
    if platform.system() == "Linux":
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    fns, _ = build(w)
    return peak_extra_bytes(fns[name])


def measure_memory(row: Row) -> None:
    """Peak extra memory of each contender (slow ones skipped), into ``row.memory``.

    Each contender runs in a fresh process: in one long-lived process the heap left by earlier
    rows (arenas of other threads, cached blocks) made the same call read 11.5 MiB or 29.7 MiB
    depending on which rows ran before it.
    """
    import concurrent.futures
    import multiprocessing
    fns, _ = build(row.workload)
    names = [n for n, f in fns.items() if f is not None and n not in row.slow]
    row.memory = {}
    for n in names:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            row.memory[n] = pool.submit(_memory_child, row.workload, n, torch.get_num_threads()).result()


# ----------------------------------------------------------------------------------------------
# tiny call: the per-call overhead (selection, checks, layout), sdpa on NJTs and varlen on packed


def tiny_rows(reps: int, rounds: int) -> dict:
    w = TINY
    q, k, v, cu_q, cu_k = make_tensors(w)
    njts = [torch.nested.nested_tensor_from_jagged(x, offsets=cu_q.long()).transpose(1, 2) for x in (q, k, v)]
    fns = {
        "ours (sdpa, NJT)": lambda: jagged_sdpa.sdpa(*njts),
        "ours (varlen)": lambda: jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 10, 10),
        "njt": lambda: F.scaled_dot_product_attention(*njts),
        "padded": make_padded(w, q, k, v, cu_q, cu_k),
        "loop": make_loop(w, q, k, v, cu_q, cu_k),
    }
    ref = fns["njt"]().transpose(1, 2).values()
    for name, f in fns.items():
        out = f()
        out = out.transpose(1, 2).values() if out.is_nested else out
        assert agree(out, ref, torch.float32) < 1e-4, name
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            samples[name].append(timed(f, reps).seconds)
    return {n: statistics.median(s) for n, s in samples.items()}


# ----------------------------------------------------------------------------------------------
# report


def _label(w: Workload) -> str:
    parts = [w.name]
    if w.dtype != torch.float32:
        parts.append(str(w.dtype).replace("torch.", ""))
    if w.causal and w.name != "W4":
        parts.append("causal")
    parts.append("fwd+bwd" if w.backward else "fwd")
    return " ".join(parts)


def _ms(x):
    return "refused" if x is None else f"{x * 1e3:.1f}"


def print_table(rows: list[Row], tiny: Optional[dict]) -> None:
    print("| workload | ours | NJT SDPA | padded+mask | loop | bucketed | best anchor | best/ours | ours GFLOP/s | "
          "peak MiB ours / loop | repeated rounds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r.medians
        anchors = {n: m[n] for n in ANCHORS if n in m}
        best = min(anchors, key=anchors.get)
        mem = f"{r.memory.get('ours', 0) / 2**20:.1f} / {r.memory.get('loop', 0) / 2**20:.1f}"
        gflops = r.workload.flops() / m["ours"] / 1e9
        print(f"| {_label(r.workload)} | {_ms(m['ours'])} | {_ms(m.get('njt'))} | {_ms(m['padded'])} | "
              f"{_ms(m['loop'])} | {_ms(m['bucketed'])} | {best} | {anchors[best] / m['ours']:.2f}x | "
              f"{gflops:.0f} | {mem} | {r.repeated} |")
    if tiny:
        ours = tiny["ours (sdpa, NJT)"]
        print()
        print("| tiny call (us per call) | " + " | ".join(tiny) + " | NJT / ours (sdpa) |")
        print("|---|" + "---|" * (len(tiny) + 1))
        print("| B=4, lengths 6..10, H=2, D=16 | " + " | ".join(f"{t * 1e6:.0f}" for t in tiny.values())
              + f" | {tiny['njt'] / ours:.1f}x |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, short samples (about a minute)")
    parser.add_argument("--only", default="", help="comma-separated workload names, e.g. W1,W2")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, min_sample, retries = (3, 0.03, 1) if args.quick else (7, 0.1, 4)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  cpus {NCPU}  {platform.processor() or platform.machine()}  "
          f"load {' '.join(load)}  rounds {rounds}")
    torch.set_grad_enabled(True)
    rows = []
    for w in standard_workloads():
        if only and w.name not in only:
            continue
        row = run_workload(w, rounds, min_sample, retries, skip_slow_s=1.0 if args.quick else 3.0)
        rows.append(row)
        print(f"  {_label(w)}: " + ", ".join(f"{n} {_ms(t)}" for n, t in row.medians.items())
              + f"  (ms; repeated {row.repeated})", flush=True)
    # Memory last, each contender in a fresh process: fixing glibc's mmap threshold there makes
    # freed large blocks leave RSS at once (so the peak is measurable) but turns every large
    # allocation into fresh page faults, which would distort timings (2.5x on our bf16 path).
    for row in rows:
        measure_memory(row)
    tiny = None
    if not only or "tiny" in only:
        with torch.no_grad():
            tiny = tiny_rows(reps=200 if args.quick else 1000, rounds=rounds)
    print()
    print_table(rows, tiny)


if __name__ == "__main__":
    main()
