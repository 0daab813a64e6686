"""What a quick cost profile gives up against a thorough one: `del-fast` decode speed from each,
beside `ar`, interleaved per prompt in one process.

Both profiles are measured here, each into a directory of its own (a first run measures the
quick one; the server and `delspec bench` the thorough one), and timed as `delspec bench`'s
tasks prompt them (3 prompts per task, 128 new tokens, greedy). Each profile's policies carry
what they learn from prompt to prompt apart from the other's. Prints, and writes to `--out`,
the seconds each measurement took and decode tok/s per method; every method's tokens are
checked against `ar`'s.

    python benchmarks/cost_profiles.py --model default --out benchmarks/results/cost-profiles-zen4
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from delspec import PRESETS, load_model
from delspec.bench.environment import cpu_name
from delspec.bench.tasks import load_task
from delspec.decoding.generate import encode_prompt
from delspec.decoding.sequence import Decoding
from delspec.drafting.draft_head import draft_head
from delspec.machine.profile import MachineProfile
from delspec.policies import PolicyInputs, make_policy
from delspec.policies.cost_model import MeasuredCost

TASKS = ("humaneval", "gsm8k", "summarization", "continuation", "mtbench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=3, help="prompts per task")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lm = load_model(args.model, threads=args.threads)
    model, config = lm.model, PRESETS["fast"]
    head = draft_head(lm, config)
    probe = make_policy(config, model.num_layers)
    middle = probe.base_candidates[len(probe.base_candidates) // 2]
    profiles, measure_s = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for name in ("thorough", "quick"):
            start = time.perf_counter()
            machine = MachineProfile(model, args.threads, root=Path(folder) / name)
            profile = machine.cost_profile(head, middle, probe.draft_cap + 1, name == "thorough")
            profiles[name], measure_s[name] = profile, time.perf_counter() - start
    prompts = [p.text for task in TASKS for p in load_task(task, args.samples)]
    learned = {name: {} for name in profiles}
    seconds, tokens = dict.fromkeys(["ar", *profiles], 0.0), dict.fromkeys(["ar", *profiles], 0)
    for repeat in range(args.repeats):
        for i, text in enumerate(prompts):
            ids = encode_prompt(lm, text)
            order = ["ar", *profiles]
            order = order if (i + repeat) % 2 == 0 else order[::-1]
            outputs = {}
            for name in order:
                if name == "ar":
                    policy = make_policy("ar", model.num_layers)
                else:
                    policy = make_policy(
                        config, model.num_layers, PolicyInputs(learned=learned[name])
                    )
                    policy.cost = MeasuredCost(profiles[name], model.num_layers)
                out = Decoding(
                    model,
                    ids,
                    policy,
                    max_new_tokens=args.max_new_tokens,
                    eos_token_ids=lm.eos_token_ids,
                    exit_head=head,
                ).run()
                outputs[name] = out.token_ids
                seconds[name] += out.stats.decode_ms_per_token * out.stats.new_tokens / 1e3
                tokens[name] += out.stats.new_tokens
            assert all(ids == outputs["ar"] for ids in outputs.values()), "not lossless"
    report = {
        "model": lm.name,
        "cpu": cpu_name(),
        "threads": args.threads,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "measure_s": {k: round(v, 2) for k, v in measure_s.items()},
        "decode_tok_s": {k: round(tokens[k] / seconds[k], 1) for k in seconds},
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{lm.name}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
