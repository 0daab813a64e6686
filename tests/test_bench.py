"""`delspec bench` end to end on a tiny random model: files, table, plots, losslessness, CLI."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from matplotlib.image import imread
from tiny_models import tiny_hf_llama
from transformers import AutoTokenizer

from delspec.bench.backends import (
    BACKENDS,
    LLAMA_CMAKE_ARGS,
    DelspecBackend,
    Generate,
    Output,
    TransformersBackend,
)
from delspec.bench.methods import METHODS, MethodSpec, parse_methods
from delspec.bench.metrics import first_divergence
from delspec.bench.report import _heading, peer_line
from delspec.bench.runner import MAX_REPEATS_FACTOR
from delspec.bench.tasks import TASKS, load_task
from delspec.cli import main
from delspec.errors import ConfigError
from delspec.weights.gguf_file import GGUFFile
from delspec.weights.loading import load_model
from delspec.weights.named_models import default_model_path

LAYERS = 6
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ECONOMIZE = importlib.util.find_spec("economize") is not None
METHODS_ARG = (
    "ar,del,static:E=2,d=3,static-sweep:E=2/4,d=2/4,calibration=1,hf,hf-early-exit:E=2,"
    "hf-lookup:d=4"
)
if ECONOMIZE:
    METHODS_ARG += ",economize-early-exit:E=2,d=3"
LABELS = [
    "ar",
    "del",
    "static:E=2,d=3",
    "static-sweep:E=2/4,d=2/4,calibration=1",
    "hf",
    "hf-early-exit:E=2",
    "hf-lookup:d=4",
] + (["economize-early-exit:E=2,d=3"] if ECONOMIZE else [])
OWN = LABELS[:4]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, saved by transformers. Layers 2.. barely
    change the residual stream, so early exits agree with the full model and drafts get accepted.
    """
    tokenizer = AutoTokenizer.from_pretrained(GGUFFile(default_model_path()).directory)
    model = tiny_hf_llama(
        vocab_size=len(tokenizer),
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)  # peaked logits: no near-ties
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    directory = tmp_path_factory.mktemp("bench") / "tiny-smollm2"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def bench(model: Path, out: Path, *options: str) -> int:
    common = ["--model", str(model), "--threads", "1", "--max-new-tokens", "12", "--out", str(out)]
    return main(["bench", *common, *options])


