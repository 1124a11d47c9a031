"""A continuous-batching server loop over a paged KV cache, with jagged_sdpa doing the attention.

Requests arrive over time with log-normal prompt lengths and varied output lengths. Each step the
scheduler builds one mixed batch under a token budget: every decoding request contributes one
token and prefilling requests contribute chunks of their prompt (chunked prefill). The keys and
values live in a paged cache: a block allocator hands out fixed-size blocks when a request is
admitted and takes them back when it finishes. Per step and per layer, the new keys/values are
written with ``jagged_sdpa.paged_append`` and attention runs with ``jagged_sdpa.varlen_attention``
over the block table, bottom-right causal, without padding anything.

The model is only its attention layers (random q/k/v per layer): what is shown is the attention
and cache machinery a server needs. ``benchmarks/bench_serving.py`` reuses this module and runs
the same loop against padded dense SDPA and PyTorch's NJT SDPA.

    python examples/serving.py [--requests 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

try:
    import jagged_sdpa
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jagged_sdpa


# ----------------------------------------------------------------------------------------------
# workload


@dataclass
class Request:
    rid: int
    arrival_step: int
    prompt_len: int
    output_len: int
    cached: int = 0                 # tokens whose keys/values are in the cache
    generated: int = 0              # output tokens produced so far
    blocks: list[int] = field(default_factory=list)
    slot: int = -1                  # a per-request row, for loops that keep one (padded caches)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.generated >= self.output_len

    @property
    def max_tokens(self) -> int:
        """Keys the request will ever hold: its prompt and every output token but the last."""
        return self.prompt_len + self.output_len - 1


@dataclass(frozen=True)
class Workload:
    """How requests arrive: Poisson arrivals per step, log-normal prompts, uniform output lengths."""

    requests: int = 48
    arrivals_per_step: float = 0.5
    prompt_median: int = 160
    prompt_sigma: float = 0.9
    prompt_max: int = 1536
    output_min: int = 8
    output_max: int = 160

    def generate(self, seed: int) -> list[Request]:
        rng = random.Random(seed)
        step, out = 0.0, []
        for rid in range(self.requests):
            step += rng.expovariate(self.arrivals_per_step)
            prompt = int(round(rng.lognormvariate(math.log(self.prompt_median), self.prompt_sigma)))
            prompt = max(1, min(self.prompt_max, prompt))
            output = rng.randint(self.output_min, self.output_max)
            out.append(Request(rid, int(step), prompt, output))
        return out


# ----------------------------------------------------------------------------------------------
# paged cache bookkeeping


class BlockAllocator:
    """Hands out cache block ids and takes them back; a free list, nothing more."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self.free)

    def allocate(self, tokens: int) -> list[int]:
        n = self.blocks_for(tokens)
        if n > len(self.free):
            raise RuntimeError(f"{n} blocks asked for, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


@dataclass
class StepPlan:
    """One step's batch: request b contributes ``new_tokens[b]`` tokens after its ``cached`` ones."""

    requests: list[Request]
    new_tokens: list[int]
    step: int

    @property
    def cached(self) -> list[int]:
        return [r.cached for r in self.requests]

    @property
    def total_after(self) -> list[int]:
        return [r.cached + n for r, n in zip(self.requests, self.new_tokens)]

    @property
    def total_new(self) -> int:
        return sum(self.new_tokens)

    @property
    def decode_only(self) -> bool:
        return all(not r.prefilling for r in self.requests)


class Scheduler:
    """Admission, chunked prefill under a token budget, and release of finished requests.

    Blocks for a request's whole lifetime (prompt + outputs) are reserved when it is admitted, so
    a running request never waits for memory (a real server allocates lazily and preempts).
    """

    def __init__(self, workload: list[Request], allocator: BlockAllocator, *, token_budget: int, max_running: int):
        self.pending = sorted(workload, key=lambda r: r.arrival_step)
        self.allocator = allocator
        self.token_budget = token_budget
        self.max_running = max_running
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.free_slots = list(range(max_running - 1, -1, -1))
        self.step = 0

    @property
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def plan(self) -> Optional[StepPlan]:
        """The next step's batch, or None for an idle step (nothing has arrived yet)."""
        while self.pending and self.pending[0].arrival_step <= self.step:
            self.waiting.append(self.pending.pop(0))
        while (self.waiting and len(self.running) < self.max_running
               and self.allocator.can_allocate(self.waiting[0].max_tokens)):
            req = self.waiting.pop(0)
            req.blocks = self.allocator.allocate(req.max_tokens)
            req.slot = self.free_slots.pop()
            self.running.append(req)
        budget = self.token_budget
        chosen, counts = [], []
        for req in self.running:             # decodes first: one token each, latency-bound
            if not req.prefilling and budget > 0:
                chosen.append(req)
                counts.append(1)
                budget -= 1
        for req in self.running:             # then prompt chunks, oldest first
            if req.prefilling and budget > 0:
                n = min(budget, req.prompt_len - req.cached)
                chosen.append(req)
                counts.append(n)
                budget -= n
        plan = StepPlan(chosen, counts, self.step) if chosen else None
        self.step += 1
        return plan

    def commit(self, plan: StepPlan) -> list[Request]:
        """Advance the planned requests by their tokens; release and return the finished ones."""
        for req, n in zip(plan.requests, plan.new_tokens):
            req.cached += n
            if not req.prefilling:           # the last prompt chunk or a decode emits a token
                req.generated += 1
        finished = [r for r in self.running if r.finished]
        for req in finished:
            self.allocator.release(req.blocks)
            self.free_slots.append(req.slot)
            self.running.remove(req)
        return finished


# ----------------------------------------------------------------------------------------------
# the attention layers


@dataclass(frozen=True)
class ModelShape:
    layers: int = 4
    heads_q: int = 8
    heads_kv: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"


def random_layer_inputs(plan: StepPlan, shape: ModelShape, gen: torch.Generator):
    """(q, k_new, v_new) per layer for the step's packed new tokens: stand-ins for projections."""
    n = plan.total_new
    out = []
    for _ in range(shape.layers):
        q = torch.randn(n, shape.heads_q, shape.head_dim, generator=gen)
        k = torch.randn(n, shape.heads_kv, shape.head_dim, generator=gen)
        v = torch.randn(n, shape.heads_kv, shape.head_dim, generator=gen)
        out.append(tuple(t.to(shape.device, shape.dtype) for t in (q, k, v)))
    return out


class PagedAttentionStack:
    """One paged KV cache per layer; a step appends the new keys and attends, layer by layer."""

    name = "jagged_sdpa paged"

    def __init__(self, shape: ModelShape, num_blocks: int, block_size: int, backend=None):
        cache = (num_blocks, block_size, shape.heads_kv, shape.head_dim)
        self.k_caches = [torch.zeros(cache, dtype=shape.dtype, device=shape.device) for _ in range(shape.layers)]
        self.v_caches = [torch.zeros(cache, dtype=shape.dtype, device=shape.device) for _ in range(shape.layers)]
        self.device = shape.device
        self.backend = backend

    def step_metadata(self, plan: StepPlan):
        """cu_seqlens_q, block_table, seqused_k (before the append) and the two max lengths."""
        width = max(len(r.blocks) for r in plan.requests)
        table = [r.blocks + [0] * (width - len(r.blocks)) for r in plan.requests]
        table = torch.tensor(table, dtype=torch.int32, device=self.device)
        cu_q = torch.tensor([0, *_cumsum(plan.new_tokens)], dtype=torch.int32, device=self.device)
        used = torch.tensor(plan.cached, dtype=torch.int32, device=self.device)
        return cu_q, table, used, max(plan.new_tokens), max(plan.total_after)

    def explain(self, plan: StepPlan, layer_inputs) -> jagged_sdpa.Explanation:
        """Which backend the step's attention gets, and why not the others."""
        cu_q, table, _, max_q, max_k = self.step_metadata(plan)
        used = torch.tensor(plan.total_after, dtype=torch.int32, device=self.device)
        return jagged_sdpa.explain(layer_inputs[0][0], self.k_caches[0], self.v_caches[0], cu_q, None, max_q, max_k,
                                   causal=True, block_table=table, seqused_k=used, backend=self.backend)

    def step(self, plan: StepPlan, layer_inputs) -> list[torch.Tensor]:
        cu_q, table, used_before, max_q, max_k = self.step_metadata(plan)
        outs = []
        for (q, k_new, v_new), k_cache, v_cache in zip(layer_inputs, self.k_caches, self.v_caches):
            used = jagged_sdpa.paged_append(k_cache, v_cache, table, used_before, k_new, v_new, cu_q)
            outs.append(jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_q, None, max_q, max_k, causal=True,
                                                     block_table=table, seqused_k=used, backend=self.backend))
        return outs


