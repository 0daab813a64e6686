"""Cost models for choosing the exit layer and draft length: what one round costs.

`LayerCost` is the paper's (layer loads). `MeasuredCost` uses seconds measured on the actual
device, dtype and thread count (`measure_profile`), cached per model and setting.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from delspec.cache import write_atomically
from delspec.engine import ExitHead
from delspec.kernels.build import build_key, cpu_name
from delspec.timing import median_seconds

PROFILE_MAX_AGE_S = 7 * 24 * 3600
PROFILE_VERSION = 8


class LayerCost:
    """The paper's cost: layer loads per round, d*l (drafting) + L (verification)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def grid(
        self, exit_layers: Tensor, draft_lengths: Tensor, levels: Tensor | None = None
    ) -> Tensor:
        """`[exit layers, draft lengths]` cost of one round (d = 0 is a plain step); layer loads
        do not depend on the draft vocabulary `levels`."""
        d = draft_lengths[None, :].double()
        return d * exit_layers[:, None].double() + self.num_layers


@dataclass
class CostProfile:
    """Seconds measured for this model on one device/dtype/thread setting.

    `layer[k - 1]`: k new tokens through one layer (after a context); `head[k - 1]`: k rows
    through the full LM head; `draft_layer`: one token through one layer as drafts run it (on
    int8 weights when `int8`); `draft_head[v]`: one row through the draft head's vocabulary
    level v (`ExitHead.vocabs`), for the head the profile was loaded for.
    """

    layer: list[float]
    head: list[float]
    draft_layer: float
    draft_head: list[float]
    int8: bool
    key: str
    measured_at: float
    version: int = PROFILE_VERSION


class MeasuredCost:
    """Round cost in seconds from a `CostProfile`, plus a per-round policy overhead.

    Drafting d tokens with exit layer l and vocabulary level v costs
    d * (l * draft_layer + draft_head[v]). Verification
    runs the last draft token through layers [0, l) and d + 1 positions through [l, L) and the
    full head; after int8 drafts, d + 1 positions through every layer and the full head. d = 0
    is a plain step: L * layer(1) + head(1).

    A round that first drafts c context tokens (free to make) verifies c + d + 1 positions; with
    layer drafts after them, drafting runs the input and the c tokens through [0, l) in one pass
    and d - 1 more tokens one at a time. With d = 0 it is every layer over c + 1 positions.
    """

    def __init__(self, profile: CostProfile, num_layers: int) -> None:
        self.profile = profile
        self.num_layers = num_layers
        self.overhead = 0.0  # seconds of policy work per round, updated by the policy

    def grid(
        self,
        exit_layers: Tensor,
        draft_lengths: Tensor,
        levels: Tensor | None = None,
        context: int = 0,
    ) -> Tensor:
        """`[rows, draft lengths]` seconds of one round drafting `context` context tokens, then
        d (the draft length) from layer `exit_layers[i]` with vocabulary level `levels[i]`
        (default 0) in row i."""
        p = self.profile
        levels = torch.zeros_like(exit_layers) if levels is None else levels
        layer = torch.tensor(p.layer, dtype=torch.float64)
        head = torch.tensor(p.head, dtype=torch.float64)
        k = (draft_lengths + context + 1).clamp(max=len(p.layer)) - 1  # index of rows verified
        e = exit_layers[:, None].double()
        d = draft_lengths[None, :].double()
        head_s = torch.tensor(p.draft_head, dtype=torch.float64)[levels][:, None]
        if context:  # one pass over the input and the context tokens, then d - 1 tokens
            first = layer[min(context, len(p.layer) - 1)]
            draft = torch.where(d > 0, e * first + (d - 1) * e * p.draft_layer + d * head_s, 0.0)
        else:
            draft = d * (e * p.draft_layer + head_s)
        every_layer = self.num_layers * layer[k][None, :] + head[k][None, :]
        if p.int8:  # every layer again over every position
            verify = every_layer
        else:
            verify = e * layer[0] + (self.num_layers - e) * layer[k][None, :] + head[k][None, :]
            verify = torch.where(d > 0, verify, every_layer)  # no layer draft: every layer
        return draft + verify + self.overhead

    def plain_seconds(self, rows: int) -> float:
        """Seconds of a round running `rows` positions through every layer and the full head:
        a plain step (1), or a context draft of `rows - 1` tokens and its verification."""
        p = self.profile
        k = min(rows, len(p.layer)) - 1
        return self.num_layers * p.layer[k] + p.head[k] + self.overhead


