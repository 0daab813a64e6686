"""How far `del-fast`'s draft sources can take a model on this machine: bounds from replaying `ar`.

For each bench prompt, `ar`'s greedy reply is replayed position by position with what a round
could draft there: the context's proposal (`ContextIndex`, as `del-fast` asks it) and drafts
from the final layer through the smallest draft vocabulary (right exactly when that vocabulary
holds the target: `ExitHead.final_layer_is_full_head`). Round costs are measured in decoding, in
plain-step units: an engine on a real prompt runs verifications of k context tokens (random
ones, so rejected: the sequence moves one token a round) and rounds of d final-layer drafts,
each between plain steps, in shuffled turns (`round_costs`); a round is charged its own median
time and what it adds to the plain steps after it (on an Intel Xeon, a verification of 9
rows slowed the four steps after it by 0.3-0.7 of a step in all, one of 19 rows by 0.6-1.3).
Two bounds per task, end to end (each prompt's prefill and `ar` step as timed in this run) and
in decode:

- oracle: every round drafts exactly what will be accepted, by the cheapest mix of the sources
  (dynamic programming over the reply's positions).
- known rates: each context proposal is drafted to the length that promises the most tokens
  per plain step under its match-length class's acceptance (`MATCH_CLASSES`; the first token's
  rate and the rate after an accepted one, counted over these very replies), final-layer drafts
  under the replies' own rate; no policy work, no warm-up, costs known exactly.

`del-fast` and `lookup` run on the same prompts in the same process beside them (one take each,
interleaved with `ar`). The bounds leave out exits below the final layer (they matter on models
whose early layers draft well, not on SmolLM2). Writes `{model}.json` and `{model}.md` to
`--out`, naming the CPU and how fast the weights read.

    python benchmarks/headroom.py --model default
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from delspec import load_model
from delspec.bench.environment import read_bandwidth, run_environment
from delspec.bench.tasks import TASKS, load_task
from delspec.decode_config import STRATEGIES, DecodeConfig
from delspec.decoding.engine import Engine
from delspec.decoding.generate import generate
from delspec.decoding.sampling import Sampling
from delspec.drafting.context_drafts import MAX_NGRAM, MIN_NGRAM, ContextIndex
from delspec.drafting.draft_head import draft_head
from delspec.policies.fast_state import MATCH_CLASSES, ContextScore

RESULTS = Path(__file__).parent / "results" / "headroom"
FINAL_DRAFTS = 4  # the most final-layer drafts a round of the bounds makes
AFTER = 4  # plain steps after a round in which it may still cost time


def round_costs(lm, head, prompt_ids: list[int], cap: int, cycles: int) -> dict[str, list[float]]:
    """Seconds a round costs, verifying k = 0..cap random context tokens ("context") or making
    d = 1..`FINAL_DRAFTS` final-layer drafts ("final", index d - 1), and what it adds to the
    `AFTER` plain steps that follow it ("context after", "final after"). Each kind runs as a
    block (a plain step, the round, `AFTER` plain steps) right after a block whose round is a
    plain step: what the kind adds is the difference of the two blocks' last `AFTER` steps.
    Kinds take shuffled turns, `cycles` times after one untimed cycle, each cycle on a fresh
    engine decoding after `prompt_ids`; medians."""
    model, rng = lm.model, random.Random(0)
    kinds = [("context", k) for k in range(cap + 1)]
    kinds += [("final", d) for d in range(1, FINAL_DRAFTS + 1)]
    own: dict[tuple[str, int], list[float]] = defaultdict(list)
    added: dict[tuple[str, int], list[float]] = defaultdict(list)
    high = min(model.config.vocab_size, 40000)

    def block(engine: Engine, kind: str, n: int) -> tuple[float, float]:
        """A plain step, the round, `AFTER` plain steps: the round's seconds and the steps'."""
        engine.round(0, 0, lambda c: True)
        start = time.perf_counter()
        if kind == "context":
            drafts = [rng.randrange(100, high) for _ in range(n)]
            engine.round(0, 0, lambda c: True, context_drafts=drafts)
        else:
            engine.round(model.num_layers, n, lambda c: True)
        middle = time.perf_counter()
        for _ in range(AFTER):
            engine.round(0, 0, lambda c: True)
        return middle - start, time.perf_counter() - middle

    for cycle in range(cycles + 1):
        engine = Engine(model, Sampling(), (), exit_head=head.for_prompt(prompt_ids))
        engine.prefill(prompt_ids, len(prompt_ids) + len(kinds) * (2 * AFTER + 4 + cap))
        rng.shuffle(kinds)
        for kind, n in kinds:
            _, reference = block(engine, "context", 0)
            seconds, steps = block(engine, kind, n)
            if cycle:
                own[kind, n].append(seconds)
                added[kind, n].append(steps - reference)
    median = {key: statistics.median(v) for key, v in own.items()}
    after = {key: statistics.median(v) for key, v in added.items()}
    finals = range(1, FINAL_DRAFTS + 1)
    return {
        "context": [median["context", k] for k in range(cap + 1)],
        "final": [median["final", d] for d in finals],
        "context after": [after["context", k] for k in range(cap + 1)],
        "final after": [after["final", d] for d in finals],
    }


def accepted(reply: list[int], at: int, tokens: list[int]) -> int:
    """How many of `tokens`, drafted at position `at` of `reply`, match it."""
    n = 0
    while n < len(tokens) and at + n < len(reply) and tokens[n] == reply[at + n]:
        n += 1
    return n


def final_run(held: list[bool], at: int, most: int) -> int:
    """How many final-layer drafts from position `at` on would be accepted (up to `most`)."""
    n = 0
    while n < most and at + n < len(held) and held[at + n]:
        n += 1
    return n


def oracle(reply, proposals, held, context, final) -> float:
    """Least plain steps that decode `reply` with drafts that are always accepted."""
    n, step = len(reply), final[1] - final[0] if len(final) > 1 else final[0]
    cost = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best = 1.0 + cost[i + 1]
        a = accepted(reply, i, proposals[i].tokens)
        if a:
            best = min(best, context[a] + cost[min(n, i + a + 1)])
        d = final_run(held, i, FINAL_DRAFTS)
        if d:
            best = min(best, final[d - 1] + cost[min(n, i + d + 1)])
        if a:  # the context's tokens, then final-layer drafts after them
            d = final_run(held, i + a, FINAL_DRAFTS)
            if d:
                rows = min(a + d, len(context) - 1)
                best = min(best, context[rows] + d * step + cost[min(n, i + a + d + 1)])
        cost[i] = best
    return cost[0]


def known_rates(reply, proposals, held, context, final, rates, alpha) -> float:
    """Plain steps of a replay that drafts each round's best under average acceptance."""
    i, spent, n = 0, 0.0, len(reply)
    while i < n:
        value, choice = 1.0, ("plain", 0)
        tokens = proposals[i].tokens[: len(context) - 1]
        if tokens:
            first, then = rates[ContextScore.match_class(proposals[i].match_length)]
            expected, chance = 1.0, first
            for k in range(1, len(tokens) + 1):
                expected, chance = expected + chance, chance * then
                if expected / context[k] > value:
                    value, choice = expected / context[k], ("context", k)
        expected, chance = 1.0, alpha
        for d in range(1, len(final) + 1):
            expected, chance = expected + chance, chance * alpha
            if expected / final[d - 1] > value:
                value, choice = expected / final[d - 1], ("final", d)
        kind, k = choice
        if kind == "plain":
            spent, i = spent + 1.0, i + 1
        elif kind == "context":
            spent, i = spent + context[k], i + accepted(reply, i, tokens[:k]) + 1
        else:
            spent, i = spent + final[k - 1], i + final_run(held, i, k) + 1
    return spent


