"""The compiled CPU kernel on Arm (aarch64, NEON): cross-compiled with ``aarch64-linux-gnu-g++`` and
run under ``qemu-aarch64`` (Debian's g++-aarch64-linux-gnu and qemu-user; .ci/run installs them).
No Arm machine is at hand, so its speed is not measured here, but every CI run checks that the Arm
build compiles and that its results pass a subset of test_native.py and test_dropout.py against the
float64 reference: a child python runs those tests with the kernel's entry points served by the
Arm build under qemu (remote_kernel.py), all validation and references being the host's own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from support import remote_kernel
from support.guarded import run_child
from test_portable_build import SUBSET

pytestmark = [pytest.mark.cross_isa,
              pytest.mark.skipif(bool(remote_kernel.missing_tools()),
                                 reason=f"needs {' and '.join(remote_kernel.missing_tools())} "
                                        "(apt-get install g++-aarch64-linux-gnu qemu-user)")]

_CHILD = """
import sys, pytest
from support import remote_kernel
from pathlib import Path
lib = remote_kernel.install(Path({driver!r}))
rc = pytest.main(["-q", "-p", "no:cacheprovider", "tests/backends/cpu/test_native.py", "tests/api/test_dropout.py", "-k", {subset!r}])
print("CALLS", lib.calls, flush=True)
lib.close()
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    out = tmp_path_factory.mktemp("arm") / "kernel_driver"
    proc = remote_kernel.build(out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_the_aarch64_build_is_an_arm_executable_with_neon_tiles(driver):
    head = driver.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:
        code = subprocess.run([objdump, "-d", str(driver)], capture_output=True, text=True, check=True).stdout
        assert re.search(r"\bfmla\s+v\d+\.4s", code)  # 128-bit NEON FMAs


def test_the_aarch64_build_passes_the_kernel_tests_under_qemu(driver):
    # One thread: qemu runs each OpenMP thread as a host thread; thread independence is tested on
    # the native build.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_child(_CHILD.format(driver=str(driver), subset=SUBSET), env=env, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 80 and not re.search(r"\d+ (failed|error|skipped)", out), out[-2000:]
    calls = re.search(r"^CALLS (\d+)$", out, re.M)
    assert calls and int(calls.group(1)) >= 100, out[-2000:]  # the kernel calls ran under qemu
