"""Decode tokens/s of `delspec generate --strategy ar` with 1 and 2 threads, with and without
busy loops on every core, for one or more builds of the package (source trees), interleaved.

    python3 benchmarks/contention.py --sources old=/tmp/old/src new=src --repeats 3

Each measurement is a fresh `delspec generate ... --json` process (so each build compiles and
loads its own kernels); the hog is one `while True: pass` process per core, started before and
killed after each measurement. Prints one JSON line per measurement and a summary (median
decode tokens/s per condition). Timings on a shared machine are noisy: repeat and interleave.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "The history of the Roman empire"
RUN = "import sys; from delspec.cli import main; sys.argv[0] = 'delspec'; main()"


def hogs(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def measure(source: str, threads: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": source}
    command = [sys.executable, "-c", RUN, "generate", PROMPT, "--strategy", "ar", "--json"]
    command += ["--max-new-tokens", str(args.tokens), "--threads", str(threads)]
    command += ["--model", args.model]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    stats = json.loads(out.stdout)["stats"]
    return {"decode_tok_s": round(1000.0 / stats["decode_ms_per_token"], 2),
            "tokens": stats["new_tokens"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", nargs="+", default=["new=src"], help="NAME=PATH ...")
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hog", default="off,on", help="off, on or off,on")
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    sources = dict(item.split("=", 1) for item in args.sources)
    results: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for hog in args.hog.split(","):
            for name, path in sources.items():
                for threads in map(int, args.threads.split(",")):
                    busy = hogs(os.cpu_count() or 1) if hog == "on" else []
                    try:
                        time.sleep(0.2 if busy else 0)
                        row = measure(path, threads, args)
                    finally:
                        for p in busy:
                            p.kill()
                            p.wait()
                    row.update(model=args.model, build=name, threads=threads, hog=hog)
                    print(json.dumps(row), flush=True)
                    results.setdefault((hog, name, threads), []).append(row["decode_tok_s"])
    print("hog build threads median [all]")
    for (hog, name, threads), values in results.items():
        print(hog, name, threads, round(statistics.median(values), 1), values)


if __name__ == "__main__":
    main()
