"""``benchmarks/bench_cpu.py --quick`` end to end on a small selection (W4 decode and the tiny call;
no FlexAttention, whose compile takes minutes, and no memory processes): the machine lines, the
GEMM yardstick, a workload row with its K/V read floor, the tiny call and the targets table. The
benchmark checks every contender's output against ours before timing it, so a run is also a test.
Plus the FLOP count and the targets' arithmetic on made-up timings, and the tile micro-benchmark
(``benchmarks/tiles.cpp``) built and run once.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from jagged_sdpa.backends.cpu import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_cpu", os.path.join(ROOT, "benchmarks", "bench_cpu.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_cpu"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_machine_gemm_rows_and_targets(capsys, monkeypatch):
    bench = _bench()
    # Shorter timings, the same code: the GEMM yardstick on its two attention-shaped GEMMs (the
    # 1024^3 one, in bf16 on one thread, was half of this test's 24 s of CPU) and 20 tiny calls a
    # sample instead of --quick's 200 (each contender's output is still checked against ours first).
    monkeypatch.setattr(bench, "QUICK_GEMM_SHAPES", bench.QUICK_GEMM_SHAPES[:2])
    tiny_rows = bench.tiny_rows
    monkeypatch.setattr(bench, "tiny_rows", lambda reps, rounds: tiny_rows(reps=min(reps, 20), rounds=rounds))
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--only", "W4,tiny", "--no-flex", "--no-memory", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert re.search(r"^# cpu: .+; \d+ CPUs usable .+torch threads 1$", out, re.M), out[:2000]
    assert "# vector extensions: " in out and "# compiled kernel: -march=" in out
    assert re.search(r"^# compiled kernel: -march=.+; bf16 tiles: (AMX|AVX512-BF16|float32).*; fp32 tile: .+ rows x", out, re.M), \
        out[:2000]
    for dtype in ("float32", "bfloat16"):
        assert re.search(rf"^# best {dtype} GEMM: \d+ GFLOP/s \((matmul|onednn), \d+x\d+x\d+\)$", out, re.M), out
    assert re.search(r"^\| W4 fwd \| direct rows, fp32 FMA \((AVX-512|AVX2|AVX|SSE4.2|NEON|scalar)\) \| direct rows, 16 keys a "
                     r"block \([\w.+-]+\) \| [\d.]+ \| "
                     r"\d+ \| \d+ \(\d+%\) \|", out, re.M), out
    assert re.search(r"^\| W4 bfloat16 fwd \| direct rows, (AVX512-BF16|fp32 FMA \([\w.-]+\)) \| direct rows[^|]+\| [\d.]+ \|", out,
                     re.M), out
    assert re.search(r"^# W4 bfloat16 fwd: reading its K/V once", out, re.M), out
    assert re.search(r"^# W4 fwd: reading its K/V once \(int64 word sums\) [\d.]+ ms, ours [\d.]+x that$", out,
                     re.M), out
    assert re.search(r"^# W4 fwd: \w+/ours round by round: median [\d.]+x \(lowest [\d.]+x, highest [\d.]+x, 3 rounds\)$",
                     out, re.M), out
    assert "| dense SDPA |" in out
    for target in ("W4 decode <= 2x reading its K/V", "W4 bf16 decode <= 1.5x reading its K/V (issue 22)",
                   "tiny varlen <= 3x one dense SDPA call",
                   "tiny sdpa <= 1/20 of NJT SDPA's time", "every row >= 1.0x the fastest contender"):
        assert re.search(rf"^\| {re.escape(target)} \| .+ \| (met|unmet) \|$", out, re.M), (target, out[-2000:])
    assert "W1 fp32 fwd" not in out  # W1 was not run: its target is left out, not guessed


def test_paired_ratio_divides_round_by_round_and_skips_contenders_timed_once():
    bench = _bench()
    row = bench.Row(bench.W1, {"ours": 2.0, "loop": 3.0, "njt": 9.0}, {}, {}, 0, 4, {"njt"}, {},
                    {"ours": [1.0, 2.0, 4.0, 2.0], "loop": [1.5, 2.4, 8.0, 2.2], "njt": [9.0]})
    # per round 1.5, 1.2, 2.0, 1.1: the median of the rounds, not the ratio of the medians (3.0 / 2.0)
    assert bench.paired_ratio(row, "loop") == pytest.approx((1.35, 1.1, 2.0))
    assert bench.paired_ratio(row, "njt") is None  # slow: timed once, no round to pair with
    assert bench.paired_ratio(row, "padded") is None  # not run


def test_flops_count_visible_pairs_and_targets_compare_with_the_bounds():
    bench = _bench()
    from workloads import W1, W4
    causal = W1.with_(causal=True)
    assert W1.flops() == 4 * 64 * 8 * sum(n * n for n in W1.q_lengths)
    assert causal.flops() == 4 * 64 * 8 * sum(n * (n + 1) // 2 for n in W1.q_lengths)
    assert W1.with_(backward=True).flops() == 3.5 * W1.flops()
    gemm = bench.Gemm({}, {torch.float32: (100.0, "matmul", (1, 1, 1))})
    ours = W1.flops() / 80e9  # 80 GFLOP/s: 80% of the GEMM rate
    rows = [bench.Row(W1, {"ours": ours, "loop": 0.99 * ours}, {}, {}, 0, 3, set(), {}),
            bench.Row(W4, {"ours": 0.003, "loop": 0.006, "kv_read": 0.001}, {}, {}, 0, 3, set(), {})]
    targets = {t: (measured, met) for t, measured, met in bench.target_rows(rows, gemm, None)}
    assert targets["W1 fp32 fwd >= 70% of fp32 GEMM"] == ("80% (80 of 100 GFLOP/s, fastest rounds)", "met")
    assert targets["W4 decode <= 2x reading its K/V"][1] == "unmet"  # 3x
    assert targets["every row >= 1.0x the fastest contender"] == ("lowest W1 fwd 0.99x; below: W1 fwd 0.99x",
                                                                   "unmet")


def test_tile_micro_benchmark_builds_and_measures(tmp_path):
    """``benchmarks/tiles.cpp`` (the shipped tiles alone, BENCHMARKS.md's bound of the fp32 and bf16
    rows) builds with the kernel's instruction-set flags and prints a rate per tile: the AMX tile
    where this CPU has AMX. Built at -O0 (6 s of CPU; -O1 15 s, -O3 ~45 s; the same intrinsics and
    code paths, the rates of course far lower): the rates recorded come from its -O3 build, run by
    hand."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "tiles"
    subprocess.run([cxx, "-O0", "-march=native", "-fopenmp", "-std=c++17", "-fno-math-errno", "-o", str(exe),
                    os.path.join(ROOT, "benchmarks", "tiles.cpp")], check=True, capture_output=True, timeout=300)
    out = subprocess.run([str(exe), "2"], check=True, capture_output=True, text=True, timeout=120).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 3 and all(re.match(r"fp32 tile<6>: \d+ GFLOP/s", line) for line in lines), out
    lib = native.library()
    if lib is not None and native.target_arch() == "native" and lib.js_bf16_tiles() == 2:
        assert all(re.search(r"bf16 AMX tile: \d+ GFLOP/s$", line) for line in lines), out


