"""The checks of a call's index-tensor *contents* (cu_seqlens, seqused_k, block_table), run when
the attention operator runs.

An eager call on the CPU, or one without its max lengths, has read and validated them already
(``spec.lengths_known``). Otherwise (an accelerator call given every max length, and every call
inside ``torch.compile``, where the wrapper is traced and reads nothing) the operator checks them
here before any kernel runs: on the CPU by reading them (not a device sync; a ``ValueError`` naming
the argument, exactly as eager), elsewhere with ``checks.device`` (a device-side assert, no sync).
The rules themselves live in ``layout.seqlen_stats``/``lengths_stats`` and
``inputs.validate_block_ids``; ``varlen_lengths`` is the one place that applies them to a varlen
call, for the wrapper and for the operator.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor

from jagged_sdpa import layout
from jagged_sdpa.checks import inputs
from jagged_sdpa.checks.device import DeviceChecks
from jagged_sdpa.spec import PackedCall


class Lengths(NamedTuple):
    """Validated lengths of a call: stats of queries and (used) keys, cu_seqlens_k and seqused_k as
    read (None when paged / not given)."""

    q: layout.SeqlenStats
    k: layout.SeqlenStats
    cu_k: Optional[tuple[int, ...]]
    seqused_k: Optional[tuple[int, ...]]


def varlen_lengths(host: list, total_q: int, k: Tensor, max_q: Optional[int], max_k: Optional[int],
                   paged: bool, has_seqused: bool) -> Lengths:
    """Validate what ``layout.read_host`` read for a varlen call: ``host`` is [cu_seqlens_q,
    block_table, seqused_k] when paged, else [cu_seqlens_q, cu_seqlens_k(, seqused_k)]."""
    stats_q = layout.seqlen_stats("cu_seqlens_q", host[0], total_q, max_q, "max_seqlen_q")
    if paged:
        num_blocks, block_size = k.shape[0], k.shape[1]
        batch = len(host[0]) - 1
        width = len(host[1]) // batch if batch else 0
        used = tuple(host[2])
        stats_k = layout.lengths_stats("seqused_k", host[2], [width * block_size] * batch, max_k)
        rows = [host[1][b * width:(b + 1) * width] for b in range(batch)]
        inputs.validate_block_ids(rows, used, block_size, num_blocks)
        return Lengths(stats_q, stats_k, None, used)
    # With seqused_k, max_seqlen_k bounds the used keys, not the cu_seqlens_k segments.
    if host[1] is host[0] and k.shape[0] == total_q and not has_seqused and max_k == max_q:
        stats_k = stats_q  # self-attention: the same cu_seqlens, read once, already validated
    else:
        stats_k = layout.seqlen_stats("cu_seqlens_k", host[1], k.shape[0], None if has_seqused else max_k,
                                      "max_seqlen_k")
    if not has_seqused:
        return Lengths(stats_q, stats_k, stats_k.cu_host, None)
    used = tuple(host[2])
    return Lengths(stats_q, layout.lengths_stats("seqused_k", used, layout.host_lengths(stats_k.cu_host), max_k), stats_k.cu_host,
                   used)


def check(call: PackedCall) -> PackedCall:
    """``call`` with its contents checked; on the CPU also with the lengths read (host fields set,
    ``lengths_known``). A call already checked by its wrapper is returned as it is."""
    spec = call.spec
    if spec.lengths_known:
        return call
    if call.q.device.type == "cpu":
        return _read_and_check(call)
    _queue_device_checks(call)
    return call


def _read_and_check(call: PackedCall) -> PackedCall:
    spec = call.spec
    if spec.entry == "varlen":
        to_read = [call.cu_seqlens_q] + ([call.block_table, call.seqused_k] if spec.paged else
                                         [call.cu_seqlens_k] + ([call.seqused_k] if spec.seqused_k else []))
        found = varlen_lengths(layout.read_host(*to_read), spec.total_q, call.k, spec.max_seqlen_q,
                               spec.max_seqlen_k, spec.paged, spec.seqused_k)
        return call.replace(cu_q_host=found.q.cu_host, cu_k_host=found.cu_k, seqused_k_host=found.seqused_k,
                            spec=spec.replace(lengths_known=True))
    cu_q, cu_k = layout.read_host(call.cu_seqlens_q, call.cu_seqlens_k)
    stats_q = layout.seqlen_stats("query.offsets()", cu_q, spec.total_q, spec.max_seqlen_q,
                                  "query's cached max seqlen")
    if spec.kv_dense or call.cu_seqlens_k is call.cu_seqlens_q:
        stats_k = stats_q if not spec.kv_dense else layout.SeqlenStats(tuple(cu_k), spec.max_seqlen_k, False)
    else:
        stats_k = layout.seqlen_stats("key.offsets()", cu_k, spec.total_k, spec.max_seqlen_k,
                                      "key's cached max seqlen")
    return call.replace(cu_q_host=stats_q.cu_host, cu_k_host=stats_k.cu_host, spec=spec.replace(lengths_known=True))


def _queue_device_checks(call: PackedCall) -> None:
    spec = call.spec
    checks = DeviceChecks()
    if spec.entry == "varlen":
        checks.add_cu("cu_seqlens_q", call.cu_seqlens_q, spec.total_q, spec.max_seqlen_q, "max_seqlen_q")
        if spec.paged:
            width = call.block_table.shape[1]
            checks.add_lengths("seqused_k", call.seqused_k, width * spec.block_size, spec.max_seqlen_k)
            checks.add_block_ids(call.block_table, call.seqused_k, spec.block_size, call.k.shape[0])
        else:
            max_cu_k = spec.max_seqlen_k if not spec.seqused_k else call.k.shape[0]
            checks.add_cu("cu_seqlens_k", call.cu_seqlens_k, call.k.shape[0], max_cu_k, "max_seqlen_k")
            if spec.seqused_k:
                checks.add_lengths("seqused_k", call.seqused_k, call.cu_seqlens_k, spec.max_seqlen_k)
    else:
        checks.add_cu("query.offsets()", call.cu_seqlens_q, spec.total_q, spec.max_seqlen_q,
                      "query's cached max seqlen")
        if not spec.kv_dense:
            checks.add_cu("key.offsets()", call.cu_seqlens_k, spec.total_k, spec.max_seqlen_k,
                          "key's cached max seqlen")
    checks.queue()
