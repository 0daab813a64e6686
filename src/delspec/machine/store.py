"""The machine cache on disk: the one module that reads or writes what was measured on this machine.
Two kinds of entry live under the delspec cache, each keyed by `MachineProfile.key`: kernel choices
(`kernels/choice-<key>.json`) and decode cost profiles (`costs/profile-<key>.json`, with draft head
timings per vocabulary; until one is measured, the new tokens that runs too short to measure it were
allowed: `costs/pending-<key>.json`). An entry older than `MEASURED_MAX_AGE_S` (a profile whose
takes never agreed: `UNSETTLED_MAX_AGE_S`), or of another version, reads as missing, so it is
measured again. Writes are atomic: a reader sees the old entry or the whole new one.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from delspec.cache import write_atomically
from delspec.machine.cost_profile import PROFILE_VERSION, CostProfile
from delspec.machine.kernel_choice import CHOICE_VERSION
from delspec.machine.timing import MEASURED_MAX_AGE_S

UNSETTLED_MAX_AGE_S = 3600  # a profile whose takes never agreed is measured again after this


def choices_path(root: Path, key: str) -> Path:
    """Where the kernel choices of measurement key `key` are kept under cache root `root`."""
    return root / "kernels" / f"choice-{key}.json"


def profile_path(root: Path, key: str) -> Path:
    """Where the cost profile of profile key `key` is kept under cache root `root`."""
    return root / "costs" / f"profile-{key}.json"


def count_unprofiled(path: Path, tokens: int) -> int:
    """Add `tokens` (a run's budget of new tokens) to those allowed to runs that went without
    the profile at `path` because each was too short to repay measuring it, and return the
    total (`MachineProfile.cost_profile`). Kept beside the profile (`pending-<key>.json`);
    an unreadable count starts again from zero, and one that cannot be written (a read-only
    cache) is only this run's: the count is a saving, never a reason for a run to fail."""
    pending = _pending_path(path)
    try:
        total = int(json.loads(pending.read_text())["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        total = 0
    total += tokens
    text = json.dumps({"tokens": total})
    with contextlib.suppress(OSError):
        write_atomically(pending, lambda out: out.write_text(text))
    return total


def clear_unprofiled(path: Path) -> None:
    """Forget the count of `count_unprofiled` (the profile at `path` was measured)."""
    with contextlib.suppress(OSError):
        _pending_path(path).unlink(missing_ok=True)


def _pending_path(path: Path) -> Path:
    return path.with_name(path.name.replace("profile-", "pending-", 1))


def read_choices(path: Path) -> dict[str, Any] | None:
    """The kernel choices stored at `path` (their row buckets as numbers again), or None where
    none are stored for this version or they are too old."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if stored.get("version") != CHOICE_VERSION:
        return None
    if time.time() - stored.get("measured_at", 0) > MEASURED_MAX_AGE_S:
        return None
    choices = stored["choices"]
    stored["choices"] = {key: {int(r): k for r, k in rows.items()} for key, rows in choices.items()}
    return stored


def write_choices(path: Path, stored: dict[str, Any]) -> None:
    """Store kernel choices (`MachineProfile.choose_kernels`'s record) at `path`."""
    text = json.dumps(stored, indent=1)
    write_atomically(path, lambda out: out.write_text(text))


def read_profile(path: Path, max_tokens: int) -> tuple[CostProfile, dict[str, list[float]]] | None:
    """The profile stored at `path` and its draft heads' timings per vocabulary, or None when
    missing, unreadable, of another version, too old, or measured for fewer than `max_tokens`
    rows."""
    stored = _parse_profile(path)
    if stored is None:
        return None
    profile, draft_heads = stored
    age = MEASURED_MAX_AGE_S if profile.settled else UNSETTLED_MAX_AGE_S
    fresh = time.time() - profile.measured_at < age
    if fresh and profile.version == PROFILE_VERSION and len(profile.layer) >= max_tokens:
        return profile, draft_heads
    return None


def write_profile(path: Path, profile: CostProfile, draft_heads: dict[str, list[float]]) -> None:
    """Write `profile`'s model timings and `draft_heads` (per vocabulary) atomically."""
    stored = {k: v for k, v in asdict(profile).items() if k not in ("draft_head", "path")}
    text = json.dumps({**stored, "draft_heads": draft_heads})
    write_atomically(path, lambda scratch: scratch.write_text(text))


def store_correction(path: str | Path, factor: float) -> None:
    """Scale every timing of the profile stored at `path` by `factor` (every vocabulary's draft
    head too), keeping when it was measured, so that the next process starts from timings the
    rounds agreed with (a missing or unreadable file is left alone)."""
    stored = _parse_profile(Path(path))
    if stored is None:
        return
    profile, draft_heads = stored
    profile.scale(factor)
    scaled = {vocab: [t * factor for t in times] for vocab, times in draft_heads.items()}
    write_profile(Path(path), profile, scaled)


def mark_stale(path: str | Path) -> None:
    """Mark the profile stored at `path` stale (unsettled, measured at time 0), so that the next
    run measures it again (a missing or unreadable file is left alone)."""
    try:
        stored = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return
    text = json.dumps({**stored, "settled": False, "measured_at": 0.0})
    write_atomically(Path(path), lambda scratch: scratch.write_text(text))


def _parse_profile(path: Path) -> tuple[CostProfile, dict[str, list[float]]] | None:
    """The profile stored at `path` (without draft head timings) and its draft heads' timings
    per vocabulary; None when missing or unreadable."""
    try:
        stored = json.loads(path.read_text())
        draft_heads = dict(stored.pop("draft_heads"))
        return CostProfile(**stored, draft_head=[]), draft_heads
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
