"""The attention function (``AttentionInterface``): unpads queries/keys/values with the mask's
unpadding data, runs varlen attention and re-pads the output (padded query rows are zeros); where
every row's keys are one run of cache slots it reads the cache in place instead. A padded batch's
layers run one ``jagged_sdpa.plan`` per options, kept on the mask's unpadding data: the batch is
validated once per forward, and each layer does only per-layer work.
Causal is bottom-right (new queries see every cached key); GQA without repeating K/V; sliding window,
softcap, scaling, dropout and sinks come from the module, the mask's overlays from its unpadding
data. Without padding it reads packed sequences from ``cu_seq_lens_q/k`` + ``max_length_q/k``
(``DataCollatorWithFlattening``) or from ``position_ids`` that do not continue by +1."""

from __future__ import annotations

import functools
import logging

import torch

import jagged_sdpa
from jagged_sdpa import plans
from jagged_sdpa.api import varlen_attention

from .packing import packed_from_position_ids
from .unpad import RANGES_ATTR, unpad_info

_logger = logging.getLogger("jagged_sdpa")
_warned_output_attentions = [False]


def as_int(x, name):
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name}: expected an int or a one-element tensor, got shape {tuple(x.shape)}")
        return int(x.item())
    if not isinstance(x, int):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    return x