@pytest.fixture(scope="module")
def run(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """Every task, 2 prompts each, our methods, a static sweep and the transformers peers."""
    out = tmp_path_factory.mktemp("bench-out")
    return bench(tiny_dir, out, "--num-samples", "2", "--methods", METHODS_ARG), out


@pytest.fixture(scope="module")
def results(run: tuple[int, Path]) -> dict:
    return json.loads((run[1] / "results.json").read_text())


def test_run_succeeds_and_writes_every_file(run):
    code, out = run
    assert code == 0
    names = {p.name for p in out.iterdir()}
    expected = {"results.json", "summary.json", "table.md", "speedup.png"}
    assert expected | {"exit_layer_trace.png", "alpha_heatmap.png"} == names


def test_results_json(results):
    tasks = list(TASKS)
    assert (
        results["settings"] | {"tasks": tasks, "num_samples": 2, "seed": 42} == results["settings"]
    )
    assert results["settings"]["calibration_held_out"] is True
    env = results["environment"]
    assert {"torch", "threads", "cpu", "date", "command"} <= set(env)
    assert env["threads"] == 1 and "bench" in env["command"]
    # the CPU as /proc/cpuinfo names its first processor, family and model numbers included
    # where it has them ("AMD EPYC" alone is a Zen 2 or a Zen 3, whose products differ)
    info = Path("/proc/cpuinfo")
    first = info.read_text().split("\n\n")[0] if info.exists() else ""
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in first.splitlines())
    )
    if fields.get("model name") and fields.get("cpu family"):
        numbers = f"family {fields['cpu family']}, model {fields['model']}"
        assert env["cpu"] == f"{fields['model name']} ({numbers})"
    # how fast the model's weights could be read when the run started and when it ended (a busy
    # host's reads are slower)
    start, end = env["read"]["gb_per_s"]
    assert 0.5 < start < 5000 and 0.5 < end < 5000 and env["read"]["bytes"] > 0
    assert list(results["methods"]) == LABELS
    assert results["methods"]["hf"]["peer"] and not results["methods"]["del"]["peer"]
    records = results["records"]
    assert len(records) == len(tasks) * 2 * len(LABELS)
    for record in records:
        assert record["new_tokens"] == 12  # a random model never says EOS here
        assert record["wall_s"] > 0 and record["tokens_per_s"] > 0
        peer = results["methods"][record["method"]]["peer"]
        assert (record["stats"] is None) == peer
        # delspec times the prompt's pass and the decoding apart; transformers does not
        phases = ("prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s")
        assert all((record[key] is None) == peer for key in phases), record
    assert results["settings"]["skipped"] == {}
    assert env["rss_start_mib"] > 0
    for label, info in results["methods"].items():
        memory = info["memory"]
        assert set(memory) == {"shared_mib", "setup_mib", "run_mib", "peak_mib", "process_peak_mib"}
        assert (memory["shared_mib"] is None) == info["peer"], label
        assert memory["setup_mib"] >= 0 and memory["run_mib"] >= 0
        assert memory["process_peak_mib"] >= memory["peak_mib"] >= (memory["shared_mib"] or 0)
    assert results["methods"]["hf"]["memory"]["setup_mib"] > 0  # its own copy of the model
    assert set(results["aggregates"]) == {*tasks, "overall"}
    for group in results["aggregates"].values():
        assert list(group) == LABELS
        assert group["ar"]["speedup"] == 1.0 and group["ar"]["etpl"] == pytest.approx(
            1 / LAYERS, abs=1e-5
        )
        assert group["del"]["acceptance_rate"] > 0.5  # the tiny model's early exits agree
        assert group["hf"]["etpl"] is None and group["hf"]["decode_tokens_per_s"] is None
        assert group["ar"]["decode_tokens_per_s"] > 0 and group["ar"]["prefill_tokens_per_s"] > 0


def test_methods_are_interleaved_in_rotated_order(results):
    turns: dict[str, set[int]] = {}
    by_prompt: dict[tuple[str, str], list[int]] = {}
    for r in results["records"]:
        turns.setdefault(r["method"], set()).add(r["turn"])
        by_prompt.setdefault((r["task"], r["prompt_id"]), []).append(r["turn"])
    assert all(sorted(t) == list(range(len(LABELS))) for t in by_prompt.values())
    assert all(t == set(range(len(LABELS))) for t in turns.values())  # 10 prompts > methods


def test_static_sweep_picks_a_grid_setting_per_task(results):
    sweeps = results["sweeps"]["static-sweep:E=2/4,d=2/4,calibration=1"]
    assert list(sweeps) == list(TASKS)
    for sweep in sweeps.values():
        grid = [(row["exit_layer"], row["draft_length"]) for row in sweep["grid"]]
        assert grid == [(2, 2), (2, 4), (4, 2), (4, 4)]
        best = max(sweep["grid"], key=lambda row: row["tokens_per_s"])
        assert sweep["chosen"] == {
            "exit_layer": best["exit_layer"],
            "draft_length": best["draft_length"],
        }
        assert sweep["calibration_prompts"] == 1


def test_losslessness(results):
    assert results["lossless"]["ok"] and not results["lossless"]["failures"]
    records = results["records"]
    assert all(r["lossless"] for r in records if r["method"] in OWN)
    # float32 transformers matches delspec's float32 model on this model's peaked logits
    assert results["lossless"]["peer_mismatches"] == []
    assert all(r["first_divergence"] is None for r in records)


def test_summary_json(run, results):
    summary = json.loads((run[1] / "summary.json").read_text())
    assert list(summary) == ["tiny-smollm2"]
    (groups,) = summary.values()
    assert list(groups) == [*TASKS, "overall"]
    for group, methods in groups.items():
        assert list(methods) == LABELS
        for label, cell in methods.items():
            assert set(cell) == {"speedup", "tokens_per_s", "lossless"}
            assert cell["speedup"] == results["aggregates"][group][label]["speedup"]
            assert cell["lossless"] is True


