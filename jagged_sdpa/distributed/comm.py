"""The few collectives the algorithms use, behind one small interface.

``GroupComm`` wraps a ``torch.distributed`` process group (gloo, NCCL); ``local.LocalComm`` runs
every rank as a thread of one process (fast tests). Timeouts come from the process group (or
the local world), so a rank that never arrives fails a collective instead of hanging it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Comm:
    """rank, world_size, and three collectives: all_to_all (1-D, element counts), all_gather_header
    (a small int64 vector from every rank, stacked), all_gather_object (any picklable value)."""

    rank: int
    world_size: int

    def all_to_all(self, send: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
        raise NotImplementedError

    def all_gather_header(self, header: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather_object(self, obj) -> list:
        raise NotImplementedError


class GroupComm(Comm):
    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_to_all(self, send, send_counts, recv_counts):
        out = send.new_empty(int(sum(recv_counts)))
        dist.all_to_all_single(out, send.contiguous(), [int(c) for c in recv_counts],
                               [int(c) for c in send_counts], group=self.group)
        return out

    def all_gather_header(self, header):
        out = header.new_empty(self.world_size * header.numel())
        # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, header.contiguous(), group=self.group)
        return out.view(self.world_size, -1)

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def resolve(group, argument: str = "group") -> Comm:
    """A Comm for ``group``: a Comm as is, else a process group (None = the default group)."""
    if isinstance(group, Comm):
        return group
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{argument}: torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group first (or pass a communicator)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{argument}: expected a torch.distributed ProcessGroup or None, "
                        f"got {type(group).__name__}")
    return GroupComm(group)


def header_device(comm: Comm, x) -> torch.device | str:
    """Where the agreement header travels: the CPU for gloo and in-process ranks, the data's device
    for device-only backends (NCCL)."""
    if not isinstance(comm, GroupComm) or not isinstance(x, torch.Tensor) or x.device.type == "cpu":
        return "cpu"
    return "cpu" if dist.get_backend(comm.group) == "gloo" else x.device
