"""Exit adapters: what an adapter computes, its sidecar file, and finding that file.

The adapter of exit layer E is a residual low-rank map on the final-norm-normalised state:
`n = norm(h)`, `n' = n + up_E(down_E(n))`, logits = LM head(`n'`) (`adapt`). Adapters and a
token-frequency ranking are stored in a safetensors sidecar with a fingerprint of the model
(`save_adapters`); `load_adapters` refuses another model's file. `default_adapters_path` says
where a model's sidecar lives. They are made by `delspec.calibration.calibrate.calibrate` and
drafted with by `delspec.drafting.draft_head.DraftHead`.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import Tensor

from delspec.cache import cache_dir, write_atomically
from delspec.errors import ModelFormatError
from delspec.model.transformer import Transformer
from delspec.weights.loading import LoadedModel
from delspec.weights.named_models import named_model_of

FORMAT = "delspec-exit-adapters"
VERSION = "1"
SUFFIX = ".adapters.safetensors"
_PROBE_ROWS = 16  # embedding (and untied LM head) rows kept in the fingerprint
# Relative difference of fingerprint weights still taken as the same model: bfloat16 or float16
# copies of one checkpoint differ by far less, another checkpoint or quantisation by far more.
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


@functools.cache
def _is_named_model(source: Path) -> bool:
    """Whether `source` is a named model's file (cached: a draft head asks every generation)."""
    return named_model_of(source) is not None


def find_adapters(lm: LoadedModel) -> Path | None:
    """`default_adapters_path(lm)` if that file exists."""
    if not Path(lm.source).exists():  # built in memory
        return None
    path = default_adapters_path(lm)
    return path if path.is_file() else None


def adapt(n: Tensor, down: Tensor, up: Tensor) -> Tensor:
    """An exit adapter on normalised states `n [..., hidden]`: `n + up(down(n))`, with
    `down [rank, hidden]` and `up [hidden, rank]` (or a batch of layers: `n [layers, ..., hidden]`
    with `down [layers, rank, hidden]`, `up [layers, hidden, rank]`)."""
    return n + (n @ down.mT) @ up.mT
