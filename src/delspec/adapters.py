"""Exit adapters and pruned draft vocabularies: a better early-exit head for drafting.

The adapter of exit layer E is a residual low-rank map on the final-norm-normalised state:
`n = norm(h)`, `n' = n + up_E(down_E(n))`, logits = LM head(`n'`). `DraftHead` applies the
adapters, and optionally keeps only the K most frequent tokens' rows of the LM head, for drafts
and DEL's shadow tokens only: verification always runs the model's own full head, so output is
unchanged (lossless). Adapters and a token-frequency ranking are stored in a safetensors sidecar
with a fingerprint of the model (`save_adapters`); `load_adapters` refuses another model's file.
They are made by `delspec.calibration.calibrate`.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import Tensor

from delspec.cache import cache_dir, write_atomically
from delspec.decode_config import DecodeConfig, default_draft_vocab, default_int8_draft
from delspec.engine import ExitHead
from delspec.errors import ConfigError, ModelFormatError
from delspec.kernels.products import Int8Weight
from delspec.loading import NAMED_MODELS, LoadedModel, named_model_path
from delspec.model import Transformer

FORMAT = "delspec-exit-adapters"
VERSION = "1"
SUFFIX = ".adapters.safetensors"
_PROBE_ROWS = 16  # embedding (and untied LM head) rows kept in the fingerprint
# Relative difference of fingerprint weights still taken as the same model: bfloat16 or float16
# copies of one checkpoint differ by < 0.4%, another checkpoint or quantisation by far more.
_PROBE_TOLERANCE = 1e-2
# Model config fields a file must match, with how a mismatch names them.
_IDENTITY = {
    "family": "architecture",
    "num_layers": "layers",
    "hidden_size": "hidden size",
    "vocab_size": "vocabulary size",
}
_TENSORS = {"layers", "down", "up", "ranking"}


@dataclass
class ExitAdapters:
    """Per-layer exit adapters and a token-frequency ranking, calibrated for one model.

    `down[i]` (`[rank, hidden]`) and `up[i]` (`[hidden, rank]`) form the adapter of exit layer
    `layers[i]` (1..L-1), float32. `ranking` holds every token id, most frequent first.
    `identity` and `probes` fingerprint the model (see `fingerprint`); `calibration` records
    how the adapters were made (JSON-serialisable).
    """

    layers: list[int]
    down: Tensor
    up: Tensor
    ranking: Tensor
    identity: dict[str, str]
    probes: dict[str, Tensor]
    calibration: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.down.shape[1]


def fingerprint(model: Transformer) -> tuple[dict[str, str], dict[str, Tensor]]:
    """What ties adapters to `model`: its shapes, and float32 copies of a few of its weights.

    The weights (final norm, last layer's MLP norm, a spread of embedding and untied LM head
    rows) are compared with a tolerance rather than hashed, so that one sidecar serves every
    dtype the checkpoint is loaded in.
    """
    cfg = model.config
    identity = {key: str(getattr(cfg, key)) for key in _IDENTITY}
    rows = torch.linspace(0, cfg.vocab_size - 1, _PROBE_ROWS).long().to(model.device)
    probes = {
        "final_norm": model.norm.weight,
        "last_layer_norm": model.layers[-1].mlp_norm.weight,
        "embedding": model.embedding_rows(rows),
    }
    if not cfg.tie_embeddings:
        probes["lm_head"] = model.head_rows(rows)
    return identity, {k: v.detach().float().cpu().contiguous() for k, v in probes.items()}


def save_adapters(adapters: ExitAdapters, path: str | os.PathLike) -> Path:
    """Write `adapters` as one safetensors file (created atomically); returns its path."""
    path = Path(path)
    tensors = {
        "layers": torch.tensor(adapters.layers, dtype=torch.long),
        "down": adapters.down,
        "up": adapters.up,
        "ranking": adapters.ranking,
        **{f"probe.{k}": v for k, v in adapters.probes.items()},
    }
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        **adapters.identity,
        "calibration": json.dumps(adapters.calibration),
    }
    contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_atomically(path, lambda scratch: save_file(contiguous, scratch, metadata))
    return path


def load_adapters(path: str | os.PathLike, model: Transformer) -> ExitAdapters:
    """Read an adapters file and check that it was calibrated for `model`.

    Raises `ModelFormatError` for an unreadable file or one made for another model, naming what
    differs.
    """
    path = Path(path)
    try:
        with safe_open(path, "pt") as file:
            metadata = file.metadata() or {}
        tensors = load_file(path)
        calibration = json.loads(metadata.get("calibration", "{}"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ModelFormatError(f"cannot read adapters file {path}: {exc}") from exc
    if metadata.get("format") != FORMAT or not tensors.keys() >= _TENSORS:
        raise ModelFormatError(f"{path} is not a delspec adapters file")
    if metadata.get("version") != VERSION:
        raise ModelFormatError(
            f"{path} has adapters format version {metadata.get('version')}, this delspec reads "
            f"version {VERSION}; recalibrate with `delspec calibrate`"
        )
    identity = {k: metadata.get(k, "?") for k in _IDENTITY}
    probes = {k[len("probe.") :]: v for k, v in tensors.items() if k.startswith("probe.")}
    adapters = ExitAdapters(
        layers=tensors["layers"].tolist(),
        down=tensors["down"],
        up=tensors["up"],
        ranking=tensors["ranking"],
        identity=identity,
        probes=probes,
        calibration=calibration,
    )
    check_model(adapters, model, str(path))
    return adapters


def check_model(adapters: ExitAdapters, model: Transformer, name: str = "the adapters") -> None:
    """Raise `ModelFormatError` naming what differs unless `adapters` were made for `model`."""
    differences = _differences(adapters, model)
    if differences:
        made_for = adapters.calibration.get("model", "another model")
        raise ModelFormatError(
            f"{name} holds exit adapters calibrated for {made_for}, not this model: "
            f"{'; '.join(differences)}. Recalibrate with `delspec calibrate`."
        )


def _differences(adapters: ExitAdapters, model: Transformer) -> list[str]:
    """How the model `adapters` were made for differs from `model` (empty: none)."""
    identity, probes = fingerprint(model)
    found = [
        f"{label} {adapters.identity[key]} (model: {identity[key]})"
        for key, label in _IDENTITY.items()
        if adapters.identity[key] != identity[key]
    ]
    if found:
        return found
    for name, mine in probes.items():
        theirs = adapters.probes.get(name)
        if theirs is None or theirs.shape != mine.shape:
            found.append(f"{name.replace('_', ' ')} weights are missing or of another shape")
            continue
        scale = float(mine.abs().max().clamp_min(1e-6))
        difference = float((theirs - mine).abs().max()) / scale
        if difference > _PROBE_TOLERANCE:
            found.append(
                f"{name.replace('_', ' ')} weights differ (max relative difference "
                f"{difference:.3g})"
            )
    return found


def default_adapters_path(lm: LoadedModel) -> Path:
    """Where `lm`'s adapters are looked for and written by default.

    Next to the model: `<file stem or directory>.adapters.safetensors`; for a named model,
    whose file lives inside a Python package, in the delspec cache (`cache_dir()/adapters`).
    """
    source = Path(lm.source)
    if _is_named_model(source):
        return cache_dir() / "adapters" / (source.stem + SUFFIX)
    if source.is_dir():
        return source.parent / (source.name + SUFFIX)
    return source.with_name(source.stem + SUFFIX)


def _is_named_model(source: Path) -> bool:
    for name in NAMED_MODELS:
        try:
            if named_model_path(name).resolve() == source.resolve():
                return True
        except ModelFormatError:  # not installed
            continue
    return False


def find_adapters(lm: LoadedModel) -> Path | None:
    """`default_adapters_path(lm)` if that file exists."""
    if not Path(lm.source).exists():  # built in memory
        return None
    path = default_adapters_path(lm)
    return path if path.is_file() else None


def fallback_ranking(source: str | os.PathLike, vocab_size: int) -> Tensor:
    """A token ranking without calibration data: tokenizer scores, else token id order.

    A GGUF file's `tokenizer.ggml.scores` (SentencePiece: unigram log-probabilities, or minus
    the merge rank for BPE vocabularies such as Gemma's) rank tokens by descending score, ties
    by id. Otherwise ids are taken in order, which follows the merge order (a frequency proxy)
    for byte-level BPE vocabularies such as SmolLM2's. Model rows beyond the tokenizer come last.
    """
    scores = _gguf_scores(Path(source))
    if scores is None:
        return torch.arange(vocab_size)
    scores = scores[:vocab_size]
    order = torch.from_numpy(np.argsort(-scores, kind="stable")).long()
    return torch.cat([order, torch.arange(len(scores), vocab_size)])


def _gguf_scores(path: Path) -> np.ndarray | None:
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return None
    try:
        field_ = gguf.GGUFReader(path).fields.get("tokenizer.ggml.scores")
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"cannot read the tokenizer scores of {path}: {exc}") from exc
    if field_ is None:
        return None
    scores = np.array([field_.parts[i][0] for i in field_.data], dtype=np.float64)
    return None if np.unique(scores).size < 2 else scores


def top_tokens(ranking: Tensor, k: int) -> Tensor:
    """The `k` highest-ranked token ids, ascending (so that ties break as in the full head)."""
    if not 1 <= k <= len(ranking):
        raise ConfigError(f"draft vocabulary must be in 1..{len(ranking)} tokens, got {k}")
    return ranking[:k].sort().values


def adapt(n: Tensor, down: Tensor, up: Tensor) -> Tensor:
    """An exit adapter on normalised states `n [..., hidden]`: `n + up(down(n))`, with
    `down [rank, hidden]` and `up [hidden, rank]` (or a batch of layers: `n [layers, ..., hidden]`
    with `down [layers, rank, hidden]`, `up [layers, hidden, rank]`)."""
    return n + (n @ down.mT) @ up.mT


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
        # the smallest level each token is in; len(levels) for none
        self.level_of = torch.full((model.config.vocab_size,), len(levels) - full)
        for level, (lo, hi) in enumerate(itertools.pairwise([0, *sizes])):
            self.level_of[ranked[lo:hi].cpu()] = level
        self.context_vocab = context_vocab and bool(pruned)
        self.extras = [model.head_rows(ranked[:0])] * len(levels)  # per level: rows of context
        # tokens outside it
        self.context: set[int] = set()  # the sequence's tokens so far
        self.fresh: set[int] = set()  # those the latest `admit` added
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

    def covered(self, tokens: Tensor) -> Tensor:
        levels = torch.arange(len(self.vocabs))[:, None]
        ranked = self.level_of[tokens.cpu()][None, :] <= levels
        if not self.context_vocab:
            return ranked
        seen = [t in self.context and t not in self.fresh for t in tokens.tolist()]
        return ranked | torch.tensor(seen, dtype=torch.bool)[None, :]

    def for_prompt(self, prompt: list[int]) -> ExitHead:
        if not self.context_vocab:
            return self
        head = copy.copy(self)
        head.vocabs, head.extras, head.context = list(self.vocabs), list(self.extras), set()
        head.admit(prompt)
        head.fresh = set()
        return head

    def admit(self, tokens: list[int]) -> None:
        if not self.context_vocab:
            return
        new = [t for t in dict.fromkeys(tokens) if t not in self.context]
        self.fresh = set(new)
        if not new:
            return
        self.context.update(new)
        ids = torch.tensor(new)
        for level, base in enumerate(self.base_vocabs):
            outside = ids[self.level_of[ids] > level].to(self.model.device)
            if base is None or not len(outside):
                continue
            self.vocabs[level] = torch.cat([self.vocabs[level], outside])
            rows = self.model.head_rows(outside)
            self.extras[level] = torch.cat([self.extras[level], rows])

    def _stacked(self, exit_layers: list[int]) -> tuple[Tensor, Tensor]:
        """The listed layers' adapters (`down`, `up`), stacked for a layer batch."""
        if self._stack is None or self._stack[0] != exit_layers:
            index = torch.tensor(exit_layers, device=self.down.device)
            self._stack = (list(exit_layers), self.down[index], self.up[index])
        return self._stack[1], self._stack[2]


