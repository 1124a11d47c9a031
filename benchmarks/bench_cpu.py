"""CPU benchmark (issues 3 and 14): jagged_sdpa against what a CPU user can run today, side by side,
and against this machine's own limits.

Printed first: the CPU (model, vector extensions, CPUs and threads used), torch, the compiler and
the target the compiled kernel was built for; then the best GEMM rate torch reaches here (fp32: the
better of torch.matmul and oneDNN's linear; bf16: torch.matmul), measured in the same run on
attention-like and square shapes, best of the rounds: the yardstick of the "% of GEMM" column.

Contenders, timed interleaved in one process (round r times every contender once, in turn):
  ours      jagged_sdpa.varlen_attention (automatic selection: CPU_FUSED on CPU tensors)
  njt       torch's NJT SDPA (refuses is_causal=True)
  padded    pad to (B, H, max_len, D) + boolean mask, one dense SDPA call
  loop      one dense SDPA call per sequence (views of the packed buffer)
  bucketed  sort by length, pad within buckets of similar length, one SDPA call per bucket
  flex      torch.compile'd FlexAttention over the packed batch with a document mask
            (create_block_mask; compiled once before timing, its compile time and the block mask's
            build time reported apart; forward only: it has no CPU backward)
Every contender's output (and gradients, for forward+backward rows) is checked against ours. For
decode rows (W4) the time of reading the same K/V once (``read_once``: sums of their bytes viewed as
int64 words) is timed beside them.

GFLOP/s count attention honestly: 4 * D flops per visible (query, key) pair per head forward
(causal pairs only: about half), forward+backward 3.5x the forward (the backward is 2.5x). Times
are medians of rounds; the share of the GEMM rate sets our fastest round against the GEMM's
fastest, so that a busy machine lowers neither side alone. Below the table, each row's fastest
contender over ours round by round (both timed back to back in one round): the median, lowest and
highest of those ratios, steadier than the ratio of medians when the machine's load moves.

Disturbed rounds: the machine is shared. Each sample reads /proc/stat around the call; CPU time
spent by other processes (system busy time minus this process's CPU time), beyond the CPUs our
threads leave free, above 10% of the machine marks the round disturbed, and the round is repeated
(up to a limit; how many were repeated is printed). Peak extra memory is the rise of the process's peak RSS during one call
(/proc/self/clear_refs resets the peak), measured after all timings in a fresh process per
contender where glibc is told to return large blocks to the OS at once (not for flex, whose
compile a fresh process would redo).

Issue 20's rows (``options``): W1 causal, fp32 and bf16, forward and forward+backward, the same call
with and without docs/api.md section 11's sinks + prefix_lens + chunk_size, timed interleaved on the compiled
kernel, with two chunk sizes: one that cuts the sequences (less work: the time ratio) and one that
cuts almost nothing (the cost per visible (query, key) pair, counted by positions.visible_keys: what
the options themselves cost). The target: both at most 1.10x.

At the end, the targets (issues 14, 20, 22) next to the measured values, met or not.

Issue 29's rows (``fp8``): W4's decode over a paged fp8 cache (e4m3fn, e5m2; per-kv-head scales), q
bf16, against the same call over the same pages dequantized to bf16 and against one read of the fp8
cache's bytes, timed interleaved; fastest rounds.

Run: python benchmarks/bench_cpu.py [--quick] [--only W1,W2,tiny,options,fp8] [--threads N] [--no-flex] [--no-memory]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jagged_sdpa  # noqa: E402
from jagged_sdpa.backends.cpu import native  # noqa: E402
from jagged_sdpa.backends import positions  # noqa: E402
from workloads import TINY, W1, W4, Workload, make_tensors, standard_workloads  # noqa: E402

CONTENDERS = ("ours", "njt", "padded", "loop", "bucketed", "flex")
ANCHORS = CONTENDERS[1:]
CLK_TCK = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------
# the machine, and the best GEMM rate torch reaches on it

VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def _cpuinfo() -> dict:
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def _bf16_tiles() -> str:
    """What the compiled kernel runs bf16 on here (js_bf16_tiles)."""
    lib = native.library()
    if lib is None:
        return ""
    return "; bf16 tiles: " + {2: "AMX (tdpbf16ps)", 1: "AVX512-BF16 (vdpbf16ps)"}.get(lib.js_bf16_tiles(),
                                                                                    "float32 FMAs")


def _vector_width() -> str:
    """The widest vector extension the compiled kernel was built with."""
    isa = set(native._STATE.get("isa") or ())
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2"),
                       ("asimd", "NEON")):
        if flag in isa:
            return name
    return "scalar"


def kernel_path(w: Workload) -> str:
    """Which instructions the compiled kernel runs this row's products on, by the rules of
    attention.cpp's header: bf16 tiles, forward and backward, on AMX (tdpbf16ps) where the CPU has
    it and Linux grants the tile state, else on AVX512-BF16 (vdpbf16ps); decode rows (at most
    native.DIRECT_ROWS queries per sequence: direct rows) in bf16 on vdpbf16ps wherever the CPU has
    it (AMX or not); fp32/fp16 in float32 FMAs of the build's vector width. ``js_bf16_tiles`` is
    the kernel's own answer for bf16 tiles."""
    lib = native.library()
    if lib is None:
        return "no compiled kernel"
    fma = f"fp32 FMA ({_vector_width()})"
    tiles = lib.js_bf16_tiles()
    if all(n <= native.DIRECT_ROWS for n in w.q_lengths):
        return f"direct rows, {'AVX512-BF16' if w.dtype == torch.bfloat16 and tiles else fma}"
    if w.dtype != torch.bfloat16:
        return fma
    fwd = {2: "AMX", 1: "AVX512-BF16"}.get(tiles, fma)
    if not w.backward:
        return fwd
    return f"{fwd} fwd, {fwd} bwd"


