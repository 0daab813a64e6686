"""The command line on the real model: JSON output, traces, and clear errors for bad input."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest
from helpers import CUT_OFF_PROMPTS

import delspec.weights.loading
from delspec.cli import build_parser, commands, main
from delspec.decode_config import DEFAULT_STRATEGY
from delspec.model.architectures import FAMILIES


def test_generate_json_and_trace(smollm2, tmp_path, capsys):
    trace = tmp_path / "rounds.jsonl"
    code = main(
        [
            "generate",
            "The capital of France is",
            "--max-new-tokens",
            "8",
            "--json",
            "--strategy",
            "static",
            "--exit-layer",
            "26",
            "--draft-length",
            "2",
            "--trace",
            str(trace),
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["strategy"] == "static" and out["finish_reason"] in ("stop", "length")
    assert 0 < len(out["token_ids"]) <= 8 and out["text"]
    stats = out["stats"]
    for key in (
        "prompt_tokens",
        "new_tokens",
        "prefill_ms",
        "decode_ms_per_token",
        "tokens_per_s",
        "acceptance_rate",
        "etpl",
        "mean_exit_layer",
        "mean_draft_length",
    ):
        assert key in stats
    assert stats["mean_exit_layer"] == 26.0
    rounds = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rounds) == stats["rounds"]
    # every round drafts from layer 26, except a plain step when one token is left to make
    assert all(r["exit_layer"] == 26 for r in rounds if r["drafted"])
    assert all(r["exit_layer"] == 0 and r["committed"] == 1 for r in rounds if not r["drafted"])
    assert sum(r["committed"] for r in rounds) == stats["new_tokens"]


def test_int8_drafts_from_the_command_line_match_ar(smollm2, capsys):
    common = ["generate", "def fibonacci(n):", "--max-new-tokens", "16", "--json"]
    common += ["--weights", "float"]  # int8 drafts are made from float weights
    assert main([*common, "--strategy", "ar"]) == 0
    expected = json.loads(capsys.readouterr().out)
    for switch in ("on", "off"):
        argv = [*common, "--strategy", "static", "--exit-layer", "30", "--int8-draft", switch]
        assert main(argv) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["token_ids"] == expected["token_ids"] and got["stats"]["drafted"] > 0
    with pytest.raises(SystemExit) as exit_info:
        main([*common, "--int8-draft", "maybe"])
    assert exit_info.value.code == 2
    assert "expected on, off or auto, got 'maybe'" in capsys.readouterr().err


def test_sampling_controls_from_the_command_line_give_generate_s_tokens(smollm2, capsys):
    """The controls' flags are `Sampling`'s fields; the seeded output is the same whatever
    the strategy."""
    from delspec import generate
    from delspec.decoding.sampling import Sampling

    controls = dict(
        temperature=0.9, top_p=0.95, seed=4, min_p=0.05, frequency_penalty=0.7,
        presence_penalty=0.2, repetition_penalty=1.3, logit_bias={198: -100, 30: 5},
    )  # fmt: skip
    expected = generate(
        smollm2, "The sea", strategy="ar", sampling=Sampling(**controls), max_new_tokens=12
    )
    argv = ["generate", "The sea", "--max-new-tokens", "12", "--json", "--temperature", "0.9"]
    argv += ["--top-p", "0.95", "--seed", "4", "--min-p", "0.05", "--frequency-penalty", "0.7"]
    argv += ["--presence-penalty", "0.2", "--repetition-penalty", "1.3"]
    argv += ["--logit-bias", "198=-100", "--logit-bias", "30=5"]
    assert main(argv) == 0  # del-fast
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected.token_ids
    assert main([*argv, "--strategy", "ar"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected.token_ids


def test_generate_streams_text_and_a_summary(smollm2, capsys):
    assert main(["generate", "Hello", "--max-new-tokens", "6", "--strategy", "ar"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "strategy ar" in captured.err and "mean exit layer" not in captured.err
    assert re.search(r"decode \d+\.\d tok/s .* end-to-end \d+\.\d tok/s", captured.err)


def test_info_lists_the_families_it_runs_without_loading_a_model(capsys, monkeypatch):
    monkeypatch.setattr(commands, "load", None)  # calling it would fail
    assert main(["info", "--families", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["model_type"] for row in rows} == set(FAMILIES)
    assert {"smollm3", "granite", "phi3"} <= {row["gguf"] for row in rows}
    assert main(["info", "--families"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(FAMILIES) and lines[1].startswith("llama ")


def test_info(smollm2, capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layers"] == 30 and info["vocab_size"] == 49152
    assert info["parameters"] > 100_000_000
    assert info["load_seconds"] > 0 and info["peak_resident_mb"] > info["weight_mb"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "x", "--model", "/no/such/model.gguf"], "does not exist"),
        (["generate", "x", "--strategy", "static", "--exit-layer", "31"], "exit layer must be"),
        (["generate", "x", "--strategy", "static", "--draft-length", "0"], "draft length"),
        (["generate", "x", "--temperature", "-1"], "temperature"),
        (["generate", "x", "--temperature", "0.5", "--top-p", "2"], "top_p"),
        (["generate", "x", "--min-p", "-0.5"], "min_p must be in"),
        (["generate", "x", "--frequency-penalty", "9"], "frequency_penalty must be in"),
        (["generate", "x", "--repetition-penalty", "0"], "repetition_penalty must be"),
        (["generate", "x", "--logit-bias", "5=200"], "logit_bias values"),
        (["generate", "x", "--logit-bias", "999999=1"], "not in the vocabulary"),
        (["generate", "", "--chat"], "the chat message is empty"),
        (["generate", "x", "--weights", "bogus"], "use one of native, int8, float, auto"),
        (["generate", "x", "--strategy", DEFAULT_STRATEGY, "--exit-layer", "3"], "exit_layer"),
        (["generate", "x " * 9000, "--strategy", "ar"], "context"),
    ],
)
def test_bad_input_is_a_message_and_exit_2(smollm2, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("delspec: error:") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1"),
        (["generate", "x", "--threads", "0"], "--threads: expected an integer >= 1, got '0'"),
        (["serve", "--threads", "-2"], "--threads: expected an integer >= 1, got '-2'"),
        (["generate", "x", "--exit-layer", "0"], "--exit-layer: expected an integer >= 1"),
        (["generate", "x", "--stop", ""], "--stop: a stop string must not be empty"),
        (["generate", "x", "--logit-bias", "5"], "--logit-bias: expected TOKEN_ID=BIAS"),
        (["serve", "--max-body-mb", "0"], "--max-body-mb: expected a number > 0, got '0'"),
        (["serve", "--prefill-chunk", "0"], "--prefill-chunk: expected an integer >= 1"),
        (["serve", "--prompt-cache-mb", "-1"], "--prompt-cache-mb: expected a number >= 0"),
        (["serve", "--draft-pool-tokens", "-5"], "--draft-pool-tokens: expected an integer >= 0"),
        (["bench-serve", "--soak", "0"], "--soak: expected a number > 0, got '0'"),
        (["bench-serve", "--soak", "5", "--stress"], "not allowed with argument --soak"),
        (["serve", "--port", "99999"], "--port: expected an integer 0..65535, got '99999'"),
        (["serve", "--max-queue", "-1"], "--max-queue: expected an integer >= 0"),
        (["serve", "--max-batch", "0"], "--max-batch: expected an integer >= 1"),
        (["serve", "--timeout", "0"], "--timeout: expected a number > 0"),
        (["serve", "--replicas", "0"], "--replicas: expected an integer >= 1"),
        (["generate", "x", "--seed", "-1"], "--seed: expected an integer 0..9223372036854775807"),
        (["generate", "x", "--top-k", "-1"], "--top-k: expected an integer >= 0"),
    ],
)
def test_bad_arguments_are_refused_when_parsed(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_exit_layer_is_checked_before_the_model_loads(smollm2, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(delspec.weights.loading, "load_model", no_load)
    argv = ["generate", "x", "--strategy", "static", "--exit-layer", "999"]
    assert main(argv) == 2
    assert "exit layer must be in 1..30" in capsys.readouterr().err


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the command loads a model."""

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(delspec.weights.loading, "load_model", no_load)


