"""Differentiable collectives: every data movement of the algorithms goes through these two.

``all_to_all``: the backward of an all-to-all is the reverse all-to-all (Ulysses, unshard).
``gather_keys``: rows of a row-sharded tensor that other ranks' queries read, fetched with one
all-to-all of only the rows each rank needs; its backward sends the gradient of every fetched
row home and sums it there in float32 (like a float32 reduce-scatter), cast once at the end.
torch.distributed.nn.functional is not used: its all_gather takes no uneven sizes, and the
gather's backward here must sum in float32 before the cast, which its all_to_all would not do.
"""

from __future__ import annotations

import torch


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send, comm, send_counts, recv_counts):
        ctx.comm, ctx.counts = comm, (send_counts, recv_counts)
        return comm.all_to_all(send.contiguous(), send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return ctx.comm.all_to_all(grad.contiguous(), recv_counts, send_counts), None, None, None


def all_to_all(send: torch.Tensor, comm, send_counts, recv_counts) -> torch.Tensor:
    """1-D ``send`` split by ``send_counts`` (elements per destination); returns the pieces
    received from every rank, concatenated in rank order."""
    return _AllToAll.apply(send, comm, list(send_counts), list(recv_counts))


class _GatherKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, comm, send_index, send_rows, recv_rows, key_index):
        width = local.shape[1]
        send = local.index_select(0, send_index).reshape(-1)
        recv = comm.all_to_all(send, [n * width for n in send_rows], [n * width for n in recv_rows])
        buffer = torch.cat([local, recv.view(-1, width)])
        ctx.comm, ctx.rows = comm, (send_rows, recv_rows)
        ctx.save_for_backward(send_index, key_index)
        ctx.shape = local.shape
        return buffer.index_select(0, key_index)

    @staticmethod
    def backward(ctx, grad):
        send_index, key_index = ctx.saved_tensors
        send_rows, recv_rows = ctx.rows
        n, width = ctx.shape
        acc_dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
        acc = torch.zeros(n + sum(recv_rows), width, dtype=acc_dtype, device=grad.device)
        acc.index_add_(0, key_index, grad.to(acc_dtype))
        back = ctx.comm.all_to_all(acc[n:].reshape(-1), [r * width for r in recv_rows],
                                   [s * width for s in send_rows])
        local = acc[:n].index_add_(0, send_index, back.view(-1, width))
        return local.to(grad.dtype), None, None, None, None, None


def gather_keys(local: torch.Tensor, comm, route) -> torch.Tensor:
    """(n_local, C) rows -> (n_keys, C): the rows ``route.key_index`` names in the buffer
    [local rows | rows received from rank 0 | from rank 1 | ...]."""
    return _GatherKeys.apply(local, comm, route.send_index(local.device), route.send_rows,
                             route.recv_rows, route.key_index(local.device))
