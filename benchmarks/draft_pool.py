"""Decode speed with the draft pool (context drafts from earlier replies) on and off, and `ar`.

Three workloads of chat prompts, each prompt decoded greedily by `ar`, by `del-fast` without a
pool and by `del-fast` with one pool shared by all its runs (as `delspec serve` shares one),
the three interleaved prompt by prompt in rotating order so that the machine's drift is shared:

- `template`: one extraction instruction over different short records (the replies repeat the
  instruction's template, the values change);
- `repeat`: the same few questions asked again (an agent loop re-running a step);
- `unrelated`: varied chats that share little (the pool should neither help nor cost).

Every delspec output is checked against `ar`'s token for token. Decode tokens per second are
the workload's generated tokens over its decode seconds (prefill excluded). Writes
`results.json` and `table.md` to `--out`.

    python benchmarks/draft_pool.py --out benchmarks/results/draft-pool-zen4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import delspec
from delspec import load_model
from delspec.bench.environment import model_info, run_environment
from delspec.drafting.draft_pool import DraftPool

RECORDS = [
    "Maria Lopez, 34, lives in Madrid and works as a nurse.",
    "Tom Becker is a 51-year-old carpenter from Hamburg.",
    "Aiko Tanaka (27) is a software tester living in Osaka.",
    "Lena Novak, a 45-year-old teacher, lives in Prague.",
    "Samuel Okafor, 39, is a pharmacist based in Lagos.",
    "Priya Sharma works as an architect in Pune; she is 31.",
    "Jonas Berg, 62, is a retired pilot who lives in Oslo.",
    "Fatima Haddad is a 29-year-old journalist from Beirut.",
    "Carlos Mendes (48) runs a bakery in Porto.",
    "Olga Ivanova, 36, is a chemist working in Kazan.",
    "Ahmed Saleh, 57, is a tailor with a shop in Cairo.",
    "Emma Wilson is a 23-year-old barista in Leeds.",
    "Kenji Mori (44) teaches mathematics in Sapporo.",
    "Sofia Rossi, 38, is a veterinarian living in Bologna.",
    "Daniel Kim works as a firefighter in Busan; he is 30.",
    "Ines Dubois, 66, is a retired librarian from Lyon.",
    "Mateo Garcia is a 19-year-old student in Valencia.",
    "Hannah Fischer, 41, is an engineer based in Graz.",
    "Ravi Patel (52) drives a taxi in Leicester.",
    "Nadia Kowalski, 27, is a photographer in Gdansk.",
]
TEMPLATE = (
    "Extract the person's details from the text below as JSON with the keys "
    '"name", "age", "city" and "job", then one sentence saying who they are.\n\nText: '
)
QUESTIONS = [
    "List the planets of the solar system, one per line.",
    "Write a Python function that checks whether a number is prime.",
]
UNRELATED = [
    "Why do cats purr?",
    "Give me three tips for a job interview.",
    "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.",
    "How does a bicycle stay upright?",
    "Suggest a name for a small bakery.",
    "Explain what a black hole is to a child.",
    "What should I pack for a weekend hike?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How do vaccines train the immune system?",
]
WORKLOADS = {
    "template": [TEMPLATE + record for record in RECORDS],
    "repeat": QUESTIONS * 3,
    "unrelated": UNRELATED,
}
METHODS = ("ar", "del-fast", "del-fast+pool")


def run(args: argparse.Namespace) -> dict[str, Any]:
    lm = load_model(args.model)
    pool = DraftPool(args.pool_tokens)
    delspec.generate(lm, "Hello", max_new_tokens=8)  # cost profile read, kernels built
    totals: dict[str, dict[str, list[float]]] = {}
    for name, prompts in WORKLOADS.items():
        sums = totals[name] = {m: [0.0, 0.0, 0.0, 0.0] for m in METHODS}  # tokens, s, pool, ok
        for i, prompt in enumerate(prompts):
            chat = [{"role": "user", "content": prompt}]
            order = METHODS[i % 3 :] + METHODS[: i % 3]
            outputs = {}
            for method in order:
                options: dict[str, Any] = {"strategy": method.removesuffix("+pool")}
                if method.endswith("+pool"):
                    options["draft_pool"] = pool
                result = delspec.generate(lm, chat, max_new_tokens=args.max_new_tokens, **options)
                stats, outputs[method] = result.stats, result.token_ids
                sums[method][0] += stats.new_tokens
                sums[method][1] += stats.decode_ms_per_token * stats.new_tokens / 1000
                sums[method][2] += stats.pool_accepted
            for method in METHODS:
                sums[method][3] += outputs[method] == outputs["ar"]
    return {
        "model": model_info(lm),
        "environment": run_environment(lm),
        "max_new_tokens": args.max_new_tokens,
        "pool_tokens": args.pool_tokens,
        "workloads": {
            name: {
                m: {
                    "tokens": int(s[0]),
                    "tokens_per_s": round(s[0] / s[1], 2),
                    "pool_accepted": int(s[2]),
                    "identical_to_ar": f"{int(s[3])}/{len(WORKLOADS[name])}",
                }
                for m, s in sums.items()
            }
            for name, sums in totals.items()
        },
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        "| workload | ar tok/s | del-fast tok/s | del-fast + pool tok/s | pool / no pool | "
        "pool tokens accepted | identical to ar |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in results["workloads"].items():
        ar, off, on = (rows[m]["tokens_per_s"] for m in METHODS)
        same = ", ".join(rows[m]["identical_to_ar"] for m in METHODS[1:])
        lines.append(
            f"| {name} | {ar} | {off} | {on} | {on / off:.2f}x | "
            f"{rows['del-fast+pool']['pool_accepted']} | {same} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--pool-tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "table.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
