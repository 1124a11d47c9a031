"""The compiled CPU kernel built for another machine and run under an emulator: an aarch64 build
(``aarch64-linux-gnu-g++``) under ``qemu-aarch64``, for tests/backends/cpu/test_arm_build.py.

``build`` compiles ``kernel_driver.cpp`` (the kernel's source with a small server around it) into a
static aarch64 executable; ``install`` replaces the loaded library's two entry points in this
process with calls to one driver process under qemu. Each call sends the parameter struct native.py
built and the whole storage of every tensor one of its pointers points into (found through a
registry of ``Tensor.data_ptr`` results: native.py takes every pointer that way), and copies every
storage back after the call. Everything above the entry points (validation, dispatch, the tests'
float64 references) is the host's own code, so a test of test_native.py runs unchanged on the Arm
kernel.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
import weakref
from pathlib import Path

import torch

from jagged_sdpa.backends.cpu import native

CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
DRIVER = Path(__file__).with_name("kernel_driver.cpp")


def missing_tools() -> list[str]:
    return [t for t in (CROSS_CXX, QEMU) if shutil.which(t) is None]


def build(out: Path, march: str = "armv8-a") -> subprocess.CompletedProcess:
    """Compiles the driver for aarch64 with native.py's flags (static: qemu then needs no sysroot)."""
    flags = [f.format(arch=march) for f in native.FLAGS if f not in ("-shared", "-fPIC")]
    return subprocess.run([CROSS_CXX, *flags, "-static", "-o", str(out), str(DRIVER)], capture_output=True, text=True,
                          timeout=600)


_SEEN: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _pointer_fields(cls, base: int = 0):
    """(offset, name) of every pointer field of a ctypes struct, nested structs included."""
    out = []
    for name, typ in cls._fields_:
        off = base + getattr(cls, name).offset
        if typ is ctypes.c_void_p:
            out.append((off, name))
        elif isinstance(typ, type) and issubclass(typ, ctypes.Structure):
            out.extend(_pointer_fields(typ, off))
    return out


class RemoteLibrary:
    """The host library's attributes, but forward and backward run by the driver under qemu."""

    def __init__(self, host, driver: Path):
        self._host = host
        self._proc = subprocess.Popen([QEMU, str(driver)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._host, name)

    def js_bf16_tiles(self):
        return 0  # the Arm build multiplies bf16 as float32

    def js_attention_forward(self, ref):
        return self._call(1, ref._obj)

    def js_attention_backward(self, ref):
        return self._call(2, ref._obj)

    def _storage_of(self, ptr: int):
        for t in list(_SEEN.values()):
            s = t.untyped_storage()
            start = s.data_ptr()
            if start <= ptr < start + s.nbytes() or (ptr == start and s.nbytes() == 0):
                return start, s.nbytes()
        raise RuntimeError(f"pointer {ptr:#x} is in no tensor this process handed out")

    def _call(self, kind: int, params) -> int:
        raw = bytes(memoryview(params).cast("B"))
        buffers, where, pointers = [], {}, []
        for off, _name in _pointer_fields(type(params)):
            (ptr,) = struct.unpack_from("<Q", raw, off)
            if ptr == 0:
                continue
            start, n = self._storage_of(ptr)
            if start not in where:
                where[start] = len(buffers)
                buffers.append((start, n))
            pointers.append((off, where[start], ptr - start))
        msg = [struct.pack("<II", kind, len(buffers))]
        for start, n in buffers:
            msg += [struct.pack("<Q", n), ctypes.string_at(start, n)]
        msg += [struct.pack("<Q", len(raw)), raw, struct.pack("<I", len(pointers))]
        msg += [struct.pack("<IIQ", off, buf, at) for off, buf, at in pointers]
        self._proc.stdin.write(b"".join(msg))
        self._proc.stdin.flush()
        head = self._proc.stdout.read(4)
        if len(head) != 4:
            raise RuntimeError(f"the kernel under {QEMU} died (exit code {self._proc.wait()})")
        (code,) = struct.unpack("<i", head)
        for start, n in buffers:
            data = self._proc.stdout.read(n)
            ctypes.memmove(start, data, n)
        self.calls += 1
        return code

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.write(struct.pack("<I", 0))
            self._proc.stdin.close()
            self._proc.wait(timeout=60)


def install(driver: Path) -> RemoteLibrary:
    """From now on this process's kernel calls run in the driver under qemu."""
    host = native.library()
    assert host is not None, native.unavailable_reason()
    data_ptr = torch._C.TensorBase.data_ptr

    def recorded(self):
        ptr = data_ptr(self)
        _SEEN[ptr] = self
        return ptr

    torch.Tensor.data_ptr = recorded
    lib = RemoteLibrary(host, driver)
    native._STATE["lib"] = lib
    return lib
