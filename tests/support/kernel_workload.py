"""Small calls that reach every path of the compiled CPU kernel through the public API, in every
dtype, for runs where the point is *where* memory is read: the sanitizer build
(``test_sanitizers.py``) and guard pages (``test_guard_pages.py``). Correctness on its own is
tested against float64 elsewhere (test_native*.py); here each call is checked against the same call
on ordinary tensors (bit for bit on the kernel: the placement must not matter) and loosely
against MATH.

Paths: forward tiles (several key blocks, query chunks, GQA, odd D, Dv != D, every option),
direct decode rows, windows past the keys (top-left through ``sdpa``, Lq > Lk, Lk = 0), the
issue-11 repros, NaN rows, the backward, the paged forward and backward; each with docs/api.md section 11's
chunk_size, prefix_lens and sinks too (the ``sinks_chunk_prefix_*`` cases: prefix_lens and sinks
are placed like every other input). ``run(place)`` runs them all in this
process, printing each case before it runs (a crash names its case).
"""

from __future__ import annotations

import contextlib
import sys

import torch

import jagged_sdpa
from jagged_sdpa.backends.cpu import native

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOOSE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
INT64_MAX = (1 << 63) - 1


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


def _add_options(x, gen, dtype, hq, prefix, sinks, grad=False):
    """docs/api.md section 11's tensors: prefix_lens (a list, or None) and sinks ((Hq,) in the call's dtype)."""
    if prefix is not None:
        x["prefix"] = torch.tensor(prefix, dtype=torch.int32)
    if sinks:
        x["sinks"] = (torch.randn(hq, generator=gen) * 2).to(dtype).requires_grad_(grad)
    return x


def _options_of(x):
    return {"prefix_lens": x.get("prefix"), "sinks": x.get("sinks")}


def _leaves(x):
    """The tensors a backward case differentiates, and their gradients' names."""
    names = ["q", "k", "v"] + (["sinks"] if "sinks" in x else [])
    return [x[n] for n in names], ["d" + n if n != "v" else "dv" for n in names]


def _varlen_case(q_lens, k_lens, hq, hkv, d, dv, *, alibi=None, prefix=None, sinks=False, **opts):
    def build(dtype, gen):
        x = {"q": _randn(gen, sum(q_lens), hq, d, dtype=dtype), "k": _randn(gen, sum(k_lens), hkv, d, dtype=dtype),
             "v": _randn(gen, sum(k_lens), hkv, dv, dtype=dtype), "cu_q": _cu(q_lens), "cu_k": _cu(k_lens)}
        if alibi == "per_head":
            x["slopes"] = torch.rand(hq, generator=gen) * 0.3
        elif alibi == "per_batch_head":
            x["slopes"] = torch.rand(len(q_lens), hq, generator=gen) * 0.3
        return _add_options(x, gen, dtype, hq, prefix, sinks)

    def call(x, backend):
        out, lse = jagged_sdpa.varlen_attention(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"],
                                                alibi_slopes=x.get("slopes"), return_lse=True, backend=backend,
                                                **_options_of(x), **opts)
        return {"out": out, "lse": lse}
    return build, call


def _backward_case(q_lens, k_lens, hq, hkv, d, dv, *, prefix=None, sinks=False, **opts):
    def build(dtype, gen):
        x = {"q": _randn(gen, sum(q_lens), hq, d, dtype=dtype).requires_grad_(True),
             "k": _randn(gen, sum(k_lens), hkv, d, dtype=dtype).requires_grad_(True),
             "v": _randn(gen, sum(k_lens), hkv, dv, dtype=dtype).requires_grad_(True),
             "grad": _randn(gen, sum(q_lens), hq, dv, dtype=dtype), "cu_q": _cu(q_lens), "cu_k": _cu(k_lens)}
        return _add_options(x, gen, dtype, hq, prefix, sinks, grad=True)

    def call(x, backend):
        leaves, names = _leaves(x)
        out = jagged_sdpa.varlen_attention(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], backend=backend,
                                           **_options_of(x), **opts)
        return {"out": out, **dict(zip(names, torch.autograd.grad(out, leaves, x["grad"])))}
    return build, call


def _fp8_cache(x, gen, fp8, hkv):
    """k/v quantized to an fp8 cache (docs/api.md section 13) with per-kv-head scales, NaN bytes
    (0x7f in both formats) in every slot no row reads being the caller's business."""
    if fp8 is None:
        return x
    x["k_scale"] = torch.rand(hkv, generator=gen) * 0.1 + 0.02
    x["v_scale"] = torch.tensor(0.05)
    for name, scale in (("k", x["k_scale"]), ("v", x["v_scale"])):
        x[name] = (x[name].float() / scale.view(-1, 1)).clamp(-400, 400).to(fp8)
    return x


