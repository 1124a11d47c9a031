"""User-error validation: raise ``TypeError``/``ValueError`` naming the argument, before any kernel.

Kinds and dtypes are ``TypeError``; shapes, sizes, devices, contents and option values are
``ValueError``. Content checks of offsets (start at 0, non-decreasing, end at total) live in
``layout.seqlen_stats``, the one place that reads them on the host. Nothing here returns reasons.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Optional

import torch
from torch import Tensor

from jagged_sdpa import layout
from jagged_sdpa.spec import ALIGNMENTS, FP8_DTYPES

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
ATTN_MASK_ALTERNATIVES = "is_causal, window_size, alibi_slopes, softcap"


def _is_int(x) -> bool:
    return type(x) is int or (isinstance(x, Integral) and not isinstance(x, bool))  # int first: per call


def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def validate_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def validate_float_dtypes(names: tuple[str, ...], tensors: tuple[Tensor, ...]) -> None:
    for name, t in zip(names, tensors):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float64, float32, float16 or bfloat16, got {t.dtype}")
    first = tensors[0].dtype
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != first:
            raise TypeError(f"{name} dtype {t.dtype} does not match {names[0]} dtype {first}")


def validate_same_device(names: tuple[str, ...], tensors: tuple[Optional[Tensor], ...]) -> None:
    device = tensors[0].device
    for name, t in zip(names[1:], tensors[1:]):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but {names[0]} is on {device}: all must be on one device")


def validate_bool(name: str, x) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def validate_dropout(dropout_p) -> float:
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not (0.0 <= float(dropout_p) <= 1.0):
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    return float(dropout_p)


def validate_not_meta(name: str, x: Tensor) -> None:
    """A call needs data: meta tensors (no storage) are refused before selection. ``explain``
    takes them, which describes a call without allocating its tensors. Non-tensors are left to the
    type checks that follow."""
    if isinstance(x, Tensor) and x.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: attention needs data (explain() accepts meta tensors)")


def validate_scale(name: str, scale) -> None:
    if scale is None:
        return
    if not _is_real(scale):
        raise TypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"{name} must be finite, got {scale}")


def validate_window(window_size) -> tuple[int, int]:
    if window_size is None:
        return (-1, -1)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints or None, got {window_size!r}")
    left, right = window_size
    if not (_is_int(left) and _is_int(right)):
        raise TypeError(f"window_size must hold ints, got {window_size!r}")
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded, got {tuple(window_size)}")
    return (int(left), int(right))


def validate_chunk_size(chunk_size) -> Optional[int]:
    """chunk_size (docs/api.md section 11): a positive int, or None (off)."""
    if chunk_size is None:
        return None
    if not _is_int(chunk_size):
        raise TypeError(f"chunk_size must be a positive int or None, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None for no chunking), got {chunk_size}")
    return int(chunk_size)


def validate_sinks(sinks, heads_q: int, device: torch.device) -> bool:
    """sinks (docs/api.md section 11): a dense float (Hq,) tensor on q's device; returns whether given."""
    if sinks is None:
        return False
    validate_tensor("sinks", sinks)
    if sinks.is_nested:
        raise TypeError("sinks must be a dense float tensor of shape (Hq,), got a nested tensor")
    if sinks.dtype not in FLOAT_DTYPES:
        raise TypeError(f"sinks must be a float tensor (float64, float32, float16 or bfloat16), got {sinks.dtype}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape ({heads_q},) (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {device}")
    return True


