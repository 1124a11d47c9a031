"""``paged_append``: write new keys/values into a paged KV cache after each sequence's used ones.

Every check (kinds, shapes, dtypes, devices, block ids, capacity, two tokens aimed at one slot)
runs before the first write, so a rejected call leaves the cache untouched. The lengths and the
block table are read on the host once per call (``layout.read_host``): that read is what lets a
bad append be refused before anything is written.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from jagged_sdpa import layout
from jagged_sdpa.checks import inputs
from jagged_sdpa.spec import FP8_DTYPES


def _validate_caches(k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, k_scale, v_scale) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        inputs.validate_tensor(name, t)
        if t.is_nested:
            raise TypeError(f"{name} must be a dense tensor, got a nested tensor")
    fp8 = k_cache.dtype in FP8_DTYPES or v_cache.dtype in FP8_DTYPES
    if fp8:
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(f"v_cache dtype {v_cache.dtype} does not match k_cache dtype {k_cache.dtype}")
    else:
        inputs.validate_float_dtypes(("k_cache", "v_cache"), (k_cache, v_cache))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (num_blocks, block_size, Hkv, D), got shape {tuple(t.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree in (num_blocks, block_size, Hkv), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[1] < 1:
        raise ValueError(f"k_cache block_size must be >= 1, got {k_cache.shape[1]}")
    for name, t, cache_name, cache in (("k_new", k_new, "k_cache", k_cache), ("v_new", v_new, "v_cache", v_cache)):
        if fp8:
            if t.dtype not in inputs.FLOAT_DTYPES:
                raise TypeError(f"{name} must be float64, float32, float16 or bfloat16 (quantized into the fp8 "
                                f"{cache_name} with its scale), got {t.dtype}")
        elif t.dtype != cache.dtype:
            raise TypeError(f"{name} dtype {t.dtype} does not match {cache_name} dtype {cache.dtype}")
        if t.dim() != 3 or t.shape[1:] != cache.shape[2:]:
            raise ValueError(f"{name} must have shape (total_new, {cache.shape[2]}, {cache.shape[3]}) to match "
                             f"{cache_name}, got {tuple(t.shape)}")
    if k_new.shape[0] != v_new.shape[0]:
        raise ValueError(f"k_new and v_new must have the same number of tokens, got {k_new.shape[0]} and "
                         f"{v_new.shape[0]}")
    inputs.validate_same_device(("k_cache", "v_cache", "k_new", "v_new"), (k_cache, v_cache, k_new, v_new))
    inputs.validate_kv_scales(k_scale, v_scale, k_cache.dtype if fp8 else None, k_cache.shape[2], k_cache.device)


def quantized(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``x / scale`` in float32 (per tensor, or per kv head of (tokens, Hkv, D)) rounded to nearest
    even in fp8 ``dtype``, saturated to its largest finite value (inf too; NaN stays NaN), as vLLM's
    fp8 cache stores it (docs/api.md section 13)."""
    largest = torch.finfo(dtype).max
    return (x.float() / scale.view(-1, 1)).clamp_(-largest, largest).to(dtype)


