"""In-process ranks: every rank of a world is a thread, collectives meet at a barrier.

Runs the distributed code paths unchanged (same Comm interface, same autograd Functions) without
process groups, so most tests run in one process in lockstep. A rank that fails aborts the
barrier, so the others fail too instead of waiting; every wait has a timeout.
"""

from __future__ import annotations

import threading

import torch

from jagged_sdpa.distributed.comm import Comm


class _Barrier:
    """A barrier that a failing rank breaks only for the ranks still waiting in it."""

    def __init__(self, parties: int, timeout: float):
        self.parties, self.timeout = parties, timeout
        self.count, self.generation, self.failed = 0, 0, None
        self.cond = threading.Condition()

    def wait(self):
        with self.cond:
            generation = self.generation
            self.count += 1
            if self.count == self.parties:
                self.count, self.generation = 0, self.generation + 1
                self.cond.notify_all()
                return
            self.cond.wait_for(lambda: self.generation != generation or self.failed, self.timeout)
            if self.generation != generation:
                return
            if self.failed:
                raise RuntimeError(f"local world: another rank failed ({self.failed})")
            raise TimeoutError(f"local world: a collective waited {self.timeout} s for the other ranks")

    def abort(self, why):
        with self.cond:
            self.failed = why
            self.cond.notify_all()


class LocalWorld:
    def __init__(self, world_size: int, timeout: float = 60.0):
        self.world_size = world_size
        self.barrier = _Barrier(world_size, timeout)
        self.slots = [None] * world_size

    def comm(self, rank: int) -> "LocalComm":
        return LocalComm(self, rank)


class LocalComm(Comm):
    def __init__(self, world: LocalWorld, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.world_size

    def _gather(self, value) -> list:
        self.world.slots[self.rank] = value
        self.world.barrier.wait()
        values = list(self.world.slots)
        self.world.barrier.wait()
        return values

    def all_to_all(self, send, send_counts, recv_counts):
        sent = self._gather((send, [int(c) for c in send_counts]))
        parts = []
        for src, (buf, counts) in enumerate(sent):
            start = sum(counts[:self.rank])
            if counts[self.rank] != int(recv_counts[src]):
                raise RuntimeError(f"all_to_all: rank {self.rank} expects {int(recv_counts[src])} "
                                   f"elements from rank {src}, which sends {counts[self.rank]}")
            parts.append(buf[start:start + counts[self.rank]])
        return torch.cat(parts) if parts else send.new_empty(0)

    def all_gather_header(self, header):
        return torch.stack(self._gather(header.clone()))

    def all_gather_object(self, obj):
        return self._gather(obj)


def run_local(fn, world_size: int, timeout: float = 60.0) -> list:
    """Run ``fn(comm)`` on ``world_size`` thread-ranks; return each rank's result or exception."""
    world = LocalWorld(world_size, timeout)
    results = [None] * world_size

    def body(rank):
        try:
            results[rank] = fn(world.comm(rank))
        except BaseException as exc:  # handed back to the caller, rank by rank
            results[rank] = exc
            world.barrier.abort(f"rank {rank}: {type(exc).__name__}")

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"run_local: a rank did not finish within {timeout} s")
    return results
