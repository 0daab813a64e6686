"""`MachineProfile`: everything measured on this machine for one loaded model, under one key.

A loaded model has one (`LoadedModel.machine`), made at load with the thread count the model
runs with. It chooses the product kernels (measured once per key, kept on disk), and on first
need measures or reads the decode cost profile of an exit head's setting, a batched step's
seconds per batch size and the attention span (the last two held for the process). Every
measurement is keyed by `key`: the CPU, torch, the thread count, the model's shape, device,
dtype and weight format and the kernels' build. Only `store` reads or writes the disk.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from delspec.cache import cache_dir
from delspec.machine import batching, cost_profile, kernel_choice, store
from delspec.machine.cost_profile import (
    DRAFT_HEAD_ROUNDS,
    QUICK_DRAFT_HEAD_ROUNDS,
    QUICK_PROFILE_STEPS,
    CostProfile,
    ExitHeadLike,
    profile_key,
)
from delspec.machine.timing import measurement_key
from delspec.model.transformer import Transformer


class MachineProfile:
    """What this machine measured for `model` with `threads` threads (None: the thread count
    torch runs with now), kept under cache root `root` (None: `cache_dir()`)."""

    def __init__(
        self, model: Transformer, threads: int | None = None, root: Path | None = None
    ) -> None:
        self.model = model
        self.threads = threads or torch.get_num_threads()
        self.root = root
        # cost profiles read or measured in this process, by file and draft head vocabulary
        self.profiles: dict[tuple[Path, str], CostProfile] = {}

    @property
    def directory(self) -> Path:
        """The cache root measurements are kept under."""
        return self.root or cache_dir()

    def key(self, *extra: str) -> str:
        """The key of a measurement of the model on this machine (`measurement_key`), set apart
        by `extra`."""
        return measurement_key(self.model, self.threads, *extra)

    def choose_kernels(self) -> None:
        """Give the model this machine's kernel choices, measured on first use (CPU only:
        elsewhere every product keeps its default kernel)."""
        if self.model.device.type != "cpu":
            return
        path = store.choices_path(self.directory, self.key())
        stored = store.read_choices(path)
        if stored is None or set(stored["choices"]) != set(kernel_choice.layer_groups(self.model)):
            print(
                f"delspec: timing product kernels on this CPU (once; cached in {path.parent})",
                file=sys.stderr,
                flush=True,
            )
            stored = kernel_choice.measure_kernels(self.model)
            store.write_choices(path, stored)
        kernel_choice.apply_kernels(self.model, stored)

    def cost_profile(
        self,
        exit_head: ExitHeadLike,
        exit_layer: int,
        max_tokens: int,
        thorough: bool = False,
        budget: int | None = None,
    ) -> CostProfile | None:
        """The decode cost profile of drafts through `exit_head` (at exit layer `exit_layer`,
        for verifications of up to `max_tokens` rows): the one read or measured before in this
        process, else the stored one, measured again when missing, older than a week (an hour
        when not `CostProfile.settled`), measured for fewer tokens, or quick where a `thorough`
        one is asked for. Measured quick unless `thorough`; not measured (None) for a run of at
        most `budget` new tokens when that is under `QUICK_PROFILE_STEPS`, until such runs'
        budgets together reach it (`store.count_unprofiled`): then that run measures it, the
        time repaid by the tokens they were allowed, so that runs that are all short still get
        one. Draft head timings are kept per vocabulary (`ExitHead.vocab_sizes`) in the same
        file; a new one is measured and added."""
        key = profile_key(exit_head, self.threads)
        path = store.profile_path(self.directory, key)
        vocab = ",".join(map(str, exit_head.vocab_sizes))
        known = self.profiles.get((path, vocab))
        if known is not None and len(known.layer) >= max_tokens and not (thorough and known.quick):
            return known
        stored = store.read_profile(path, max_tokens)
        if stored is not None and thorough and stored[0].quick:
            stored = None
        if stored is None:
            short = not thorough and budget is not None and budget < QUICK_PROFILE_STEPS
            if short and store.count_unprofiled(path, budget) < QUICK_PROFILE_STEPS:
                return None
            profile = self._measure_profile(exit_head, exit_layer, max_tokens, thorough)
            profile.path = str(path)
            store.write_profile(path, profile, {vocab: profile.draft_head})
            store.clear_unprofiled(path)
        else:
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
                store.write_profile(path, profile, draft_heads)
        profile.key = key
        self.profiles[path, vocab] = profile
        return profile

    def _measure_profile(
        self, exit_head: ExitHeadLike, exit_layer: int, max_tokens: int, thorough: bool
    ) -> CostProfile:
        """`cost_profile.measure_profile`, saying so first."""
        how = "thoroughly, once" if thorough else "quickly; `delspec serve` measures thoroughly"
        where = self.directory / "costs"
        device = self.model.device
        print(
            f"delspec: measuring decode costs on {device} ({how}; cached in {where})",
            file=sys.stderr,
        )
        return cost_profile.measure_profile(exit_head, exit_layer, max_tokens, quick=not thorough)

    @functools.cached_property
    def batch_seconds(self) -> dict[int, float]:
        """A batched step's seconds per batch size (`batching.measured_batch_seconds`),
        measured on first use."""
        return batching.measured_batch_seconds(self.model)

    @functools.cached_property
    def attention_span(self) -> float:
        """The position at which a prompt row costs twice one at position 0
        (`batching.measured_attention_span`), measured on first use."""
        return batching.measured_attention_span(self.model)
