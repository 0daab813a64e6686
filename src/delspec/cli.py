"""`delspec` command line: generate, info, serve, bench, calibrate. Thin: parsing and printing."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from delspec.errors import DelspecError

if TYPE_CHECKING:
    from delspec.decode_config import DecodeConfig

DRAFT_STYLE = "green"  # accepted draft tokens; target-supplied tokens print plainly
# flags of `_decode_arguments` that are `DecodeConfig` options of the same name
DECODE_FLAGS = (
    "strategy",
    "exit_layer",
    "draft_length",
    "adapters",
    "draft_vocab",
    "context_vocab",
    "int8_draft",
)


def _model_arguments(parser: argparse.ArgumentParser, positional: bool = False) -> None:
    """The model to load (`--model`, or an optional positional `model`) and where to run it."""
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
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument(
        "--weights",
        default="auto",
        help="weight format: native (a GGUF file's own quantised blocks), int8, float, or auto "
        "(native for GGUF files on CPU, float otherwise)",
    )


def _decode_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--exit-layer", type=int, help="exit layer E (static, fs, dv)")
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
    """The `DecodeConfig` of the command line: `--preset`, updated with the flags given."""
    from delspec.decode_config import PRESETS, parse_option

    options = dict(parse_option(pair) for pair in args.option or ())
    for name in DECODE_FLAGS:
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return PRESETS[args.preset].updated(**options)


def load(args: argparse.Namespace):
    import torch

    from delspec.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model, device=args.device, dtype=args.dtype, weights=args.weights)


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from delspec.generate import generate
    from delspec.sampling import Sampling

    config = decode_config(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    lm = load(args)
    console = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False)

    def show(piece: str, kind: str) -> None:
        console.print(piece, style=DRAFT_STYLE if kind == "draft" else None, end="", markup=False)

    result = generate(
        lm,
        prompt,
        config,
        sampling=sampling,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop or (),
        chat=args.chat,
        on_text=None if args.json else show,
        trace=args.trace is not None,
    )
    if args.trace is not None:
        with open(args.trace, "w") as f:
            for entry in result.trace or []:
                f.write(json.dumps(entry) + "\n")
    if args.json:
        print(
            json.dumps(
                {"model": lm.name, "weights": lm.model.weights, **result.as_dict()}, indent=2
            )
        )
        return 0
    s = result.stats
    console.print()
    summary = (
        f"{s.new_tokens} tokens · {s.tokens_per_s:.1f} tok/s · prefill {s.prefill_ms:.0f} ms · "
        f"strategy {result.strategy}"
    )
    if s.drafted:
        summary += (
            f" · acceptance {s.acceptance_rate:.0%} · mean exit layer {s.mean_exit_layer:.1f}"
            f" · mean draft {s.mean_draft_length:.1f} · eTPL {s.etpl:.3f}"
        )
    if console.is_terminal:
        summary += " · [green]green[/] = accepted draft tokens"
    err.print(f"[dim]── {summary}[/]")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    lm = load(args)
    cfg = lm.model.config
    info = {
        "name": lm.name,
        "source": lm.source,
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
        "dtype": str(lm.model.dtype).removeprefix("torch."),
        "device": str(lm.model.device),
        "parameters": lm.model.parameter_count,
        "weights": lm.model.weights,
        "weight_mb": round(lm.model.weight_bytes / 2**20, 1),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            shown = f"{value:,}" if key == "parameters" else value
            print(f"{key.replace('_', ' '):<{width}}  {shown}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from delspec.server import serve

    config = decode_config(args)
    lm = load(args)
    serve(
        lm,
        host=args.host,
        port=args.port,
        config=config,
        max_queue=args.max_queue,
        request_timeout=args.timeout,
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from delspec.bench.methods import parse_methods
    from delspec.bench.report import summary_lines, write_report
    from delspec.bench.runner import calibration_count, run_bench, select_prompts

    methods = parse_methods(args.methods)
    tasks = args.tasks.split(",") if args.tasks else None
    prompts = select_prompts(
        tasks, args.num_samples, args.seed, args.prompts, calibration_count(methods)
    )
    result = run_bench(
        load(args),
        methods,
        prompts,
        max_new_tokens=args.max_new_tokens,
        command=shlex.join(["delspec", *args.argv]),
        repeats=args.repeats,
    )
    paths = write_report(result, args.out)
    print("\n".join(summary_lines(result)))
    print(f"delspec: wrote {', '.join(p.name for p in paths)} to {args.out}", file=sys.stderr)
    if not result.ok:
        count = len(result.lossless["failures"])
        print(f"delspec: error: {count} output(s) differ from ar: NOT LOSSLESS", file=sys.stderr)
        return 1
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from delspec.adapters import default_adapters_path, save_adapters
    from delspec.calibration import calibrate, read_prompts

    lm = load(args)
    adapters = calibrate(
        lm,
        read_prompts(args.prompts) if args.prompts else None,
        layers=_layer_list(args.layers) if args.layers else None,
        rank=args.rank,
        steps=args.steps,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    path = save_adapters(adapters, args.out or default_adapters_path(lm))
    info = adapters.calibration
    table = Table(
        title=f"held-out agreement with the final layer ({info['heldout_positions']} positions)"
    )
    for column in ("exit layer", "top-1 before", "top-1 after", "KL before", "KL after"):
        table.add_column(column, justify="right")
    for row in info["layers"]:
        table.add_row(
            str(row["layer"]),
            f"{row['agreement_before']:.3f}",
            f"{row['agreement_after']:.3f}",
            f"{row['kl_before']:.3f}",
            f"{row['kl_after']:.3f}",
        )
    console = Console(highlight=False)
    console.print(table)
    console.print(
        f"wrote {path} ({len(adapters.layers)} layers, rank {adapters.rank}, "
        f"{info['train_positions']} training positions; generation {info['generate_s']:.0f} s, "
        f"training {info['train_s']:.0f} s)",
        markup=False,
    )
    return 0


def _layer_list(text: str) -> list[int]:
    """Exit layers from "8-12,20,24": ranges are inclusive."""
    layers: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            layers.extend(range(int(first), int(last or first) + 1))
    except ValueError as exc:
        raise DelspecError(f"--layers: expected e.g. 8-12,20, got {text!r}") from exc
    return layers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="delspec", description="DEL self-speculative decoding: lossless, faster generation."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (streams to the terminal)")
    gen.add_argument("prompt", help="the prompt, or - to read it from standard input")
    _model_arguments(gen)
    _decode_arguments(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead")
    gen.add_argument("--trace", type=Path, help="write the per-round trace as JSON lines")
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="describe a model")
    _model_arguments(info, positional=True)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _model_arguments(srv)
    _decode_arguments(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-queue", type=int, default=16, help="waiting requests before 429")
    srv.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    srv.set_defaults(func=cmd_serve)

    from delspec.bench.methods import METHODS
    from delspec.bench.tasks import TASKS

    bench = sub.add_parser("bench", help="benchmark methods on tasks (speed, eTPL, losslessness)")
    _model_arguments(bench)
    bench.add_argument("--tasks", help=f"comma-separated, of: {', '.join(TASKS)} (default: all)")
    bench.add_argument("--prompts", type=Path, help="JSON Lines prompts file instead of tasks")
    bench.add_argument(
        "--methods",
        default="ar,static-sweep,fs,dv,del",
        help="comma-separated methods, NAME or NAME:key=value,... (e.g. static:E=8,d=4), "
        f"NAME one of: {', '.join(METHODS)}; ar is always included",
    )
    bench.add_argument("--num-samples", type=int, default=10, help="prompts per task (tasks)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every method N times per prompt (rotated) and keep the median time",
    )
    bench.add_argument("--seed", type=int, default=42, help="seed of the task prompts' order")
    bench.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    bench.set_defaults(func=cmd_bench)

    cal = sub.add_parser("calibrate", help="train exit adapters that make drafts more accurate")
    _model_arguments(cal, positional=True)
    cal.add_argument(
        "--out", type=Path, help="adapters file (default: where `generate` finds it by itself)"
    )
    cal.add_argument(
        "--prompts", type=Path, help=".jsonl or one-prompt-per-line file (default: built-in)"
    )
    cal.add_argument("--rank", type=int, default=64, help="adapter rank")
    cal.add_argument("--layers", help="exit layers, e.g. 8-29 or 10,20 (default: all)")
    cal.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    cal.add_argument(
        "--steps", type=int, default=50, help="Adam steps per layer after the closed-form fit"
    )
    cal.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    cal.add_argument("--seed", type=int, default=0)
    cal.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return command(args)
    except DelspecError as exc:
        print(f"delspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ndelspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
