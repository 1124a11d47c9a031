"""Count what one TRITON paged decode call launches, on the CPU: aten ops and Triton kernel calls.

``TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/launch_count.py [--accelerator-path] [--step] [--ops]
[--dim 16 --shrink 4]`` (the last two only make the interpreter faster: the launches are the same).

Host time of a decode call is mostly launches, so their count is a proxy a CPU can measure. The
call is bench_cuda's paged decode (B16, 32/8 heads, D128, contexts 1.5-2.5k, block 16) with an
H200's split-K plan (264 programs wanted), along the path an unobserved call takes (no operator
round trip). Aten ops made inside a Triton call (the interpreter's copies) are not counted; one
aten op may be several GPU kernels (logsumexp). ``--accelerator-path``: the call as on a GPU with
max lengths given (no host read of lengths; device-side checks through their Triton kernels when
the batch is validated); ``--step``: the metadata updated in place first, so it is validated again.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that allocate or view without launching a kernel on a GPU.
NO_LAUNCH = {"empty", "empty_strided", "view", "_unsafe_view", "select", "slice", "unsqueeze", "squeeze", "t",
             "alias", "as_strided", "detach", "reshape", "expand", "permute", "transpose", "unbind", "split",
             "lift_fresh", "_local_scalar_dense", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
             "view_as_real", "_reshape_alias", "new_empty", "new_empty_strided", "split_with_sizes"}


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.triton = collections.Counter()
        self.inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_triton:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_triton(counter: Counter):
    """Wrap the interpreter's launch so each kernel call counts once and its host copies not at all."""
    from triton.runtime import interpreter

    real = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        counter.triton[getattr(self.fn, "__name__", str(self.fn))] += 1
        counter.inside_triton += 1
        try:
            return real(self, *args, **kwargs)
        finally:
            counter.inside_triton -= 1

    interpreter.GridExecutor.__call__ = call
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = real


def decode_inputs(dim: int, gen: torch.Generator, shrink: int = 1):
    batch, hq, hkv, block = 16, 32, 8, 16
    contexts = torch.randint(1500 // shrink, 2501 // shrink, (batch,), generator=gen).tolist()
    blocks = sum(-(-n // block) for n in contexts)
    perm = torch.randperm(blocks, generator=gen)
    table = torch.zeros(batch, max(-(-n // block) for n in contexts), dtype=torch.int32)
    start = 0
    for b, n in enumerate(contexts):
        used = -(-n // block)
        table[b, :used] = perm[start:start + used]
        start += used
    seqused = torch.tensor(contexts, dtype=torch.int32)
    cu_q = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, hq, dim, generator=gen, dtype=torch.float16)
    k = torch.randn(blocks, block, hkv, dim, generator=gen, dtype=torch.float16)
    v = torch.randn(blocks, block, hkv, dim, generator=gen, dtype=torch.float16)
    return q, k, v, cu_q, table, seqused, max(contexts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator-path", action="store_true")
    parser.add_argument("--ops", action="store_true", help="list the aten ops")
    parser.add_argument("--step", action="store_true", help="metadata updated in place before the counted call "
                        "(a server's step): the batch is validated again, not found in the cache")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--shrink", type=int, default=1, help="contexts / this (the interpreter is slow); the "
                        "launches are the same while the split count is")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import jagged_sdpa
    from jagged_sdpa import layout, ops
    from jagged_sdpa.backends.triton import launch_rules
    from jagged_sdpa.checks import device

    launch_rules.programs_wanted = lambda spec: 2 * 132  # H200: split-K as there
    ops.unobserved = lambda call: True  # the path an unobserved call takes, though this mode watches
    planned = []
    real_plan = launch_rules.plan_splits
    launch_rules.plan_splits = lambda spec: planned.append(real_plan(spec)) or planned[-1]
    if args.accelerator_path:
        layout.host_read_needed = lambda dev, *given: any(m is None for m in given)
        device._flags_torch = lambda checks: device._flags_triton(checks, device._triton_kernels())
    q, k, v, cu_q, table, seqused, max_k = decode_inputs(args.dim, torch.Generator().manual_seed(0), args.shrink)

    def call():
        return jagged_sdpa.varlen_attention(q, k, v, cu_q, None, 1, max_k, block_table=table, seqused_k=seqused,
                                            causal=True, backend="triton")

    call()  # imports, caches
    if args.step:
        for t in (cu_q, table, seqused):
            t.add_(0)  # a new version: the call validates the batch again, as after a server's update
    counter = Counter()
    with _count_triton(counter), counter:
        call()
    splits = planned[-1]
    path = "accelerator path (device-side checks)" if args.accelerator_path else "cpu path (host checks)"
    path += ", metadata updated in place" if args.step else ", same metadata as the last call"
    print(f"{path}, {splits} splits: aten ops {sum(counter.ops.values())}, "
          f"triton kernels {sum(counter.triton.values())}, "
          f"launching aten ops {sum(n for op, n in counter.ops.items() if op not in NO_LAUNCH)}")
    if args.ops:
        print("  triton:", dict(counter.triton))
        print("  aten:", dict(sorted(counter.ops.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