def _cumsum(values):
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def dense_check(plan: StepPlan, stack: PagedAttentionStack, layer_inputs, outs) -> float:
    """Largest difference between the step's last layer and dense causal SDPA run per request."""
    q_all, _, _ = layer_inputs[-1]
    k_cache, v_cache = stack.k_caches[-1], stack.v_caches[-1]
    worst, start = 0.0, 0
    group = q_all.shape[1] // k_cache.shape[2]
    for req, n, total in zip(plan.requests, plan.new_tokens, plan.total_after):
        k = k_cache[req.blocks].flatten(0, 1)[:total].float().repeat_interleave(group, 1).transpose(0, 1)
        v = v_cache[req.blocks].flatten(0, 1)[:total].float().repeat_interleave(group, 1).transpose(0, 1)
        q = q_all[start:start + n].float().transpose(0, 1)
        keep = torch.arange(total).unsqueeze(0) <= torch.arange(n).unsqueeze(1) + (total - n)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(0, 1)
        worst = max(worst, (outs[-1][start:start + n].float() - ref).abs().max().item())
        start += n
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=256)
    args = parser.parse_args(argv)

    shape = ModelShape(layers=2)
    workload = Workload(requests=args.requests, prompt_median=96, output_max=48).generate(args.seed)
    num_blocks = sum(-(-r.max_tokens // args.block_size) for r in workload)
    scheduler = Scheduler(workload, BlockAllocator(num_blocks, args.block_size),
                          token_budget=args.token_budget, max_running=16)
    stack = PagedAttentionStack(shape, num_blocks, args.block_size)
    gen = torch.Generator().manual_seed(args.seed)
    tokens, elapsed, steps, worst = 0, 0.0, 0, 0.0
    while not scheduler.done:
        plan = scheduler.plan()
        if plan is None:
            continue
        layer_inputs = random_layer_inputs(plan, shape, gen)
        if steps == 0:
            print(stack.explain(plan, layer_inputs))
        start = time.perf_counter()
        outs = stack.step(plan, layer_inputs)
        elapsed += time.perf_counter() - start
        if steps % 10 == 0:
            worst = max(worst, dense_check(plan, stack, layer_inputs, outs))
        tokens += plan.total_new
        steps += 1
        finished = scheduler.commit(plan)
        for req in finished:
            print(f"step {plan.step:4d}: request {req.rid:3d} done (prompt {req.prompt_len}, output {req.output_len})")
    print(f"{steps} steps, {tokens} tokens, {tokens / elapsed:,.0f} tokens/s through {shape.layers} attention layers; "
          f"largest difference to dense SDPA on sampled steps: {worst:.2e}")


if __name__ == "__main__":
    main()
