"""How to decode: one `DecodeConfig` (a strategy, its options, and the draft head's options).

Every default is defined here, once: `STRATEGIES` holds each strategy's default options and
`DraftConfig`'s fields the draft head's. `PRESETS` names whole configurations. The CLI, bench
method strings and HTTP requests all reach a config through `DecodeConfig.updated`, which
takes flat options (``preset``, ``strategy``, the strategy's options, the draft options) and
raises `ConfigError` for an unknown name or a bad value.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin, get_type_hints

from delspec.errors import ConfigError

if TYPE_CHECKING:
    from delspec.drafting.adapters import ExitAdapters

DEFAULT_STRATEGY = "del-fast"
# del-fast drafts with the LM-head rows of the most frequent tokens (when the vocabulary is at
# least twice as large): drafting and shadow tokens then cost a fraction of the full head. Its
# cost model picks, per round, this many rows, twice or four times as many (up to half the
# vocabulary), or the full head: a larger one costs more per draft token and may accept more.
FAST_DRAFT_VOCAB = 16384
FAST_VOCAB_LEVELS = 3
# Short names in `key=value` options (bench method strings, `--option`).
OPTION_ALIASES = {"E": "exit_layer", "d": "draft_length"}

_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _typed(name: str, value: Any, hint: Any) -> Any:
    """`value` as field `name` of type `hint` holds it (an int as a float, a list as a tuple);
    `ConfigError` when it is of another type."""
    if get_origin(hint) in (Union, types.UnionType):
        if value is None:
            return None
        (hint,) = [arg for arg in get_args(hint) if arg is not type(None)]
    if get_origin(hint) is tuple:  # tuple[int, ...]
        items = list(value) if isinstance(value, list | tuple) else [value]
        return tuple(_typed(name, item, int) for item in items)
    ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(f"{name} must be {_KINDS[hint]}, got {value!r}")
    return value


@functools.cache
def _hints(kind: type) -> dict[str, Any]:
    """`kind`'s resolved field annotations (resolved once: resolving them is slow, and every
    generation asks)."""
    return get_type_hints(kind)


@dataclass(frozen=True)
class _Options:
    """Strategy options: fields are type-checked on creation, then `check`ed."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in fields(self):
            object.__setattr__(self, f.name, _typed(f.name, getattr(self, f.name), hints[f.name]))
        self.check()

    def check(self) -> None:
        """Raise `ConfigError` for a value out of range (the model's own bounds aside)."""

    def check_depth(self, num_layers: int) -> None:
        """Raise `ConfigError` for a value a model of `num_layers` layers rules out."""


def exit_layer_for(exit_layer: int | None, num_layers: int) -> int:
    """`exit_layer` (None: a quarter of the model's layers, at least 1), checked against a model
    of `num_layers` layers."""
    if exit_layer is None:
        exit_layer = max(1, num_layers // 4)
    if not 1 <= exit_layer <= num_layers:
        raise ConfigError(
            f"exit layer must be in 1..{num_layers} for a {num_layers}-layer model, "
            f"got {exit_layer}"
        )
    return exit_layer


def _at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class NoOptions(_Options):
    """`ar`: plain autoregressive decoding takes no options."""


@dataclass(frozen=True)
class StaticOptions(_Options):
    """`static`: draft `draft_length` tokens from layer `exit_layer` (None: a quarter of the
    model's layers)."""

    exit_layer: int | None = None
    draft_length: int = 6

    def check(self) -> None:
        _at_least_one("draft length", self.draft_length)

    def check_depth(self, num_layers: int) -> None:
        exit_layer_for(self.exit_layer, num_layers)


@dataclass(frozen=True)
class FSOptions(StaticOptions):
    """`fs`: `static`, whose draft length moves within [1, `max_draft`]."""

    max_draft: int = 18

    def check(self) -> None:
        super().check()
        _at_least_one("max draft", self.max_draft)


@dataclass(frozen=True)
class DVOptions(_Options):
    """`dv`: drafts from `exit_layer` stop below a confidence `threshold` (adapted toward the
    acceptance `target` by `step`, smoothed by `beta1`, `beta2`), or at `max_draft` tokens."""

    exit_layer: int | None = None
    threshold: float = 0.6
    max_draft: int = 18
    target: float = 0.8
    step: float = 0.01
    beta1: float = 0.5
    beta2: float = 0.9

    def check(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"threshold must be in [0, 1], got {self.threshold}")
        _at_least_one("max draft", self.max_draft)

    def check_depth(self, num_layers: int) -> None:
        exit_layer_for(self.exit_layer, num_layers)


@dataclass(frozen=True)
class LookupOptions(_Options):
    """`lookup`: draft only from the context (prompt lookup): up to `draft_length` tokens that
    followed the latest earlier occurrence of the sequence's longest suffix of `ngram_min` to
    `ngram_max` tokens; with `adaptive`, the length moves within [1, `max_draft`] as `fs`'s
    does."""

    draft_length: int = 4
    adaptive: bool = False
    max_draft: int = 18
    ngram_min: int = 2
    ngram_max: int = 4

    def check(self) -> None:
        _at_least_one("draft length", self.draft_length)
        _at_least_one("max draft", self.max_draft)
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )


