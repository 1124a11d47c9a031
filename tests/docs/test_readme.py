"""Every ```python block of README.md runs as pasted, so the README cannot drift.

Each block is executed on its own, in a fresh namespace (nothing defined by an earlier block is
visible), on the CPU, in this process. A block whose first line is

    # requires: cuda

needs a CUDA device: it is skipped where torch sees none (and runs where it does). That is the only
marker; any other block that fails is a README bug. ``bash`` and ``text`` blocks are not run
(``tests/cli/test_cli.py`` runs the commands they show).

A block may change process-wide state that a model or a program would keep: after each block this
test destroys a ``torch.distributed`` process group it left, and undoes
``jt.enable_continuous_batching()``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = re.compile(r"#\s*requires:\s*(\w+)\s*$")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, source) of every fenced block whose info string is ``python``."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == "python"]


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_its_python_blocks():
    """The extraction finds the blocks (a change of fence style would otherwise run nothing)."""
    assert len(BLOCKS) >= 8, [line for line, _ in BLOCKS]
    fenced = README.read_text().count("\n```python")
    assert len(BLOCKS) == fenced
    assert python_blocks("a\n```python\nx = 1\n```\n```bash\nls\n```\n") == [(2, "x = 1\n")]


def _cleanup() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    module = sys.modules.get("jagged_sdpa.integrations.transformers")
    if module is not None:
        module.disable_continuous_batching()


@pytest.mark.parametrize("line,source", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs_as_pasted(line, source):
    first = source.lstrip().splitlines()[0] if source.strip() else ""
    marker = MARKER.match(first)
    if marker:
        assert marker.group(1) == "cuda", f"README.md:{line}: unknown marker {first!r} (only '# requires: cuda')"
        if not torch.cuda.is_available():
            pytest.skip(f"README.md:{line} needs a CUDA device")
    code = compile(source, f"README.md:{line}", "exec")
    try:
        exec(code, {"__name__": "__readme__"})
    finally:
        _cleanup()
