"""The command line on the real model: JSON output, traces, and clear errors for bad input."""

from __future__ import annotations

import json
import re

import pytest

import delspec.loading
from delspec.cli import main
from delspec.decode_config import DEFAULT_STRATEGY


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
    from delspec.sampling import Sampling

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
    assert "strategy ar" in captured.err
    assert re.search(r"decode \d+\.\d tok/s .* end-to-end \d+\.\d tok/s", captured.err)


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
        (["bench-serve", "--soak", "0"], "--soak: expected a number > 0, got '0'"),
        (["bench-serve", "--soak", "5", "--stress"], "not allowed with argument --soak"),
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

    monkeypatch.setattr(delspec.loading, "load_model", no_load)
    argv = ["generate", "x", "--strategy", "static", "--exit-layer", "999"]
    assert main(argv) == 2
    assert "exit layer must be in 1..30" in capsys.readouterr().err