def jagged_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers attention function backed by jagged_sdpa's varlen attention.

    Same contract as transformers' ``sdpa_attention_forward``: query ``(B, Hq, Q, D)``, key/value
    ``(B, Hkv, K, D)`` (cache included) -> ``(output (B, Q, Hq, Dv), None)``. Attention weights are
    never materialised, so ``output_attentions`` yields ``None`` (as with sdpa/flash).
    """
    if kwargs.get("position_bias") is not None:
        raise ValueError("position_bias: not supported by jagged attention (use attn_implementation='eager')")
    if kwargs.get("indices") is not None:
        # DeepSeek sparse attention and its descendants hand non-eager/sdpa attentions the indexer's selection
        raise ValueError(
            "indices: this model's sparse-attention indexer selects the top-k keys of each query, which jagged "
            "attention cannot restrict itself to (it attends to every key its mask allows); use "
            "attn_implementation='eager' or 'sdpa' for this model"
        )
    if kwargs.get("cache") is not None:
        raise ValueError(
            "cache: a paged (continuous batching) cache reached the 'jagged' attention; transformers' continuous "
            "batching accepts only its built-in names: call jagged_sdpa.integrations.transformers."
            "enable_continuous_batching() and use attn_implementation='sdpa'"
        )
    if kwargs.get("output_attentions", False) and not _warned_output_attentions[0]:
        _warned_output_attentions[0] = True
        _logger.warning("jagged attention does not compute attention weights; output_attentions gives None")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            f"query/key/value: expected (batch, heads, seq, head_dim) tensors, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    B, Hq, Q, D = query.shape
    K, Dv = key.shape[2], value.shape[-1]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # Traced by torch.compile (transformers' static-cache recipe): the mask is read as a tensor only
    # (``_traced_in_place``), so nothing is read on the host and one graph serves every decode step.
    compiling = torch.compiler.is_compiling()
    traced = attention_mask is not None and compiling
    info = unpad_info(attention_mask, B, Q, K) if attention_mask is not None and not traced else None
    if info is not None and info.causal is not None:
        causal = info.causal  # the mask's pattern is what eager applies (see Unpad.causal)
    window = (-1, -1)
    if sliding_window is not None:
        sw = as_int(sliding_window, "sliding_window")
        if sw <= 0:
            raise ValueError(f"sliding_window: must be a positive int, got {sw}")
        # eager: causal keeps kv > q - sw (sw tokens including itself); bidirectional |q - kv| <= sw
        window = (sw - 1, 0) if causal else (sw, sw)
    dropout_p = float(dropout) if module.training else 0.0
    softcap = float(softcap) if softcap else 0.0
    sinks = kwargs.get("s_aux")  # gpt-oss and others: learned per-head sinks (docs/api.md section 11)
    chunk = prefix_lens = None
    packed_by_eager = False
    if info is not None:  # the mask's overlays (see Overlay)
        packed_by_eager = info.packed
        if info.window is not None:
            window = info.window
        chunk, prefix_lens = info.chunk, info.prefix_lens
        if not info.padded:
            info = None  # a marker only: no padding to remove
    options = dict(dropout_p=dropout_p, softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap)
    if chunk is not None:
        options["chunk_size"] = chunk
    key_of_options = (dropout_p, scaling, causal, window, softcap, chunk)

    if traced:
        q = query.transpose(1, 2).reshape(B * Q, Hq, D)
        out = _traced_in_place(q, key.transpose(1, 2), value.transpose(1, 2), attention_mask, prefix_lens, sinks,
                               options)
        return out.view(B, Q, Hq, Dv), None

    if info is not None:
        if info.keys_only and window != (-1, -1):
            # eager's bidirectional window |q - kv| <= w counts positions in the padded row; packed,
            # it holds only when each sequence's queries are its keys. Padded query rows then
            # output zeros (eager's see only padding), real rows equal eager's.
            if Q != K:
                raise ValueError(
                    f"sliding_window: a bidirectional sliding window between {Q} queries and {K} keys "
                    "(cross-attention) with a padding mask is not supported by jagged attention; "
                    "use attn_implementation='eager' or 'sdpa' for this model"
                )
            info = info.queries_as_keys()
        if info.holes and window != (-1, -1):
            raise ValueError(
                "attention_mask: a row has padding between real tokens inside the sliding window of several "
                "of its queries (e.g. a prompt with padding inside it); the distances would differ from "
                "eager. Decoding one token per row past such padding is supported"
            )
        if info.queries_full or (info.queries_left_padded and causal and prefix_lens is None):
            # every query row is real (or a left-padded prompt's, which sees no key under causal
            # masking) and each row's keys are one run of cache slots: read the cache where it lies
            # (docs/api.md section 12), no gather of K/V and no scatter of the output
            plan = info.plan(("in place",) + key_of_options, lambda: _in_place_plan(info, Q, prefix_lens, options))
            out = plan.run(query.transpose(1, 2).reshape(B * Q, Hq, D), key.transpose(1, 2), value.transpose(1, 2),
                           sinks=sinks)
            return out.view(B, Q, Hq, Dv), None
        # one gather per tensor, straight from (B, H, S, D): no full (B, S, H, D) copy first
        rows_q, rows_k = info.rows_q, info.rows_k
        q = query[rows_q[0], :, rows_q[1]]  # (total_q, Hq, D)
        k = key[rows_k[0], :, rows_k[1]]
        v = value[rows_k[0], :, rows_k[1]]
        plan = info.plan(("packed",) + key_of_options, lambda: jagged_sdpa.plan(
            info.cu_seqlens_q, info.cu_seqlens_k, info.max_seqlen_q, info.max_seqlen_k, prefix_lens=prefix_lens,
            **options))
        out = plan.run(q, k, v, sinks=sinks)
        full = out.new_zeros(B * Q, Hq, Dv).index_copy(0, info.indices_q, out)
        return full.view(B, Q, Hq, Dv), None

    if prefix_lens is not None:
        options["prefix_lens"] = prefix_lens
    if sinks is not None:
        options["sinks"] = sinks
    q = query.transpose(1, 2)  # (B, Q, Hq, D)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)  # no-op when already int32
        max_q, max_k = as_int(max_q, "max_length_q"), as_int(max_k, "max_length_k")
    else:
        packed = None
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and Q == K and Q > 1 and position_ids.shape[-1] == Q:
            packed = packed_from_position_ids(position_ids, B, Q)
        if packed is not None:
            cu_q, max_q = packed
            cu_k, max_k = cu_q, max_q
        elif packed_by_eager:
            # e.g. Llama 4's layers do not pass position_ids on: the boundaries eager used are not known here
            raise ValueError(
                "position_ids: eager separates the sequences packed in a row (position_ids restarting), but this "
                "model does not hand position_ids to its attention; pass DataCollatorWithFlattening's "
                "cu_seq_lens_q/k and max_length_q/k (return_flash_attn_kwargs=True), or pad the batch"
            )
        elif K > Q:  # decoding without padding: the cache is read where it lies (docs/api.md section 12)
            cu_q, used = _dense_lengths(B, Q, K, query.device)
            out = varlen_attention(q.reshape(B * Q, Hq, D), k, v, cu_q, None, Q, K, seqused_k=used, **options)
            return out.view(B, Q, Hq, Dv), None
        else:  # dense: B sequences of Q queries and K keys (new queries are the last keys)
            cu_q, cu_k = _dense_offsets(B, Q, K, query.device) if not compiling else _offsets(B, Q, K, query.device)
            max_q, max_k = Q, K
    out = varlen_attention(q.reshape(B * Q, Hq, D), k.reshape(B * K, k.shape[2], D), v.reshape(B * K, v.shape[2], Dv),
                           cu_q, cu_k, max_q, max_k, **options)
    return out.view(B, Q, Hq, Dv), None


def _in_place_plan(info, Q: int, prefix_lens, options: dict):
    """The plan of a forward whose layers read the cache in place: over the ranges the mask hook
    derived on the host (``plans.over_ranges``: valid by construction, so not checked again), or,
    with an overlay's ``prefix_lens`` (checked against each row's keys), over ``jagged_sdpa.plan``."""
    if prefix_lens is None:
        return plans.over_ranges(info.cu_seqlens_full, Q, info.seqused_k, info.cache_leftpad, info.lens_k,
                                 info.first_k, **options)
    return jagged_sdpa.plan(info.cu_seqlens_full, None, Q, info.max_seqlen_k, seqused_k=info.seqused_k,
                            cache_leftpad=info.cache_leftpad, prefix_lens=prefix_lens, **options)


def _traced_in_place(q, k, v, mask, prefix_lens, sinks, options):
    """The in-place call of a traced forward, from the mask tensor alone. The hook's mask (compact,
    or eager's layout for the static-cache decode step) carries the rows' ranges it computed on the
    host (``unpad.RANGES_ATTR``, graph inputs like the mask): every layer reads the same tensors. Without them (a keys-only additive ``(B, 1, 1, K)``
    mask, or padding between real keys) each row's first valid key slot and their count are computed
    from the mask; ``K`` bounds ``max_seqlen_k``. Every query row is computed: a padded one sees no
    key under causal masking (left padding), and its output is never read as a key. Padding between
    real keys cannot be expressed by a range: a device-side assert fails loudly instead of returning
    other numbers."""
    B, K = k.shape[0], k.shape[1]
    Q = q.shape[0] // max(B, 1)
    extra = dict(options, prefix_lens=prefix_lens, sinks=sinks)
    ranges = getattr(mask, RANGES_ATTR, None)
    if ranges is not None and mask.shape[-1] in (Q + K, K):
        cu_q, used, first = ranges
        return varlen_attention(q, k, v, cu_q, None, Q, K, seqused_k=used, cache_leftpad=first, **extra)
    if mask.dtype == torch.bool and mask.shape[-1] == Q + K:
        key_valid = mask.reshape(B, Q + K)[:, Q:]
    elif mask.shape[-1] == K:
        key_valid = mask.reshape(B, K) == 0
    else:
        raise ValueError(
            f"attention_mask: under torch.compile jagged attention reads its own compact mask "
            f"(bool (B, 1, 1, Q + K) = ({B}, 1, 1, {Q + K})), got {mask.dtype} of shape {tuple(mask.shape)}; "
            "build the model with attn_implementation=jagged_sdpa.integrations.transformers.register()")
    valid = key_valid.to(torch.int32)
    used = valid.sum(1, dtype=torch.int32)
    first = valid.argmax(1).to(torch.int32)
    last = K - 1 - valid.flip(1).argmax(1).to(torch.int32)
    torch._assert_async(((used == 0) | (last - first + 1 == used)).all(),
                        "jagged_sdpa: under torch.compile a row's real keys must be one run of cache slots "
                        "(left padding); this mask has padding between real tokens")
    cu_q = torch.arange(0, (B + 1) * Q, max(Q, 1), dtype=torch.int32, device=q.device)[:B + 1]
    return varlen_attention(q, k, v, cu_q, None, Q, K, seqused_k=used, cache_leftpad=first, **extra)


def _offsets(B: int, Q: int, K: int, device: torch.device) -> tuple:
    """cu_seqlens_q/_k of B rows of Q queries and K keys each."""
    cu_q = torch.arange(0, (B + 1) * Q, max(Q, 1), dtype=torch.int32, device=device)[:B + 1]
    cu_k = cu_q if K == Q else torch.arange(0, (B + 1) * K, max(K, 1), dtype=torch.int32, device=device)[:B + 1]
    return cu_q, cu_k


# the same tensors for every layer and forward of one shape, so the batch is validated once
_dense_offsets = functools.lru_cache(maxsize=16)(_offsets)


@functools.lru_cache(maxsize=16)
def _dense_lengths(B: int, Q: int, K: int, device: torch.device) -> tuple:
    """cu_seqlens_q and seqused_k of B rows of Q queries over K cached keys each: the same tensors
    for every layer and step of that shape, so the batch is validated once."""
    cu_q = torch.arange(0, (B + 1) * Q, max(Q, 1), dtype=torch.int32, device=device)[:B + 1]
    return cu_q, torch.full((B,), K, dtype=torch.int32, device=device)
