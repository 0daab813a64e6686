"""`delspec` command line: generate, info, serve, bench, calibrate. Thin: parsing and printing.

`commands` holds each command's flags and what it runs (`bench_commands`: the benchmarks');
`arguments` the flags they share.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
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


# Commands that leave nothing for exit handlers: run from the shell, they end without the
# interpreter's teardown, which frees every tensor of the loaded model one by one (a noticeable
# share of a short run).
LEAVE_AT_ONCE = ("generate", "info")


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (None: the process's arguments, as the `delspec` script does)
    and return its exit status; from the script, `LEAVE_AT_ONCE` commands exit here."""
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        status = command(args)
    except DelspecError as exc:
        print(f"delspec: error: {exc}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        print("\ndelspec: interrupted", file=sys.stderr)
        return 130
    if argv is None and args.command in LEAVE_AT_ONCE:
        for stream in (sys.stdout, sys.stderr):
            # a reader that went away (`| head`): nothing more to say to it
            with contextlib.suppress(OSError):
                stream.flush()
        os._exit(status)
    return status
