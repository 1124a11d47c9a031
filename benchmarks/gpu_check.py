"""What a first hour on a GPU runs first: every check only a GPU can make, in one script.

    python benchmarks/gpu_check.py [--out DIR] [--budget-s 480] [--skip-tests] [--skip-bench]
    python benchmarks/gpu_check.py --cpu [--out DIR]      # CI: the interpreter, tiny shapes

On CUDA (an H100/H200 with PyTorch >= 2.11 and Triton >= 3.6; about 8 minutes) it runs:

* the ``cuda``-marked tests (``pytest -m cuda``);
* TRITON with sinks, chunk_size and prefix_lens at shapes that reach the kernels' unmasked
  interior tiles, D=128 and D=256, forward and backward, against the float64 reference;
* one probe per item of the Triton/CUDA source review: paged split-K with a loose max_seqlen_k
  of 2**32 + 3, a column-major block table and strided ALiBi slopes, kernels launched without an
  autotuner (and a new length bucket first seen inside a CUDA-graph capture), fp32 D=256 decode
  with JAGGED_SDPA_TRITON_AUTOTUNE=1 (configs pruned to the shared memory), one-hot gradients at
  large logits, transformers' eager mask without a mask function;
* CUDA-graph decode probes: a captured decode step must read the seqused_k the caller last wrote;
* ``torch.compile(fullgraph=True)`` training steps through FLASH_VARLEN and TRITON with every
  option, against eager;
* K with more than 2**31 elements, forward and backward, against MATH on the rows it reads;
* host time per ``plan.run`` of a decode step;
* ``bench_cuda.py --quick``'s rows.

Each check prints PASS, FAIL or SKIP with a detail, as it finishes; at the end one JSON and one
markdown table (for BENCHMARKS.md) are written to ``--out``. ``--cpu`` runs the checks the CPU can
make (the Triton kernels under TRITON_INTERPRET=1 with tiny shapes, MATH in place of the CUDA
backends) and skips the rest, so the script cannot rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CI mode: interpreter and tiny shapes, GPU checks skipped")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "gpu_check_out")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new checks after this")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the cuda-marked tests")
    parser.add_argument("--skip-bench", action="store_true", help="do not run bench_cuda.py")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    return parser.parse_args(argv)


ARGS = _parse(sys.argv[1:] if __name__ == "__main__" else [])
if ARGS.cpu:
    # Triton reads this when kernels are decorated: before triton (or jagged_sdpa's kernels) import.
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import jagged_sdpa  # noqa: E402
from support.reference import attention_reference  # noqa: E402
from support.tolerances import assert_close_lse, assert_close_packed  # noqa: E402

CUDA = torch.cuda.is_available() and not ARGS.cpu
DEVICE = "cuda" if CUDA else "cpu"


class Skip(Exception):
    """A check that cannot run here; its message says why."""


def cu_of(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def reference(q, k, v, cu_q, cu_k, grad_out=None, **opts):
    """float64 out, lse and (with grad_out) gradients of q, k, v, on the CPU."""
    leaves = [x.detach().cpu().double().requires_grad_(grad_out is not None) for x in (q, k, v)]
    opts = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in opts.items()}
    out, lse = attention_reference(*leaves, cu_q.tolist(), cu_k.tolist(), **opts)
    grads = None
    if grad_out is not None:
        out.backward(grad_out.detach().cpu().double())
        grads = [x.grad for x in leaves]
    return out.detach(), lse.detach(), grads


def compare(got, ref, cu, name, grad=False):
    assert_close_packed(got.detach().cpu(), ref, cu_seqlens=cu.tolist(), name=name, grad=grad)


# ---------------------------------------------------------------------------------------------------
# checks: each returns a detail string (PASS), raises AssertionError (FAIL) or Skip


def check_cuda_tests():
    if not CUDA:
        raise Skip("no CUDA device")
    if ARGS.skip_tests:
        raise Skip("--skip-tests")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-m", "cuda",
                          str(ROOT / "tests")], capture_output=True, text=True, timeout=240, cwd=ROOT)
    tail = run.stdout.strip().splitlines()[-1:] or [run.stderr[-300:]]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]
    return tail[0]


def _triton_case(lens_q, lens_k, hq, hkv, d, dtype, **opts):
    q = torch.randn(sum(lens_q), hq, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), hkv, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), hkv, d, device=DEVICE, dtype=dtype, requires_grad=True)
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    out, lse = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend="triton", **opts)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_opts = {("window" if n == "window_size" else n): x for n, x in opts.items()}
    ref_out, ref_lse, grads = reference(q, k, v, cu_q, cu_k, grad_out, alignment="bottom_right", **ref_opts)
    compare(out, ref_out, cu_q, "out")
    assert_close_lse(lse.cpu(), ref_lse)
    for name, x, ref, cu in (("dq", q, grads[0], cu_q), ("dk", k, grads[1], cu_k), ("dv", v, grads[2], cu_k)):
        compare(x.grad, ref, cu, name, grad=True)


def check_triton_interior_tiles():
    """Sinks, chunks and prefixes with sequences long enough for unmasked interior tiles."""
    if CUDA:
        cases = [([700, 1, 513], [700, 300, 513], 128, torch.bfloat16), ([390, 260], [390, 512], 256, torch.float16)]
    else:
        cases = [([33, 1], [33, 20], 16, torch.float32)]
    done = []
    for lens_q, lens_k, d, dtype in cases:
        hq, hkv = 4, 2
        sinks = torch.randn(hq, device=DEVICE)
        prefix = torch.tensor([min(n, 37) for n in lens_q], dtype=torch.int32, device=DEVICE)
        for opts in (dict(causal=True, sinks=sinks), dict(causal=True, chunk_size=96 if CUDA else 16),
                     dict(causal=True, prefix_lens=prefix, window_size=(200 if CUDA else 20, 0))):
            _triton_case(lens_q, lens_k, hq, hkv, d, dtype, **opts)
            done.append(f"D{d} {str(dtype)[6:]} {'+'.join(sorted(opts))}")
    return "; ".join(done)


def _paged(lens_k, hkv, d, block_size, dtype=torch.float32):
    """A shuffled paged cache (NaN where no key lives) and the packed keys it holds."""
    blocks = [max(1, -(-n // block_size)) for n in lens_k]
    num = sum(blocks) + 1
    perm = torch.randperm(num).tolist()
    kc = torch.full((num, block_size, hkv, d), float("nan"), dtype=dtype)
    vc = torch.full((num, block_size, hkv, d), float("nan"), dtype=dtype)
    table = torch.zeros(len(lens_k), max(blocks), dtype=torch.int32)
    kp, vp = torch.randn(sum(lens_k), hkv, d).to(dtype), torch.randn(sum(lens_k), hkv, d).to(dtype)
    nxt = start = 0
    for b, n in enumerate(lens_k):
        for i in range(blocks[b]):
            blk = perm[nxt]
            nxt += 1
            table[b, i] = blk
            rows = slice(start + i * block_size, start + min(n, (i + 1) * block_size))
            kc[blk, :rows.stop - rows.start] = kp[rows]
            vc[blk, :rows.stop - rows.start] = vp[rows]
        start += n
    return kc.to(DEVICE), vc.to(DEVICE), table.to(DEVICE), kp, vp


def check_paged_split_k_past_2_32():
    from jagged_sdpa.backends.triton.fwd import launch_fwd
    from jagged_sdpa.backends.triton.fwd import merge_splits
    from support.described_call import prepare_varlen

    lens_k = [300, 4000] if CUDA else [300]
    lens_q = [1] * len(lens_k)
    kc, vc, table, kp, vp = _paged(lens_k, 1, 64 if CUDA else 16, 64)
    q = torch.randn(len(lens_q), 2, kc.shape[-1], device=DEVICE)
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    cu_q = cu_of(lens_q)
    ref_out, ref_lse, _ = reference(q, kp, vp, cu_q, cu_of(lens_k))
    args = (q, kc, vc, cu_q, None, 1, 2**32 + 3)
    call, _, _ = prepare_varlen(*args, return_lse=True, block_table=table, seqused_k=used, backend="triton")
    parts = launch_fwd(call, num_splits=16)
    out, lse = merge_splits(parts.out, parts.lse, q.dtype)
    compare(out, ref_out, cu_q, "out (16 forced splits)")
    assert_close_lse(lse.cpu(), ref_lse, name="lse (16 forced splits)")
    out, lse = jagged_sdpa.varlen_attention(*args, block_table=table, seqused_k=used, return_lse=True,
                                            backend="triton")
    compare(out, ref_out, cu_q, "out")
    assert_close_lse(lse.cpu(), ref_lse)
    return f"keys {lens_k}, max_seqlen_k 2**32+3"


def check_fp8_cache_decode():
    """An fp8 paged cache (docs/api.md section 13) read by TRITON in bf16 and fp16, both formats,
    per-kv-head scales, long enough on CUDA for split-K: against float64 on the dequantized keys."""
    lens_k = [1700, 33, 2500] if CUDA else [70, 33]
    hq, hkv, d = 8, 2, 64 if CUDA else 16
    kc, vc, table, kp, vp = _paged(lens_k, hkv, d, 16)
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    cu_q = cu_of([1] * len(lens_k))
    k_scale = torch.tensor([0.02, 0.05], device=DEVICE)
    v_scale = torch.tensor(0.03, device=DEVICE)
    done = []
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        largest = torch.finfo(fp8).max
        quant = lambda x, s: (x.float() / s.reshape(-1, 1)).clamp(-largest, largest).to(fp8)
        k8, v8 = quant(kc, k_scale), quant(vc, v_scale)
        kd = quant(kp.to(DEVICE), k_scale).float() * k_scale.reshape(-1, 1)
        vd = quant(vp.to(DEVICE), v_scale).float() * v_scale.reshape(-1, 1)
        for dtype in ((torch.bfloat16, torch.float16) if CUDA else (torch.float32,)):
            q = torch.randn(len(lens_k), hq, d, device=DEVICE).to(dtype)
            ref_out, ref_lse, _ = reference(q, kd, vd, cu_q, cu_of(lens_k), causal=True, alignment="bottom_right")
            out, lse = jagged_sdpa.varlen_attention(q, k8, v8, cu_q, None, 1, max(lens_k), block_table=table,
                                                    seqused_k=used, k_scale=k_scale, v_scale=v_scale, causal=True,
                                                    return_lse=True, backend="triton")
            compare(out, ref_out, cu_q, f"out {fp8} q {dtype}")
            assert_close_lse(lse.cpu(), ref_lse, name=f"lse {fp8} q {dtype}")
            done.append(f"{str(fp8)[6:]}/{str(dtype)[6:]}")
    return "keys " + str(lens_k) + ": " + ", ".join(done)


def check_fp8_every_code():
    """Every finite code of both fp8 formats as K and V bytes (subnormals, the largest values, -0)
    through TRITON's decoding (the GPU's own conversion for e4m3fn on sm89+, a shift for e5m2), against
    float64 on torch's own widening of the same bytes; then a NaN byte in one used V element must
    make exactly that output element NaN for the heads reading it."""
    hq, hkv, d, block = 4, 2, 32, 16
    lens_k = [300, 41] if CUDA else [40, 9]
    blocks = [-(-n // block) for n in lens_k]
    table = torch.arange(sum(blocks), dtype=torch.int32).reshape(-1)
    table = torch.stack([torch.nn.functional.pad(t, (0, max(blocks) - len(t))) for t in table.split(blocks)])
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    cu_q = cu_of([1] * len(lens_k))
    gen = torch.Generator().manual_seed(3)
    done = []
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        finite = codes[torch.isfinite(codes.view(fp8).float())]
        shape = (sum(blocks), block, hkv, d)
        picks = [finite[torch.randint(len(finite), shape, generator=gen)] for _ in range(2)]
        picks[0].view(-1)[:len(finite)] = finite  # each code at least once
        k8, v8 = (x.view(fp8).to(DEVICE) for x in picks)
        # logits and values of a few units: scales put each format's largest value near 1-8
        k_scale = torch.tensor([2.0 ** -9, 2.0 ** -7] if fp8 == torch.float8_e4m3fn else [2.0 ** -16, 2.0 ** -14])
        v_scale = torch.tensor(2.0 ** -6 if fp8 == torch.float8_e4m3fn else 2.0 ** -14)

        def rows(cache, scale):  # the used keys of each sequence, packed, widened by torch, scaled
            widened = cache.cpu().float()
            return torch.cat([widened[table[b, :blocks[b]].long()].reshape(-1, hkv, d)[:n]
                              for b, n in enumerate(lens_k)]) * scale.reshape(-1, 1)

        kd, vd = rows(k8, k_scale), rows(v8, v_scale)
        q = torch.randn(len(lens_k), hq, d, generator=gen).to(DEVICE, torch.bfloat16 if CUDA else torch.float32)
        kwargs = dict(block_table=table.to(DEVICE), seqused_k=used, k_scale=k_scale.to(DEVICE),
                      v_scale=v_scale.to(DEVICE), return_lse=True, backend="triton")
        out, lse = jagged_sdpa.varlen_attention(q, k8, v8, cu_q, None, 1, max(lens_k), **kwargs)
        ref_out, ref_lse, _ = reference(q, kd, vd, cu_q, cu_of(lens_k))
        compare(out, ref_out, cu_q, f"out {fp8}")
        assert_close_lse(lse.cpu(), ref_lse, name=f"lse {fp8}")
        nan_code = 0x7F if fp8 == torch.float8_e4m3fn else 0x7E
        v_nan = v8.view(torch.uint8).clone()
        v_nan[table[0, 1], 3, 1, 5] = nan_code  # sequence 0, key 19, kv head 1, dim 5
        out, _ = jagged_sdpa.varlen_attention(q, k8, v_nan.view(fp8), cu_q, None, 1, max(lens_k), **kwargs)
        expected = torch.zeros_like(out, dtype=torch.bool)
        expected[0, 2:, 5] = True  # query heads 2, 3 read kv head 1
        assert torch.equal(torch.isnan(out), expected), f"{fp8}: NaN at {torch.isnan(out).nonzero().tolist()}"
        done.append(f"{str(fp8)[6:]}: {len(finite)} codes")
    return ", ".join(done)


def check_strided_table_and_slopes():
    lens_q, lens_k, hq, d = [3, 1], [40, 21], 2, 16
    kc, vc, table, kp, vp = _paged(lens_k, 1, d, 16)
    table = table.t().contiguous().t()
    slopes = torch.rand(2 * hq, device=DEVICE)[::2]
    q = torch.randn(sum(lens_q), hq, d, device=DEVICE)
    out, lse = jagged_sdpa.varlen_attention(q, kc, vc, cu_of(lens_q), None, 3, 40, block_table=table,
                                            seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=DEVICE),
                                            causal=True, alibi_slopes=slopes, return_lse=True, backend="triton")
    ref_out, ref_lse, _ = reference(q, kp, vp, cu_of(lens_q), cu_of(lens_k), causal=True, alignment="bottom_right",
                                    alibi_slopes=slopes.contiguous())
    compare(out, ref_out, cu_of(lens_q), "out")
    assert_close_lse(lse.cpu(), ref_lse)
    return f"block table strides {tuple(table.stride())}, slopes stride {slopes.stride()}"


def check_no_autotuner_and_graph_capture():
    from triton.runtime.autotuner import Autotuner
    from jagged_sdpa.backends.triton import bwd, fwd

    kinds = {name: type(k).__name__ for name, k in (("fwd", fwd._attn_fwd), ("dkdv", bwd._attn_bwd_dkdv),
                                                   ("dq", bwd._attn_bwd_dq))}
    assert fwd.AUTOTUNE or not any(isinstance(k, Autotuner) for k in (fwd._attn_fwd, bwd._attn_bwd_dkdv,
                                                                      bwd._attn_bwd_dq)), kinds
    if not CUDA:
        return f"kernels {kinds} (capture: needs CUDA)"
    # Warm one length bucket, then capture a call whose max_seqlen_k falls in a new one.
    hq, hkv, d = 8, 2, 128
    q = torch.randn(4, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4 * 3000, hkv, d, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(5, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(5, device="cuda", dtype=torch.int32) * 3000
    cu_short = torch.arange(5, device="cuda", dtype=torch.int32) * 900  # max_seqlen_k must bound the lengths
    jagged_sdpa.varlen_attention(q, k[:3600], k[:3600], cu_q, cu_short, 1, 900, backend="triton")  # bucket 1024
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = jagged_sdpa.varlen_attention(q, k, k, cu_q, cu_k, 1, 3000, backend="triton")  # bucket 4096
    graph.replay()
    torch.cuda.synchronize()
    eager = jagged_sdpa.varlen_attention(q, k, k, cu_q, cu_k, 1, 3000, backend="triton")
    assert torch.equal(out, eager)
    return f"kernels {kinds}; capture at a new bucket ok ({(time.perf_counter() - start) * 1e3:.0f} ms)"


def check_fp32_d256_decode_autotune():
    if not CUDA:
        raise Skip("autotuning needs a GPU")
    code = (
        "import torch, jagged_sdpa\n"
        "q = torch.randn(8, 8, 256, device='cuda')\n"
        "k = torch.randn(8 * 700, 2, 256, device='cuda')\n"
        "cu_q = torch.arange(9, device='cuda', dtype=torch.int32)\n"
        "cu_k = cu_q * 700\n"
        "out = jagged_sdpa.varlen_attention(q, k, k, cu_q, cu_k, 1, 700, backend='triton')\n"
        "ref = jagged_sdpa.varlen_attention(q.double(), k.double(), k.double(), cu_q, cu_k, 1, 700, backend='math')\n"
        "print('maxerr', (out.double() - ref).abs().max().item())\n"
    )
    env = dict(os.environ, JAGGED_SDPA_TRITON_AUTOTUNE="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    err = float(run.stdout.split("maxerr")[-1])
    assert err < 1e-4, run.stdout
    return run.stdout.strip()


def check_one_hot_gradients():
    """Large logits make every row one-hot: MATH's dk is exact there; TRITON's within tolerance."""
    lens = [3, 7]
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(sum(lens), 1, 32, generator=gen) * 300).to(DEVICE).requires_grad_(True)
    k = torch.randn(sum(lens), 1, 32, generator=gen).to(DEVICE).requires_grad_(True)
    v = torch.randn(sum(lens), 1, 32, generator=gen).to(DEVICE).requires_grad_(True)
    cu = cu_of(lens)
    out = jagged_sdpa.varlen_attention(q, k, v, cu, cu, causal=True, softmax_scale=1.95, backend="triton")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, _, grads = reference(q, k, v, cu, cu, grad_out, causal=True, scale=1.95, alignment="bottom_right")
    compare(out, ref_out, cu, "out")
    errors = {}
    for name, x, ref in (("dq", q, grads[0]), ("dk", k, grads[1]), ("dv", v, grads[2])):
        errors[name] = (x.grad.detach().cpu().double() - ref).abs().max().item()
        compare(x.grad, ref, cu, name, grad=True)
    return ", ".join(f"{n} err {e:.1e}" for n, e in errors.items())


def check_eager_mask_without_mask_function():
    try:
        from transformers import masking_utils
    except Exception as error:  # transformers is optional
        raise Skip(f"transformers not importable: {error}")
    from jagged_sdpa.integrations.transformers import eager as jt_eager

    mask = jt_eager.eager_mask(2, 3, 5, 2, 0, None, None, False, None)
    expected = masking_utils.eager_mask(batch_size=2, q_length=3, kv_length=5, q_offset=2, kv_offset=0,
                                        mask_function=masking_utils.causal_mask_function, attention_mask=None,
                                        use_vmap=False, device="cpu")
    assert torch.equal(mask, expected)
    return "causal mask"


def check_graph_decode_reads_seqused_k():
    """A captured decode step must read the seqused_k the caller writes before each replay."""
    if not CUDA:
        raise Skip("CUDA graphs need a GPU")
    results = []
    for backend in ("flash_varlen", "triton"):
        b, hq, hkv, d, s = 4, 8, 2, 128, 512
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        kc, vc, table, _, _ = _paged([s] * b, hkv, d, 256, torch.bfloat16)
        kc, vc = torch.randn_like(kc), torch.randn_like(vc)
        used = torch.full((b,), 100, dtype=torch.int32, device="cuda")
        cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        step = lambda: jagged_sdpa.varlen_attention(q, kc, vc, cu_q, None, 1, s, block_table=table,  # noqa: E731
                                                    seqused_k=used, backend=backend)
        try:
            step()
        except jagged_sdpa.NoBackendError as error:
            results.append(f"{backend}: not eligible ({str(error).splitlines()[0]})")
            continue
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        used.copy_(torch.tensor([500, 3, 250, 100], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        expected = step()
        assert torch.allclose(out.float(), expected.float(), atol=2e-2), (
            f"{backend}: the replay ignored seqused_k.copy_() (max diff {(out - expected).abs().max().item():.3g})")
        results.append(f"{backend}: replay reads the new seqused_k")
    return "; ".join(results)


def check_compiled_training_step():
    """torch.compile(fullgraph=True) training steps with every option against eager."""
    backends = ("flash_varlen", "triton") if CUDA else ("math",)
    dtype = torch.bfloat16 if CUDA else torch.float32
    lens = [37, 1, 130] if CUDA else [5, 1, 9]
    hq, hkv, d = 4, 2, 64 if CUDA else 16
    cu = cu_of(lens)
    done = []
    for backend in backends:
        options = [dict(causal=True), dict(causal=True, window_size=(16, 0), softcap=5.0)] if CUDA else []
        if backend != "flash_varlen":
            options.append(dict(causal=True, sinks=torch.randn(hq, device=DEVICE), chunk_size=8,
                                prefix_lens=torch.tensor([3, 1, 2], dtype=torch.int32, device=DEVICE)))
        for opts in options:
            def step(q, k, v):
                out = jagged_sdpa.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), backend=backend, **opts)
                return (out.float() ** 2).sum()

            torch._dynamo.reset()
            compiled = torch.compile(step, fullgraph=True)
            base = [torch.randn(sum(lens), h, d, device=DEVICE, dtype=dtype) for h in (hq, hkv, hkv)]
            grads = []
            for fn in (step, compiled):
                leaves = [x.clone().requires_grad_(True) for x in base]
                fn(*leaves).backward()
                grads.append([x.grad for x in leaves])
            for eager, comp in zip(*grads):
                torch.testing.assert_close(comp, eager, atol=1e-2 if CUDA else 1e-5, rtol=1e-2 if CUDA else 1e-5)
            done.append(f"{backend} {'+'.join(sorted(opts))}")
    return "; ".join(done)


def check_k_beyond_2_31_elements():
    if not CUDA:
        raise Skip("needs ~9 GB of GPU memory")
    hkv, d = 8, 128
    rows = (2**31) // (hkv * d) + 4096
    done = []
    k = torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16)
    lens_k = [rows - 1000, 1000]
    lens_q = [8, 64]
    cu_k = cu_of(lens_k)
    cu_q = cu_of(lens_q)
    tail_k, tail_v = k[rows - 1000:], v[rows - 1000:]
    for backend in ("triton", "flash_varlen"):
        q = torch.randn(sum(lens_q), 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kk = k.requires_grad_(True)
        out = jagged_sdpa.varlen_attention(q, kk, v, cu_q, cu_k, 64, rows, causal=True, backend=backend)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        # The last sequence's keys start past row 2**31 / (Hkv D): MATH on those rows only.
        q2 = q.detach()[8:].clone().requires_grad_(True)
        k2 = tail_k.detach().clone().requires_grad_(True)
        ref = jagged_sdpa.varlen_attention(q2, k2, tail_v, cu_of([64]), cu_of([1000]), causal=True, backend="math")
        ref.backward(grad_out[8:])
        torch.testing.assert_close(out[8:], ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(q.grad[8:], q2.grad, atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(kk.grad[rows - 1000:], k2.grad, atol=5e-2, rtol=5e-2)
        done.append(f"{backend} fwd+bwd")
        kk.grad = None
        k.requires_grad_(False)
    del k, v
    torch.cuda.empty_cache()
    return f"K {rows} x {hkv} x {d} = {rows * hkv * d / 2**31:.3f} x 2**31 elements: " + ", ".join(done)


def check_plan_run_host_time():
    backend = "triton" if CUDA else "math"
    b, hq, hkv, d, s = (64, 32, 8, 128, 2048) if CUDA else (4, 4, 2, 16, 64)
    dtype = torch.bfloat16 if CUDA else torch.float32
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b * s, hkv, d, device=DEVICE, dtype=dtype)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=DEVICE)
    cu_k = cu_q * s
    plan = jagged_sdpa.plan(cu_q, cu_k, 1, s, causal=True, backend=backend)
    for _ in range(5):
        plan.run(q, k, k)
    if CUDA:
        torch.cuda.synchronize()
    times = []
    for _ in range(50 if CUDA else 5):
        start = time.perf_counter()
        plan.run(q, k, k)
        times.append(time.perf_counter() - start)
    if CUDA:
        torch.cuda.synchronize()
    return f"{backend} decode B{b} H{hq}/{hkv} D{d} ctx {s}: median host {statistics.median(times) * 1e6:.0f} us"


def check_bench_cuda():
    if not CUDA:
        raise Skip("no CUDA device")
    if ARGS.skip_bench:
        raise Skip("--skip-bench")
    path = ARGS.out / "bench_cuda.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), "--quick", "--reps", "10",
                          "--json", str(path)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (ARGS.out / "bench_cuda.txt").write_text(run.stdout)
    return f"{len(run.stdout.splitlines())} lines in bench_cuda.txt"


CHECKS = [
    ("cuda-tests", check_cuda_tests),
    ("triton-interior-tiles", check_triton_interior_tiles),
    ("paged-split-k-2**32", check_paged_split_k_past_2_32),
    ("strided-table-slopes", check_strided_table_and_slopes),
    ("fp8-cache-decode", check_fp8_cache_decode),
    ("fp8-every-code", check_fp8_every_code),
    ("no-autotuner-graph-capture", check_no_autotuner_and_graph_capture),
    ("fp32-d256-decode-autotune", check_fp32_d256_decode_autotune),
    ("one-hot-gradients", check_one_hot_gradients),
    ("eager-mask-no-function", check_eager_mask_without_mask_function),
    ("graph-decode-seqused-k", check_graph_decode_reads_seqused_k),
    ("compiled-training-step", check_compiled_training_step),
    ("k-beyond-2**31", check_k_beyond_2_31_elements),
    ("plan-run-host-time", check_plan_run_host_time),
    ("bench-cuda", check_bench_cuda),
]


def run_checks(names=None) -> list[dict]:
    started = time.perf_counter()
    results = []
    for name, check in CHECKS:
        if names and name not in names:
            continue
        entry = {"check": name}
        if time.perf_counter() - started > ARGS.budget_s:
            entry.update(status="SKIP", detail=f"budget of {ARGS.budget_s:.0f} s spent", seconds=0.0)
        else:
            t0 = time.perf_counter()
            try:
                entry.update(status="PASS", detail=check())
            except Skip as why:
                entry.update(status="SKIP", detail=str(why))
            except Exception as error:  # every check reports, none stops the others
                lines = [line for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
                entry.update(status="FAIL", detail=f"{type(error).__name__}: {lines[0][:400]}",
                             trace=traceback.format_exc()[-3000:])
            entry["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(entry)
        print(f"{entry['status']:4} {name} ({entry['seconds']:.1f} s): {entry['detail']}", flush=True)
    return results


def environment() -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "mode": "cuda" if CUDA else "cpu"}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if CUDA:
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = "sm%d%d" % torch.cuda.get_device_capability()
    return env


def markdown(results: list[dict], env: dict) -> str:
    head = ", ".join(f"{k} {v}" for k, v in env.items())
    lines = [f"GPU check ({head}): `python benchmarks/gpu_check.py`", "",
             "| check | status | seconds | detail |", "|---|---|---|---|"]
    for r in results:
        detail = str(r["detail"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['check']} | {r['status']} | {r['seconds']:.1f} | {detail} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ARGS.out.mkdir(parents=True, exist_ok=True)
    names = {n for n in ARGS.only.split(",") if n}
    unknown = names - {n for n, _ in CHECKS}
    if unknown:
        print(f"unknown checks {sorted(unknown)}; known: {[n for n, _ in CHECKS]}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    env = environment()
    results = run_checks(names)
    (ARGS.out / "gpu_check.json").write_text(json.dumps({"environment": env, "results": results}, indent=2))
    table = markdown(results, env)
    (ARGS.out / "gpu_check.md").write_text(table)
    print()
    print(table)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped; "
          f"written to {ARGS.out}/gpu_check.json and gpu_check.md")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
