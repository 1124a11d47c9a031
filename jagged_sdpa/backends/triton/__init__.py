"""TRITON: the project's own varlen attention kernels (``fwd.py``, ``bwd.py``; launch rules in ``launch_rules.py``).

Triton decides between compiled and interpreted functions when ``@triton.jit`` runs: for its own
library functions (``tl.cdiv``, ``tl.philox``) that is when ``triton`` is imported; ours follow
triton's own mode (``mode.py``). So this module imports neither until a call needs them, never imports
triton where doing so would fix compiled mode in a CPU-only process, and explains a CPU call that
cannot run because ``TRITON_INTERPRET=1`` was set too late.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from typing import Iterator, Optional

import torch

from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.backends.triton import launch_rules
from jagged_sdpa.checks import Reason
from jagged_sdpa.checks.capability import Capabilities
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall

_FWD_MODULE = "jagged_sdpa.backends.triton.fwd"
HEAD_DIM_MAX = 256


def interpret_setting() -> Optional[str]:
    """The TRITON_INTERPRET environment variable, read at call time (the kernels' mode is triton's
    own, fixed when triton was imported: ``mode.py``)."""
    return os.environ.get("TRITON_INTERPRET")


def autotune_setting() -> bool:
    """JAGGED_SDPA_TRITON_AUTOTUNE=1 makes the kernels benchmark their whole config set on the first
    call of each shape bucket (minutes of compilation each); otherwise one config per shape class
    is picked by rule. The kernel modules read it once, when they are imported."""
    return os.environ.get("JAGGED_SDPA_TRITON_AUTOTUNE") == "1"


def _interpreted_state() -> Optional[bool]:
    """Whether the Triton functions already decorated in this process are interpreted; None when
    triton is not imported yet (the mode will be decided by the environment at import)."""
    if "triton.language" not in sys.modules:
        return None
    from jagged_sdpa.backends.triton.mode import INTERPRETED  # triton is imported: this imports nothing new

    return INTERPRETED


@functools.cache
def _import_reason() -> Optional[Reason]:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as error:  # any import failure (missing, broken install) is a reason
        return f"triton is not importable: {type(error).__name__}: {error}".rstrip()
    return None


@functools.cache
def _triton_installed() -> bool:
    """Whether triton can be found, without importing it (cached: a file-system search)."""
    return importlib.util.find_spec("triton") is not None


def _kernels():
    fwd = importlib.import_module(_FWD_MODULE)
    bwd = importlib.import_module("jagged_sdpa.backends.triton.bwd")
    return fwd, bwd


class TritonBackend(BackendImpl):
    backend = Backend.TRITON
    caps = Capabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dim_max=HEAD_DIM_MAX,
        min_capability=(8, 0),  # what Triton itself supports on NVIDIA GPUs
        paged=True,
        sinks=True,
        sinks_grad=True,
        chunked=True,
        prefix=True,
        dense_cache=True,
        fp8_cache=True,
        notes=("cpu runs only under TRITON_INTERPRET=1 (tests)", "paged KV cache is forward-only",
               "fp8 KV cache (docs/api.md section 13): bytes decoded in the kernel, scales folded into the score "
               "scale and the output",
               "dense KV cache (docs/api.md section 12) read in place, forward and backward"),
    )

    @classmethod
    def is_available(cls) -> Optional[Reason]:
        if "triton" not in sys.modules and interpret_setting() != "1" and not torch.cuda.is_available():
            # Importing triton here would make this CPU-only process compiled for good: look only.
            if not _triton_installed():
                return "triton is not importable: no module named 'triton'"
            return None
        return _import_reason()

    @classmethod
    def extra_reasons(cls, spec: AttnSpec) -> Iterator[Reason]:
        if spec.device_type == "cpu":
            setting = interpret_setting()
            if setting != "1":
                shown = "unset" if setting is None else repr(setting)
                yield f"cpu tensors need TRITON_INTERPRET=1 (set: {shown}) - set it before importing triton"
            elif _interpreted_state() is False:
                yield ("triton was imported (compiled) before TRITON_INTERPRET=1 was set - set it before "
                       "importing triton")
        if spec.batch > launch_rules.MAX_GRID_Z:
            yield f"batch {spec.batch} > {launch_rules.MAX_GRID_Z} (cuda grid limit) - split the batch"
        if spec.paged and not spec.dense_cache and spec.needs_grad:
            yield "paged KV cache with a gradient needed not supported - use packed keys for training"

    @classmethod
    def plan_notes(cls, spec: AttnSpec) -> tuple[str, ...]:
        return launch_rules.plan_notes(launch_rules.clamped(spec))

    @classmethod
    def forward(cls, call: PackedCall) -> AttnOutput:
        fwd, _ = _kernels()
        call = _clamped(call)
        splits = launch_rules.plan_splits(call.spec)
        result = fwd.launch_fwd(call, num_splits=splits, pack_gqa=launch_rules.pack_gqa(call.spec))
        if splits > 1:
            return AttnOutput(*fwd.merge_splits(result.out, result.lse, call.q.dtype))
        return result

    @classmethod
    def backward(cls, call: PackedCall, out, lse, grad_out, state):
        _, bwd = _kernels()
        call = _clamped(call)
        return bwd.launch_bwd(call, out, lse, grad_out, group_splits=launch_rules.plan_group_splits(call.spec))


def _clamped(call: PackedCall) -> PackedCall:
    """The call with ``launch_rules.clamped``'s max lengths, which the kernels' launch geometry reads."""
    width = call.block_table.shape[1] if call.spec.paged and call.block_table is not None else None
    spec = launch_rules.clamped(call.spec, width)
    return call if spec is call.spec else call.replace(spec=spec)
