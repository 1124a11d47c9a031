"""``Backend`` enum and ``BackendImpl``, the base every backend implementation derives from.

A backend declares ``caps`` once, adds the rules that cannot be declared in ``extra_reasons``,
and implements ``forward`` (and ``backward`` unless torch autograd differentiates its forward).
Backends never validate user input: ``checks.inputs`` already did.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Iterator, Optional

from torch import Tensor

from jagged_sdpa.checks import Reason
from jagged_sdpa.checks.capability import Capabilities, capability_reasons
from jagged_sdpa.spec import AttnOutput, AttnSpec, PackedCall


class Backend(str, enum.Enum):
    """The attention implementations ``jagged_sdpa`` can run; ``Backend("triton")`` works too."""

    FLASH_VARLEN = "flash_varlen"
    EFFICIENT = "efficient"
    TRITON = "triton"
    CPU_FUSED = "cpu_fused"
    MATH = "math"

    @classmethod
    def _missing_(cls, value):
        valid = ", ".join(repr(b.value) for b in cls)
        raise ValueError(f"backend {value!r} is not a Backend (valid: {valid})")

    def __str__(self) -> str:
        return self.value


class BackendImpl:
    backend: ClassVar[Backend]
    caps: ClassVar[Capabilities]
    # True when ``forward`` is built from differentiable torch ops, so autograd needs no help.
    native_autograd: ClassVar[bool] = False

    @classmethod
    def is_available(cls) -> Optional[Reason]:
        """Cheap and cached: can this backend run at all in this process? None when it can."""
        return None

    @classmethod
    def extra_reasons(cls, spec: AttnSpec) -> Iterator[Reason]:
        return iter(())

    @classmethod
    def reasons(cls, spec: AttnSpec) -> tuple[Reason, ...]:
        if (why := cls.is_available()) is not None:
            return (why,)
        return (*capability_reasons(spec, cls.caps), *cls.extra_reasons(spec))

    @classmethod
    def plan_notes(cls, spec: AttnSpec) -> tuple[str, ...]:
        """How this backend would run the call (e.g. a kernel variant it picks), for ``explain``."""
        return ()

    @classmethod
    def forward(cls, call: PackedCall) -> AttnOutput:
        raise NotImplementedError

    @classmethod
    def backward(
        cls, call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor, state: object
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients (dq, dk, dv) in the shapes of call.q/k/v; lse is the forward's float32 lse."""
        raise NotImplementedError