def isa_tile(w: Workload) -> str:
    """The build's instruction set and the micro-tile that runs this row's products (issue 30): the
    kernel's own answers (js_tile_shape, js_bf16_tiles); decode rows run as direct rows, without
    tiles."""
    lib = native.library()
    if lib is None:
        return "-"
    if all(n <= native.DIRECT_ROWS for n in w.q_lengths):
        return f"direct rows, 16 keys a block ({_vector_width()})"
    tiles = lib.js_bf16_tiles() if w.dtype == torch.bfloat16 else 0
    if tiles == 2:
        return "AMX: 16 rows x 16 columns a tile (tdpbf16ps)"
    if tiles == 1:
        return "AVX512-BF16: 6 rows x 64 columns (24 zmm accumulators, vdpbf16ps)"
    return native.tile_shape()


def machine_lines() -> list[str]:
    """What this run ran on: CPU model, vector extensions, CPUs and threads, software versions."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else NCPU
    try:
        cxx = native._compiler()
        compiler = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (native.NativeUnavailable, OSError, IndexError) as exc:
        compiler = f"none ({exc})"
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return [
        f"# cpu: {info.get('model name', platform.processor() or platform.machine())}; "
        f"{cpus} CPUs usable ({info.get('cpu cores', '?')} cores, {info.get('siblings', '?')} logical CPUs per "
        f"package in /proc/cpuinfo); torch threads {torch.get_num_threads()}",
        f"# vector extensions: {' '.join(f for f in VECTOR_FLAGS if f in flags) or 'none of ' + ', '.join(VECTOR_FLAGS)}",
        f"# torch {torch.__version__} (oneDNN {'yes' if torch.backends.mkldnn.is_available() else 'no'}, "
        f"MKL {'yes' if torch.backends.mkl.is_available() else 'no'}, "
        f"{torch.backends.cpu.get_cpu_capability()}); compiler: {compiler}",
        f"# compiled kernel: {native.build_target() or 'not used: ' + str(native.unavailable_reason())}"
        f"{_bf16_tiles()}; fp32 tile: {native.tile_shape() or '-'}",
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  load {load}",
    ]


# (M, K, N): S = Q.K^T of 256 rows against 1024 keys at D = 64, O = P.V, and square GEMMs.
GEMM_SHAPES = ((256, 64, 1024), (256, 1024, 64), (1024, 1024, 1024), (2048, 2048, 2048))
QUICK_GEMM_SHAPES = ((256, 64, 1024), (256, 1024, 64), (1024, 1024, 1024))


def _gemm_methods(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Closures computing a @ b ((M, K) @ (K, N)) each way torch offers on the CPU for a's dtype:
    torch.matmul (MKL or oneDNN, torch's choice), and for fp32 oneDNN's linear with the weight
    packed once (torch.ops.mkldnn._linear_pointwise: what torch.compile'd linears call)."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
    methods = {"matmul": lambda: torch.matmul(a, b, out=out)}
    if a.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        w = b.t().contiguous()
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, a.shape[0])
            linear = torch.ops.mkldnn._linear_pointwise
            linear(a, packed, None, "none", [], "")
            methods["onednn"] = lambda: linear(a, packed, None, "none", [], "")
        except (AttributeError, RuntimeError):
            pass  # an older torch: torch.matmul alone
    return methods


@dataclass
class Gemm:
    rates: dict   # (dtype, method, shape) -> best GFLOP/s
    best: dict    # dtype -> (GFLOP/s, method, shape)


def gemm_rates(shapes, rounds: int, min_sample_s: float) -> Gemm:
    """The best GFLOP/s of each method on each shape (best of ``rounds`` samples: a peak, to
    compare our medians with), and the best over all per dtype."""
    gen = torch.Generator().manual_seed(0)
    rates, best = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            m, k, n = shape
            a = torch.randn(m, k, generator=gen).to(dtype)
            b = torch.randn(k, n, generator=gen).to(dtype)
            for method, fn in _gemm_methods(a, b).items():
                t0 = time.perf_counter()
                fn()
                reps = max(1, math.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-6)))
                seconds = min(timed(fn, reps).seconds for _ in range(rounds))
                rate = 2.0 * m * k * n / seconds / 1e9
                rates[(dtype, method, shape)] = rate
                if rate > best.get(dtype, (0.0,))[0]:
                    best[dtype] = (rate, method, shape)
    return Gemm(rates, best)


def print_gemm(g: Gemm) -> None:
    shapes = sorted({s for _, _, s in g.rates}, key=lambda s: s[0] * s[1] * s[2])
    print("| GEMM GFLOP/s (best of rounds) | " + " | ".join("x".join(map(str, s)) for s in shapes) + " |")
    print("|---|" + "---:|" * len(shapes))
    for dtype, method in dict.fromkeys((d, m) for d, m, _ in g.rates):
        cells = [f"{g.rates[(dtype, method, s)]:.0f}" if (dtype, method, s) in g.rates else "-" for s in shapes]
        print(f"| {_dt(dtype)} {method} | " + " | ".join(cells) + " |")
    for dtype, (rate, method, shape) in g.best.items():
        print(f"# best {_dt(dtype)} GEMM: {rate:.0f} GFLOP/s ({method}, {'x'.join(map(str, shape))})")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------------------------
# the contenders: each builds a closure that runs one call (forward, or forward+backward)


def _anchor_causal(w: Workload) -> bool:
    """Decode rows (one query, bottom-right causal) see every key: the anchors run them unmasked,
    which is the same attention and the only form NJT SDPA accepts."""
    if w.causal and w.alignment == "bottom_right" and all(n == 1 for n in w.q_lengths):
        return False
    return w.causal


def make_ours(w, q, k, v, cu_q, cu_k):
    max_q, max_k = max(w.q_lengths), max(w.keys)

    def run():
        return jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=w.causal)
    return run


def make_loop(w, q, k, v, cu_q, cu_k):
    causal = _anchor_causal(w)
    cq, ck = cu_q.tolist(), cu_k.tolist()

    def run():
        outs = []
        for b in range(len(cq) - 1):
            qb = q[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
            kb = k[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
            vb = v[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, enable_gqa=w.heads != w.heads_kv)[0].transpose(0, 1))
        return torch.cat(outs)
    return run


def _padded_group(w, q, k, v, cq, ck, members, causal):
    """One dense SDPA call over ``members`` padded to their longest; returns packed outputs."""
    lq = [cq[b + 1] - cq[b] for b in members]
    lk = [ck[b + 1] - ck[b] for b in members]
    mq, mk = max(lq), max(lk)
    qi = torch.cat([torch.arange(cq[b], cq[b] + mq).clamp(max=max(cq[-1] - 1, 0)) for b in members])
    ki = torch.cat([torch.arange(ck[b], ck[b] + mk).clamp(max=max(ck[-1] - 1, 0)) for b in members])
    n = len(members)
    valid_k = torch.arange(mk).unsqueeze(0) < torch.tensor(lk).unsqueeze(1)           # (n, mk)
    mask = valid_k.view(n, 1, 1, mk).expand(n, 1, mq, mk)
    if causal:
        rows = []
        for a, bk in zip(lq, lk):
            shift = bk - a if w.alignment == "bottom_right" else 0
            rows.append(torch.arange(mk).unsqueeze(0) <= torch.arange(mq).unsqueeze(1) + shift)
        mask = mask & torch.stack(rows).unsqueeze(1)
    keep_rows = torch.cat([torch.arange(i * mq, i * mq + a) for i, a in enumerate(lq)])

    def run():
        qp = q[qi].view(n, mq, w.heads, -1).transpose(1, 2)
        kp = k[ki].view(n, mk, w.heads_kv, -1).transpose(1, 2)
        vp = v[ki].view(n, mk, w.heads_kv, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=w.heads != w.heads_kv)
        return o.transpose(1, 2).reshape(n * mq, w.heads, -1)[keep_rows]
    return run


def make_padded(w, q, k, v, cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return _padded_group(w, q, k, v, cq, ck, list(range(len(cq) - 1)), _anchor_causal(w))


def buckets(lengths, waste: float = 1.25) -> list[list[int]]:
    """Sequences sorted by length, cut into groups whose longest is at most ``waste`` x shortest."""
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    groups, current = [], []
    for b in order:
        if current and lengths[b] > waste * max(1, lengths[current[0]]):
            groups.append(current)
            current = []
        current.append(b)
    if current:
        groups.append(current)
    return groups


def make_bucketed(w, q, k, v, cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    causal = _anchor_causal(w)
    groups = buckets([max(a, b) for a, b in zip(w.q_lengths, w.keys)])
    runs = [_padded_group(w, q, k, v, cq, ck, g, causal) for g in groups]
    inverse = torch.argsort(torch.cat([torch.arange(cq[b], cq[b + 1]) for g in groups for b in g]))

    def run():
        return torch.cat([r() for r in runs])[inverse]
    return run


def make_njt(w, q, k, v, cu_q, cu_k):
    if _anchor_causal(w):
        return None  # NJT SDPA refuses is_causal=True
    if w.heads != w.heads_kv:
        return None

    def to_njt(x, cu):
        return torch.nested.nested_tensor_from_jagged(x, offsets=cu.long()).transpose(1, 2)
    qn, kn, vn = to_njt(q, cu_q), to_njt(k, cu_k), to_njt(v, cu_k)

    def run():
        return F.scaled_dot_product_attention(qn, kn, vn).transpose(1, 2).values()
    return run


_FLEX = {}  # the one torch.compile'd flex_attention of the process


def _positions(cu: torch.Tensor):
    """(document id, position within it) of every packed row, from cu_seqlens."""
    lengths = (cu[1:] - cu[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return doc, torch.arange(int(cu[-1])) - cu[:-1].long()[doc]


def make_flex(w, q, k, v, cu_q, cu_k):
    """FlexAttention over the whole packed batch as one (1, H, total, D) sequence: the document
    mask keeps each query to its own sequence's keys (and causal positions). Building the block
    mask is per-batch work, timed apart (``run.mask_s``); the closure reuses it."""
    if w.backward:
        return None  # FlexAttention has no backward on the CPU (NotImplementedError in torch 2.13)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _FLEX:
        # Each workload (shapes, dtype, mask) is a compile of its own: keep dynamo from falling
        # back to eager after its default 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 8, 8, device="cpu")  # first use: ~6 s
    causal = _anchor_causal(w)
    q_doc, q_pos = _positions(cu_q)
    k_doc, k_pos = _positions(cu_k)
    shift = (cu_k[1:] - cu_k[:-1] - (cu_q[1:] - cu_q[:-1])).long() if w.alignment == "bottom_right" \
        else torch.zeros(len(cu_q) - 1, dtype=torch.long)

    def document(b, h, qi, ki):
        same = q_doc[qi] == k_doc[ki]
        return same & (q_pos[qi] + shift[q_doc[qi]] >= k_pos[ki]) if causal else same
    t0 = time.perf_counter()
    mask = create_block_mask(document, None, None, q.shape[0], k.shape[0], device="cpu")
    mask_s = time.perf_counter() - t0
    gqa = w.heads != w.heads_kv

    def run():
        out = _FLEX["fn"](q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                          v.transpose(0, 1).unsqueeze(0), block_mask=mask, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    run.mask_s = mask_s
    return run


MAKERS: dict[str, Callable] = {
    "ours": make_ours, "njt": make_njt, "padded": make_padded, "loop": make_loop, "bucketed": make_bucketed,
    "flex": make_flex,
}


def with_backward(forward: Callable, grad: torch.Tensor, inputs) -> Callable:
    def run():
        for t in inputs:
            t.grad = None
        out = forward()
        out.backward(grad)
        return out
    return run


# ----------------------------------------------------------------------------------------------
# measurement


def _system_busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle


@dataclass
class Sample:
    seconds: float          # per call
    disturbed: bool


def timed(fn: Callable, reps: int) -> Sample:
    busy0, cpu0, t0 = _system_busy_ticks(), time.process_time(), time.perf_counter()
    for _ in range(reps):
        fn()
    t1, cpu1, busy1 = time.perf_counter(), time.process_time(), _system_busy_ticks()
    wall = t1 - t0
    others = (busy1 - busy0) / CLK_TCK - (cpu1 - cpu0)
    # Others may use the CPUs our threads leave free; beyond that, more than 10% of the machine
    # is a disturbance. /proc/stat counts in ticks: one tick per CPU of slack.
    free_cpus = max(0, NCPU - torch.get_num_threads())
    disturbed = others > (free_cpus + 0.10 * NCPU) * wall + NCPU / CLK_TCK
    return Sample(wall / reps, disturbed)


def peak_extra_bytes(fn: Callable) -> int:
    """Rise of peak RSS during one call (after a warm-up call)."""
    fn()

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0
    if platform.system() == "Linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so reuse shows as growth
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    result = fn()
    peak = status("VmHWM:")
    del result
    return max(0, peak - before)


def agree(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """Max abs difference relative to the reference's scale."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if a.numel() else 0.0


