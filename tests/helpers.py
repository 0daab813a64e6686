"""Helpers shared by several test modules: hand-made cost profiles, scripted and fixed-level
policies, a run of one strategy that records its rounds, and the server tests' HTTP helpers and
tiny model. (Tiny random models themselves: `tiny_models.py`.)"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
from tiny_models import tiny_model

from delspec.decode_config import StaticOptions
from delspec.decoding.sequence import Decoding
from delspec.drafting.context_drafts import NO_PROPOSAL
from delspec.drafting.exit_head import ExitHead
from delspec.machine.cost_profile import CostProfile
from delspec.policies import make_policy
from delspec.policies.fixed import Static
from delspec.policies.protocol import Plan, Round
from delspec.weights.loading import LoadedModel

# prompts whose 16-token greedy replies end inside a multi-byte character
CUT_OFF_PROMPTS = ["北京是中国的首都，", "Reply with emojis only: 👍🏽💡"]


def profile(layer, head, draft_head=0.001, draft_layer=None, int8=False):
    """A hand-made profile; `draft_head`: seconds per draft row, one level or a list of them."""
    return CostProfile(
        layer=layer,
        head=head,
        draft_layer=layer[0] if draft_layer is None else draft_layer,
        draft_head=[draft_head] if isinstance(draft_head, float) else list(draft_head),
        int8=int8,
        key="test",
        measured_at=0,
    )


POLICIES = {
    "static": dict(exit_layer=2, draft_length=4),
    "fs": dict(exit_layer=3, draft_length=2),
    "dv": dict(exit_layer=2),
    "del": dict(),
    "dele": dict(),
    "del-fast": dict(warmup=4),  # evidence from the prompt: drafting starts within ~25 tokens
    "lookup": dict(ngram_min=1, adaptive=True),
}


class AtLevel(Static):
    """Static drafting from one of the exit head's draft vocabularies (levels)."""

    def __init__(self, num_layers: int, level: int, **options) -> None:
        super().__init__(num_layers, StaticOptions(**options))
        self.level = level

    def plan(self, proposal=NO_PROPOSAL) -> Plan:
        return replace(super().plan(proposal), level=self.level)


def run(model, prompt, strategy, max_new, eos=(), int8=False, **options):
    policy = make_policy(strategy, model.num_layers, **options)
    records: list[Round] = []
    observe = policy.observe
    policy.observe = lambda record: (records.append(record), observe(record))[-1]
    head = ExitHead(model, int8) if int8 else None
    out = Decoding(
        model, prompt, policy, max_new_tokens=max_new, eos_token_ids=eos, exit_head=head
    ).run()
    return out, records


class Scripted(Static):
    """Drafts `context` tokens from a script of what the model will say (corrupted from token
    `correct(round)` on), then up to 3 exit-layer drafts from `exit_layer` (0: none), then
    `after` more script tokens (corrupted the same way) once the exit layer has drafted
    `switch_at` tokens (None: after its last). Its proposals come from the script, not from
    the sequence's own index."""

    context_ngrams = (1, 1)
    context_limit = 32

    def __init__(
        self, num_layers, script, context, correct, exit_layer, vocab=64, after=0, switch_at=None
    ):
        super().__init__(num_layers, StaticOptions(max(exit_layer, 1), 3))
        self.script, self.context, self.correct, self.vocab = script, context, correct, vocab
        self.layer_drafts = 3 if exit_layer else 0
        self.after, self.switch_at = after, switch_at

    def start(self, exit_head):
        self.generated, self.round = 0, 0

    def plan(self, proposal=NO_PROPOSAL):
        self.round += 1
        drafts = self._script(0, self.context)
        return Plan(self.exit_layer, self.layer_drafts, context_drafts=drafts)

    def follow(self, proposal, layer_drafts, last):
        if not self.after or not (
            last if self.switch_at is None else layer_drafts == self.switch_at
        ):
            return []
        return list(self._script(self.context + layer_drafts, self.after))

    def _script(self, offset, count):
        """`count` script tokens from `offset` tokens into the round, corrupted as planned."""
        start = self.generated + offset
        tokens = list(self.script[start : start + count])
        cut = self.correct(self.round)
        tokens[cut:] = [(t + 1) % self.vocab for t in tokens[cut:]]
        return tuple(tokens)

    def observe(self, record):
        self.generated += len(record.tokens)


TIMEOUT = 60.0  # seconds, for any one HTTP call


CHAT = "/v1/chat/completions"


TEXT = "/v1/completions"


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        time.sleep(0.02)


def sse(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of a server-sent event stream (JSON decoded, except `[DONE]`)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def answer(url: str, path: str, body: dict[str, Any]) -> tuple[str, str]:
    """(text, finish_reason) of a chat or text completion, streamed or not."""
    with httpx.stream("POST", url + path, json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        if not body.get("stream"):
            choice = json.loads(response.read())["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return text, choice["finish_reason"]
        events = sse(response)
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1]]
    text = "".join(c["delta"].get("content") or "" if "delta" in c else c["text"] for c in choices)
    return text, choices[-1]["finish_reason"]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """Checks the status and the OpenAI error shape; returns the error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


def tiny_lm(smollm2: LoadedModel, delay_s: float = 0.0) -> LoadedModel:
    """A fast 4-layer random model with SmolLM2's tokenizer (float64: exact greedy ties).

    Every call builds the same weights; `delay_s` slows each layer-range call down.
    """
    model = tiny_model(seed=3, vocab_size=49152, num_layers=4, max_position=256)
    if delay_s:
        run_layers = model.run_layers

        def slow_run_layers(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay_s)
            return run_layers(*args, **kwargs)

        model.run_layers = slow_run_layers
    return LoadedModel(model, smollm2.tokenizer, "tiny", "memory", smollm2.eos_token_ids)


PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "Hello", "1, 2, 3,"]
