"""Calibrating exit adapters by self-distillation on the model's own generations.

`calibrate` lets the model continue a set of prompts (by default the built-in
`calibration.prompts.PROMPTS`) and `fit_adapters` runs every sequence once through all layers,
collecting each layer's states. Each exit layer's adapter (see `delspec.drafting.adapters`) is then
fitted to the final layer in two stages:

1. Closed form: the rank-r map A minimising the logit-space squared error
   sum_i |W (n_i + A n_i) - W n_final_i|^2 (W the LM head), i.e. reduced-rank ridge regression
   in the metric W^T W. It costs a few D x D matrix products per layer, no vocabulary-sized work.
2. `steps` Adam steps on the distillation loss: cross-entropy against the final layer's
   next-token distribution truncated to its `TEACHER_TOP` most likely tokens (the KL divergence
   up to a constant), over the student's full vocabulary.

The closed form alone matches many Adam steps from a zero adapter, at a fraction of the time,
and the few Adam steps after it improve on both. Every sixth sequence is held out; per-layer
top-1 agreement with the final layer and the full KL divergence on those, before and after, are
recorded. The final layer's tokens over all sequences give the token-frequency ranking for pruned
draft heads.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from delspec.calibration.prompts import PROMPTS
from delspec.decoding.generate import generate
from delspec.decoding.sampling import Sampling
from delspec.drafting.adapters import ExitAdapters, adapt, fingerprint
from delspec.drafting.draft_vocab import fallback_ranking
from delspec.errors import ConfigError
from delspec.model.transformer import Transformer
from delspec.weights.loading import LoadedModel

Prompt = tuple[str, bool]  # (text, whether to send it through the chat template)
TEACHER_TOP = 64  # final-layer tokens kept per position as the distillation target
HOLDOUT_EVERY = 6  # every sixth sequence is held out for the agreement table
RIDGE = 1e-3  # ridge of the closed form, relative to the mean state energy
EVAL_POSITIONS = 512  # held-out positions scored (evenly spaced): 2 head passes per layer each
_CHUNK = 512  # positions per head evaluation outside training


@dataclass
class LayerReport:
    """Held-out quality of one exit layer: top-1 agreement with the final layer, mean KL."""

    layer: int
    agreement_before: float
    agreement_after: float
    kl_before: float
    kl_after: float


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
    """Prompts from a file: `.jsonl` lines are a JSON string or `{"prompt": ..., "chat": ...}`
    (chat defaults to true), any other file holds one plain-text prompt per non-empty line."""
    path = Path(path)
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise ConfigError(f"cannot read prompts file {path}: {exc}") from exc
    if path.suffix.lower() != ".jsonl":
        return [(line, False) for line in lines]
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc})") from exc
        if isinstance(entry, str):
            prompts.append((entry, True))
        elif isinstance(entry, dict) and isinstance(entry.get("prompt"), str):
            prompts.append((entry["prompt"], bool(entry.get("chat", True))))
        else:
            raise ConfigError(f'{path}:{number}: expected a string or {{"prompt": ...}}')
    return prompts


def calibrate(
    lm: LoadedModel,
    prompts: Sequence[Prompt] | None = None,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    **options: Any,
) -> ExitAdapters:
    """Calibrate exit adapters for `lm` on its continuations of `prompts` (default: built-in).

    The model continues each prompt with `max_new_tokens` tokens (greedy, or sampled at
    `temperature` with seeds from `seed`); `options` go to `fit_adapters` (layers, rank,
    steps, batch_size, lr). Needs at least `HOLDOUT_EVERY` prompts.
    """
    prompts = list(PROMPTS if prompts is None else prompts)
    if len(prompts) < HOLDOUT_EVERY:
        raise ConfigError(f"calibration needs at least {HOLDOUT_EVERY} prompts, got {len(prompts)}")
    start = time.perf_counter()
    sequences = _continuations(lm, prompts, max_new_tokens, temperature, seed, progress)
    generate_s = time.perf_counter() - start
    fallback = fallback_ranking(lm.source, lm.model.config.vocab_size)
    adapters = fit_adapters(
        lm.model, sequences, fallback=fallback, seed=seed, progress=progress, **options
    )
    adapters.calibration = {
        "model": lm.name,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "generate_s": round(generate_s, 1),
        **adapters.calibration,
    }
    return adapters


def fit_adapters(
    model: Transformer,
    sequences: Sequence[Sequence[int]],
    *,
    layers: Sequence[int] | None = None,
    rank: int = 64,
    steps: int = 50,
    batch_size: int = 64,
    lr: float = 3e-4,
    seed: int = 0,
    fallback: Tensor | None = None,
    progress: bool = False,
) -> ExitAdapters:
    """Train adapters for exit `layers` (default: all, 1..L-1) on token `sequences`.

    Every `HOLDOUT_EVERY`-th sequence is held out. Each adapter starts from the closed-form fit
    and gets `steps` Adam steps (0: none) on mini-batches of `batch_size` positions. The
    ranking orders tokens by how often the final layer predicts them, ties in `fallback` order
    (default: token ids). The result's `calibration` holds the settings, the training time, and
    the held-out `LayerReport`s under "layers".
    """
    exit_layers = sorted(set(range(1, model.num_layers) if layers is None else layers))
    _check(model, len(sequences), exit_layers, rank, steps, batch_size)
    vocab_size = model.config.vocab_size
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    weight = model.head_rows().detach().float()
    split: tuple[list, list] = ([], [])  # (training, held out): (sequence, first new position)
    for i, item in enumerate(zip(sequences, _novel_starts(sequences), strict=True)):
        split[i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1].append(item)
    train_set, held_set = (_collect(model, weight, part, exit_layers) for part in split)
    roots = _metric_roots(weight)
    bar = tqdm(exit_layers, desc="fitting adapters", unit="layer", disable=not progress)
    trained = [
        _fit_layer(model, weight, roots, train_set, e, rank, steps, batch_size, lr, generator)
        for e in bar
    ]
    down = torch.stack([d for d, _ in trained])
    up = torch.stack([u for _, u in trained])
    reports = _evaluate(model, weight, held_set, exit_layers, down, up)
    tokens = torch.cat([train_set.teacher_ids[:, 0], held_set.teacher_ids[:, 0]]).cpu()
    counts = torch.bincount(tokens, minlength=vocab_size)
    ranking = _ranking(counts, torch.arange(vocab_size) if fallback is None else fallback)
    identity, probes = fingerprint(model)
    calibration = {
        "sequences": len(sequences),
        "train_positions": len(train_set.teacher_ids),
        "heldout_positions": min(len(held_set.teacher_ids), EVAL_POSITIONS),
        "rank": rank,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "train_s": round(time.perf_counter() - start, 1),
        "layers": [asdict(r) for r in reports],
    }
    return ExitAdapters(exit_layers, down.cpu(), up.cpu(), ranking, identity, probes, calibration)


def _check(
    model: Transformer, sequences: int, layers: list[int], rank: int, steps: int, batch_size: int
) -> None:
    if sequences < HOLDOUT_EVERY:
        raise ConfigError(f"calibration needs at least {HOLDOUT_EVERY} sequences, got {sequences}")
    bad = [e for e in layers if not 1 <= e < model.num_layers]
    if bad:
        raise ConfigError(f"exit layers must be in 1..{model.num_layers - 1}, got {bad}")
    if not 1 <= rank <= model.config.hidden_size:
        raise ConfigError(f"rank must be in 1..{model.config.hidden_size}, got {rank}")
    if steps < 0 or batch_size < 1:
        raise ConfigError(f"need steps >= 0 and batch size >= 1, got {steps}, {batch_size}")


def _continuations(
    lm: LoadedModel,
    prompts: list[Prompt],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    progress: bool,
) -> list[list[int]]:
    """Each prompt's token ids followed by the model's continuation."""
    sequences = []
    for i, (text, chat) in enumerate(tqdm(prompts, desc="generating", disable=not progress)):
        if chat and lm.tokenizer.chat_template:
            template = lm.apply_chat_template([{"role": "user", "content": text}])
            ids = lm.tokenizer.encode(template, add_special_tokens=False)
        else:
            ids = lm.tokenizer.encode(text)
        result = generate(
            lm,
            ids,
            sampling=Sampling(temperature, seed=seed + i),
            max_new_tokens=max_new_tokens,
            strategy="ar",
            adapters=None,  # a stale sidecar must not stop its own recalibration
        )
        sequences.append(ids + result.token_ids)
    return sequences


@dataclass
class _Positions:
    """Training or evaluation data: normalised states per exit layer and final-layer targets."""

    states: dict[int, Tensor]  # exit layer -> norm(h) [positions, hidden], float32
    final: Tensor  # norm(h) of the last layer [positions, hidden], float32
    teacher_probs: Tensor  # [positions, TEACHER_TOP], renormalised
    teacher_ids: Tensor  # [positions, TEACHER_TOP], most likely first


def _novel_starts(sequences: Sequence[Sequence[int]]) -> list[int]:
    """Per sequence, the first position whose prefix no earlier sequence shares.

    States depend only on the prefix, so positions before it (e.g. a chat template's system
    prompt) repeat earlier ones and are left out.
    """
    return [
        max((_common_prefix(sequence, other) for other in sequences[:i]), default=0)
        for i, sequence in enumerate(sequences)
    ]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    pairs = zip(a, b, strict=False)
    return next((k for k, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


@torch.inference_mode()  # as the engine: its KV cache is reused
def _collect(
    model: Transformer,
    weight: Tensor,
    sequences: list[tuple[Sequence[int], int]],
    layers: list[int],
) -> _Positions:
    """Run each `(sequence, start)` once through every layer; keep positions from `start` on."""
    states: dict[int, list[Tensor]] = {e: [] for e in layers}
    final, probs, ids = [], [], []
    for sequence, start in sequences:
        model.setup_cache(len(sequence))
        hidden: list[Tensor] = []
        tokens = torch.tensor(sequence, device=model.device)
        model.run_layers(model.embed(tokens), 0, 0, model.num_layers, hidden)
        for e in layers:
            states[e].append(model.norm(hidden[e - 1][start:]).float())
        n = model.norm(hidden[-1][start:]).float()
        final.append(n)
        top = torch.log_softmax(model.project(n, weight), -1)
        top = top.topk(min(TEACHER_TOP, top.shape[-1]), -1)
        p = top.values.exp()
        probs.append(p / p.sum(-1, keepdim=True))
        ids.append(top.indices)
    return _Positions(
        {e: torch.cat(s) for e, s in states.items()},
        torch.cat(final),
        torch.cat(probs),
        torch.cat(ids),
    )


def _metric_roots(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`(R, R^+)`, float64: the square root of the logit-space metric W^T W and its inverse."""
    metric = (weight.T @ weight).double()
    values, vectors = torch.linalg.eigh(metric)
    roots = values.clamp_min(0).sqrt()
    inverse = torch.where(roots > roots.max() * 1e-8, 1 / roots, torch.zeros_like(roots))
    return (vectors * roots) @ vectors.T, (vectors * inverse) @ vectors.T


