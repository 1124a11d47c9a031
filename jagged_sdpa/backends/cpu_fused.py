"""CPU_FUSED: the fast CPU path."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.checks.capability import Capabilities


class CpuFusedBackend(BackendImpl):
    backend = Backend.CPU_FUSED
    caps = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float16, torch.bfloat16}))

    @classmethod
    @functools.cache
    def is_available(cls) -> Optional[str]:
        return "not implemented yet"
