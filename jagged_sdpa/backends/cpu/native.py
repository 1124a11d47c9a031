"""Our compiled CPU kernel (``csrc/attention.cpp`` and the parts it includes), forward and backward, built for this machine on
first use, and its ctypes binding.

Why compiled: torch ops pay Python and dispatch per sequence, and PyTorch's fused CPU kernel runs
MKL's AVX2 sgemm on AMD CPUs (89 GFLOP/s a core where AVX-512 FMAs reach ~190). One call of the
compiled kernel runs a whole ragged batch on torch's own OpenMP threads.

The build needs only a C++ compiler (``$CXX``, else ``g++``/``c++``), no torch headers, and runs
once per machine: 27 s with g++ 12 on an idle 2-core AMD EPYC VM (Zen 3, AVX2, no AVX-512;
2026-11-29), 57 s on the same machine at load 5. It is announced once at INFO on the
``"jagged_sdpa"`` logger (and, when stderr is a terminal and no handler shows that line, in a short
note on stderr), with where the library goes and how long it took. The library is cached under
``$JAGGED_SDPA_CACHE`` (default ``~/.cache/jagged_sdpa``) by a hash of the sources (``attention.cpp`` and its headers), the flags, the
compiler and (for ``native``) this CPU's flags. ``JAGGED_SDPA_CPU_ARCH`` picks the ``-march`` target (default ``native``; e.g.
``x86-64-v3`` for a library that runs on any AVX2 machine, which CI builds to test the kernel
without AVX-512). Without a compiler, with a target the compiler refuses or this CPU cannot run, or
with ``JAGGED_SDPA_NATIVE=0``, CPU_FUSED refuses every call with the reason (``explain``) and MATH
runs it: a failed build is a reason, never an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from jagged_sdpa.backends import keyed_dropout
from jagged_sdpa.spec import AttnSpec, PackedCall

SOURCE = Path(__file__).with_name("csrc") / "attention.cpp"


def source_text() -> str:
    """The kernel's whole source, ``attention.cpp`` and every header beside it in name order: what
    the build cache key hashes, so an edit to any part rebuilds."""
    parts = [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]
    return "\n".join(f"// {part.name}\n{part.read_text()}" for part in parts)
FLAGS = ("-O3", "-march={arch}", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno")
ARCH_ENV = "JAGGED_SDPA_CPU_ARCH"
# JAGGED_SDPA_SANITIZE=address,undefined (tests/safety/test_sanitizers.py) builds a separate, instrumented
# library: every out-of-bounds read or undefined behaviour aborts with a report. It only loads into
# a python started with LD_PRELOAD=$(g++ -print-file-name=libasan.so).
SANITIZE_ENV = "JAGGED_SDPA_SANITIZE"
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all")
ABI_VERSION = 10
# The dtypes the kernel takes (its ``dtype`` code); it computes in float32, so float64 is not one.
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# An fp8 KV cache (docs/api.md section 13): the code names the cache's dtype; q and out are float32.
FP8_CODES = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}

# The kernel's work split (attention.cpp): query rows per work item (at most 1024, fewer for head
# dims over 64; each key block is packed once for them), sequences with at most DIRECT_ROWS queries
# run as direct rows (all heads, no packing: decoding), whose keys go in steps of DIRECT_KEYS (at
# most 256). Tests shrink them.
Q_CHUNK = 1024
DIRECT_ROWS = 2
DIRECT_KEYS = 256

# Per-thread scratch grows with the head dims (a work item's rows of D floats, ~256 KB): beyond this
# CPU_FUSED refuses the call (MATH runs it).
MAX_HEAD_DIM = 1024


class _Params(ctypes.Structure):
    """Mirror of ``JsParams`` in csrc/abi.h, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("lse", ctypes.c_void_p), ("cu_q", ctypes.c_void_p), ("cu_k", ctypes.c_void_p),
        ("seqused_k", ctypes.c_void_p), ("block_table", ctypes.c_void_p), ("bt_stride", ctypes.c_int64),
        ("block_size", ctypes.c_int64), ("k_block", ctypes.c_int64), ("v_block", ctypes.c_int64),
        ("slopes", ctypes.c_void_p), ("slopes_batch_stride", ctypes.c_int64),
        ("batch", ctypes.c_int64), ("heads_q", ctypes.c_int64), ("heads_kv", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("head_dim_v", ctypes.c_int64),
        ("q_tok", ctypes.c_int64), ("q_head", ctypes.c_int64), ("k_tok", ctypes.c_int64), ("k_head", ctypes.c_int64),
        ("v_tok", ctypes.c_int64), ("v_head", ctypes.c_int64), ("o_tok", ctypes.c_int64), ("o_head", ctypes.c_int64),
        ("lse_head", ctypes.c_int64), ("lse_tok", ctypes.c_int64),
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("causal", ctypes.c_int32), ("bottom_right", ctypes.c_int32),
        ("window_left", ctypes.c_int64), ("window_right", ctypes.c_int64),
        ("dtype", ctypes.c_int32), ("threads", ctypes.c_int32),
        ("q_chunk", ctypes.c_int32), ("direct_rows", ctypes.c_int32), ("direct_keys", ctypes.c_int32),
        ("dropout_seed", ctypes.c_uint32), ("dropout_offset", ctypes.c_uint32), ("dropout_p", ctypes.c_float),
        ("chunk_size", ctypes.c_int64), ("prefix_lens", ctypes.c_void_p), ("sinks", ctypes.c_void_p),
        ("cache_leftpad", ctypes.c_void_p),
    ]