def test_kernel_path_names_what_the_kernel_runs_each_row_on():
    """Each row says which path ran it; bf16 tiles as the kernel itself reports them
    (js_bf16_tiles), decode rows as direct rows (bf16 on vdpbf16ps wherever there are bf16 tiles),
    fp32 on FMAs of the build's vector width."""
    bench = _bench()
    from workloads import W1, W3, W4, W5

    lib = native.library()
    if lib is None:
        pytest.skip("no compiled kernel here")
    tiles = {2: "AMX", 1: "AVX512-BF16"}.get(lib.js_bf16_tiles())
    fma = f"fp32 FMA ({bench._vector_width()})"
    assert bench.kernel_path(W1) == fma and bench.kernel_path(W4) == f"direct rows, {fma}"
    assert bench.kernel_path(W4.with_(dtype=torch.bfloat16)) == f"direct rows, {'AVX512-BF16' if tiles else fma}"
    assert bench.kernel_path(W5) == (tiles or fma) == bench.kernel_path(W3.with_(dtype=torch.bfloat16))
    assert bench.kernel_path(W5.with_(backward=True)) == f"{tiles or fma} fwd, {tiles or fma} bwd"
    if "avx512f" in native.build_target():
        assert "AVX-512" in fma


@pytest.mark.skipif(native.library() is None, reason="needs the compiled kernel")
def test_options_rows_time_the_same_call_with_and_without_sinks_chunks_and_prefixes(capsys):
    """The sinks/chunk/prefix rows on a small batch: plain, chunk 256 (cuts the 300-token sequence) and chunk
    longest - 1, all on the kernel; the visible pairs come from the position rules; the target
    line reads both ratios."""
    bench = _bench()
    from workloads import Workload

    rows = bench.options_rows(1, 0.0, 0, base=Workload("small", (40, 300, 100), heads=2, head_dim=16))
    assert [r.label for r in rows] == ["small float32 causal fwd", "small float32 causal fwd+bwd",
                                       "small bfloat16 causal fwd", "small bfloat16 causal fwd+bwd"]
    r = rows[0]
    causal = sum(i + 1 for n in (40, 300, 100) for i in range(n))
    assert r.pairs["plain"] == causal and r.chunks == {"cut": 256, "uncut": 299}
    # prefix rows (i < n // 4) see n // 4 keys; in the 300-token sequence chunk 256 takes keys 0..255
    # from rows 256..299, chunk 299 keys 0..298 from row 299
    prefix_extra = sum(n // 4 - (i + 1) for n in (40, 300, 100) for i in range(n // 4))
    assert r.pairs["uncut"] == causal + prefix_extra - 299
    assert r.pairs["cut"] == causal + prefix_extra - 44 * 256
    bench.print_options(rows)
    text = "\n".join(t for row in bench.target_rows([], None, None, rows) for t in row)
    out = capsys.readouterr().out
    assert re.search(r"^\| small bfloat16 causal fwd\+bwd \| [\d.]+ \| [\d.]+ \| [\d.]+x \| [\d.]+ \| 1\.\d\d \| [\d.]+x \|$",
                     out, re.M), out
    assert "sinks + chunk_size + prefix_lens <= 1.10x the plain call (issue 20)" in text and "chunk 299" in text


def test_each_row_names_the_builds_instruction_set_and_tile():
    """Every row prints the build's instruction set and the tile its products run on
    (the kernel's own js_tile_shape), decode rows as direct rows."""
    bench = _bench()
    from workloads import W1, W4, W5

    if native.library() is None:
        pytest.skip("no compiled kernel here")
    shape = native.tile_shape()
    assert re.match(r"(AVX-512|AVX2\+FMA|AVX|NEON|128-bit vectors): 6 rows x \d+ columns", shape), shape
    assert bench.isa_tile(W1) == shape and bench.isa_tile(W4).startswith("direct rows")
    if "avx512f" not in native.build_target() and "avx2" in native.build_target():
        assert shape.startswith("AVX2+FMA: 6 rows x 16 columns (12 ymm")
    if not native.library().js_bf16_tiles():
        assert bench.isa_tile(W5) == shape
