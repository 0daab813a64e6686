"""Flags several `delspec` commands share: the model to load and the `DecodeConfig` options."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from delspec.errors import ConfigError

if TYPE_CHECKING:
    from delspec.decode_config import DecodeConfig
    from delspec.weights.loading import LoadedModel


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, unless its help says it already or it has none
    (None, or False for a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action) or ""


# flags of `decode_arguments` that are `DecodeConfig` options of the same name
DECODE_FLAGS = (
    "strategy",
    "exit_layer",
    "draft_length",
    "adapters",
    "draft_vocab",
    "context_vocab",
    "int8_draft",
)


def model_arguments(
    parser: argparse.ArgumentParser, positional: bool = False, huge_pages: bool = False
) -> None:
    """The model to load (`--model`, or an optional positional `model`) and where to run it;
    native weights in huge pages by default with `huge_pages` (a long-lived process)."""
    parser.add_argument(
        *(["model"] if positional else ["--model"]),
        **({"nargs": "?"} if positional else {}),
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct), a named model, a .gguf file, "
        "or a Hugging Face model directory",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default: cpu)")
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32 (CPU default), bfloat16 (GPU default), float16, float64",
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch")
    parser.add_argument(
        "--weights",
        default="auto",
        help="weight format: native (a GGUF file's own quantised blocks), int8, float, or auto "
        "(native for GGUF files on CPU, float otherwise)",
    )
    parser.add_argument(
        "--huge-pages",
        action=argparse.BooleanOptionalAction,
        default=huge_pages,
        help="native weights in transparent huge pages: fewer TLB misses in each step, a slower "
        f"load (docs/models.md; default: {'on' if huge_pages else 'off'})",
    )


def decode_arguments(parser: argparse.ArgumentParser) -> None:
    """The `DecodeConfig` flags: a preset, then the strategy and options that override it."""
    from delspec.decode_config import DEFAULT_STRATEGY, PRESETS, STRATEGIES

    parser.add_argument(
        "--preset",
        default="fast",
        choices=list(PRESETS),
        help="decoding configuration the other flags start from: fast (default: del-fast with "
        "adapters, pruned draft vocabularies and int8 drafts where they apply) or paper (the "
        "paper's DEL exactly)",
    )
    parser.add_argument(
        "--strategy",
        choices=sorted(STRATEGIES),
        help=f"decoding strategy (default: the preset's; {DEFAULT_STRATEGY} for fast, del for "
        "paper, the paper's DEL)",
    )
    parser.add_argument("--exit-layer", type=positive_int, help="exit layer E (static, fs, dv)")
    parser.add_argument("--draft-length", type=int, help="draft length d (static, fs)")
    parser.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="any other strategy or draft option, e.g. omega=0.9 or candidates=4/8/12 "
        "(repeatable; values as in bench method strings)",
    )
    parser.add_argument(
        "--adapters",
        help="exit adapters file from `delspec calibrate`; 'auto' (default): the model's own "
        "if it has one; 'none'",
    )
    parser.add_argument(
        "--draft-vocab",
        type=_draft_vocab,
        help="draft with only the K most frequent tokens' LM head rows; several sizes "
        "(e.g. 16384,65536,full) for del-fast to choose from per round; 'full'; 'auto' "
        "(default) for del-fast on large vocabularies: 16384, up to two doublings within half "
        "the vocabulary, and full",
    )
    parser.add_argument(
        "--no-context-vocab",
        action="store_false",
        dest="context_vocab",
        default=None,
        help="do not add the prompt's and reply's own tokens to a pruned draft vocabulary",
    )
    parser.add_argument(
        "--int8-draft",
        type=_switch,
        help="draft on int8 copies of the weights: on, off, or 'auto' (default): on for del-fast",
    )


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _int_in(text, 1, None)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _int_in(text, 0, None)


def seed(text: str) -> int:
    """An argparse type: a sampling seed, as the server takes it (0..2^63-1)."""
    return _int_in(text, 0, 2**63 - 1)


def port(text: str) -> int:
    """An argparse type: a TCP port number (0: the system picks a free one)."""
    return _int_in(text, 0, 65535)


def _int_in(text: str, low: int, high: int | None) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        expected = f"{low}..{high}" if high is not None else f">= {low}"
        raise argparse.ArgumentTypeError(f"expected an integer {expected}, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_number(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _draft_vocab(text: str) -> list[int | str] | str:
    if text in ("auto", "full"):
        return text
    try:
        return [k if k == "full" else int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number, numbers and 'full' separated by commas, 'auto' or 'full', "
            f"got {text!r}"
        ) from None


def _switch(text: str) -> bool | str:
    choices = {"on": True, "off": False, "auto": "auto"}
    if text not in choices:
        raise argparse.ArgumentTypeError(f"expected on, off or auto, got {text!r}")
    return choices[text]


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    """The `DecodeConfig` of the command line: `--preset`, updated with the flags given.
    Checked against the model's depth (e.g. `--exit-layer`) before the model loads where its
    config can be read alone (`model_depth`); the command resolves it against the loaded model
    (`delspec.decoding.run.resolve`) in any case."""
    from delspec.decode_config import PRESETS, parse_option
    from delspec.weights.loading import model_depth

    options = dict(parse_option(pair) for pair in args.option or ())
    for name in DECODE_FLAGS:
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    config = PRESETS[args.preset].updated(**options)
    depth = model_depth(args.model)
    if depth is not None:
        config.check_depth(depth)
    return config


def writable_directory(path: Path, flag: str) -> Path:
    """`path`, checked before a long command's work rather than when its results are written
    (the writer creates it): a directory, or none yet, under a directory a file can be written
    in. Nothing is created. `ConfigError` naming `flag` if not."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: {exc.strerror or exc}") from None
    return path


def load(args: argparse.Namespace) -> LoadedModel:
    """The model the `model_arguments` flags name, on their device and threads."""
    from delspec.weights.loading import load_model

    return load_model(
        args.model,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        huge_pages=args.huge_pages,
        threads=args.threads or None,
    )


def sampling_control_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling controls beyond temperature, top-k, top-p and the seed (`Sampling`'s
    fields of the same names; they bias and penalise greedy decoding too)."""
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="keep tokens at least this fraction of the "
        "most likely one's probability (0 = off, default)",
    )  # fmt: skip
    parser.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtracted from a token's logit "
        "per time it occurs in the reply so far, in [-2, 2] (default 0)",
    )  # fmt: skip
    parser.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtracted from the logit of a "
        "token the reply holds so far, in [-2, 2] (default 0)",
    )  # fmt: skip
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="divides positive logits and "
        "multiplies negative ones of tokens in the prompt or reply, > 0 (1 = off, default)",
    )  # fmt: skip
    parser.add_argument(
        "--logit-bias", action="append", type=_token_bias, metavar="TOKEN_ID=BIAS",
        help="add BIAS in [-100, 100] to a token's logit (repeatable)",
    )  # fmt: skip


def sampling_controls(args: argparse.Namespace) -> dict:
    """`sampling_control_arguments`' values as `Sampling` keywords."""
    return {
        "min_p": args.min_p,
        "frequency_penalty": args.frequency_penalty,
        "presence_penalty": args.presence_penalty,
        "repetition_penalty": args.repetition_penalty,
        "logit_bias": dict(args.logit_bias or ()),
    }


def _token_bias(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected TOKEN_ID=BIAS, e.g. 42=-100, got {text!r}"
        ) from None
