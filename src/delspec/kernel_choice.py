"""Which product kernel each linear layer uses, measured on this machine.

For every weight shape a model holds (its layers' projections and its LM head, per weight
format) and every row bucket (`kernels.products.ROW_BUCKETS`: the one-token step, verify sizes,
prefill), the candidate kernels (`Linear.candidates`) are timed over all the model's layers of
that shape, one product each, so that the weights stream from memory as in a real step. The
fastest is kept. So is the prompt length from which the compiled layers run a prompt on
bfloat16 tiles (`measure_prompt_tiles`), where the CPU has them. Choices are cached
(`~/.cache/delspec/kernels`), keyed by the CPU, torch, the thread count, the model shape, dtype
and weight format, and measured again after a week, as the cost profile is; the cost profile,
measured with the chosen kernels, then sees their times.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from delspec.cache import cache_dir, write_atomically
from delspec.costs import PROFILE_MAX_AGE_S
from delspec.kernels.build import build_key, cpu_flags, cpu_name
from delspec.kernels.layers import prompt_tiles_ready
from delspec.kernels.products import ROW_BUCKETS
from delspec.model import Transformer
from delspec.modules import Linear
from delspec.timing import settled_seconds

CHOICE_VERSION = 2
STREAMING_ROWS = 20  # products of up to this many rows are timed over every layer of a group
PROMPT_ROWS = (16, 32, 64, 128)  # prompt lengths at which tiles and 8-bit products are timed
PROMPT_LAYERS = 2  # ...through this many layers (a prompt's rows are compute-bound)
# seconds(candidate name, run) -> the time of `run()`; injectable for tests.
Timer = Callable[[str, Callable[[], object]], float]


def fastest(times: dict[str, float]) -> str:
    """The candidate with the least time."""
    return min(times, key=times.__getitem__)


ROUNDS = 3  # rounds of a take in which the candidates take turns (`settled_seconds`)


def layer_groups(model: Transformer) -> dict[str, list[Linear]]:
    """The model's linear layers by weight kind and shape (`kind:out:in`)."""
    groups: dict[str, list[Linear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, Linear):
            kind = "blocks" if module.blocks is not None else str(module.weight.dtype)
            groups[f"{kind}:{module.out_features}:{module.in_features}"].append(module)
    return dict(groups)


def measure_choices(model: Transformer, timer: Timer | None = None) -> dict[str, dict[int, str]]:
    """Per layer group (`layer_groups`) and row bucket, the fastest candidate kernel. Without a
    `timer`, each candidate's fastest of rounds in which the candidates take turns, taken again
    until two takes agree (`settled_seconds`): a busy moment of the machine cannot fall on one
    candidate alone."""
    choices: dict[str, dict[int, str]] = {}
    with torch.inference_mode():
        for key, layers in layer_groups(model).items():
            choices[key] = {}
            for rows in ROW_BUCKETS:
                x = torch.randn(rows, layers[0].in_features, dtype=model.dtype, device=model.device)
                # long products are compute-bound: a few layers tell as much as all of them
                timed = layers if rows <= STREAMING_ROWS else layers[:2]
                names = timed[0].candidates(x)
                if len(names) > 1:
                    runs = {name: _products(timed, x, name) for name in names}
                    if timer is None:
                        times, _ = settled_seconds(runs, ROUNDS)
                    else:
                        times = {name: timer(name, run) for name, run in runs.items()}
                    names = (fastest(times),)
                choices[key][rows] = names[0]
            if "packed" not in choices[key].values():
                for layer in layers:  # measuring made copies that no product will use
                    layer.drop_copy("packed")
    return choices


def measure_prompt_tiles(model: Transformer, timer: Timer | None = None) -> int | None:
    """The fewest rows (of `PROMPT_ROWS`) from which a prompt runs the first `PROMPT_LAYERS`
    layers faster on bfloat16 tiles than on the 8-bit products, there and at every larger count
    measured; None where tiles never paid or cannot run (no AMX-BF16, no compiled layers)."""
    counts = [rows for rows in PROMPT_ROWS if rows < model.config.max_position]
    if not counts or not prompt_tiles_ready():
        return None
    with model.scratch_cache(max(counts)), torch.inference_mode():
        compiled = model.compiled_layers()
        if compiled is None:
            return None
        runs = {}
        for rows in counts:
            h = model.embed(torch.zeros(rows, dtype=torch.long, device=model.device))
            layers = min(PROMPT_LAYERS, model.num_layers)
            where = (list(range(rows)), [0] * rows, 0, layers, None)
            for tiles in (False, True):
                runs[rows, tiles] = lambda h=h, w=where, t=tiles: compiled.run(h, *w, tiles=t)
        if timer is None:
            times, _ = settled_seconds(runs, ROUNDS)
        else:
            times = {key: timer(f"{key[0]} rows, tiles={key[1]}", run) for key, run in runs.items()}
    paying = None
    for rows in reversed(counts):
        if times[rows, True] >= times[rows, False]:
            break
        paying = rows
    return paying


def _products(layers: list[Linear], x: torch.Tensor, kernel: str) -> Callable[[], object]:
    """One product of `x` with every layer of a group, through `kernel`."""
    return lambda: [layer.compute(x, kernel) for layer in layers]


def apply_choices(model: Transformer, choices: dict[str, dict[int, str]]) -> None:
    """Give each linear layer its group's kernels."""
    for key, layers in layer_groups(model).items():
        for layer in layers:
            layer.kernels = dict(choices[key])


def choose_kernels(model: Transformer) -> None:
    """Apply this machine's kernel choices for `model`, measuring them on first use (CPU only:
    elsewhere every product keeps its default kernel)."""
    if model.device.type != "cpu":
        return
    path = cache_dir() / "kernels" / f"choice-{_choice_key(model)}.json"
    stored = _read(path)
    if stored is None or set(stored["choices"]) != set(layer_groups(model)):
        print(
            f"delspec: timing product kernels on this CPU (once; cached in {path.parent})",
            file=sys.stderr,
            flush=True,
        )
        stored = {
            "version": CHOICE_VERSION,
            "measured_at": time.time(),
            "cpu": cpu_name(),
            "choices": measure_choices(model),
            "prompt_tiles_from": measure_prompt_tiles(model),
        }
        text = json.dumps(stored, indent=1)
        write_atomically(path, lambda out: out.write_text(text))
    apply_choices(model, stored["choices"])
    model.prompt_tiles_from = stored["prompt_tiles_from"]


def _choice_key(model: Transformer) -> str:
    parts = [
        cpu_name(),
        " ".join(sorted(cpu_flags())),
        torch.__version__,
        str(torch.get_num_threads()),
        repr(model.config),
        str(model.dtype),
        model.weights,
        build_key() if model.weights != "float" else "-",
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _read(path) -> dict | None:
    """The stored choices (their row buckets as numbers again), or None where none are stored
    for this version or they are older than a week."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if stored.get("version") != CHOICE_VERSION:
        return None
    if time.time() - stored.get("measured_at", 0) > PROFILE_MAX_AGE_S:
        return None
    choices = stored["choices"]
    stored["choices"] = {key: {int(r): k for r, k in rows.items()} for key, rows in choices.items()}
    return stored
