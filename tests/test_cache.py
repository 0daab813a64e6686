"""The cache's atomic file writes (its directory builds are tested through model loading)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from delspec.cache import write_atomically


def test_a_failed_write_leaves_the_old_file_and_no_scratch(tmp_path):
    path = tmp_path / "costs" / "profile.json"
    write_atomically(path, lambda scratch: scratch.write_text("old"))

    def fail(scratch):
        scratch.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, fail)
    assert path.read_text() == "old"
    assert [entry.name for entry in path.parent.iterdir()] == ["profile.json"]
    write_atomically(path, lambda scratch: scratch.write_text("new"))
    assert path.read_text() == "new"


def test_a_write_removes_scratch_files_that_killed_writes_left(tmp_path):
    path = tmp_path / "adapters.safetensors"
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # its pid now names no process
    hours_ago = time.time() - 7200
    killed = tmp_path / f".{path.name}.{ended.pid}.abc.tmp"
    recent = tmp_path / f".{path.name}.{ended.pid}.def.tmp"  # maybe another machine's write
    running = tmp_path / f".{path.name}.{os.getpid()}.ghi.tmp"
    for scratch in (killed, recent, running):
        scratch.write_text("partial")
    for scratch in (killed, running):
        os.utime(scratch, (hours_ago, hours_ago))
    write_atomically(path, lambda scratch: scratch.write_text("whole"))
    assert path.read_text() == "whole"
    assert sorted(tmp_path.iterdir()) == sorted([path, recent, running])
