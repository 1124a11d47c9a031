"""TRITON: the project's own Triton varlen kernels (fwd.py, bwd.py)."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from jagged_sdpa.backends.base import Backend, BackendImpl
from jagged_sdpa.checks.capability import Capabilities


class TritonBackend(BackendImpl):
    backend = Backend.TRITON
    caps = Capabilities(devices=frozenset({"cuda", "cpu"}), dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}))

    @classmethod
    @functools.cache
    def is_available(cls) -> Optional[str]:
        return "not implemented yet"
