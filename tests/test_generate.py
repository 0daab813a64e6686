"""`generate`'s arguments: sampling keywords, and clear `ConfigError`s for bad values."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_models import tiny_model

from delspec.errors import ConfigError
from delspec.generate import generate
from delspec.loading import LoadedModel
from delspec.sampling import Sampling


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


def test_acceptance_rate_is_none_when_nothing_was_drafted(tiny: LoadedModel) -> None:
    plain = generate(tiny, "Hi", strategy="ar", max_new_tokens=4)
    assert plain.stats.drafted == 0 and plain.as_dict()["stats"]["acceptance_rate"] is None
    drafted = generate(tiny, "Hi", strategy="static", exit_layer=2, max_new_tokens=6)
    assert drafted.stats.drafted > 0
    assert drafted.as_dict()["stats"]["acceptance_rate"] == round(drafted.stats.acceptance_rate, 6)
