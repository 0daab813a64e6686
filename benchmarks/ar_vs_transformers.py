"""Decode speed of delspec's autoregressive loop against transformers' `generate`.

Same weights (the embedded SmolLM2 GGUF, dequantised to float32), same prompts, one process,
the two measured alternately per prompt so machine drift cancels. Decode time per token is
(time for N new tokens - time for 1 new token) / (N - 1), which removes the prompt's prefill.

    python benchmarks/ar_vs_transformers.py --threads 2 --new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from delspec import load_model
from delspec.bench.backends import load_transformers_model
from delspec.decoding.sequence import Decoding
from delspec.policies import make_policy

PROMPTS = [
    "The history of the printing press begins",
    "def quicksort(items):\n",
    "Question: A train travels 60 km in 45 minutes. What is its average speed in km/h?\nAnswer:",
    "Write a short letter to a friend about a trip to the mountains.",
]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    lm = load_model("default", weights="float")  # the same float32 weights as transformers
    hf = load_transformers_model(lm)
    hf.generation_config.eos_token_id = None  # both run exactly N tokens, EOS or not
    n = args.new_tokens

    def ours(ids: list[int], new: int) -> list[int]:
        policy = make_policy("ar", lm.model.num_layers)
        return Decoding(lm.model, ids, policy, max_new_tokens=new).run().token_ids

    def theirs(ids: list[int], new: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=lm.tokenizer.eos_token_id,
            )
        return out[0, len(ids) :].tolist()

    per_token = {"delspec": [], "transformers": []}
    for ids in (lm.tokenizer.encode(p) for p in PROMPTS):
        assert ours(ids, n) == theirs(ids, n), "outputs differ"  # also the warm-up
        for _ in range(args.repeats):
            for name, fn in (("delspec", ours), ("transformers", theirs)):
                full = timed(lambda fn=fn, ids=ids: fn(ids, n))
                first = timed(lambda fn=fn, ids=ids: fn(ids, 1))
                per_token[name].append((full - first) / (n - 1) * 1000)
    ms = {k: statistics.median(v) for k, v in per_token.items()}
    ratios = [a / b for a, b in zip(per_token["delspec"], per_token["transformers"], strict=True)]
    print(f"threads={args.threads} new_tokens={n} prompts={len(PROMPTS)} repeats={args.repeats}")
    print(f"transformers generate: {ms['transformers']:.1f} ms/token (median)")
    print(f"delspec AR:            {ms['delspec']:.1f} ms/token (median)")
    print(f"ratio delspec/transformers: {statistics.median(ratios):.2f} (median of pairs)")


if __name__ == "__main__":
    main()