AGREE_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass
class Row:
    workload: Workload
    medians: dict
    memory: dict
    errors: dict
    repeated: int
    rounds: int
    slow: set
    notes: dict       # contender -> why it did not run, or its setup cost (flex)
    samples: dict = None  # contender -> seconds per round, in round order (slow ones: their one call)

    @property
    def bests(self) -> Optional[dict]:
        """contender -> fastest round (GEMM shares compare peaks with peaks)."""
        return {n: min(s) for n, s in self.samples.items()} if self.samples else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def build(w: Workload, names=CONTENDERS):
    """Inputs and the closures of ``names`` for one workload (None where one cannot run, with
    the reason in ``notes``)."""
    q, k, v, cu_q, cu_k = make_tensors(w, requires_grad=w.backward)
    grad = torch.randn(q.shape[0], w.heads, w.head_dim, generator=torch.Generator().manual_seed(1)).to(w.dtype)
    fns, notes = {}, {}
    for name in names:
        try:
            f = MAKERS[name](w, q, k, v, cu_q, cu_k)
        except Exception as exc:  # noqa: BLE001 - flex on an unsupported setup: report it in the row
            if name != "flex":
                raise
            f, notes[name] = None, f"failed to build: {_first_line(exc)}"
        if f is not None and w.backward:
            f = with_backward(f, grad, (q, k, v))
        fns[name] = f
    if "flex" in names and fns.get("flex") is None and "flex" not in notes:
        notes["flex"] = "no CPU backward in FlexAttention" if w.backward else "not run"
    return fns, (q, k, v), notes


