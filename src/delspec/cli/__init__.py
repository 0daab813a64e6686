"""`delspec` command line: generate, info, serve, bench, calibrate. Thin: parsing and printing.

`commands` holds each command's flags and what it runs (`bench_commands`: the benchmarks');
`arguments` the flags they share.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from importlib.metadata import version

from delspec.cli import bench_commands, commands
from delspec.cli.arguments import HelpFormatter
from delspec.errors import DelspecError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="delspec",
        description="DEL self-speculative decoding: lossless, faster generation.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('delspec')}")
    subparser = functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=subparser)
    commands.add_generate(sub)
    commands.add_info(sub)
    commands.add_serve(sub)
    bench_commands.add_bench(sub)
    bench_commands.add_bench_serve(sub)
    commands.add_calibrate(sub)
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
