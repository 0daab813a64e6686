"""Constrained decoding's speed by strategy: JSON replies to extraction prompts under a JSON
schema, each strategy against constrained `ar` on the same prompts (greedy; tokens checked
equal, replies checked against the schema). Reports decode tokens per second per strategy
(all prompts' tokens over all their decode time) and the speed-up over `ar`; writes
`results.json` and `table.md` to `--out`, naming the CPU.

    python benchmarks/structured_speed.py --model default --strategies ar,del-fast,lookup
    python benchmarks/structured_speed.py --model gemma3-270m \
        --out benchmarks/results/structured-speed-zen4/gemma3-270m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema

from delspec import generate, json_grammar, load_model
from delspec.bench.environment import run_environment

RESULTS = Path(__file__).parent / "results" / "structured-speed-zen4" / "smollm2"

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "year": {"type": "integer", "minimum": 0, "maximum": 3000},
        "topic": {"type": "string", "enum": ["science", "history", "sport", "art", "other"]},
        "summary": {"type": "string", "maxLength": 160},
    },
    "required": ["title", "people", "year", "topic", "summary"],
    "additionalProperties": False,
}
TEXTS = [
    "In 1969 Neil Armstrong and Buzz Aldrin walked on the Moon while Michael Collins orbited.",
    "Marie Curie won the Nobel Prize in Chemistry in 1911 for discovering radium and polonium.",
    "In 1998 France beat Brazil 3-0 in the World Cup final; Zinedine Zidane scored twice.",
    "Leonardo da Vinci painted the Mona Lisa in the early sixteenth century in Florence.",
    "The Berlin Wall fell in 1989, and Germany was reunified the following year.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--strategies", default="ar,del-fast,lookup")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    lm = load_model(args.model)
    grammar = json_grammar(SCHEMA)
    strategies = args.strategies.split(",")
    tokens = {s: 0 for s in strategies}
    seconds = {s: 0.0 for s in strategies}
    for text in TEXTS:
        ask = f"Extract the facts of this text as JSON: {text}"
        if lm.tokenizer.chat_template:  # else the instruction as plain text
            ask = [{"role": "user", "content": ask}]
        else:
            ask += "\nJSON: "
        reference = None
        for strategy in strategies:  # interleaved per prompt
            result = generate(
                lm, ask, strategy=strategy, grammar=grammar, max_new_tokens=args.max_new_tokens
            )
            if reference is None:
                reference = result
                if result.finish_reason == "stop":
                    jsonschema.validate(json.loads(result.text), SCHEMA)
            elif result.token_ids != reference.token_ids:
                raise SystemExit(f"{strategy} differs from {strategies[0]} on {text!r}")
            tokens[strategy] += result.stats.new_tokens
            seconds[strategy] += result.stats.new_tokens / max(result.stats.tokens_per_s, 1e-9)
    rows = []
    base = tokens[strategies[0]] / seconds[strategies[0]]
    for strategy in strategies:
        speed = tokens[strategy] / seconds[strategy]
        row = {"strategy": strategy, "tokens": tokens[strategy], "tokens_per_s": round(speed, 2)}
        rows.append({**row, "speedup": round(speed / base, 3)})
        print(rows[-1], flush=True)
    environment = run_environment(lm)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"environment": environment, "model": lm.name, "rows": rows}, indent=1) + "\n"
    )
    lines = [
        "| strategy | tokens | decode tokens/s | vs " + strategies[0] + " |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['strategy']} | {r['tokens']} | {r['tokens_per_s']} | {r['speedup']}x |" for r in rows
    ]
    (args.out / "table.md").write_text(
        f"# Constrained decoding by strategy ({lm.name})\n\nCPU: {environment['cpu']}; "
        f"threads {environment['threads']}; `{environment['command']}`; {len(TEXTS)} prompts, "
        "greedy, every strategy's tokens equal to the first's.\n\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
