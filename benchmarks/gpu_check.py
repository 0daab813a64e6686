"""Check every decoding strategy on a GPU: greedy output identical to `ar`, speed, acceptance.

Loads the model on the device (float weights: GGUF block weights are CPU-only), runs each
strategy greedily on a few fixed prompts and compares its tokens with `ar`'s. A divergence is
allowed only at a near tie: where the full model's logits (one full forward over the prompt and
`ar`'s tokens) put the strategy's token within the tolerance of the top one (1e-3 in float32,
0.05 in 16-bit dtypes). Exits 1 on any other divergence, 2 without a usable device.

    python benchmarks/gpu_check.py --device cuda --dtype bfloat16 --new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

import delspec
from delspec.decoding.generate import encode_prompt
from delspec.policies import STRATEGIES

PROMPTS = [
    "The history of the printing press begins",
    "def quicksort(items):\n",
    "Question: A train travels 60 km in 45 minutes. What is its average speed in km/h?\nAnswer:",
    "Write a short letter to a friend about a trip to the mountains.",
]
TIE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}  # other dtypes: 0.05
HALF_TIE_TOLERANCE = 0.05


@dataclass
class Divergence:
    prompt: int
    index: int
    gap: float  # top logit - the strategy's token's logit (top-2 gap if it stopped)
    tie: bool


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (a shorter one ends there); None if equal."""
    index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if index is None and len(a) != len(b):
        return min(len(a), len(b))
    return index


@torch.inference_mode()
def logit_gap(lm: delspec.LoadedModel, ids: list[int], token: int | None) -> float:
    """How far `token` (None: the runner-up) is below the top logit after `ids`."""
    lm.model.setup_cache(len(ids))
    logits = lm.model(torch.tensor(ids, device=lm.model.device))[-1].float()
    top = logits.topk(2).values
    return float(top[0] - (top[1] if token is None else logits[token]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="a named model, .gguf file or HF dir")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} finds none on this machine")
        return 2
    try:
        lm = delspec.load_model(args.model, device=args.device, dtype=args.dtype, weights="float")
    except delspec.DelspecError as exc:
        print(f"cannot load {args.model} on {args.device}: {exc}")
        return 2
    tolerance = TIE_TOLERANCE.get(lm.model.dtype, HALF_TIE_TOLERANCE)
    name = torch.cuda.get_device_name() if lm.model.device.type == "cuda" else "CPU"
    print(
        f"{lm.name} on {args.device} ({name}), {lm.model.dtype}, {len(PROMPTS)} prompts x "
        f"{args.new_tokens} new tokens, near-tie tolerance {tolerance:g}"
    )
    prompts = [encode_prompt(lm, text) for text in PROMPTS]

    def run(strategy: str) -> list[delspec.Result]:
        delspec.generate(lm, prompts[0], strategy=strategy, max_new_tokens=4)  # warm-up
        return [
            delspec.generate(lm, ids, strategy=strategy, max_new_tokens=args.new_tokens)
            for ids in prompts
        ]

    ar_results = run("ar")
    reference = [r.token_ids for r in ar_results]
    failed = False
    for strategy in ["ar", *(s for s in STRATEGIES if s != "ar")]:
        results = ar_results if strategy == "ar" else run(strategy)
        divergences = []
        for p, (result, ar) in enumerate(zip(results, reference, strict=True)):
            ours = result.token_ids
            index = first_difference(ours, ar)
            if index is not None:
                token = ours[index] if index < len(ours) else None
                gap = logit_gap(lm, prompts[p] + ar[:index], token)
                divergences.append(Divergence(p, index, gap, gap <= tolerance))
        stats = [r.stats for r in results]
        new = sum(s.new_tokens for s in stats)
        seconds = sum(s.new_tokens / s.tokens_per_s for s in stats if s.tokens_per_s)
        drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
        identity = f"identical {len(PROMPTS) - len(divergences)}/{len(PROMPTS)}"
        for d in divergences:
            kind = "near tie" if d.tie else "NOT a near tie"
            identity += f"; prompt {d.prompt} diverges at {d.index} ({kind}, gap {d.gap:.4g})"
        failed |= any(not d.tie for d in divergences)
        print(
            f"{strategy:>9}: {new / seconds if seconds else 0:8.1f} tok/s, acceptance "
            f"{accepted / drafted if drafted else 0:.3f} ({drafted} drafted) | {identity}"
        )
    print("FAIL: a strategy diverges from ar away from a near tie" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
