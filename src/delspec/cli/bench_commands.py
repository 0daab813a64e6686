"""The benchmark commands, `delspec bench` and `delspec bench-serve`: each one's flags
(`add_<command>`) and what it runs (`cmd_<command>`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from delspec.cli.arguments import (
    load,
    model_arguments,
    positive_int,
    positive_number,
    writable_directory,
)
from delspec.errors import ConfigError


def add_bench_serve(sub: argparse._SubParsersAction) -> None:
    """`delspec bench-serve`: concurrent streaming clients against the server."""
    load = sub.add_parser(
        "bench-serve", help="load the OpenAI server with concurrent streaming clients"
    )
    model_arguments(load)
    load.add_argument(
        "--setups",
        help="server setups STRATEGY[@BATCH],... (no @: the batch size measured at start; "
        "default: ar@1,ar,del-fast@1,del-fast); --soak and --stress use the first (default: "
        "the server's strategy and batch size; --stress: batch size 5)",
    )
    load.add_argument("--clients", default="1,4,8,16", help="concurrent clients, e.g. 1,4,8,16")
    load.add_argument(
        "--requests-per-client", type=positive_int, default=2, help="requests each client sends"
    )
    load.add_argument("--max-tokens", type=positive_int, default=64, help="max_tokens per request")
    load.add_argument("--url", help="measure the server already running there instead")
    load.add_argument("--out", type=Path, help="results directory (default: bench-serve-results)")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument(
        "--soak",
        type=positive_number,
        metavar="SECONDS",
        help="instead: a soak of SECONDS (normal, long, vanishing and hostile clients together): "
        "5xx, answers that differ from solo, queue depth and server RSS over time",
    )
    mode.add_argument(
        "--turns",
        type=positive_int,
        metavar="N",
        help="instead: a chat of N turns over long documents (~2,000 tokens by turn 3), each "
        "turn's time to first token with the prompt cache against the same turn sent cold",
    )
    mode.add_argument(
        "--stress",
        action="store_true",
        help="instead: running streams while a ~3000-token prompt joins, and /health and a "
        "small chat while 3 clients send 10 MB bodies",
    )
    load.add_argument(
        "--long-tokens",
        type=positive_int,
        help="tokens of the long prompts, about (default: 1500 with --soak, 3000 with --stress)",
    )
    load.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from delspec.bench.serve_load import parse_setups, run_bench_serve

    serve_args = ["--model", str(args.model), "--weights", str(args.weights or "auto")]
    serve_args += ["--device", args.device] + (
        ["--threads", str(args.threads)] if args.threads else []
    )
    if args.turns is not None:
        return _bench_serve_turns(args, serve_args)
    if args.soak is not None or args.stress:
        return _bench_serve_hostile(args, serve_args)
    setups = parse_setups(args.setups or "ar@1,ar,del-fast@1,del-fast")
    try:
        clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(f"--clients takes numbers, e.g. 1,4,8; got {args.clients!r}") from None
    if not clients or min(clients) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        raise ConfigError("--clients, --requests-per-client and --max-tokens must be >= 1")
    out = writable_directory(args.out or Path("bench-serve-results"), "--out")
    run_bench_serve(
        serve_args,
        setups,
        clients,
        per_client=args.requests_per_client,
        max_tokens=args.max_tokens,
        url=args.url,
        out=out,
    )
    print(f"delspec: wrote results.json, summary.json, table.md, throughput.png to {out}")
    return 0


def _bench_serve_turns(args: argparse.Namespace, serve_args: list[str]) -> int:
    """`bench-serve --turns N`: two servers of its own (the first of `--setups`' strategy)."""
    from delspec.bench.serve_load import parse_setups
    from delspec.bench.serve_turns import run_turns, turns_table, write_turns

    if args.url:
        raise ConfigError("--turns starts its own two servers; it does not take --url")
    strategy = parse_setups(args.setups)[0].strategy if args.setups else None
    out = writable_directory(args.out or Path("bench-serve-turns"), "--out")
    result = run_turns(serve_args, args.turns, max_tokens=args.max_tokens, strategy=strategy)
    write_turns(result, out)
    print(turns_table(result))
    print(f"delspec: wrote results.json, table.md to {out}")
    return 0


def _bench_serve_hostile(args: argparse.Namespace, serve_args: list[str]) -> int:
    """`bench-serve --soak` or `--stress`, against a server with the first of `--setups` (if
    given)."""
    from delspec.bench.serve_load import parse_setups
    from delspec.bench.serve_soak import run_soak
    from delspec.bench.serve_stress import run_stress

    if args.setups:
        setup = parse_setups(args.setups)[0]
        serve_args += ["--strategy", setup.strategy]
        if setup.max_batch is not None:
            serve_args += ["--max-batch", str(setup.max_batch)]
    if args.soak is not None:
        out = writable_directory(args.out or Path("bench-serve-soak"), "--out")
        result = run_soak(
            serve_args, args.soak, out, url=args.url, max_tokens=args.max_tokens,
            long_tokens=args.long_tokens or 1500,
        )  # fmt: skip
        print(
            f"delspec: soak of {args.soak:g} s: {sum(result.requests.values())} requests, "
            f"{result.server_errors} 5xx, {result.wrong_answers} answers not solo, RSS growth "
            f"{result.rss_growth_pct}%; wrote results.json, table.md to {out}"
        )
        return 0
    out = writable_directory(args.out or Path("bench-serve-stress"), "--out")
    results = run_stress(serve_args, out, url=args.url, long_tokens=args.long_tokens or 3000)
    joins, bodies = results["long_prompt_joins"], results["big_bodies"]
    print(
        f"delspec: longest gap while a long prompt joined {joins['gap_during_max_s']:.2f} s; "
        f"/health p99 {bodies['health_p99_ms']:.0f} ms under big bodies; wrote results.json, "
        f"table.md to {out}"
    )
    return 0


def add_bench(sub: argparse._SubParsersAction) -> None:
    """`delspec bench`: benchmark methods on tasks."""
    from delspec.bench.methods import METHODS
    from delspec.bench.tasks import TASKS

    bench = sub.add_parser("bench", help="benchmark methods on tasks (speed, eTPL, losslessness)")
    model_arguments(bench)
    bench.add_argument("--tasks", help=f"comma-separated, of: {', '.join(TASKS)} (default: all)")
    bench.add_argument("--prompts", type=Path, help="JSON Lines prompts file instead of tasks")
    bench.add_argument(
        "--methods",
        default="ar,static-sweep,fs,dv,del",
        help="comma-separated methods, NAME or NAME:key=value,... (e.g. static:E=8,d=4), "
        f"NAME one of: {', '.join(METHODS)}; ar is always included",
    )
    bench.add_argument("--num-samples", type=int, default=10, help="prompts per task (tasks)")
    bench.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="most tokens per reply"
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every method N times per prompt (rotated) and keep the median time",
    )
    bench.add_argument(
        "--min-seconds",
        type=float,
        default=0.0,
        help="time each prompt again (a few times at most) until every method's runs on it "
        "add up to this many seconds: steadier medians for short replies",
    )
    bench.add_argument("--seed", type=int, default=42, help="seed of the task prompts' order")
    bench.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the model's chat template",
    )
    bench.add_argument(
        "--temperature", type=float, default=0.0, help="sample every method (peers too) at "
        "this temperature, each prompt seeded with its index (0 = greedy, default)",
    )  # fmt: skip
    bench.add_argument("--top-p", type=float, default=1.0, help="with --temperature (default 1)")
    bench.add_argument("--top-k", type=int, default=0, help="with --temperature (0 = off)")
    bench.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from delspec.bench.methods import parse_methods
    from delspec.bench.prompt_sets import select_prompts
    from delspec.bench.report import summary_lines, write_report
    from delspec.bench.runner import run_bench
    from delspec.bench.sweeps import calibration_count

    methods = parse_methods(args.methods)
    tasks = args.tasks.split(",") if args.tasks else None
    prompts = select_prompts(
        tasks, args.num_samples, args.seed, args.prompts, calibration_count(methods)
    )
    from delspec.decoding.sampling import Sampling

    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    writable_directory(args.out, "--out")  # after the arguments' checks, before the work
    result = run_bench(
        load(args),
        methods,
        prompts,
        max_new_tokens=args.max_new_tokens,
        command=shlex.join(["delspec", *args.argv]),
        repeats=args.repeats,
        min_seconds=args.min_seconds,
        chat=args.chat,
        sampling=sampling,
    )
    paths = write_report(result, args.out)
    print("\n".join(summary_lines(result)))
    print(f"delspec: wrote {', '.join(p.name for p in paths)} to {args.out}", file=sys.stderr)
    if not result.ok:
        count = len(result.lossless["failures"])
        print(f"delspec: error: {count} output(s) differ from ar: NOT LOSSLESS", file=sys.stderr)
        return 1
    return 0