def _is_decode(w: Workload) -> bool:
    return all(n == 1 for n in w.q_lengths)


def read_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as int64 words: their ``sum()`` is one read of ``t`` and nothing else (torch
    vectorises int64 sums; a bf16 ``sum()`` widens every element and runs at about half the speed of
    the read, uint8/int32 sums are not vectorised), the floor a decode call is compared with."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.int64) if flat.numel() * flat.element_size() % 8 == 0 else flat


def run_workload(w: Workload, rounds: int, min_sample_s: float, max_retries: int, skip_slow_s: float,
                 names=CONTENDERS) -> Row:
    fns, (q, k, v), notes = build(w, names)
    if fns.get("flex") is not None:  # compile outside the timing (first call), report its cost
        t0 = time.perf_counter()
        try:
            fns["flex"]()
            notes["flex"] = f"compile {time.perf_counter() - t0:.1f} s, block mask " \
                            f"{fns['flex'].mask_s * 1e3:.1f} ms per batch (neither in its time)"
        except Exception as exc:  # noqa: BLE001 - e.g. inductor cannot compile here: say why
            fns["flex"], notes["flex"] = None, f"failed: {_first_line(exc)}"

    # Agreement (outputs, and dq/dk/dv for backward rows) and calibration.
    ref_out = fns["ours"]()
    ref_grads = [t.grad.clone() for t in (q, k, v)] if w.backward else []
    errors, reps, cost = {}, {}, {}
    for name, f in fns.items():
        if f is None:
            continue
        t0 = time.perf_counter()
        out = f()
        cost[name] = time.perf_counter() - t0
        err = agree(out, ref_out, w.dtype)
        if w.backward:
            err = max([err] + [agree(t.grad, g, w.dtype) for t, g in zip((q, k, v), ref_grads)])
        errors[name] = err
        if err > AGREE_TOL[w.dtype]:
            raise AssertionError(f"{w.name}: {name} disagrees with ours (relative error {err:.2e})")
        reps[name] = max(1, math.ceil(min_sample_s / max(cost[name], 1e-6)))
    if _is_decode(w):  # the floor of a decode step: reading its K/V once
        kw, vw = read_words(k), read_words(v)
        fns["kv_read"] = lambda: (kw.sum(), vw.sum())
        t0 = time.perf_counter()
        fns["kv_read"]()
        cost["kv_read"] = time.perf_counter() - t0
        reps["kv_read"] = max(1, math.ceil(min_sample_s / max(cost["kv_read"], 1e-6)))
    active = [n for n in fns if fns[n] is not None]
    slow = {n for n in active if n != "ours" and cost[n] > skip_slow_s}

    # A contender slower than skip_slow_s per call is timed once: its calibration call.
    samples = {n: ([cost[n]] if n in slow else []) for n in active}
    repeated = 0
    for r in range(rounds):
        for attempt in range(max_retries + 1):
            round_samples = {}
            for name in active:
                if name not in slow:
                    round_samples[name] = timed(fns[name], reps[name])
            if not any(s.disturbed for s in round_samples.values()) or attempt == max_retries:
                break
            repeated += 1
        for name, s in round_samples.items():
            samples[name].append(s.seconds)
    medians = {n: statistics.median(s) for n, s in samples.items()}
    return Row(w, medians, {}, errors, repeated, rounds, slow, notes, samples)