def test_table_is_shaped_like_table_1(run, results):
    table = (run[1] / "table.md").read_text()
    read = results["environment"]["read"]
    start, end = read["gb_per_s"]
    size = read["bytes"] / 2**20
    assert f" · reading {size:.0f} MiB (the weights' size) at {start:g} GB/s" in table
    assert f"GB/s at the start, {end:g} at the end\n" in table
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| Method |"))
    assert header == "| Method | " + " | ".join(TASKS) + " | Speed (tok/s) | Overall |"
    rows = lines[lines.index(header) + 2 : lines.index(header) + 2 + len(LABELS)]
    cell = r"(\d\.\d{3}|–) / \d+\.\d\d×"
    for label, row in zip(LABELS, rows, strict=True):
        pattern = rf"\| {re.escape(label)} \| " + r" \| ".join([cell] * len(TASKS))
        assert re.fullmatch(pattern + r" \| \d+\.\d\d \| \d+\.\d\d× \|", row), row
    assert rows[0].endswith(" | 1.00× |") and "NOT LOSSLESS" not in table
    assert "static-sweep:E=2/4,d=2/4,calibration=1` on humaneval: E=" in table


def test_plots_are_valid_pngs(run):
    for name in ("speedup.png", "exit_layer_trace.png", "alpha_heatmap.png"):
        path = run[1] / name
        assert path.read_bytes()[:8] == PNG_MAGIC
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_trace_of_a_del_prompt(results):
    trace = results["trace"]
    assert trace["method"] == "del" and trace["layers"] == list(range(1, LAYERS))
    assert len(trace["rounds"]) > 1
    assert all(len(entry["alpha"]) == LAYERS - 1 for entry in trace["rounds"])


class CorruptBackend(DelspecBackend):
    """delspec output with its last token changed: not lossless."""

    def generator(self, strategy, options) -> Generate:
        generate = super().generator(strategy, options)

        def corrupt(prompt_ids: list[int], max_new_tokens: int) -> Output:
            output = generate(prompt_ids, max_new_tokens)
            output.token_ids[-1] += 1
            return output

        return corrupt


@pytest.fixture
def corrupt_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BACKENDS, "corrupt", CorruptBackend)
    monkeypatch.setitem(METHODS, "broken", MethodSpec("static", backend="corrupt"))
    monkeypatch.setitem(METHODS, "broken-peer", MethodSpec("ar", backend="corrupt", peer=True))


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "The capital of France is", "id": "a"}, {"prompt": "def f(x):", "id": "b"}]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


def test_a_non_lossless_method_fails_the_run(
    tiny_dir, tmp_path, prompts_file, corrupt_methods, capsys
):
    out = tmp_path / "out"
    code = bench(tiny_dir, out, "--prompts", str(prompts_file), "--methods", "broken,broken-peer")
    assert code == 1
    captured = capsys.readouterr()
    assert "NOT LOSSLESS" in captured.err and "broken on custom/a differs" in captured.out
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["prompts_file"] == str(prompts_file)
    lossless = results["lossless"]
    assert not lossless["ok"]
    assert {(f["method"], f["prompt_id"], f["first_divergence"]) for f in lossless["failures"]} == {
        ("broken", "a", 11),
        ("broken", "b", 11),
    }
    assert [m["method"] for m in lossless["peer_mismatches"]] == ["broken-peer"] * 2
    assert "| broken (NOT LOSSLESS) |" in (out / "table.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tiny-smollm2"]["custom"]["broken"]["lossless"] is False


