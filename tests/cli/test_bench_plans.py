"""``benchmarks/bench_plans.py`` end to end with a few calls a row (every section: tiny, paged,
dense, fp8), and the runs of used blocks its decode floors read."""

from __future__ import annotations

import importlib.util
import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plans", os.path.join(ROOT, "benchmarks", "bench_plans.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_used_runs_cover_each_used_block_once():
    runs = _bench().used_runs(torch.tensor([5, 1, 2, 3, 9, 8, 2, 12]))
    assert runs == [(1, 4), (5, 6), (8, 10), (12, 13)]


def test_every_section_prints_its_rows_and_floors(capsys):
    threads = torch.get_num_threads()
    try:
        assert _bench().main(["--only", "tiny,paged,dense,fp8", "--reps", "8", "--rounds", "1"]) in (0, None)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+)x \|$", out, re.M)
    names = [name for name, _, _ in rows]
    for floor in ("float32: read used K/V once (floor)", "bfloat16: read used K/V once (floor)",
                  "float32, 32-layer step: read used K/V once (floor)", "fp8 cache: read its used bytes once (floor)"):
        assert floor in names, out
    assert any(name.startswith("fp8 e4m3fn cache, q bf16 (") for name in names), out
    assert all(float(us) > 0 for _, us, _ in rows)
    floors = [float(ratio) for name, _, ratio in rows if "(floor)" in name]
    assert floors and all(r == 1.0 for r in floors)
