"""Where the real tokens of a padded batch are: computed once per forward by the mask hook, carried
on the mask it returns (``UNPAD_ATTR``) and read by every layer's attention call, so no layer
recomputes or re-reads the padding."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

UNPAD_ATTR = "_jagged_sdpa_unpad"
EAGER_VERSION_ATTR = "_jagged_sdpa_version"  # eager-layout masks: their version when handed to the model
# (cu_seqlens_full, seqused_k, cache_leftpad) on a compact mask whose rows' keys are one run of slots: what a
# layer traced by torch.compile reads (attention._traced_in_place), one set of tensors for every layer
RANGES_ATTR = "_jagged_sdpa_ranges"


@dataclass
class Unpad:
    """Where the valid queries/keys of a padded batch are, computed once per forward."""

    query_valid: torch.Tensor  # bool (B, Q): which query rows are real
    key_valid: torch.Tensor  # bool (B, K)
    lens_q: np.ndarray  # int32 (B,): real queries per row, on the host
    lens_k: np.ndarray  # int32 (B,): valid keys per row
    max_seqlen_q: int
    max_seqlen_k: int
    holes: bool  # some row's valid keys are not contiguous (padding between real tokens)
    no_padding: bool  # every query row and key slot is real
    # the pattern of the mask function transformers asked for: True (causal), False (bidirectional),
    # None (unknown: a 2-D mask read directly). Eager applies the mask whatever the module's
    # is_causal says, so a known pattern overrides it (bigbird_pegasus' decoder declares is_causal=False)
    causal: bool | None = None
    padded: bool = True  # False: a marker without padding, only there to carry the pattern
    # keys only (create_bidirectional_mask: encoder self-attention, cross-attention): every query row is kept
    keys_only: bool = False
    # what the mask's overlays add (see Overlay): they replace or join the module's own options
    window: tuple | None = None  # (left, right): replaces the window the module's sliding_window gives
    chunk: int | None = None  # chunk_size (docs/api.md section 11); the keys before each row's first chunk are dropped
    prefix_lens: torch.Tensor | None = None  # int32 (B,): prefix-LM (docs/api.md section 11)
    packed: bool = False  # eager separates packed sequences (position_ids restarting, no cache)
    checks: tuple = ()  # the ints read with the lengths (see unpad_from_validity)
    # The cache read in place (docs/api.md section 12): each row's valid keys are the slots
    # [cache_leftpad[b], cache_leftpad[b] + seqused_k[b]); usable when there are no holes and every
    # query row is real (``queries_full``), with ``cu_seqlens_full`` over all B * Q query rows.
    seqused_k: torch.Tensor | None = None
    cache_leftpad: torch.Tensor | None = None
    first_k: np.ndarray | None = None  # cache_leftpad's values, on the host
    queries_full: bool = False
    cu_seqlens_full: torch.Tensor | None = None
    # Every row's padded query rows come first and its real queries are all its keys (a left-padded
    # prompt): under causal masking a padded row then sees no key and outputs zeros, exactly what the
    # packed path gives it, so the cache can be read in place for all B * Q rows too.
    queries_left_padded: bool = False

    def plan(self, key: tuple, make):
        """The plan of this batch for the options ``key``: made by ``make()`` at the first layer that
        asks, run by every layer with the same options (``jagged_sdpa.plan``, docs/api.md section 10)."""
        plans = self.__dict__.setdefault("_plans", {})
        found = plans.get(key)
        if found is None:
            found = plans[key] = make()
        return found

    def queries_as_keys(self) -> "Unpad":
        """The same batch with the valid keys as the only queries (self-attention): what a
        bidirectional sliding window needs, since varlen aligns query i with key i + Lk - Lq and
        every query row of a bidirectional mask is otherwise kept. Computed once per mask."""
        view = self.__dict__.get("_as_keys")
        if view is None:
            view = Unpad(self.key_valid, self.key_valid, self.lens_k, self.lens_k, self.max_seqlen_k,
                         self.max_seqlen_k, self.holes, self.no_padding, causal=self.causal,
                         keys_only=self.keys_only)
            self.__dict__["_as_keys"] = view
        return view

    # The packed path's metadata (gathers straight from (B, H, S, D) and the output's scatter):
    # computed on first use, since reading the cache in place needs none of it.
    def _cached(self, name: str, make):
        got = self.__dict__.get(name)
        if got is None:
            got = self.__dict__[name] = make()
        return got

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """int32 (B + 1,)"""
        return self._cached("_cu_q", lambda: _cumulative(self.lens_q, self.key_valid.device))

    @property
    def cu_seqlens_k(self) -> torch.Tensor:
        if self.lens_k is self.lens_q:
            return self.cu_seqlens_q
        return self._cached("_cu_k", lambda: _cumulative(self.lens_k, self.key_valid.device))

    @property
    def indices_q(self) -> torch.Tensor:
        """int64 (total_q,): rows of the flattened (B*Q) queries that are real."""
        return self._cached("_indices_q", lambda: self.query_valid.flatten().nonzero().flatten())

    @property
    def indices_k(self) -> torch.Tensor:
        return self._cached("_indices_k", lambda: self.key_valid.flatten().nonzero().flatten())

    @property
    def rows_q(self) -> tuple:
        """(batch index, position) of each real query."""
        n = max(self.query_valid.shape[1], 1)
        return self.indices_q // n, self.indices_q % n

    @property
    def rows_k(self) -> tuple:
        n = max(self.key_valid.shape[1], 1)
        return self.indices_k // n, self.indices_k % n


def _int32(a, device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
    return t if device.type == "cpu" else t.to(device)


def _cumulative(lens: np.ndarray, device) -> torch.Tensor:
    return _int32(np.concatenate([[0], np.cumsum(lens)]), device)


@functools.lru_cache(maxsize=16)
def _row_starts(B: int, Q: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens of B rows of Q queries each: the same tensor for every forward of that shape."""
    return torch.arange(0, (B + 1) * Q, max(Q, 1), dtype=torch.int32, device=device)[:B + 1]