COSTS = ("layers", "measured")


@dataclass(frozen=True)
class DELOptions(_Options):
    """`del`, `dele`, `del-fast`: the paper's DEL (`DynamicExit`) and what del-fast adds
    (`FastDynamicExit`).

    `candidates`: exit layers to choose from (None: every layer). `omega`: decay of the
    statistics; d* is chosen in [`gamma_min`, `gamma_max`) and a draft stops at `draft_cap`
    tokens; `warmup`: prompt positions scored in round 0; `dynamic_draft=False` is DELE.
    del-fast's additions: `cost="measured"`, `no_draft`, `shadow_budget`, `prior`, `margin`
    (None: what the cost implies), `runs`, `min_evidence`, `context_drafts` (draft from the
    context too, choosing each round's source by measured cost; needs `cost="measured"`),
    `remember` (start from what the previous generation with the same model and options
    learned, instead of a warm-up).
    """

    candidates: tuple[int, ...] | None = None
    omega: float = 0.95
    gamma_max: int = 18
    gamma_min: int = 0
    draft_cap: int = 18
    warmup: int = 32
    dynamic_draft: bool = True
    cost: str = "layers"
    no_draft: bool = False
    shadow_budget: float | None = None
    prior: float | None = None
    margin: float | None = None
    runs: bool = False
    min_evidence: float = 0.0
    context_drafts: bool = False
    remember: bool = False

    def check(self) -> None:
        if not 0.0 < self.omega <= 1.0:
            raise ConfigError(f"omega must be in (0, 1], got {self.omega}")
        if not 0 <= self.gamma_min < self.gamma_max:
            raise ConfigError(
                f"need 0 <= gamma_min < gamma_max, got {self.gamma_min}, {self.gamma_max}"
            )
        _at_least_one("draft cap", self.draft_cap)
        if self.warmup < 0:
            raise ConfigError(f"warmup window must be >= 0, got {self.warmup}")
        if self.cost not in COSTS:
            raise ConfigError(f"cost must be one of {', '.join(COSTS)}, got {self.cost!r}")
        if self.shadow_budget is not None and not 0.0 < self.shadow_budget <= 1.0:
            raise ConfigError(f"shadow_budget must be in (0, 1], got {self.shadow_budget}")
        for name in ("prior", "margin", "min_evidence"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.context_drafts and self.cost != "measured":
            raise ConfigError("context_drafts needs cost='measured' (sources are chosen by cost)")

    def check_depth(self, num_layers: int) -> None:
        self.exit_layers(num_layers)

    def exit_layers(self, num_layers: int) -> list[int]:
        """The candidate exit layers (default: every layer but the last), ascending, checked
        against a model of `num_layers` layers."""
        layers = self.candidates if self.candidates is not None else range(1, num_layers)
        if not layers:
            raise ConfigError("DEL needs at least one candidate exit layer")
        return [exit_layer_for(e, num_layers) for e in sorted(set(layers))]

    @property
    def uses_fast_additions(self) -> bool:
        """Whether these options turn on anything beyond the paper's DEL (del-fast's additions,
        `policies.fast_dynamic_exit`)."""
        return bool(
            self.cost != "layers"
            or self.no_draft
            or self.shadow_budget is not None
            or self.runs
            or self.min_evidence
            or self.prior
            or self.margin
            or self.context_drafts
            or self.remember
        )


StrategyOptions = NoOptions | StaticOptions | FSOptions | DVOptions | LookupOptions | DELOptions

# Each strategy's default options. del-fast is DEL with the CPU/stock-checkpoint improvements:
# measured costs, no-draft rounds, shadow work bounded to a small share of round time,
# acceptance in runs, drafting only from layers seen at 3+ positions, context drafts, and what
# the previous generation learned. Without one, its first round scores 4 prompt positions
# (once, not charged to the budget) so that a layer worth drafting from is known from the start
# of a short reply.
STRATEGIES: dict[str, StrategyOptions] = {
    "del": DELOptions(),
    "dele": DELOptions(dynamic_draft=False),
    "del-fast": DELOptions(
        cost="measured",
        no_draft=True,
        shadow_budget=0.01,
        warmup=4,
        runs=True,
        min_evidence=3,
        context_drafts=True,
        remember=True,
    ),
    "static": StaticOptions(),
    "fs": FSOptions(),
    "dv": DVOptions(),
    "lookup": LookupOptions(),
    "ar": NoOptions(),
}


@dataclass(frozen=True)
class DraftConfig:
    """What drafts are made with; none of it changes the output.

    `adapters`: exit adapters, "auto" (the model's calibration file if it has one), a file, an
    `ExitAdapters`, or None ("none"). `draft_vocab`: draft with the LM-head rows of the K most
    frequent tokens, a list of sizes (None or "full": the whole vocabulary) for `del-fast` to
    choose from per round, None ("full"), or "auto" (`default_draft_vocab`). `context_vocab`:
    add the prompt's and reply's own tokens to a pruned vocabulary. `int8_draft`: draft on int8
    copies of the weights; "auto" = `drafting.draft_head.default_int8_draft`.
    """

    adapters: str | os.PathLike | ExitAdapters | None = "auto"
    draft_vocab: int | Sequence[int | None] | str | None = "auto"
    context_vocab: bool = True
    int8_draft: bool | str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.adapters, bool | int | float | list | tuple | dict):
            raise ConfigError(f"adapters must be 'auto', 'none' or a file, got {self.adapters!r}")
        if self.adapters == "none":
            object.__setattr__(self, "adapters", None)
        object.__setattr__(self, "draft_vocab", _draft_vocab(self.draft_vocab))
        _typed("context_vocab", self.context_vocab, bool)
        if self.int8_draft != "auto" and not isinstance(self.int8_draft, bool):
            raise ConfigError(f"int8_draft must be true, false or 'auto', got {self.int8_draft!r}")


