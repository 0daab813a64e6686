"""Loading a model and its tokenizer from a named model, a GGUF file or a Hugging Face directory.

A GGUF file is read in place (`gguf_file`): its config and tokenizer come from its metadata
(cached once, they are small, and read back without transformers: `tokenizer`), its tensors from
the file one at a time, in the `native` weight format as the file's own blocks. Hugging Face
directories are read tensor by tensor too (`tensor_sources`). Named models are files inside pip
packages (`named_models`). Every problem with a model source is reported as a `ModelFormatError`
naming it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import torch

from delspec.errors import LIBRARY_ERRORS, ConfigError, DelspecError, ModelFormatError
from delspec.machine.profile import MachineProfile
from delspec.model.architectures import config_from_hf, token_ids
from delspec.model.transformer import Transformer
from delspec.weights.checkpoint import build_model
from delspec.weights.gguf_file import GGUFFile, block_count
from delspec.weights.named_models import NAMED_MODELS, default_model_path, named_model_path
from delspec.weights.tensor_sources import SafetensorsSource, TensorSource, progress
from delspec.weights.tokenizer import LightTokenizer, load_tokenizer
from delspec.weights.weight_formats import (
    check_layout,
    hf_names,
    int8_blocks,
    native_blocks,
    resolve_weights,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    """A ready-to-run model with its tokenizer, what this machine measured for it (`machine`;
    made for the thread count torch runs with now where not given), and what its runs learned
    for the next (`learned`: per policy setting, kept by the policies that carry it)."""

    model: Transformer
    tokenizer: LightTokenizer | PreTrainedTokenizerBase  # light: a GGUF file's (`tokenizer`)
    name: str  # short display name
    source: str  # the .gguf file or Hugging Face directory that was loaded
    eos_token_ids: tuple[int, ...]  # config, generation config and tokenizer EOS ids
    load_seconds: float | None = None  # how long `load_model` took
    machine: MachineProfile = None  # type: ignore[assignment]  # None: made in __post_init__
    learned: dict[tuple, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.machine is None:
            self.machine = MachineProfile(self.model)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text for `messages` (and the JSON descriptions of `tools`, for a template
        that takes them), ending with the assistant's turn opening. `ConfigError` when the
        template refuses the conversation (a template may raise, e.g. on roles that do not
        alternate)."""
        if not self.tokenizer.chat_template:
            raise DelspecError(f"model {self.name} has no chat template; pass a plain prompt")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except jinja2.TemplateError as exc:
            raise ConfigError(
                f"the model's chat template refused the conversation: {exc}"
            ) from None

    def describe(self) -> dict[str, Any]:
        """The model's name, source, architecture, shapes, size and where it runs (what
        `delspec info` shows)."""
        model, cfg = self.model, self.model.config
        return {
            "name": self.name,
            "source": self.source,
            "architecture": cfg.family,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "attention_heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "context": cfg.max_position,
            "tied_embeddings": cfg.tie_embeddings,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device),
            "parameters": model.parameter_count,
            "weights": model.weights,
            "weight_mb": round(model.weight_bytes / 2**20, 1),
            "load_seconds": None if self.load_seconds is None else round(self.load_seconds, 2),
            "peak_resident_mb": round(peak_resident_bytes() / 2**20, 1),
        }


def load_model(
    source: str | os.PathLike | None = None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    weights: str | None = None,
    huge_pages: bool = False,
    threads: int | None = None,
) -> LoadedModel:
    """Load a named model (None = the default), a `.gguf` file or a Hugging Face directory.

    `weights`: the format the model is held and computed in
    (`delspec.model.transformer.WEIGHT_FORMATS`):
    "native" (a GGUF file's own quantised blocks), "int8" (8-bit blocks made from float
    weights) or "float"; None picks native for GGUF files on CPU, float otherwise.
    `huge_pages`: native blocks in transparent huge pages (`kernels.blocks.advise_huge_pages`:
    fewer TLB misses in each step, a slower load).
    `threads`: the threads it runs with (torch's for the process; None: as many as now), which
    key every measurement of this machine (`MachineProfile`).
    """
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"threads must be at least 1, not {threads}")
        torch.set_num_threads(threads)
    check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    path = _resolve_source(source)
    if not path.is_dir() and path.suffix.lower() != ".gguf":
        raise ModelFormatError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    weights = resolve_weights(weights, path, device)
    started = time.perf_counter()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFormatError(f"{path} is not a model directory: it has no config.json")
        source: TensorSource = SafetensorsSource(path, _safetensors_files(path))
        directory, name = path, path.resolve().name
    else:
        source = GGUFFile(path)
        directory, name = source.directory, path.stem
    loaded = _load(directory, source, name, path, torch_dtype, device, weights, huge_pages)
    loaded.load_seconds = time.perf_counter() - started
    return loaded