def unpad_from_validity(query_valid: torch.Tensor, key_valid: torch.Tensor, checks=(), host=None) -> Unpad:
    """Unpadding data from bool (B, Q) / (B, K) validity (and the 0-d int ``checks`` the mask's
    overlays need, returned in ``checks``), with one host read of the validity masks (``host``: the
    caller's numpy copies of both, already read): the lengths' arithmetic runs in numpy on B x (Q + K)
    bytes, where the same rules as torch ops cost ~40 small kernel calls per forward, and only the
    int32 vectors the in-place call needs go back to the masks' device (the packed path's on demand)."""
    device = key_valid.device
    qv, kv = host if host is not None else (query_valid.cpu().numpy(), key_valid.cpu().numpy())
    checked = tuple(int(c) for c in checks)
    B, Q = qv.shape
    K = kv.shape[1]
    lens_q, lens_k = qv.sum(1, dtype=np.int32), kv.sum(1, dtype=np.int32)
    queries_full = bool((lens_q == Q).all())
    first = kv.argmax(1).astype(np.int32) if K else np.zeros(B, np.int32)
    last = K - 1 - kv[:, ::-1].argmax(1) if K else first
    holes = bool(((lens_k > 0) & (last - first + 1 != lens_k)).any())
    if queries_full:
        left_padded = True
    else:
        first_q = qv.argmax(1) if Q else np.zeros(B, np.int64)
        left_padded = bool((((lens_q == 0) | (first_q == Q - lens_q)) & ((lens_q == Q) | (lens_k == lens_q))).all())
    return Unpad(
        query_valid=query_valid,
        key_valid=key_valid,
        lens_q=lens_q,
        lens_k=lens_k,
        max_seqlen_q=int(lens_q.max(initial=0)),
        max_seqlen_k=int(lens_k.max(initial=0)),
        holes=holes,
        no_padding=queries_full and bool((lens_k == K).all()),
        checks=checked,
        seqused_k=_int32(lens_k, device),
        cache_leftpad=_int32(first, device) if K > 0 and not holes else None,
        first_k=first if K > 0 and not holes else None,
        queries_full=queries_full and not holes,
        queries_left_padded=left_padded and not holes,
        cu_seqlens_full=_row_starts(B, Q, device),
    )


def marker_info(Q: int, K: int, **pattern) -> Unpad:
    """Unpadding data of a mask without padding: only the pattern (``Unpad``'s pattern fields)."""
    lens = np.zeros(0, np.int32)
    return Unpad(torch.ones(1, Q, dtype=torch.bool), torch.ones(1, K, dtype=torch.bool), lens, lens, Q, K, False,
                 True, padded=False, **pattern)


def unpad_info(mask: torch.Tensor, B: int, Q: int, K: int) -> Unpad:
    """The unpadding data of a mask: cached on the masks ``jagged_attention_mask`` builds; a bool
    ``(B, 1, 1, Q + K)`` or a 2-D ``(B, L >= K)`` padding mask (keys = its last K columns, queries
    its last Q: the flash convention) is also read directly."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a tensor or None, got {type(mask).__name__}")
    info = getattr(mask, UNPAD_ATTR, None)
    if info is not None and (mask.shape == (B, 1, 1, Q + K) or (info.keys_only and mask.shape == (B, 1, 1, K))):
        return info  # compact, or keys-only (bidirectional)
    if info is not None and mask.shape == (B, 1, Q, K):  # eager's layout, for model code that reads it
        version = getattr(mask, EAGER_VERSION_ATTR, None)
        if version is not None and version != mask._version:
            raise ValueError(
                "attention_mask: this model modified its attention mask in place (e.g. added a bias or a "
                "selection to it), which jagged attention cannot apply; use attn_implementation='eager' or 'sdpa'"
            )
        return info
    if mask.dtype == torch.bool and mask.shape == (B, 1, 1, Q + K):
        flat = mask.view(B, Q + K)
        return unpad_from_validity(flat[:, :Q], flat[:, Q:])
    if mask.ndim == 2 and mask.shape[0] == B and mask.shape[1] >= K >= Q:
        valid = mask.to(torch.bool)
        return unpad_from_validity(valid[:, -Q:], valid[:, -K:])
    if mask.ndim == 4 and mask.shape[0] == B and mask.shape[-2:] == (Q, K):
        raise ValueError(
            f"attention_mask: jagged attention got a {mask.dtype} mask of shape {tuple(mask.shape)} that its mask "
            "function did not build: a 4-D mask passed in, or one this model's code computed itself (a "
            "sparse-attention indexer's selection, a learned per-head or dynamic mask, a bias added to the mask). "
            "Jagged attention supports causal, sliding-window and padding masks only: pass the 2-D padding mask, "
            "or use attn_implementation='eager' or 'sdpa' for this model"
        )
    raise ValueError(
        f"attention_mask: jagged attention got a {mask.dtype} mask of shape {tuple(mask.shape)}, not one "
        f"built by its mask function (bool (B, 1, 1, Q + K) = ({B}, 1, 1, {Q + K})) nor a 2-D padding mask. "
        "Build the model with attn_implementation=jagged_sdpa.integrations.transformers.register() so that "
        "transformers uses the matching mask function"
    )
