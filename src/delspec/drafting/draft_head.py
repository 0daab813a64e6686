"""The draft head: an exit head with exit adapters and/or pruned draft vocabularies.

`draft_spec` checks what a `DecodeConfig` drafts with against a model, `build_draft_head` builds
that head (`draft_head`: both). Only drafts and DEL's shadow tokens
go through it: verification always runs the model's own full head, so output is unchanged
(lossless).
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from delspec.decode_config import DecodeConfig, default_draft_vocab
from delspec.drafting.adapters import ExitAdapters, adapt, check_model, find_adapters, load_adapters
from delspec.drafting.draft_vocab import draft_vocabularies, fallback_ranking, vocabulary_sizes
from delspec.drafting.exit_head import ExitHead, int8_drafts
from delspec.errors import ConfigError, ModelFormatError
from delspec.kernels.products import Int8Weight, int8_supported
from delspec.model.transformer import Transformer
from delspec.weights.loading import LoadedModel


class DraftHead(ExitHead):
    """An exit head with per-layer adapters and/or pruned draft vocabularies.

    `vocab` is one pruned vocabulary (token ids), or a list of nested ones, smallest first, in
    which None stands for the full vocabulary: each is a level a round may draft with
    (`ExitHead.vocabs`; a cost-aware policy picks one). Only drafts and shadow tokens go through
    this head (shadow tokens over the smallest level): the engine verifies with `model.head`,
    the full unadapted head. Layers without an adapter use the plain final norm + head. With
    pruned vocabularies and `context_vocab`, each sequence's head (`for_prompt`) also drafts the
    tokens of its prompt and reply so far (prompts are often copied from: names, numbers, code).
    """

    def __init__(
        self,
        model: Transformer,
        adapters: ExitAdapters | None = None,
        vocab: Tensor | Sequence[Tensor | None] | None = None,
        context_vocab: bool = True,
        int8: bool = False,
    ) -> None:
        levels = [vocab] if vocab is None or isinstance(vocab, Tensor) else list(vocab)
        if not levels or None in levels[:-1]:
            raise ConfigError("draft vocabularies: only the last (largest) may be the full one")
        full = levels[-1] is None
        super().__init__(model, int8, full)
        device, dtype = model.device, model.dtype
        pruned = [v.to(device) for v in levels if v is not None]
        # The pruned levels' tokens, level by level, so that every level is a prefix of `order`.
        order: dict[int, None] = {}
        for v in pruned:
            ids = dict.fromkeys(v.tolist())
            if not ids.keys() >= order.keys():
                raise ConfigError("each draft vocabulary must contain the smaller ones")
            order.update(ids)
        ranked = torch.tensor(list(order), dtype=torch.long, device=device)
        sizes = [len(v) for v in pruned]
        rows = model.head_weight[ranked]
        drafts = Int8Weight(rows) if self.int8 and sizes else rows
        self.draft_weights = [drafts[:k] for k in sizes] + [None] * full
        self.base_vocabs: list[Tensor | None] = [ranked[:k] for k in sizes] + [None] * full
        self.vocabs = list(self.base_vocabs)
        # per token id, the smallest level it is in (len(levels) for none), as bytes: `held` and
        # `_join_pending` look a few ids up in plain Python
        level_of = np.full(model.config.vocab_size, len(levels) - full, dtype=np.uint8)
        for level, (lo, hi) in enumerate(itertools.pairwise([0, *sizes])):
            level_of[ranked[lo:hi].cpu().numpy()] = level
        self.level_of = level_of.tobytes()
        self.context_vocab = context_vocab and bool(pruned)
        self._pending: list[int] = []  # admitted tokens not yet in the vocabularies
        self.extras = [model.head_rows(ranked[:0])] * len(levels)
        # the sequence's tokens so far, each with the `admit` (counted in `admissions`) that
        # added it
        self.context: dict[int, int] = {}
        self.adapted: frozenset[int] = frozenset()
        if adapters is not None and adapters.layers:
            num_layers, rank, hidden = model.num_layers, adapters.rank, model.config.hidden_size
            layers = num_layers + 1  # indexed by exit layer, 1..L
            self.down = torch.zeros(layers, rank, hidden, dtype=dtype, device=device)
            self.up = torch.zeros(layers, hidden, rank, dtype=dtype, device=device)
            index = torch.tensor(adapters.layers, device=device)
            self.down[index] = adapters.down.to(device, dtype)
            self.up[index] = adapters.up.to(device, dtype)
            self.adapted = frozenset(adapters.layers)
        self._stack: tuple[list[int], Tensor, Tensor] | None = None

    def __call__(self, h: Tensor, exit_layer: int, level: int = 0) -> Tensor:
        n = self.model.norm(h)
        if exit_layer in self.adapted:
            n = adapt(n, self.down[exit_layer], self.up[exit_layer])
        return self._project(n, self.draft_weights[level], self.extras[level], self.int8)

    def exit_states(self, hidden: Tensor, exit_layers: list[int]) -> Tensor:
        n = self.model.norm(hidden)
        if self.adapted.intersection(exit_layers):
            n = adapt(n, *self._stacked(exit_layers))
        return n

    def shadow(self, hidden: Tensor, exit_layers: list[int]) -> Tensor:
        # The smallest level's draft rows (int8 ones with int8 drafts: a quarter of the reads);
        # without pruning, the model's own exact head.
        states = self.exit_states(hidden, exit_layers)
        return self._project(states, self.draft_weights[0], self.extras[0])

    def _adapts(self, exit_layer: int) -> bool:
        return exit_layer in self.adapted

    @property
    def vocab_sizes(self) -> list[int]:
        full = self.model.config.vocab_size
        return [full if v is None else len(v) for v in self.base_vocabs]

    def _project(
        self, n: Tensor, weight: Tensor | Int8Weight | None, extra: Tensor, int8: bool = False
    ) -> Tensor:
        logits = self.model.project(n, weight, int8)
        if not len(extra):
            return logits
        return torch.cat([logits, self.model.project(n, extra)], -1)

    def held(self, tokens: list[int], admission: int | None = None) -> list[list[bool]]:
        level_of = self.level_of
        ranks = [level_of[t] for t in tokens]
        if self.context_vocab:  # in the sequence before that `admit`: every level has it
            latest, context = self.admissions if admission is None else admission, self.context
            ranks = [
                0 if context.get(t, latest) < latest else r
                for t, r in zip(tokens, ranks, strict=True)
            ]
        return [[r <= level for r in ranks] for level in range(len(self.base_vocabs))]

    def for_prompt(self, prompt: list[int]) -> ExitHead:
        if not self.context_vocab:
            return self
        head = copy.copy(self)
        head.vocabs, head.extras, head.context = list(self.vocabs), list(self.extras), {}
        head._pending, head.admissions = [], 0
        head.admit(prompt)
        head.admissions += 1  # the prompt's `admit` is not the latest: every level has it
        return head

    def admit(self, tokens: list[int]) -> None:
        """Note `tokens`' new ones; they join the vocabularies (and their head rows) when a draft
        or shadow token next needs them (most rounds of a model whose layers rarely draft need
        none: `held` answers from the sequence's tokens)."""
        if not self.context_vocab:
            return
        self.admissions += 1
        new = [t for t in dict.fromkeys(tokens) if t not in self.context]
        self.context.update(dict.fromkeys(new, self.admissions))
        self._pending += new

    @property
    def vocabs(self) -> list[Tensor | None]:
        self._join_pending()
        return self._vocabs

    @vocabs.setter
    def vocabs(self, value: list[Tensor | None]) -> None:
        self._vocabs = value

    @property
    def extras(self) -> list[Tensor]:
        """Per level: the LM head rows of the context tokens outside it (in `vocabs`' order)."""
        self._join_pending()
        return self._extras

    @extras.setter
    def extras(self, value: list[Tensor]) -> None:
        self._extras = value

    def _join_pending(self) -> None:
        """Add the admitted tokens not yet in the vocabularies (and their head rows): per pruned
        level, those outside it, in the order admitted."""
        if not self._pending:
            return
        pending, self._pending, level_of = self._pending, [], self.level_of
        for level, base in enumerate(self.base_vocabs):
            ids = [t for t in pending if level_of[t] > level]
            if base is None or not ids:
                continue
            outside = torch.tensor(ids, dtype=torch.long, device=self.model.device)
            self._vocabs[level] = torch.cat([self._vocabs[level], outside])
            self._extras[level] = torch.cat([self._extras[level], self.model.head_rows(outside)])

    def _stacked(self, exit_layers: list[int]) -> tuple[Tensor, Tensor]:
        """The listed layers' adapters (`down`, `up`), stacked for a layer batch."""
        if self._stack is None or self._stack[0] != exit_layers:
            index = torch.tensor(exit_layers, device=self.down.device)
            self._stack = (list(exit_layers), self.down[index], self.up[index])
        return self._stack[1], self._stack[2]


def default_int8_draft(strategy: str, device: torch.device) -> bool:
    """Whether `int8_draft="auto"` drafts on int8 weights: for `del-fast`, whose cost model
    weighs the cheaper drafts against verifying every layer again, where the device runs them."""
    return strategy == "del-fast" and int8_supported(device)


@dataclass(frozen=True)
class DraftSpec:
    """What a draft head is built from, checked against its model (`draft_spec`)."""

    adapters: ExitAdapters | None  # adapters given as an object
    stamp: tuple[str, int, int] | None  # an adapters file: its resolved path, size, mtime
    sizes: tuple[int | None, ...] | None  # draft vocabulary sizes (`vocabulary_sizes`)
    context_vocab: bool
    int8: bool


def draft_spec(lm: LoadedModel, config: DecodeConfig) -> DraftSpec:
    """What `config.draft` (see `DraftConfig`) drafts with on `lm`, checked: `ConfigError` for a
    draft vocabulary outside the model's or int8 drafts the device cannot run,
    `ModelFormatError` for adapters made for another model or a file that cannot be read.

    Adapters "auto" are the model's sidecar file if there is one (see `default_adapters_path`).
    "auto" draft vocabularies and int8 drafts are what `config.strategy` drafts with by default
    (`default_draft_vocab`, `default_int8_draft`).
    """
    draft, strategy = config.draft, config.strategy
    vocab_size = lm.model.config.vocab_size
    draft_vocab = draft.draft_vocab
    if draft_vocab == "auto":
        draft_vocab = default_draft_vocab(strategy, vocab_size)
    sizes = vocabulary_sizes(draft_vocab, vocab_size)
    int8 = draft.int8_draft
    if int8 == "auto":
        int8 = default_int8_draft(strategy, lm.model.device)
    int8 = int8_drafts(lm.model, bool(int8))
    adapters = draft.adapters
    if isinstance(adapters, ExitAdapters):
        check_model(adapters, lm.model)
        return DraftSpec(adapters, None, sizes, draft.context_vocab, int8)
    path = None
    if adapters == "auto":
        path = find_adapters(lm)
    elif adapters is not None:
        path = Path(adapters)
    stamp = None
    if path is not None:
        try:
            stat = path.stat()
        except OSError as exc:
            raise ModelFormatError(f"cannot read adapters file {path}: {exc}") from exc
        stamp = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    return DraftSpec(None, stamp, sizes, draft.context_vocab, int8)


def build_draft_head(lm: LoadedModel, spec: DraftSpec) -> ExitHead:
    """The exit head of `spec`. A draft vocabulary of K keeps the K highest-ranked tokens (the
    adapters' ranking, else `fallback_ranking`), plus each sequence's own tokens with
    `context_vocab`; several sizes give one draft vocabulary per size, for a cost-aware policy
    to choose from per round. Without adapters or a draft vocabulary, the plain `ExitHead`.
    Heads built from files are cached (keyed by the file's path, size and modification time).
    """
    adapters, sizes = spec.adapters, spec.sizes
    if adapters is not None:
        vocab = draft_vocabularies(adapters.ranking, sizes)
        return DraftHead(lm.model, adapters, vocab, spec.context_vocab, spec.int8)
    if spec.stamp is None and sizes is None:
        return ExitHead(lm.model, spec.int8)
    return _cached_head(lm.model, lm.source, spec.stamp, sizes, spec.context_vocab, spec.int8)


def draft_head(lm: LoadedModel, config: DecodeConfig) -> ExitHead:
    """The exit head `config` drafts with on `lm` (`draft_spec`, then `build_draft_head`)."""
    return build_draft_head(lm, draft_spec(lm, config))


@functools.lru_cache(maxsize=4)  # holds up to four models alive
def _cached_head(
    model: Transformer,
    source: str,
    stamp: tuple[str, int, int] | None,
    sizes: tuple[int | None, ...] | None,
    context_vocab: bool,
    int8: bool,
) -> DraftHead:
    adapters = None if stamp is None else load_adapters(stamp[0], model)
    vocab = None
    if sizes is not None:
        if adapters is not None:
            ranking = adapters.ranking
        else:
            ranking = fallback_ranking(source, model.config.vocab_size)
        vocab = draft_vocabularies(ranking, sizes)
    return DraftHead(model, adapters, vocab, context_vocab, int8)
