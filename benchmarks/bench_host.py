"""Host time per call of FLASH_VARLEN / EFFICIENT without a GPU: our Python and torch's op dispatch.

``bench_cuda.py``'s last table (decode batch: 8 sequences x 1 query, 64 keys, fp16, H 8, D 64,
causal, max lengths given) needs a GPU. The host side is device-agnostic, so here it runs on CPU
tensors: the CUDA backends are made eligible (specs labelled cuda sm90, ``is_available`` None, as
the fake-op tests do), the aten ops are instant stubs returning preallocated outputs of the right
shapes, and the batch is taken as a GPU takes it with its max lengths (no host read: lengths
unknown, device checks queued once; ``--host-read`` reads them as the CPU does). "raw" is the stub
called directly. ``--ops`` lists the aten ops one call runs (each a kernel launch, or a dispatch, on
a GPU: the number that transfers; the profiler puts the call on the operator path, whose
placeholder lse adds one ``empty``); ``--profile`` prints cProfile's top entries.

    python benchmarks/bench_host.py [--ops] [--profile] [--return-lse] [--backends efficient]

Times are CPU time of the thread (``time.thread_time``, best of 25 rounds), so a loaded machine
inflates them less; compare runs made on one machine.
"""
import argparse
import cProfile
import math
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jagged_sdpa  # noqa: E402
from jagged_sdpa import layout, spec as specs  # noqa: E402
from jagged_sdpa.backends.cuda import common as cc  # noqa: E402
from jagged_sdpa.backends.cuda.efficient import EfficientBackend  # noqa: E402
from jagged_sdpa.backends.cuda.flash_varlen import FlashVarlenBackend  # noqa: E402


def install(host_read: bool):
    """CUDA backends eligible for CPU tensors, the aten forward ops stubbed; returns the stubs."""
    for name in ("_flash_attention_forward", "_flash_attention_backward",
                 "_efficient_attention_forward", "_efficient_attention_backward"):
        assert cc.op_arguments(name), name
    for impl in (FlashVarlenBackend, EfficientBackend):
        impl.is_available = classmethod(lambda cls: None)
    orig_build = specs.build
    specs.build = lambda *a, **kw: orig_build(*a, **kw).replace(device_type="cuda", capability=(9, 0))
    if not host_read:
        layout.host_read_needed = lambda device, *given: any(m is None for m in given)
    cache = {}

    def flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, **kw):
        key = ("f", q.shape, v.shape)
        if key not in cache:
            cache[key] = (torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype),
                          torch.empty(q.shape[1], q.shape[0], dtype=torch.float32),
                          torch.empty(2, dtype=torch.int64), torch.empty(()), torch.empty(0))
        return cache[key]

    def eff_fwd(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask, compute_lse, **kw):
        key = ("e", q.shape, v.shape, compute_lse, max_q, cu_q.shape)
        if key not in cache:
            b = cu_q.shape[0] - 1
            w = -(-max_q // 32) * 32 if compute_lse else 0
            cache[key] = (torch.empty(1, q.shape[1], q.shape[2], v.shape[-1], dtype=q.dtype),
                          torch.full((b, q.shape[2], w), 0.5, dtype=torch.float32),
                          torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64), max_q, max_k)
        return cache[key]

    torch.ops.aten._flash_attention_forward = flash_fwd
    torch.ops.aten._efficient_attention_forward = eff_fwd
    return flash_fwd, eff_fwd


def decode_batch(batch=8, heads=8, dim=64, keys=64, dtype=torch.float16):
    q = torch.randn(batch, heads, dim).to(dtype)
    k = torch.randn(batch * keys, heads, dim).to(dtype)
    v = torch.randn(batch * keys, heads, dim).to(dtype)
    cu_q = torch.arange(batch + 1, dtype=torch.int32)
    cu_k = torch.arange(0, batch * keys + 1, keys, dtype=torch.int32)
    return q, k, v, cu_q, cu_k


CLOCK = time.thread_time  # CPU time of this thread: a busy machine's preemptions are not counted


def per_call_us(fn, reps, rounds=25):
    for _ in range(50):
        fn()
    times = []
    for _ in range(rounds):
        start = CLOCK()
        for _ in range(reps):
            fn()
        times.append((CLOCK() - start) / reps * 1e6)
    return min(times), statistics.median(times)


def aten_ops(fn):
    """The top-level aten ops of one call (on the operator path, where the profiler puts it)."""
    from torch.profiler import profile, ProfilerActivity
    fn()
    for _ in range(2):  # the operator path builds its own runner on its first call
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    return [e.name for e in prof.events()
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--host-read", action="store_true", help="read lengths on the host (the CPU's default)")
    ap.add_argument("--return-lse", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ops", action="store_true", help="list the top-level aten ops of one call")
    ap.add_argument("--backends", default="flash_varlen,efficient")
    args = ap.parse_args()
    flash_fwd, eff_fwd = install(args.host_read)
    q, k, v, cu_q, cu_k = decode_batch()
    scale = 1 / math.sqrt(64)
    raw = {
        "flash_varlen": lambda: flash_fwd(q, k, v, cu_q, cu_k, 1, 64, 0.0, True, False, scale=scale),
        "efficient": lambda: eff_fwd(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, cu_q, cu_k, 1, 64, 0.0, 2,
                                     False, scale=scale),
    }
    print(f"torch {torch.__version__}, host_read={args.host_read}, return_lse={args.return_lse}")
    print(f"{'backend':<14} {'ours us (min/med)':>18} {'raw us':>8} {'overhead us':>12}")
    for backend in args.backends.split(","):
        ours = lambda: jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 1, 64, causal=True, backend=backend,  # noqa
                                                    return_lse=args.return_lse)
        ours()
        o_min, o_med = per_call_us(ours, args.reps)
        r_min, _ = per_call_us(raw[backend], args.reps)
        print(f"{backend:<14} {o_min:>8.1f} / {o_med:>7.1f} {r_min:>8.2f} {o_min - r_min:>12.1f}")
        if args.ops:
            names = aten_ops(ours)
            print(f"  {len(names)} top-level aten ops:", " ".join(n.replace("aten::", "") for n in names))
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.reps):
                ours()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