class _GradParams(ctypes.Structure):
    """Mirror of ``JsGradParams`` in csrc/abi.h."""

    _fields_ = [
        ("f", _Params), ("dout", ctypes.c_void_p), ("dq", ctypes.c_void_p), ("dk", ctypes.c_void_p),
        ("dv", ctypes.c_void_p),
        ("do_tok", ctypes.c_int64), ("do_head", ctypes.c_int64), ("dq_tok", ctypes.c_int64),
        ("dq_head", ctypes.c_int64), ("dk_tok", ctypes.c_int64), ("dk_head", ctypes.c_int64),
        ("dv_tok", ctypes.c_int64), ("dv_head", ctypes.c_int64),
        ("dk_block", ctypes.c_int64), ("dv_block", ctypes.c_int64), ("dsinks", ctypes.c_void_p),
    ]


class NativeUnavailable(RuntimeError):
    pass


log = logging.getLogger("jagged_sdpa")

# What the first build costs, as measured (the module docstring says on what); the first-build
# message repeats it so that a silent 30 s is never a surprise.
BUILD_TIME_NOTE = "about 30 s on an idle 2-core machine"


def _stderr_note() -> bool:
    """A note on stderr when a person is likely watching (stderr a terminal) and no log handler
    already shows the INFO line."""
    stream = sys.stderr
    try:
        interactive = stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False
    return interactive and not (log.isEnabledFor(logging.INFO) and log.hasHandlers())


def _announce(message: str) -> None:
    log.info(message)
    if _stderr_note():
        print(f"jagged_sdpa: {message}", file=sys.stderr, flush=True)


_LOCK = threading.Lock()
_STATE: dict = {}