def profile_key(exit_head: ExitHead) -> str:
    """Identifies the setting a profile's model timings were measured for: model shape, device
    (and the CPU), dtype, weight format, threads, the compiled kernels' build, and whether drafts
    run on int8 weights (not the draft head's vocabulary: its timings are kept per vocabulary
    within the profile)."""
    model = exit_head.model
    parts = [
        repr(model.config),
        str(model.device),
        cpu_name(),
        str(model.dtype),
        model.weights,
        str(torch.get_num_threads()),
        torch.__version__,
        build_key(),
        "int8" if exit_head.int8 else "exact",
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def measure_profile(
    exit_head: ExitHead,
    exit_layer: int,
    max_tokens: int,
    context: int = 128,
    repeats: int = 5,
) -> CostProfile:
    """Time the primitives a round is made of, for 1..max_tokens new tokens; drafts through
    `exit_head` as exit layer `exit_layer`."""
    model = exit_head.model
    cfg, int8 = model.config, exit_head.int8
    total = min(cfg.max_position, context + max_tokens + 1)
    context = total - max_tokens - 1
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (context + max_tokens,), generator=gen)
    ids = ids.to(model.device)
    with model.scratch_cache(total), torch.inference_mode():
        model.run_layers(model.embed(ids[:context]), 0, 0, cfg.num_layers)
        states = model.embed(ids[context:])

        def seconds(fn: Callable[[], object]) -> float:
            return median_seconds(fn, repeats, model.device)

        layers, heads = [], []
        for k in range(1, max_tokens + 1):
            h = states[:k]
            layers.append(seconds(lambda h=h: model.run_layers(h, context, 0, cfg.num_layers)))
            heads.append(seconds(lambda h=h: model.head(h)))
        one = states[:1]
        layers_as_drafted = seconds(
            lambda: model.run_layers(one, context, 0, cfg.num_layers, None, int8)
        )
    return CostProfile(
        layer=[t / cfg.num_layers for t in layers],
        head=heads,
        draft_layer=layers_as_drafted / cfg.num_layers,
        draft_head=measure_draft_heads(exit_head, exit_layer, repeats),
        int8=int8,
        key=profile_key(exit_head),
        measured_at=time.time(),
    )


def measure_draft_heads(exit_head: ExitHead, exit_layer: int, repeats: int = 5) -> list[float]:
    """Seconds of one draft row through each of `exit_head`'s vocabulary levels."""
    model = exit_head.model
    with torch.inference_mode():
        one = model.embed(torch.zeros(1, dtype=torch.long, device=model.device))
        return [
            median_seconds(lambda v=v: exit_head(one, exit_layer, v), repeats, model.device)
            for v in range(len(exit_head.vocabs))
        ]


def cached_profile(
    exit_head: ExitHead, exit_layer: int, max_tokens: int, directory: Path
) -> CostProfile:
    """The profile for this model and setting from `directory`, measured again when missing,
    older than a week, or measured for fewer tokens. Draft head timings are stored per
    vocabulary (`ExitHead.vocab_sizes`) in the same file; a new one is measured and added."""
    path = directory / f"profile-{profile_key(exit_head)}.json"
    vocab = ",".join(map(str, exit_head.vocab_sizes))
    stored = _read_profile(path, max_tokens)
    if stored is None:
        print(
            f"delspec: measuring decode costs on {exit_head.model.device} (once; cached in "
            f"{directory})",
            file=sys.stderr,
        )
        profile = measure_profile(exit_head, exit_layer, max_tokens)
        _write_profile(path, profile, {vocab: profile.draft_head})
        return profile
    profile, draft_heads = stored
    if vocab in draft_heads:
        profile.draft_head = draft_heads[vocab]
    else:
        profile.draft_head = draft_heads[vocab] = measure_draft_heads(exit_head, exit_layer)
        _write_profile(path, profile, draft_heads)
    return profile


def _read_profile(path: Path, max_tokens: int) -> tuple[CostProfile, dict[str, list[float]]] | None:
    """A stored profile (without draft head timings) and its draft heads' timings; None when
    missing, unreadable, of another version, older than a week, or for fewer tokens."""
    try:
        stored = json.loads(path.read_text())
        draft_heads = dict(stored.pop("draft_heads"))
        profile = CostProfile(**stored, draft_head=[])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    fresh = time.time() - profile.measured_at < PROFILE_MAX_AGE_S
    if fresh and profile.version == PROFILE_VERSION and len(profile.layer) >= max_tokens:
        return profile, draft_heads
    return None


def _write_profile(path: Path, profile: CostProfile, draft_heads: dict[str, list[float]]) -> None:
    """Write `profile`'s model timings and `draft_heads` (per vocabulary) atomically."""
    stored = {k: v for k, v in asdict(profile).items() if k != "draft_head"}
    text = json.dumps({**stored, "draft_heads": draft_heads})
    write_atomically(path, lambda scratch: scratch.write_text(text))
