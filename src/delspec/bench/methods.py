"""The methods `delspec bench` can compare, by name, and the ``--methods`` list syntax.

A method is a `MethodSpec` in `METHODS`: which backend runs it, with which strategy and fixed
options. Adding a variant is one entry. A delspec method's options are `DecodeConfig` options
(``preset``, the strategy's options, the draft options) and ``weights`` (a weight format to
load the checkpoint in); the paper's methods run the ``paper`` preset's plain exit head,
``del-fast`` the defaults. On the command line, ``NAME:key=value,...`` adds or overrides
options (`delspec.decode_config.parse_option`: ``E`` and ``d`` stand for ``exit_layer`` and
``draft_length``, a value ``a/b/c`` of numbers is a list, used by ``static-sweep`` grids).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from delspec.decode_config import DecodeConfig, parse_option
from delspec.errors import ConfigError

PAPER_OPTIONS = {"preset": "paper"}  # no adapters, the full vocabulary, exact drafts
REFERENCE = "ar"  # every run includes it: speedups and losslessness are measured against it


@dataclass(frozen=True)
class MethodSpec:
    """How a named method runs.

    `backend` names an entry of `delspec.bench.backends.BACKENDS` ("delspec", "transformers",
    "economize", "llama-cpp"); `strategy` is what that backend runs (a delspec strategy name, or
    the peer's mode). `peer` methods come from other libraries: their outputs are compared with
    `ar` but a mismatch does not fail the run. `sweep` methods first pick `exit_layer` and
    `draft_length` per task on calibration prompts (grid options are lists).
    """

    strategy: str
    options: Mapping[str, Any] = field(default_factory=dict)
    backend: str = "delspec"
    peer: bool = False
    sweep: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


METHODS: dict[str, MethodSpec] = {
    "ar": MethodSpec(
        "ar", PAPER_OPTIONS, description="vanilla autoregressive decoding (the reference)"
    ),
    "del": MethodSpec(
        "del", PAPER_OPTIONS, description="DEL: dynamic exit layer + dynamic draft exiting"
    ),
    "dele": MethodSpec(
        "dele", PAPER_OPTIONS, description="DEL without dynamic draft exiting (DEL-E)"
    ),
    "del-fast": MethodSpec(
        "del-fast",
        description="the default, as `generate` runs it: DEL + measured cost model, no-draft "
        "rounds, context drafts (each round's source chosen by cost), 1% shadow budget, "
        "acceptance in runs, int8 drafts, pruned draft vocabularies (size chosen per round) "
        "with the context's tokens and the final layer, calibrated adapters where they apply",
    ),
    "static": MethodSpec(
        "static", PAPER_OPTIONS, description="LayerSkip self-speculation, fixed E and d"
    ),
    "static-sweep": MethodSpec(
        "static",
        PAPER_OPTIONS,
        sweep=True,
        description="static at the (E, d) with the best tokens/s on calibration prompts per task",
    ),
    "fs": MethodSpec(
        "fs", PAPER_OPTIONS, description="fixed E; draft length +1 / -1 per round (FS)"
    ),
    "dv": MethodSpec(
        "dv", PAPER_OPTIONS, description="fixed E; Draft & Verify's adaptive confidence threshold"
    ),
    "lookup": MethodSpec(
        "lookup",
        description="context drafts alone (prompt lookup: the tokens after the latest earlier "
        "match of the newest 2-4 tokens), up to 4 a round; options draft_length, adaptive",
    ),
    "hf": MethodSpec(
        "greedy",
        backend="transformers",
        peer=True,
        description="transformers model.generate, same weights",
    ),
    "hf-early-exit": MethodSpec(
        "early-exit",
        backend="transformers",
        peer=True,
        description="transformers generate(assistant_early_exit=E), d drafts per round",
    ),
    "hf-lookup": MethodSpec(
        "lookup",
        backend="transformers",
        peer=True,
        description="transformers generate(prompt_lookup_num_tokens=d, max_matching_ngram_size="
        "ngram), same weights: prompt-lookup decoding, up to d drafts per round copied "
        "from where the context's last ngram tokens occurred before (d=10, ngram=2)",
    ),
    "economize-early-exit": MethodSpec(
        "early-exit",
        backend="economize",
        peer=True,
        description="economize's LayerSkip drafter (shared head, frozen layers), d drafts",
    ),
    "llama-cpp": MethodSpec(
        "greedy",
        backend="llama-cpp",
        peer=True,
        description="llama.cpp (llama-cpp-python) on the same GGUF file (its own "
        "kernels; a quantized file's weights stay quantized); option n_ctx",
    ),
    "llama-cpp-lookup": MethodSpec(
        "lookup",
        backend="llama-cpp",
        peer=True,
        description="llama-cpp-python's prompt-lookup decoding (LlamaPromptLookupDecoding("
        "num_pred_tokens=d, max_ngram_size=ngram), d=10, ngram=2), on the same GGUF "
        "file as llama-cpp; options d, ngram, n_ctx",
    ),
}


@dataclass(frozen=True)
class Method:
    """A requested method: its label in reports, its spec, and the spec's options updated with
    the user's."""

    label: str
    name: str
    spec: MethodSpec
    options: Mapping[str, Any]


def method_config(strategy: str, options: Mapping[str, Any]) -> tuple[DecodeConfig, str | None]:
    """The config a delspec method runs `strategy` with (`options` as `DecodeConfig.updated`
    takes them, but ``weights``), and the weight format it runs on (None: the bench model's)."""
    options = dict(options)
    weights = options.pop("weights", None)
    return DecodeConfig().updated(**options, strategy=strategy), weights


def weights_of(method: Method, loaded: str) -> str | None:
    """The weight format a delspec method runs on (`loaded`: the bench model's); None for a
    peer."""
    if method.spec.backend != "delspec":
        return None
    return method.options.get("weights", loaded)


def references(methods: Sequence[Method], loaded: str) -> dict[str, str]:
    """Per method label, the label of the `ar` run its output must equal: `ar` on the same
    weight format (a model is its checkpoint and weight format); the first method, `ar`, for
    peers. Raises `ConfigError` when a format has no `ar` run."""
    plain = {}
    for method in methods:
        if method.spec.backend == "delspec" and method.spec.strategy == REFERENCE:
            plain.setdefault(weights_of(method, loaded), method.label)
    chosen = {}
    for method in methods:
        weights = weights_of(method, loaded)
        if weights is not None and weights not in plain:
            raise ConfigError(
                f"{method.label} runs on weights {weights!r}: add ar:weights={weights} "
                "to check it against plain decoding on the same weights"
            )
        chosen[method.label] = plain[weights] if weights is not None else methods[0].label
    return chosen


def parse_methods(text: str) -> list[Method]:
    """The methods of a ``--methods`` value, `REFERENCE` first (added when missing).

    ``"ar,static:E=8,d=4,del"`` is three methods: a comma-separated item that contains ``=`` but
    no ``:`` continues the previous method's options. Raises `ConfigError` for an unknown
    method, a malformed option, or a label given twice.
    """
    items: list[list[str]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item:
            if not items:
                raise ConfigError(f"option {item!r} comes before any method in {text!r}")
            items[-1].append(item)
        else:
            items.append([item])
    methods = [_method(",".join(parts)) for parts in items]
    if not any(m.label == REFERENCE for m in methods):
        methods.insert(0, _method(REFERENCE))
    labels = [m.label for m in methods]
    if duplicates := sorted({label for label in labels if labels.count(label) > 1}):
        raise ConfigError(f"method(s) given twice: {', '.join(duplicates)}")
    return sorted(methods, key=lambda m: m.label != REFERENCE)


def _method(label: str) -> Method:
    name, _, raw = label.partition(":")
    spec = METHODS.get(name)
    if spec is None:
        raise ConfigError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    options = dict(spec.options)
    try:
        options.update(parse_option(pair) for pair in filter(None, raw.split(",")))
    except ConfigError as exc:
        raise ConfigError(f"method {label!r}: {exc}") from exc
    return Method(label, name, spec, MappingProxyType(options))
