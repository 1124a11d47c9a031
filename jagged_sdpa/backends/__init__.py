"""The ``Backend`` enum, the registry ``IMPLS`` (Backend -> implementation) and ``DEFAULT_ORDER``.

Automatic selection tries ``DEFAULT_ORDER`` first to last; each backend's reasons say which
devices it serves, so the order only matters where several can take a call.
"""

from __future__ import annotations

from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.backends.cpu import CpuFusedBackend
from jagged_sdpa.backends.cuda.efficient import EfficientBackend
from jagged_sdpa.backends.cuda.flash_varlen import FlashVarlenBackend
from jagged_sdpa.backends.math import MathBackend
from jagged_sdpa.backends.triton import TritonBackend

IMPLS: dict[Backend, type[BackendImpl]] = {
    Backend.FLASH_VARLEN: FlashVarlenBackend,
    Backend.EFFICIENT: EfficientBackend,
    Backend.TRITON: TritonBackend,
    Backend.CPU_FUSED: CpuFusedBackend,
    Backend.MATH: MathBackend,
}

# CPU_FUSED serves only CPU tensors and the CUDA kernels only CUDA ones, so CPU_FUSED ahead of
# TRITON only matters on the CPU, where TRITON is the (slow) interpreter used for testing.
DEFAULT_ORDER: tuple[Backend, ...] = (
    Backend.FLASH_VARLEN,
    Backend.EFFICIENT,
    Backend.CPU_FUSED,
    Backend.TRITON,
    Backend.MATH,
)

# On the CPU, TRITON is the interpreter (TRITON_INTERPRET=1, for tests): the default order tries
# MATH before it there, so a call CPU_FUSED refuses (float64, no compiled kernel) never lands on
# the interpreter unless TRITON is named.
CPU_ORDER: tuple[Backend, ...] = (
    Backend.FLASH_VARLEN,
    Backend.EFFICIENT,
    Backend.CPU_FUSED,
    Backend.MATH,
    Backend.TRITON,
)

__all__ = ["Backend", "BackendImpl", "IMPLS", "DEFAULT_ORDER", "CPU_ORDER"]
