"""Where the milliseconds of one decode step go (one token, and a verification of 8).

    python benchmarks/step_profile.py [--model default] [--weights native] [--threads 2]

Prints a Markdown table naming the CPU. On block weights the parts are timed inside whole steps:
the layers run as one compiled call, which times its own steps (summed over the layers; a shared
step includes waiting for the other threads at its barrier), and the embedding and the LM head
are clocked around it, so each part meets the caches as a step leaves them (timed alone in a
loop, SmolLM2's 30 MB head would sit in the last-level cache and look twice as fast as it is).
Otherwise each part of a layer is timed alone in a loop over every layer (weights streaming from
memory as in a step). "rest of the step" is the whole step minus the parts: Python, the engine's
own work, and (eager path) the residuals.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from delspec import load_model
from delspec.kernels.build import cpu_name
from delspec.kernels.layers import STEPS
from delspec.machine.timing import median_seconds


def step_seconds(model, ids: torch.Tensor, position: int, repeats: int) -> float:
    """Median seconds of a whole step: embedding, every layer, final norm and LM head."""
    layers = model.num_layers
    return median_seconds(
        lambda: model.head(model.run_layers(model.embed(ids), position, 0, layers)), repeats
    )


def compiled_profile(model, rows: int, position: int, repeats: int) -> dict[str, float]:
    """Milliseconds per step of each part, timed inside whole steps: the compiled layers' own
    timers, and the clock around the embedding and the LM head."""
    ids = torch.full((rows,), 5)
    compiled = model.compiled_layers()
    totals = torch.zeros(len(STEPS), dtype=torch.float64)
    where = (list(range(position, position + rows)), [0] * rows)
    embed, head = [], []
    for repeat in range(repeats + 1):  # the first step is a warm-up
        start = time.perf_counter()
        x = model.embed(ids)
        layers_start = time.perf_counter()
        h = compiled.run(x, *where, 0, model.num_layers, None, totals if repeat else None)
        head_start = time.perf_counter()
        model.head(h)
        if repeat:
            embed.append(layers_start - start)
            head.append(time.perf_counter() - head_start)
    times = {"embedding lookup": statistics.median(embed) * 1e3}
    times.update({name: float(t) / repeats * 1e3 for name, t in zip(STEPS, totals, strict=True)})
    times["LM head (final norm + head)"] = statistics.median(head) * 1e3
    return times


def eager_profile(model, rows: int, position: int, repeats: int) -> dict[str, float]:
    """Milliseconds per step of each part, each timed alone over every layer."""
    cfg = model.config
    layers = model.layers
    x = torch.randn(rows, cfg.hidden_size)
    ids = torch.full((rows,), 5)
    attn_in = torch.randn(rows, cfg.num_heads * cfg.head_dim)
    mlp_in = torch.randn(rows, cfg.intermediate_size)
    cos, sin = (t[position : position + rows] for t in model._rope[False])
    mask = model._mask(position, rows, None)

    def attention_only(block):  # the attention module less its two projections
        return block.attn(x, position, model.cache[0, :, 0], cos, sin, mask)

    parts = {
        "embedding lookup": lambda: model.embed(ids),
        "norms": lambda: [b.attn_norm(x) for b in layers] + [b.mlp_norm(x) for b in layers],
        "q/k/v projection": lambda: [b.attn.qkv(x) for b in layers],
        "attention (RoPE, cache, scores)": lambda: [attention_only(b) for b in layers],
        "output projection": lambda: [b.attn.o(attn_in) for b in layers],
        "gate/up projection": lambda: [b.mlp.gate_up(x) for b in layers],
        "activation": lambda: [F.silu(mlp_in) * mlp_in for _ in layers],
        "down projection": lambda: [b.mlp.down(mlp_in) for b in layers],
        "LM head (final norm + head)": lambda: model.head(x),
    }
    times = {name: median_seconds(run, repeats) * 1e3 for name, run in parts.items()}
    # the attention module ran both its projections too: count them once
    times["attention (RoPE, cache, scores)"] -= (
        times["q/k/v projection"] + times["output projection"]
    )
    return times


def profile(lm, rows: int, position: int, repeats: int) -> dict[str, float]:
    """Milliseconds per step of each part, for a step of `rows` tokens at `position`, and the
    whole step."""
    model = lm.model
    parts = compiled_profile if model.compiled_layers() is not None else eager_profile
    times = parts(model, rows, position, repeats)
    step = step_seconds(model, torch.full((rows,), 5), position, repeats) * 1e3
    times["rest of the step (Python, engine)"] = step - sum(times.values())
    times["whole step"] = step
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--weights", default="native")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--position", type=int, default=128, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, weights=args.weights)
    lm.model.setup_cache(args.position + 16)
    with torch.inference_mode():
        one = profile(lm, 1, args.position, args.repeats)
        eight = profile(lm, 8, args.position, args.repeats)
    kind = "compiled layers" if lm.model.compiled_layers() is not None else "eager layers"
    print(
        f"{lm.name}, weights {lm.model.weights} ({kind}), {cpu_name()}, {args.threads} threads, "
        f"{args.position} tokens in the cache; ms per step\n"
    )
    print("| part | 1 token | 8 tokens (a verification) |\n|---|---|---|")
    for name in one:
        bold = "**" if name == "whole step" else ""
        print(f"| {bold}{name}{bold} | {one[name]:.2f} | {eight[name]:.2f} |")


if __name__ == "__main__":
    main()
