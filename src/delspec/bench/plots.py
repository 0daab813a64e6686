"""PNG plots of a benchmark run, drawn with matplotlib's object API (Agg canvas, no pyplot state).

`speedup_plot` compares methods per task; `exit_trace_plot` and `alpha_heatmap` show how DEL
chose its exit layer over one prompt's rounds, from the trace kept in the results; `serve_plot`
shows a served model under concurrent clients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from delspec.bench.methods import REFERENCE


def speedup_plot(
    aggregates: Mapping[str, Mapping[str, Mapping[str, Any]]], path: Path, title: str
) -> Path:
    """Grouped bars: speedup over `ar` of every other method, per task and overall."""
    groups = list(aggregates)
    methods = [m for m in next(iter(aggregates.values())) if m != REFERENCE]
    figure = _figure(max(6.0, 0.16 * len(groups) * (len(methods) + 1) + 1.5), 4.5)
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(methods))
    for index, method in enumerate(methods):
        values = [aggregates[g][method]["speedup"] for g in groups]
        lossless = all(aggregates[g][method]["lossless"] for g in groups)
        label = method if lossless else f"{method} (NOT LOSSLESS)"
        offsets = [g + (index - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        bars = axes.bar(offsets, values, width, label=label, hatch=None if lossless else "//")
        axes.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label=f"{REFERENCE} = 1")
    axes.set_xticks(range(len(groups)), groups)
    axes.set_ylabel(f"speedup over {REFERENCE} (overall tokens/s ratio)")
    axes.set_title(title)
    figure.legend(loc="outside lower center", fontsize=8, ncols=min(3, len(methods) + 1))
    return _save(figure, path)


def exit_trace_plot(trace: Mapping[str, Any], path: Path) -> Path:
    """Per round: the exit layer used (0: no draft), and the alpha and tau that layer had when
    it was chosen (after the previous round)."""
    rounds = trace["rounds"]
    layers = trace["layers"]
    x = [entry["round"] for entry in rounds]
    chosen_alpha, chosen_tau = [math.nan], [math.nan]  # the first round is the warm-up round
    for before, entry in pairwise(rounds):
        used = entry["exit_layer"]
        chosen_alpha.append(before["alpha"][layers.index(used)] if used in layers else math.nan)
        chosen_tau.append(before["tau"] if used in layers else math.nan)
    figure = _figure(8.0, 5.0)
    top, bottom = figure.subplots(2, 1, sharex=True)
    top.step(x, [e["exit_layer"] for e in rounds], where="mid", marker=".", linewidth=1)
    top.set_ylim(-0.5, layers[-1] + 0.5)
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("exit layer E")
    top.set_title(_trace_title(trace))
    bottom.plot(x, chosen_alpha, marker=".", linewidth=1, label="alpha of the chosen layer")
    bottom.plot(x, chosen_tau, linestyle="--", linewidth=1, label="tau (draft exit threshold)")
    bottom.set_ylim(0, 1.02)
    bottom.set_xlabel("round")
    bottom.set_ylabel("probability")
    bottom.legend(fontsize=8)
    return _save(figure, path)


def alpha_heatmap(trace: Mapping[str, Any], path: Path) -> Path:
    """Per-layer acceptance estimate alpha after every round, with the next exit layer marked."""
    rounds = trace["rounds"]
    layers: Sequence[int] = trace["layers"]
    matrix = [[entry["alpha"][row] for entry in rounds] for row in range(len(layers))]
    figure = _figure(8.0, max(3.0, 0.16 * len(layers) + 1.5))
    axes = figure.add_subplot()
    x0, x1 = rounds[0]["round"] - 0.5, rounds[-1]["round"] + 0.5
    y0, y1 = layers[0] - 0.5, layers[-1] + 0.5
    image = axes.imshow(
        matrix,
        aspect="auto",
        origin="lower",
        extent=(x0, x1, y0, y1),
        vmin=0.0,
        vmax=1.0,
        cmap="viridis",
        interpolation="nearest",
    )
    axes.plot(
        [e["round"] for e in rounds],
        [e["next_exit_layer"] for e in rounds],
        color="red",
        linewidth=0.8,
        marker=".",
        markersize=3,
        label="next exit layer",
    )
    figure.colorbar(image, ax=axes, label="alpha (acceptance estimate)")
    axes.set_xlabel("round")
    axes.set_ylabel("exit layer")
    axes.set_title(_trace_title(trace))
    axes.legend(fontsize=8, loc="upper right")
    return _save(figure, path)


def serve_plot(runs: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Aggregate tokens/s and p95 time to first token against the number of clients, one line
    per server setup (`delspec bench-serve`)."""
    figure = _figure(9.0, 4.0)
    throughput, first = figure.subplots(1, 2)
    for setup in dict.fromkeys(r["setup"] for r in runs):
        own = [r for r in runs if r["setup"] == setup]
        clients = [r["clients"] for r in own]
        throughput.plot(clients, [r["tokens_per_s"] for r in own], marker="o", label=setup)
        first.plot(clients, [r["first_token_p95_s"] for r in own], marker="o", label=setup)
    throughput.set_ylabel("generated tokens/s (all clients)")
    first.set_ylabel("time to first token, p95 (s)")
    for axes in (throughput, first):
        axes.set_xlabel("concurrent clients")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    throughput.legend(fontsize=8)
    return _save(figure, path)


def _trace_title(trace: Mapping[str, Any]) -> str:
    return f"{trace['method']} on {trace['task']} / {trace['prompt_id']}"


def _figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, dpi=120)
    return path
