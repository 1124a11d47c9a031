"""Builds of the compiled CPU kernel for a named target (``JAGGED_SDPA_CPU_ARCH``), and builds that
fail.

The suite's other kernel tests run the build for this machine (``-march=native``: AVX-512 here).
Users on AVX2 machines run the other half of the vector code (a vector of 16 floats as two 256-bit
registers; see the top of attention.cpp), so CI builds ``x86-64-v3`` (AVX2 + FMA, no AVX-512) on
every machine and runs a subset of ``test_native.py`` with it in a child python, against the
float64 reference: forward (every option, fp32/fp16/bf16, both work splits), backward, decode rows,
paged caches in both directions, dropout masks, odd head dims, NaN propagation. The child proves which library it ran (its build
target and path), and the library's code is checked for 512-bit registers with ``objdump``. On a
CPU with AVX512-BF16, CI also builds ``cooperlake`` (AVX512-BF16, no AMX) and runs the bf16 tests
on its vdpbf16ps tiles, which an AMX machine's native build does not use; and it compiles the AMX
build (``sapphirerapids``), which no CI machine can run.

A failed build (a value the compiler refuses, a badly spelled value, a missing compiler, a target
this CPU cannot run) is cpu_fused's reason in ``explain``, and the call runs on MATH.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess

import pytest
import torch

import jagged_sdpa
from jagged_sdpa.backends.cpu import native
from support.cases import cu_of
from support.guarded import run_child
from support.kernel_calls import assert_math_takes_over
from support.reference import attention_reference
from support.tolerances import assert_close_packed

PORTABLE = "x86-64-v3"
_CPU_FLAGS = set(native._cpu_flags().split())

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= _CPU_FLAGS
    or (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")) is None,
    reason=f"needs an x86-64 CPU that runs {PORTABLE} (AVX2, FMA, F16C) and a C++ compiler")

# The subset of test_native.py and test_dropout.py run on the portable build.
SUBSET = ("test_every_option_and_dtype_matches_reference"
          " or (test_backward_matches_reference and (plain or causal_window or softcap_alibi))"
          " or test_decode_rows or (test_paged_cache_prefill_and_decode and causal and 16)"
          " or (test_head_dims_and_gqa and d7_dv3) or (test_nan_in_a_visible and shipped)"
          " or test_rows_that_see_no_key"
          " or (test_paged_backward_accumulates_shared_blocks and float32)"
          " or test_kernel_mask_ignores_threads_and_work_split"
          " or (test_math_and_kernel_match_the_reference_exactly and float32)")

_CHILD = """
import sys, pytest
from jagged_sdpa.backends.cpu import native
print("TARGET", native.build_target(), native.unavailable_reason(), flush=True)
print("LIBRARY", native.library_path(), flush=True)
print("BF16_TILES", native.library().js_bf16_tiles(), flush=True)
print("TILE", native.tile_shape(), flush=True)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "tests/backends/cpu/test_native.py", "tests/api/test_dropout.py", "-k", {subset!r}]))
"""

# The bf16 tests of the same files (forward, backward, head dims and GQA, paged caches, NaN
# rows, empty rows, dropout), for the build that runs bf16 on vdpbf16ps tiles.
BF16_SUBSET = ("bfloat16 and (test_every_option_and_dtype_matches_reference or test_backward or test_head_dims_and_gqa"
               " or test_paged or test_nan or test_rows_that_see_no_key or dropout)")
# AVX512-BF16 without AMX: the native build of an AMX machine runs bf16 on AMX tiles, so CI builds
# this target too, and its bf16 tiles (vdpbf16ps) pass the bf16 tests.
NO_AMX = "cooperlake"


def _arch_env(arch: str) -> dict:
    # One thread: OpenMP threads on a loaded 2-core machine spin at barriers (5x slower); thread
    # independence is tested on the native build.
    return dict(os.environ, JAGGED_SDPA_CPU_ARCH=arch, OMP_NUM_THREADS="1")


@pytest.mark.cross_isa
def test_x86_64_v3_build_has_no_avx512_and_passes_the_kernel_tests():
    proc = run_child(_CHILD.format(subset=SUBSET), env=_arch_env(PORTABLE), timeout=600)
    out = proc.stdout
    target = re.search(r"^TARGET (.*)$", out, re.M).group(1)
    assert target.startswith(f"-march={PORTABLE} (") and "avx2" in target and "fma" in target, target
    assert "avx512" not in target, target
    assert re.search(r"^BF16_TILES 0$", out, re.M), out[-2000:]  # bf16 widened to float32
    # the tiles for 16 ymm registers, not the AVX-512 tile split over two ymm each
    assert re.search(r"^TILE AVX2\+FMA: 6 rows x 16 columns \(12 ymm accumulators\)$", out, re.M), out[-2000:]
    assert proc.returncode == 0, out[-4000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 80 and not re.search(r"\d+ (failed|error|skipped)", out), out[-2000:]
    library = re.search(r"^LIBRARY (.*)$", out, re.M).group(1)
    assert f"attention-{PORTABLE}-" in library
    if shutil.which("objdump"):
        code = subprocess.run(["objdump", "-d", library], capture_output=True, text=True, check=True).stdout
        assert "ymm" in code and "zmm" not in code  # 256-bit registers, no 512-bit ones


@pytest.mark.cross_isa
@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= _CPU_FLAGS,
                    reason=f"needs a CPU that runs {NO_AMX} (AVX512-BF16)")
def test_bf16_tiles_without_amx_pass_the_bf16_kernel_tests():
    proc = run_child(_CHILD.format(subset=BF16_SUBSET), env=_arch_env(NO_AMX), timeout=600)
    out = proc.stdout
    target = re.search(r"^TARGET (.*)$", out, re.M).group(1)
    assert target.startswith(f"-march={NO_AMX} (") and "avx512_bf16" in target and "amx" not in target, target
    assert re.search(r"^BF16_TILES 1$", out, re.M), out[-2000:]  # vdpbf16ps
    assert proc.returncode == 0, out[-4000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 60 and not re.search(r"\d+ (failed|error|skipped)", out), out[-2000:]


# An AMX Xeon: its native build runs bf16 forward and backward on AMX tiles (tdpbf16ps). No CI
# machine has AMX, so CI at least compiles that code with the flags users' machines build it with
# (a change that breaks it fails here, not on their first call) and checks the tile code is in.
AMX = "sapphirerapids"


@pytest.mark.cross_isa
def test_the_amx_build_compiles_with_its_tile_code(tmp_path):
    cxx = native._compiler()
    library = tmp_path / "attention-amx.so"
    flags = [f.format(arch=AMX) for f in native.FLAGS]
    proc = subprocess.run([cxx, *flags, str(native.SOURCE), "-o", str(library)], capture_output=True, text=True,
                          timeout=300)
    if "unrecognized" in proc.stderr or "bad value" in proc.stderr:
        pytest.skip(f"{cxx} does not know -march={AMX}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    if shutil.which("objdump"):
        code = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
        assert "tdpbf16ps" in code and "ldtilecfg" in code and "vdpbf16ps" in code


def _v3_library(monkeypatch, tmp_path=None):
    """This process with JAGGED_SDPA_CPU_ARCH=x86-64-v3, its library built at -O0: what these tests
    check (which library loads, what explain says, that a target this CPU cannot run is refused, one
    small call's result) does not depend on -O3, whose build of attention.cpp costs ~40 s of CPU to
    the default run (-O0: ~6 s); the cross_isa tests above run the -O3 build."""
    monkeypatch.setenv("JAGGED_SDPA_CPU_ARCH", PORTABLE)
    monkeypatch.setattr(native, "FLAGS", tuple("-O0" if f.startswith("-O") else f for f in native.FLAGS))
    if tmp_path is not None:
        monkeypatch.setenv("JAGGED_SDPA_CACHE", str(tmp_path))
    native.reset()


def _falls_back(reason_part: str):
    """The build failed with a reason naming ``reason_part``: cpu_fused refuses calls with it
    (explain, a forced call's error) and MATH runs them, matching the float64 reference."""
    assert native.library() is None
    assert reason_part in native.unavailable_reason(), native.unavailable_reason()
    assert_math_takes_over(reason_part)
    q, cu = torch.randn(3, 1, 8), cu_of([3])
    why = native.unavailable_reason()
    assert jagged_sdpa.explain(q, q, q, cu, cu).reasons[jagged_sdpa.Backend.CPU_FUSED] == [
        f"compiled kernel unavailable ({why})"]


def test_the_target_is_in_the_cache_key_and_the_file_name():
    cxx = native._compiler()
    native_file, native_flags = native._library_file(cxx, "native")
    v3_file, v3_flags = native._library_file(cxx, PORTABLE)
    assert "-march=native" in native_flags and f"-march={PORTABLE}" in v3_flags
    assert native_file != v3_file and native_file.name.startswith("attention-native-")
    assert v3_file.name.startswith(f"attention-{PORTABLE}-")
    # Only the default flags differ: the native build is unchanged by the variable.
    assert [f for f in native_flags if "march" not in f] == [f for f in v3_flags if "march" not in f]


def test_a_named_target_is_loaded_and_explain_says_so(monkeypatch):
    _v3_library(monkeypatch)
    try:
        assert native.build_target().startswith(f"-march={PORTABLE} ")
        q = torch.randn(70, 2, 16)
        cu = cu_of([64, 6])
        notes = " ".join(jagged_sdpa.explain(q, q, q, cu, cu).notes)
        assert f"cpu_fused: compiled kernel built for -march={PORTABLE} (" in notes, notes
        assert "by JAGGED_SDPA_CPU_ARCH" in notes
        out = jagged_sdpa.varlen_attention(q, q, q, cu, cu, backend="cpu_fused")
        assert_close_packed(out, attention_reference(q, q, q, cu, cu)[0], cu_seqlens=cu)
    finally:
        monkeypatch.undo()
        native.reset()
    if native.target_arch() == "native":  # the suite's own build: no note
        assert native.build_target().startswith("-march=native ")
        assert not [n for n in jagged_sdpa.explain(q, q, q, cu, cu).notes if "built for" in n]


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """Set environment variables, then build (or fail to build) into an empty cache; the suite's
    own library is back afterwards."""
    monkeypatch.setenv("JAGGED_SDPA_CACHE", str(tmp_path))

    def build_with(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        native.reset()
        return tmp_path

    yield build_with
    monkeypatch.undo()
    native.reset()


def test_a_value_the_compiler_refuses_is_a_reason(fresh_build):
    cache = fresh_build(JAGGED_SDPA_CPU_ARCH="no-such-cpu")
    _falls_back("failed to build attention.cpp for -march=no-such-cpu: ")
    assert "error" in native.unavailable_reason() and list(cache.glob("*.so")) == []


@pytest.mark.parametrize("value", ["native -O0", "-mavx512f", "x86-64-v3;rm"])
def test_a_value_that_is_not_a_march_is_a_reason(fresh_build, value):
    fresh_build(JAGGED_SDPA_CPU_ARCH=value)
    _falls_back(f"JAGGED_SDPA_CPU_ARCH={value!r} is not a -march value")


def test_a_missing_compiler_named_by_cxx_is_a_reason(fresh_build):
    """CXX names the compiler the user wants: a missing one is not replaced by another."""
    fresh_build(CXX="/nonexistent")
    _falls_back("no C++ compiler: CXX=/nonexistent not found")


def test_a_target_this_cpu_cannot_run_is_refused_before_any_call(monkeypatch):
    """A library for another machine (here: the x86-64-v3 one on a CPU said to lack AVX2) is
    refused when it loads, instead of dying of SIGILL in its first call."""
    _v3_library(monkeypatch)
    flags = native._cpu_flags().replace(" avx2", "")
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    try:
        _falls_back(f"built for -march={PORTABLE}, which uses avx2: this CPU lacks it")
    finally:
        monkeypatch.undo()
        native.reset()
