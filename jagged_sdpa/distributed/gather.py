"""``plan.unshard``: every rank's rows, back in global order, on every rank.

One all-to-all in which each rank sends its rows to every rank (so the backward is the reverse
all-to-all: each rank gets back the gradient of its rows from every rank, summed).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from jagged_sdpa.distributed.agree import agree, digest
from jagged_sdpa.distributed.comm import header_device, resolve
from jagged_sdpa.distributed.exchange import all_to_all


def unshard(plan, x_local, group=None) -> torch.Tensor:
    comm = resolve(group)
    error, fields = None, {"plan": plan.digest, "x_local": 0}
    try:
        if plan.world_size != comm.world_size:
            raise ValueError(f"plan: made for world_size {plan.world_size}, but the group has {comm.world_size} ranks")
        if not isinstance(x_local, torch.Tensor):
            raise TypeError(f"x_local: expected a tensor, got {type(x_local).__name__}")
        if x_local.dim() < 1 or x_local.shape[0] != plan.tokens[comm.rank]:
            raise ValueError(f"x_local: expected {plan.tokens[comm.rank]} rows (rank {comm.rank}'s share of the "
                             f"plan), got shape {tuple(x_local.shape)}")
        fields["x_local"] = digest((str(x_local.dtype), tuple(x_local.shape[1:]), x_local.requires_grad))
    except (ValueError, TypeError) as exc:
        error = exc
    agree(comm, fields, error, device=header_device(comm, x_local))
    W, width = comm.world_size, math.prod(x_local.shape[1:])
    flat = x_local.reshape(-1)
    received = all_to_all(flat.repeat(W), comm, [flat.numel()] * W, [t * width for t in plan.tokens])
    in_plan_order = received.view(plan.total, *x_local.shape[1:])
    inverse = plan.device_tensor("plan_inverse", lambda: np.argsort(
        np.concatenate([plan.rows(r) for r in range(W)])), x_local.device)
    return in_plan_order.index_select(0, inverse)
