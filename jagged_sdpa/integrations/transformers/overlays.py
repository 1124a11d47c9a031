"""What the mask's overlays mean for each row's keys, in varlen terms. Eager numbers positions in the
padded row (absolute positions, left padding included), varlen from each row's first key, so each
function drops the keys no query of a row sees and checks that what remains means the same thing;
its 0-d flags are read on the host with the lengths (``unpad.unpad_from_validity``).

- Chunks (Llama 4): the first key kept starts the chunk of the row's first query. Padding between
  real tokens (or a cache that lost the chunk's start) where the chunks of several queries would
  differ is refused; decoding one token per row past it is exact (the keys kept are its chunk).
- Causal sliding windows: the keys kept start at the window of the row's first query; with one query
  per row (decoding) they are exactly its window and the hook drops the window, so decoding past
  padding between real tokens (a right-padded prompt continued by a new turn) equals eager. Padding
  inside the window of several queries of a row is refused (the distances differ).
- Prefix blocks (PaliGemma, Gemma3 images): ``prefix_lens`` = the length of the block each row
  starts with, counted from its first real token, when every later real token has no block (-1);
  other blocks (an image after text, several images) are refused, and so is a block longer than the
  sliding window Gemma3 applies after it."""

from __future__ import annotations

import numpy as np
import torch


def chunk_keys(query_valid, key_valid, q_offset, kv_offset, chunk_size, left_padding):
    """Llama 4's chunks (``chunked_overlay``: ``(position - left_padding) // C``, absolute positions, so
    counted from each row's first real token) as varlen's (counted from the first key it is given).
    Drops the keys before the chunk of each row's first query (no query of the row sees them), so the
    first key kept starts that chunk (with one query per row, the keys kept are exactly its chunk).
    Returns the keys kept and a 0-d flag: some row's chunk ids would still differ (padding between its
    real tokens across chunks, or a cache that lost the chunk's start)."""
    B, K = key_valid.shape
    dev = key_valid.device
    C = int(chunk_size)
    lead = torch.as_tensor(left_padding, device=dev).reshape(-1, 1)
    key_pos = torch.arange(K, device=dev) + kv_offset - lead  # eager's positions (B, K)
    q_pos = query_valid.to(torch.int8).argmax(1, keepdim=True) + q_offset - lead  # each row's first query
    keep = key_valid & (key_pos.div(C, rounding_mode="floor") >= q_pos.div(C, rounding_mode="floor"))
    far = torch.iinfo(torch.int64).max // 2
    first = torch.where(keep, key_pos, far).amin(1)
    last = torch.where(keep, key_pos, -far).amax(1)
    aligned = (first % C == 0) & (last - first + 1 == keep.sum(1))  # same ids, shifted by whole chunks
    one_chunk = first.div(C, rounding_mode="floor") == last.div(C, rounding_mode="floor")  # < C keys: one chunk
    inexact = (query_valid.any(1) & keep.any(1) & ~aligned & ~one_chunk).any()
    return keep, inexact


def window_keys(query_valid, key_valid, q_offset: int, kv_offset: int, window: int):
    """Drop the keys that no query of the row sees through a causal sliding window (eager: kv > q - w,
    absolute positions): those before the row's first query minus w - 1 (host arrays, numpy). Exact
    always; padding between real tokens that lies before every query's window (a right-padded prompt
    continued by generate) then no longer counts in the distances; with one query per row (decoding)
    the keys kept are exactly its window, padding inside it or not, and the hook drops the window."""
    first_q = query_valid.argmax(1)[:, None] + q_offset
    key_pos = np.arange(key_valid.shape[1]) + kv_offset
    return key_valid & (key_pos > first_q - int(window))


def block_prefix_lens(key_valid, blocks, kv_offset, K):
    """PaliGemma's / Gemma3's ``block_sequence_ids`` (``blockwise_overlay``: tokens of one block, id >= 0,
    see each other) as varlen's ``prefix_lens``: the same mask iff each row's real tokens are one block
    then only tokens without one (-1). Returns prefix_lens int32 (B,) counted from each row's first real
    key, a 0-d flag (some row is not such a prefix) and the longest prefix."""
    B = key_valid.shape[0]
    ids = blocks.to(key_valid.device)
    if ids.shape[-1] < kv_offset + K:  # transformers pads them to the key slots with -1 itself
        ids = torch.nn.functional.pad(ids, (0, kv_offset + K - ids.shape[-1]), value=-1)
    g = ids[:, kv_offset:kv_offset + K].expand(B, K)
    first = key_valid.to(torch.int8).argmax(1, keepdim=True)
    g0 = g.gather(1, first)
    rank = key_valid.cumsum(1) - 1  # position among the row's real keys
    run = torch.where(key_valid & (g != g0), rank, key_valid.sum(1, keepdim=True)).amin(1, keepdim=True)
    prefix = torch.where(g0 >= 0, run, 0)
    not_prefix = (key_valid & (g >= 0) & (rank >= prefix)).any()
    return prefix.view(B).to(torch.int32), not_prefix, prefix.max()
