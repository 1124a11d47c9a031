"""What a model or server pays per attention call: plans and implicit reuse against dense SDPA.

Side by side in one run, one thread (``--threads``), process CPU time (``time.process_time``:
the cores here are shared), best of ``--rounds`` rounds of ``--reps`` calls:

- tiny batch (B=4, lengths 3/5/2/4, H=2, D=16, causal): one dense ``F.scaled_dot_product_attention``
  on the padded batch; ``plan.run``; ``varlen_attention`` with max lengths; ``sdpa`` over NJTs
  that share one offsets tensor (32 layers); forward+backward through a plan and dense.
- a 32-layer paged decode step (B=8, one query each, block 16, contexts 20-300, Hq 8 / Hkv 2,
  D 64, fp32 and bf16): one plan run per layer, against reading the layer's used K/V once (the
  step's floor: ``read_once``, int64 sums over the used blocks; ``index_select`` copies them, which
  costs a write and page faults besides the read) and against ``varlen_attention`` per layer.
- a decode step over a dense left-padded cache as transformers keeps it (``dense_decode``): read in
  place, against the packed path and transformers' "sdpa", one layer and 32 layers.
- one decode call over a paged cache in fp8 (e4m3fn, e5m2), bf16 and fp32 (``fp8_decode``, B 16,
  contexts 1,500-2,500, 32/8 heads, D 128), against reading the fp8 cache's used bytes once.

Run: python benchmarks/bench_plans.py [--reps N] [--rounds N] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import jagged_sdpa


def best_us(fn, reps: int, rounds: int) -> float:
    """Best per-call process time of ``rounds`` rounds of ``reps`` calls, in microseconds."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - t0) / reps)
    return best * 1e6


def used_runs(used_blocks: torch.Tensor) -> list[tuple[int, int]]:
    """The used block ids as sorted runs [start, end) of consecutive ids, each id once (a read's
    order does not matter)."""
    ids = torch.unique(used_blocks).tolist()
    runs, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            runs.append((start, a + 1))
            start = b
    return runs


def read_once(caches, used_blocks: torch.Tensor):
    """A function that reads the used blocks of each paged cache in ``caches`` once: the floor of a
    decode call over them. Each cache is viewed as int64 words (whose sum torch vectorises; its
    uint8 and int32 sums are not) and summed over the runs of consecutive used block ids, found
    once here: a read and nothing else. ``index_select`` of the used blocks, the floor before,
    is a copy (a read, a write, and page faults on each fresh output) and measured 11 to 68 ms
    for the fp8 cache where one read takes about 6 ms."""
    runs = used_runs(used_blocks)
    words = [c.reshape(c.shape[0], -1).view(torch.int64) for c in caches]

    def read():
        for w in words:
            for a, b in runs:
                w[a:b].sum()
    return read