def test_a_peer_mismatch_alone_does_not_fail_the_run(
    tiny_dir, tmp_path, prompts_file, corrupt_methods
):
    out = tmp_path / "out"
    assert bench(tiny_dir, out, "--prompts", str(prompts_file), "--methods", "broken-peer") == 0
    table = (out / "table.md").read_text()
    assert "`broken-peer` on custom/a: first divergence from ar at token 11" in table
    assert not (out / "alpha_heatmap.png").exists()  # no DEL method ran


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--methods", "ar,nope"], "unknown method 'nope'; choose from ar, del"),
        (["--tasks", "gsm8k,nope"], "unknown task(s) nope; choose from humaneval"),
        (["--methods", "del,del"], "method(s) given twice: del"),
        (["--methods", "static:E"], "expected key=value, got 'E'"),
        (["--tasks", "gsm8k", "--prompts", "x.jsonl"], "either tasks or a prompts file"),
    ],
)
def test_cli_errors_come_before_loading_the_model(tmp_path, capsys, options, message):
    assert bench(tmp_path / "no-such-model", tmp_path / "out", *options) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("static:E=99", "method 'static:E=99': exit layer must be in 1..6"),
        (
            "hf-lookup:d=4,window=3",
            "method 'hf-lookup:d=4,window=3': prompt lookup takes the options draft_length (d) "
            "and ngram, not window",
        ),
        ("hf-lookup:ngram=0", "method 'hf-lookup:ngram=0': ngram must be an integer >= 1, got 0"),
    ],
)
def test_bad_method_option_is_reported_before_timing(tiny_dir, tmp_path, capsys, method, message):
    code = bench(tiny_dir, tmp_path / "out", "--tasks", "gsm8k", "--methods", method)
    assert code == 2
    assert message in capsys.readouterr().err


def test_parse_methods():
    methods = parse_methods("del:omega=0.9,static:E=8,d=4,static-sweep:E=2/4,calibration=3")
    assert [m.label for m in methods] == [
        "ar",
        "del:omega=0.9",
        "static:E=8,d=4",
        "static-sweep:E=2/4,calibration=3",
    ]
    paper = {"preset": "paper"}  # the paper's methods draft with a plain exit head
    assert [dict(m.options) for m in methods] == [
        paper,
        {**paper, "omega": 0.9},
        {**paper, "exit_layer": 8, "draft_length": 4},
        {**paper, "exit_layer": [2, 4], "calibration": 3},
    ]
    assert methods[3].spec.sweep and methods[0].name == "ar"
    (path,) = parse_methods("ar,del-fast:adapters=/tmp/a/x.safetensors,draft_vocab=8")[1:]
    assert dict(path.options) == {"adapters": "/tmp/a/x.safetensors", "draft_vocab": 8}
    with pytest.raises(ConfigError, match="comes before any method"):
        parse_methods("E=3,del")


def test_parse_lookup_methods():
    methods = parse_methods("hf-lookup,hf-lookup:d=4,ngram=3,llama-cpp-lookup:d=5,n_ctx=512")[1:]
    assert [m.label for m in methods] == [
        "hf-lookup",
        "hf-lookup:d=4,ngram=3",
        "llama-cpp-lookup:d=5,n_ctx=512",
    ]
    assert [dict(m.options) for m in methods] == [
        {},
        {"draft_length": 4, "ngram": 3},
        {"draft_length": 5, "n_ctx": 512},
    ]
    assert [(m.spec.backend, m.spec.strategy, m.spec.peer) for m in methods] == [
        ("transformers", "lookup", True),
        ("transformers", "lookup", True),
        ("llama-cpp", "lookup", True),
    ]


