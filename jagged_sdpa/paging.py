"""``paged_append``: write new keys/values into a paged KV cache after each sequence's used ones.

Every check (shapes, dtypes, devices, block ids, capacity) runs before the first write, so a
rejected call leaves the cache untouched.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagged_sdpa import layout
from jagged_sdpa.checks import inputs


def paged_append(k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqused_k: Tensor,
                 k_new: Tensor, v_new: Tensor, cu_seqlens_new: Tensor) -> Tensor:
    """Append packed ``k_new``/``v_new`` (total_new, Hkv, D/Dv) to each sequence's cache rows.

    Sequence b's new tokens ``cu_seqlens_new[b]:cu_seqlens_new[b+1]`` go to positions
    ``seqused_k[b], seqused_k[b] + 1, ...`` of its blocks (``block_table[b]``). Returns the updated
    ``seqused_k`` (int32 (B,)); the caches are written in place.

    Raises:
        TypeError: non-tensors, int32 index tensors of another dtype, new keys of another dtype
        than the cache. ValueError: shapes, devices, block ids out of range, or an append that
        would not fit in a row's assigned blocks (nothing is written then).
    """
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        inputs.validate_tensor(name, t)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (num_blocks, block_size, Hkv, D), got shape {tuple(t.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree in (num_blocks, block_size, Hkv), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_blocks, block_size, heads_kv = k_cache.shape[:3]
    for name, t, cache in (("k_new", k_new, k_cache), ("v_new", v_new, v_cache)):
        if t.dim() != 3 or t.shape[1:] != cache.shape[2:]:
            raise ValueError(f"{name} must have shape (total_new, {cache.shape[2]}, {cache.shape[3]}), got {tuple(t.shape)}")
        if t.dtype != cache.dtype:
            raise TypeError(f"{name} dtype {t.dtype} does not match its cache's {cache.dtype}")
    if k_new.shape[0] != v_new.shape[0]:
        raise ValueError(f"k_new and v_new must have the same number of tokens, got {k_new.shape[0]} and {v_new.shape[0]}")
    inputs.validate_same_device(("k_cache", "v_cache", "k_new", "v_new"), (k_cache, v_cache, k_new, v_new))
    device = k_cache.device
    inputs.validate_tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D (B, max_blocks_per_seq), got shape {tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but k_cache is on {device}")
    batch = block_table.shape[0]
    inputs.validate_tensor("seqused_k", seqused_k)
    if seqused_k.dtype != torch.int32:
        raise TypeError(f"seqused_k must be int32, got {seqused_k.dtype}")
    inputs.validate_int32_vector("seqused_k", seqused_k, batch, device, "B")
    inputs.validate_tensor("cu_seqlens_new", cu_seqlens_new)
    if cu_seqlens_new.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_new must be int32, got {cu_seqlens_new.dtype}")
    inputs.validate_int32_vector("cu_seqlens_new", cu_seqlens_new, batch + 1, device, "B + 1")

    cu_host, used_host, table_host = layout.read_host(cu_seqlens_new, seqused_k, block_table)
    stats = layout.seqlen_stats("cu_seqlens_new", cu_host, k_new.shape[0], None)
    width = block_table.shape[1]
    capacity = width * block_size
    new_used = []
    for b in range(batch):
        n_new = stats.cu_host[b + 1] - stats.cu_host[b]
        used = used_host[b]
        if used < 0 or used > capacity:
            raise ValueError(f"seqused_k[{b}] = {used} is outside [0, {capacity}] (row {b}'s capacity)")
        if used + n_new > capacity:
            raise ValueError(f"appending {n_new} tokens to sequence {b} (seqused_k {used}) overflows its "
                             f"{width} assigned blocks x {block_size} = {capacity} slots")
        new_used.append(used + n_new)
    rows = [table_host[b * width:(b + 1) * width] for b in range(batch)]
    inputs.validate_block_ids(rows, tuple(new_used), block_size, num_blocks)

    # Flat cache slot of every new token, computed on the host (the lengths are already here).
    slots = []
    for b in range(batch):
        for pos in range(used_host[b], new_used[b]):
            slots.append(rows[b][pos // block_size] * block_size + pos % block_size)
    if slots:
        index = torch.tensor(slots, dtype=torch.long, device=device)
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            cache[index // block_size, index % block_size] = new
    return torch.tensor(new_used, dtype=torch.int32, device=device)

