"""CPU_FUSED: the compiled CPU kernel; the implementation lives in ``jagged_sdpa.backends.cpu``."""

from jagged_sdpa.backends.cpu import CpuFusedBackend

__all__ = ["CpuFusedBackend"]
