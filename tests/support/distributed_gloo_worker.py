"""One gloo rank of tests/distributed/test_distributed_gloo.py: joins the group, runs every case, reports.

Imported by spawned children: it puts this worktree first on sys.path before importing
jagged_sdpa, so the children test the code under test, not another installed copy.
"""

from __future__ import annotations

import sys
import traceback
from datetime import timedelta


def main(rank, world_size, store_path, repo_root, cases, refs, errors, queue):
    sys.path[:0] = [repo_root, f"{repo_root}/tests"]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    report = {"rank": rank, "results": []}
    try:
        import jagged_sdpa
        from support.distributed_cases import check, run_rank, single_process, tensors
        from jagged_sdpa import distributed as jd

        report["package"] = jagged_sdpa.__file__
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        for case, ref, bitwise in zip(cases, refs, [c.algorithm == "ulysses" and c.hkv % world_size == 0
                                                      for c in cases]):
            try:
                t = tensors(case)
                plan = jd.plan_shards(t["cu"], world_size, strategy=case.strategy, causal=case.causal,
                                      window_size=case.window_size)
                got = run_rank(jd, plan, rank, None, case, t)
                check(plan, rank, case, got, single_process(case, t), ref, bitwise=bitwise)
                report["results"].append((case.name, "ok", "bitwise" if bitwise else "tolerance"))
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                report["results"].append((case.name, "fail", traceback.format_exc()))
        for name, make in errors:
            try:
                make(jd, rank, world_size)
                report["results"].append((name, "no error", ""))
            except (ValueError, TypeError) as exc:
                report["results"].append((name, type(exc).__name__, str(exc)))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        report["crash"] = traceback.format_exc()
    queue.put(report)
