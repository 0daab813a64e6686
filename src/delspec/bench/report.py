"""Writing a benchmark run's results: JSON, a Markdown table shaped like the paper's Table 1, and
PNG plots.

Files under the output directory: ``results.json`` (everything: settings, environment, every
per-prompt record, sweeps, aggregates, losslessness, the plotted trace), ``summary.json``
(``{model: {task: {method: {"speedup", "tokens_per_s", "lossless"}}}}``, tasks then
``"overall"``), ``table.md``, ``speedup.png``, and for a DEL run ``exit_layer_trace.png`` and
``alpha_heatmap.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from delspec.bench.methods import REFERENCE
from delspec.bench.metrics import OVERALL
from delspec.bench.plots import alpha_heatmap, exit_trace_plot, speedup_plot
from delspec.bench.runner import BenchResult

SPEEDUP_PNG = "speedup.png"
TRACE_PNG = "exit_layer_trace.png"
HEATMAP_PNG = "alpha_heatmap.png"


def write_report(result: BenchResult, out: str | Path) -> list[Path]:
    """Write every output file of `result` into directory `out` (created); returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        _write_json(out / "results.json", result.as_dict()),
        _write_json(out / "summary.json", summary(result)),
        speedup_plot(
            result.aggregates, out / SPEEDUP_PNG, f"{result.model['name']}: speedup over ar"
        ),
    ]
    if result.trace:
        paths += [exit_trace_plot(result.trace, out / TRACE_PNG)]
        paths += [alpha_heatmap(result.trace, out / HEATMAP_PNG)]
    table = out / "table.md"
    table.write_text(markdown(result), encoding="utf-8")
    return [*paths, table]


def summary(result: BenchResult) -> dict[str, Any]:
    """The compact ``{model: {task: {method: {speedup, tokens_per_s, lossless}}}}``."""
    return {
        result.model["name"]: {
            group: {
                method: {k: m[k] for k in ("speedup", "tokens_per_s", "lossless")}
                for method, m in methods.items()
            }
            for group, methods in result.aggregates.items()
        }
    }


def markdown(result: BenchResult) -> str:
    """The report: Table 1 (eTPL / speedup per task, overall speed and speedup), details,
    sweeps, losslessness and plots."""
    lines = [*_heading(result), *_peer(result), *_table_one(result), *_details(result)]
    lines += [*_method_notes(result), *_sweep_notes(result), *_lossless_notes(result)]
    lines += ["## Plots", "", f"![speedup by task and method]({SPEEDUP_PNG})", ""]
    if result.trace:
        lines += [
            f"![exit layer and alpha over rounds]({TRACE_PNG})",
            "",
            f"![alpha per layer over rounds]({HEATMAP_PNG})",
            "",
        ]
    return "\n".join(lines)


def _heading(result: BenchResult) -> list[str]:
    """The title, where and how the run was made, and a warning when it was not lossless."""
    env, settings = result.environment, result.settings
    lines = [
        f"# delspec bench: {result.model['name']}",
        "",
        f"{env['date']} · torch {env['torch']} · transformers {env['transformers']} · "
        f"{env['threads']} thread(s) · {env['cpu']} · {_weights(result.model)} on "
        f"{result.model['device']} · {result.model['layers']} layers{_bandwidth(env)}",
        "",
        f"{settings['prompts']} prompts ({_origin(settings)})"
        f"{', as chat messages' if settings['chat'] else ''}, {_decoding(settings)}, at most "
        f"{settings['max_new_tokens']} new tokens; methods interleaved per prompt.",
        "",
    ]
    if not result.ok:
        lines += ["**NOT LOSSLESS: some delspec outputs differ from ar (see below).**", ""]
    return lines


def _peer(result: BenchResult) -> list[str]:
    """The llama.cpp build's line where llama.cpp methods ran."""
    if any(method.startswith("llama-cpp") for method in result.methods):
        return [peer_line(result.environment), ""]
    return []


def peer_line(env: dict) -> str:
    """Which llama.cpp build the llama.cpp methods ran (`environment.llama_cpp_build`)."""
    build = env.get("llama_cpp_build")
    if not build:
        return "llama.cpp peer: build not recorded."
    features = [f.split("=")[0].strip() for f in build["system_info"].split("|") if "= 1" in f]
    features = [f.removeprefix("CPU :").strip() for f in features]
    return f"llama.cpp peer: {build['library']} ({' '.join(features)})."


def _decoding(settings: dict) -> str:
    """ "greedy", or the sampling settings (older results have none: greedy)."""
    sampling = settings.get("sampling")
    if not sampling:
        return "greedy"
    top = f", top-k {sampling['top_k']}" if sampling["top_k"] else ""
    return (
        f"sampled (temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}{top}; "
        "each prompt seeded with its index)"
    )


