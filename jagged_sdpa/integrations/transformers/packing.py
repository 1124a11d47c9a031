"""Sequences packed into one row without padding, read from ``position_ids`` that do not continue by
+1 (what ``DataCollatorWithFlattening`` produces without its flash kwargs): their boundaries as
cu_seqlens, read on the host once per forward, not once per layer."""

from __future__ import annotations

import weakref

import torch


# Packed boundaries derived from the last position_ids tensor seen (every layer of a forward gets the
# same object): one host read per forward instead of one per layer. Holds a weak reference only.
_last_positions: list = [None]  # (weakref to position_ids, (version, B, S), result)


def packed_from_position_ids(position_ids: torch.Tensor, B: int, S: int):
    """cu_seqlens and max length of the sequences packed in each row: a new one wherever positions
    do not continue by +1 (transformers' ``find_packed_sequence_indices`` rule). None if each row
    is one sequence."""
    compiling = torch.compiler.is_compiling()
    key = (position_ids._version, B, S)
    if not compiling:
        hit = _last_positions[0]
        if hit is not None and hit[0]() is position_ids and hit[1] == key:
            return hit[2]
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[0] != B:
        pos = pos.expand(B, -1)
    starts = torch.ones(B, S, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    begin = starts.flatten().nonzero().flatten().to(torch.int32)
    cu = torch.cat([begin, begin.new_tensor([B * S])])
    n_seqs, max_len = torch.stack([cu.new_tensor(cu.numel() - 1), cu.diff().max()]).tolist()
    result = None if n_seqs == B else (cu, int(max_len))
    if not compiling:
        _last_positions[0] = (weakref.ref(position_ids), key, result)
    return result