def _draft_vocab(value: Any) -> int | tuple[int | None, ...] | str | None:
    """`value` as `DraftConfig.draft_vocab` holds it: "auto", None (for "full"), a size, or
    sizes (a tuple, None for "full")."""
    if value in ("auto", None, "full"):
        return None if value == "full" else value
    if isinstance(value, list | tuple):
        return tuple(None if v in (None, "full") else _typed("draft_vocab", v, int) for v in value)
    if isinstance(value, str):
        raise ConfigError(f"draft_vocab must be a size, sizes, 'full' or 'auto', got {value!r}")
    return _typed("draft_vocab", value, int)


DRAFT_OPTIONS = tuple(f.name for f in fields(DraftConfig))


@dataclass(frozen=True)
class DecodeConfig:
    """A decoding strategy with its options and the draft head's options; the default is
    `del-fast` as `generate` runs it. `options` given here replace the strategy's defaults
    whole (None: the defaults); `updated` changes single options."""

    strategy: str = DEFAULT_STRATEGY
    options: StrategyOptions | None = None  # None: the strategy's defaults (set on creation)
    draft: DraftConfig = field(default_factory=DraftConfig)

    def __post_init__(self) -> None:
        default = STRATEGIES[_known(self.strategy)]
        if self.options is None:
            object.__setattr__(self, "options", default)
        elif type(self.options) is not type(default):
            raise ConfigError(
                f"strategy {self.strategy!r} takes {type(default).__name__}, "
                f"not {type(self.options).__name__}"
            )

    def check_depth(self, num_layers: int) -> None:
        """Raise `ConfigError` for an option a model of `num_layers` layers rules out (an exit
        layer past its last): what a config can be checked for before the model loads
        (`delspec.decoding.run.resolve` checks everything against the loaded model)."""
        self.options.check_depth(num_layers)

    def updated(self, **options: Any) -> DecodeConfig:
        """This config with flat `options` applied: ``preset`` (a name of `PRESETS`) replaces
        it first; a new ``strategy`` starts from that strategy's default options; the other
        names are the strategy's options and `DraftConfig`'s."""
        config = self
        if "preset" in options:
            name = options.pop("preset")
            if name not in PRESETS:
                raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
            config = PRESETS[name]
        strategy = _known(options.pop("strategy", config.strategy))
        current = config.options if strategy == config.strategy else STRATEGIES[strategy]
        draft = {k: options.pop(k) for k in DRAFT_OPTIONS if k in options}
        return DecodeConfig(
            strategy, strategy_options(strategy, options, current), replace(config.draft, **draft)
        )


