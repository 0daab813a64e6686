"""Prompt tokens per second of a prefill, delspec against llama.cpp, by prompt length.

delspec's figure is `generate`'s own prefill time (`Stats.prefill_ms`, plain `ar`, one new
token); llama.cpp's is llama-cpp-python's `Llama.eval` of the same tokens after a `reset`, with
the same thread count and a batch of 512. Random prompts, one per length, fixed seed; the two
engines take turns and each length keeps its fastest of `--repeats`. Writes `{model}.json` and
`table.md` (every model's file) to `--out`, naming the CPU.

    python benchmarks/prefill.py --model smollm2 --model gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from delspec import load_model
from delspec.bench.environment import run_environment
from delspec.decoding.generate import generate

RESULTS = Path(__file__).parent / "results" / "prefill"


def measure(model: str, lengths: list[int], repeats: int, threads: int) -> dict:
    """Fastest prompt tokens/s of each engine at each length (llama.cpp's None without it)."""
    torch.set_num_threads(threads)
    lm = load_model(model)
    try:
        import llama_cpp
    except ImportError:
        llama = None
        print("llama-cpp-python is not installed (make install-llama): delspec alone")
    else:
        llama = llama_cpp.Llama(
            model_path=str(lm.source), n_threads=threads, n_threads_batch=threads,
            n_ctx=max(lengths) + 8, n_batch=512, verbose=False,
        )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    high = min(lm.model.config.vocab_size, 20000)
    prompts = {n: torch.randint(100, high, (n,), generator=generator).tolist() for n in lengths}
    generate(lm, prompts[lengths[0]], strategy="ar", max_new_tokens=1)  # warm-up
    seconds: dict[str, dict[int, float]] = {"delspec": {}, "llama.cpp": {}}
    for _ in range(repeats):
        for n, ids in prompts.items():
            took = generate(lm, ids, strategy="ar", max_new_tokens=1).stats.prefill_ms / 1000
            seconds["delspec"][n] = min(seconds["delspec"].get(n, took), took)
            if llama is not None:
                llama.reset()
                start = time.perf_counter()
                llama.eval(ids)
                took = time.perf_counter() - start
                seconds["llama.cpp"][n] = min(seconds["llama.cpp"].get(n, took), took)
    return {
        "model": model,
        "environment": run_environment(lm),
        "repeats": repeats,
        "tok_s": {
            engine: {str(n): round(n / s, 1) for n, s in by_length.items()}
            for engine, by_length in seconds.items()
        },
    }


def render(reports: list[dict]) -> str:
    """`table.md` from every model's report."""
    lines = ["# Prefill: prompt tokens per second, delspec `ar` against llama.cpp", ""]
    for report in reports:
        ours, theirs = report["tok_s"]["delspec"], report["tok_s"]["llama.cpp"]
        env = report["environment"]
        lines += [
            f"## {report['model']}",
            "",
            f"CPU: {env['cpu']}; {env['threads']} threads; llama-cpp-python "
            f"{env['llama_cpp_python']}; fastest of {report['repeats']} interleaved; "
            f"{env['date']}.",
            "",
            f"`{env['command']}`",
            "",
            "| prompt tokens | delspec tok/s | llama.cpp tok/s | delspec / llama.cpp |",
            "|---|---|---|---|",
        ]
        for n, tok_s in ours.items():
            other = theirs.get(n)
            ratio = f"{tok_s / other:.2f}x" if other else "–"
            lines.append(f"| {n} | {tok_s:.1f} | {other or '–'} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="named model or GGUF file (repeatable)")
    parser.add_argument("--lengths", default="256,1024,3072")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    for model in args.model or ["smollm2"]:
        report = measure(model, lengths, args.repeats, args.threads)
        name = Path(model).stem if model.endswith(".gguf") else model
        (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["tok_s"]))
    reports = [json.loads(path.read_text()) for path in sorted(args.out.glob("*.json"))]
    (args.out / "table.md").write_text(render(reports))


if __name__ == "__main__":
    main()