def _closed_form(
    states: Tensor, final: Tensor, roots: tuple[Tensor, Tensor], rank: int
) -> tuple[Tensor, Tensor]:
    """Balanced factors `(down, up)` of the rank-`rank` A minimising sum |W(n + A n - f)|^2.

    Reduced-rank ridge regression of the residual f - n on n after whitening by R = (W^T W)^1/2:
    with B the ridge solution of (f - n) R ~ n B, A = R^+ V V^T B^T, V the top right singular
    vectors of the fitted values n B.
    """
    root, root_inv = roots
    x = states.double()
    gram = x.T @ x
    ridge = gram.clone()
    ridge.diagonal().add_(RIDGE * gram.diagonal().mean())
    b = torch.linalg.solve(ridge, x.T @ (final.double() - x)) @ root
    v = torch.linalg.eigh(b.T @ gram @ b).eigenvectors[:, -rank:]
    u, singular, vh = torch.linalg.svd(root_inv @ v @ (v.T @ b.T))
    scale = singular[:rank].sqrt()
    return (scale[:, None] * vh[:rank]).float(), (u[:, :rank] * scale).float()


def _fit_layer(
    model: Transformer,
    weight: Tensor,
    roots: tuple[Tensor, Tensor],
    data: _Positions,
    layer: int,
    rank: int,
    steps: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """One exit layer's adapter `(down [rank, hidden], up [hidden, rank])`, float32."""
    states = data.states[layer]
    device = states.device
    down, up = _closed_form(states, data.final, roots, rank)
    down.requires_grad_(True)
    up.requires_grad_(True)
    optimizer = torch.optim.Adam([down, up], lr=lr)
    batches = _batches(len(states), batch_size, generator)
    for _ in range(steps):
        index = next(batches).to(device)
        n = states[index]
        logits = model.project(adapt(n, down, up), weight)
        target = torch.log_softmax(logits, -1).gather(1, data.teacher_ids[index])
        loss = -(data.teacher_probs[index] * target).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return down.detach(), up.detach()


def _batches(positions: int, batch_size: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Endless mini-batches of position indices: shuffled epochs, without replacement."""
    while True:
        yield from torch.randperm(positions, generator=generator).split(batch_size)


@torch.no_grad()
def _evaluate(
    model: Transformer,
    weight: Tensor,
    data: _Positions,
    layers: list[int],
    down: Tensor,
    up: Tensor,
) -> list[LayerReport]:
    """Top-1 agreement and mean KL(final || exit) per layer, without and with adapters, over
    `EVAL_POSITIONS` evenly spaced positions of `data`."""
    totals = torch.zeros(len(layers), 4, dtype=torch.float64)
    positions = min(len(data.final), EVAL_POSITIONS)
    scored = torch.linspace(0, len(data.final) - 1, positions).long()
    for chunk in scored.split(_CHUNK):
        teacher = torch.log_softmax(model.project(data.final[chunk], weight), -1)
        teacher_probs, target = teacher.exp(), teacher.argmax(-1)
        for row, layer in enumerate(layers):
            n = data.states[layer][chunk]
            for column, state in ((0, n), (1, adapt(n, down[row], up[row]))):
                student = torch.log_softmax(model.project(state, weight), -1)
                agree = (student.argmax(-1) == target).sum()
                kl = (teacher_probs * (teacher - student)).sum()
                totals[row, column] += float(agree)
                totals[row, column + 2] += float(kl)
    totals /= max(positions, 1)
    return [
        LayerReport(layer, *(round(float(v), 4) for v in totals[row]))
        for row, layer in enumerate(layers)
    ]


def _ranking(counts: Tensor, fallback: Tensor) -> Tensor:
    """Token ids by descending count, ties in `fallback` order."""
    order = torch.sort(counts[fallback], descending=True, stable=True).indices
    return fallback[order]
