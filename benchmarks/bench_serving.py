"""Continuous-batching benchmark: jagged_sdpa on a paged KV cache vs padded dense SDPA vs NJT SDPA.

One simulated server (``examples/serving.py``: Poisson arrivals, log-normal prompts, chunked
prefill under a token budget, a block allocator) produces the steps. Every step, with the same
random q/k/v per layer, runs through each implementation in turn (the order rotates each step),
each keeping its own KV storage:

- ``jagged paged``: ``paged_append`` + ``varlen_attention`` over the block table (automatic
  backend selection, or ``--backend``), no padding anywhere.
- ``padded``: what a server without ragged attention writes: one padded cache row per request,
  the step's queries padded to its longest chunk, one dense SDPA call with a boolean mask
  (bottom-right causal + key padding).
- ``padded split``: a smarter padded loop, with separate padded SDPA calls for the decoding and
  the prefilling requests of the step.
- ``torch NJT``: PyTorch's NJT SDPA, on the steps it can take: decode-only steps (one query per
  request sees every key, so no causal mask is needed). A mixed step needs bottom-right causal
  masks for chunks, which NJT SDPA cannot express. NJT SDPA has no GQA: K/V heads are expanded.

Reported: tokens/s over all steps (prefill + decode tokens / time), per-step latency p50/p90/p99
(all layers of a step), the same on decode-only steps, and correctness: every implementation vs
the jagged output on every step, and all of them vs a float64 per-request reference on a sample.

    python benchmarks/bench_serving.py [--quick] [--threads 1] [--dtype bfloat16] [--backend cpu_fused]
                                       [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from serving import (  # noqa: E402  (examples/serving.py: the simulated server; it finds jagged_sdpa)
    BlockAllocator,
    ModelShape,
    PagedAttentionStack,
    Scheduler,
    StepPlan,
    Workload,
    random_layer_inputs,
)
from jagged_sdpa import NoBackendError  # noqa: E402  (importable once serving.py set the path)


# ----------------------------------------------------------------------------------------------
# the padded loops


class StepIndex:
    """Where each packed new token sits: its request (row of the step) and position in its chunk."""

    def __init__(self, plan: StepPlan, device):
        n = torch.tensor(plan.new_tokens)
        self.device = device
        self.batch = len(plan.requests)
        self.row = torch.repeat_interleave(torch.arange(self.batch), n)
        starts = torch.cumsum(n, 0) - n
        self.pos_q = torch.arange(int(n.sum())) - torch.repeat_interleave(starts, n)
        self.cached = torch.tensor(plan.cached)
        self.pos_k = self.cached[self.row] + self.pos_q
        self.slot = torch.tensor([r.slot for r in plan.requests])
        self.len_q = n
        self.len_k = self.cached + n
        self.prompt = torch.tensor([r.prompt_len for r in plan.requests])
        # Built on the host (the plan is host data) and moved in one go per tensor.
        for name in ("row", "pos_q", "cached", "pos_k", "slot", "len_q", "len_k", "prompt"):
            setattr(self, name, getattr(self, name).to(device))


class PaddedGroup(NamedTuple):
    """Requests of a step padded together: their packed tokens, each token's row and position in the
    padded batch, their cache slots, the padded sizes and the (rows, 1, max_q, max_k) keep-mask."""

    tokens: torch.Tensor
    row: torch.Tensor
    pos_q: torch.Tensor
    slots: torch.Tensor
    max_q: int
    max_k: int
    keep: torch.Tensor


class PaddedCacheStack:
    """One cache row per request slot (max_running, Hkv, max_len, D) per layer, padded attention."""

    def __init__(self, shape: ModelShape, max_running: int, max_len: int, *, split: bool):
        cache = (max_running, shape.heads_kv, max_len, shape.head_dim)
        self.k_caches = [torch.zeros(cache, dtype=shape.dtype, device=shape.device) for _ in range(shape.layers)]
        self.v_caches = [torch.zeros(cache, dtype=shape.dtype, device=shape.device) for _ in range(shape.layers)]
        self.device = shape.device
        self.split = split
        self.name = "padded split" if split else "padded"

    @staticmethod
    def append(k_cache, v_cache, ix: StepIndex, k_new, v_new) -> None:
        slot = ix.slot[ix.row]
        k_cache[slot, :, ix.pos_k] = k_new
        v_cache[slot, :, ix.pos_k] = v_new

    @staticmethod
    def group_layout(ix: StepIndex, rows: torch.Tensor) -> PaddedGroup:
        """The padding plan of the step rows ``rows``, made once per step (not per layer)."""
        tokens = torch.isin(ix.row, rows).nonzero().squeeze(1)
        where = torch.full((ix.batch,), -1, dtype=torch.long, device=ix.device)
        where[rows] = torch.arange(rows.numel(), device=ix.device)
        b = where[ix.row[tokens]]
        len_q, len_k = ix.len_q[rows], ix.len_k[rows]
        max_q, max_k = int(len_q.max()), int(len_k.max())
        i = torch.arange(max_q, device=ix.device).view(1, -1, 1)
        j = torch.arange(max_k, device=ix.device).view(1, 1, -1)
        # Bottom-right causal and key padding; padded query rows see every real key (no NaN).
        keep = (j <= i + (len_k - len_q).view(-1, 1, 1)) & (j < len_k.view(-1, 1, 1))
        return PaddedGroup(tokens, b, ix.pos_q[tokens], ix.slot[rows], max_q, max_k, keep.unsqueeze(1))

    @staticmethod
    def attend(q, k_cache, v_cache, g: PaddedGroup) -> torch.Tensor:
        """Padded dense SDPA for one group of the step; returns the outputs of its packed tokens."""
        q_pad = q.new_zeros(g.slots.numel(), g.max_q, q.shape[1], q.shape[2])
        q_pad[g.row, g.pos_q] = q[g.tokens]
        k = k_cache[g.slots, :, :g.max_k]
        v = v_cache[g.slots, :, :g.max_k]
        out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k, v, attn_mask=g.keep, enable_gqa=True)
        return out.transpose(1, 2)[g.row, g.pos_q]

    def step(self, plan: StepPlan, layer_inputs) -> list[torch.Tensor]:
        ix = StepIndex(plan, self.device)
        if self.split:
            decode = (ix.len_q == 1) & (ix.cached >= ix.prompt)
            groups = [g for g in (decode.nonzero().squeeze(1), (~decode).nonzero().squeeze(1)) if g.numel()]
        else:
            groups = [torch.arange(ix.batch, device=self.device)]
        layouts = [self.group_layout(ix, rows) for rows in groups]
        outs = []
        for (q, k_new, v_new), k_cache, v_cache in zip(layer_inputs, self.k_caches, self.v_caches):
            self.append(k_cache, v_cache, ix, k_new, v_new)
            out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
            for group in layouts:
                out[group.tokens] = self.attend(q, k_cache, v_cache, group)
            outs.append(out)
        return outs

    def keys_of(self, layer: int, req, length: int):
        return (self.k_caches[layer][req.slot, :, :length].transpose(0, 1),
                self.v_caches[layer][req.slot, :, :length].transpose(0, 1))


class NjtStack(PaddedCacheStack):
    """PyTorch NJT SDPA over keys gathered from per-request cache rows; decode-only steps."""

    def __init__(self, shape: ModelShape, max_running: int, max_len: int):
        super().__init__(shape, max_running, max_len, split=False)
        self.name = "torch NJT"
        self.group = shape.heads_q // shape.heads_kv

    def step(self, plan: StepPlan, layer_inputs) -> list[torch.Tensor]:
        ix = StepIndex(plan, self.device)
        key_row = torch.repeat_interleave(ix.slot, ix.len_k)
        starts = torch.cumsum(ix.len_k, 0) - ix.len_k
        key_pos = torch.arange(key_row.numel(), device=self.device) - torch.repeat_interleave(starts, ix.len_k)
        offsets_q = torch.arange(ix.batch + 1, device=self.device)
        offsets_k = torch.cat([torch.zeros(1, dtype=torch.long, device=self.device), torch.cumsum(ix.len_k, 0)])
        njt = torch.nested.nested_tensor_from_jagged
        outs = []
        for (q, k_new, v_new), k_cache, v_cache in zip(layer_inputs, self.k_caches, self.v_caches):
            self.append(k_cache, v_cache, ix, k_new, v_new)
            # NJT SDPA has no GQA: every kv head is repeated for its query heads.
            k = k_cache[key_row, :, key_pos].repeat_interleave(self.group, dim=1)
            v = v_cache[key_row, :, key_pos].repeat_interleave(self.group, dim=1)
            q_njt = njt(q, offsets_q, min_seqlen=1, max_seqlen=1).transpose(1, 2)
            max_k = int(ix.len_k.max())
            k_njt = njt(k, offsets_k, max_seqlen=max_k).transpose(1, 2)
            v_njt = njt(v, offsets_k, max_seqlen=max_k).transpose(1, 2)
            out = F.scaled_dot_product_attention(q_njt, k_njt, v_njt)
            outs.append(out.transpose(1, 2).values())
        return outs

    def append_only(self, plan: StepPlan, layer_inputs) -> None:
        """Keep the cache in step on the steps NJT SDPA cannot attend."""
        ix = StepIndex(plan, self.device)
        for (_, k_new, v_new), k_cache, v_cache in zip(layer_inputs, self.k_caches, self.v_caches):
            self.append(k_cache, v_cache, ix, k_new, v_new)


# ----------------------------------------------------------------------------------------------
# reference and statistics


def reference_step(plan: StepPlan, layer_inputs, keys_of, layer: int) -> torch.Tensor:
    """float64, one request at a time, explicit bottom-right causal mask; independent of jagged_sdpa."""
    q_all = layer_inputs[layer][0]
    group = q_all.shape[1] // layer_inputs[layer][1].shape[1]
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    start = 0
    for req, n, total in zip(plan.requests, plan.new_tokens, plan.total_after):
        k, v = keys_of(layer, req, total)
        q = q_all[start:start + n].cpu().double().transpose(0, 1)                 # (Hq, n, D)
        k = k.cpu().double().transpose(0, 1).repeat_interleave(group, 0)          # (Hq, total, D)
        v = v.cpu().double().transpose(0, 1).repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        keep = torch.arange(total).view(1, -1) <= torch.arange(n).view(-1, 1) + (total - n)
        scores = scores.masked_fill(~keep, -math.inf)
        out[start:start + n] = (torch.softmax(scores, -1) @ v).transpose(0, 1)
        start += n
    return out


ABS_FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # tests/support/tolerances.py


def percentile(values, p):
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class Timings:
    def __init__(self):
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.max_diff = 0.0           # vs the jagged output, every step
        self.max_ref_err = 0.0        # vs float64, sampled steps

    def add(self, seconds, tokens):
        self.seconds.append(seconds)
        self.tokens.append(tokens)

    def row(self):
        total = sum(self.seconds)
        ms = [s * 1e3 for s in self.seconds]
        return (len(ms), sum(self.tokens) / total if total else float("nan"),
                percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


# ----------------------------------------------------------------------------------------------
# the run


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} cpu ({os.cpu_count()} cores)"


def timed(device: str, fn, *args):
    """(result, seconds); on CUDA it waits for the device, so the time covers the work, not the launch."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    result = fn(*args)
    sync()
    return result, time.perf_counter() - start


