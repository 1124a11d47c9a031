"""The ``Backend`` enum, the registry ``IMPLS`` (Backend -> implementation) and ``DEFAULT_ORDER``.

Automatic selection tries ``DEFAULT_ORDER`` first to last; each backend's reasons say which
devices it serves, so the order only matters where several can take a call.
"""

from __future__ import annotations

from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.backends.cpu_fused import CpuFusedBackend
from jagged_sdpa.backends.efficient import EfficientBackend
from jagged_sdpa.backends.flash_varlen import FlashVarlenBackend
from jagged_sdpa.backends.math import MathBackend
from jagged_sdpa.backends.triton import TritonBackend

IMPLS: dict[Backend, type[BackendImpl]] = {
    Backend.FLASH_VARLEN: FlashVarlenBackend,
    Backend.EFFICIENT: EfficientBackend,
    Backend.TRITON: TritonBackend,
    Backend.CPU_FUSED: CpuFusedBackend,
    Backend.MATH: MathBackend,
}

DEFAULT_ORDER: tuple[Backend, ...] = (
    Backend.FLASH_VARLEN,
    Backend.EFFICIENT,
    Backend.TRITON,
    Backend.CPU_FUSED,
    Backend.MATH,
)

__all__ = ["Backend", "BackendImpl", "IMPLS", "DEFAULT_ORDER"]
