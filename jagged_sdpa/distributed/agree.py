"""Errors without hangs: ranks agree on their inputs before any data moves.

Every call first all-gathers one small int64 header per rank: a local error code and the fields
that must match (plan digest, row counts, dtypes, head counts, options). A rank whose own checks
failed does not raise at once (the others would wait forever in the next collective): the error
travels in the header, and then every rank raises it, naming the rank and the argument.
"""

from __future__ import annotations

import hashlib

import torch

from jagged_sdpa.errors import NoBackendError

_CODES = {ValueError: 1, TypeError: 2, NoBackendError: 3}
_TYPES = {1: ValueError, 2: TypeError, 3: NoBackendError}


def code_of(exc) -> int:
    if exc is None:
        return 0
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            return code
    raise exc  # not an input error: a bug; let it surface here


def digest(value) -> int:
    """A stable int63 of a repr-able value (options, shapes), equal on every rank."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") & (2**62 - 1)


def _raise(code: int, message: str, src: int, own: bool, exc=None):
    if own and exc is not None:
        raise exc
    text = f"rank {src}: {message}"
    if code == 3:
        raise NoBackendError(message, header=f"rank {src}: no backend can take its local attention call")
    raise _TYPES[code](text)


def agree(comm, fields: dict, error=None, device="cpu") -> None:
    """Collective. ``fields``: name -> int that must be equal on every rank (the name is the
    argument a mismatch is reported against). ``error``: this rank's input error, or None."""
    code = code_of(error)
    header = torch.tensor([code, *[int(v) for v in fields.values()]], dtype=torch.int64, device=device)
    table = comm.all_gather_header(header).cpu().tolist()
    codes = [row[0] for row in table]
    if any(codes):
        info = (code, str(error.explanation) if code == 3 else str(error)) if code else None
        infos = comm.all_gather_object(info)
        src = next(r for r, c in enumerate(codes) if c)
        if code:
            _raise(code, info[1], comm.rank, True, error)
        _raise(infos[src][0], infos[src][1], src, False)
    for col, name in enumerate(fields, start=1):
        values = [row[col] for row in table]
        if len(set(values)) > 1:
            other = next(r for r, v in enumerate(values) if v != values[0])
            raise ValueError(f"{name}: differs between rank 0 and rank {other}; every rank must pass the "
                             "same plan, options and tensor kinds (dtype, heads, head dims, requires_grad)")
