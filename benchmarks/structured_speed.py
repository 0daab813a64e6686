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
    "Isaac Newton published the Principia in 1687, setting out his laws of motion and gravity.",
    "In 1953 Edmund Hillary and Tenzing Norgay reached the summit of Mount Everest.",
    "Jesse Owens won four gold medals at the 1936 Olympic Games in Berlin.",
    "Vincent van Gogh painted The Starry Night in 1889 while staying at Saint-Remy.",
    "In 1492 Christopher Columbus crossed the Atlantic with three ships from Spain.",
    "Rosalind Franklin's X-ray images of 1952 helped Watson and Crick describe DNA in 1953.",
    "The Wright brothers flew the first powered aeroplane at Kitty Hawk in 1903.",
    "Serena Williams won her first Grand Slam singles title at the 1999 US Open.",
    "Johann Sebastian Bach wrote the Brandenburg Concertos, presented in 1721.",
    "The printing press of Johannes Gutenberg produced its famous Bible around 1455.",
    "Albert Einstein published his theory of special relativity in 1905 in Bern.",
    "In 1963 Valentina Tereshkova became the first woman to fly in space.",
    "Frida Kahlo painted The Two Fridas in 1939 in Mexico City.",
    "The Magna Carta was sealed by King John at Runnymede in 1215.",
    "Usain Bolt ran the 100 metres in 9.58 seconds in Berlin in 2009.",
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
    valid = 0  # replies that parse and validate against the schema
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
                try:
                    jsonschema.validate(json.loads(result.text), SCHEMA)
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as error:
                    print(f"not valid ({result.finish_reason}): {error}", flush=True)
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
        json.dumps(
            {"environment": environment, "model": lm.name, "valid": valid, "rows": rows}, indent=1
        )
        + "\n"
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
        f"greedy, every strategy's tokens equal to the first's; {valid} of {len(TEXTS)} replies "
        "parse and validate against the schema.\n\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
