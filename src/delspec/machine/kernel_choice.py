"""Which product kernel each linear layer uses, measured on this machine.

For every weight shape a model holds (its layers' projections and its LM head, per weight
format) and every row bucket (`kernels.products.ROW_BUCKETS`: the one-token step, verify sizes,
prefill), the candidate kernels (`Linear.candidates`) are timed over all the model's layers of
that shape, one product each, so that the weights stream from memory as in a real step. The
fastest is kept. So is the prompt length from which the compiled layers run a prompt on
bfloat16 tiles (`measure_prompt_tiles`), where the CPU has them, the row counts from which
they split a call's per-row steps between the threads (`measure_split_rows`), and whether the
products take four tiles of weight rows at once or pairs (`measure_four_tiles`), whether a
product of one row runs the two-row loop on the row and a copy of it (`measure_twin_row`), and
whether attention reads its cache in order first (`measure_fetch_first`). The record
(`measure_kernels`) is kept by the machine cache (`MachineProfile.choose_kernels`, `store`), keyed
as every measurement of the machine is, and measured again when it grows old, as the cost
profile is; the cost profile, measured with the chosen kernels, then sees their times.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from delspec.kernels.build import cpu_name
from delspec.kernels.layers import (
    SPLIT_ROWS,
    prompt_tiles_ready,
    set_fetch_first,
    set_four_tiles,
    set_twin_row,
)
from delspec.kernels.products import ROW_BUCKETS
from delspec.machine.timing import settled_seconds
from delspec.model.modules import Linear
from delspec.model.transformer import Transformer

CHOICE_VERSION = 6
STREAMING_ROWS = 20  # products of up to this many rows are timed over every layer of a group
PROMPT_ROWS = (16, 32, 64, 128)  # prompt lengths at which tiles and 8-bit products are timed
# row counts at which calls without tiles (steps of several rows, short prompts) are timed with
# their per-row steps split between the threads and without
SPLIT_COUNTS = (8, 16, 32, 64)
PROMPT_LAYERS = 2  # ...through this many layers (a prompt's rows are compute-bound)
# a step's and verifications' row counts, timed through this many layers (enough weights to
# stream from memory, as in a step) with four tiles at once and with pairs
STEP_ROWS, STEP_LAYERS = (1, 4, 8), 8
# cached positions at which whole steps are timed with attention fetching its cache first and not
FETCH_POSITION = 512
# seconds(candidate name, run) -> the time of `run()`; injectable for tests.
Timer = Callable[[str, Callable[[], object]], float]


def fastest(times: dict[str, float]) -> str:
    """The candidate with the least time."""
    return min(times, key=times.__getitem__)


ROUNDS = 3  # rounds of a take in which the candidates take turns (`settled_seconds`)
STEP_ROUNDS = 2  # ...where each call is a whole step (`_time_steps`), in at most two takes


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
    if not prompt_tiles_ready():
        return None
    variants = {"tiles": {"tiles": True}, "8-bit": {"tiles": False}}
    times = _time_calls(model, PROMPT_ROWS, variants, timer)
    return None if times is None else _paying(times, "tiles", "8-bit")


def measure_split_rows(model: Transformer, timer: Timer | None = None) -> dict[bool, int]:
    """Per kind of call, without tiles and on them, the fewest rows (of `SPLIT_COUNTS`, and for
    tiles of the counts from `prompt_tiles_from` on) from which the first `PROMPT_LAYERS` layers
    run faster with their per-row steps split between the threads than with every thread doing
    them all, there and at every larger count measured; where that never held, twice the most
    rows measured (the steps a thread repeats grow with the rows, its barriers do not). Kinds
    that cannot be measured keep `SPLIT_ROWS`. The bits are the same either way."""
    chosen = dict(SPLIT_ROWS)
    tiles_from = model.prompt_tiles_from
    kinds = {False: SPLIT_COUNTS}
    if tiles_from is not None:
        kinds[True] = tuple(rows for rows in PROMPT_ROWS if rows >= tiles_from)
    for tiles, counts in kinds.items():
        variants = {s: {"tiles": tiles, "split": s == "split"} for s in ("split", "each")}
        times = _time_calls(model, counts, variants, timer)
        if times is not None:
            paying = _paying(times, "split", "each")
            chosen[tiles] = paying if paying is not None else 2 * max(counts)
    return chosen


def measure_four_tiles(model: Transformer, timer: Timer | None = None) -> bool | None:
    """Whether the products take four tiles at once (True) or pairs (False): the first
    `STEP_LAYERS` layers timed on each of `STEP_ROWS` rows both ways, four where their times
    summed are no more than pairs'. None where the kernels have no four-tile path or no
    compiled layers. The bits are the same either way."""
    before = set_four_tiles(True)
    if before is None:
        return None
    variants: dict[str, dict[str, bool]] = {"four": {}, "pairs": {}}
    try:
        times = _time_calls(
            model,
            STEP_ROWS,
            variants,
            timer,
            STEP_LAYERS,
            lambda name: set_four_tiles(name == "four"),
        )
    finally:
        set_four_tiles(before)
    if times is None:
        return None
    return sum(t for (_, n), t in times.items() if n == "four") <= sum(
        t for (_, n), t in times.items() if n == "pairs"
    )


def measure_twin_row(model: Transformer, timer: Timer | None = None) -> bool | None:
    """Whether one row's products run the two-row loop on the row and a copy of it (True) or
    the one-row loop (False): whole one-row steps timed both ways (`_time_steps`: the one-row
    loop's pace against the memory's is what differs between CPUs), twinned where that takes
    less time. None without compiled layers. The bits are the same either way."""
    return _switch_pays(model, set_twin_row, "twin", "one", 0, timer, default=False)


def measure_fetch_first(model: Transformer, timer: Timer | None = None) -> bool | None:
    """Whether attention reads a sequence's cached keys and values once in order before its
    products (True) or not: whole one-row steps timed both ways at `FETCH_POSITION` cached
    positions (where a CPU's last-level cache keeps a step's keys and values between steps,
    the read costs a pass; where the weights evict them, it saves waiting on each line),
    fetching unless that takes more time. None without compiled layers. The results are the
    same either way."""
    return _switch_pays(model, set_fetch_first, "fetch", "none", FETCH_POSITION, timer, True)


def _switch_pays(
    model: Transformer,
    switch: Callable[[bool], bool | None],
    on: str,
    off: str,
    position: int,
    timer: Timer | None,
    default: bool,
) -> bool | None:
    """Whether a process-wide `switch` of the kernels (the same bits either way) makes whole
    one-row steps at `position` take less time on (named `on`) than off (`off`); a tie keeps
    `default`. The switch is left as it was found. None without compiled layers."""
    before = switch(default)
    if before is None:
        return None
    try:
        times = _time_steps(model, position, (on, off), lambda name: switch(name == on), timer)
    finally:
        switch(before)
    if times is None:
        return None
    if times[on] == times[off]:
        return default
    return times[on] < times[off]


def _time_steps(
    model: Transformer,
    position: int,
    names: tuple[str, ...],
    setup: Callable[[str], object],
    timer: Timer | None,
) -> dict[str, float] | None:
    """Seconds of a whole one-row step (embedding, every compiled layer, final norm and LM
    head, so that the weights stream through the caches as in decoding) at `position` (capped
    by the model's positions) of a scratch cache, per name in `names`, `setup(name)` before
    each call; None without compiled layers."""
    position = max(0, min(position, model.config.max_position - 1))
    with model.scratch_cache(position + 1), torch.inference_mode():
        compiled = model.compiled_layers()
        if compiled is None:
            return None
        ids = torch.zeros(1, dtype=torch.long, device=model.device)
        runs = {}
        for name in names:

            def run(name: str = name) -> object:
                setup(name)
                h = compiled.run(model.embed(ids), [position], [0], 0, model.num_layers, None)
                return model.head(h)

            runs[name] = run
        if timer is None:  # a whole step per call: fewer calls than the layer timings take
            times, _ = settled_seconds(runs, STEP_ROUNDS, tries=2)
            return times
        return {name: timer(f"{position} positions, {name}", run) for name, run in runs.items()}


def _time_calls(
    model: Transformer,
    counts: tuple[int, ...],
    variants: dict[str, dict[str, bool]],
    timer: Timer | None,
    layers: int = PROMPT_LAYERS,
    setup: Callable[[str], object] | None = None,
) -> dict[tuple[int, str], float] | None:
    """Seconds of a call of the first `layers` compiled layers on each of `counts` rows (those
    the model's positions hold) at position 0, per variant (keyword arguments of
    `LayerKernels.run`; `setup(variant)` called before each call, where given); None without
    compiled layers or counts."""
    counts = tuple(rows for rows in counts if rows < model.config.max_position)
    if not counts:
        return None
    with model.scratch_cache(max(counts)), torch.inference_mode():
        compiled = model.compiled_layers()
        if compiled is None:
            return None
        runs = {}
        for rows in counts:
            h = model.embed(torch.zeros(rows, dtype=torch.long, device=model.device))
            where = (list(range(rows)), [0] * rows, 0, min(layers, model.num_layers), None)
            for name, options in variants.items():

                def run(h=h, w=where, o=options, name=name) -> object:
                    if setup is not None:
                        setup(name)
                    return compiled.run(h, *w, **o)

                runs[rows, name] = run
        if timer is None:
            times, _ = settled_seconds(runs, ROUNDS)
        else:
            times = {key: timer(f"{key[0]} rows, {key[1]}", run) for key, run in runs.items()}
    return times


def _paying(times: dict[tuple[int, str], float], better: str, worse: str) -> int | None:
    """The fewest rows from which variant `better` took less time than `worse`, there and at
    every larger count timed; None where it did not at the largest."""
    paying = None
    for rows in sorted({rows for rows, _ in times}, reverse=True):
        if times[rows, better] >= times[rows, worse]:
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


def measure_kernels(model: Transformer) -> dict[str, Any]:
    """Every kernel choice for `model` on this machine, measured now, as the record the
    machine cache keeps (`MachineProfile.choose_kernels`)."""
    stored: dict[str, Any] = {
        "version": CHOICE_VERSION,
        "measured_at": time.time(),
        "cpu": cpu_name(),
        "choices": measure_choices(model),
    }
    stored["prompt_tiles_from"] = model.prompt_tiles_from = measure_prompt_tiles(model)
    split = measure_split_rows(model)  # for the prompts that take tiles too
    stored["split_rows_from"] = {"plain": split[False], "tiles": split[True]}
    stored["four_tiles"] = measure_four_tiles(model)
    stored["twin_row"] = measure_twin_row(model)
    stored["fetch_first"] = measure_fetch_first(model)
    return stored


def apply_kernels(model: Transformer, stored: dict[str, Any]) -> None:
    """Give `model` the kernel choices of a `measure_kernels` record."""
    apply_choices(model, stored["choices"])
    model.prompt_tiles_from = stored["prompt_tiles_from"]
    split = stored["split_rows_from"]
    model.split_rows_from = {False: split["plain"], True: split["tiles"]}
    if stored["four_tiles"] is not None:  # process-wide: the last model chosen for sets it
        set_four_tiles(stored["four_tiles"])
    for switch, key in ((set_twin_row, "twin_row"), (set_fetch_first, "fetch_first")):
        if stored[key] is not None:  # process-wide, as four_tiles
            switch(stored[key])