def _memory_child(w: Workload, name: str, threads: int) -> int:
    """In a fresh process: one contender's peak extra memory (see ``measure_memory``)."""
    from jagged_sdpa.__main__ import _quiet_torch_notices
    _quiet_torch_notices()  # the parent printed torch's NJT notices once already
    torch.set_num_threads(threads)
    if platform.system() == "Linux":
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    fns, _, _ = build(w, (name,))
    return peak_extra_bytes(fns[name])


def measure_memory(row: Row) -> None:
    """Peak extra memory of each contender (slow ones and flex skipped), into ``row.memory``.

    Each contender runs in a fresh process: in one long-lived process the heap left by earlier
    rows (arenas of other threads, cached blocks) made the same call read 11.5 MiB or 29.7 MiB
    depending on which rows ran before it.
    """
    import concurrent.futures
    import multiprocessing
    names = [n for n in row.medians if n in CONTENDERS and n != "flex" and n not in row.slow]
    row.memory = {}
    for n in names:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            row.memory[n] = pool.submit(_memory_child, row.workload, n, torch.get_num_threads()).result()


# ----------------------------------------------------------------------------------------------
# tiny call: the per-call overhead (selection, checks, layout), sdpa on NJTs and varlen on packed


def tiny_rows(reps: int, rounds: int) -> dict:
    """Per-call seconds of the tiny batch: ours (sdpa on NJTs, varlen on packed), NJT SDPA, the
    padded and loop contenders, and one dense SDPA call on the batch already padded to (B, H,
    max_len, D) without a mask: the floor of a PyTorch attention call of this size."""
    w = TINY
    q, k, v, cu_q, cu_k = make_tensors(w)
    njts = [torch.nested.nested_tensor_from_jagged(x, offsets=cu_q.long()).transpose(1, 2) for x in (q, k, v)]
    dense = [torch.randn(len(w.q_lengths), w.heads, max(w.q_lengths), w.head_dim) for _ in range(3)]
    fns = {
        "ours (sdpa, NJT)": lambda: jagged_sdpa.sdpa(*njts),
        "ours (varlen)": lambda: jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 10, 10),
        "njt": lambda: F.scaled_dot_product_attention(*njts),
        "padded": make_padded(w, q, k, v, cu_q, cu_k),
        "loop": make_loop(w, q, k, v, cu_q, cu_k),
        "dense SDPA": lambda: F.scaled_dot_product_attention(*dense),
    }
    ref = fns["njt"]().transpose(1, 2).values()
    for name, f in fns.items():
        if name == "dense SDPA":
            continue  # another computation (padded keys unmasked): a cost floor, not a contender
        out = f()
        out = out.transpose(1, 2).values() if out.is_nested else out
        assert agree(out, ref, torch.float32) < 1e-4, name
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            samples[name].append(timed(f, reps).seconds)
    return {n: statistics.median(s) for n, s in samples.items()}


# ----------------------------------------------------------------------------------------------
# issue 20: docs/api.md section 11's options on the compiled kernel, the same call with and without them

# Two chunk sizes: 256 cuts W1's sequences (47..851) as Llama 4's 8192 cuts long contexts (less
# work: the time ratio is the user's view); the longest key length - 1 cuts almost nothing, so its
# cost per visible pair is what the options' machinery costs (the per-row rules, the sink).
OPTION_CHUNK = 256


@dataclass
class OptionsRow:
    label: str
    seconds: dict         # "plain", "cut", "uncut": fastest round's seconds per call
    pairs: dict           # visible (query, key) pairs per head, same keys
    chunks: dict          # "cut", "uncut": the chunk_size

    def time_ratio(self, kind: str) -> float:
        return self.seconds[kind] / self.seconds["plain"]

    def pair_ratio(self, kind: str) -> float:
        """Cost per visible pair with the options over without."""
        return self.time_ratio(kind) * self.pairs["plain"] / self.pairs[kind]


def _visible_pairs(spec, w: Workload, prefix) -> int:
    total = 0
    for b, (lq, lk) in enumerate(zip(w.q_lengths, w.keys)):
        shift = positions.shift_of(spec, lq, lk)
        for i in range(lq):
            lo, hi = positions.visible_keys(spec, i + shift, lk, prefix[b])
            total += max(0, hi - lo)
    return total


def _interleaved_best(fns: dict, rounds: int, min_sample_s: float, max_retries: int) -> dict:
    """Each callable's fastest seconds per call over ``rounds`` interleaved rounds, after a warm-up
    call and a calibration of repetitions to ``min_sample_s`` per sample; a round disturbed by the
    load (``timed``) is repeated up to ``max_retries`` times."""
    reps = {}
    for name, f in fns.items():
        f()  # warm-up
        t0 = time.perf_counter()
        f()
        reps[name] = max(1, math.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-6)))
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for attempt in range(max_retries + 1):
            got = {n: timed(f, reps[n]) for n, f in fns.items()}
            if not any(x.disturbed for x in got.values()) or attempt == max_retries:
                break
        for n, x in got.items():
            samples[n].append(x.seconds)
    return {n: min(x) for n, x in samples.items()}