def _bandwidth(env: dict) -> str:
    """How fast the model's weights could be read at the start and end of the run, where
    measured (older results lack it): a busy host reads them slower, and speculation gains
    more there."""
    read = env.get("read") or {}
    start_end = read.get("gb_per_s") or []
    if len(start_end) < 2:
        return ""
    size = read["bytes"] / 2**20
    return (
        f" · reading {size:.0f} MiB (the weights' size) at {start_end[0]:g} GB/s at the start, "
        f"{start_end[1]:g} at the end"
    )


def _table_one(result: BenchResult) -> list[str]:
    """Per method: eTPL / speedup on each task, overall tokens/s and speedup."""
    tasks, aggregates = result.settings["tasks"], result.aggregates
    lines = [
        "| Method | " + " | ".join(tasks) + " | Speed (tok/s) | Overall |",
        "|---|" + "---|" * (len(tasks) + 2),
    ]
    for method in result.methods:
        cells = [_cell(aggregates[task][method]) for task in tasks]
        overall = aggregates[OVERALL][method]
        name = method + _mark(result, method, overall["lossless"], " ({})")
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {overall['tokens_per_s']:.2f} | "
            f"{overall['speedup']:.2f}× |"
        )
    return [
        *lines,
        "",
        f"Cells: eTPL / speedup over {REFERENCE} (ratio of overall tokens/s on the task's "
        "prompts, measured in this run); – where a peer library exposes no eTPL.",
        "",
    ]