def peak_resident_bytes() -> int:
    """The most memory this process has held resident so far (on Linux since it started the
    program: getrusage's figure there includes what the process that started it held)."""
    try:
        status = Path("/proc/self/status").read_text()
        return (
            int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])
            * 1024
        )
    except (OSError, StopIteration, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def model_depth(source: str | os.PathLike | None) -> int | None:
    """The number of layers of the model `load_model(source)` would load, read from its
    config.json or GGUF metadata alone; None when the source is unreadable (`load_model` says
    why)."""
    try:
        path = _resolve_source(source)
        if not path.is_dir():
            return block_count(path)
        return config_from_hf(_read_json(path / "config.json")).num_layers
    except (DelspecError, *LIBRARY_ERRORS):
        return None


def check_device(device: str | torch.device) -> None:
    """Raise `ConfigError` unless this torch build can run on `device`."""
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise ConfigError(f"invalid device {device!r} (use cpu, cuda or cuda:N)") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        built = "has no CUDA support" if torch.version.cuda is None else "finds no CUDA GPU"
        raise ConfigError(f"device {device!r} is unavailable: this torch build {built}")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} is unavailable on this machine")


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """The torch dtype for a name or dtype; None means float32 on CPU and bfloat16 elsewhere."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; use one of {', '.join(_DTYPES)}")
        return dtype
    if dtype is None:
        try:
            kind = torch.device(device).type
        except RuntimeError as exc:
            raise ConfigError(f"invalid device {device!r}") from exc
        return torch.float32 if kind == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _resolve_source(source: str | os.PathLike | None) -> Path:
    if source is None or source == "default":
        return default_model_path()
    if isinstance(source, str) and source in NAMED_MODELS:
        return named_model_path(source)
    path = Path(source).expanduser()
    if not path.exists():
        named = ", ".join(["default", *NAMED_MODELS])
        raise ModelFormatError(f"model path {path} does not exist (named models: {named})")
    return path


def _load(
    directory: Path,
    source: TensorSource,
    name: str,
    path: Path,
    dtype: torch.dtype,
    device: str,
    weights: str,
    huge_pages: bool = False,
) -> LoadedModel:
    """Build the model whose config and tokenizer are in `directory` and whose tensors come from
    `source` (GGUF file or Hugging Face directory `path`), in weight format `weights`."""
    config = config_from_hf(_read_json(directory / "config.json"))
    try:
        tokenizer = load_tokenizer(directory, isinstance(source, GGUFFile))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{directory} has no usable tokenizer: {exc}") from exc
    if weights == "native":
        assert isinstance(source, GGUFFile)  # resolve_weights allows native for GGUF files only
        blocks = native_blocks(source, config, huge_pages)
        check_layout(blocks, source, config)
    else:
        blocks = int8_blocks(source, config) if weights == "int8" else {}
    wanted = sorted(set(source.names) - hf_names(set(blocks), config))
    # in float weights this is the whole load; next to blocks, only norms and biases are left
    reading = progress(wanted, len(wanted), "reading", 0 if blocks else source.size)
    state = {tensor: source.get(tensor) for tensor in reading}
    model = build_model(config, state, dtype=dtype, device=device, blocks=blocks, weights=weights)
    machine = MachineProfile(model, torch.get_num_threads())
    machine.choose_kernels()
    generation = directory / "generation_config.json"
    generation_eos = _read_json(generation).get("eos_token_id") if generation.is_file() else None
    eos = [*config.eos_token_ids, *token_ids(generation_eos), *token_ids(tokenizer.eos_token_id)]
    eos_ids = tuple(dict.fromkeys(eos))
    return LoadedModel(model, tokenizer, name, str(path), eos_ids, machine=machine)


def _safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else all there are."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        return [directory / f for f in sorted(set(weight_map.values()))]
    return sorted(directory.glob("*.safetensors"))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} does not hold a JSON object")
    return data