def validate_prefix_lens(prefix_lens, batch: int, device: torch.device) -> None:
    """prefix_lens (docs/api.md section 11): int32 (B,) on the batch's device (contents: ``batch.build``)."""
    if prefix_lens is None:
        return
    validate_tensor("prefix_lens", prefix_lens)
    if prefix_lens.is_nested:
        raise TypeError("prefix_lens must be a dense int32 tensor of shape (B,), got a nested tensor")
    if prefix_lens.dtype != torch.int32:
        raise TypeError(f"prefix_lens must be int32, got {prefix_lens.dtype}")
    if tuple(prefix_lens.shape) != (batch,):
        raise ValueError(f"prefix_lens must have shape ({batch},) (one prefix length per sequence), got "
                         f"{tuple(prefix_lens.shape)}")
    if prefix_lens.device != device:
        raise ValueError(f"prefix_lens is on {prefix_lens.device} but the query offsets are on {device}")


def validate_prefix_values(prefix_host, key_lengths) -> None:
    """0 <= prefix_lens[b] <= the key length of sequence b (values read on the host)."""
    for b, (p, n) in enumerate(zip(prefix_host, key_lengths)):
        if p < 0:
            raise ValueError(f"prefix_lens[{b}] = {p} must be >= 0")
        if p > n:
            raise ValueError(f"prefix_lens[{b}] = {p} exceeds the key length {n} of sequence {b}")


def validate_softcap(softcap, *, zero_means_off: bool) -> float:
    if softcap is None:
        return 0.0
    if not _is_real(softcap):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    value = float(softcap)
    if zero_means_off and value == 0.0:
        return 0.0
    if not (value > 0 and math.isfinite(value)):
        expected = "> 0 (0 turns it off)" if zero_means_off else "> 0, or None"
        raise ValueError(f"softcap must be finite and {expected}, got {softcap}")
    return value


def validate_alignment(causal_alignment) -> str:
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")
    return causal_alignment


def validate_alibi(alibi_slopes, heads_q: int, batch: int, device: torch.device) -> Optional[str]:
    """Return the ALiBi kind ("per_head" / "per_batch_head") or None."""
    if alibi_slopes is None:
        return None
    validate_tensor("alibi_slopes", alibi_slopes)
    if alibi_slopes.is_nested:
        raise TypeError("alibi_slopes must be a dense float32 tensor, got a nested tensor")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but query is on {device}")
    if tuple(alibi_slopes.shape) == (heads_q,):
        return "per_head"
    if tuple(alibi_slopes.shape) == (batch, heads_q):
        return "per_batch_head"
    raise ValueError(f"alibi_slopes must have shape ({heads_q},) or ({batch}, {heads_q}), got {tuple(alibi_slopes.shape)}")


def validate_attn_mask(attn_mask) -> None:
    if attn_mask is not None:
        raise ValueError(
            f"attn_mask must be None: arbitrary masks are not supported; use {ATTN_MASK_ALTERNATIVES} instead"
        )


def validate_heads(heads_q: int, heads_kv: int, *, gqa_allowed: bool, hint: str = "") -> None:
    if heads_kv < 1 or heads_q < 1:
        raise ValueError(f"head counts must be >= 1, got Hq={heads_q}, Hkv={heads_kv}")
    if heads_q == heads_kv:
        return
    if not gqa_allowed:
        raise ValueError(f"query has {heads_q} heads but key/value have {heads_kv}: pass enable_gqa=True{hint}")
    if heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")