def _details(result: BenchResult) -> list[str]:
    """Per method over all prompts: speeds, acceptance, exit layers, memory, losslessness."""
    lines = [
        "## Details (all prompts)",
        "",
        "| Method | tok/s | speedup | median per-prompt speedup | prefill tok/s | decode tok/s "
        "| acceptance | mean exit layer | mean draft length | policy time share "
        "| peak RSS MiB (own / process) | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, info in result.methods.items():
        m = result.aggregates[OVERALL][method]
        rss = info.get("memory") or {}
        lines.append(
            f"| {method} | {m['tokens_per_s']:.2f} | {m['speedup']:.2f}× | "
            f"{m['speedup_median']:.2f}× | {_num(m.get('prefill_tokens_per_s'), '.1f')} | "
            f"{_num(m.get('decode_tokens_per_s'), '.2f')} | {_num(m['acceptance_rate'], '.1%')} | "
            f"{_num(m['mean_exit_layer'], '.1f')} | {_num(m['mean_draft_length'], '.2f')} | "
            f"{_num(m['policy_share'], '.1%')} | {_num(rss.get('peak_mib'), '.0f')} / "
            f"{_num(rss.get('process_peak_mib'), '.0f')} | {'yes' if m['lossless'] else 'NO'} |"
        )
    return [*lines, "", *_details_notes(result), *_sources(result)]


def _sources(result: BenchResult) -> list[str]:
    """Per task, for each method that drafted: where its rounds' drafts came from, and how
    many of each source's draft tokens were accepted."""
    tasks = [*result.settings["tasks"], OVERALL]
    drafting = [
        method
        for method in result.methods
        if (result.aggregates[OVERALL][method].get("sources") or {}).get("plain", 1.0) < 1.0
    ]
    if not drafting:
        return []
    lines = [
        "## Draft sources",
        "",
        "| Task | Method | context only | exit layer only | context + exit layer | plain "
        "| context acceptance | exit-layer acceptance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for task in tasks:
        for method in drafting:
            m = result.aggregates[task][method]
            shares = m["sources"]
            lines.append(
                f"| {task} | {method} | "
                + " | ".join(_num(shares[k], ".1%") for k in ("context", "layer", "mixed", "plain"))
                + f" | {_num(m['context_acceptance'], '.1%')} | "
                f"{_num(m['layer_acceptance'], '.1%')} |"
            )
    return [
        *lines,
        "",
        "Shares of rounds by where their drafts came from (a plain round drafts nothing; "
        "context + exit layer: context tokens before the exit layer's drafts or after them); "
        "acceptance: accepted over drafted tokens of each source.",
        "",
    ]


def summary_lines(result: BenchResult) -> list[str]:
    """A few lines for the terminal: overall speed and speedup per method, then losslessness."""
    overall = result.aggregates[OVERALL]
    width = max(map(len, overall))
    lines = [
        f"{method:<{width}}  {m['tokens_per_s']:8.2f} tok/s  {m['speedup']:.2f}×"
        + _mark(result, method, m["lossless"], "  {}")
        for method, m in overall.items()
    ]
    for failure in result.lossless["failures"]:
        lines.append(
            f"NOT LOSSLESS: {failure['method']} on {failure['task']}/{failure['prompt_id']} "
            f"differs from {REFERENCE} at token {failure['first_divergence']}"
        )
    return lines


def _details_notes(result: BenchResult) -> list[str]:
    start = result.environment.get("rss_start_mib")
    return [
        "Prefill: prompt tokens per second of the prompt's forward pass; decode: new tokens per "
        "second after it (– where a library does not time them apart). Peak RSS, own: the "
        "resident memory the method needs, as measured in this one process: what the RSS grew "
        "by while the method was set up (built and warmed up: a peer's own weights and buffers) "
        "plus its largest peak above the level just before one of its generations (KV cache, "
        "activations), plus, for delspec methods, the tensors of delspec's model they share "
        "(weights and the derived copies made so far). It leaves out the interpreter and "
        f"libraries (the process had {_num(start, '.0f')} MiB, delspec's model included, when "
        "the bench started). Process: the process's peak during the method's generations, with "
        "every method's models loaded. Memory an allocator reuses from earlier work does not "
        "show as growth.",
        "",
    ]


def _method_notes(result: BenchResult) -> list[str]:
    lines = ["## Methods", "", f"Decoding, for every method: {_decoding(result.settings)}.", ""]
    for label, info in result.methods.items():
        options = ", ".join(f"{k}={v}" for k, v in info["options"].items())
        lines.append(f"- `{label}`: {info['description']}" + (f" ({options})" if options else ""))
    for label, reason in result.settings.get("skipped", {}).items():
        lines.append(f"- `{label}`: skipped, {reason}")
    return [*lines, ""]


def _sweep_notes(result: BenchResult) -> list[str]:
    if not result.sweeps:
        return []
    held_out = result.settings["calibration_held_out"]
    lines = [
        "## Static sweeps",
        "",
        "Chosen per task by overall tokens/s on calibration prompts "
        + ("held out from the evaluated ones." if held_out else "that are also evaluated."),
        "",
    ]
    for label, tasks in result.sweeps.items():
        for task, sweep in tasks.items():
            chosen = sweep["chosen"]
            best = max(row["tokens_per_s"] for row in sweep["grid"])
            lines.append(
                f"- `{label}` on {task}: E={chosen['exit_layer']}, d={chosen['draft_length']} "
                f"({best:.1f} tok/s on {sweep['calibration_prompts']} prompt(s), "
                f"{len(sweep['grid'])} settings)"
            )
    return [*lines, ""]


def _sampled_peers(result: BenchResult) -> bool:
    """Whether the run sampled: peers then draw with their own generators, not `ar`'s."""
    return bool(result.settings.get("sampling"))


def _mark(result: BenchResult, method: str, lossless: bool, form: str) -> str:
    """How a method's name is marked: not at all when its output was `ar`'s, "own draws" for
    a peer of a sampled run, else NOT LOSSLESS (in `form`)."""
    if lossless:
        return ""
    own = _sampled_peers(result) and result.methods[method]["peer"]
    return form.format("own draws" if own else "NOT LOSSLESS")


def _lossless_notes(result: BenchResult) -> list[str]:
    lossless = result.lossless
    lines = ["## Losslessness", ""]
    if lossless["ok"]:
        lines.append(f"Every delspec method's output is token-identical to {REFERENCE}'s.")
    for failure in lossless["failures"]:
        lines.append(f"- **NOT LOSSLESS** {_mismatch(failure)}")
    if lossless["peer_mismatches"]:
        why = "their own random draws" if _sampled_peers(result) else "float rounding may differ"
        lines += ["", f"Peer libraries ({why}; these do not fail the run):"]
        lines += [f"- {_mismatch(m)}" for m in lossless["peer_mismatches"]]
    elif any(info["peer"] for info in result.methods.values()):
        lines.append(f"Peer libraries' outputs are token-identical to {REFERENCE}'s too.")
    return [*lines, ""]


def _mismatch(m: dict[str, Any]) -> str:
    return (
        f"`{m['method']}` on {m['task']}/{m['prompt_id']}: first divergence from {REFERENCE} "
        f"at token {m['first_divergence']}"
    )


def _weights(model: dict[str, Any]) -> str:
    """The weight format the loaded model computed in, as the heading names it."""
    named = {"native": "native GGUF blocks", "int8": "int8 (Q8_0) blocks"}
    return named.get(model["weights"], f"{model['dtype']} weights")


def _origin(settings: dict[str, Any]) -> str:
    if "prompts_file" in settings:
        return f"from {settings['prompts_file']}"
    return f"{settings['num_samples']} per task, seed {settings['seed']}"


def _cell(m: dict[str, Any]) -> str:
    return f"{_num(m['etpl'], '.3f')} / {m['speedup']:.2f}×"


def _num(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
