"""Offsets, lengths and block ids checked on the device, for calls that read nothing on the host.

An accelerator call that is given every max length reads no lengths on the host (no sync, so a
decode step can be captured in a CUDA graph). What ``layout.seqlen_stats``/``lengths_stats`` and
``inputs.validate_block_ids`` check on the host is then queued on the device, and bad contents
fail loudly (a device-side assert, reported at the next sync) instead of letting a kernel read
outside its tensors.

A call collects its checks in ``DeviceChecks`` and queues them once. On CUDA each check is one
small Triton kernel writing a flag, followed by one ``torch._assert_async`` over all flags: 4
launches for a varlen call with distinct cu_seqlens, where the same rules as torch ops took 22
(measured on an H100: about 250 us of the 512 us host overhead of a decode-sized call). Elsewhere
(other accelerators, no Triton) the rules run as torch ops; ``tests/backends/triton/test_backend_triton.py`` checks
that both forms agree on good and bad inputs.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Union

import torch
from torch import Tensor

MESSAGE_LIMIT = 255  # torch._assert_async: "Message length must be smaller than 255" (CUDA)


@dataclass
class DeviceChecks:
    """The device-side checks of one call, queued together by ``queue``."""

    cu: list = field(default_factory=list)        # (name, cu, total, max_seqlen, max_name)
    lengths: list = field(default_factory=list)   # (name, lengths, capacity, max_seqlen)
    block_ids: list = field(default_factory=list)  # (block_table, used, block_size, num_blocks)

    def add_cu(self, name: str, cu: Tensor, total: int, max_seqlen: int, max_name: str) -> None:
        """cu must start at 0, never decrease, end at ``total``, every entry in [0, total]; no length
        above ``max_seqlen`` (lengths taken in int64, so out-of-range offsets cannot wrap into range).
        The same tensor under the same bounds (self-attention) is checked once."""
        if not any(c is cu and t == total and m == max_seqlen for _, c, t, m, _ in self.cu):
            self.cu.append((name, cu, total, max_seqlen, max_name))

    def add_lengths(self, name: str, lengths: Tensor, capacity: Union[Tensor, int], max_seqlen: int) -> None:
        """0 <= lengths[b] <= capacity (cumulative offsets of the capacities, or one int for every
        b) and <= max_seqlen."""
        self.lengths.append((name, lengths, capacity, max_seqlen))

    def add_block_ids(self, block_table: Tensor, used: Tensor, block_size: int, num_blocks: int) -> None:
        """The block ids a call reads (the first ceil(used[b] / block_size) of row b) exist."""
        self.block_ids.append((block_table, used, block_size, num_blocks))

    def message(self) -> str:
        """What failed, in the < 255 characters ``torch._assert_async`` accepts (CUDA refuses
        longer messages outright): the arguments checked and the rules, without values."""
        names = [c[0] for c in self.cu] + [c[0] for c in self.lengths] + ["block_table"] * bool(self.block_ids)
        text = (f"jagged_sdpa: bad {', '.join(dict.fromkeys(names))}: offsets must start at 0, not decrease, "
                "stay within and end at the packed length; lengths within capacity and the max seqlens given; "
                "block ids in range")
        return text if len(text) < MESSAGE_LIMIT else text[:MESSAGE_LIMIT - 4] + "..."

    def queue(self) -> None:
        """Queue every check, with one assert; no host sync either way."""
        tensors = [c[1] for c in self.cu] + [c[1] for c in self.lengths] + [c[0] for c in self.block_ids]
        if not tensors:
            return
        kernels = _triton_kernels() if tensors[0].is_cuda else None
        ok = _flags_triton(self, kernels) if kernels is not None else _flags_torch(self)
        torch._assert_async(ok.all(), self.message())


def _flags_torch(checks: DeviceChecks) -> Tensor:
    """One boolean per check, from torch ops (any device)."""
    flags = []
    for _, cu, total, max_seqlen, _ in checks.cu:
        wide = cu.to(torch.int64)  # int32 differences of out-of-range offsets would wrap
        lengths = wide[1:] - wide[:-1]
        ok = (cu[0] == 0) & (cu[-1] == total) & (wide.min() >= 0) & (wide.max() <= total)
        if lengths.numel():
            ok = ok & (lengths.min() >= 0) & (lengths.max() <= max_seqlen)
        flags.append(ok)
    for _, lengths, capacity, max_seqlen in checks.lengths:
        if lengths.numel():
            if not isinstance(capacity, int):
                capacity = capacity.to(torch.int64)
            cap = capacity if isinstance(capacity, int) else capacity[1:] - capacity[:-1]
            flags.append((lengths.min() >= 0) & (lengths <= cap).all() & (lengths.max() <= max_seqlen))
    for table, used, block_size, num_blocks in checks.block_ids:
        if table.numel():
            needed = (used.to(torch.int64) + block_size - 1) // block_size
            read = torch.arange(table.shape[1], device=table.device)[None, :] < needed[:, None]
            flags.append(((table >= 0) & (table < num_blocks) | ~read).all())
    device = (checks.cu or checks.lengths or checks.block_ids)[0][1].device
    return torch.stack(flags) if flags else torch.ones(1, dtype=torch.bool, device=device)


def _flags_triton(checks: DeviceChecks, kernels) -> Tensor:
    """One int32 flag per check (per sequence for block ids), each written by a Triton kernel."""
    n_flags = len(checks.cu) + len(checks.lengths) + sum(max(t.shape[0], 1) for t, *_ in checks.block_ids)
    first = (checks.cu or checks.lengths or checks.block_ids)[0][1]
    ok = torch.empty(n_flags, dtype=torch.int32, device=first.device)
    slot = 0
    with torch.cuda.device(first.device) if first.is_cuda else contextlib.nullcontext():
        for _, cu, total, max_seqlen, _ in checks.cu:
            kernels.cu_ok[(1,)](ok, slot, cu, cu.shape[0] - 1, total, max_seqlen, BLOCK=1024)
            slot += 1
        for _, lengths, capacity, max_seqlen in checks.lengths:
            fixed = isinstance(capacity, int)
            kernels.lengths_ok[(1,)](ok, slot, lengths, lengths.shape[0], lengths if fixed else capacity,
                                     capacity if fixed else 0, max_seqlen, CAP_FROM_CU=not fixed, BLOCK=1024)
            slot += 1
        for table, used, block_size, num_blocks in checks.block_ids:
            rows = max(table.shape[0], 1)
            kernels.block_ids_ok[(rows,)](ok, slot, table, table.stride(0), table.stride(1), used, table.shape[0],
                                          table.shape[1], block_size, num_blocks, BLOCK=256)
            slot += rows
    return ok


@functools.cache
def _triton_kernels():
    """The Triton kernels, or None where Triton cannot be imported (the torch-op form runs)."""
    try:
        from jagged_sdpa.checks import _device_kernels
    except Exception:  # no triton, or a broken install: the torch-op form is always available
        return None
    return _device_kernels