def class_rates(replays) -> dict[int, tuple[float, float]]:
    """Per match-length class: the rate of first tokens accepted, and of tokens after an
    accepted one (over every position's proposal), with one unseen miss each."""
    counts = defaultdict(lambda: [0, 0, 0, 0])  # proposals, first accepted, tried after, accepted
    for reply, proposals, _ in replays:
        for i, proposal in enumerate(proposals):
            if proposal.tokens:
                c, a = (
                    counts[ContextScore.match_class(proposal.match_length)],
                    accepted(reply, i, proposal.tokens),
                )
                c[0], c[1] = c[0] + 1, c[1] + (a > 0)
                if a:
                    c[2], c[3] = c[2] + min(a, len(proposal.tokens) - 1), c[3] + a - 1
    return {cls: (c[1] / (c[0] + 1), c[3] / (c[2] + 1)) for cls, c in counts.items()}


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    lm = load_model(None if args.model == "default" else args.model)
    head = draft_head(lm, DecodeConfig())
    cap = STRATEGIES["del-fast"].draft_cap  # context tokens a round may take
    prompts = [(task, p) for task in TASKS for p in load_task(task, args.num_samples)]
    encoded = [(task, lm.tokenizer.encode(p.text)) for task, p in prompts]
    read_start = read_bandwidth(lm.model.weight_bytes)
    seconds = round_costs(lm, head, encoded[0][1], cap, args.cycles)
    plain = seconds["context"][0]
    # what a round costs: its own time and what it adds to the steps after it
    context = [
        (s + a) / plain for s, a in zip(seconds["context"], seconds["context after"], strict=True)
    ]
    final = [(s + a) / plain for s, a in zip(seconds["final"], seconds["final after"], strict=True)]
    methods = ("ar", "del-fast", "lookup")
    for method in methods:  # warm-up (del-fast: its cost profile and what it learns)
        generate(lm, encoded[0][1], strategy=method, max_new_tokens=args.max_new_tokens)
    replays, timed = [], []
    for index, (task, ids) in enumerate(encoded):
        walls = {}
        for method in methods[index % 3 :] + methods[: index % 3]:
            start = time.perf_counter()
            result = generate(lm, ids, strategy=method, max_new_tokens=args.max_new_tokens)
            walls[method] = time.perf_counter() - start
            if method == "ar":
                reply, stats = result.token_ids, result.stats
        index_of, vocab = ContextIndex(ids, MIN_NGRAM, MAX_NGRAM), head.for_prompt(ids)
        proposals, held = [], []
        for token in reply:
            proposals.append(index_of.propose(cap))
            held.append(vocab.held([token])[0][0])
            index_of.extend([token])
            vocab.admit([token])
        replays.append((reply, proposals, held))
        timed.append((task, stats.prefill_ms / 1000, walls))
    rates = class_rates(replays)
    alpha = sum(sum(h) for *_, h in replays) / max(1, sum(len(h) for *_, h in replays))
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (reply, proposals, held), (task, prefill, walls) in zip(replays, timed, strict=True):
        step = (walls["ar"] - prefill) / max(1, len(reply))
        bounds = {
            "oracle": oracle(reply, proposals, held, context, final),
            "known rates": known_rates(reply, proposals, held, context, final, rates, alpha),
        }
        for key in (task, "overall"):
            s = sums[key]
            s["tokens"] += len(reply)
            for method, wall in walls.items():
                s[method] += wall
            for name, steps in bounds.items():
                s[name] += prefill + steps * step
                s[name + " steps"] += steps
    table = {
        key: {
            **{m: s["ar"] / s[m] for m in methods[1:]},
            **{n: s["ar"] / s[n] for n in ("oracle", "known rates")},
            **{n + " decode": s["tokens"] / s[n + " steps"] for n in ("oracle", "known rates")},
        }
        for key, s in sorted(sums.items(), key=lambda item: item[0] == "overall")
    }
    return {
        "model": lm.describe()["name"],
        "environment": run_environment(lm),
        "read_gb_per_s": [read_start, read_bandwidth(lm.model.weight_bytes)],
        "settings": vars(args),
        "round_costs_in_plain_steps": {
            "context": context,
            "final": final,
            "plain_s": plain,
            "own": {kind: [x / plain for x in seconds[kind]] for kind in ("context", "final")},
            "after": {
                kind: [x / plain for x in seconds[kind + " after"]] for kind in ("context", "final")
            },
        },
        "class_rates": {str(MATCH_CLASSES[c]): r for c, r in sorted(rates.items())},
        "final_layer_rate": alpha,
        "speedup_over_ar": table,
    }