@pytest.mark.parametrize(
    "argv", [["generate", "caf\udce9 au lait"], ["generate", "x", "--stop", "\udce9"]]
)
def test_text_that_is_not_utf8_is_an_error_before_the_model_loads(no_model, capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("delspec: error: ") and "is not valid text: '\\udce9'" in err
    assert len(err.splitlines()) == 1


def run_cli(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """`delspec ...` in a process of its own."""
    command = [sys.executable, "-m", "delspec.cli", *argv]
    return subprocess.run(command, input=stdin, capture_output=True, timeout=300, env=os.environ)


def test_standard_input_that_is_not_utf8_is_a_one_line_error():
    done = run_cli("generate", "-", stdin=b"caf\xe9 au lait")
    assert done.returncode == 2 and done.stdout == b""
    assert done.stderr.decode().splitlines() == [
        "delspec: error: the prompt is not valid text: '\\udce9' at character 3 is a lone "
        "surrogate (from bytes that are not UTF-8, or a JSON \\u escape of half a character)"
    ]


def test_a_trace_path_that_cannot_be_written_fails_before_generating(no_model, capsys, tmp_path):
    trace = tmp_path / "missing" / "rounds.jsonl"
    assert main(["generate", "Hi", "--trace", str(trace)]) == 2
    assert (
        capsys.readouterr().err == f"delspec: error: --trace {trace}: No such file or directory\n"
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_failed_trace_write_keeps_the_result(smollm2, capsys):
    argv = ["generate", "Hi", "--max-new-tokens", "4", "--strategy", "ar", "--json"]
    assert main([*argv, "--trace", "/dev/full"]) == 1  # every write fails: the disk is full
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["token_ids"]) == 4
    assert captured.err == "delspec: error: --trace /dev/full: No space left on device\n"


@pytest.mark.slow
@pytest.mark.parametrize("prompt", CUT_OFF_PROMPTS)
def test_a_character_the_token_limit_cut_is_left_out(smollm2, capsys, prompt):
    argv = ["generate", prompt, "--max-new-tokens", "16", "--strategy", "ar"]
    assert main([*argv, "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    whole = smollm2.tokenizer.decode(reply["token_ids"])
    assert whole.endswith("\ufffd") and reply["text"] == whole.rstrip("\ufffd")
    assert main(argv) == 0
    assert capsys.readouterr().out == reply["text"] + "\n"  # streamed: the same text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"delspec {version('delspec')}\n"


def test_every_option_has_help_that_shows_its_default():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or action.default == argparse.SUPPRESS:
                continue
            assert action.help, f"{name} {action.dest} has no help"
            if action.default is not None and action.default is not False:
                assert "default" in formatter._expand_help(action), f"{name} {action.dest}"
    generate_help = " ".join(commands.choices["generate"].format_help().split())
    assert "--max-new-tokens MAX_NEW_TOKENS most tokens to generate (default: 128)" in generate_help


def test_the_summary_breaks_between_fields(smollm2, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    argv = ["generate", "Hello", "--max-new-tokens", "6", "--strategy", "static"]
    assert main([*argv, "--exit-layer", "26", "--draft-length", "2"]) == 0
    lines = capsys.readouterr().err.splitlines()
    field = (
        r"── \d+ tokens|decode [\d.]+ tok/s|prefill \d+ ms|end-to-end [\d.]+ tok/s|strategy static"
        r"|drafted \d+|acceptance \d+%|mean exit layer 26\.0|mean draft [\d.]+|eTPL [\d.]+"
    )
    fields = [f for line in lines for f in line.split(" · ")]
    assert len(lines) > 1 and len(fields) == 10
    assert all(re.fullmatch(field, f) for f in fields), lines
    assert main(["generate", "Hello", "--max-new-tokens", "6", "--strategy", "ar"]) == 0
    summary = capsys.readouterr().err
    assert "strategy ar" in summary and "drafted" not in summary


def test_output_paths_are_checked_before_the_work(no_model, capsys, tmp_path):
    file = tmp_path / "a-file"
    file.write_text("")
    for argv, message in [
        (["bench", "--out", str(file)], f"--out {file}: {file} is a file, not a directory"),
        (["bench-serve", "--out", str(file / "x")], f"--out {file / 'x'}: {file} is a file"),
        (["calibrate", "--out", str(tmp_path)], f"--out {tmp_path} is a directory"),
        (["calibrate", "--out", str(file / "x.st")], f"--out {file}: {file} is a file"),
    ]:
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.startswith(f"delspec: error: {message}")
    assert sorted(tmp_path.iterdir()) == [file]  # nothing created


def test_the_server_holds_native_weights_in_huge_pages_unless_told_not_to():
    """A server's load is paid once and its steps for every request: huge pages by default
    there, not for one-off commands; either way the flag decides."""
    parse = build_parser().parse_args
    assert parse(["serve"]).huge_pages and not parse(["serve", "--no-huge-pages"]).huge_pages
    assert (
        not parse(["generate", "hi"]).huge_pages
        and parse(["generate", "hi", "--huge-pages"]).huge_pages
    )
