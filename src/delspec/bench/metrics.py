"""Benchmark metrics: per task and method aggregates of the per-prompt records, and losslessness.

Speeds are overall, as in the paper: total new tokens over total wall time around each
generation (prefill included); speedup divides a method's overall speed by `ar`'s over the same
prompts. `speedup_median` is the median of per-prompt speed ratios. Acceptance rate and mean
draft length pool all rounds; eTPL and mean exit layer average the per-prompt values; policy
share is the time spent in the policy between rounds (DEL's shadow tokens) over wall time.
Peers have no delspec statistics: those fields are None for them. Prefill speed is total prompt
tokens over total time of the prompts' forward passes, decode speed total new tokens over the
total time after them; None for a method that does not time them apart (transformers).
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from typing import Any

from delspec.bench.methods import REFERENCE

OVERALL = "overall"


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first position where `tokens` differs from `reference` (a length difference counts
    at the shorter one's end), or None when they are identical."""
    for position, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return position
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def aggregate(
    records: Sequence[dict[str, Any]], methods: Sequence[str], tasks: Sequence[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{task or "overall": {method: metrics}}`` for every task (in order), then overall."""
    groups = {task: [r for r in records if r["task"] == task] for task in tasks}
    groups[OVERALL] = list(records)
    result = {}
    for group, rows in groups.items():
        by_method = {m: [r for r in rows if r["method"] == m] for m in methods}
        reference = _speed(by_method[REFERENCE])
        result[group] = {m: _summary(by_method[m], reference) for m in methods}
    return result


def lossless_summary(records: Sequence[dict[str, Any]], peers: Collection[str]) -> dict[str, Any]:
    """Which outputs differ from `ar`'s: `failures` (delspec methods; they make `ok` False) and
    `peer_mismatches` (peers, whose float rounding may differ), each with the first divergence.
    """
    mismatches = [
        {k: r[k] for k in ("method", "task", "prompt_id", "first_divergence", "new_tokens")}
        for r in records
        if not r["lossless"]
    ]
    failures = [m for m in mismatches if m["method"] not in peers]
    return {
        "ok": not failures,
        "failures": failures,
        "peer_mismatches": [m for m in mismatches if m["method"] in peers],
    }


def _speed(rows: Sequence[dict[str, Any]]) -> float:
    return sum(r["new_tokens"] for r in rows) / sum(r["wall_s"] for r in rows)


def _phase_speed(rows: Sequence[dict[str, Any]], tokens: str, seconds: str) -> float | None:
    times = [r.get(seconds) for r in rows]
    if not rows or any(t is None for t in times) or not sum(times):
        return None
    return round(sum(r[tokens] for r in rows) / sum(times), 3)


def _summary(rows: Sequence[dict[str, Any]], reference_speed: float) -> dict[str, Any]:
    wall = sum(r["wall_s"] for r in rows)
    speed = _speed(rows)
    out: dict[str, Any] = {
        "prompts": len(rows),
        "new_tokens": sum(r["new_tokens"] for r in rows),
        "wall_s": round(wall, 4),
        "tokens_per_s": round(speed, 3),
        "speedup": round(speed / reference_speed, 4),
        "speedup_median": round(statistics.median(r["speedup"] for r in rows), 4),
        "lossless": all(r["lossless"] for r in rows),
        "mismatches": sum(not r["lossless"] for r in rows),
        "prefill_tokens_per_s": _phase_speed(rows, "prompt_tokens", "prefill_s"),
        "decode_tokens_per_s": _phase_speed(rows, "new_tokens", "decode_s"),
    }
    stats = [r["stats"] for r in rows if r["stats"] is not None]
    if len(stats) < len(rows):  # a peer
        return out | dict.fromkeys(
            (
                "etpl",
                "acceptance_rate",
                "mean_exit_layer",
                "mean_draft_length",
                "policy_share",
                "sources",
                "context_acceptance",
                "layer_acceptance",
            )
        )
    return out | _speculation(stats, wall)


def _speculation(stats: Sequence[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Drafting statistics pooled over delspec generations' `stats` (wall: their seconds), with
    the rounds' draft sources: shares of rounds drafting from the context alone, from an exit
    layer alone, from both, and of plain rounds; each source's acceptance."""
    drafted = sum(s["drafted"] for s in stats)
    rounds = sum(s["rounds"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    exits = [s["mean_exit_layer"] for s in stats if s.get("layer_rounds", s["drafted"])]
    pooled = {k: sum(s.get(k, 0) for s in stats) for k in _SOURCE_COUNTS}
    layer_drafted = drafted - pooled["context_drafted"]
    layer_accepted = accepted - pooled["context_accepted"]
    both = pooled["mixed_rounds"]
    shares = {
        "context": pooled["context_rounds"] - both,
        "layer": pooled["layer_rounds"] - both,
        "mixed": both,
        "plain": rounds - pooled["context_rounds"] - pooled["layer_rounds"] + both,
    }
    return {
        "etpl": round(statistics.fmean(s["etpl"] for s in stats), 5),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_exit_layer": round(statistics.fmean(exits), 3) if exits else None,
        "mean_draft_length": round(drafted / rounds, 3) if rounds else 0.0,
        "policy_share": round(sum(s["policy_s"] for s in stats) / wall, 4),
        "sources": {k: round(v / rounds, 4) if rounds else 0.0 for k, v in shares.items()},
        "context_acceptance": _ratio(pooled["context_accepted"], pooled["context_drafted"]),
        "layer_acceptance": _ratio(layer_accepted, layer_drafted),
    }


_SOURCE_COUNTS = (
    "layer_rounds",
    "context_rounds",
    "mixed_rounds",
    "context_drafted",
    "context_accepted",
)


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None
