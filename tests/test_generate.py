"""`generate`'s arguments: sampling keywords, and clear `ConfigError`s for bad values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import CUT_OFF_PROMPTS
from tiny_models import tiny_model

from delspec.decoding.generate import TextStream, generate
from delspec.decoding.sampling import Sampling
from delspec.errors import ConfigError
from delspec.machine.cost_profile import QUICK_PROFILE_STEPS
from delspec.policies.cost_model import MeasuredCost
from delspec.weights.loading import LoadedModel


@pytest.fixture(scope="module")
def tiny(smollm2: LoadedModel) -> LoadedModel:
    """A fast 4-layer random model with SmolLM2's tokenizer and chat template."""
    model = tiny_model(seed=3, vocab_size=49152, num_layers=4, max_position=256)
    return LoadedModel(model, smollm2.tokenizer, "tiny", "memory", smollm2.eos_token_ids)


def test_sampling_keywords_are_a_sampling(tiny: LoadedModel) -> None:
    options = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7}
    expected = generate(tiny, "Hi", sampling=Sampling(**options), max_new_tokens=8)
    assert generate(tiny, "Hi", max_new_tokens=8, **options).token_ids == expected.token_ids
    as_dict = generate(tiny, "Hi", sampling=options, max_new_tokens=8)
    assert as_dict.token_ids == expected.token_ids


@pytest.mark.parametrize(
    ("prompt", "arguments", "message"),
    [
        ("Hi", {"sampling": Sampling(0.5), "temperature": 0.5}, "not both"),
        ("Hi", {"sampling": {"temprature": 0.5}}, "unknown sampling option"),
        ("Hi", {"sampling": 0.5}, "sampling must be a delspec.Sampling or a dict"),
        ("Hi", {"temperature": "hot"}, "temperature must be a number"),
        ("Hi", {"seed": 1.5, "temperature": 1.0}, "seed must be an integer"),
        ("Hi", {"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 1, got 2.5"),
        ("Hi", {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        (None, {}, "the prompt must be text, token ids or a chat conversation"),
        ([1, "2"], {}, "prompt token id '2' is not an integer"),
        ([{"role": "user"}], {}, "chat message 0 needs a text 'role' and 'content'"),
        ("", {}, "the prompt is empty"),
        ("", {"chat": True}, "the chat message is empty"),
        ("Hi", {"stop": [""]}, "stop strings must be non-empty"),
        ("Hi", {"stop": ["x", 3]}, "stop strings must be non-empty text, got 3"),
        ("\ud800 hi", {}, "the prompt is not valid text: '\\\\ud800' at character 0"),
        ("caf\udce9", {"chat": True}, "chat message 0's content is not valid text"),
        ([{"role": "user", "content": "\udc00"}], {}, "chat message 0's content is not valid"),
        ("Hi", {"stop": ["\ud83d"]}, "a stop string is not valid text"),
    ],
)
def test_bad_arguments_are_config_errors(
    tiny: LoadedModel, prompt: Any, arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        generate(tiny, prompt, **{"max_new_tokens": 4, **arguments})


def test_a_single_stop_string(tiny: LoadedModel) -> None:
    full = generate(tiny, "Hello there", strategy="ar", max_new_tokens=12).text
    stop = full[len(full) // 2 :][:3]
    cut = generate(tiny, "Hello there", strategy="ar", max_new_tokens=12, stop=stop)
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_statistics_without_a_value_are_none(tiny: LoadedModel) -> None:
    plain = generate(tiny, "Hi", strategy="ar", max_new_tokens=4)
    assert plain.stats.drafted == 0 and plain.as_dict()["stats"]["acceptance_rate"] is None
    assert (
        plain.stats.mean_exit_layer is None and plain.as_dict()["stats"]["mean_exit_layer"] is None
    )
    drafted = generate(tiny, "Hi", strategy="static", exit_layer=2, max_new_tokens=6)
    assert drafted.stats.drafted > 0
    assert drafted.as_dict()["stats"]["acceptance_rate"] == round(drafted.stats.acceptance_rate, 6)


def test_should_stop_is_asked_before_the_first_round(tiny: LoadedModel) -> None:
    stopped = generate(tiny, "Hi", max_new_tokens=8, should_stop=lambda: True)
    assert stopped.token_ids == [] and stopped.text == "" and stopped.finish_reason == "cancelled"
    rounds = iter([False, False, True])
    later = generate(tiny, "Hi", strategy="ar", max_new_tokens=8, should_stop=lambda: next(rounds))
    assert len(later.token_ids) == 2 and later.finish_reason == "cancelled"


@pytest.mark.slow
@pytest.mark.parametrize("prompt", CUT_OFF_PROMPTS)
def test_a_character_the_token_limit_cut_is_left_out(smollm2: LoadedModel, prompt: str) -> None:
    pieces: list[str] = []
    result = generate(
        smollm2, prompt, strategy="ar", max_new_tokens=16, on_text=lambda p, _: pieces.append(p)
    )
    whole = smollm2.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert len(result.token_ids) == 16 and whole.endswith("\ufffd")  # the limit cut a character
    assert result.text == whole.rstrip("\ufffd") and "".join(pieces) == result.text


def test_a_replacement_character_more_text_follows_stays(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    lead = tokenizer.convert_tokens_to_ids("å")  # byte 0xE5 alone: a 3-byte character's first
    more = tokenizer.encode(" and more")
    assert tokenizer.decode([lead]) == "\ufffd"
    stream = TextStream(tokenizer, tokenizer.encode("Hi"))
    pieces = stream.push([lead], "target") + stream.push(more, "target") + stream.finish()
    assert stream.text == "\ufffd and more" == "".join(text for text, _ in pieces)
    cut = TextStream(tokenizer, tokenizer.encode("Hi"))
    pieces = cut.push(more, "target") + cut.push([lead], "target") + cut.finish()
    assert cut.text == " and more" == "".join(text for text, _ in pieces)


def test_a_short_first_run_leaves_the_cost_profile_to_a_longer_one(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`del-fast` on a model with nothing measured yet: a run allowed fewer new tokens than a
    quick profile takes steps decodes without one (the layer cost) and stores none; a longer
    run measures it and carries it to the next. Both give `ar`'s tokens."""
    monkeypatch.setenv("DELSPEC_CACHE", str(tmp_path))
    lm = LoadedModel(tiny.model, tiny.tokenizer, "tiny", "memory", tiny.eos_token_ids)
    prompt = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"
    for tokens, measured in ((QUICK_PROFILE_STEPS - 1, False), (QUICK_PROFILE_STEPS, True)):
        expected = generate(lm, prompt, strategy="ar", max_new_tokens=tokens)
        assert generate(lm, prompt, max_new_tokens=tokens).token_ids == expected.token_ids
        assert bool(list(tmp_path.glob("costs/profile-*.json"))) is measured
        (learned,) = lm.learned.values()
        assert isinstance(learned.cost, MeasuredCost) is measured