def _compiler() -> str:
    """``$CXX`` when set (one that is missing is a reason: the user asked for it), else g++ or c++."""
    cxx = os.environ.get("CXX")
    if cxx:
        if shutil.which(cxx):
            return cxx
        raise NativeUnavailable(f"no C++ compiler: CXX={cxx} not found")
    for name in ("g++", "c++"):
        if shutil.which(name):
            return name
    raise NativeUnavailable("no C++ compiler found (set CXX, or install g++)")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cache_dir() -> Path:
    root = os.environ.get("JAGGED_SDPA_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jagged_sdpa"


def target_arch() -> str:
    """The ``-march`` target: ``$JAGGED_SDPA_CPU_ARCH``, default ``native``. Only the spelling is
    checked here (it becomes a file name and a flag); the compiler judges the value."""
    arch = os.environ.get(ARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", arch):
        raise NativeUnavailable(f"{ARCH_ENV}={arch!r} is not a -march value (e.g. native, x86-64-v3)")
    return arch


def _flags(arch: str) -> tuple[tuple[str, ...], str]:
    """The compiler flags and a file-name tag: the shipped build, or the sanitizer build."""
    flags = tuple(f.format(arch=arch) for f in FLAGS)
    sanitize = os.environ.get(SANITIZE_ENV)
    if not sanitize:
        return flags, f"{arch}-"
    flags = tuple(f for f in flags if f != "-O3") + SANITIZE_FLAGS + (f"-fsanitize={sanitize}",)
    return flags, f"sanitize-{arch}-"


def _compile_error(stderr: str) -> str:
    """The compiler's first error line (a bad -march is followed by a screen of valid values)."""
    errors = [line.strip() for line in stderr.splitlines() if "error" in line]
    return errors[0][:400] if errors else stderr.strip()[-400:]


def _library_file(cxx: str, arch: str) -> tuple[Path, tuple[str, ...]]:
    """Where the library for (compiler, target) is cached, and its flags. The key hashes the
    sources, the flags (the target among them), the compiler's version and, for ``native`` only,
    this CPU's flags: a named target builds the same library on every machine."""
    flags, tag = _flags(arch)
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{cxx} --version failed: {exc}") from None
    machine = _cpu_flags() if arch == "native" else ""
    key = hashlib.sha256("\n".join([source_text(), " ".join(flags), version, machine]).encode())
    return cache_dir() / f"attention-{tag}{key.hexdigest()[:16]}.so", flags


def _build() -> Path:
    cxx = _compiler()
    arch = target_arch()
    target, flags = _library_file(cxx, arch)
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        raise NativeUnavailable(f"cannot write the build cache {target.parent} ({exc}); set JAGGED_SDPA_CACHE") from None
    _announce(f"building the compiled CPU kernel for this machine ({cxx} -march={arch}, once; "
              f"{BUILD_TIME_NOTE}) into {target}")
    start = time.perf_counter()
    try:
        # A hung compiler must not hang the first call; the instrumented build is several times slower.
        limit = 900 if os.environ.get(SANITIZE_ENV) else 300
        proc = subprocess.run([cxx, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=limit)
        if proc.returncode:
            raise NativeUnavailable(f"{cxx} failed to build {SOURCE.name} for -march={arch}: "
                                    f"{_compile_error(proc.stderr)}")
        os.replace(tmp, target)  # atomic: concurrent builders each install a whole library
        _announce(f"built the compiled CPU kernel in {time.perf_counter() - start:.0f} s; "
                  "later processes load it from the cache")
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"building {SOURCE.name} for -march={arch} failed: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load():
    if os.environ.get("JAGGED_SDPA_NATIVE", "1") == "0":
        raise NativeUnavailable("disabled by JAGGED_SDPA_NATIVE=0")
    path = _build()
    try:
        lib = ctypes.CDLL(str(path))   # CDLL calls release the GIL
    except OSError as exc:
        raise NativeUnavailable(f"loading {path} failed: {exc}") from None
    if lib.js_abi_version() != ABI_VERSION:
        raise NativeUnavailable(f"{path} has ABI {lib.js_abi_version()}, expected {ABI_VERSION}")
    # Loading runs none of the kernel's instructions; the first call would die of SIGILL where the
    # target (another machine's -march) uses an instruction set this CPU lacks.
    lib.js_build_isa.restype = ctypes.c_char_p
    lib.js_tile_shape.restype = ctypes.c_char_p
    isa = tuple(lib.js_build_isa().decode().split())
    arch = target_arch()
    cpu = set(_cpu_flags().split())
    missing = [f for f in isa if cpu and f not in cpu]
    if missing:
        raise NativeUnavailable(f"built for -march={arch}, which uses {' '.join(missing)}: this CPU lacks it")
    lib.js_attention_forward.argtypes = [ctypes.POINTER(_Params)]
    lib.js_attention_forward.restype = ctypes.c_int
    lib.js_attention_backward.argtypes = [ctypes.POINTER(_GradParams)]
    lib.js_attention_backward.restype = ctypes.c_int
    _STATE["path"], _STATE["arch"], _STATE["isa"] = path, arch, isa
    return lib


def library():
    """The loaded library, or None; built at most once per process (and once per machine)."""
    if "lib" not in _STATE:
        with _LOCK:
            if "lib" not in _STATE:
                try:
                    _STATE["lib"], _STATE["why"] = _load(), None
                except NativeUnavailable as exc:
                    _STATE["lib"], _STATE["why"] = None, str(exc)
    return _STATE["lib"]


def library_path() -> Optional[Path]:
    """The file the loaded library came from (None when there is none)."""
    library()
    return _STATE.get("path")


def unavailable_reason() -> Optional[str]:
    library()
    return _STATE["why"]


def build_target() -> Optional[str]:
    """What the loaded library was built for, e.g. ``-march=x86-64-v3 (avx avx2 fma f16c ...)``:
    the target and the instruction sets the compiler enabled (None when there is no library)."""
    if library() is None:
        return None
    return f"-march={_STATE['arch']} ({' '.join(_STATE['isa']) or 'baseline instructions'})"


def tile_shape() -> Optional[str]:
    """The loaded library's float32 micro-tile, e.g. ``AVX2+FMA: 6 rows x 16 columns (12 ymm
    accumulators)`` (None when there is no library)."""
    lib = library()
    return None if lib is None else lib.js_tile_shape().decode()


def target_note() -> Optional[str]:
    """``explain``'s note when the library was built for a named target instead of this CPU."""
    if library() is None or _STATE["arch"] == "native":
        return None
    return f"compiled kernel built for {build_target()} by {ARCH_ENV}, not for this CPU (-march=native)"


def reset() -> None:
    """Forget the loaded library (tests switch JAGGED_SDPA_NATIVE)."""
    with _LOCK:
        _STATE.clear()


# The backward keeps, per work item (one sequence and kv head), float32 copies of its query heads'
# q, dO and dQ: above this many bytes per item CPU_FUSED refuses a call that needs a gradient.
BACKWARD_ITEM_BYTES = 256 << 20


def backward_scratch_reason(spec: AttnSpec) -> Optional[str]:
    """None when the backward's scratch of the longest sequence fits ``BACKWARD_ITEM_BYTES``."""
    per_item = spec.gqa_group * spec.max_seqlen_q * (2 * spec.head_dim + spec.head_dim_v) * 4
    if per_item <= BACKWARD_ITEM_BYTES:
        return None
    return (f"gradient needed: the backward's scratch for one sequence and KV head would take {per_item >> 20} MiB "
            f"(> {BACKWARD_ITEM_BYTES >> 20} MiB)")


_INT64_MAX = (1 << 63) - 1


def _int32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _sinks(call: PackedCall) -> Optional[Tensor]:
    """The sinks (docs/api.md section 11) as the kernel reads them, float32 (Hq,) contiguous, or None."""
    if call.sinks is None:
        return None
    return call.sinks.detach().to(torch.float32).contiguous()


def _prefix(call: PackedCall) -> Optional[Tensor]:
    """prefix_lens (docs/api.md section 11) as the kernel reads them, int32 (B,) contiguous, or None."""
    return None if call.prefix_lens is None else _int32(call.prefix_lens)


def _params(call: PackedCall, out: Tensor, lse: Tensor, keep: list) -> _Params:
    """The kernel's parameters; the checks already validated every length it reads (prefix_lens
    among them)."""
    spec = call.spec
    q, k, v = call.q, call.k, call.v
    cu_q = _int32(call.cu_seqlens_q)
    cu_k = None if call.cu_seqlens_k is None else _int32(call.cu_seqlens_k)
    used = None if call.seqused_k is None else _int32(call.seqused_k)
    table = None if call.block_table is None else _int32(call.block_table)
    if table is not None:   # (num_blocks, block_size, Hkv, D): tokens, heads, blocks
        k_tok, k_head, k_block, v_tok, v_head, v_block = k.stride(1), k.stride(2), k.stride(0), v.stride(1), \
            v.stride(2), v.stride(0)
    else:
        k_tok, k_head, v_tok, v_head = k.stride(0), k.stride(1), v.stride(0), v.stride(1)
        k_block = v_block = 0
    slopes = None
    if call.alibi_slopes is not None:
        slopes = call.alibi_slopes.to(torch.float32).contiguous()
    prefix, sinks = _prefix(call), _sinks(call)
    leftpad = None if call.cache_leftpad is None else _int32(call.cache_leftpad)
    keep += [cu_q, cu_k, used, table, slopes, prefix, sinks, leftpad]  # alive until the kernel returns
    ptr = lambda t: None if t is None else t.data_ptr()
    # ctypes would wrap a window past int64 silently (2**64 -> 0); any such window is unbounded in
    # effect, and the kernel's range arithmetic is exact up to INT64_MAX.
    left, right = (min(w, _INT64_MAX) for w in spec.window)
    seed, offset = keyed_dropout.key_words(call.dropout_key) if spec.dropout_p else (0, 0)
    return _Params(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        cu_q.data_ptr(), ptr(cu_k), ptr(used), ptr(table), 0 if table is None else table.stride(0),
        spec.block_size, k_block, v_block, ptr(slopes),
        spec.heads_q if slopes is not None and slopes.dim() == 2 else 0,
        spec.batch, spec.heads_q, spec.heads_kv, spec.head_dim, spec.head_dim_v,
        q.stride(0), q.stride(1), k_tok, k_head, v_tok, v_head, out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        spec.scale, spec.softcap, int(spec.causal), int(spec.alignment == "bottom_right"),
        left, right, DTYPES[spec.dtype] if spec.cache_dtype is None else FP8_CODES[spec.cache_dtype],
        torch.get_num_threads(), Q_CHUNK, DIRECT_ROWS, DIRECT_KEYS,
        seed, offset, spec.dropout_p,
        0 if spec.chunk_size is None else min(spec.chunk_size, _INT64_MAX), ptr(prefix), ptr(sinks), ptr(leftpad),
    )


def forward(call: PackedCall, out: Tensor, lse: Tensor) -> None:
    """Every sequence of ``call`` in one kernel call: out (total_q, Hq, Dv) and lse (Hq, total_q)."""
    keep: list = []
    code = library().js_attention_forward(ctypes.byref(_params(call, out, lse, keep)))
    if code:
        raise RuntimeError(f"native attention kernel refused its parameters (code {code})")


class ForwardRunner:
    """The forward of one kind of plan run (``plans.Plan``), its parameters built once: a run
    sets only the pointers of its q, k, v, out and lse, of its prefix_lens and sinks (per call
    tensors, like q), its dropout key and the thread count. Valid for calls of the kind it was built
    from: same shapes, strides and dtypes, the plan's own metadata tensors, no ALiBi (slopes come
    per layer)."""

    __slots__ = ("_params", "_keep", "_shape_out", "_shape_lse", "_dtype", "_dropout", "_options", "_lib")

    def __init__(self, call: PackedCall):
        spec = call.spec
        self._shape_out = (spec.total_q, spec.heads_q, spec.head_dim_v)
        self._shape_lse = (spec.heads_q, spec.total_q)
        self._dtype = spec.dtype
        self._dropout = bool(spec.dropout_p)
        self._options = spec.prefix or spec.sinks  # per-call tensors whose pointers each run sets
        self._keep: list = []
        out = torch.empty(self._shape_out, dtype=spec.dtype)
        lse = torch.empty(self._shape_lse, dtype=torch.float32)
        self._params = _params(call, out, lse, self._keep)
        self._lib = library()

    def __call__(self, call: PackedCall) -> tuple[Tensor, Tensor]:
        """(out, lse) of ``call``."""
        out = torch.empty(self._shape_out, dtype=self._dtype)
        lse = torch.empty(self._shape_lse, dtype=torch.float32)
        # A copy per call: ctypes releases the GIL while the kernel runs, and another thread's run of
        # the same plan (or operator batch) would otherwise rewrite the pointers this kernel reads.
        params = _Params.from_buffer_copy(self._params)
        params.q, params.k, params.v = call.q.data_ptr(), call.k.data_ptr(), call.v.data_ptr()
        params.out, params.lse = out.data_ptr(), lse.data_ptr()
        if self._options:
            prefix, sinks = _prefix(call), _sinks(call)  # alive until the kernel returns
            params.prefix_lens = None if prefix is None else prefix.data_ptr()
            params.sinks = None if sinks is None else sinks.data_ptr()
        params.threads = torch.get_num_threads()
        if self._dropout:
            params.dropout_seed, params.dropout_offset = keyed_dropout.key_words(call.dropout_key)
        code = self._lib.js_attention_forward(ctypes.byref(params))
        if code:
            raise RuntimeError(f"native attention kernel refused its parameters (code {code})")
        return out, lse


def backward(call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor) -> tuple[Tensor, ...]:
    """dq, dk, dv of every sequence of ``call`` in one kernel call (out and lse from the forward),
    then dsinks in the sinks' dtype when ``spec.sinks_grad``. With a paged cache dk/dv are
    cache-shaped: blocks no sequence reads get 0, shared blocks the sum over the sequences that read
    them (summed in order: deterministic)."""
    lse = lse if lse.dtype == torch.float32 else lse.float()
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype) for t in (call.q, call.k, call.v))
    dsinks = torch.empty(call.spec.heads_q, dtype=torch.float32) if call.spec.sinks_grad else None
    keep: list = []
    # (tokens, heads, blocks) strides of dk/dv: (num_blocks, block_size, Hkv, D) when paged.
    dk_strides, dv_strides = ((t.stride(1), t.stride(2), t.stride(0)) if call.spec.paged else
                              (t.stride(0), t.stride(1), 0) for t in (dk, dv))
    g = _GradParams(_params(call, out, lse, keep), grad_out.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                    grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1), *dk_strides[:2],
                    *dv_strides[:2], dk_strides[2], dv_strides[2], None if dsinks is None else dsinks.data_ptr())
    code = library().js_attention_backward(ctypes.byref(g))
    if code:
        raise RuntimeError(f"native attention kernel refused its parameters (code {code})")
    if dsinks is None:
        return dq, dk, dv
    return dq, dk, dv, dsinks.to(call.sinks.dtype)
