"""Per-token cost of a grammar engine's token mask on a large vocabulary: llguidance and xgrammar.

For each model's tokenizer (its whole vocabulary, as the model's logits are wide) and each
grammar (any JSON object; a JSON schema with nested objects, arrays, enums and numbers), a
matcher walks a valid document token by token: before each token it fills the mask of the
tokens allowed next (what constrained decoding computes per generated token), then consumes
the token. Reported: the grammar's compile seconds (tokenizer set-up apart) and the mask's
seconds per token (mean, median, 95th percentile, max), each engine's fastest of `--repeats`
walks. The engines take turns. Writes `results.json` and `table.md` to `--out`, naming the CPU.
llguidance is the `grammar` extra; xgrammar is measured where it is importable (its wheel pulls
in triton: `pip install --no-deps --target DIR xgrammar apache-tvm-ffi` and DIR on PYTHONPATH
is enough for this script).

    python benchmarks/grammar_masks.py --model gemma3-270m --model default
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

from delspec import load_model
from delspec.bench.environment import run_environment

RESULTS = Path(__file__).parent / "results" / "grammar-masks-zen4"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "score", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace, Countess of Lovelace",
    "age": 36,
    "email": "ada@analytical-engine.example.org",
    "tags": ["mathematics", "poetical science", "notes on the engine", "Bernoulli numbers"],
    "address": {"street": "12 St James's Square", "city": "London", "country": "FR"},
    "score": 98.25,
    "active": True,
}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np = llguidance, llguidance.numpy
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.mask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict | None):
        text = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema or {"type": "object"}),
            defaults={"whitespace_flexible": False},
        )
        return lambda: self.llg.LLMatcher(self.tokenizer, text)

    def step(self, matcher, token: int) -> float:
        t0 = time.perf_counter()
        self.np.fill_next_token_bitmask(matcher, self.mask, 0)
        seconds = time.perf_counter() - t0
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance rejected token {token}: {matcher.get_error()}")
        return seconds


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict | None):
        if schema is None:
            compiled = self.compiler.compile_builtin_json_grammar()
        else:
            compiled = self.compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(",", ":")
            )
        return lambda: self.xgr.GrammarMatcher(compiled)

    def step(self, matcher, token: int) -> float:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(self.mask)
        seconds = time.perf_counter() - t0
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar rejected token {token}")
        return seconds


def walk(engine, schema: dict | None, tokens: list[int], repeats: int) -> dict:
    """Compile seconds and the fastest walk's per-token mask seconds."""
    t0 = time.perf_counter()
    make = engine.compile(schema)
    make()
    compile_s = time.perf_counter() - t0
    best = None
    for _ in range(repeats):
        matcher = make()
        times = np.array([engine.step(matcher, t) for t in tokens])
        if best is None or times.sum() < best.sum():
            best = times
    return {
        "compile_s": round(compile_s, 4),
        "tokens": len(tokens),
        "mean_us": round(float(best.mean()) * 1e6, 1),
        "p50_us": round(float(np.median(best)) * 1e6, 1),
        "p95_us": round(float(np.percentile(best, 95)) * 1e6, 1),
        "max_us": round(float(best.max()) * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="delspec model names (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows, environment = [], None
    for model in args.model or ["gemma3-270m", "default"]:
        lm = load_model(model)
        environment = environment or run_environment(lm)
        vocab = lm.model.config.vocab_size
        text = json.dumps(DOCUMENT, separators=(",", ":"))
        tokens = lm.tokenizer.encode(text, add_special_tokens=False)
        engines = []
        for kind in (Llguidance, Xgrammar):
            if kind is Xgrammar and importlib.util.find_spec("xgrammar") is None:
                print("xgrammar is not importable: llguidance alone")
                continue
            t0 = time.perf_counter()
            engine = kind(lm.tokenizer, vocab)
            engines.append((engine, time.perf_counter() - t0))
        for grammar, schema in [("json_object", None), ("json_schema", SCHEMA)]:
            for engine, setup_s in engines:
                row = {"model": lm.name, "vocab": vocab, "engine": engine.name}
                row |= {"grammar": grammar, "tokenizer_setup_s": round(setup_s, 3)}
                row |= walk(engine, schema, tokens, args.repeats)
                print(row, flush=True)
                rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"environment": environment, "rows": rows}, indent=1) + "\n"
    )
    head = (
        "| model (vocabulary) | grammar | engine | tokenizer set-up s | compile s "
        "| mask µs/token: mean | p50 | p95 | max |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['vocab']:,}) | {r['grammar']} | {r['engine']} | "
            f"{r['tokenizer_setup_s']} | {r['compile_s']} | {r['mean_us']} | {r['p50_us']} | "
            f"{r['p95_us']} | {r['max_us']} |"
        )
    cpu = environment["cpu"] if environment else "?"
    (args.out / "table.md").write_text(
        f"# Grammar mask cost per token\n\nCPU: {cpu}; one thread per matcher; "
        f"`{environment['command'] if environment else ''}`\n\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
