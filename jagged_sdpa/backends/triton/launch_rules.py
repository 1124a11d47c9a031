"""Launch rules that read only the spec (no tensor data, no host sync), shown by ``explain`` as
notes.

* Split-K (flash-decoding): with one query block per sequence (decode, a short chunk) the forward
  grid has only B * Hq programs, far fewer than a GPU has SMs. Splitting each sequence's keys over
  ``num_splits`` programs fills the machine; each split writes a float32 partial out and lse and
  ``fwd.merge_splits`` combines them in one kernel launch: ``lse = logsumexp_s lse_s``,
  ``out = sum_s exp(lse_s - lse) out_s``.
* GQA packing: with few queries, a kv group's query heads share one forward tile.
* Backward group splits: the dK/dV kernel runs one program per (key block, kv head, sequence) and
  loops over the kv head's query group; with MQA or large groups and few sequences that leaves SMs
  idle, so the group is split over programs that write float32 partials summed afterwards
  (deterministic, no atomics).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from jagged_sdpa.spec import AttnSpec

# Grid axis 2 (sequences x splits) holds at most this many programs on CUDA.
MAX_GRID_Z = 65535

# Calls with at most this many queries per sequence are decode-shaped (decode, short chunks):
# one forward tile holds all of a sequence's queries, so only more programs add parallelism.
DECODE_MAX_SEQLEN_Q = 16
# Below this many keys per split, the merge costs more than the parallelism gains.
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 64
# Key rows per dK/dV program assumed by the backward plan (the autotuned BLOCK_N is 32 to 128).
BWD_KEY_BLOCK = 64


@functools.cache
def _cuda_programs_wanted(index: int) -> int:
    """Two waves of programs per SM keeps every SM busy while tails finish."""
    return 2 * torch.cuda.get_device_properties(index).multi_processor_count


def programs_wanted(spec: AttnSpec) -> int:
    if spec.device_type == "cuda" and torch.cuda.is_available():
        return _cuda_programs_wanted(torch.cuda.current_device())
    # The interpreter and unknown devices: a small fixed target keeps the rule testable on CPU.
    return 16


def clamped(spec: AttnSpec, table_width: Optional[int] = None) -> AttnSpec:
    """The spec with max_seqlen_q no larger than total_q (and max_seqlen_k than total_k for packed
    keys): the launch geometry and every plan below read these bounds, and a caller may pass a
    loose static one (a server's decode step, a CUDA graph: 131072 for one query per sequence).
    Unclamped, such a decode got prefill tiles, no split-K and no GQA packing, and launched
    cdiv(bound, BLOCK_M) x Hq x B programs that mostly exit at once; around 2**35 the grid's x
    axis overflowed. A paged cache's capacity bounds no sequence (a block table may repeat a
    block), but its block table's width x block_size does (``table_width``, known to a call, not
    to ``explain``): unclamped, a bound past 2**31 overflowed split-K's key ranges. A dense cache
    is a table of width 1: its bound is S."""
    max_q = min(spec.max_seqlen_q, spec.total_q)
    max_k = spec.max_seqlen_k if spec.paged else min(spec.max_seqlen_k, spec.total_k)
    if spec.paged and (table_width is not None or spec.dense_cache):
        max_k = min(max_k, (1 if spec.dense_cache else table_width) * spec.block_size)
    if (max_q, max_k) == (spec.max_seqlen_q, spec.max_seqlen_k):
        return spec
    return spec.replace(max_seqlen_q=max_q, max_seqlen_k=max_k)


def plan_splits(spec: AttnSpec) -> int:
    """Number of key splits for this call; 1 means the ordinary forward."""
    if spec.max_seqlen_q > DECODE_MAX_SEQLEN_Q or spec.max_seqlen_k < 2 * MIN_KEYS_PER_SPLIT:
        return 1
    programs = max(spec.batch * (spec.heads_kv if pack_gqa(spec) else spec.heads_q), 1)
    by_occupancy = -(-programs_wanted(spec) // programs)
    by_length = spec.max_seqlen_k // MIN_KEYS_PER_SPLIT
    by_grid = MAX_GRID_Z // max(spec.batch, 1)
    return max(1, min(by_occupancy, by_length, by_grid, MAX_SPLITS))


def pack_gqa(spec: AttnSpec) -> bool:
    """Few queries with GQA: put a kv group's query heads in one tile (rows = query x head), so the
    tile is not mostly padding and each K/V block is loaded once per kv head instead of per head."""
    return spec.gqa_group > 1 and spec.max_seqlen_q <= DECODE_MAX_SEQLEN_Q


def plan_group_splits(spec: AttnSpec) -> int:
    """How many programs share one kv head's query group in the dK/dV kernel (a divisor of it)."""
    group = spec.gqa_group
    programs = spec.batch * spec.heads_kv * -(-max(spec.max_seqlen_k, 1) // BWD_KEY_BLOCK)
    splits = 1
    while group % (2 * splits) == 0 and programs * splits < programs_wanted(spec):
        splits *= 2
    return splits


def plan_notes(spec: AttnSpec) -> tuple[str, ...]:
    """The launch choices ``explain`` shows for a TRITON call."""
    notes = []
    splits = plan_splits(spec)
    if splits > 1:
        notes.append(f"triton: split-k decode over {splits} key splits (max_seqlen_q {spec.max_seqlen_q} <= "
                     f"{DECODE_MAX_SEQLEN_Q}, max_seqlen_k {spec.max_seqlen_k} >= {2 * MIN_KEYS_PER_SPLIT})")
    if pack_gqa(spec):
        notes.append(f"triton: the {spec.gqa_group} query heads of each kv head share one tile "
                     f"(max_seqlen_q {spec.max_seqlen_q} <= {DECODE_MAX_SEQLEN_Q})")
    if spec.needs_grad and (splits := plan_group_splits(spec)) > 1:
        notes.append(f"triton: backward splits each kv head's {spec.gqa_group} query heads over {splits} programs "
                     f"(few key blocks x kv heads to fill the device)")
    return tuple(notes)
