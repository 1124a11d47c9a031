"""The CPU_FUSED backend: ``native`` (the compiled kernel ``csrc/attention.cpp`` and its ctypes
binding) and ``backend`` (the BackendImpl that runs it and says what it refuses)."""

from jagged_sdpa.backends.cpu.backend import CpuFusedBackend

__all__ = ["CpuFusedBackend"]
