"""The `delspec` commands: each one's flags (`add_<command>`) and what it runs (`cmd_<command>`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from delspec.cli.arguments import (
    decode_arguments,
    decode_config,
    load,
    model_arguments,
    non_negative_int,
    non_negative_number,
    port,
    positive_int,
    positive_number,
    sampling_control_arguments,
    sampling_controls,
    seed,
    writable_directory,
)
from delspec.errors import ConfigError, DelspecError
from delspec.model.architectures import FAMILIES

if TYPE_CHECKING:
    from delspec.decoding.generate import Result
    from delspec.decoding.grammar import Grammar

DRAFT_STYLE = "green"  # accepted draft tokens; target-supplied tokens print plainly


def add_generate(sub: argparse._SubParsersAction) -> None:
    """`delspec generate`: generate text, streamed to the terminal (or one JSON object)."""
    gen = sub.add_parser("generate", help="generate text (streams to the terminal)")
    gen.add_argument("prompt", help="the prompt, or - to read it from standard input")
    model_arguments(gen)
    decode_arguments(gen)
    gen.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="most tokens to generate"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument(
        "--top-k", type=non_negative_int, default=0, help="sample from the K likeliest (0 = off)"
    )
    gen.add_argument(
        "--top-p", type=float, default=1.0, help="sample from the likeliest P of mass (1 = off)"
    )
    gen.add_argument(
        "--seed", type=seed, help="sampling seed, 0..2^63-1 (default: a fresh one every run)"
    )
    sampling_control_arguments(gen)
    gen.add_argument("--stop", action="append", type=_stop_string, help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema", type=Path, metavar="FILE",
        help="constrain the output to JSON matching the schema in FILE (the grammar extra)",
    )  # fmt: skip
    shape.add_argument(
        "--json-object", action="store_true",
        help="constrain the output to a JSON object (the grammar extra)",
    )  # fmt: skip
    gen.add_argument("--trace", type=Path, help="write the per-round trace as JSON lines")
    gen.set_defaults(func=cmd_generate)


def _stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from delspec.decoding.generate import checked_stop, checked_text, generate
    from delspec.decoding.sampling import Sampling

    config = decode_config(args)
    sampling = Sampling(
        args.temperature, args.top_k, args.top_p, args.seed, **sampling_controls(args)
    )
    prompt = read_stdin() if args.prompt == "-" else args.prompt
    checked_text(prompt, "the prompt")  # as `generate` would, before the model loads
    checked_stop(args.stop or ())
    grammar = _output_grammar(args)
    with _trace_file(args.trace) as trace:
        lm = load(args)
        if grammar is not None:
            from delspec.decoding.grammar import check_grammar

            check_grammar(lm, grammar)
        console = Console(highlight=False, soft_wrap=True)

        def show(piece: str, kind: str) -> None:
            style = DRAFT_STYLE if kind == "draft" else None
            console.print(piece, style=style, end="", markup=False)

        result = generate(
            lm,
            prompt,
            config,
            sampling=sampling,
            max_new_tokens=args.max_new_tokens,
            stop=args.stop or (),
            chat=args.chat,
            on_text=None if args.json else show,
            trace=trace is not None,
            grammar=grammar,
        )
        if args.json:
            info = {"model": lm.name, "weights": lm.model.weights, **result.as_dict()}
            print(json.dumps(info, indent=2), flush=True)
        else:
            console.print()
            _print_summary(result, console.is_terminal)
        if trace is not None:  # after the result is out: a failed write loses only the trace
            try:
                trace.writelines(json.dumps(entry) + "\n" for entry in result.trace or ())
                trace.close()  # closed even if this fails
            except OSError as exc:
                print(f"delspec: error: --trace {args.trace}: {exc.strerror}", file=sys.stderr)
                return 1
    return 0


def _output_grammar(args: argparse.Namespace) -> Grammar | None:
    """The grammar `--json-schema` or `--json-object` asks for (None: free text), read before
    the model loads; `ConfigError` naming the flag for a file that is not a JSON schema."""
    if args.json_schema is None and not args.json_object:
        return None
    from delspec.decoding.grammar import json_grammar

    if args.json_object:
        return json_grammar(None, "--json-object")
    flag = f"--json-schema {args.json_schema}"
    try:
        schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{flag}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"{flag} is not JSON: {exc}") from None
    return json_grammar(schema, flag)


def read_stdin() -> str:
    """Standard input as text: UTF-8, other bytes as lone surrogates (as in `sys.argv`), which
    `checked_text` reports."""
    return sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")


@contextlib.contextmanager
def _trace_file(path: Path | None) -> Iterator[IO[str] | None]:
    """`--trace`'s file, opened before any work (a path that cannot be written is an error
    now, not after the generation); removed again if the command fails before writing it."""
    if path is None:
        yield None
        return
    try:
        file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (kept open for the command)
    except OSError as exc:
        raise ConfigError(f"--trace {path}: {exc.strerror}") from None
    with file:
        try:
            yield file
        except BaseException:
            if file.tell() == 0:
                Path(path).unlink(missing_ok=True)
            raise


def _print_summary(result: Result, terminal: bool) -> None:
    """The statistics line after a generation, on standard error; broken between fields
    only (when it is wider than the terminal)."""
    from rich.console import Console
    from rich.text import Text

    s = result.stats
    seconds = (s.prefill_ms + s.decode_ms_per_token * s.new_tokens) / 1000
    end_to_end = s.new_tokens / seconds if seconds > 0 else 0.0
    fields = [
        f"── {s.new_tokens} tokens",
        f"decode {s.tokens_per_s:.1f} tok/s",
        f"prefill {s.prefill_ms:.0f} ms",
        f"end-to-end {end_to_end:.1f} tok/s",
        f"strategy {result.strategy}",
    ]
    if result.strategy != "ar":  # a strategy that may draft: how many it did (0 is news too)
        fields.append(f"drafted {s.drafted}")
    if s.acceptance_rate is not None:
        fields.append(f"acceptance {s.acceptance_rate:.0%}")
    if s.mean_exit_layer is not None:
        fields.append(f"mean exit layer {s.mean_exit_layer:.1f}")
    if s.drafted:
        fields += [f"mean draft {s.mean_draft_length:.1f}", f"eTPL {s.etpl:.3f}"]
    if terminal:
        fields.append("[green]green[/] = accepted draft tokens")
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    lines: list[str] = []
    for field in fields:
        if lines and Text.from_markup(f"{lines[-1]} · {field}").cell_len <= err.width:
            lines[-1] += f" · {field}"
        else:
            lines.append(field)
    for line in lines:
        err.print(f"[dim]{line}[/]")


def add_info(sub: argparse._SubParsersAction) -> None:
    """`delspec info`: describe a model."""
    info = sub.add_parser("info", help="describe a model")
    model_arguments(info, positional=True)
    info.add_argument("--json", action="store_true", help="print one JSON object instead")
    info.add_argument(
        "--families",
        action="store_true",
        help="list the architecture families delspec runs (no model is loaded)",
    )
    info.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    if args.families:
        return _print_families(args.json)
    info = load(args).describe()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            shown = f"{value:,}" if key == "parameters" else value
            print(f"{key.replace('_', ' '):<{width}}  {shown}")
    return 0


def _print_families(as_json: bool) -> int:
    """The supported families: Hugging Face `model_type`, GGUF architecture, what differs."""
    rows = [
        {"model_type": name, "gguf": family.gguf, "differs": family.differs}
        for name, family in FAMILIES.items()
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model_type':<12}  {'gguf':<8}  differs from the Llama layout")
    for row in rows:
        print(f"{row['model_type']:<12}  {row['gguf']:<8}  {row['differs']}")
    return 0


def add_serve(sub: argparse._SubParsersAction) -> None:
    """`delspec serve`: the OpenAI-compatible HTTP server."""
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    model_arguments(srv, huge_pages=True)  # a load paid once, every request's steps faster
    decode_arguments(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=port, default=8000, help="port to listen on (0: any free one)")
    srv.add_argument(
        "--max-queue", type=non_negative_int, default=16, help="waiting requests before 429"
    )
    srv.add_argument(
        "--max-batch",
        type=positive_int,
        help="requests generating at once (default: measured on this machine at start)",
    )
    srv.add_argument(
        "--context",
        type=int,
        help="positions a request may use, prompt and reply (default: the model's, at most 4096)",
    )
    srv.add_argument("--served-model-name", help="the model id clients see (default: its name)")
    srv.add_argument("--timeout", type=positive_number, default=600.0, help="seconds per request")
    srv.add_argument(
        "--max-body-mb",
        type=positive_number,
        help="largest request body in MiB; larger ones get 413 (default: 4)",
    )
    srv.add_argument(
        "--prefill-chunk",
        type=positive_int,
        help="prompt tokens prefilled between two steps of the running requests (fewer far "
        "into a long prompt), so that a long prompt joining does not stall their streams "
        "(default: 128)",
    )
    srv.add_argument(
        "--prompt-cache-mb",
        type=non_negative_number,
        help="MiB of prompt prefixes evicted from the slots kept for later requests that "
        "start with them (0: none; a slot's own prefix is reused still) (default: 256)",
    )
    srv.add_argument(
        "--draft-pool-tokens",
        type=non_negative_int,
        help="tokens of earlier replies kept as a shared source of context drafts for later "
        "requests that repeat them (0: none) (default: 32768)",
    )
    srv.add_argument(
        "--replicas",
        type=positive_int,
        help="copies of the server behind one API, each a process with its own model and "
        "--threads (default: the cores shared out), through Ray Serve (delspec[ray])",
    )
    srv.add_argument(
        "--ray-address", help="with --replicas: join this Ray cluster (default: start one here)"
    )
    srv.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from delspec.server import serve

    config = decode_config(args)
    lm = load(args)  # here too with --replicas: a bad model or option fails before Ray starts
    settings = {
        "config": config,
        "max_queue": args.max_queue,
        "max_batch": args.max_batch,
        "context": args.context,
        "request_timeout": args.timeout,
        "max_body_mb": args.max_body_mb,
        "prefill_chunk": args.prefill_chunk,
        "prompt_cache_mb": args.prompt_cache_mb,
        "draft_pool_tokens": args.draft_pool_tokens,
    }
    options = {**settings, "model_name": args.served_model_name}
    if args.replicas is None:
        serve(lm, host=args.host, port=args.port, aliases=(lm.name, str(args.model)), **options)
        return 0
    from delspec.server.app import check_options
    from delspec.server.replicas import ReplicaSpec, default_threads, serve_replicas

    check_options(lm, queue_timeout=None, **settings)
    del lm
    spec = ReplicaSpec(
        str(args.model),
        args.device,
        args.dtype,
        args.weights,
        args.threads or default_threads(args.replicas),
        options,
        args.huge_pages,
    )
    serve_replicas(
        spec, args.replicas, host=args.host, port=args.port, ray_address=args.ray_address
    )
    return 0


def add_calibrate(sub: argparse._SubParsersAction) -> None:
    """`delspec calibrate`: train exit adapters."""
    cal = sub.add_parser("calibrate", help="train exit adapters that make drafts more accurate")
    model_arguments(cal, positional=True)
    cal.add_argument(
        "--out", type=Path, help="adapters file (default: where `generate` finds it by itself)"
    )
    cal.add_argument(
        "--prompts", type=Path, help=".jsonl or one-prompt-per-line file (default: built-in)"
    )
    cal.add_argument("--rank", type=int, default=64, help="adapter rank")
    cal.add_argument("--layers", help="exit layers, e.g. 8-29 or 10,20 (default: all)")
    cal.add_argument(
        "--max-new-tokens", type=positive_int, default=64, help="tokens generated per prompt"
    )
    cal.add_argument(
        "--steps", type=int, default=50, help="Adam steps per layer after the closed-form fit"
    )
    cal.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    cal.add_argument("--seed", type=seed, default=0, help="seed of the sampled replies")
    cal.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from delspec.calibration.calibrate import calibrate, read_prompts
    from delspec.drafting.adapters import default_adapters_path, save_adapters

    if args.out is not None:
        if args.out.is_dir():
            raise ConfigError(f"--out {args.out} is a directory; name the adapters file")
        writable_directory(args.out.parent, "--out")
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
