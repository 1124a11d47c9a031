"""Compile the TRITON kernels for a CUDA architecture without a GPU: ``python -m
jagged_sdpa.backends.triton.compile_check [--arch 90] [--quick]``.

The interpreter runs kernels as Python and cannot catch what only the compiler rejects (constexpr
misuse, loop-carried type changes, tile shapes ``tl.dot`` refuses). Triton's front end and the
bundled ptxas need no device, so this compiles each variant for the target and reports shared
memory, registers and spills (from ``ptxas -v`` when a matching ptxas is found). Run it in a
process without ``TRITON_INTERPRET=1``: the kernels must be decorated in compiled mode.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from jagged_sdpa.backends.triton import _common, bwd, fwd

DATA_POINTERS = {"Q", "K", "V", "DO", "DQ"}
OUT_POINTERS = {"Out", "DK", "DV"}  # may be float32 partials (split-k, backward group splits)
FLOAT32_POINTERS = {"Lse", "Delta", "Alibi", "Sinks", "KScale", "VScale", "OutParts", "LseParts"}
FLOAT_SCALARS = {"sm_scale", "softcap", "dropout_p"}

ALL_ON = dict(GROUP=2, BOTTOM_RIGHT=True, HAS_BAND=True, HAS_CHUNK=True, HAS_PREFIX=True, HAS_SOFTCAP=True,
              HAS_ALIBI=True, HAS_DROPOUT=True, HAS_SEQUSED=True, DENSE=False, HAS_LEFTPAD=False, IEEE=False, FP8=0)
ALL_OFF = dict(GROUP=1, BOTTOM_RIGHT=False, HAS_BAND=False, HAS_CHUNK=False, HAS_PREFIX=False, HAS_SOFTCAP=False,
               HAS_ALIBI=False, HAS_DROPOUT=False, HAS_SEQUSED=False, DENSE=False, HAS_LEFTPAD=False, IEEE=False,
               FP8=0)


def _dims(d: int, dv: int) -> dict:
    return dict(HEAD_DIM=d, HEAD_DIM_PAD=max(16, triton.next_power_of_2(d)), HEAD_DIM_V=dv,
                HEAD_DIM_V_PAD=max(16, triton.next_power_of_2(dv)))


def variants(quick: bool, arch: int = 90):
    """(name, kernel, data dtype, out dtype, constexprs, num_warps, num_stages)."""
    paged_split = dict(PAGED=True, PAGE_SIZE=16, SPLIT_K=True, PACK_GQA=True, HAS_SINKS=True)
    packed = dict(PAGED=False, PAGE_SIZE=16, SPLIT_K=False, PACK_GQA=False, HAS_SINKS=False)
    yield ("fwd every option, paged, split-k, gqa-packed, bf16 D128", fwd._attn_fwd, "bf16", "fp32",
           {**ALL_ON, **_dims(128, 128), **paged_split, "BLOCK_M": 128, "BLOCK_N": 64}, 8, 3)
    yield ("bwd dk/dv every option, group split, bf16 D128", bwd._attn_bwd_dkdv, "bf16", "fp32",
           {**ALL_ON, **_dims(128, 128), "GROUP_SPLITS": 2, "BLOCK_M": 64, "BLOCK_N": 64}, 8, 2)
    yield ("bwd dq every option, bf16 D128", bwd._attn_bwd_dq, "bf16", "bf16",
           {**ALL_ON, **_dims(128, 128), "BLOCK_M": 64, "BLOCK_N": 64}, 8, 2)
    dense = dict(PAGED=False, PAGE_SIZE=16, SPLIT_K=True, PACK_GQA=True, HAS_SINKS=True, DENSE=True,
                 HAS_LEFTPAD=True)
    yield ("fwd every option, dense cache with leftpad, split-k, gqa-packed, fp16 D64", fwd._attn_fwd, "fp16",
           "fp32", {**ALL_ON, **_dims(64, 64), **dense, "BLOCK_M": 16, "BLOCK_N": 128}, 4, 2)
    yield ("bwd dk/dv every option, dense cache with leftpad, bf16 D128", bwd._attn_bwd_dkdv, "bf16", "bf16",
           {**ALL_ON, **_dims(128, 128), "DENSE": True, "HAS_LEFTPAD": True, "GROUP_SPLITS": 1, "BLOCK_M": 64,
            "BLOCK_N": 64}, 8, 2)
    fp8_codes = ((1, "e4m3fn"), (2, "e5m2")) + (((3, "e4m3fn (GPU conversion)"),) if arch >= 89 else ())
    for fp8, name in fp8_codes:  # an fp8 cache (docs/api.md section 13): K/V bytes (fp8_args' codes)
        yield (f"fwd every option, paged {name} cache, split-k, gqa-packed, bf16 q D128", fwd._attn_fwd, "bf16", "fp32",
               {**ALL_ON, **_dims(128, 128), **paged_split, "HAS_DROPOUT": False, "FP8": fp8, "BLOCK_M": 16,
                "BLOCK_N": 64}, 4, 2)
    yield ("bwd delta bf16 Dv96", bwd._attn_bwd_delta, "bf16", "bf16",
           {"HEAD_DIM_V": 96, "HEAD_DIM_V_PAD": 128, "BLOCK_T": 64, "IEEE": False}, 4, 1)
    yield ("split-k merge, bf16 out Dv96", fwd._merge_splits, "bf16", "bf16",
           {"HEAD_DIM_V": 96, "HEAD_DIM_V_PAD": 128, "MAX_S": fwd.MAX_SPLITS}, 1, 1)
    yield ("sequence order, seqused_k", _common._sequence_order, "bf16", "bf16", {"HAS_SEQUSED": True, "BLOCK": 64}, 4, 1)
    if quick:
        return
    for fp8, name in fp8_codes:  # each decoding into the other q dtypes (the dot runs in q's dtype)
        for q_dtype in ("fp16", "fp32"):
            yield (f"fwd paged {name} cache, {q_dtype} q D128", fwd._attn_fwd, q_dtype, "fp32",
                   {**ALL_OFF, **_dims(128, 128), **paged_split, "FP8": fp8, "IEEE": q_dtype == "fp32",
                    "BLOCK_M": 16, "BLOCK_N": 64}, 4, 2)
    # Every default tile at the widest row it serves: what runs when autotuning is off.
    widest = {256: ("bf16", 128), 512: ("bf16", 256)}
    for bm, bn, warps, stages in fwd.DEFAULT_TILES:
        data, d = widest.get(fwd._TILE_ROW_BYTES[(bm, bn)], ("fp32", 256))
        for causal in (False, True):
            yield (f"fwd default tile {bm}x{bn} {data} D{d}{' causal' if causal else ''}", fwd._attn_fwd, data, data,
                   {**ALL_OFF, **_dims(d, d), **packed, "PACK_GQA": bm <= 32, "GROUP": 8 if bm <= 32 else 1,
                    "HAS_BAND": causal, "BOTTOM_RIGHT": causal, "IEEE": data == "fp32",
                    "BLOCK_M": bm, "BLOCK_N": bn}, warps, stages)
    for bm, bn, warps, stages, row_bytes in bwd.DEFAULT_TILES:
        data, d = widest.get(row_bytes, ("fp32", 256))
        for kernel, name, extra in ((bwd._attn_bwd_dkdv, "dk/dv", {"GROUP_SPLITS": 1}), (bwd._attn_bwd_dq, "dq", {})):
            yield (f"bwd {name} default tile {bm}x{bn} {data} D{d} causal", kernel, data, data,
                   {**ALL_OFF, **_dims(d, d), **extra, "HAS_BAND": True, "BOTTOM_RIGHT": True,
                    "IEEE": data == "fp32", "BLOCK_M": bm, "BLOCK_N": bn}, warps, stages)

def signature(kernel, data: str, out: str, constexprs: dict) -> dict:
    sig = {}
    for param in kernel.params:
        name = param.name
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("K", "V") and constexprs.get("FP8"):
            sig[name] = "*u8"
        elif name in DATA_POINTERS:
            sig[name] = "*" + data
        elif name in OUT_POINTERS:
            sig[name] = "*" + out
        elif name in FLOAT32_POINTERS:
            sig[name] = "*fp32"
        elif name[0].isupper():
            sig[name] = "*i32"
        elif name in FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _ptxas_report(ptx: str) -> str:
    arch = re.search(r"\.target (\S+)", ptx)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for tool in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(bin_dir, tool)
        if not (arch and os.path.exists(path)):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            run = subprocess.run([path, "-v", f"--gpu-name={arch.group(1)}", src, "-o", os.path.join(tmp, "k.o")],
                                 capture_output=True, text=True)
        if run.returncode == 0:
            lines = [line.split("info    :")[-1].strip() for line in run.stderr.splitlines()
                     if "registers" in line or "spill" in line]
            return "; ".join(lines)
    return "ptxas report unavailable"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    parser.add_argument("--quick", action="store_true", help="only the every-option variants")
    parser.add_argument("--ptxas", action="store_true", help="also report registers and spills")
    args = parser.parse_args(argv)
    if fwd.INTERPRETED:
        print("TRITON_INTERPRET=1 is set: the kernels were decorated for the interpreter", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for name, kernel, data, out, constexprs, warps, stages in variants(args.quick, args.arch):
        jit_fn = kernel if hasattr(kernel, "params") else kernel.fn  # an autotuner wraps it (autotuning on)
        params = {param.name for param in jit_fn.params}
        constexprs = {key: value for key, value in constexprs.items() if key in params}  # ALL_ON serves every kernel
        source = ASTSource(jit_fn, signature(jit_fn, data, out, constexprs), constexprs=constexprs)
        try:
            compiled = triton.compile(source, target=target, options={"num_warps": warps, "num_stages": stages})
        except Exception as error:  # report every failing variant, not only the first
            failures += 1
            print(f"FAIL {name}: {type(error).__name__}: {error}")
            continue
        extra = f" {_ptxas_report(compiled.asm['ptx'])}" if args.ptxas else ""
        print(f"OK   {name}: shared {compiled.metadata.shared} B{extra}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
