"""``Backend`` enum and ``BackendImpl``, the base every backend implementation derives from.

A backend declares ``caps`` once, adds the rules that cannot be declared in ``extra_reasons``,
and implements ``forward`` and ``backward``; both run inside the ``jagged_sdpa::attention``
operators (``ops.py``), with tensor contents already checked. No backend relies on torch autograd
through its forward, whose saved intermediates would grow with the whole call. Backends never
validate user input: ``checks.inputs`` already did.
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
        why = _traced_availability(cls.backend.value) if torch.compiler.is_compiling() else cls.is_available()
        if why is not None:
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
    def forward_runner(cls, call: PackedCall):
        """Per-batch work done once for a plan (``plans.Plan``): a callable that runs the forward
        of later calls of ``call``'s kind (same shapes, strides, dtypes, metadata tensors; no
        gradient) and returns their AttnOutput, or None (``forward`` runs every call)."""
        return None

    @classmethod
    def fake_state(cls, call: PackedCall) -> tuple:
        """The ``state`` tensors ``forward`` would return, as fake tensors (``torch.compile``
        traces with them): none unless a backend keeps some."""
        return ()

    @classmethod
    def backward(
        cls, call: PackedCall, out: Tensor, lse: Tensor, grad_out: Tensor, state: tuple
    ) -> tuple[Tensor, ...]:
        """Gradients (dq, dk, dv) in the shapes and dtypes of call.q/k/v (dk/dv cache-shaped when
        paged), then dslopes in the shape of call.alibi_slopes when ``spec.alibi_grad`` (only
        backends whose caps allow ``alibi_slopes_grad`` see such calls), then dsinks in the sinks'
        shape and dtype when ``spec.sinks_grad`` (docs/api.md section 11): (dq, dk, dv[, dslopes][, dsinks]).
        out, lse (float32) and state are the forward's; grad_out is contiguous."""
        raise NotImplementedError


@torch.compiler.assume_constant_result
def _traced_availability(backend: str) -> Optional[Reason]:
    """``is_available()`` while torch.compile traces the selection: a constant of the process,
    computed eagerly (its caches, imports and device queries are not Dynamo's to trace)."""
    from jagged_sdpa.backends import IMPLS

    return IMPLS[Backend(backend)].is_available()
