"""Context-parallel attention over one ragged batch, one process per rank (gloo on the CPU).

    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py

Every rank builds the same plan from the lengths, keeps only its rows, and gets exactly the rows
of the single-process call (checked at the end). Use "nccl" and one GPU per rank on GPUs.
"""

import torch
import torch.distributed as dist

import jagged_sdpa
from jagged_sdpa import distributed as jd


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    lengths = [300, 17, 1200, 5, 640, 0, 90]                  # a ragged packed batch
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)                    # the same batch on every rank (demo only)
    q, k, v = (torch.randn(sum(lengths), h, 64, generator=gen) for h in (8, 2, 2))

    plan = jd.plan_shards(cu_seqlens, world_size, causal=True)   # host-side, identical on every rank
    q_local, k_local, v_local = (plan.shard(x, rank).requires_grad_() for x in (q, k, v))
    positions = plan.positions(rank)                          # for rotary embeddings of the local rows
    if rank == 0:
        print(plan)
        print(jd.explain(plan, q_local, k_local, v_local, causal=True))

    out = jd.varlen_attention(q_local, k_local, v_local, plan, causal=True)
    out.square().sum().backward()                             # gradients reach the local q, k, v

    full = plan.unshard(out.detach())                         # collective: all rows, global order
    expected = jagged_sdpa.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=True)
    error = (full - expected).abs().max().item()
    print(f"rank {rank}: {q_local.shape[0]} rows, positions {positions[:3].tolist()}..., "
          f"max |distributed - single process| = {error:.2e}, dq norm {q_local.grad.norm():.3f}")
    assert error < 1e-5
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
