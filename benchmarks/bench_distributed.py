"""Context-parallel benchmark (issue 13): real gloo process groups on this machine, and the cost
model's predictions for 8-1024 GPUs.

Part 1, measured: world sizes 1-4 as gloo processes (one intra-op thread each; W > 2 oversubscribes
a 2-core machine, so those times measure contention, not scaling). For every strategy and
algorithm: forward+backward time (median over rounds, slowest rank), bytes each rank really sent
to other ranks (counted in the communicator), per-rank attention work (max/mean) and tokens.
The same run measures what the cost model needs here: the kernel's FLOP rate (single process),
and gloo's all-to-all latency and bandwidth, and prints the model's prediction beside each time.

Part 2, modelled: a Llama-3-8B-like layer (Hq=32, Hkv=8, D=128, bf16, causal, forward+backward)
on log-normal ragged batches (W1's shape), 8-1024 GPUs, NVLink inside 8 GPUs and InfiniBand
beyond. Every assumption is printed with the numbers.

Run: python benchmarks/bench_distributed.py [--quick] [--world-sizes 1,2,3,4] [--model-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from workloads import W1_LENGTHS, lognormal_lengths  # noqa: E402

STRATEGIES = ("auto", "contiguous", "zigzag", "documents")
ALGORITHMS = ("allgather", "ulysses")
SHAPE = dict(hq=8, hkv=2, d=64)          # the CPU benchmarks' W1 shape, GQA 4:1


def scaled(lengths, total):
    s = sum(lengths)
    return [max(1, round(n * total / s)) for n in lengths]


# ------------------------------------------------------------------------------------------------
# part 1: gloo processes


def _counting_comm():
    from jagged_sdpa.distributed.comm import GroupComm

    class CountingComm(GroupComm):
        """Counts the bytes this rank sends to other ranks (its own piece never leaves)."""

        sent = 0

        def all_to_all(self, send, send_counts, recv_counts):
            others = sum(int(c) for r, c in enumerate(send_counts) if r != self.rank)
            CountingComm.sent += others * send.element_size()
            return super().all_to_all(send, send_counts, recv_counts)

    return CountingComm()


def _probe_collectives(rank, world_size):
    """all_to_all_single latency (8 bytes per peer) and bandwidth (2 MiB per peer), medians."""
    out = {}
    for name, per_peer in (("latency", 2), ("bandwidth", 1 << 19)):
        send = torch.ones(per_peer * world_size)
        recv = torch.empty_like(send)
        samples = []
        for _ in range(7):
            dist.barrier()
            t = time.perf_counter()
            dist.all_to_all_single(recv, send)
            samples.append(time.perf_counter() - t)
        out[name] = statistics.median(samples[2:])
    bytes_out = 4 * (1 << 19) * (world_size - 1)
    return dict(latency=out["latency"] / max(world_size - 1, 1),
                bandwidth=bytes_out / out["bandwidth"] if world_size > 1 else float("inf"))


def worker(rank, world_size, store, lengths, rounds, queue):
    sys.path[:0] = [HERE, ROOT]
    torch.set_num_threads(1)
    import jagged_sdpa  # noqa: F401  (this worktree's package: ROOT is first on sys.path)
    from jagged_sdpa import distributed as jd

    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))
    gen = torch.Generator().manual_seed(0)
    n = sum(lengths)
    q = torch.randn(n, SHAPE["hq"], SHAPE["d"], generator=gen)
    k = torch.randn(n, SHAPE["hkv"], SHAPE["d"], generator=gen)
    v = torch.randn(n, SHAPE["hkv"], SHAPE["d"], generator=gen)
    g = torch.randn(n, SHAPE["hq"], SHAPE["d"], generator=gen)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    comm = _counting_comm()
    rows = []
    for strategy in STRATEGIES:
        plan = jd.plan_shards(cu, world_size, strategy=strategy, causal=True)
        ql, kl, vl, gl = (plan.shard(x, rank) for x in (q, k, v, g))
        for algorithm in ALGORITHMS + ("auto",):
            if algorithm == "ulysses" and SHAPE["hq"] % world_size:
                rows.append((strategy, algorithm, None))
                continue
            samples = []
            for i in range(rounds + 1):
                a, b, c = (x.clone().requires_grad_() for x in (ql, kl, vl))
                dist.barrier()
                comm.__class__.sent = 0
                t = time.perf_counter()
                out = jd.varlen_attention(a, b, c, plan, comm, algorithm=algorithm, causal=True)
                out.backward(gl)
                elapsed = time.perf_counter() - t
                if i:  # the first round warms caches (routes, index tensors, the kernel)
                    samples.append(elapsed)
            sent = comm.__class__.sent
            e = jd.explain(plan, a, b, c, comm, algorithm=algorithm, causal=True)
            rows.append((strategy, algorithm, dict(seconds=statistics.median(samples), best=min(samples), sent=sent,
                                                   chosen=e.chosen, work=plan.work, tokens=plan.tokens,
                                                   imbalance=plan.imbalance)))
    probe = _probe_collectives(rank, world_size)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (rows, probe))
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def measure_world(world_size, lengths, rounds):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, world_size, os.path.join(tmp, "store"), lengths, rounds, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        result = queue.get(timeout=1800)
        for p in procs:
            p.join(timeout=60)
    return result


def kernel_rate(lengths, rounds):
    """Single-process forward+backward FLOP/s of the attention call, one thread (the model's F)."""
    import jagged_sdpa
    from jagged_sdpa.distributed.work import WorkTable

    torch.set_num_threads(1)
    n = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    q = torch.randn(n, SHAPE["hq"], SHAPE["d"], requires_grad=True)
    k = torch.randn(n, SHAPE["hkv"], SHAPE["d"], requires_grad=True)
    v = torch.randn(n, SHAPE["hkv"], SHAPE["d"], requires_grad=True)
    samples = []
    for i in range(rounds + 1):
        t = time.perf_counter()
        jagged_sdpa.varlen_attention(q, k, v, cu, cu, causal=True).sum().backward()
        if i:
            samples.append(time.perf_counter() - t)
    pairs = WorkTable(lengths, True, (-1, -1)).total()
    flops = pairs * SHAPE["hq"] * 2 * (2 * SHAPE["d"]) * 3.5
    return flops / statistics.median(samples), statistics.median(samples)


def part1(world_sizes, lengths, rounds):
    from jagged_sdpa.distributed import cost
    from jagged_sdpa.distributed.shards import plan_shards

    rate, single = kernel_rate(lengths, rounds)
    print("## Measured: gloo on this machine\n")
    print(f"batch: W1 lengths scaled to {sum(lengths)} tokens ({len(lengths)} sequences), Hq={SHAPE['hq']} "
          f"Hkv={SHAPE['hkv']} D=Dv={SHAPE['d']} fp32, causal, forward+backward, 1 thread per process")
    print(f"single process: {single * 1e3:.1f} ms, kernel rate F = {rate / 1e9:.1f} GFLOP/s (forward-equivalent "
          f"FLOPs x 3.5 / time)\n")
    print("ms: slowest rank, median (best) of the rounds. model: the cost model with this machine's F, alpha "
          "and beta; 'shared' also divides the compute rate by W/2 when W processes share the 2 cores.\n")
    print("| W | strategy | algorithm | ran | ms median (best) | model ms / shared | MB sent (sum of ranks) | "
          "max/mean work | max/mean tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    probes = {}
    for W in world_sizes:
        gathered = measure_world(W, lengths, rounds)
        probe = gathered[0][1]
        probes[W] = probe
        machine = cost.Machine("measured", flops=rate, latency=probe["latency"], bandwidth=probe["bandwidth"],
                               copy_bandwidth=cost.MACHINES["cpu"].copy_bandwidth)
        for i, (strategy, algorithm, info) in enumerate(gathered[0][0]):
            if info is None:
                print(f"| {W} | {strategy} | {algorithm} | refused: Hq % W != 0 | | | | | |")
                continue
            seconds = max(rows[i][2]["seconds"] for rows, _ in gathered)
            best = max(rows[i][2]["best"] for rows, _ in gathered)
            sent = sum(rows[i][2]["sent"] for rows, _ in gathered)
            plan = plan_shards(lengths, W, strategy=strategy, causal=True)
            est = cost.estimate(plan, info["chosen"], SHAPE["hq"], SHAPE["hkv"], SHAPE["d"], SHAPE["d"], 4,
                                causal=True, window=(-1, -1), grad=True, machine=machine)
            tok = max(info["tokens"]) / (sum(info["tokens"]) / W)
            shared = est.seconds + est.t_compute * (max(1.0, W / (os.cpu_count() or 1)) - 1)
            print(f"| {W} | {strategy} | {algorithm} | {info['chosen']} | {seconds * 1e3:.1f} ({best * 1e3:.1f}) | "
                  f"{est.seconds * 1e3:.1f} / {shared * 1e3:.1f} | {sent / 2**20:.2f} | {info['imbalance']:.3f} | "
                  f"{tok:.3f} |")
    print("\ngloo all_to_all_single on this machine (median; W > 2 shares 2 cores):")
    for W, p in probes.items():
        if W > 1:
            print(f"- W={W}: latency {p['latency'] * 1e6:.0f} us per peer step, bandwidth "
                  f"{p['bandwidth'] / 1e9:.2f} GB/s per rank")
    return rate, probes


def plans_table():
    """max/mean work / max/mean tokens / largest fetched share, per strategy (causal W1 batches)."""
    from jagged_sdpa.distributed.shards import plan_shards
    from jagged_sdpa.distributed.routes import remote_rows

    print("## Plans: causal W1 lengths scaled to 16K-128K tokens\n")
    print("| tokens | W | auto work / tokens / fetched | zigzag | documents | contiguous |")
    print("|---|---|---|---|---|---|")
    for total in (16384, 65536, 131072):
        lengths = scaled(W1_LENGTHS, total)
        for W in range(2, 9):
            cells = []
            for strategy in ("auto", "zigzag", "documents", "contiguous"):
                p = plan_shards(lengths, W, strategy=strategy, causal=True)
                fetched = max(remote_rows(p, r, True, (-1, -1)) for r in range(W)) / total
                cells.append(f"{p.imbalance:.3f} / {p.token_imbalance:.2f} / {fetched:.2f}")
            print(f"| {total // 1024}K | {W} | " + " | ".join(cells) + " |")
    print()


# ------------------------------------------------------------------------------------------------
# part 2: the model at scale


GPU_LAYER = dict(hq=32, hkv=8, d=128, itemsize=2)
NVLINK = dict(latency=1e-5, bandwidth=3.0e11)       # H100 NVLink 4: ~450 GB/s per direction peak, 2/3 of it
INFINIBAND = dict(latency=2e-5, bandwidth=5.0e10)   # NDR 400 Gb/s per GPU
GPU_FLOPS = 4.0e14                                  # bf16 flash attention, ~40% of H100 dense peak
GPU_COPY = 2.0e12                                   # local gathers/scatters: ~60% of HBM3 bandwidth


def part2(world_sizes, tokens_per_gpu, fixed_tokens):
    from jagged_sdpa.distributed import cost
    from jagged_sdpa.distributed.shards import plan_shards

    print("\n## Modelled: 8-1024 GPUs\n")
    print(f"Assumptions: layer Hq={GPU_LAYER['hq']} Hkv={GPU_LAYER['hkv']} D=Dv={GPU_LAYER['d']} bf16, causal, "
          f"forward+backward (backward = 2.5x forward FLOPs); F = {GPU_FLOPS / 1e12:.0f} TFLOP/s per GPU; "
          f"W <= 8: NVLink alpha {NVLINK['latency'] * 1e6:.0f} us, beta {NVLINK['bandwidth'] / 1e9:.0f} GB/s; "
          f"W > 8: InfiniBand alpha {INFINIBAND['latency'] * 1e6:.0f} us, beta {INFINIBAND['bandwidth'] / 1e9:.0f} "
          f"GB/s per GPU; local copies at {GPU_COPY / 1e12:.0f} TB/s; no overlap of communication and compute; "
          "plan strategy auto.")
    for title, total_of in ((f"weak scaling, {tokens_per_gpu // 1024}K tokens per GPU", lambda W: tokens_per_gpu * W),
                            (f"strong scaling, {fixed_tokens // 2**20}M tokens", lambda W: fixed_tokens)):
        print(f"\n### {title}; log-normal documents (median {MEDIAN} tokens, sigma 0.8, W1's shape)\n")
        print("| W | tokens | docs | max/mean work | allgather ms (comp + comm + local) | ulysses ms (comp + comm + local) | "
              "auto picks | allgather GB moved | ulysses GB moved |")
        print("|---|---|---|---|---|---|---|---|---|")
        for W in world_sizes:
            total = total_of(W)
            lengths = doc_lengths(total)
            plan = plan_shards(lengths, W, causal=True)
            link = NVLINK if W <= 8 else INFINIBAND
            machine = cost.Machine("model", flops=GPU_FLOPS, copy_bandwidth=GPU_COPY, **link)
            cells, moved, best = [], [], None
            for algorithm in ("allgather", "ulysses"):
                if algorithm == "ulysses" and GPU_LAYER["hq"] % W:
                    cells.append("refused (Hq % W)")
                    moved.append("-")
                    continue
                e = cost.estimate(plan, algorithm, GPU_LAYER["hq"], GPU_LAYER["hkv"], GPU_LAYER["d"], GPU_LAYER["d"],
                                  GPU_LAYER["itemsize"], causal=True, window=(-1, -1), grad=True, machine=machine)
                cells.append(f"{e.seconds * 1e3:.1f} ({e.t_compute * 1e3:.1f} + {e.t_comm * 1e3:.1f} + "
                             f"{e.t_local * 1e3:.1f})")
                moved.append(f"{e.total_bytes / 1e9:.1f}")
                if best is None or e.seconds < best[1]:
                    best = (algorithm, e.seconds)
            print(f"| {W} | {total} | {len(lengths)} | {plan.imbalance:.3f} | {cells[0]} | {cells[1]} | {best[0]} | "
                  f"{moved[0]} | {moved[1]} |")


MEDIAN = 8192


def doc_lengths(total):
    """Log-normal documents (W1's sigma, median MEDIAN tokens, capped at 1M) until ``total`` tokens."""
    lengths, seed = [], 0
    while sum(lengths) < total:
        lengths += lognormal_lengths(64, MEDIAN, 0.8, 16, 1 << 20, seed=seed)
        seed += 1
    out, acc = [], 0
    for n in lengths:
        if acc + n >= total:
            out.append(total - acc)
            break
        out.append(n)
        acc += n
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batch, fewer rounds")
    parser.add_argument("--world-sizes", default="1,2,3,4")
    parser.add_argument("--model-only", action="store_true")
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"# bench_distributed: commit {commit}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average at start {' '.join(load)}\n")
    plans_table()
    if not args.model_only:
        total = 2048 if args.quick else 8192
        part1([int(w) for w in args.world_sizes.split(",")], scaled(W1_LENGTHS, total), 2 if args.quick else 5)
        with open("/proc/loadavg") as f:
            print(f"\nload average after the measured part: {' '.join(f.read().split()[:3])}")
    part2([8, 16, 32, 64, 128, 256, 512, 1024], 16384, 1 << 20)


if __name__ == "__main__":
    main()