def _scales_of(x):
    return {"k_scale": x["k_scale"], "v_scale": x["v_scale"]} if "k_scale" in x else {}


def _paged_case(q_lens, used, block_size, hq, hkv, d, *, prefix=None, sinks=False, fp8=None, **opts):
    def build(dtype, gen):
        need = [-(-n // block_size) for n in used]
        num_blocks = sum(need) + 2
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        table = torch.zeros(len(used), max(need + [1]), dtype=torch.int32)
        for b, n in enumerate(need):
            table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            ids = ids[n:]
        x = {"q": _randn(gen, sum(q_lens), hq, d, dtype=dtype),
             "k": _randn(gen, num_blocks, block_size, hkv, d, dtype=dtype),
             "v": _randn(gen, num_blocks, block_size, hkv, d, dtype=dtype),
             "cu_q": _cu(q_lens), "table": table, "used": torch.tensor(used, dtype=torch.int32)}
        return _fp8_cache(_add_options(x, gen, dtype, hq, prefix, sinks), gen, fp8, hkv)

    def call(x, backend):
        out, lse = jagged_sdpa.varlen_attention(x["q"], x["k"], x["v"], x["cu_q"], None, block_table=x["table"],
                                                seqused_k=x["used"], return_lse=True, backend=backend,
                                                **_options_of(x), **_scales_of(x), **opts)
        return {"out": out, "lse": lse}
    return build, call


def _paged_backward_case(q_lens, used, block_size, hq, hkv, d, *, prefix=None, sinks=False, **opts):
    """The paged backward: sequence 1 reads sequence 0's first block as its first and second
    blocks (a shared block, read twice), so dK/dV go through the kernel's shared-block sums."""
    build_paged, _ = _paged_case(q_lens, used, block_size, hq, hkv, d, prefix=prefix, sinks=sinks)

    def build(dtype, gen):
        x = build_paged(dtype, gen)
        x["table"][1, :2] = x["table"][0, 0]
        for key in ("q", "k", "v", "sinks"):
            if key in x:
                x[key].requires_grad_(True)
        x["grad"] = _randn(gen, sum(q_lens), hq, d, dtype=dtype)
        return x

    def call(x, backend):
        leaves, names = _leaves(x)
        out = jagged_sdpa.varlen_attention(x["q"], x["k"], x["v"], x["cu_q"], None, block_table=x["table"],
                                           seqused_k=x["used"], backend=backend, **_options_of(x), **opts)
        return {"out": out, **dict(zip(names, torch.autograd.grad(out, leaves, x["grad"])))}
    return build, call


def _njt_case(q_lens, k_lens, h, d, **opts):
    """sdpa on NJTs (top-left alignment unless opts say otherwise) whose values are the placed tensors."""
    def build(dtype, gen):
        return {"q": _randn(gen, sum(q_lens), h, d, dtype=dtype), "k": _randn(gen, sum(k_lens), h, d, dtype=dtype),
                "v": _randn(gen, sum(k_lens), h, d, dtype=dtype), "off_q": _cu(q_lens).long(),
                "off_k": _cu(k_lens).long()}

    def call(x, backend):
        nj = lambda values, offsets: torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)
        out = jagged_sdpa.sdpa(nj(x["q"], x["off_q"]), nj(x["k"], x["off_k"]), nj(x["v"], x["off_k"]),
                               backend=backend, **opts)
        return {"out": out.transpose(1, 2).values()}
    return build, call


def _nan_row_case():
    build, call = _varlen_case([4, 70], [4, 130], 2, 1, 24, 24, causal=True)

    def build_nan(dtype, gen):
        x = build(dtype, gen)
        x["q"][2, 0, 3] = float("nan")
        x["q"][4 + 30, 1, 0] = float("nan")
        return x
    return build_nan, call


# name -> (build(dtype, generator) -> inputs dict, call(inputs, backend) -> outputs dict)
CASES = {
    "tiles_every_option": _varlen_case([70, 9, 0, 3, 130], [130, 0, 5, 70, 65], 4, 2, 33, 20, alibi="per_batch_head",
                                       causal=True, window_size=(40, 3), softcap=5.0),
    "tiles_plain_gqa": _varlen_case([70, 9, 3, 130], [130, 5, 70, 65], 6, 2, 40, 40),
    "decode_rows": _varlen_case([1, 2, 1, 1, 2], [300, 0, 40, 1, 70], 8, 2, 64, 48, alibi="per_head",
                                causal=True, window_size=(100, 0)),
    # Direct rows in bf16/fp16 pairs: odd head dims (pair and row tails), Dv past 32, GQA.
    "decode_rows_odd_dims": _varlen_case([1, 1, 2, 1], [300, 33, 70, 1], 6, 2, 37, 45, causal=True, softcap=5.0),
    "decode_rows_odd_dims_backward": _backward_case([1, 1, 2], [300, 37, 70], 6, 2, 37, 45, causal=True),
    "decode_rows_odd_dims_paged": _paged_case([1, 1, 1], [77, 40, 5], 16, 6, 2, 37, causal=True),
    "windows_past_keys_varlen": _varlen_case([10, 3, 0, 70, 2, 9], [2, 0, 4, 3, 70, 150], 2, 1, 24, 24,
                                             window_size=(0, 0)),
    "windows_int64_max": _varlen_case([10, 3, 70], [2, 0, 90], 2, 1, 16, 16, causal=True,
                                      window_size=(INT64_MAX, INT64_MAX)),
    "windows_past_keys_top_left": _njt_case([10, 3, 70, 2], [2, 0, 3, 70], 2, 24, window_size=(0, 0)),
    "top_left_causal_window": _njt_case([10, 130, 1], [70, 20, 0], 2, 16, is_causal=True, window_size=(5, 2)),
    "repro_window_past_keys": _njt_case([10], [2], 1, 8, window_size=(0, 0)),
    "repro_empty_keys": _njt_case([3], [0], 1, 8, window_size=(0, 0)),
    "nan_query_rows": _nan_row_case(),
    "backward": _backward_case([130, 0, 1, 67, 9, 3], [130, 5, 70, 0, 140, 2], 4, 2, 40, 24, causal=True,
                               window_size=(50, -1)),
    # odd head dims (pairs of elements with a zero beside the last), Dv != D, GQA, odd row chunks
    # (64 + 3 rows: a half pair in the bf16 transposed products), dropout
    "backward_odd_dims_gqa_dropout": _backward_case([67, 1, 9, 130], [130, 70, 2, 67], 6, 2, 33, 21, causal=True,
                                                    window_size=(70, -1), dropout_p=0.1),
    "backward_d1": _backward_case([5, 70], [70, 3], 2, 1, 1, 3),
    "backward_softcap": _backward_case([70, 2, 10], [70, 90, 2], 2, 1, 16, 16, softcap=3.0, window_size=(0, 0)),
    "paged": _paged_case([9, 1, 2, 0, 70], [40, 77, 0, 5, 70], 16, 4, 2, 24, causal=True, window_size=(30, 0)),
    "paged_odd_blocks": _paged_case([3, 1, 1], [5, 1, 33], 5, 2, 2, 8, softcap=2.0),
    "dropout_tiles_and_decode_rows": _varlen_case([70, 1, 0, 2, 130], [130, 300, 5, 0, 65], 4, 2, 33, 20,
                                                  alibi="per_head", causal=True, window_size=(90, 3),
                                                  dropout_p=0.3),
    "dropout_backward": _backward_case([130, 0, 1, 67, 3], [130, 5, 70, 0, 2], 4, 2, 40, 24, causal=True,
                                       softcap=3.0, dropout_p=0.2),
    "dropout_paged": _paged_case([9, 1, 70], [40, 77, 70], 16, 4, 2, 24, causal=True, dropout_p=0.5),
    "paged_backward": _paged_backward_case([9, 3, 1, 0, 70], [40, 37, 0, 5, 70], 16, 4, 2, 24, causal=True,
                                           window_size=(30, 0)),
    "paged_backward_odd_blocks": _paged_backward_case([3, 2, 1], [5, 12, 33], 5, 2, 2, 8, softcap=2.0),
    # docs/api.md section 11: chunks starting inside and at key blocks, prefixes past a row's other keys, sinks.
    "sinks_chunk_prefix_tiles": _varlen_case([70, 9, 0, 3, 130], [130, 0, 5, 70, 65], 4, 2, 33, 20,
                                             alibi="per_head", causal=True, window_size=(40, 3), softcap=5.0,
                                             chunk_size=48, prefix=[60, 0, 5, 2, 65], sinks=True),
    "sinks_chunk_prefix_negative_rows": _varlen_case([10, 3, 70], [2, 4, 90], 2, 1, 24, 24, chunk_size=7,
                                                     prefix=[1, 4, 30], sinks=True),
    "sinks_chunk_prefix_decode_rows": _varlen_case([1, 2, 1, 1, 2], [300, 0, 40, 1, 70], 8, 2, 64, 48, causal=True,
                                                   chunk_size=100, prefix=[150, 0, 40, 1, 3], sinks=True),
    "sinks_chunk_prefix_backward": _backward_case([130, 0, 1, 67, 9, 3], [130, 5, 70, 0, 140, 2], 4, 2, 40, 24,
                                                  causal=True, chunk_size=50, prefix=[70, 3, 20, 0, 100, 1],
                                                  sinks=True),
    "sinks_chunk_prefix_dropout_backward": _backward_case([70, 2, 10], [70, 90, 2], 2, 1, 16, 16, softcap=3.0,
                                                          chunk_size=9, prefix=[20, 0, 2], sinks=True, dropout_p=0.2),
    "sinks_chunk_prefix_paged": _paged_case([9, 1, 2, 0, 70], [40, 77, 0, 5, 70], 16, 4, 2, 24, causal=True,
                                            chunk_size=20, prefix=[10, 77, 0, 5, 33], sinks=True),
    # docs/api.md section 13: fp8 caches read in place, through tiles and direct rows.
    "fp8_e4m3_paged": _paged_case([9, 1, 2, 0, 70], [40, 77, 0, 5, 70], 16, 4, 2, 24, causal=True, softcap=4.0,
                                  fp8=torch.float8_e4m3fn),
    "fp8_e5m2_paged_odd": _paged_case([1, 1, 3], [33, 1, 130], 5, 8, 2, 40, window_size=(50, 0), causal=True,
                                      sinks=True, fp8=torch.float8_e5m2),
    "sinks_chunk_prefix_paged_backward": _paged_backward_case([9, 3, 1, 0, 70], [40, 37, 0, 5, 70], 16, 4, 2, 24,
                                                              causal=True, chunk_size=20, prefix=[10, 20, 0, 5, 33],
                                                              sinks=True),
}


@contextlib.contextmanager
def work_split(q_chunk, direct_rows, direct_keys):
    saved = native.Q_CHUNK, native.DIRECT_ROWS, native.DIRECT_KEYS
    try:
        native.Q_CHUNK, native.DIRECT_ROWS, native.DIRECT_KEYS = q_chunk, direct_rows, direct_keys
        yield
    finally:
        native.Q_CHUNK, native.DIRECT_ROWS, native.DIRECT_KEYS = saved


SPLITS = {"shipped": (native.Q_CHUNK, native.DIRECT_ROWS, native.DIRECT_KEYS), "small": (5, 2, 24)}


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(torch.isnan(a), torch.isnan(b)) and \
        torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def run(place, *, backends=("cpu_fused", "math"), cases=None, dtypes=DTYPES, splits=("shipped", "small")) -> None:
    """Runs every case with its inputs passed through ``place`` (a tensor -> tensor copy), and
    checks that the compiled kernel's results equal the same call on the unplaced inputs bit for
    bit (under every work split) and match MATH's loosely (NaN where MATH has NaN). Every call
    starts from the same seed: dropout cases draw the same key, so the same mask, each time."""
    assert native.library() is not None, native.unavailable_reason()
    for name in cases or CASES:
        build, call = CASES[name]
        for dtype in dtypes:
            inputs = build(dtype, torch.Generator().manual_seed(0))
            placed = {key: place(t) for key, t in inputs.items()}
            want = None
            if "math" in backends:
                print(f"case {name} {str(dtype)[6:]} math", flush=True)
                torch.manual_seed(1)
                want = call(placed, "math")
            if "cpu_fused" not in backends:
                continue
            for split in splits:
                print(f"case {name} {str(dtype)[6:]} cpu_fused split={split}", flush=True)
                with work_split(*SPLITS[split]):
                    torch.manual_seed(1)
                    got = call(placed, "cpu_fused")
                    torch.manual_seed(1)
                    plain = call(inputs, "cpu_fused")
                for key in got:
                    assert _same(got[key], plain[key]), f"{name} {dtype}: placed {key} differs from plain"
                    if want is not None:
                        torch.testing.assert_close(got[key].float(), want[key].float(), atol=LOOSE[dtype],
                                                   rtol=LOOSE[dtype], equal_nan=True,
                                                   msg=lambda m: f"{name} {dtype} {key} against MATH: {m}")
    print("workload done", flush=True)


if __name__ == "__main__":  # python kernel_workload.py: the workload on ordinary tensors
    run(lambda t: t.clone())
    sys.exit(0)
