"""The all-gather algorithm: each rank fetches the keys/values its query runs read, then makes
one ``jagged_sdpa.varlen_attention`` call per distinct shift (routes.py says why that is exact).

Only the KV heads travel (GQA/MQA gather Hkv heads), and only the rows some run of this rank
reads (an all-to-all with per-rank counts: on whole-document plans almost nothing moves). The
backward sends dK/dV home and sums them in float32 (exchange.gather_keys).
"""

from __future__ import annotations

import numpy as np
import torch

import jagged_sdpa
from jagged_sdpa.distributed.exchange import gather_keys
from jagged_sdpa.distributed.routes import needs_offset, route


def refusal(plan, world_size, hq, hkv, opts):
    """Why allgather cannot take this call, or None."""
    if opts["alibi_slopes"] is not None and needs_offset(plan, opts["causal"], opts["window_size"]):
        return ("bidirectional ALiBi on a sequence split across ranks: a run's keys extend past its "
                "last query, and the kernels take no per-sequence position offset to correct the "
                "distances (use causal=True, a 'documents' plan, or algorithm='ulysses')")
    return None


def _calls(q, kv_keys, plan, rank, hkv, d, dv, opts):
    """Yield (group, positional args after q, kwargs) of each of this rank's kernel calls."""
    r = route(plan, rank, opts["causal"], opts["window_size"])
    device = q.device
    alibi = opts["alibi_slopes"]
    for i, g in enumerate(r.groups):
        def cu(lens):
            return lambda: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        cu_q = r.tensor(("cu_q", i), cu(g.q_lens), device)
        cu_k = r.tensor(("cu_k", i), cu(g.k_lens), device)
        keys = kv_keys[g.key_offset:g.key_offset + g.n_keys]
        k = keys[:, :hkv * d].view(-1, hkv, d)
        v = keys[:, hkv * d:].view(-1, hkv, dv)
        slopes = alibi
        if alibi is not None and alibi.dim() == 2:
            slopes = alibi.index_select(0, r.tensor(("docs", i), lambda g=g: torch.as_tensor(g.docs), alibi.device))
        kwargs = dict(softmax_scale=opts["softmax_scale"], causal=opts["causal"], window_size=g.window,
                      softcap=opts["softcap"], alibi_slopes=slopes, return_lse=True, backend=opts["backend"])
        yield g, (k, v, cu_q, cu_k, max(g.q_lens), max(g.k_lens)), kwargs


def explain_calls(q, k, v, plan, rank, opts):
    """jagged_sdpa explanations of this rank's calls, on stand-in tensors (runs no kernel)."""
    n, hkv, d = k.shape
    dv = v.shape[2]
    r = route(plan, rank, opts["causal"], opts["window_size"])
    keys = torch.empty(r._key_index.size, hkv * (d + dv), dtype=k.dtype, device=k.device)
    keys.requires_grad_(k.requires_grad or v.requires_grad)
    out = []
    for g, (kk, vv, cu_q, cu_k, mq, mk), kwargs in _calls(q, keys, plan, rank, hkv, d, dv, opts):
        qq = torch.empty(g.q_rows.size, q.shape[1], d, dtype=q.dtype, device=q.device).requires_grad_(q.requires_grad)
        kwargs.pop("return_lse")
        out.append(jagged_sdpa.explain(qq, kk, vv, cu_q, cu_k, mq, mk, return_lse=True, **kwargs))
    return out


def attention(q, k, v, plan, comm, opts):
    """This rank's (out (n, Hq, Dv), lse (Hq, n))."""
    n, hkv, d = k.shape
    dv = v.shape[2]
    r = route(plan, comm.rank, opts["causal"], opts["window_size"])
    kv = torch.cat([k.reshape(n, hkv * d), v.reshape(n, hkv * dv)], dim=1)
    keys = gather_keys(kv, comm, r)
    outs, lses = [], []
    for g, (kk, vv, cu_q, cu_k, mq, mk), kwargs in _calls(q, keys, plan, comm.rank, hkv, d, dv, opts):
        single = len(r.groups) == 1
        qq = q if single else q.index_select(0, r.tensor(("q_rows", g.shift), lambda g=g: torch.as_tensor(g.q_rows), q.device))
        o, l = jagged_sdpa.varlen_attention(qq, kk, vv, cu_q, cu_k, mq, mk, **kwargs)
        outs.append(o)
        lses.append(l)
    if not outs:
        # No local rows: still tie the output to the exchange (so this rank's backward joins the
        # collective the other ranks' backward runs) and to q (whose gradient is then empty, not None).
        out = keys.new_zeros(0, q.shape[1], dv) + (keys.sum() + q.sum()) * 0
        return out, torch.zeros(q.shape[1], 0, dtype=torch.float32, device=q.device)
    if len(outs) == 1:
        return outs[0], lses[0]
    inverse = r.tensor("inverse", lambda: torch.as_tensor(np.argsort(np.concatenate([g.q_rows for g in r.groups]))), q.device)
    return torch.cat(outs).index_select(0, inverse), torch.cat(lses, dim=1).index_select(1, inverse)