def _validate_index_tensors(block_table: Tensor, seqused_k: Tensor, cu_seqlens_new: Tensor,
                            device: torch.device) -> int:
    """Kinds, dtypes, shapes and devices of the int32 index tensors; returns B."""
    inputs.validate_tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D (B, max_blocks_per_seq), got shape {tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but k_cache is on {device}")
    batch = block_table.shape[0]
    for name, t, length, what in (("seqused_k", seqused_k, batch, "B"),
                                  ("cu_seqlens_new", cu_seqlens_new, batch + 1, "B + 1")):
        inputs.validate_tensor(name, t)
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.dim() != 1 or t.shape[0] != length:
            raise ValueError(f"{name} must have shape ({length},) ({what}, B from block_table), got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {device}")
    return batch


def _write_slots(cu_new: tuple[int, ...], used: list[int], rows: list[list[int]], block_size: int) -> list[int]:
    """Flat cache slot (block * block_size + offset) of every new token, in packed order."""
    slots = []
    for b, row in enumerate(rows):
        start = used[b]
        for pos in range(start, start + cu_new[b + 1] - cu_new[b]):
            slots.append(row[pos // block_size] * block_size + pos % block_size)
    return slots


def _validate_capacity(cu_new: tuple[int, ...], used: list[int], width: int, block_size: int) -> list[int]:
    """The updated lengths; ValueError when a row's used length or its append does not fit."""
    capacity = width * block_size
    new_used = []
    for b, n_used in enumerate(used):
        n_new = cu_new[b + 1] - cu_new[b]
        if n_used < 0 or n_used > capacity:
            raise ValueError(f"seqused_k[{b}] = {n_used} is outside [0, {capacity}], the capacity of "
                             f"block_table row {b} ({width} blocks x {block_size})")
        if n_used + n_new > capacity:
            raise ValueError(f"k_new: appending {n_new} tokens to sequence {b} (seqused_k[{b}] = {n_used}) overflows "
                             f"its block_table row ({width} assigned blocks x {block_size} = {capacity} slots)")
        new_used.append(n_used + n_new)
    return new_used


def _validate_distinct(slots: list[int], cu_new: tuple[int, ...], block_size: int) -> None:
    """Two new tokens aimed at one slot (rows sharing a block past their common prefix) is an error."""
    if len(set(slots)) == len(slots):
        return
    seen: dict[int, int] = {}
    for t, slot in enumerate(slots):
        if slot in seen:
            rows = [b for b in range(len(cu_new) - 1) for tok in (seen[slot], t) if cu_new[b] <= tok < cu_new[b + 1]]
            raise ValueError(f"block_table rows {rows[0]} and {rows[1]} would both write block {slot // block_size} "
                             f"slot {slot % block_size}: a block shared by two sequences must not be appended to")
        seen[slot] = t


def paged_append(k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqused_k: Tensor,
                 k_new: Tensor, v_new: Tensor, cu_seqlens_new: Tensor, *, k_scale: Optional[Tensor] = None,
                 v_scale: Optional[Tensor] = None) -> Tensor:
    """Append packed ``k_new``/``v_new`` (total_new, Hkv, D/Dv) to each sequence's cache blocks.

    Sequence b's new tokens ``cu_seqlens_new[b]:cu_seqlens_new[b+1]`` go to positions
    ``seqused_k[b], seqused_k[b] + 1, ...`` of its blocks (``block_table[b]``), in place. Returns the
    updated ``seqused_k`` (int32 (B,), a new tensor; the argument is not modified). An fp8 cache
    (docs/api.md section 13) needs ``k_scale``/``v_scale`` (float32 () or (Hkv,)) and stores
    ``k_new / k_scale`` rounded to nearest even, saturated to the dtype's largest finite value.

    Costs one host read of ``cu_seqlens_new``, ``seqused_k`` and ``block_table`` (all validated
    before the first write), inside the ``jagged_sdpa::paged_append`` operator (``ops.py``): under
    ``torch.compile`` the read happens when the operator runs.

    Raises:
        TypeError: non-tensors, index tensors that are not int32, caches or new keys/values of
        mismatched dtypes. ValueError: shapes, devices, ``cu_seqlens_new`` contents, ``seqused_k``
        outside a row's capacity, block ids out of range, an append that would not fit in a row's
        assigned blocks, two tokens written to one slot. Nothing is written when it raises.
    """
    _validate_caches(k_cache, v_cache, k_new, v_new, k_scale, v_scale)
    _validate_index_tensors(block_table, seqused_k, cu_seqlens_new, k_cache.device)
    if k_cache.device.type == "meta":  # the operator's meta kernel would write nothing, silently
        raise ValueError("meta tensors hold no lengths to read: paged_append needs the values of cu_seqlens_new, "
                         "seqused_k and block_table")
    return torch.ops.jagged_sdpa.paged_append(k_cache, v_cache, block_table, seqused_k, k_new, v_new, cu_seqlens_new,
                                              k_scale, v_scale)


def append_checked(k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqused_k: Tensor, k_new: Tensor,
                   v_new: Tensor, cu_seqlens_new: Tensor, k_scale: Optional[Tensor] = None,
                   v_scale: Optional[Tensor] = None) -> Tensor:
    """The ``jagged_sdpa::paged_append`` operator: read and check the contents, then write."""
    batch, width = block_table.shape
    num_blocks, block_size = k_cache.shape[:2]
    cu_host, used_host, table_host = layout.read_host(cu_seqlens_new, seqused_k, block_table)
    cu_new = layout.seqlen_stats("cu_seqlens_new", cu_host, k_new.shape[0], None).cu_host
    new_used = _validate_capacity(cu_new, used_host, width, block_size)
    rows = [table_host[b * width:(b + 1) * width] for b in range(batch)]
    inputs.validate_block_ids(rows, tuple(new_used), block_size, num_blocks)
    slots = _write_slots(cu_new, used_host, rows, block_size)
    _validate_distinct(slots, cu_new, block_size)
    if slots:
        index = torch.tensor(slots, dtype=torch.long, device=k_cache.device)
        blocks, offsets = index // block_size, index % block_size
        if k_scale is not None:
            k_new, v_new = quantized(k_new, k_scale, k_cache.dtype), quantized(v_new, v_scale, v_cache.dtype)
        k_cache.index_put_((blocks, offsets), k_new)
        v_cache.index_put_((blocks, offsets), v_new)
    return torch.tensor(new_used, dtype=torch.int32, device=k_cache.device)
