"""The cache's atomic file writes (its directory builds are tested through model loading)."""

from __future__ import annotations

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