def test_hf_lookup_equals_greedy_with_fewer_forward_passes(tiny_dir):
    """Prompt lookup is lossless under greedy decoding: the same tokens as plain `generate`. On
    a repetitive prompt its drafts are accepted, so it runs fewer forward passes than tokens."""
    lm = load_model(tiny_dir)
    backend = TransformersBackend(lm)
    passes: list[int] = []
    backend.model.register_forward_hook(lambda *_: passes.append(1))
    ids = lm.tokenizer.encode("one two three four five six seven eight " * 3)
    greedy = backend.generator("greedy", {})(ids, 24).token_ids
    assert len(passes) == 24
    passes.clear()
    for options in ({}, {"draft_length": 4, "ngram": 1}):
        assert backend.generator("lookup", options)(ids, 24).token_ids == greedy
    assert len(passes) < 24


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_llama_cpp_is_skipped_with_a_hint_when_not_installed(
    tiny_dir, tmp_path, prompts_file, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` fails
    out = tmp_path / "out"
    llama = ["llama-cpp", "llama-cpp-lookup:d=4"]
    methods = ",".join([*llama, "del"])
    assert bench(tiny_dir, out, "--prompts", str(prompts_file), "--methods", methods) == 0
    hint = f"CMAKE_ARGS=\"{LLAMA_CMAKE_ARGS}\" pip install 'delspec[llama]'"
    lines = [x for x in capsys.readouterr().err.splitlines() if "llama-cpp" in x]
    for label, line in zip(llama, lines, strict=True):
        assert line.startswith(f"delspec: skipping {label}: llama-cpp-python is not installed")
        assert hint in line and "make install-llama" in line
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["ar", "del"] and results["lossless"]["ok"]
    assert list(results["settings"]["skipped"]) == llama
    table = (out / "table.md").read_text()
    for label in llama:
        assert f"- `{label}`: skipped, llama-cpp-python is not installed" in table


def test_repeats_time_each_prompt_several_times(tiny_dir, tmp_path, capsys):
    args = ("--tasks", "gsm8k", "--num-samples", "1", "--methods", "static:E=2,d=2")
    assert bench(tiny_dir, tmp_path / "out", *args, "--repeats", "3") == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["settings"]["repeats"] == 3
    # still one record per method and prompt, lossless, with the median time
    assert [r["method"] for r in results["records"]] == ["ar", "static:E=2,d=2"]
    assert all(r["lossless"] and r["wall_s"] > 0 for r in results["records"])
    assert all(r["timings"] == 3 for r in results["records"])
    assert bench(tiny_dir, tmp_path / "bad", *args, "--repeats", "0") == 2
    assert "repeats must be >= 1" in capsys.readouterr().err


def test_short_runs_are_timed_until_they_add_up_to_min_seconds(tiny_dir, tmp_path, capsys):
    """`--min-seconds` adds rounds (every method again, rotated) past `--repeats` until each
    method's timings of a prompt add up to it, up to `MAX_REPEATS_FACTOR` times as many."""
    args = ("--tasks", "gsm8k", "--num-samples", "1", "--methods", "static:E=2,d=2")
    for seconds, timings in (("0", 2), ("1e6", 2 * MAX_REPEATS_FACTOR)):
        out = tmp_path / seconds
        assert bench(tiny_dir, out, *args, "--repeats", "2", "--min-seconds", seconds) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["settings"]["min_seconds"] == float(seconds)
        [ar, static] = results["records"]
        assert ar["timings"] == static["timings"] == timings
        assert ar["lossless"] and static["lossless"]
    assert bench(tiny_dir, tmp_path / "bad", *args, "--min-seconds", "-1") == 2
    assert "min_seconds must be a number >= 0" in capsys.readouterr().err


def test_sampled_runs_give_every_delspec_method_ar_s_tokens(tiny_dir, tmp_path, capsys):
    """`--temperature`/`--top-p`: every method samples (seeded per prompt), delspec's own
    still give `ar`'s tokens, and the settings are recorded."""
    args = ["--tasks", "gsm8k,summarization", "--num-samples", "1"]
    args += ["--methods", "ar,del,static:E=2,d=3,hf"]
    assert bench(tiny_dir, tmp_path / "greedy", *args) == 0
    assert bench(tiny_dir, tmp_path / "out", *args, "--temperature", "30", "--top-p", "0.99") == 0
    greedy = json.loads((tmp_path / "greedy" / "results.json").read_text())
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["settings"]["sampling"] == {
        "temperature": 30.0, "top_k": 0, "top_p": 0.99, "seeds": "prompt index"
    }  # fmt: skip
    records = results["records"]
    own = [r for r in records if r["method"] != "hf"]
    assert own and all(r["lossless"] for r in own)
    ar_texts = [r["text"] for r in records if r["method"] == "ar"]
    assert ar_texts != [r["text"] for r in greedy["records"] if r["method"] == "ar"]
    hf_texts = [r["text"] for r in records if r["method"] == "hf"]
    assert hf_texts != [r["text"] for r in greedy["records"] if r["method"] == "hf"]
    table = (tmp_path / "out" / "table.md").read_text()
    assert "sampled (temperature 30, top-p 0.99" in table
    assert "| hf (own draws) |" in table and "their own random draws" in table
    assert bench(tiny_dir, tmp_path / "bad", *args, "--temperature", "0.5", "--top-p", "0") == 2
    assert "top_p must be in" in capsys.readouterr().err


def test_chat_sends_each_prompt_through_the_chat_template(tiny_dir, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    args = ("--tasks", "mtbench", "--num-samples", "1", "--methods", "ar,del", "--chat")
    assert bench(tiny_dir, tmp_path / "out", *args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["settings"]["chat"] is True
    [question] = load_task("mtbench", 1, 42)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question.text}], tokenize=False, add_generation_prompt=True
    )
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    assert expected > len(tokenizer.encode(question.text))
    assert [r["prompt_tokens"] for r in results["records"]] == [expected, expected]
    assert all(r["lossless"] for r in results["records"])
    assert "as chat messages" in (tmp_path / "out" / "table.md").read_text()

    tokenizer.chat_template = None  # a model without one: a clear error, no results
    plain = tmp_path / "no-template"
    shutil.copytree(tiny_dir, plain)
    tokenizer.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    capsys.readouterr()
    assert bench(plain, tmp_path / "bad", *args) == 2
    assert "has no chat template; pass a plain prompt" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_methods_on_another_weight_format_are_checked_against_ar_on_it(tiny_dir, tmp_path, capsys):
    methods = "ar:weights=int8,static:E=2,d=2,weights=int8"
    args = ("--tasks", "gsm8k", "--num-samples", "1", "--methods", methods)
    assert bench(tiny_dir, tmp_path / "out", *args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    by_method = {r["method"]: r for r in results["records"]}
    assert by_method["ar"]["weights"] == "float"  # a Hugging Face directory loads in float
    assert by_method["ar:weights=int8"]["weights"] == "int8"
    static = by_method["static:E=2,d=2,weights=int8"]
    assert static["reference"] == "ar:weights=int8" and static["lossless"]
    # a model is (checkpoint, weight format): another format's output is not compared with ar's
    assert by_method["ar:weights=int8"]["reference"] == "ar:weights=int8"
    lonely = ("--tasks", "gsm8k", "--num-samples", "1", "--methods", "static:E=2,d=2,weights=int8")
    assert bench(tiny_dir, tmp_path / "bad", *lonely) == 2
    assert "add ar:weights=int8" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("weights", "named"),
    [
        ("native", "native GGUF blocks"),
        ("int8", "int8 (Q8_0) blocks"),
        ("float", "float32 weights"),
    ],
)
def test_table_heading_names_the_weight_format(tmp_path, weights, named):
    model = {"name": "m", "weights": weights, "dtype": "float32", "device": "cpu", "layers": 30}
    environment = {"date": "d", "torch": "t", "transformers": "t", "threads": 2, "cpu": "c"}
    settings = {"prompts": 1, "num_samples": 1, "seed": 0, "max_new_tokens": 8, "chat": False}
    result = SimpleNamespace(model=model, environment=environment, settings=settings, ok=True)
    heading = _heading(result)
    assert f"· {named} on cpu · 30 layers" in heading[2]


def test_draft_sources_table(tiny_dir, tmp_path):
    """Methods that draft get a table of their rounds' draft sources per task."""
    out = tmp_path / "out"
    methods = "ar,lookup:ngram_min=1,static:E=2,d=3"
    assert (
        bench(tiny_dir, out, "--tasks", "humaneval", "--num-samples", "1", "--methods", methods)
        == 0
    )
    overall = json.loads((out / "results.json").read_text())["aggregates"]["overall"]
    lookup = overall["lookup:ngram_min=1"]
    assert lookup["sources"]["layer"] == lookup["sources"]["mixed"] == 0.0
    assert lookup["sources"]["context"] > 0 and lookup["layer_acceptance"] is None
    static = overall["static:E=2,d=3"]
    assert static["sources"]["layer"] == 1.0 and static["context_acceptance"] is None
    table = (out / "table.md").read_text()
    assert "## Draft sources" in table
    assert "| humaneval | lookup:ngram_min=1 |" in table and "| overall | static:E=2,d=3 |" in table
    assert "| ar |" not in table.split("## Draft sources")[1]


def test_peer_line_names_the_llama_cpp_build():
    """A report names which llama.cpp library its llama.cpp methods ran and the CPU features
    that build uses (llama.cpp's own system-info line), or says that none was recorded."""
    info = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 0 | "
    env = {"llama_cpp_build": {"library": "/opt/llama/bin", "system_info": info}}
    assert peer_line(env) == "llama.cpp peer: /opt/llama/bin (SSE3 AVX2 AVX512 AVX512_VNNI)."
    assert peer_line({}) == "llama.cpp peer: build not recorded."
