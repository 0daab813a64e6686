"""What sampling costs a decoding step: `ar` greedy against `ar` sampled (and, optionally,
other strategies sampled), interleaved prompt by prompt in one process, decode tok/s apart
from the prompt's pass.

    python benchmarks/sampled_step.py --model gemma3-270m --strategies ar,del-fast
    python benchmarks/sampled_step.py --synthetic llama3.2-1b   # a 1B-class shape: step cost

With `--synthetic SHAPE` the model is `large_model.py`'s synthetic file of that shape (random
weights: its text means nothing, its logits are flat, the sampler's worst case) and only `ar`
runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from delspec import generate, load_model
from delspec.bench.environment import cpu_name
from delspec.cache import cache_dir

sys.path.insert(0, str(Path(__file__).parent))

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain why the sky is blue in three sentences.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Give me three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how a bicycle works to a ten-year-old.",
    "List five uses of a paperclip.",
    "Write a haiku about autumn rain.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--synthetic", help="a large_model.py shape instead of --model")
    parser.add_argument("--strategies", default="ar", help="comma-separated, sampled")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    prompts: list = PROMPTS
    chat = not args.synthetic
    if args.synthetic:
        from large_model import SHAPES, write_model

        path = cache_dir() / "benchmarks" / f"synthetic-{args.synthetic}.gguf"
        if not path.exists():
            write_model(path, args.synthetic)
        lm = load_model(str(path))
        strategies = ["ar"]
        rng = random.Random(1)
        prompts = [[rng.randrange(SHAPES[args.synthetic][5]) for _ in range(24)] for _ in PROMPTS]
    else:
        lm = load_model(args.model)
        strategies = args.strategies.split(",")
        chat = bool(lm.tokenizer.chat_template)
    methods = [("ar", "greedy")] + [(s, "sampled") for s in strategies]
    rates: dict[str, list[float]] = {f"{s} {how}": [] for s, how in methods}
    tokens: dict[str, int] = dict.fromkeys(rates, 0)
    for i, prompt in enumerate(prompts[:1]):  # warm-up: kernels chosen, costs measured
        for strategy, how in methods:
            generate(lm, prompt, chat=chat, max_new_tokens=16, strategy=strategy,
                     **_sampling(how, args, i))  # fmt: skip
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for strategy, how in methods:
                result = generate(
                    lm, prompt, chat=chat, max_new_tokens=args.max_new_tokens,
                    strategy=strategy, **_sampling(how, args, i),
                )  # fmt: skip
                rates[f"{strategy} {how}"].append(result.stats.tokens_per_s)
                tokens[f"{strategy} {how}"] += len(result.token_ids)
    base = statistics.median(rates["ar greedy"])
    report = {
        "model": lm.name,
        "cpu": cpu_name(),
        "sampling": {"temperature": args.temperature, "top_p": args.top_p},
        "prompts": len(prompts) * args.rounds,
        "median_decode_tok_s": {k: statistics.median(v) for k, v in rates.items()},
        "new_tokens": tokens,
    }
    print(f"{lm.name} on {report['cpu']}; sampled: T {args.temperature}, top-p {args.top_p}")
    print("method | median decode tok/s | / ar greedy | / ar sampled")
    sampled = report["median_decode_tok_s"]["ar sampled"]
    for name, rate in report["median_decode_tok_s"].items():
        print(f"{name} | {rate:.1f} | {rate / base:.2f}x | {rate / sampled:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


def _sampling(how: str, args: argparse.Namespace, seed: int) -> dict:
    if how == "greedy":
        return {}
    return {"temperature": args.temperature, "top_p": args.top_p, "seed": seed}


if __name__ == "__main__":
    main()
