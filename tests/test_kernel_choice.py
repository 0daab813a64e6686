"""The kernel chooser keeps what measures fastest, not a fixed rule, and caches its choice."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from delspec.kernels.build import library
from delspec.kernels.layers import (
    SPLIT_ROWS,
    prompt_tiles_ready,
    set_fetch_first,
    set_four_tiles,
    set_twin_row,
)
from delspec.kernels.products import ROW_BUCKETS
from delspec.machine import kernel_choice
from delspec.machine.kernel_choice import apply_choices, fastest, measure_choices
from delspec.machine.profile import MachineProfile
from delspec.model.modules import Linear


def given_speeds(seconds: dict[str, float]):
    """A timer that reports the given time per candidate (and still runs it once)."""

    def timer(name, run):
        run()
        return seconds[name]

    return timer


def test_fastest_is_the_least_time():
    assert fastest({"linear": 2.0, "narrow": 1.0, "packed": 3.0}) == "narrow"
    assert fastest({"blocks": 0.5, "dequant": 0.7}) == "blocks"


@pytest.mark.parametrize(
    "speeds,winner",
    [
        ({"linear": 2.0, "narrow": 1.0, "packed": 3.0}, "narrow"),
        ({"linear": 1.0, "narrow": 2.0, "packed": 3.0}, "linear"),
        ({"linear": 3.0, "narrow": 2.0, "packed": 1.0}, "packed"),
    ],
)
def test_the_faster_candidate_is_chosen_for_every_layer(speeds, winner):
    model = tiny_model(seed=0, dtype=torch.float32)
    choices = measure_choices(model, given_speeds(speeds))
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert set(choices) == {f"torch.float32:{m.out_features}:{m.in_features}" for m in layers}
    assert len(choices) == 4  # qkv and the LM head share a shape (64 x 32)
    assert all(set(rows) == set(ROW_BUCKETS) for rows in choices.values())
    assert {kernel for rows in choices.values() for kernel in rows.values()} == {winner}
    apply_choices(model, choices)
    assert all(layer.kernels == dict.fromkeys(ROW_BUCKETS, winner) for layer in layers)
    if winner != "packed":  # copies made while timing that no product will use are freed
        assert all("packed" not in layer.__dict__.get("_copies", {}) for layer in layers)


def test_outputs_agree_whatever_the_kernels():
    ids = torch.arange(9)
    logits = []
    for speeds in (
        {"linear": 1, "narrow": 2, "packed": 3},
        {"linear": 3, "narrow": 1, "packed": 2},
    ):
        model = tiny_model(seed=1, dtype=torch.float32)
        apply_choices(model, measure_choices(model, given_speeds(speeds)))
        model.setup_cache(16)
        with torch.inference_mode():
            logits.append(model(ids))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_block_weights_keep_their_row_exact_kernel_at_every_size():
    model = tiny_model(seed=0, blocks=True)
    timed: list[str] = []
    choices = measure_choices(model, lambda name, run: timed.append(name) or 1.0)
    assert not timed  # one candidate: nothing to time
    assert {kernel for rows in choices.values() for kernel in rows.values()} == {"blocks"}


def faster_but_at(variant: str, slower: set[int], timed: list[str]) -> kernel_choice.Timer:
    """A timer that runs each call (noting its name in `timed`) and says `variant` took less
    time than the other way at every row count but those in `slower`."""

    def timer(name: str, run) -> float:
        run()
        timed.append(name)
        rows, chosen = int(name.split()[0]), name.endswith(variant)
        return 1.0 if chosen == (rows in slower) else 0.5

    return timer


@pytest.mark.skipif(not prompt_tiles_ready(), reason="no AMX-BF16 tiles on this CPU")
@pytest.mark.parametrize(
    ("slower", "expected"),
    [({16}, 32), (set(), 16), ({128}, None), ({32}, 64), ({16, 32, 64, 128}, None)],
)
def test_prompts_take_tiles_from_where_they_pay_at_every_longer_length(slower, expected):
    """`measure_prompt_tiles` times every layer on each of PROMPT_ROWS rows both ways (really
    running them: here the timer only says which was faster)."""
    model = tiny_model(seed=0, dtype=torch.float32, blocks=True)
    timed: list[str] = []
    timer = faster_but_at("tiles", slower, timed)
    assert kernel_choice.measure_prompt_tiles(model, timer) == expected
    assert len(timed) == 2 * len(kernel_choice.PROMPT_ROWS)


@pytest.mark.skipif(library() is None, reason="no C compiler for the kernels")
@pytest.mark.parametrize(
    ("slower", "expected"), [({8}, 16), (set(), 8), ({8, 32}, 64), ({64}, 128), ({16, 64}, 128)]
)
def test_calls_split_their_rows_from_where_it_pays_at_every_larger_count(slower, expected):
    """`measure_split_rows` times the layers on each of SPLIT_COUNTS rows with their per-row
    steps split between the threads and not (really running them: here the timer only says
    which was faster); where splitting never paid at the most rows, from twice those rows.
    Without tiles measured, calls on tiles keep the default."""
    model = tiny_model(seed=0, dtype=torch.float32, blocks=True)
    timed: list[str] = []
    chosen = kernel_choice.measure_split_rows(model, faster_but_at("split", slower, timed))
    assert chosen == {False: expected, True: SPLIT_ROWS[True]}
    assert len(timed) == 2 * len(kernel_choice.SPLIT_COUNTS)


def noting_switch(
    timer: kernel_choice.Timer, switch, settings: list[bool | None]
) -> kernel_choice.Timer:
    """`timer`, noting in `settings` the process-wide `switch`'s setting each timed call ran
    with (read by setting it, then set back)."""

    def watching(name: str, run) -> float:
        def checked() -> object:
            out = run()
            settings.append(switch(True))
            switch(settings[-1])
            return out

        return timer(name, checked)

    return watching


FOUR_TILES = pytest.mark.skipif(
    library() is None or set_four_tiles(True) is None,
    reason="no four-tile path in this build of the kernels (AVX-512 VNNI)",
)


@FOUR_TILES
@pytest.mark.parametrize(("faster", "slower", "expected"), [
    ("four", set(), True), ("pairs", set(), False), ("four", {1, 4}, False), ("pairs", {8}, False),
])  # fmt: skip
def test_four_tiles_taken_where_they_take_less_time_summed(faster, slower, expected):
    """`measure_four_tiles` times the layers on each of STEP_ROWS rows with four tiles at once
    and with pairs (really running them, the switch set for each call), keeps four where the
    summed times are no more than pairs', and leaves the process's setting as it found it."""
    model = tiny_model(seed=0, dtype=torch.float32, blocks=True)
    timed: list[str] = []
    settings: list[bool | None] = []
    timer = faster_but_at(faster, slower, timed)

    set_four_tiles(False)
    try:
        watching = noting_switch(timer, set_four_tiles, settings)
        assert kernel_choice.measure_four_tiles(model, watching) is expected
        assert set_four_tiles(False) is False  # as it was before
    finally:
        set_four_tiles(True)
    assert len(timed) == 2 * len(kernel_choice.STEP_ROWS)
    assert settings == [name.endswith("four") for name in timed]


SWITCHES = [  # (measure, switch, name on, name off, position timed, default)
    (kernel_choice.measure_twin_row, set_twin_row, "twin", "one", 0, False),
    (kernel_choice.measure_fetch_first, set_fetch_first, "fetch", "none", 512, True),
]


@pytest.mark.skipif(library() is None, reason="no C compiler for the kernels")
@pytest.mark.parametrize("faster_on", [True, False])
@pytest.mark.parametrize("measure, switch, on, off, position, default", SWITCHES)
def test_switches_taken_where_whole_steps_take_less_time(
    measure, switch, on, off, position, default, faster_on
):
    """`measure_twin_row` and `measure_fetch_first` time whole one-row steps with the switch on
    and off (really running them, the switch set for each call, at the position named), keep
    the faster, and leave the process's setting as they found it."""
    model = tiny_model(seed=0, dtype=torch.float32, blocks=True)
    position = min(position, model.config.max_position - 1)
    timed: list[str] = []
    settings: list[bool | None] = []
    timer = faster_but_at(on if faster_on else off, set(), timed)

    watching = noting_switch(timer, switch, settings)
    for before in (False, True):
        timed.clear()
        settings.clear()
        switch(before)
        try:
            assert measure(model, watching) is faster_on
            assert switch(default) is before  # as it was
        finally:
            switch(default)
        assert sorted(timed) == sorted(f"{position} positions, {n}" for n in (on, off))
        assert settings == [name.endswith(on) for name in timed]


