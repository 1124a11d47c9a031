"""Backend priority, ``use_backends`` (a ContextVar), ``select``, ``Explanation`` and the log line.

Selection sees no tensor data: it works on an ``AttnSpec``. ``select`` computes reasons for every
backend in the order, even after one is chosen, because the explain table, the DEBUG log and
``NoBackendError`` list them all; a call that logs nothing stops at the first eligible one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import torch

from jagged_sdpa.backends import CPU_ORDER, DEFAULT_ORDER, IMPLS, Backend
from jagged_sdpa.errors import NoBackendError
from jagged_sdpa.spec import AttnSpec

log = logging.getLogger("jagged_sdpa")

_ORDER: ContextVar[Optional[tuple[Backend, ...]]] = ContextVar("jagged_sdpa_order", default=None)


def to_backend(value: Union[Backend, str], name: str = "backend") -> Backend:
    if isinstance(value, Backend):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a jagged_sdpa.Backend or its string value, got {type(value).__name__}")
    return Backend(value)


@contextlib.contextmanager
def use_backends(*backends: Union[Backend, str]) -> Iterator[tuple[Backend, ...]]:
    """Restrict automatic selection to ``backends``, tried in the order given.

    An inner block replaces the outer one (like ``torch.nn.attention.sdpa_kernel``); duplicates
    are dropped keeping the first. The state is a ``ContextVar``: per thread and per asyncio task.
    ``backend=`` on a call still forces its backend inside a block.

    Example::

        with jagged_sdpa.use_backends("triton", "math"):
            out = jagged_sdpa.sdpa(q, k, v)
    """
    if not backends:
        raise ValueError("use_backends needs at least one backend")
    order = tuple(dict.fromkeys(to_backend(b, "backends") for b in backends))
    token = _ORDER.set(order)
    try:
        yield order
    finally:
        _ORDER.reset(token)


def current_order(device_type: Optional[str] = None) -> tuple[Backend, ...]:
    """The order in force for tensors on ``device_type``: ``use_backends``'s, else the default one
    (``CPU_ORDER`` for CPU tensors). Inside ``torch.compile`` it is read when the function is traced,
    and the compiled code keeps it (Dynamo cannot trace a ContextVar): enter ``use_backends`` before
    the first call of a compiled function."""
    if torch.compiler.is_compiling():
        return _traced_order(device_type)
    return _ORDER.get() or (CPU_ORDER if device_type == "cpu" else DEFAULT_ORDER)


@torch.compiler.assume_constant_result
def _traced_order(device_type: Optional[str]) -> tuple[Backend, ...]:
    return _ORDER.get() or (CPU_ORDER if device_type == "cpu" else DEFAULT_ORDER)


@dataclass(frozen=True)
class Explanation:
    """Which backend a call gets and, for every backend in the order, why not.

    ``reasons[b]`` is an empty list when ``b`` is eligible. ``str(e)`` is a readable table.
    """

    spec: AttnSpec
    order: tuple[Backend, ...]
    reasons: dict = field(default_factory=dict)
    chosen: Optional[Backend] = None
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        rows = [self.spec.describe(), f"  {'backend':<14} {'eligible':<9} why not"]
        for b in self.order:
            why = self.reasons[b]
            rows.append(f"  {b.value:<14} {'no' if why else 'yes':<9} {'; '.join(why)}".rstrip())
        rows.append(f"chosen: {self.chosen.value if self.chosen else 'none'}")
        rows.extend(f"note: {n}" for n in self.notes)
        return "\n".join(rows)


def select(spec: AttnSpec, forced: Optional[Backend] = None) -> Explanation:
    """Compute every backend's reasons and take the first eligible one in order."""
    order = (forced,) if forced is not None else current_order(spec.device_type)
    reasons = {b: list(IMPLS[b].reasons(spec)) for b in order}
    chosen = next((b for b in order if not reasons[b]), None)
    notes = IMPLS[chosen].plan_notes(spec) if chosen is not None else ()
    return Explanation(spec, order, reasons, chosen, tuple(notes))


def with_notes(explanation: Explanation, notes) -> Explanation:
    """``explanation`` with the call's layout notes put before the chosen backend's plan notes."""
    if not notes:
        return explanation
    return dataclasses.replace(explanation, notes=tuple(notes) + explanation.notes)


def choose(spec: AttnSpec, forced: Optional[Backend], notes: tuple[str, ...] = ()) -> Backend:
    """The backend a call runs (``select``'s choice), with the DEBUG log line; raises
    ``NoBackendError`` when nothing is eligible.

    Without DEBUG logging only the backends up to the chosen one are asked for reasons (the
    first eligible one wins either way): the others' reasons feed only the log line, ``explain``
    and the error, and each of those computes them all. This keeps selection off the per-call cost.
    """
    # Inside torch.compile this runs once, at trace time, and logs nothing (Dynamo cannot trace a
    # logger): ``explain`` on the same arguments shows the choice.
    if torch.compiler.is_compiling() or not log.isEnabledFor(logging.DEBUG):
        for backend in (forced,) if forced is not None else current_order(spec.device_type):
            if not IMPLS[backend].reasons(spec):
                return backend
    explanation = with_notes(select(spec, forced), notes)
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        log.debug("jagged_sdpa selection\n%s", explanation)
    if explanation.chosen is None:
        header = (
            f"forced backend {forced.value} cannot take this call"
            if forced is not None
            else "no backend can take this call"
        )
        raise NoBackendError(explanation, header, _left_out_table(spec, explanation.order, forced))
    return explanation.chosen


def _left_out_table(spec: AttnSpec, tried: tuple[Backend, ...], forced: Optional[Backend]) -> str:
    """The backends a forced backend or ``use_backends`` kept out of a failed call, each with why
    it was left out and its own reasons: the user sees what would have taken the call."""
    left_out = [b for b in dict.fromkeys(DEFAULT_ORDER + tuple(Backend)) if b not in tried]
    if not left_out:
        return ""
    because = f"not tried: backend={forced.value!r} forced" if forced is not None else (
        f"not tried: left out by use_backends({', '.join(repr(b.value) for b in tried)})")
    rows = ["  left out       could take it  why not"]
    for b in left_out:
        own = IMPLS[b].reasons(spec)
        rows.append(f"  {b.value:<14} {'no' if own else 'yes':<14} {'; '.join((because, *own))}")
    return "\n".join(rows)
