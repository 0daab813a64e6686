"""`DecodeConfig`: one set of defaults, presets, and one parser for the CLI, bench method strings
and HTTP bodies, with clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tiny_models import tiny_model

from delspec.bench.backends import DelspecBackend
from delspec.bench.methods import method_config, parse_methods
from delspec.cli import build_parser, main
from delspec.cli.arguments import decode_config
from delspec.decode_config import (
    PAPER,
    PRESETS,
    STRATEGIES,
    DecodeConfig,
    DELOptions,
    DraftConfig,
    StaticOptions,
    parse_option,
)
from delspec.decoding.generate import generate
from delspec.decoding.sequence import Decoding
from delspec.drafting.draft_head import draft_head
from delspec.drafting.exit_head import ExitHead
from delspec.errors import ConfigError
from delspec.policies import POLICIES, make_policy
from delspec.policies.cost_model import LayerCost
from delspec.policies.dynamic_exit import DynamicExit
from delspec.policies.fast_dynamic_exit import FastDynamicExit
from delspec.server.protocol import CompletionRequest
from delspec.weights.loading import LoadedModel

LAYERS = 6


class DigitTokenizer:
    """Token id i is the text "<i>": enough for `generate`'s streaming and stop strings."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in text.strip("<>").split("><")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    model = tiny_model(seed=1, shallow=2, num_layers=LAYERS)
    return LoadedModel(model, DigitTokenizer(), "tiny", "memory", ())


def test_one_set_of_defaults_the_fast_preset():
    config = DecodeConfig()
    assert config == PRESETS["fast"]
    assert config.strategy == "del-fast" and config.options is STRATEGIES["del-fast"]
    assert config.draft == DraftConfig("auto", "auto", True, "auto")
    fast = make_policy(config, 30)
    assert type(fast) is FastDynamicExit and fast.name == "del-fast"
    assert (fast.cost_name, fast.no_draft, fast.shadow_budget, fast.runs) == (
        "measured",
        True,
        0.01,
        True,
    )
    assert (fast.warmup_window, fast.min_evidence, fast.prior, fast.margin) == (4, 3, 1, 0.05)
    # every strategy has default options and a policy for their type
    for strategy, options in STRATEGIES.items():
        assert type(options) in POLICIES
        assert DecodeConfig(strategy).options is options


def test_the_paper_preset_is_the_papers_del_with_a_plain_exit_head(lm):
    assert PRESETS["paper"] is PAPER and PAPER.strategy == "del"
    assert PAPER.options == DELOptions()
    paper = make_policy(PAPER, 30)
    assert type(paper) is DynamicExit  # none of del-fast's additions
    assert (paper.warmup_window, paper.omega, type(paper.cost)) == (32, 0.95, LayerCost)
    assert paper.dynamic_draft and paper.base_candidates == list(range(1, 30))
    head = draft_head(lm, PAPER)
    assert type(head) is ExitHead and not head.int8 and head.vocab is None


