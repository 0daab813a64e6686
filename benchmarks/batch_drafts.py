"""Batched steps with and without context drafts (`BatchDrafts`), as the server runs them.

Groups of `--batch` bench prompts (the five tasks, 3 each) are decoded together in one batched
pass per step (`step_together`), each sequence with the `lookup` strategy's context proposals,
once with no drafts and once with the drafts `BatchDrafts` chooses from the batch cost measured
here; the two take turns, twice each, and the faster of each pair counts. Every group's tokens
must be the same both ways (greedy). Writes `results.json` and `table.md` to `--out`.

    python benchmarks/batch_drafts.py --batch 2 --batch 4 --out benchmarks/results/batch-drafts
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from delspec import load_model
from delspec.bench.tasks import load_task
from delspec.decoding.batch import start_together, step_together
from delspec.decoding.sequence import Decoding
from delspec.drafting.batch_drafts import BatchDrafts
from delspec.kernels.build import cpu_name
from delspec.machine.batching import measured_batch_seconds
from delspec.policies import make_policy

TASKS = ("humaneval", "gsm8k", "summarization", "continuation", "mtbench")


def decode_group(lm, prompts: list[list[int]], seconds: dict[int, float], tokens: int) -> dict:
    """Decode `prompts` together to the end; drafts chosen from `seconds` (empty: none)."""
    model = lm.model
    with torch.inference_mode():
        model.setup_cache(max(map(len, prompts)) + tokens + 1, len(prompts))
    eos = [lm.tokenizer.eos_token_id]
    decodings = [
        Decoding(model, ids, make_policy("lookup", model.num_layers), max_new_tokens=tokens,
                 slot=slot, eos_token_ids=eos)
        for slot, ids in enumerate(prompts)
    ]  # fmt: skip
    start_together(decodings)
    drafts = BatchDrafts(seconds)
    steps = drafted = 0
    start = time.perf_counter()
    while not all(d.done for d in decodings):
        active = [d for d in decodings if not d.done]
        chosen = drafts.choose([d.proposal(drafts.limit) for d in active])
        committed = step_together(active, chosen)
        drafts.observe(chosen, [accepted for _, accepted in committed])
        steps, drafted = steps + 1, drafted + sum(map(len, chosen))
    seconds_taken = time.perf_counter() - start
    outputs = [d.finish().token_ids for d in decodings]
    generated = sum(map(len, outputs))
    return {"tokens": generated, "seconds": seconds_taken, "steps": steps, "drafted": drafted,
            "tok_s": generated / seconds_taken, "outputs": outputs}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, action="append", help="sequences per group")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("batch-drafts-results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    prompts = [lm.tokenizer.encode(p.text) for task in TASKS for p in load_task(task, 3)]
    seconds = measured_batch_seconds(lm.model)
    rows = []
    for batch in args.batch or [2, 4]:
        for first in range(0, len(prompts) - batch + 1, batch):
            group = prompts[first : first + batch]
            runs = {"plain": [], "drafts": []}
            for kind in ("plain", "drafts", "drafts", "plain"):
                runs[kind].append(decode_group(lm, group, seconds if kind == "drafts" else {},
                                               args.tokens))  # fmt: skip
            best = {kind: min(r, key=lambda run: run["seconds"]) for kind, r in runs.items()}
            if best["plain"]["outputs"] != best["drafts"]["outputs"]:
                raise SystemExit(f"group at prompt {first}: tokens differ with drafts")
            row = {"batch": batch, "first_prompt": first}
            for kind, run in best.items():
                row |= {f"{kind}_{k}": round(v, 3) for k, v in run.items() if k != "outputs"}
            row["speedup"] = round(row["drafts_tok_s"] / row["plain_tok_s"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    header = {"model": lm.name, "cpu": cpu_name(), "threads": args.threads,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "batch_seconds": {str(k): round(v, 6) for k, v in seconds.items()}}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps({**header, "groups": rows}, indent=1))
    lines = [
        f"# Batched steps with context drafts: {lm.name}",
        "",
        f"{header['date']} · {header['cpu']} · {args.threads} thread(s) · {args.tokens} new "
        "tokens per sequence, greedy, `lookup` proposals; the faster of two runs each, "
        "interleaved. Batched step ms by rows: "
        + ", ".join(f"{k}: {v * 1000:.2f}" for k, v in seconds.items()),
        "",
        "| batch | prompts | plain tok/s (steps) | with drafts tok/s (steps, drafted) | speedup |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['first_prompt']}-{r['first_prompt'] + r['batch'] - 1} | "
            f"{r['plain_tok_s']:.1f} ({r['plain_steps']}) | {r['drafts_tok_s']:.1f} "
            f"({r['drafts_steps']}, {r['drafts_drafted']}) | {r['speedup']:.2f}x |"
        )
    (args.out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
