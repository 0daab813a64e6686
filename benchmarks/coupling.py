"""How often an exit layer's sampled draft is accepted: by the target's own seeded draw (the
Gumbel-max coupling delspec uses, which makes a seed reproduce a text under every strategy)
against the rejection sampling of speculative sampling (Leviathan et al.; accepted with
probability sum(min(p, q))), and the greedy agreement beside them.

For each prompt, `ar` samples a continuation; one pass over prompt and continuation keeps
every layer's states; at each generated position, p is the processed target distribution
(`Sampling.probs`) and q the exit layer's (final norm + LM head on layer E's state, under the
same controls). Gumbel acceptance is estimated by drawing the shared noise many times over
the tokens either distribution keeps. Context drafts (one certain token) are accepted with
probability p(token) under both schemes, so only exit-layer drafts are compared.

    python benchmarks/coupling.py --model smollm2 --temperature 0.7 --top-p 0.9
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from delspec import Sampling, generate, load_model
from delspec.bench.environment import cpu_name
from delspec.decoding.generate import encode_prompt

sys.path.insert(0, str(Path(__file__).parent))
from sampled_step import PROMPTS


def acceptance(p: torch.Tensor, q: torch.Tensor, draws: int, g: torch.Generator) -> float:
    """P(the draft's Gumbel-max draw equals the target's) under shared noise, estimated."""
    support = ((p > 0) | (q > 0)).nonzero().flatten()
    lp, lq = p[support].log(), q[support].log()
    u = torch.rand(draws, len(support), generator=g, dtype=torch.float64).clamp_min(1e-300)
    noise = -(-u.log()).log()
    return float(((lp + noise).argmax(1) == (lq + noise).argmax(1)).double().mean())


def measure(args: argparse.Namespace) -> dict:
    lm = load_model(args.model)
    model = lm.model
    layers = model.num_layers
    exits = sorted({max(1, round(layers * f)) for f in (0.25, 0.5, 0.75)} | {layers - 2})
    sampling = Sampling(args.temperature, top_p=args.top_p, top_k=args.top_k)
    chat = bool(lm.tokenizer.chat_template)
    sums = {e: {"gumbel": 0.0, "rejection": 0.0, "greedy": 0.0} for e in exits}
    positions = 0
    g = torch.Generator().manual_seed(0)
    for i, prompt in enumerate(PROMPTS[: args.prompts]):
        ids = encode_prompt(lm, prompt, chat)
        out = generate(
            lm, ids, strategy="ar", max_new_tokens=args.new_tokens,
            sampling=Sampling(**{**vars_of(sampling), "seed": i}),
        ).token_ids  # fmt: skip
        seq = ids + out
        model.setup_cache(len(seq) + 1)
        states: list[torch.Tensor] = []
        with torch.inference_mode():
            final = model.run_layers(model.embed(seq), 0, 0, layers, states)
            for k in range(len(out)):
                t = len(ids) - 1 + k
                p = sampling.probs(model.head(final[t : t + 1])[0].double(), ids, out[:k])
                for e in exits:
                    logits = model.head(states[e - 1][t : t + 1])[0].double()
                    q = sampling.probs(logits, ids, out[:k])
                    sums[e]["gumbel"] += acceptance(p, q, args.draws, g)
                    sums[e]["rejection"] += float(torch.minimum(p, q).sum())
                    sums[e]["greedy"] += float(p.argmax() == q.argmax())
        positions += len(out)
    return {
        "model": lm.name,
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
        "positions": positions,
        "layers": layers,
        "acceptance": {e: {k: v / positions for k, v in s.items()} for e, s in sums.items()},
    }


def vars_of(sampling: Sampling) -> dict:
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draws", type=int, default=2000, help="noise draws per position")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    result = measure(args)
    head = f"{result['model']} on {result['cpu']}, {result['positions']} positions"
    print(f"{head}, {result['sampling']}")
    print("exit layer | Gumbel (seeded draws) | rejection sampling | greedy agreement")
    for e, a in result["acceptance"].items():
        rates = f"{a['gumbel']:.3f} | {a['rejection']:.3f} | {a['greedy']:.3f}"
        print(f"{e:>2}/{result['layers']} | {rates}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