def options_rows(rounds: int, min_sample_s: float, max_retries: int, base: Workload = W1) -> list[OptionsRow]:
    """``base`` causal in fp32 and bf16, forward and forward+backward: the plain call, and with
    sinks (Hq,), prefix_lens of a quarter of each sequence and chunk_size ``OPTION_CHUNK`` ("cut")
    or the longest key length - 1 ("uncut"), all on the compiled kernel, timed interleaved (a
    disturbed round is repeated, as in run_workload). Ratios set fastest rounds against each
    other, so that a busy machine lowers neither side alone."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for backward in (False, True):
            w = base.with_(causal=True, dtype=dtype, backward=backward)
            q, k, v, cu_q, cu_k = make_tensors(w, requires_grad=backward)
            prefix = [n // 4 for n in w.keys]
            options = dict(sinks=torch.randn(w.heads, generator=torch.Generator().manual_seed(2)).to(dtype),
                           prefix_lens=torch.tensor(prefix, dtype=torch.int32))
            chunks = {"cut": OPTION_CHUNK, "uncut": max(w.keys) - 1}
            kinds = {"plain": {}, **{n: dict(options, chunk_size=c) for n, c in chunks.items()}}
            args = (q, k, v, cu_q, cu_k, max(w.q_lengths), max(w.keys))
            grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
            fns, pairs = {}, {}
            for name, kw in kinds.items():
                e = jagged_sdpa.explain(*args, causal=True, **kw)
                assert e.chosen == jagged_sdpa.Backend.CPU_FUSED, str(e)
                pairs[name] = _visible_pairs(e.spec, w, prefix if kw else [0] * len(prefix))
                f = (lambda kw=kw: jagged_sdpa.varlen_attention(*args, causal=True, **kw))
                fns[name] = with_backward(f, grad, (q, k, v)) if backward else f
            best = _interleaved_best(fns, rounds, min_sample_s, max_retries)
            row = OptionsRow(f"{w.name} {_dt(dtype)} causal {'fwd+bwd' if backward else 'fwd'}", best, pairs, chunks)
            rows.append(row)
            print(f"  options {row.label}: " + ", ".join(f"{n} {_ms(t)}" for n, t in row.seconds.items())
                  + " (ms, fastest rounds)", flush=True)
    return rows


def print_options(rows: list[OptionsRow]) -> None:
    c = rows[0].chunks
    print(f"| issue 20: sinks + prefix_lens (len/4) + chunk_size | plain ms | chunk {c['cut']} ms | time ratio | "
          f"chunk {c['uncut']} ms | visible pairs ratio | cost per visible pair ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.label} | {_ms(r.seconds['plain'])} | {_ms(r.seconds['cut'])} | {r.time_ratio('cut'):.2f}x | "
              f"{_ms(r.seconds['uncut'])} | {r.pairs['uncut'] / r.pairs['plain']:.2f} | {r.pair_ratio('uncut'):.2f}x |")
    print(f"# chunk {c['cut']} leaves {rows[0].pairs['cut'] / rows[0].pairs['plain']:.2f} of the plain call's visible pairs "
          f"(its cost per visible pair {max(r.pair_ratio('cut') for r in rows):.2f}x at most: more of its key blocks "
          "straddle a mask edge)")


# fp8 KV caches (docs/api.md section 13): W4's decode step over a paged cache stored in fp8, against
# the same call over the same pages in bf16 (q bf16 in both) and against one read of the fp8 bytes
# (the floor of a step that reads its cache once). Blocks of FP8_BLOCK slots, each sequence's own,
# so that the cache holds its keys and little else and reading the cache's bytes is reading K/V.
FP8_BLOCK = 16
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class Fp8Row:
    label: str
    seconds: dict  # "fp8", "bf16", "fp8_read", "bf16_read": fastest round's seconds per call
    agree: float   # relative difference of the fp8 and bf16 calls' outputs


def fp8_rows(rounds: int, min_sample_s: float, max_retries: int, base: Workload = W4) -> list[Fp8Row]:
    """``base`` (decode) over a paged fp8 cache, per fp8 format, timed interleaved with the same call
    over the cache dequantized to bf16 and with one read of each cache's bytes (a byte sum of the
    fp8 cache viewed as int64 words, which torch sums without widening; the bf16 cache's float sum);
    per-kv-head scales."""
    g = torch.Generator().manual_seed(3)
    hkv, d = base.heads_kv, base.head_dim
    lens = list(base.keys)
    blocks = [math.ceil(n / FP8_BLOCK) for n in lens]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    seqused = torch.tensor(lens, dtype=torch.int32)
    cu_q = torch.arange(len(lens) + 1, dtype=torch.int32)
    q = torch.randn(len(lens), base.heads, d, generator=g).to(torch.bfloat16)
    k_scale, v_scale = torch.rand(hkv, generator=g) * 0.02 + 0.01, torch.rand(hkv, generator=g) * 0.02 + 0.01
    rows = []
    for dtype in FP8_DTYPES:
        largest = torch.finfo(dtype).max
        k8, v8 = [(torch.randn(start, FP8_BLOCK, hkv, d, generator=g) / sc.view(-1, 1)).clamp(-largest, largest).to(dtype)
                  for sc in (k_scale, v_scale)]
        kb, vb = [(x.float() * sc.view(-1, 1)).to(torch.bfloat16) for x, sc in ((k8, k_scale), (v8, v_scale))]
        common = dict(block_table=table, seqused_k=seqused, causal=True)
        args = (cu_q, None, 1, max(lens))
        e = jagged_sdpa.explain(q, k8, v8, *args, k_scale=k_scale, v_scale=v_scale, **common)
        assert e.chosen == jagged_sdpa.Backend.CPU_FUSED, str(e)
        k8w, v8w, kbw, vbw = (read_words(t) for t in (k8, v8, kb, vb))
        fns = {
            "fp8": lambda: jagged_sdpa.varlen_attention(q, k8, v8, *args, k_scale=k_scale, v_scale=v_scale, **common),
            "bf16": lambda: jagged_sdpa.varlen_attention(q, kb, vb, *args, **common),
            "fp8_read": lambda: (k8w.sum(), v8w.sum()),
            "bf16_read": lambda: (kbw.sum(), vbw.sum()),
        }
        with torch.no_grad():
            err = agree(fns["fp8"](), fns["bf16"](), torch.bfloat16)
            best = _interleaved_best(fns, rounds, min_sample_s, max_retries)
        row = Fp8Row(f"{base.name} decode, {str(dtype).replace('torch.', '')} paged cache (block {FP8_BLOCK}), q bf16",
                     best, err)
        rows.append(row)
        print(f"  fp8 {row.label}: " + ", ".join(f"{n} {_ms(t)}" for n, t in row.seconds.items())
              + " (ms, fastest rounds)", flush=True)
    return rows


def print_fp8(rows: list[Fp8Row]) -> None:
    print("| issue 29: fp8 KV cache | fp8 ms | bf16 cache ms | fp8 / bf16 | read fp8 bytes ms | fp8 / its read | "
          "read bf16 ms | fp8 vs bf16 output |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t = r.seconds
        print(f"| {r.label} | {_ms(t['fp8'])} | {_ms(t['bf16'])} | {t['fp8'] / t['bf16']:.2f}x | {_ms(t['fp8_read'])} | "
              f"{t['fp8'] / t['fp8_read']:.2f}x | {_ms(t['bf16_read'])} | {r.agree:.1e} |")


# ----------------------------------------------------------------------------------------------
# report


def _label(w: Workload) -> str:
    parts = [w.name]
    if w.dtype != torch.float32:
        parts.append(_dt(w.dtype))
    if w.causal and w.name != "W4":
        parts.append("causal")
    parts.append("fwd+bwd" if w.backward else "fwd")
    return " ".join(parts)


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _best_contender(r: Row) -> tuple[str, float]:
    anchors = {n: r.medians[n] for n in ANCHORS if n in r.medians}
    best = min(anchors, key=anchors.get)
    return best, anchors[best]


def _gflops(r: Row, best: bool = False) -> float:
    """Our GFLOP/s in the median round, or in the fastest (``best``: to set against the GEMM
    rate, itself the fastest round, so that a busy machine lowers neither alone)."""
    return r.workload.flops() / (r.bests if best and r.bests else r.medians)["ours"] / 1e9


def paired_ratio(r: Row, other: str) -> Optional[tuple[float, float, float]]:
    """other's time over ours round by round (both timed in the same round, back to back): the
    median, lowest and highest of those ratios, or None when other was not timed every round. On a
    shared machine a busy spell slows both calls of a round, so the per-round ratio moves less than
    either median."""
    if not r.samples or other in r.slow or len(r.samples.get(other, ())) != len(r.samples["ours"]):
        return None
    ratios = sorted(o / ours for o, ours in zip(r.samples[other], r.samples["ours"]))
    return statistics.median(ratios), ratios[0], ratios[-1]


def print_table(rows: list[Row], gemm: Optional[Gemm]) -> None:
    print("| workload | kernel path | ISA / tile | ours ms | GFLOP/s | best GFLOP/s (% of GEMM) | NJT SDPA | padded+mask | loop | "
          "bucketed | flex | best contender | best/ours | peak MiB ours / loop | repeated rounds |")
    print("|---|---|---|" + "---:|" * 3 + "---:|" * 5 + "---|---:|---|---:|")
    for r in rows:
        m = r.medians
        best, best_s = _best_contender(r)
        mem = f"{r.memory['ours'] / 2**20:.1f} / {r.memory['loop'] / 2**20:.1f}" if "loop" in r.memory else "-"
        share = f"{_gflops(r, True):.0f} ({100 * _gflops(r, True) / gemm.best[r.workload.dtype][0]:.0f}%)" if gemm \
            else "-"
        print(f"| {_label(r.workload)} | {kernel_path(r.workload)} | {isa_tile(r.workload)} | {_ms(m['ours'])} | {_gflops(r):.0f} | {share} | {_ms(m.get('njt'))} | "
              f"{_ms(m.get('padded'))} | {_ms(m.get('loop'))} | {_ms(m.get('bucketed'))} | {_ms(m.get('flex'))} | "
              f"{best} | {best_s / m['ours']:.2f}x | {mem} | {r.repeated} |")
    for r in rows:
        best = _best_contender(r)[0]
        paired = paired_ratio(r, best)
        if paired is not None:
            print(f"# {_label(r.workload)}: {best}/ours round by round: median {paired[0]:.2f}x "
                  f"(lowest {paired[1]:.2f}x, highest {paired[2]:.2f}x, {len(r.samples['ours'])} rounds)")
        if "kv_read" in r.medians:
            print(f"# {_label(r.workload)}: reading its K/V once (int64 word sums) {_ms(r.medians['kv_read'])} ms, "
                  f"ours {r.medians['ours'] / r.medians['kv_read']:.2f}x that")
        for name, note in r.notes.items():
            print(f"# {_label(r.workload)}: {name}: {note}")


def print_tiny(tiny: dict) -> None:
    print("| tiny call (us per call) | " + " | ".join(tiny) + " |")
    print("|---|" + "---:|" * len(tiny))
    print("| B=4, lengths 6..10, H=2, D=16 | " + " | ".join(f"{t * 1e6:.0f}" for t in tiny.values()) + " |")


# Issue 14's and issue 22's targets: (text, workload label, kind, bound). Kinds: "gemm" (share of the dtype's
# GEMM rate, at least), "kv" (time over reading K/V, at most).
TARGETS = (
    ("W1 fp32 fwd >= 70% of fp32 GEMM", "W1 fwd", "gemm", 0.70),
    ("W3 fp32 fwd >= 70% of fp32 GEMM", "W3 fwd", "gemm", 0.70),
    ("W1 fp32 fwd+bwd >= 50% of fp32 GEMM", "W1 fwd+bwd", "gemm", 0.50),
    ("W5 bf16 fwd >= 60% of bf16 GEMM", "W5 bfloat16 fwd", "gemm", 0.60),
    ("W5 bf16 fwd+bwd >= 45% of bf16 GEMM", "W5 bfloat16 fwd+bwd", "gemm", 0.45),
    ("W4 decode <= 2x reading its K/V", "W4 fwd", "kv", 2.0),
    # issue 22: bf16 at AMX speed (its W5 targets replace none of the above: both are printed)
    ("W5 bf16 fwd >= 35% of bf16 GEMM (issue 22)", "W5 bfloat16 fwd", "gemm", 0.35),
    ("W5 bf16 fwd+bwd >= 30% of bf16 GEMM (issue 22)", "W5 bfloat16 fwd+bwd", "gemm", 0.30),
    ("W4 bf16 decode <= 1.5x reading its K/V (issue 22)", "W4 bfloat16 fwd", "kv", 1.5),
)


def target_rows(rows: list[Row], gemm: Optional[Gemm], tiny: Optional[dict],
                options: Optional[list] = None) -> list[tuple[str, str, str]]:
    """(target, measured, met) for every target this run measured."""
    by_label = {_label(r.workload): r for r in rows}
    out = []
    for text, label, kind, bound in TARGETS:
        r = by_label.get(label)
        if r is None:
            continue
        if kind == "gemm":
            if gemm is None:
                continue
            rate = gemm.best[r.workload.dtype][0]
            share = _gflops(r, True) / rate
            out.append((text, f"{100 * share:.0f}% ({_gflops(r, True):.0f} of {rate:.0f} GFLOP/s, fastest rounds)",
                        "met" if share >= bound else "unmet"))
        else:
            ratio = r.medians["ours"] / r.medians["kv_read"]
            out.append((text, f"{ratio:.2f}x ({_ms(r.medians['ours'])} vs {_ms(r.medians['kv_read'])} ms)",
                        "met" if ratio <= bound else "unmet"))
    if tiny:
        ratio = tiny["ours (varlen)"] / tiny["dense SDPA"]
        out.append(("tiny varlen <= 3x one dense SDPA call",
                    f"{ratio:.1f}x ({tiny['ours (varlen)'] * 1e6:.0f} vs {tiny['dense SDPA'] * 1e6:.0f} us)",
                    "met" if ratio <= 3 else "unmet"))
        ratio = tiny["njt"] / tiny["ours (sdpa, NJT)"]
        out.append(("tiny sdpa <= 1/20 of NJT SDPA's time",
                    f"1/{ratio:.1f} ({tiny['ours (sdpa, NJT)'] * 1e6:.0f} vs {tiny['njt'] * 1e6:.0f} us)",
                    "met" if ratio >= 20 else "unmet"))
    if rows:
        ratios = {_label(r.workload): _best_contender(r)[1] / r.medians["ours"] for r in rows}
        below = [f"{label} {x:.2f}x" for label, x in ratios.items() if x < 1.0]
        worst = min(ratios, key=ratios.get)
        out.append(("every row >= 1.0x the fastest contender",
                    f"lowest {worst} {ratios[worst]:.2f}x" + (f"; below: {', '.join(below)}" if below else ""),
                    "unmet" if below else "met"))
    if options:
        cut = max(options, key=lambda r: r.time_ratio("cut"))
        uncut = max(options, key=lambda r: r.pair_ratio("uncut"))
        worst = max(cut.time_ratio("cut"), uncut.pair_ratio("uncut"))
        out.append(("sinks + chunk_size + prefix_lens <= 1.10x the plain call (issue 20)",
                    f"time {cut.time_ratio('cut'):.2f}x ({cut.label}, chunk {cut.chunks['cut']}); per visible pair "
                    f"{uncut.pair_ratio('uncut'):.2f}x ({uncut.label}, chunk {uncut.chunks['uncut']}); worst of each",
                    "met" if worst <= 1.10 else "unmet"))
    return out


def print_targets(targets) -> None:
    print("| target | measured | |")
    print("|---|---|---|")
    for text, measured, met in targets:
        print(f"| {text} | {measured} | {met} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, short samples, smaller GEMMs")
    parser.add_argument("--only", default="", help="comma-separated workload names, e.g. W1,W2,tiny")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-flex", action="store_true", help="leave out FlexAttention (its compiles take minutes)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, min_sample, retries = (3, 0.03, 1) if args.quick else (7, 0.1, 4)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    names = tuple(n for n in CONTENDERS if not (args.no_flex and n == "flex"))
    for line in machine_lines():
        print(line)
    print(f"# rounds {rounds}; medians of rounds for attention, best of rounds for GEMMs", flush=True)
    gemm = gemm_rates(QUICK_GEMM_SHAPES if args.quick else GEMM_SHAPES, rounds, min_sample)
    print_gemm(gemm)
    torch.set_grad_enabled(True)
    rows = []
    for w in standard_workloads():
        if only and w.name not in only:
            continue
        row = run_workload(w, rounds, min_sample, retries, skip_slow_s=1.0 if args.quick else 3.0, names=names)
        rows.append(row)
        print(f"  {_label(w)}: " + ", ".join(f"{n} {_ms(t)}" for n, t in row.medians.items())
              + f"  (ms; repeated {row.repeated})", flush=True)
    # Memory last, each contender in a fresh process: fixing glibc's mmap threshold there makes
    # freed large blocks leave RSS at once (so the peak is measurable) but turns every large
    # allocation into fresh page faults, which would distort timings (2.5x on our bf16 path).
    if not args.no_memory:
        for row in rows:
            measure_memory(row)
    options = None
    if not only or "options" in only:
        options = options_rows(rounds, min_sample, retries)
    fp8 = None
    if not only or "fp8" in only:
        fp8 = fp8_rows(rounds, min_sample, retries)
    tiny = None
    if not only or "tiny" in only:
        with torch.no_grad():
            tiny = tiny_rows(reps=200 if args.quick else 1000, rounds=rounds)
    print()
    if rows:
        print_table(rows, gemm)
        print()
    if options:
        print_options(options)
        print()
    if fp8:
        print_fp8(fp8)
        print()
    if tiny:
        print_tiny(tiny)
        print()
    print_targets(target_rows(rows, gemm, tiny, options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