def tiny(reps: int, rounds: int) -> list[tuple[str, float, float]]:
    """Rows (name, us per call, ratio to one dense SDPA call) of the tiny batch."""
    cu = torch.tensor([0, 3, 8, 10, 14], dtype=torch.int32)
    q, k, v = (torch.randn(14, 2, 16) for _ in range(3))
    dense = [torch.randn(4, 2, 5, 16) for _ in range(3)]
    plan = jagged_sdpa.plan(cu, cu, 5, 5, causal=True)
    offsets = cu.long()
    njts = [torch.nested.nested_tensor_from_jagged(torch.randn(14, 2, 16), offsets).transpose(1, 2)
            for _ in range(32)]

    def sdpa_32_layers():
        for x in njts:
            jagged_sdpa.sdpa(x, x, x, is_causal=True)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dg = [t.clone().requires_grad_() for t in dense]
    grad_out, grad_dense = torch.randn(14, 2, 16), torch.randn(4, 2, 5, 16)

    rows = {
        "dense SDPA, padded (B, H, 5, D)": lambda: F.scaled_dot_product_attention(*dense, is_causal=True),
        "plan.run": lambda: plan.run(q, k, v),
        "varlen_attention, max lengths given": lambda: jagged_sdpa.varlen_attention(q, k, v, cu, cu, 5, 5, causal=True),
        "varlen_attention, no max lengths": lambda: jagged_sdpa.varlen_attention(q, k, v, cu, cu, causal=True),
    }
    out = {name: best_us(fn, reps, rounds) for name, fn in rows.items()}
    out["sdpa, 32 layers sharing offsets (per call)"] = best_us(sdpa_32_layers, max(reps // 32, 1), rounds) / 32
    out["dense SDPA forward+backward"] = best_us(
        lambda: F.scaled_dot_product_attention(*dg, is_causal=True).backward(grad_dense), reps // 2, rounds)
    out["plan.run forward+backward"] = best_us(lambda: plan.run(qg, kg, vg).backward(grad_out), reps // 2, rounds)
    dense_fwd, dense_bwd = out["dense SDPA, padded (B, H, 5, D)"], out["dense SDPA forward+backward"]
    return [(name, us, us / (dense_bwd if "backward" in name else dense_fwd)) for name, us in out.items()]


def decode_step(dtype: torch.dtype, reps: int, rounds: int, layers: int = 32) -> list[tuple[str, float, float]]:
    """Rows of one paged decode step over ``layers`` layers (ratio: to the K/V read floor)."""
    gen = torch.Generator().manual_seed(0)
    batch, block, hq, hkv, d = 8, 16, 8, 2, 64
    contexts = torch.randint(20, 301, (batch,), generator=gen).tolist()
    width = max(-(-n // block) for n in contexts)
    num_blocks = sum(-(-n // block) for n in contexts) + 4
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(batch, width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(contexts):
        need = -(-n // block)
        table[b, :need] = ids[at:at + need].to(torch.int32)
        at += need
    caches = [(torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype),
               torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype)) for _ in range(layers)]
    qs = [torch.randn(batch, hq, d, generator=gen).to(dtype) for _ in range(layers)]
    cu_q = torch.arange(batch + 1, dtype=torch.int32)
    seqused = torch.tensor(contexts, dtype=torch.int32)
    used_blocks = torch.cat([table[b, :-(-n // block)] for b, n in enumerate(contexts)]).long()
    plan = jagged_sdpa.plan(cu_q, None, 1, max(contexts), causal=True, block_table=table, seqused_k=seqused)

    floor = read_once([c for kv in caches for c in kv], used_blocks)

    def step_plan():
        for q, (k_cache, v_cache) in zip(qs, caches):
            plan.run(q, k_cache, v_cache)

    def step_varlen():
        for q, (k_cache, v_cache) in zip(qs, caches):
            jagged_sdpa.varlen_attention(q, k_cache, v_cache, cu_q, None, 1, max(contexts), causal=True,
                                         block_table=table, seqused_k=seqused)

    reps = max(reps // layers, 3)
    base = best_us(floor, reps, rounds)
    name = str(dtype).replace("torch.", "")
    rows = [(f"{name}: read used K/V once (floor)", base, 1.0)]
    for label, fn in ((f"{name}: plan.run per layer", step_plan), (f"{name}: varlen_attention per layer", step_varlen)):
        us = best_us(fn, reps, rounds)
        rows.append((label, us, us / base))
    return rows


def dense_decode(dtype: torch.dtype, reps: int, rounds: int, layers: int = 32) -> list[tuple[str, float, float]]:
    """Rows of a decode step over a dense left-padded cache as transformers keeps it (B=8, one query
    each, contexts 20-300 left-padded into S=320, Hq 8 / Hkv 2, D 64, (B, Hkv, S, D) per layer),
    ratio to reading the used K/V once: one layer and a ``layers``-layer step whose metadata is new
    (as each generate step's is), against transformers' "sdpa" (one SDPA call on the padded cache
    with a boolean padding mask) and the packed path (gather the valid K/V, attend, scatter)."""
    gen = torch.Generator().manual_seed(0)
    batch, S, hq, hkv, d = 8, 320, 8, 2, 64
    contexts = torch.randint(20, 301, (batch,), generator=gen)
    leftpad = (S - contexts).to(torch.int32)
    used = contexts.to(torch.int32)
    caches = [(torch.randn(batch, hkv, S, d, generator=gen).to(dtype),
               torch.randn(batch, hkv, S, d, generator=gen).to(dtype)) for _ in range(layers)]
    qs = [torch.randn(batch, hq, d, generator=gen).to(dtype) for _ in range(layers)]
    cu_q = torch.arange(batch + 1, dtype=torch.int32)
    valid = torch.arange(S)[None, :] >= leftpad[:, None]                       # (B, S)
    mask = valid[:, None, None, :]
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), used.cumsum(0).to(torch.int32)])
    b_idx, s_idx = valid.nonzero(as_tuple=True)

    # The floor: each layer's used K/V bytes read once, as int64 word sums over a buffer of the same
    # size per layer and cache (the used rows are B x Hkv runs a layer: summed one by one, the floor
    # would time Python calls; ``index_select`` of them is a copy, a write and page faults besides).
    used_words = int(contexts.sum()) * hkv * d * torch.finfo(dtype).bits // 64
    words = [[torch.empty(used_words, dtype=torch.int64).fill_(1) for _ in range(2)] for _ in range(layers)]

    def floor(n=layers):
        for kw, vw in words[:n]:
            kw.sum()
            vw.sum()

    def in_place(n=layers, fresh=False):
        u, lp = (used.clone(), leftpad.clone()) if fresh else (used, leftpad)
        for q, (kc, vc) in zip(qs[:n], caches[:n]):
            jagged_sdpa.varlen_attention(q, kc.transpose(1, 2), vc.transpose(1, 2), cu_q, None, 1, S, seqused_k=u,
                                         cache_leftpad=lp, causal=True)

    def packed(n=layers):
        for q, (kc, vc) in zip(qs[:n], caches[:n]):
            k, v = kc[b_idx, :, s_idx], vc[b_idx, :, s_idx]
            out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, 1, S, causal=True)
            out.new_zeros(batch, hq, d).index_copy(0, torch.arange(batch), out)

    def sdpa(n=layers):
        for q, (kc, vc) in zip(qs[:n], caches[:n]):
            F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=mask, enable_gqa=True)

    name = str(dtype).replace("torch.", "")
    rows_out = []
    for n, label in ((1, "one layer"), (layers, f"{layers}-layer step")):
        r = max(reps // (n * 4), 3)
        base = best_us(lambda: floor(n), r, rounds)
        rows_out.append((f"{name}, {label}: read used K/V once (floor)", base, 1.0))
        contenders = [("in place (varlen_attention, seqused_k + cache_leftpad)", lambda: in_place(n))]
        if n > 1:
            contenders.append(("in place, new metadata this step", lambda: in_place(n, fresh=True)))
        contenders += [("packed: gather K/V, attend, scatter", lambda: packed(n)),
                       ("transformers' sdpa: SDPA on the padded cache + mask", lambda: sdpa(n))]
        for label2, fn in contenders:
            us = best_us(fn, r, rounds)
            rows_out.append((f"{name}, {label}: {label2}", us, us / base))
    return rows_out


def fp8_decode(reps: int, rounds: int) -> list[tuple[str, float, float]]:
    """Rows of one decode call over a paged cache stored in fp8, bf16 and fp32 (docs/api.md section
    13): B 16, one query each, contexts 1,500-2,500, Hq 32 / Hkv 8, D 128, block 16, q bf16 (fp32
    beside the fp32 cache); ratio to the fp8 cache's floor, one read of its used blocks' bytes
    (``read_once``)."""
    gen = torch.Generator().manual_seed(0)
    batch, block, hq, hkv, d = 16, 16, 32, 8, 128
    contexts = torch.randint(1500, 2501, (batch,), generator=gen).tolist()
    need = [-(-n // block) for n in contexts]
    num_blocks = sum(need) + 4
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(batch, max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[at:at + n].to(torch.int32)
        at += n
    used_blocks = torch.cat([table[b, :n] for b, n in enumerate(need)]).long()
    k32 = torch.randn(num_blocks, block, hkv, d, generator=gen)
    v32 = torch.randn(num_blocks, block, hkv, d, generator=gen)
    k_scale, v_scale = k32.abs().amax(dim=(0, 1, 3)) / 448, v32.abs().amax() / 448   # per kv head, per tensor
    fp8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    caches = {name: ((k32 / k_scale.view(-1, 1)).to(dt), (v32 / v_scale).to(dt)) for name, dt in fp8.items()}
    q = torch.randn(batch, hq, d, generator=gen).bfloat16()
    cu_q = torch.arange(batch + 1, dtype=torch.int32)
    kw = dict(block_table=table, seqused_k=torch.tensor(contexts, dtype=torch.int32), causal=True)
    kb, vb = k32.bfloat16(), v32.bfloat16()
    k8 = caches["e4m3fn"][0].view(torch.uint8)
    v8 = caches["e4m3fn"][1].view(torch.uint8)
    rows = {"fp8 cache: read its used bytes once (floor)": read_once([k8, v8], used_blocks)}
    for name, (k, v) in caches.items():
        rows[f"fp8 {name} cache, q bf16"] = lambda k=k, v=v: jagged_sdpa.varlen_attention(
            q, k, v, cu_q, None, 1, max(contexts), k_scale=k_scale, v_scale=v_scale, **kw)
    rows["bf16 cache, q bf16"] = lambda: jagged_sdpa.varlen_attention(q, kb, vb, cu_q, None, 1, max(contexts), **kw)
    q32 = q.float()
    rows["fp32 cache, q fp32"] = lambda: jagged_sdpa.varlen_attention(q32, k32, v32, cu_q, None, 1, max(contexts),
                                                                      **kw)
    reps = max(reps // 200, 3)
    times = {name: best_us(fn, reps, rounds) for name, fn in rows.items()}
    base, bf16 = times["fp8 cache: read its used bytes once (floor)"], times["bf16 cache, q bf16"]
    return [(f"{name}" + (f" ({us / bf16:.2f}x the bf16 cache)" if name.startswith("fp8 e") else ""), us, us / base)
            for name, us in times.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="tiny,paged,dense,fp8", help="sections: tiny, paged, dense, fp8")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), process time, best of {args.rounds}")
    only = set(args.only.split(","))
    if "tiny" in only:
        print("\n| tiny batch | us per call | x dense (fwd or fwd+bwd) |\n|---|---:|---:|")
        for name, us, ratio in tiny(args.reps, args.rounds):
            print(f"| {name} | {us:.1f} | {ratio:.2f}x |")
    if "paged" in only:
        print("\n| 32-layer paged decode step | us per step | x floor |\n|---|---:|---:|")
        for dtype in (torch.float32, torch.bfloat16):
            for name, us, ratio in decode_step(dtype, args.reps, args.rounds):
                print(f"| {name} | {us:.0f} | {ratio:.2f}x |")
    if "dense" in only:
        print("\n| dense left-padded decode (transformers' cache) | us | x floor |\n|---|---:|---:|")
        for dtype in (torch.float32, torch.bfloat16):
            for name, us, ratio in dense_decode(dtype, args.reps, args.rounds):
                print(f"| {name} | {us:.0f} | {ratio:.2f}x |")
    if "fp8" in only:
        print("\n| decode over a paged fp8 / bf16 / fp32 cache (B 16, 1.5-2.5k keys, 32/8 heads, D 128) | us | x floor |"
              "\n|---|---:|---:|")
        for name, us, ratio in fp8_decode(args.reps, args.rounds):
            print(f"| {name} | {us:.0f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
