"""``Backend`` enum and ``BackendImpl``, the base every backend implementation derives from.

A backend declares ``caps`` once, adds the rules that cannot be declared in ``extra_reasons``,
and implements ``forward`` and, for speed, ``backward`` (the default recomputes the forward under
autograd). Both run inside the ``jagged_sdpa::attention`` operators (``ops.py``), with tensor
contents already checked. Backends never validate user input: ``checks.inputs`` already did.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Iterator, Optional

import torch
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
    def fake_state(cls, call: PackedCall) -> tuple:
        """The ``state`` tensors ``forward`` would return, as fake tensors (``torch.compile``
        traces with them): none unless a backend keeps some."""
        return ()

    @classmethod
    def backward(cls, call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor, state: tuple) -> tuple:
        """Gradients (dq, dk, dv), plus dslopes when ``spec.alibi_grad``, in the shapes of
        call.q/k/v/alibi_slopes; lse is the forward's float32 lse.

        This default recomputes ``forward`` under autograd, for a forward made of differentiable
        torch ops; a backend with kernels of its own overrides it."""
        wrt = [call.q, call.k, call.v] + ([call.alibi_slopes] if call.spec.alibi_grad else [])
        leaves = [t.detach().requires_grad_() for t in wrt]
        again = call.replace(q=leaves[0], k=leaves[1], v=leaves[2], spec=call.spec.replace(return_lse=False),
                             **({"alibi_slopes": leaves[3]} if call.spec.alibi_grad else {}))
        with torch.enable_grad():
            recomputed = cls.forward(again).out
            grads = torch.autograd.grad(recomputed, leaves, grad_out, allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads))
