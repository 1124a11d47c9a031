"""FLASH_VARLEN and EFFICIENT, the backends built on PyTorch's private CUDA attention ops:
``flash_varlen`` (FlashAttention-2 varlen), ``efficient`` (the CUTLASS memory-efficient kernel) and
``common`` (what both share: availability and op-schema probes, padding and alignment, row
geometry, lse layouts, launch limits). See ``README.md`` for what each op does and where each rule
comes from in PyTorch's sources."""

from jagged_sdpa.backends.cuda.efficient import EfficientBackend
from jagged_sdpa.backends.cuda.flash_varlen import FlashVarlenBackend

__all__ = ["EfficientBackend", "FlashVarlenBackend"]