def test_updated_applies_flat_options():
    static = DecodeConfig().updated(strategy="static", exit_layer=4, draft_vocab=[8, "full"])
    assert static.options == StaticOptions(exit_layer=4, draft_length=6)
    assert static.draft.draft_vocab == (8, None)
    # the same strategy keeps its options; another strategy starts from its own defaults
    assert static.updated(draft_length=2).options == StaticOptions(4, 2)
    assert static.updated(strategy="fs").options == STRATEGIES["fs"]
    assert static.updated(strategy="fs").draft == static.draft
    # a preset replaces the whole config before the other options apply
    paper_static = static.updated(preset="paper", strategy="static")
    assert paper_static.options == StaticOptions()
    assert paper_static.draft == PAPER.draft
    assert DecodeConfig("dele").options.dynamic_draft is False
    assert static.updated() == static
    with pytest.raises(dataclasses.FrozenInstanceError):
        static.strategy = "ar"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(strategy="nope"), "unknown strategy 'nope'; choose from del, dele, del-fast"),
        (dict(preset="slow"), "unknown preset 'slow'; choose from paper, fast"),
        (dict(exit_layer=3), "strategy 'del-fast' has no option 'exit_layer'; its options: "),
        (dict(strategy="ar", draft_length=3), "strategy 'ar' has no option 'draft_length'"),
        (dict(strategy="static", exit_layer="4"), "exit_layer must be an integer, got '4'"),
        (dict(strategy="static", draft_length=True), "draft_length must be an integer"),
        (dict(strategy="static", draft_length=0), "draft length must be >= 1, got 0"),
        (dict(strategy="fs", max_draft=0), "max draft must be >= 1"),
        (dict(strategy="dv", threshold=1.5), r"threshold must be in \[0, 1\]"),
        (dict(strategy="del", omega="high"), "omega must be a number, got 'high'"),
        (dict(strategy="del", omega=0.0), r"omega must be in \(0, 1\]"),
        (dict(strategy="del", cost="money"), "cost must be one of layers, measured"),
        (dict(strategy="del", gamma_min=5, gamma_max=5), "gamma_min < gamma_max"),
        (dict(strategy="del", shadow_budget=0), r"shadow_budget must be in \(0, 1\]"),
        (dict(strategy="del", prior=-1), "prior must be >= 0"),
        (dict(strategy="del", min_evidence=-1), "min_evidence must be >= 0"),
        (dict(strategy="del", candidates=[2, "x"]), "candidates must be an integer"),
        (dict(strategy="del", runs="yes"), "runs must be true or false"),
        (dict(draft_vocab="many"), "draft_vocab must be a size, sizes, 'full' or 'auto'"),
        (dict(draft_vocab=[8, 2.5]), "draft_vocab must be an integer"),
        (dict(int8_draft="maybe"), "int8_draft must be true, false or 'auto'"),
        (dict(context_vocab=1), "context_vocab must be true or false"),
        (dict(adapters=5), "adapters must be 'auto', 'none' or a file"),
    ],
)
def test_bad_options_are_clear_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        DecodeConfig().updated(**options)


def test_options_of_another_strategy_are_refused():
    with pytest.raises(ConfigError, match="strategy 'static' takes StaticOptions, not DELOptions"):
        DecodeConfig("static", DELOptions())


def test_exit_layers_are_checked_against_the_model():
    for exit_layer in (0, 7):
        with pytest.raises(ConfigError, match=r"exit layer must be in 1\.\.6"):
            make_policy("static", 6, exit_layer=exit_layer)
    with pytest.raises(ConfigError, match=r"exit layer must be in 1\.\.6"):
        make_policy("del", 6, candidates=[2, 9])
    assert make_policy("static", 6).exit_layer == 1  # None: a quarter of the layers, at least 1
    assert make_policy("dv", 24).exit_layer == 6


def test_option_strings():
    assert parse_option("E=18") == ("exit_layer", 18)
    assert parse_option("d=5") == ("draft_length", 5)
    assert parse_option("omega=0.9") == ("omega", 0.9)
    assert parse_option("runs=True") == ("runs", True)
    assert parse_option("candidates=4/8") == ("candidates", [4, 8])
    assert parse_option("adapters=dir/a.safetensors") == ("adapters", "dir/a.safetensors")
    assert parse_option("adapters=dir/full") == ("adapters", "dir/full")
    # `full` stands for the whole vocabulary in a list of draft vocabulary sizes
    assert parse_option("draft_vocab=4096/16384/full") == ("draft_vocab", [4096, 16384, "full"])
    assert DecodeConfig().updated(draft_vocab=[4096, "full"]).draft.draft_vocab == (4096, None)
    for bad in ("E", "=3", "E="):
        with pytest.raises(ConfigError, match="expected key=value"):
            parse_option(bad)


def test_method_strings_become_configs():
    static, fast = parse_methods("static:E=4,d=5,weights=int8,del-fast:draft_vocab=8/16")[1:]
    config, weights = method_config(static.spec.strategy, static.options)
    assert weights == "int8"
    assert config == PAPER.updated(strategy="static", exit_layer=4, draft_length=5)
    config, weights = method_config(fast.spec.strategy, fast.options)
    assert weights is None
    assert config == DecodeConfig().updated(draft_vocab=(8, 16))
    (ar,) = parse_methods("ar")
    assert method_config(ar.spec.strategy, ar.options)[0] == PAPER.updated(strategy="ar")
    (bad,) = parse_methods("del:omega=2")[1:]
    with pytest.raises(ConfigError, match="omega must be in"):
        method_config(bad.spec.strategy, bad.options)


