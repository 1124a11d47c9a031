"""Named ragged length sets, packed-case builders and readable ids (imports no jagged_sdpa)."""

from __future__ import annotations

import torch

LENGTHS = {
    "single": [37],
    "uniform": [16, 16, 16],
    "ragged": [5, 17, 40, 1],
    "with_empty": [0, 9, 0, 33],
    "all_empty": [0, 0],
    "long_tail": [1] * 5 + [70],
}


def cu_of(lengths) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def packed(lengths, heads, dim, dtype=torch.float32, *, requires_grad=False, gen=None):
    x = torch.randn(sum(lengths), heads, dim, generator=gen).to(dtype)
    return x.requires_grad_(requires_grad)


def padded_tokens(lengths, side: str, pad_id: int, low: int, high: int, seed: int = 1):
    """Token ids drawn from [low, high) and a 0/1 attention mask for sequences of ``lengths``,
    padded with ``pad_id`` on ``side`` ("left" or "right"): a padded batch as a tokenizer gives it."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.full((len(lengths), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        sl = slice(L - n, L) if side == "left" else slice(0, n)
        ids[b, sl] = torch.randint(low, high, (n,), generator=g)
        mask[b, sl] = 1
    return ids, mask


def in_nan_buffer(x: torch.Tensor, extra_rows: int = 3) -> torch.Tensor:
    """``x`` as a view into a larger buffer whose other rows and columns are NaN."""
    total, heads, dim = x.shape
    buf = torch.full((total + 2 * extra_rows, heads, dim + 5), float("nan"), dtype=x.dtype)
    view = buf[extra_rows:extra_rows + total, :, 2:2 + dim]
    view.copy_(x)
    return view


def njt(lengths, heads, dim, dtype=torch.float32, *, requires_grad=False):
    """(B, H, j, D) NJT, the transpose of a (B, j, H, D) jagged NJT."""
    parts = [torch.randn(n, heads, dim).to(dtype) for n in lengths]
    return torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=requires_grad).transpose(1, 2)


def case_id(name, hq, hkv, d, dtype, causal=None, window=(-1, -1), extra=""):
    parts = [name, f"Hq{hq}", f"Hkv{hkv}", f"D{d}", str(dtype).replace("torch.", "")]
    if causal:
        parts.append(f"causal{'BR' if causal == 'bottom_right' else 'TL'}")
    if window != (-1, -1):
        parts.append(f"win{window}")
    if extra:
        parts.append(extra)
    return "-".join(parts)


def paged_case(q_lens, used, block_size, hkv, d, dtype=torch.float32, shared_first_block=False):
    """A shuffled block table over a NaN-filled cache; returns the call pieces and packed K/V."""
    need = [-(-n // block_size) for n in used]
    width = max(need + [1])
    num_blocks = sum(need) + 3
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    ids = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(used), width, dtype=torch.int32)
    packed_k, packed_v = [], []
    for b, n in enumerate(used):
        row = [ids.pop() for _ in range(need[b])]
        if shared_first_block and b > 0 and need[b] and need[0]:
            row[0] = int(table[0, 0])
        table[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
        kb = torch.randn(n, hkv, d).to(dtype)
        vb = torch.randn(n, hkv, d).to(dtype)
        for i in range(n):
            blk = row[i // block_size]
            if shared_first_block and b > 0 and i < min(block_size, used[0]):  # keys sequence 0 wrote
                kb[i], vb[i] = k_cache[blk, i], v_cache[blk, i]
            else:
                k_cache[blk, i % block_size], v_cache[blk, i % block_size] = kb[i], vb[i]
        packed_k.append(kb)
        packed_v.append(vb)
    if not packed_k:  # an empty batch: no sequence, no keys
        packed_k = packed_v = [torch.zeros(0, hkv, d, dtype=dtype)]
    return k_cache, v_cache, table, torch.tensor(used, dtype=torch.int32), torch.cat(packed_k), torch.cat(packed_v)


def alibi_slopes(kind, batch, heads, high=0.5, generator=None):
    """ALiBi slopes of the accepted shapes: kind None, "per_head" (Hq,) or "per_batch_head" (B, Hq)."""
    if kind == "per_head":
        return torch.rand(heads, generator=generator) * high
    if kind == "per_batch_head":
        return torch.rand(batch, heads, generator=generator) * high
    return None


def feature_call(feature: dict, batch: int, key_lengths) -> tuple[dict, tuple[int, int], object]:
    """A feature-table entry as (the call's options, (Hq, Hkv), Dv or None): ``heads`` and
    ``head_dim_v`` shape the case; ``alibi`` ("per_head" / "per_batch_head"), ``sinks`` and
    ``prefix`` (True) become tensors; everything else is an option as it stands."""
    f = dict(feature)
    heads_q, heads_kv = f.pop("heads", (4, 2))
    head_dim_v = f.pop("head_dim_v", None)
    alibi = f.pop("alibi", None)
    if alibi == "per_head":
        f["alibi_slopes"] = torch.rand(heads_q) * 0.5
    elif alibi == "per_batch_head":
        f["alibi_slopes"] = torch.rand(batch, heads_q) * 0.5
    if f.pop("sinks", False):
        f["sinks"] = torch.randn(heads_q)
    if f.pop("prefix", False):
        f["prefix_lens"] = torch.tensor([min(3, n) for n in key_lengths], dtype=torch.int32)
    return f, (heads_q, heads_kv), head_dim_v
