"""The delspec cache: what delspec derives from a model once and keeps (GGUF metadata,
assembled model files, cost profiles, adapters of packaged models).

Entries appear atomically, so a reader never sees a partial one, and the cache cleans up after
itself: an entry made from a file that has changed since is removed when the file's new entry
is built, and the scratch files and directories that killed writes left behind are removed by
the next write of the same entry.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

LAYOUT = "4"  # bump when what an entry holds changes: every entry is then made again
_KEY_BYTES = 1 << 20  # a GGUF file's header and metadata
_SOURCE_FILE = "delspec-source.txt"  # in each entry directory: the file it was made from
_ABANDONED_AFTER_S = 3600.0  # a build this old whose process is gone was killed


def cache_dir() -> Path:
    """$DELSPEC_CACHE, else $XDG_CACHE_HOME/delspec, else ~/.cache/delspec."""
    if root := os.environ.get("DELSPEC_CACHE"):
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "delspec"


def file_key(path: Path) -> str:
    """A key that changes with file `path`: from its size, mtime and first MiB."""
    stat = path.stat()
    digest = hashlib.sha256(f"{LAYOUT}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with path.open("rb") as file:
        digest.update(file.read(_KEY_BYTES))
    return digest.hexdigest()[:16]


def build_once(target: Path, source: Path, build: Callable[[Path], None]) -> Path:
    """Directory `target`, made from file `source` by `build(empty_directory)` on first use.

    The build runs in a scratch directory (`_scratch_prefix`) and appears as `target` when
    complete. It also removes the entries made from `source` before it changed.
    """
    if target.is_dir():
        return target
    scratch = Path(tempfile.mkdtemp(prefix=_scratch_prefix(target), dir=target.parent))
    origin, root = str(source.resolve()), cache_dir().resolve()
    try:
        build(scratch)
        (scratch / _SOURCE_FILE).write_text(origin)
        try:
            scratch.rename(target)
        except OSError:
            if not target.is_dir():  # not a concurrent build that finished first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for entry in target.parent.iterdir():
        if entry != target and not entry.name.startswith(".") and _superseded(entry, origin, root):
            shutil.rmtree(entry, ignore_errors=True)
    return target


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Create or replace file `path` with what `write(scratch_file)` writes; readers see the
    old file or the whole new one, never a part."""
    handle, name = tempfile.mkstemp(prefix=_scratch_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(handle)
    scratch = Path(name)
    try:
        write(scratch)
        scratch.replace(path)
    finally:
        scratch.unlink(missing_ok=True)


def _scratch_prefix(path: Path) -> str:
    """The name prefix `.{name}.{pid}.` of this process's scratch files and directories for
    `path`, after removing those of other writers of `path` that were killed: their process
    is no longer running here and they have not changed for an hour (so a write by another
    machine sharing the cache is left alone)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}."
    for entry in path.parent.glob(f"{glob.escape(prefix)}*"):
        pid = entry.name[len(prefix) :].split(".", 1)[0]
        if not pid.isdigit() or _running(int(pid)):
            continue
        try:
            if time.time() - entry.stat().st_mtime < _ABANDONED_AFTER_S:
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:  # removed by a concurrent writer, or not ours to remove
            pass
    return f"{prefix}{os.getpid()}."


def _superseded(entry: Path, origin: str, root: Path) -> bool:
    """Whether entry `entry` of cache `root` is unneeded once file `origin` has a current
    entry: it was made from `origin` before that changed, or from a cache file that has since
    been removed (a model assembled by a package that was reinstalled since)."""
    try:
        made_from = Path((entry / _SOURCE_FILE).read_text())
    except OSError:  # not an entry, an older one, or removed meanwhile
        return False
    return str(made_from) == origin or (made_from.is_relative_to(root) and not made_from.exists())


def _running(pid: int) -> bool:
    """Whether process `pid` may exist on this machine (always, where it cannot be asked)."""
    if os.name != "posix":  # elsewhere os.kill(pid, 0) would end the process
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return True