def test_a_bench_method_runs_its_config(lm):
    (static,) = parse_methods("static:E=2,d=3")[1:]
    output = DelspecBackend(lm).generator(static.spec.strategy, static.options)([1, 2, 3], 20)
    drafting = [r for r in output.trace if r["drafted"]]
    assert drafting and all(r["exit_layer"] == 2 and r["drafted"] <= 3 for r in drafting)
    expected = Decoding(lm.model, [1, 2, 3], make_policy("ar", LAYERS), max_new_tokens=20).run()
    assert output.token_ids == expected.token_ids


def args(*argv: str):
    return build_parser().parse_args(["generate", "x", *argv])


def test_command_line_flags_become_configs():
    assert decode_config(args()) == DecodeConfig()
    assert decode_config(args("--preset", "paper")) == PAPER
    paper_static = args("--preset", "paper", "--strategy", "static", "--exit-layer", "4")
    assert decode_config(paper_static) == PAPER.updated(strategy="static", exit_layer=4)
    draft = ("--adapters", "none", "--draft-vocab", "16384,full", "--no-context-vocab")
    config = decode_config(args(*draft, "--int8-draft", "off"))
    assert config.draft == DraftConfig(None, (16384, None), False, False)
    assert config.options == DecodeConfig().options
    options = ("--strategy", "del", "--option", "omega=0.9", "--option", "candidates=4/8")
    assert decode_config(args(*options)).options == DELOptions(candidates=(4, 8), omega=0.9)
    serve = build_parser().parse_args(["serve", "--strategy", "fs", "--draft-length", "3"])
    assert decode_config(serve) == DecodeConfig("fs").updated(draft_length=3)


def test_a_bad_command_line_config_fails_before_loading_the_model(capsys):
    argv = ["generate", "x", "--model", "/no/such/model.gguf"]
    assert main([*argv, "--strategy", "del", "--option", "omega=2"]) == 2
    assert "omega must be in (0, 1], got 2" in capsys.readouterr().err
    assert main([*argv, "--option", "omega"]) == 2
    assert "expected key=value, got 'omega'" in capsys.readouterr().err


def test_http_bodies_become_configs():
    body = {
        "prompt": "hi",
        "delspec": {"strategy": "del", "candidates": [2, 4], "omega": 1, "draft_vocab": [8, None]},
    }
    request = CompletionRequest.model_validate_json(json.dumps(body))
    config = DecodeConfig().updated(**request.delspec)
    assert config.options == DELOptions(candidates=(2, 4), omega=1.0)
    assert config.draft.draft_vocab == (8, None)
    assert CompletionRequest.model_validate({"prompt": "hi"}).delspec is None


def test_generate_takes_a_config_or_its_options_as_keywords(lm):
    prompt = [1, 2, 3]
    static = DecodeConfig("static").updated(exit_layer=2, draft_length=2)
    by_config = generate(lm, prompt, static, max_new_tokens=12, trace=True)
    by_keywords = generate(lm, prompt, strategy="static", exit_layer=2, draft_length=2, trace=True)
    assert by_config.strategy == by_keywords.strategy == "static"
    assert by_keywords.token_ids[:12] == by_config.token_ids
    assert all(r["exit_layer"] == 2 for r in by_config.trace if r["drafted"])
    # keywords update the config given
    deeper = generate(lm, prompt, static, max_new_tokens=12, exit_layer=3, trace=True)
    assert {r["exit_layer"] for r in deeper.trace if r["drafted"]} == {3}
    assert deeper.token_ids == by_config.token_ids
    ar = generate(lm, prompt, PAPER, max_new_tokens=12, strategy="ar")
    assert ar.strategy == "ar" and ar.token_ids == by_config.token_ids
    with pytest.raises(ConfigError, match="has no option 'temprature'"):
        generate(lm, prompt, temprature=0.5)  # sampling keywords are spelt right
