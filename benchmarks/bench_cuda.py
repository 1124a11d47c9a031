"""GPU benchmark: FLASH_VARLEN, EFFICIENT and TRITON against PyTorch's NJT SDPA and padded SDPA.

    python benchmarks/bench_cuda.py [--quick] [--reps 30] [--json results.json]

Batches are realistic and ragged: bf16, log-normal sequence lengths (median 1k, at most 8k),
16k-64k tokens, H = 16..32 (with a GQA case), D = 64/128, causal prefill; plus a decode batch (one
query per sequence against long KV), run again with the static max_seqlen bounds servers and CUDA
graphs pass (131072: the library clamps them, issue 23). Every implementation is timed interleaved (one call of each
per round, CUDA events around each call) and the median is reported, forward and forward+backward,
with TFLOP/s from the exact number of visible (query, key) pairs (backward counted as 2.5x the
forward, the flash-attn convention). A last table gives the host time per call of our
``varlen_attention`` against calling ``aten._flash_attention_forward``/``_efficient_attention_forward``
directly on a small batch, where the host is the bottleneck: the Python overhead of the library.
On a machine without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jagged_sdpa  # noqa: E402
from jagged_sdpa import NoBackendError  # noqa: E402

PREFILL = [
    # name, heads_q, heads_kv, head_dim, total tokens
    ("prefill H16 D128 16k", 16, 16, 128, 16_384),
    ("prefill H32 D64 32k", 32, 32, 64, 32_768),
    ("prefill H32/8 D128 64k (GQA)", 32, 8, 128, 65_536),
]
DECODE = ("decode B64 H32/8 D128 ctx~2k", 32, 8, 128, 64)
OURS = ("flash_varlen", "efficient", "triton")
FP8_DECODE = ("paged decode B16 H32/8 D128 ctx 1.5-2.5k block 16", 16, 32, 8, 128, 16)
STATIC_BOUND = 131072  # a server's max_seqlen_q/_k for every decode step, whatever the batch holds


def lognormal_lengths(total: int, median: int, longest: int, gen: torch.Generator) -> list[int]:
    """Lengths ~ LogNormal(log(median), 0.8) clipped to [16, longest], summing to ``total``."""
    lengths, left = [], total
    while left > 0:
        n = int(math.exp(math.log(median) + 0.8 * torch.randn((), generator=gen).item()))
        n = min(max(n, 16), longest, left)
        lengths.append(n)
        left -= n
    return lengths


def cu_of(lengths, device) -> torch.Tensor:
    return F.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0)).to(torch.int32)


def visible_pairs(lengths_q, lengths_k, causal: bool) -> int:
    total = 0
    for lq, lk in zip(lengths_q, lengths_k):
        if not causal:
            total += lq * lk
        else:  # bottom-right: query i sees min(lk, i + lk - lq + 1) keys
            total += sum(max(0, min(lk, i + lk - lq + 1)) for i in range(lq))
    return total


class Problem:
    """One batch in every layout the implementations take, allocated once."""

    def __init__(self, lengths_q, lengths_k, heads_q, heads_kv, dim, causal, dtype=torch.bfloat16, bounds=None):
        dev = "cuda"
        self.bounds = bounds  # (max_seqlen_q, max_seqlen_k) our calls pass, else the true ones
        self.lengths_q, self.lengths_k, self.causal = lengths_q, lengths_k, causal
        self.heads_q, self.heads_kv, self.dim = heads_q, heads_kv, dim
        self.q = torch.randn(sum(lengths_q), heads_q, dim, device=dev, dtype=dtype, requires_grad=True)
        self.k = torch.randn(sum(lengths_k), heads_kv, dim, device=dev, dtype=dtype, requires_grad=True)
        self.v = torch.randn(sum(lengths_k), heads_kv, dim, device=dev, dtype=dtype, requires_grad=True)
        self.cu_q, self.cu_k = cu_of(lengths_q, dev), cu_of(lengths_k, dev)
        self.max_q, self.max_k = max(lengths_q), max(lengths_k)
        self.grad = torch.randn(sum(lengths_q), heads_q, dim, device=dev, dtype=dtype)
        self.flops_fwd = 4 * visible_pairs(lengths_q, lengths_k, causal) * heads_q * dim

    def ours(self, backend):
        max_q, max_k = self.bounds or (self.max_q, self.max_k)

        def call():
            return jagged_sdpa.varlen_attention(self.q, self.k, self.v, self.cu_q, self.cu_k, max_q, max_k,
                                                causal=self.causal, backend=backend)
        call()  # raises NoBackendError here, not inside the timing loop
        return call

    def njt(self):
        group = self.heads_q // self.heads_kv
        make = torch.nested.nested_tensor_from_jagged
        offsets_q = self.cu_q.long()
        # One offsets tensor for self-attention: NJT SDPA treats distinct ones as broadcasting.
        offsets_k = offsets_q if self.lengths_q == self.lengths_k else self.cu_k.long()
        q = make(self.q, offsets=offsets_q, max_seqlen=self.max_q).transpose(1, 2)
        k = make(self.k, offsets=offsets_k, max_seqlen=self.max_k).transpose(1, 2)
        v = make(self.v, offsets=offsets_k, max_seqlen=self.max_k).transpose(1, 2)

        def call():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=group > 1)
            return out.transpose(1, 2).values()
        call()
        return call

    def padded(self):
        """Dense SDPA on zero-padded (B, H, L, D) copies. Causal prefill (Lq == Lk, right padding)
        is exact for the valid rows with is_causal; decode masks the padded keys instead."""
        batch = len(self.lengths_q)

        def pad(x, lengths, longest):
            valid = torch.arange(longest, device=x.device) < torch.tensor(lengths, device=x.device).unsqueeze(1)
            dense = x.new_zeros(batch, longest, x.shape[1], x.shape[2])
            dense[valid] = x.detach()
            return dense.transpose(1, 2).requires_grad_(), valid

        qd, _ = pad(self.q, self.lengths_q, self.max_q)
        kd, key_valid = pad(self.k, self.lengths_k, self.max_k)
        vd, _ = pad(self.v, self.lengths_k, self.max_k)
        group = self.heads_q // self.heads_kv
        square = self.causal and self.lengths_q == self.lengths_k
        attn_mask = None if square else key_valid[:, None, None, :]

        def call():
            return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=attn_mask, is_causal=square,
                                                  enable_gqa=group > 1)
        call()
        return call


def timed(fns: dict, reps: int, backward: bool, grads: dict) -> dict:
    """Median ms per implementation, calls interleaved round by round."""
    samples = {name: [] for name in fns}
    for _ in range(3):  # warm-up (autotuning, allocator)
        for name, fn in fns.items():
            _run(fn, backward, grads[name])
    torch.cuda.synchronize()
    for _ in range(reps):
        events = []
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _run(fn, backward, grads[name])
            end.record()
            events.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in events:
            samples[name].append(start.elapsed_time(end))
    return {name: statistics.median(s) for name, s in samples.items()}


def _run(fn, backward, grad):
    if backward:
        out = fn()
        out.backward(grad.view_as(out) if grad.numel() == out.numel() else torch.ones_like(out))
    else:
        with torch.no_grad():
            fn()


def implementations(problem: Problem) -> tuple[dict, dict, set]:
    """Runnable implementations, why the others were skipped, and which of them can do backward."""
    makers = {backend: (lambda b=backend: problem.ours(b)) for backend in OURS}
    makers.update({"torch njt sdpa": problem.njt, "torch padded sdpa": problem.padded})
    fns, skipped, backward_ok = {}, {}, set()
    for name, make in makers.items():
        try:
            fns[name] = make()
        except NoBackendError as exc:
            reasons = exc.explanation.reasons.get(jagged_sdpa.Backend(name), [])
            skipped[name] = "; ".join(reasons) or str(exc).splitlines()[0]
            continue
        except (RuntimeError, ValueError, TypeError) as exc:
            skipped[name] = str(exc).splitlines()[0][:120]
            continue
        try:
            _run(fns[name], True, problem.grad)
            backward_ok.add(name)
        except (RuntimeError, ValueError, TypeError, NoBackendError):
            pass
    return fns, skipped, backward_ok


def bench_problem(name: str, problem: Problem, reps: int, rows: list) -> None:
    fns, skipped, backward_ok = implementations(problem)
    grads = {n: problem.grad for n in fns}
    fwd = timed(fns, reps, backward=False, grads=grads)
    trainable = {n: fn for n, fn in fns.items() if n in backward_ok}
    both = timed(trainable, max(reps // 2, 5), backward=True, grads=grads) if trainable else {}
    for impl in fns:
        row = {"batch": name, "impl": impl, "fwd_ms": fwd[impl], "fwd_tflops": problem.flops_fwd / fwd[impl] / 1e9,
               "fwdbwd_ms": math.nan, "fwdbwd_tflops": math.nan}
        if impl in both:
            row["fwdbwd_ms"] = both[impl]
            row["fwdbwd_tflops"] = 3.5 * problem.flops_fwd / both[impl] / 1e9
        rows.append(row)
    for impl, why in skipped.items():
        rows.append({"batch": name, "impl": impl, "skipped": why})


def host_overhead(reps: int) -> list:
    """Host microseconds per call: our varlen_attention vs the raw aten op, decode-sized batch."""
    lengths_k = [64] * 8
    p = Problem([1] * 8, lengths_k, 8, 8, 64, causal=True, dtype=torch.float16)
    q, k, v = (t.detach() for t in (p.q, p.k, p.v))
    scale = 1 / math.sqrt(64)
    raw = {
        "flash_varlen": lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, p.cu_q, p.cu_k, 1, 64, 0.0, True, False, scale=scale),
        "efficient": lambda: torch.ops.aten._efficient_attention_forward(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, p.cu_q, p.cu_k, 1, 64, 0.0, 2, False, scale=scale),
    }
    rows = []
    for backend, raw_call in raw.items():
        ours = lambda: jagged_sdpa.varlen_attention(q, k, v, p.cu_q, p.cu_k, 1, 64, causal=True, backend=backend)  # noqa: E731
        try:
            ours()
        except NoBackendError:
            continue
        result = {}
        for label, fn in (("ours", ours), ("raw", raw_call)):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            result[label] = (time.perf_counter() - start) / reps * 1e6
        rows.append({"backend": backend, "ours_us": result["ours"], "raw_us": result["raw"],
                     "overhead_us": result["ours"] - result["raw"]})
    return rows


def fp8_decode(reps: int, gen: torch.Generator, device: str = "cuda") -> list:
    """Issue 29's decode batch over bf16, e4m3fn and e5m2 paged caches, next to one read of each
    cache's bytes (int64 word sums: every block the table names is used, nothing else is held)."""
    name, batch, hq, hkv, dim, block = FP8_DECODE
    contexts = torch.randint(1500, 2501, (batch,), generator=gen).tolist()
    blocks = sum(-(-n // block) for n in contexts)
    perm = torch.randperm(blocks, generator=gen).to(device)
    table = torch.zeros(batch, max(-(-n // block) for n in contexts), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(contexts):
        used = -(-n // block)
        table[b, :used] = perm[start:start + used]
        start += used
    seqused = torch.tensor(contexts, dtype=torch.int32, device=device)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(blocks, block, hkv, dim, device=device)
    v = torch.randn(blocks, block, hkv, dim, device=device)
    caches = {"bf16": (k.bfloat16(), v.bfloat16(), {})}
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = torch.full((hkv,), 0.05, device=device)
        caches[str(fmt)[6:]] = ((k / scale[:, None]).to(fmt), (v / scale[:, None]).to(fmt),
                                 {"k_scale": scale, "v_scale": scale})
    fns, rows = {}, []
    for label, (kc, vc, scales) in caches.items():
        for backend in (None, "triton"):
            def call(kc=kc, vc=vc, scales=scales, backend=backend):
                return jagged_sdpa.varlen_attention(q, kc, vc, cu_q, None, 1, max(contexts), block_table=table,
                                                    seqused_k=seqused, causal=True, backend=backend, **scales)
            try:
                call()
            except NoBackendError as exc:
                rows.append({"batch": name, "impl": f"{backend or 'default'} {label} cache",
                             "skipped": str(exc).splitlines()[0]})
                continue
            fns[f"{backend or 'default'} {label} cache"] = call
        words_k, words_v = kc.view(torch.int64), vc.view(torch.int64)
        fns[f"read {label} cache once"] = lambda a=words_k, b=words_v: (a.sum(), b.sum())
    times = timed(fns, reps, backward=False, grads={n: None for n in fns})
    for impl, ms in times.items():
        rows.append({"batch": name, "impl": impl, "fwd_ms": ms, "fwd_tflops": math.nan,
                     "fwdbwd_ms": math.nan, "fwdbwd_tflops": math.nan})
    return rows


def print_tables(rows, overhead, device_name):
    print(f"\ndevice: {device_name}   torch {torch.__version__}   jagged_sdpa {jagged_sdpa.__version__}")
    print(f"{'batch':<32} {'impl':<18} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:<32} {r['impl']:<18} skipped: {r['skipped']}")
        else:
            print(f"{r['batch']:<32} {r['impl']:<18} {r['fwd_ms']:>9.3f} {r['fwd_tflops']:>8.1f} "
                  f"{r['fwdbwd_ms']:>11.3f} {r['fwdbwd_tflops']:>8.1f}")
    print(f"\n{'host time per call (8 x 1 query, 64 keys)':<44} {'ours us':>9} {'raw op us':>10} {'overhead us':>12}")
    for r in overhead:
        print(f"{r['backend']:<44} {r['ours_us']:>9.1f} {r['raw_us']:>10.1f} {r['overhead_us']:>12.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="smallest prefill batch and the decode batch only")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if torch.version.cuda is None or not torch.cuda.is_available():
        why = "PyTorch built without CUDA" if torch.version.cuda is None else "no CUDA device"
        print(f"bench_cuda: {why} - nothing to measure (run this on a GPU machine)")
        return 0
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, hq, hkv, dim, total in PREFILL[:1] if args.quick else PREFILL:
        lengths = lognormal_lengths(total, 1024, 8192, gen)
        bench_problem(f"{name} B={len(lengths)}", Problem(lengths, lengths, hq, hkv, dim, causal=True),
                      args.reps, rows)
        torch.cuda.empty_cache()
    name, hq, hkv, dim, batch = DECODE
    contexts = [min(8192, max(16, int(2048 * math.exp(0.5 * torch.randn((), generator=gen).item()))))
                for _ in range(batch)]
    bench_problem(name, Problem([1] * batch, contexts, hq, hkv, dim, causal=True), args.reps, rows)
    bench_problem(f"{name} bounds {STATIC_BOUND}",
                  Problem([1] * batch, contexts, hq, hkv, dim, causal=True, bounds=(STATIC_BOUND, STATIC_BOUND)),
                  args.reps, rows)
    rows += fp8_decode(args.reps, gen)
    overhead = host_overhead(200)
    print_tables(rows, overhead, torch.cuda.get_device_name())
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": rows, "host_overhead": overhead}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
