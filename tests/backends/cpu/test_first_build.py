"""The first CPU call builds the compiled kernel (tens of seconds): it says so once, at INFO on the
``"jagged_sdpa"`` logger and in a short stderr note when a person is watching.

A fake compiler stands in for g++ (the real build is timed in the README, not here): it prints a
version and writes a file where ``-o`` points, or fails, in milliseconds.
"""

from __future__ import annotations

import logging
import stat

import pytest

from jagged_sdpa.backends.cpu import native


def _fake_compiler(tmp_path, succeed: bool) -> str:
    script = tmp_path / ("fake-cxx-ok" if succeed else "fake-cxx-fail")
    body = ('out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
            'printf "not a library" > "$out"; exit 0\n') if succeed else 'echo "error: planted failure" >&2; exit 1\n'
    script.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "fake-cxx 1.0"; exit 0; fi\n' + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


class _Terminal:
    """A stderr that says it is a terminal, and keeps what is written to it."""

    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text

    def flush(self):
        pass


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    monkeypatch.setenv("JAGGED_SDPA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JAGGED_SDPA_NATIVE", raising=False)
    monkeypatch.delenv("JAGGED_SDPA_SANITIZE", raising=False)
    monkeypatch.delenv(native.ARCH_ENV, raising=False)
    native.reset()
    yield tmp_path
    monkeypatch.undo()
    native.reset()


def _build_messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "jagged_sdpa" and r.levelno == logging.INFO]


def test_first_build_is_announced_once_with_where_and_how_long(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CXX", _fake_compiler(fresh_build, succeed=True))
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with caplog.at_level(logging.INFO, logger="jagged_sdpa"):
        assert native.library() is None                     # the fake "library" does not load
        assert "loading" in native.unavailable_reason()
        native.library()                                    # once per process: nothing more is said
    messages = _build_messages(caplog)
    assert len(messages) == 2, messages
    start, done = messages
    cache = str(fresh_build / "cache")
    assert start.startswith("building the compiled CPU kernel for this machine")
    assert cache in start and "-march=native" in start and native.BUILD_TIME_NOTE in start
    assert done.startswith("built the compiled CPU kernel in ") and done.split(" in ")[1][0].isdigit()
    # caplog's handler shows the INFO line, so the terminal gets no second copy.
    assert terminal.text == ""


def test_terminal_gets_a_note_when_no_handler_shows_info(fresh_build, monkeypatch):
    monkeypatch.setenv("CXX", _fake_compiler(fresh_build, succeed=True))
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(native.log, "level", logging.WARNING)
    native.library()
    lines = terminal.text.splitlines()
    assert len(lines) == 2, terminal.text
    assert lines[0].startswith("jagged_sdpa: building the compiled CPU kernel") and str(fresh_build / "cache") in lines[0]
    assert lines[1].startswith("jagged_sdpa: built the compiled CPU kernel in ")


def test_no_note_when_stderr_is_not_a_terminal(fresh_build, monkeypatch, capsys):
    monkeypatch.setenv("CXX", _fake_compiler(fresh_build, succeed=True))
    monkeypatch.setattr(native.log, "level", logging.WARNING)
    native.library()
    assert capsys.readouterr().err == ""


def test_a_failed_build_is_announced_then_a_reason(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CXX", _fake_compiler(fresh_build, succeed=False))
    with caplog.at_level(logging.INFO, logger="jagged_sdpa"):
        assert native.library() is None
    assert "planted failure" in native.unavailable_reason()
    messages = _build_messages(caplog)
    assert len(messages) == 1 and messages[0].startswith("building the compiled CPU kernel")


def test_a_cached_library_is_loaded_silently(fresh_build, monkeypatch, caplog):
    """Only a build is announced: a library already in the cache loads without a word."""
    monkeypatch.setenv("CXX", _fake_compiler(fresh_build, succeed=True))
    native.library()
    native.reset()
    with caplog.at_level(logging.INFO, logger="jagged_sdpa"):
        native.library()
    assert _build_messages(caplog) == []


def test_an_edit_to_any_part_of_the_kernel_changes_the_cache_key(tmp_path, monkeypatch):
    """The kernel is attention.cpp plus the headers it includes: a library built before an edit to
    any one of them must not be loaded after it."""
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(native.SOURCE.parent, csrc)
    monkeypatch.setattr(native, "SOURCE", csrc / "attention.cpp")
    cxx = _fake_compiler(tmp_path, succeed=True)
    before = native._library_file(cxx, "native")[0]
    parts = sorted(csrc.glob("*.h"))
    assert {p.name for p in parts} >= {"simd.h", "tiles.h", "direct_rows.h", "backward.h"}
    for part in [csrc / "attention.cpp", *parts]:
        text = part.read_text()
        part.write_text(text + "\n// edited\n")
        assert native._library_file(cxx, "native")[0] != before, part.name
        part.write_text(text)
    assert native._library_file(cxx, "native")[0] == before


def test_the_package_data_ships_every_part_of_the_kernel():
    """An installed wheel must carry every file attention.cpp includes: pyproject's package data
    patterns match each source file in csrc/."""
    import fnmatch
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[3]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "jagged_sdpa.backends.cpu"]
    csrc = native.SOURCE.parent
    for part in csrc.iterdir():
        name = f"csrc/{part.name}"
        assert any(fnmatch.fnmatch(name, pat) for pat in patterns), name
    included = {line.split('"')[1] for line in native.SOURCE.read_text().splitlines() if line.startswith("#include \"")}
    assert included == {p.name for p in csrc.glob("*.h")}
