"""The cost profiles on disk: one file per setting (`cost_profile.profile_key`), read or
measured by `cached_profile`, corrected by the cost model's `CostCheck` (`store_correction`,
`mark_stale`)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from delspec.cache import write_atomically
from delspec.machine import cost_profile
from delspec.machine.cost_profile import (
    DRAFT_HEAD_ROUNDS,
    PROFILE_VERSION,
    QUICK_DRAFT_HEAD_ROUNDS,
    CostProfile,
    ExitHeadLike,
    profile_key,
)
from delspec.machine.timing import MEASURED_MAX_AGE_S

UNSETTLED_MAX_AGE_S = 3600  # a profile whose takes never agreed is measured again after this


def cached_profile(
    exit_head: ExitHeadLike,
    exit_layer: int,
    max_tokens: int,
    directory: Path,
    thorough: bool = False,
) -> CostProfile:
    """The profile for this model and setting from `directory`, measured again when missing,
    older than a week (an hour when not `CostProfile.settled`), measured for fewer tokens, or
    quick where a `thorough` one is asked for; measured quick unless `thorough`. Draft head
    timings are stored per vocabulary (`ExitHead.vocab_sizes`) in the same file; a new one is
    measured and added."""
    path = directory / f"profile-{profile_key(exit_head)}.json"
    vocab = ",".join(map(str, exit_head.vocab_sizes))
    stored = _read_profile(path, max_tokens)
    if stored is not None and thorough and stored[0].quick:
        stored = None
    if stored is None:
        how = "thoroughly, once" if thorough else "quickly; `delspec serve` measures thoroughly"
        print(
            f"delspec: measuring decode costs on {exit_head.model.device} ({how}; cached in "
            f"{directory})",
            file=sys.stderr,
        )
        profile = cost_profile.measure_profile(
            exit_head, exit_layer, max_tokens, quick=not thorough
        )
        profile.path = str(path)
        _write_profile(path, profile, {vocab: profile.draft_head})
        return profile
    profile, draft_heads = stored
    profile.path = str(path)
    if vocab in draft_heads:
        profile.draft_head = draft_heads[vocab]
    else:
        rounds = QUICK_DRAFT_HEAD_ROUNDS if profile.quick else DRAFT_HEAD_ROUNDS
        profile.draft_head, settled = cost_profile.measure_draft_heads(
            exit_head, exit_layer, rounds
        )
        draft_heads[vocab] = profile.draft_head
        profile.settled = profile.settled and settled  # an unsettled profile stays so
        _write_profile(path, profile, draft_heads)
    return profile


def _parse_profile(path: Path) -> tuple[CostProfile, dict[str, list[float]]] | None:
    """The profile stored at `path` (without draft head timings) and its draft heads' timings
    per vocabulary; None when missing or unreadable."""
    try:
        stored = json.loads(path.read_text())
        draft_heads = dict(stored.pop("draft_heads"))
        return CostProfile(**stored, draft_head=[]), draft_heads
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _read_profile(path: Path, max_tokens: int) -> tuple[CostProfile, dict[str, list[float]]] | None:
    """`_parse_profile`, or None when of another version, older than a week (an hour when not
    settled), or for fewer tokens."""
    stored = _parse_profile(path)
    if stored is None:
        return None
    profile, draft_heads = stored
    age = MEASURED_MAX_AGE_S if profile.settled else UNSETTLED_MAX_AGE_S
    fresh = time.time() - profile.measured_at < age
    if fresh and profile.version == PROFILE_VERSION and len(profile.layer) >= max_tokens:
        return profile, draft_heads
    return None


def _write_profile(path: Path, profile: CostProfile, draft_heads: dict[str, list[float]]) -> None:
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
    _write_profile(Path(path), profile, scaled)


def mark_stale(path: str | Path) -> None:
    """Mark the profile stored at `path` stale (unsettled, measured at time 0), so that the next
    run measures it again (a missing or unreadable file is left alone)."""
    try:
        stored = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return
    text = json.dumps({**stored, "settled": False, "measured_at": 0.0})
    write_atomically(Path(path), lambda scratch: scratch.write_text(text))