def simulate(args, shape: ModelShape, workload: Workload, *, measure: bool):
    requests = workload.generate(args.seed)
    max_len = max(r.max_tokens for r in requests)
    num_blocks = sum(-(-r.max_tokens // args.block_size) for r in requests)
    backend = args.backend or None
    jagged = PagedAttentionStack(shape, num_blocks, args.block_size, backend=backend)
    padded = PaddedCacheStack(shape, args.max_running, max_len, split=False)
    split = PaddedCacheStack(shape, args.max_running, max_len, split=True)
    njt = NjtStack(shape, args.max_running, max_len)
    stacks = [jagged, padded, split]
    names = [s.name for s in stacks] + [njt.name]
    all_steps = {name: Timings() for name in names}
    decode_steps = {name: Timings() for name in names}
    scheduler = Scheduler(requests, BlockAllocator(num_blocks, args.block_size),
                          token_budget=args.token_budget, max_running=args.max_running)
    gen = torch.Generator().manual_seed(args.seed + 1)
    chosen = None
    index = 0
    while not scheduler.done:
        plan = scheduler.plan()
        if plan is None:
            continue
        inputs = random_layer_inputs(plan, shape, gen)
        if chosen is None:
            chosen = jagged.explain(plan, inputs).chosen
        outs = {}
        order = stacks[index % len(stacks):] + stacks[:index % len(stacks)]
        for stack in order:
            outs[stack.name], seconds = timed(shape.device, stack.step, plan, inputs)
            all_steps[stack.name].add(seconds, plan.total_new)
            if plan.decode_only:
                decode_steps[stack.name].add(seconds, plan.total_new)
        if plan.decode_only:
            outs[njt.name], seconds = timed(shape.device, njt.step, plan, inputs)
            decode_steps[njt.name].add(seconds, plan.total_new)
        else:
            njt.append_only(plan, inputs)
        base = outs[jagged.name]
        for name, result in outs.items():
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(result, base))
            for table in (all_steps, decode_steps):
                table[name].max_diff = max(table[name].max_diff, diff)
        if measure and index % args.check_every == 0:
            layer = index % shape.layers
            ref = reference_step(plan, inputs, padded.keys_of, layer)
            for name, result in outs.items():
                err = (result[layer].cpu().double() - ref).abs().max().item()
                for table in (all_steps, decode_steps):
                    table[name].max_ref_err = max(table[name].max_ref_err, err)
        scheduler.commit(plan)
        index += 1
    return all_steps, decode_steps, chosen, index


def format_table(title, timings, tokens_label="tokens/s"):
    lines = [f"{title}", "",
             f"| implementation | steps | {tokens_label} | vs padded | p50 ms | p90 ms | p99 ms "
             f"| max diff vs jagged | max err vs float64 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    padded_rate = timings["padded"].row()[1]
    for name, t in timings.items():
        steps, rate, p50, p90, p99 = t.row()
        if not steps:
            lines.append(f"| {name} | 0 | - | - | - | - | - | - | - |")
            continue
        lines.append(f"| {name} | {steps} | {rate:,.0f} | {rate / padded_rate:.2f}x | {p50:.2f} | {p90:.2f} | "
                     f"{p99:.2f} | {t.max_diff:.1e} | {t.max_ref_err:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="continuous-batching benchmark over a paged KV cache")
    parser.add_argument("--quick", action="store_true", help="a small workload (< 60 s)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--backend", default=None, help="force a jagged_sdpa backend (default: automatic)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--check-every", type=int, default=None, help="float64 check every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads, 0 = torch's default. 1 by default: on a shared machine "
                             "multi-threaded small ops stall whenever another process holds a core")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.quick:
        workload = Workload(requests=args.requests or 24, arrivals_per_step=1.0, prompt_median=96,
                            prompt_max=512, output_min=8, output_max=32)
        args.token_budget = args.token_budget or 192
        args.check_every = args.check_every or 15
    else:
        workload = Workload(requests=args.requests or 64, arrivals_per_step=0.4, prompt_median=192,
                            prompt_max=2048, output_max=192)
        args.token_budget = args.token_budget or 512
        args.check_every = args.check_every or 25
    shape = ModelShape(layers=args.layers, heads_q=8, heads_kv=2, head_dim=64, dtype=getattr(torch, args.dtype),
                       device=args.device)

    warm = Workload(requests=3, prompt_median=32, prompt_max=64, output_min=2, output_max=4)
    try:
        simulate(args, shape, warm, measure=False)
    except NoBackendError as error:  # a forced --backend that cannot serve a paged cache
        print(f"bench_serving: --backend {args.backend} cannot run this workload:\n{error}", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    started = time.perf_counter()
    all_steps, decode_steps, chosen, steps = simulate(args, shape, workload, measure=True)
    wall = time.perf_counter() - started

    load = os.getloadavg()
    if max(load_start[0], load[0]) > (os.cpu_count() or 1):
        print(f"# note: load average {max(load_start[0], load[0]):.1f} > {os.cpu_count()} cores: other processes "
              f"compete for the cores")
    print(f"# bench_serving: {steps} steps, {workload.requests} requests, token budget {args.token_budget}, "
          f"max running {args.max_running}, block size {args.block_size}")
    print(f"# shape: {shape.layers} layers, Hq={shape.heads_q} Hkv={shape.heads_kv} D={shape.head_dim} "
          f"{args.dtype} on {device_name(args.device)}; jagged backend: {chosen}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {load_start[0]:.2f} at start, {load[0]:.2f} at end; "
          f"wall {wall:.1f} s")
    print()
    print(format_table("All steps (mixed prefill + decode):", {k: v for k, v in all_steps.items() if v.seconds}))
    print()
    print(format_table("Decode-only steps (the ones torch NJT SDPA can take):", decode_steps))
    jagged, padded = all_steps[PagedAttentionStack.name], all_steps["padded"]
    # Equal results: jagged is as close to float64 as the padded loop (within 2x, the tests' rule),
    # or within the tests' absolute floor for the dtype.
    allowed = max(2 * padded.max_ref_err, ABS_FLOOR[shape.dtype])
    equal = jagged.max_ref_err <= allowed
    print()
    print(f"jagged / padded tokens/s: {jagged.row()[1] / padded.row()[1]:.2f}x (target >= 2x); "
          f"jagged / padded split: {jagged.row()[1] / all_steps['padded split'].row()[1]:.2f}x")
    print(f"equal results: {'yes' if equal else 'NO'} (jagged max err vs float64 {jagged.max_ref_err:.1e}, "
          f"padded {padded.max_ref_err:.1e}, allowed {allowed:.1e})")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