def validate_max_seqlen(name: str, value) -> Optional[int]:
    if value is None:
        return None
    if not _is_int(value):
        raise TypeError(f"{name} must be a Python int or None, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def validate_packed_length(cu_name: str, cu_host, name: str, t: Tensor) -> None:
    """``cu_host`` (a cu_seqlens read on the host) must end at ``t``'s packed length ``t.shape[0]``.

    When it ends at ``t.shape[1]`` instead, the likely mistake is the layout, not the lengths: a
    ``(heads, tokens, head_dim)`` tensor where ``(tokens, heads, head_dim)`` is expected; the
    ValueError says so (a tensor built for ``F.scaled_dot_product_attention`` has heads first)."""
    if not isinstance(t, Tensor) or t.is_nested or t.dim() != 3:
        return  # not a packed tensor: ``validate_varlen_tensors`` says what it is
    total, end = t.shape[0], cu_host[-1]
    if end == total:
        return
    message = f"{cu_name} must end at the packed length {total}, got {end}"
    if t.shape[1] == end:
        message += (f"; but {name} has shape {tuple(t.shape)}, whose dim 1 is {end}: {name} looks like "
                    f"(heads, tokens, head_dim) where packed tensors are (tokens, heads, head_dim) - "
                    f"pass {name}.transpose(0, 1)")
    raise ValueError(message)


def validate_int32_vector(name: str, t, length: Optional[int], device: torch.device, what: str) -> None:
    validate_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D ({what}), got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries ({what}), got {t.shape[0]}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but cu_seqlens_q is on {device}")


# ----------------------------------------------------------------------------------------------
# sdpa


def validate_njt(name: str, x) -> tuple:
    """Check that ``x`` is a (B, H, j, D) jagged NJT; returns its sizes (read once, cheaply)."""
    if type(x) is not layout.NJT_CLASS:  # the NJT class is always jagged; anything else: full checks
        validate_tensor(name, x)
        if not x.is_nested or x.layout != torch.jagged:
            kind = "a strided nested tensor" if x.is_nested else "a dense tensor"
            raise TypeError(f"{name} must be a nested tensor with layout=torch.jagged, got {kind}")
    size = layout.tensor_size(x)
    if len(size) != 4 or x._ragged_idx != 2:
        raise ValueError(
            f"{name} must have the (B, H, j, D) form with the ragged dim at position 2 "
            f"(the .transpose(1, 2) of a (B, j, H, D) NJT), got shape {size}"
        )
    return size


def validate_sdpa_tensors(query, key, value, enable_gqa) -> tuple[tuple, tuple, tuple]:
    """Kinds, layouts, dtypes, devices and shapes of sdpa's query/key/value; returns their sizes.

    Sizes are read once per tensor (``layout.tensor_size``): an NJT's ``.shape`` costs a Python
    dispatch each time, and this runs on every call.
    """
    size_q = validate_njt("query", query)
    validate_tensor("key", key)
    validate_tensor("value", value)
    validate_bool("enable_gqa", enable_gqa)
    if key.is_nested != value.is_nested:
        raise TypeError("key and value must both be jagged NJTs or both dense tensors")
    if key.is_nested:
        size_k = validate_njt("key", key)
        size_v = validate_njt("value", value)
    else:
        size_k, size_v = tuple(key.shape), tuple(value.shape)
        for name, size in (("key", size_k), ("value", size_v)):
            if len(size) != 4:
                raise ValueError(f"dense {name} must be 4-D (B, Hkv, S, D), got shape {size}")
        if size_k[2] != size_v[2]:
            raise ValueError(f"dense key and value must have the same length S, got {size_k[2]} and {size_v[2]}")
    validate_float_dtypes(("query", "key", "value"), (query, key, value))
    validate_same_device(("query", "key", "value"), (query, key, value))
    batch = size_q[0]
    for name, size in (("key", size_k), ("value", size_v)):
        if size[0] != batch:
            raise ValueError(f"{name} batch size {size[0]} does not match query's {batch}")
    if size_k[1] != size_v[1]:
        raise ValueError(f"key has {size_k[1]} heads but value has {size_v[1]}")
    validate_heads(size_q[1], size_k[1], gqa_allowed=enable_gqa)
    if size_q[-1] != size_k[-1]:
        raise ValueError(f"query head dim {size_q[-1]} does not match key head dim {size_k[-1]}")
    for name, size in (("query", size_q), ("value", size_v)):
        if size[-1] < 1:
            raise ValueError(f"{name} head dim must be >= 1, got {size[-1]}")
    return size_q, size_k, size_v


# ----------------------------------------------------------------------------------------------
# varlen


def validate_varlen_tensors(q, k, v, device: torch.device, *, paged: bool, dense_cache: bool, batch: int) -> None:
    """Kinds, dtypes, devices and shapes of a plan's run's q, k, v, against its batch: the metadata
    (``validate_varlen_metadata``, contents in layout.py) were checked when the batch was built, all
    on ``device``. ``paged``: k/v are a block-table cache; ``dense_cache``: a (B, S, Hkv, D) cache."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        validate_tensor(name, t)
        if t.is_nested:
            raise TypeError(f"{name} must be a dense packed tensor, got a nested tensor (use jagged_sdpa.sdpa for NJTs)")
    if k.dtype in FP8_DTYPES or v.dtype in FP8_DTYPES:
        _validate_fp8_cache(q, k, v, paged or dense_cache)
    else:
        validate_float_dtypes(("q", "k", "v"), (q, k, v))
    kv_dims = 4 if paged or dense_cache else 3
    form = ("(num_blocks, block_size, Hkv, D)" if paged else
            "(B, S, Hkv, D) (a dense cache: cu_seqlens_k is None)" if dense_cache else "(total_k, Hkv, D)")
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (total_q, Hq, D), got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != kv_dims:
            raise ValueError(f"{name} must be {kv_dims}-D {form}, got shape {tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree in all but the last dim, got {tuple(k.shape)} and {tuple(v.shape)}")
    validate_heads(q.shape[1], k.shape[-2], gqa_allowed=True)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head dim {q.shape[-1]} does not match k head dim {k.shape[-1]}")
    if q.shape[-1] < 1 or v.shape[-1] < 1:
        raise ValueError(f"head dims must be >= 1, got D={q.shape[-1]}, Dv={v.shape[-1]}")
    validate_same_device(("q", "k", "v"), (q, k, v))
    if q.device != device:
        raise ValueError(f"cu_seqlens_q is on {device} but q is on {q.device}")
    if paged and k.shape[1] < 1:
        raise ValueError(f"k_cache block_size must be >= 1, got {k.shape[1]}")
    if dense_cache and k.shape[0] != batch:
        raise ValueError(f"a dense cache k must have one row per sequence: shape (B, S, Hkv, D) with "
                         f"B = {batch}, got {tuple(k.shape)}")


def _validate_fp8_cache(q: Tensor, k: Tensor, v: Tensor, cache: bool) -> None:
    """An fp8 k/v (docs/api.md section 13): one fp8 dtype for both, a paged or dense cache, q in
    float16, bfloat16 or float32."""
    if k.dtype != v.dtype:
        raise TypeError(f"v dtype {v.dtype} does not match k dtype {k.dtype}: an fp8 KV cache stores keys and values "
                        f"in one dtype")
    if not cache:
        raise ValueError(f"k and v are {k.dtype}: an fp8 KV cache must be a paged cache (block_table) or a dense "
                         f"cache (B, S, Hkv, D); packed keys are not read from fp8")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be float16, bfloat16 or float32 with an fp8 KV cache, got {q.dtype}")


def validate_kv_scales(k_scale, v_scale, cache_dtype: Optional[torch.dtype], heads_kv: int,
                       device: torch.device) -> None:
    """k_scale/v_scale (docs/api.md section 13): float32 () or (Hkv,) on the cache's device, required
    with an fp8 cache (``cache_dtype``) and refused without one."""
    given = [(name, t) for name, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is not None]
    if cache_dtype is None:
        if given:
            raise ValueError(f"{given[0][0]} is given but the KV cache is not fp8: k_scale and v_scale dequantize a "
                             f"float8_e4m3fn or float8_e5m2 cache (docs/api.md section 13)")
        return
    if len(given) < 2:
        missing = " and ".join(name for name, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is None)
        raise ValueError(f"an fp8 KV cache ({cache_dtype}) needs k_scale and v_scale (float32, shape () or "
                         f"({heads_kv},)): the keys are k.float() * k_scale; {missing} missing")
    for name, t in given:
        validate_tensor(name, t)
        if t.is_nested:
            raise TypeError(f"{name} must be a dense float32 tensor, got a nested tensor")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if tuple(t.shape) not in ((), (heads_kv,)):
            raise ValueError(f"{name} must have shape () (per tensor) or ({heads_kv},) (per kv head), got "
                             f"{tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the KV cache is on {device}")


def validate_varlen_metadata(cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, cache_leftpad=None) -> None:
    """Kinds, dtypes, shapes and devices of a batch's metadata (``plan`` has no q to compare).

    Three forms of keys: packed (``cu_seqlens_k``), a paged cache (``block_table``) and a dense
    cache (neither: docs/api.md section 12), the last two with ``seqused_k``."""
    validate_tensor("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_q must be int32, got {cu_seqlens_q.dtype}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must be 1-D with B + 1 >= 1 entries, got shape {tuple(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    device = cu_seqlens_q.device
    if block_table is not None:
        if cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_k must be None when block_table is given (keys come from the cache)")
        validate_tensor("block_table", block_table)
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape ({batch}, max_blocks_per_seq), got {tuple(block_table.shape)}")
        if block_table.device != device:
            raise ValueError(f"block_table is on {block_table.device} but cu_seqlens_q is on {device}")
        if seqused_k is None:
            raise ValueError("seqused_k is required with block_table (the number of valid keys per sequence)")
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad must be None with a block_table: it offsets the rows of a dense cache "
                             "(cu_seqlens_k=None, no block_table)")
    elif cu_seqlens_k is None:
        if seqused_k is None:
            raise ValueError("cu_seqlens_k is None and there is no block_table: k/v are then a dense cache "
                             "(B, S, Hkv, D) and seqused_k (int32 (B,): the keys each row holds) is required; "
                             "pass cu_seqlens_k for packed keys")
    else:
        validate_tensor("cu_seqlens_k", cu_seqlens_k)
        if cu_seqlens_k.dtype != torch.int32:
            raise TypeError(f"cu_seqlens_k must be int32, got {cu_seqlens_k.dtype}")
        validate_int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, device, "B + 1, like cu_seqlens_q")
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad must be None with cu_seqlens_k: it offsets the rows of a dense cache "
                             "(cu_seqlens_k=None, no block_table)")
    if seqused_k is not None:
        validate_tensor("seqused_k", seqused_k)
        if seqused_k.dtype != torch.int32:
            raise TypeError(f"seqused_k must be int32, got {seqused_k.dtype}")
        validate_int32_vector("seqused_k", seqused_k, batch, device, "B")
    if cache_leftpad is not None:
        validate_int32_vector("cache_leftpad", cache_leftpad, batch, device, "B: the first cache slot of each row")


def validate_leftpad_values(leftpad_host, used, capacity: int) -> None:
    """0 <= cache_leftpad[b] and cache_leftpad[b] + seqused_k[b] <= S (values read on the host)."""
    for b, (p, n) in enumerate(zip(leftpad_host, used)):
        if p < 0:
            raise ValueError(f"cache_leftpad[{b}] = {p} must be >= 0")
        if p + n > capacity:
            raise ValueError(f"cache_leftpad[{b}] + seqused_k[{b}] = {p} + {n} exceeds the cache length S = {capacity}")


def validate_block_ids(block_table_host: list[list[int]], used: tuple[int, ...], block_size: int, num_blocks: int) -> None:
    """Every block a sequence needs must exist; only the entries the call reads are checked."""
    max_blocks = len(block_table_host[0]) if block_table_host else 0
    for b, n in enumerate(used):
        need = -(-n // block_size)
        if need > max_blocks:
            raise ValueError(
                f"seqused_k[{b}] = {n} exceeds the capacity of block_table row {b} "
                f"({max_blocks} blocks x {block_size} = {max_blocks * block_size})"
            )
        for i, blk in enumerate(block_table_host[b][:need]):
            if not 0 <= blk < num_blocks:
                raise ValueError(f"block_table[{b}, {i}] = {blk} is out of range [0, {num_blocks})")
