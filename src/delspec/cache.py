"""The delspec cache: what delspec derives from a model once and keeps (converted checkpoints,
assembled model files, cost profiles, adapters of packaged models).

Entries appear atomically, so a reader never sees a partial one, and the cache cleans up after
itself: an entry made from a file that has changed since is removed when the file's new entry
is built, and so are the scratch directories that killed builds left behind.
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

LAYOUT = "2"  # bump when what an entry holds changes: every entry is then made again
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

    The build runs in a scratch directory named after this process and appears as `target`
    when complete. It also removes what the cache no longer needs: the entries made from
    `source` before it changed, and the scratch directories of killed builds of `target`.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}."
    _remove_abandoned(target.parent, prefix)
    scratch = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}.", dir=target.parent))
    origin = str(source.resolve())
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
        if entry != target and not entry.name.startswith(".") and _superseded(entry, origin):
            shutil.rmtree(entry, ignore_errors=True)
    return target


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Create or replace file `path` with what `write(scratch_file)` writes; readers see the
    old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    scratch = Path(name)
    try:
        write(scratch)
        scratch.replace(path)
    finally:
        scratch.unlink(missing_ok=True)


def _superseded(entry: Path, origin: str) -> bool:
    """Whether cache entry `entry` is unneeded once file `origin` has a current entry: it was
    made from `origin` before that changed, or from a cache file that has since been removed
    (a model assembled by a package that was reinstalled since)."""
    try:
        made_from = Path((entry / _SOURCE_FILE).read_text())
    except OSError:  # not an entry, an older one, or removed meanwhile
        return False
    in_cache = made_from.is_relative_to(cache_dir().resolve())
    return str(made_from) == origin or (in_cache and not made_from.exists())


def _remove_abandoned(directory: Path, prefix: str) -> None:
    """Remove scratch directories `{prefix}{pid}.*` in `directory` whose process is no longer
    running here and that have not changed for an hour (so a build by another machine sharing
    the cache is left alone)."""
    for entry in directory.glob(f"{glob.escape(prefix)}*"):
        pid = entry.name[len(prefix) :].split(".", 1)[0]
        if not pid.isdigit() or _running(int(pid)):
            continue
        try:
            if time.time() - entry.stat().st_mtime > _ABANDONED_AFTER_S:
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:  # removed by a concurrent build
            pass


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
