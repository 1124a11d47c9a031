"""Command line: ``jagged-sdpa demo | explain | bench`` (also ``python -m jagged_sdpa``).

Argument parsing and printing only; every decision is made by the public API.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import jagged_sdpa
from jagged_sdpa import batch as batches
from jagged_sdpa import options as opts
from jagged_sdpa import spec as specs
from jagged_sdpa.backends import Backend
from jagged_sdpa.selection import select
from jagged_sdpa.spec import AttnSpec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEMO_LENGTHS = [37, 5, 300, 0, 1, 128, 64, 211]


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must be >= 0, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _pair(text: str) -> tuple[int, int]:
    values = [int(x) for x in text.split(",")]
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected L,R, got {text!r}")
    return values[0], values[1]


def best_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def run_device(name: Optional[str]) -> torch.device:
    """The device ``demo``/``bench`` run on: ``--device``, else the best one; a device this torch
    cannot run on is a one-line error, not torch's ``AssertionError`` from deep inside."""
    if not name:
        return best_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise SystemExit(f"--device {name}: this torch ({torch.__version__}) is a CPU-only build; "
                             "install a CUDA build of torch, or use --device cpu")
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: no CUDA device is visible; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def ragged_batch(lengths, heads, head_dim, dtype, device, requires_grad=False, seed=0):
    """A (B, H, j, D) NJT with the given lengths, as attention layers build it."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, heads, head_dim, generator=gen).to(device=device, dtype=dtype) for n in lengths]
    njt = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=requires_grad)
    return njt.transpose(1, 2)


def padded_reference(q, k, v, lengths, kv_lengths, is_causal, enable_gqa):
    """Padded dense SDPA with a boolean mask: what users do without jagged_sdpa."""
    # Padded in the (B, j, H, D) layout the NJTs were built in: to_padded_tensor's backward cannot
    # map a gradient back through the transposed (B, H, j, D) view.
    qd, kd, vd = (x.transpose(1, 2).to_padded_tensor(0.0).transpose(1, 2).float() for x in (q, k, v))
    lq, lk = qd.shape[2], kd.shape[2]
    device = qd.device
    kq = torch.tensor(kv_lengths, device=device)
    mask = torch.arange(lk, device=device)[None, :] < kq[:, None]           # (B, Lk)
    mask = mask[:, None, None, :].expand(-1, 1, lq, -1)
    if is_causal:
        mask = mask & torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=enable_gqa)
    return [out[b, :, : lengths[b]].nan_to_num(0.0) for b in range(len(lengths))]


def _timeit(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _sync_for(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def cmd_demo(args) -> int:
    device = run_device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    lengths, heads, kv_heads, head_dim = DEMO_LENGTHS, 8, 2, 64
    print(f"jagged_sdpa {jagged_sdpa.__version__} demo on {device} ({dtype}), torch {torch.__version__}")
    print(f"ragged batch: lengths {lengths}, Hq={heads} Hkv={kv_heads} D={head_dim}, causal")
    q = ragged_batch(lengths, heads, head_dim, dtype, device, seed=1)
    k = ragged_batch(lengths, kv_heads, head_dim, dtype, device, seed=2)
    v = ragged_batch(lengths, kv_heads, head_dim, dtype, device, seed=3)
    kwargs = dict(is_causal=True, enable_gqa=True)
    explanation = jagged_sdpa.explain(q, k, v, **kwargs)
    print("\n" + str(explanation) + "\n")
    out = jagged_sdpa.sdpa(q, k, v, **kwargs)
    expected = padded_reference(q, k, v, lengths, lengths, True, True)
    worst = max((o.float() - e).abs().max().item() if o.numel() else 0.0
                for o, e in zip(out.unbind(), expected))
    tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    ok = worst <= tol and not any(torch.isnan(o).any() for o in out.unbind())
    print(f"check vs padded dense SDPA: max abs error {worst:.2e} (tolerance {tol:g}) -> {'OK' if ok else 'MISMATCH'}")
    sync = _sync_for(device)
    t_ours = _timeit(lambda: jagged_sdpa.sdpa(q, k, v, **kwargs), args.repeats, sync)
    t_pad = _timeit(lambda: padded_reference(q, k, v, lengths, lengths, True, True), args.repeats, sync)
    print(f"timings (median of {args.repeats}): jagged_sdpa [{explanation.chosen.value}] {t_ours:.2f} ms, "
          f"padded+mask SDPA {t_pad:.2f} ms")
    return 0 if ok else 1


def spec_from_args(args) -> AttnSpec:
    """A tensor-free spec for ``explain``: nothing is allocated, so any device can be described."""
    lengths = args.lengths
    kv_lengths = args.kv_lengths if args.kv_lengths is not None else lengths
    if len(kv_lengths) != len(lengths):
        raise SystemExit(f"--kv-lengths has {len(kv_lengths)} entries but --lengths has {len(lengths)}")
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        raise SystemExit(f"--heads {args.heads} must be a multiple of --kv-heads {kv_heads}")
    device = torch.device(args.device)
    capability = None
    if args.capability:
        major, minor = args.capability.split(".")
        capability = (int(major), int(minor))
    elif device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    window = tuple(args.window) if args.window else (-1, -1)
    # The spec the call itself would build (``spec.for_layer``: Lq == Lk, the effective window, ...),
    # over meta tensors of the call's shapes, then placed on the device described.
    meta = dict(device="meta", dtype=DTYPES[args.dtype])
    head_dim_v = args.head_dim_v or args.head_dim
    q = torch.empty(sum(lengths), args.heads, args.head_dim, **meta)
    k = torch.empty(sum(kv_lengths), kv_heads, args.head_dim, **meta)
    v = torch.empty(sum(kv_lengths), kv_heads, head_dim_v, **meta)
    cu = lambda ls: torch.tensor([0] + [sum(ls[:i + 1]) for i in range(len(ls))], dtype=torch.int32)
    cu_q = cu(lengths)
    cu_k = cu_q if args.kv_lengths is None else cu(kv_lengths)
    prefix_lens = None
    if args.prefix_lens is not None:
        if len(args.prefix_lens) != len(lengths):
            raise SystemExit(f"--prefix-lens has {len(args.prefix_lens)} entries but --lengths has {len(lengths)}")
        prefix_lens = torch.tensor(args.prefix_lens, dtype=torch.int32)
    try:  # the call's own checks, with the flags' names for the arguments'
        batch = batches.build(cu_q, cu_k, None, None, read=True, names=batches.SDPA_NAMES, prefix_lens=prefix_lens)
        options = opts.sdpa(args.dropout, args.causal, None, "bottom_right" if args.bottom_right else "top_left",
                            window, args.softcap, chunk_size=args.chunk_size)
    except ValueError as err:
        raise SystemExit(str(err).replace("prefix_lens", "--prefix-lens").replace("chunk_size", "--chunk-size"))
    alibi = "per_head" if args.alibi else None
    spec = specs.for_layer(batch, options, q, k, v, alibi, False, args.requires_grad, sinks=args.sinks,
                         sinks_grad=args.sinks and args.requires_grad)
    return spec.replace(device_type=device.type, capability=capability)


def cmd_explain(args) -> int:
    backend = Backend(args.backend) if args.backend else None
    print(select(spec_from_args(args), backend))
    return 0


def cmd_bench(args) -> int:
    device = run_device(args.device)
    dtype = DTYPES[args.dtype]
    lengths = args.lengths
    q = ragged_batch(lengths, args.heads, args.head_dim, dtype, device, args.backward, seed=1)
    k = ragged_batch(lengths, args.heads, args.head_dim, dtype, device, args.backward, seed=2)
    v = ragged_batch(lengths, args.heads, args.head_dim, dtype, device, args.backward, seed=3)
    sync = _sync_for(device)

    def step(fn):
        # The gradients are returned, never accumulated: torch cannot add a second backward's
        # gradient into an NJT leaf's ``.grad`` (``aten::stride does not exist``), and a timed
        # step should not pay for that sum anyway.
        def run():
            out = fn()
            if args.backward:
                loss = (out.values() if out.is_nested else out).float().sum()
                torch.autograd.grad(loss, (q, k, v), allow_unused=True)
        return run

    contenders: dict[str, Callable[[], object]] = {}
    explanation = jagged_sdpa.explain(q, k, v, is_causal=args.causal)
    contenders[f"auto ({explanation.chosen.value if explanation.chosen else 'none'})"] = step(
        lambda: jagged_sdpa.sdpa(q, k, v, is_causal=args.causal))
    for b in Backend:
        if not jagged_sdpa.explain(q, k, v, is_causal=args.causal, backend=b).reasons[b]:
            contenders[b.value] = step(lambda b=b: jagged_sdpa.sdpa(q, k, v, is_causal=args.causal, backend=b))
    if not args.causal:
        contenders["torch NJT SDPA"] = step(lambda: F.scaled_dot_product_attention(q, k, v))
    contenders["padded+mask SDPA"] = step(
        lambda: torch.cat(padded_reference(q, k, v, lengths, lengths, args.causal, False), dim=1))
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():
        fn()
    sync()
    for _ in range(args.repeats):  # interleaved rounds: a burst of load hits every contender alike
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    pass_name = "fwd+bwd" if args.backward else "fwd"
    print(f"bench: lengths {lengths}, H={args.heads} D={args.head_dim} {args.dtype} {device} "
          f"causal={args.causal} {pass_name}, median of {args.repeats} interleaved rounds")
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    best = min(medians.values())
    print(f"  {'contender':<24} {'ms':>10} {'x fastest':>10}")
    for name, ms in medians.items():
        print(f"  {name:<24} {ms:>10.3f} {ms / best:>10.2f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jagged-sdpa", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run sdpa on a synthetic ragged batch, check it, explain it, time it")
    demo.add_argument("--device", help="default: cuda if available, else cpu")
    demo.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    demo.add_argument("--repeats", type=_positive, default=10, help="timed calls per contender (default: %(default)s)")
    demo.set_defaults(func=cmd_demo)

    explain = sub.add_parser("explain", help="print the explain table for a call, without running attention")
    explain.add_argument("--lengths", type=_ints, required=True, help="query lengths, e.g. 5,17,300")
    explain.add_argument("--kv-lengths", type=_ints, help="key lengths (default: the query lengths)")
    explain.add_argument("--heads", type=int, default=8, help="query heads (default: %(default)s)")
    explain.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    explain.add_argument("--head-dim", type=int, default=64, help="head dim of q and k (default: %(default)s)")
    explain.add_argument("--head-dim-v", type=int, help="head dim of v (default: --head-dim)")
    explain.add_argument("--dtype", choices=DTYPES, default="float32", help="default: %(default)s")
    explain.add_argument("--device", default="cpu",
                         help="the device to describe; needs no such device here (default: %(default)s)")
    explain.add_argument("--capability", help="CUDA compute capability to assume, e.g. 9.0")
    explain.add_argument("--causal", action="store_true",
                         help="causal, top-left aligned as sdpa's is_causal=True (varlen_attention's "
                              "causal=True is bottom-right: add --bottom-right to describe it)")
    explain.add_argument("--bottom-right", action="store_true",
                         help="causal_alignment='bottom_right' (varlen_attention's causal)")
    explain.add_argument("--window", type=_pair, help="L,R sliding window")
    explain.add_argument("--softcap", type=float)
    explain.add_argument("--alibi", action="store_true")
    explain.add_argument("--dropout", type=float, default=0.0, help="dropout_p (default: %(default)s)")
    explain.add_argument("--sinks", action="store_true", help="a sink logit per query head (docs/api.md section 11)")
    explain.add_argument("--chunk-size", type=int, help="chunked attention: chunk length C (docs/api.md section 11)")
    explain.add_argument("--prefix-lens", type=_ints, help="prefix-LM: a prefix length per sequence (docs/api.md section 11)")
    explain.add_argument("--requires-grad", action="store_true")
    explain.add_argument("--backend", choices=[b.value for b in Backend], help="explain a forced backend")
    explain.set_defaults(func=cmd_explain)

    bench = sub.add_parser("bench", help="time the backends side by side against torch NJT SDPA and padded SDPA")
    bench.add_argument("--lengths", type=_ints, default=[37, 5, 300, 1, 128, 64, 211, 90],
                       help="sequence lengths (default: 37,5,300,1,128,64,211,90)")
    bench.add_argument("--heads", type=_positive, default=8, help="heads of q, k and v (default: %(default)s)")
    bench.add_argument("--head-dim", type=_positive, default=64, help="default: %(default)s")
    bench.add_argument("--dtype", choices=DTYPES, default="float32", help="default: %(default)s")
    bench.add_argument("--device", help="default: cuda if available, else cpu")
    bench.add_argument("--causal", action="store_true", help="top-left causal (sdpa's is_causal=True)")
    bench.add_argument("--backward", action="store_true", help="time forward+backward")
    bench.add_argument("--repeats", type=_positive, default=10, help="interleaved timed rounds (default: %(default)s)")
    bench.set_defaults(func=cmd_bench)
    return parser


def _quiet_torch_notices() -> None:
    """NJT construction makes torch log prototype/fx notices that say nothing about the demo's
    result; the CLI (never the library) silences them."""
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_torch_notices()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