def _known(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    return strategy


def strategy_options(
    strategy: str, options: Mapping[str, Any], base: StrategyOptions | None = None
) -> StrategyOptions:
    """`base` (default: `strategy`'s defaults) with `options` replaced; `ConfigError` names an
    option the strategy does not take."""
    base = STRATEGIES[strategy] if base is None else base
    names = [f.name for f in fields(base)]
    unknown = [k for k in options if k not in names]
    if unknown:
        takes = f"its options: {', '.join(names)}" if names else "it takes none"
        raise ConfigError(f"strategy {strategy!r} has no option {unknown[0]!r}; {takes}")
    return replace(base, **options)


# The paper's DEL exactly: its cost, no adapters, the full vocabulary, exact drafts.
PAPER = DecodeConfig("del", draft=DraftConfig(adapters=None, draft_vocab=None, int8_draft=False))
PRESETS: dict[str, DecodeConfig] = {"paper": PAPER, "fast": DecodeConfig()}


def default_draft_vocab(strategy: str, vocab_size: int) -> list[int | None] | None:
    """The draft vocabularies `draft_vocab="auto"` means: for `del-fast` on a vocabulary of at
    least twice `FAST_DRAFT_VOCAB`, that many tokens, up to `FAST_VOCAB_LEVELS - 1` doublings
    that stay within half the vocabulary, and the full vocabulary (None); else None (no
    pruning)."""
    if strategy != "del-fast" or vocab_size < 2 * FAST_DRAFT_VOCAB:
        return None
    sizes = [FAST_DRAFT_VOCAB << i for i in range(FAST_VOCAB_LEVELS)]
    return [k for k in sizes if 2 * k <= vocab_size] + [None]


def parse_option(pair: str) -> tuple[str, Any]:
    """``key=value`` as (name, value): `OPTION_ALIASES` expand; a value is true/false, a
    number, ``a/b/c`` of numbers (a list, in which ``full`` may stand for the whole vocabulary:
    ``draft_vocab=16384/65536/full``), or text (a value with ``/`` and other text: a path)."""
    key, sep, value = pair.partition("=")
    if not (sep and key and value):
        raise ConfigError(f"expected key=value, got {pair!r}")
    values = [_scalar(v) for v in value.split("/")]
    if len(values) > 1 and any(isinstance(v, str) and v != "full" for v in values):
        values = [value]  # a path such as adapters=dir/file, not a list
    return OPTION_ALIASES.get(key, key), values if len(values) > 1 else values[0]


def _scalar(text: str) -> int | float | bool | str:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