def test_choices_are_cached_per_machine_and_model(tmp_path, monkeypatch):
    monkeypatch.setenv("DELSPEC_CACHE", str(tmp_path))
    model = tiny_model(seed=0, dtype=torch.float32)
    calls = []
    measured = dict.fromkeys(ROW_BUCKETS, "narrow")

    def measure(m):
        calls.append(m)
        return {key: dict(measured) for key in kernel_choice.layer_groups(m)}

    monkeypatch.setattr(kernel_choice, "measure_choices", measure)
    monkeypatch.setattr(kernel_choice, "measure_prompt_tiles", lambda m: 64)
    monkeypatch.setattr(kernel_choice, "measure_split_rows", lambda m: {False: 16, True: 128})
    monkeypatch.setattr(kernel_choice, "measure_four_tiles", lambda m: None)
    monkeypatch.setattr(kernel_choice, "measure_twin_row", lambda m: None)
    monkeypatch.setattr(kernel_choice, "measure_fetch_first", lambda m: None)
    MachineProfile(model).choose_kernels()
    other = tiny_model(seed=1, dtype=torch.float32)
    MachineProfile(other).choose_kernels()  # same shapes: read from the cache
    assert len(calls) == 1
    assert list(tmp_path.glob("kernels/choice-*.json"))
    assert model.lm_head.kernels == measured
    assert other.prompt_tiles_from == 64 and other.on_tiles(64) and not other.on_tiles(63)
    assert other.split_rows_from == {False: 16, True: 128}
    MachineProfile(tiny_model(seed=0, dtype=torch.float32, num_layers=3)).choose_kernels()
    assert len(calls) == 2
