"""FLASH_VARLEN: PyTorch's FlashAttention-2 varlen kernel (aten._flash_attention_forward/backward)."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.checks.capability import Capabilities


class FlashVarlenBackend(BackendImpl):
    backend = Backend.FLASH_VARLEN
    caps = Capabilities(devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}))

    @classmethod
    @functools.cache
    def is_available(cls) -> Optional[str]:
        return "not implemented yet"
