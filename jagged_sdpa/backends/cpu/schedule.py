"""Run per-sequence work across the CPU's threads by sequence, each thread single-threaded.

Intra-op threading (every matmul and softmax split over all cores) joins the threads after each
op. The CPU path runs many small ops, and on a shared machine one descheduled thread stalls every
join: measured 50 ms single-threaded vs 3 s with 2 intra-op threads next to one busy process
(W2, 64 short sequences). Splitting the sequences into balanced halves, one per thread, each
running its ops single-threaded, has no joins inside the call and keeps both cores busy.

``torch.set_num_threads`` sets the calling thread's OpenMP/MKL thread count (and a global default
for threads not yet started), so each half sets it in its own thread and restores it after.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Callable, Sequence

import torch

# Above this share of the total work, one sequence alone would keep one thread busy while the
# other idles: such calls keep torch's intra-op threads instead.
MAX_SHARE = 0.5
# Calls whose sequences have more (query, key) pairs than this keep intra-op threads too: their
# big matmuls amortise the joins, and on a quiet machine that is faster (W1 bf16 forward: 17 ms
# intra-op vs 24 ms split; fp32: 33 vs 40). The split is for short sequences, where per-op joins
# dominate and where contention hurts most.
MAX_PAIRS = 128 * 128


@functools.lru_cache(maxsize=1)
def _helper() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jagged_sdpa_cpu")


def _single_threaded(tasks: Sequence[Callable[[], None]], threads: int, grad_enabled: bool) -> None:
    torch.get_num_threads()  # initialises this thread's count before we override it
    torch.set_num_threads(1)
    try:
        # Grad mode is per thread: the helper thread takes the caller's.
        with torch.set_grad_enabled(grad_enabled):
            for task in tasks:
                task()
    finally:
        torch.set_num_threads(threads)


def split_in_two(weights: Sequence[int]) -> tuple[list[int], list[int]]:
    """Indices of two bins with nearly equal total weight (largest first, into the lighter bin)."""
    bins, totals = ([], []), [0, 0]
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        lighter = 0 if totals[0] <= totals[1] else 1
        bins[lighter].append(i)
        totals[lighter] += weights[i]
    return sorted(bins[0]), sorted(bins[1])


def run(tasks: Sequence[Callable[[], None]], weights: Sequence[int], *, ordered: bool = False) -> None:
    """Run every task once. ``ordered`` (dropout: draws must follow sequence order) runs them in
    order on this thread; so do calls with fewer than two tasks, one thread, or one dominant task."""
    threads = torch.get_num_threads()
    total = sum(weights)
    heaviest = max(weights, default=0)
    if ordered or threads < 2 or len(tasks) < 2 or heaviest > MAX_SHARE * total or heaviest > MAX_PAIRS:
        for task in tasks:
            task()
        return
    first, second = split_in_two(weights)
    grad_enabled = torch.is_grad_enabled()
    future = _helper().submit(_single_threaded, [tasks[i] for i in second], threads, grad_enabled)
    try:
        _single_threaded([tasks[i] for i in first], threads, grad_enabled)
    finally:
        future.result()