def markdown(result: dict) -> str:
    env, costs = result["environment"], result["round_costs_in_plain_steps"]
    start, end = result["read_gb_per_s"]
    own, after = costs["own"], costs["after"]
    shown = [k for k in (1, 2, 4, 8, 12, 18) if k < len(own["context"])]
    lines = [
        f"# Headroom: {result['model']}",
        "",
        f"{env['date']} · {env['cpu']} · {env['threads']} thread(s) · torch {env['torch']} · "
        f"the weights read at {start:.1f} GB/s at the start, {end:.1f} at the end",
        "",
        f"A round's cost in plain steps (one: {costs['plain_s'] * 1000:.2f} ms): its own time +"
        f" what it adds to the {AFTER} plain steps after it.",
        "",
        "| round | "
        + " | ".join(f"{k} context" for k in shown)
        + " | "
        + " | ".join(f"{d} final" for d in range(1, len(own["final"]) + 1))
        + " |",
        "|---" * (1 + len(shown) + len(own["final"])) + "|",
        "| cost | "
        + " | ".join(f"{own['context'][k]:.2f} + {after['context'][k]:.2f}" for k in shown)
        + " | "
        + " | ".join(
            f"{o:.2f} + {a:.2f}" for o, a in zip(own["final"], after["final"], strict=True)
        )
        + " |",
        "",
        "| task | del-fast | lookup | known-rates bound | oracle bound | decode bounds |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in result["speedup_over_ar"].items():
        decode = f"{row['known rates decode']:.2f}x / {row['oracle decode']:.2f}x"
        lines.append(
            f"| {key} | {row['del-fast']:.2f}x | {row['lookup']:.2f}x | {row['known rates']:.2f}x"
            f" | {row['oracle']:.2f}x | {decode} |"
        )
    lines += [
        "",
        "End-to-end tokens/s over `ar`'s, measured in this run (del-fast, lookup) or bounded;",
        "decode bounds: known rates / oracle, in decode tokens/s over `ar`'s. k context: a round",
        "verifying k context tokens (k + 1 rows); d final: one making d final-layer drafts.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-samples", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=20, help="shuffled turns of round costs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    name = result["model"].split(".")[0].lower()
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
