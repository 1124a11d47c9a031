"""The CPU_FUSED backend: ``plan`` (visible key ranges per block of query rows), two engines
(``fused``: PyTorch's fused CPU kernel; ``blocked``: matmuls), and ``backend`` (the BackendImpl)."""

from jagged_sdpa.backends.cpu.backend import CpuFusedBackend

__all__ = ["CpuFusedBackend"]