def draft_head(lm: LoadedModel, config: DecodeConfig) -> ExitHead:
    """The exit head `config` drafts with (`config.draft`, see `DraftConfig`).

    Adapters "auto" are the model's sidecar file if there is one (see `default_adapters_path`).
    A draft vocabulary of K keeps the K highest-ranked tokens (the adapters file's ranking, else
    `fallback_ranking`), plus each sequence's own tokens with `context_vocab`; a list of sizes
    gives one draft vocabulary per size, for a cost-aware policy to choose from per round.
    "auto" draft vocabularies and int8 drafts are what `config.strategy` drafts with by default
    (`default_draft_vocab`, `default_int8_draft`). Without adapters or a draft vocabulary, the
    plain `ExitHead`. Heads built from files are cached (keyed by the file's path, size and
    modification time).
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
    adapters, context_vocab = draft.adapters, draft.context_vocab
    if isinstance(adapters, ExitAdapters):
        check_model(adapters, lm.model)
        return DraftHead(lm.model, adapters, _levels(adapters.ranking, sizes), context_vocab, int8)
    path = None
    if adapters == "auto":
        path = find_adapters(lm)
    elif adapters is not None:
        path = Path(adapters)
    if path is None and sizes is None:
        return ExitHead(lm.model, int8)
    stamp = None
    if path is not None:
        try:
            stat = path.stat()
        except OSError as exc:
            raise ModelFormatError(f"cannot read adapters file {path}: {exc}") from exc
        stamp = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    return _cached_head(lm.model, lm.source, stamp, sizes, context_vocab, int8)


def vocabulary_sizes(
    draft_vocab: int | Sequence[int | None] | None, vocab_size: int
) -> tuple[int | None, ...] | None:
    """`draft_vocab` as ascending draft vocabulary sizes, None (last) for the full vocabulary;
    None when nothing is pruned. Raises `ConfigError` for a size outside 1..`vocab_size`."""
    if draft_vocab is None:
        return None
    if isinstance(draft_vocab, str):
        raise ConfigError(f"draft vocabulary: expected sizes or 'auto', got {draft_vocab!r}")
    listed = [draft_vocab] if isinstance(draft_vocab, int) else list(draft_vocab)
    for k in listed:
        if k is not None and not 1 <= k <= vocab_size:
            raise ConfigError(f"draft vocabulary must be in 1..{vocab_size} tokens, got {k}")
    if len(listed) == 1:  # one size: that many rows, even all of them
        return tuple(listed) if listed[0] is not None else None
    pruned = sorted({k for k in listed if k is not None and k < vocab_size})
    full = any(k is None or k == vocab_size for k in listed)
    return (*pruned, *[None] * full) if pruned else None


def _levels(ranking: Tensor, sizes: tuple[int | None, ...] | None) -> list[Tensor | None] | None:
    """The draft vocabularies of `sizes` (see `vocabulary_sizes`): top-ranked tokens, or None."""
    if sizes is None:
        return None
    return [None if k is None else top_tokens(ranking, k) for k in sizes]


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
        vocab = _levels(ranking, sizes)
    return DraftHead(model, adapters, vocab, context_vocab, int8)
