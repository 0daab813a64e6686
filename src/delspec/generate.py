"""Public generation API: a prompt in, a `Result` (text, token ids, stats, optional trace) out.

`decode_tokens` is the token-level loop (policy + engine); `generate` adds tokenisation, chat
templates, streaming text, and stop strings on top of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from delspec.decode_config import DecodeConfig
from delspec.draft_head import draft_head
from delspec.engine import Engine, ExitHead, Round
from delspec.errors import ConfigError, ContextLengthError
from delspec.model import Transformer
from delspec.policies import Policy, make_policy
from delspec.sampling import Sampling
from delspec.timing import synchronize

if TYPE_CHECKING:
    from delspec.loading import LoadedModel

OnRound = Callable[[list[int], int], bool]
OnText = Callable[[str, str], None]


@dataclass
class Stats:
    """Timing and speculation statistics of one generation."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms_per_token: float = 0.0
    tokens_per_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    etpl: float = 0.0  # sum(accepted + 1) / sum(E * T + L)
    mean_exit_layer: float = 0.0  # over rounds that drafted
    mean_draft_length: float = 0.0  # over all rounds
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy_s: float = 0.0  # statistics work between rounds (DEL's shadow tokens)
    policy_share: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class Decoded:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop string, or caller), "length"
    stats: Stats
    trace: list[dict[str, Any]] | None = None


@dataclass
class Result:
    """What `generate` returns."""

    text: str
    token_ids: list[int]
    finish_reason: str
    strategy: str
    stats: Stats
    trace: list[dict[str, Any]] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "strategy": self.strategy,
            "stats": self.stats.as_dict(),
        }


def decode_tokens(
    model: Transformer,
    prompt_ids: Sequence[int],
    policy: Policy,
    *,
    sampling: Sampling | None = None,
    max_new_tokens: int = 128,
    eos_token_ids: Sequence[int] = (),
    exit_head: ExitHead | None = None,
    on_round: OnRound | None = None,
    trace: bool = False,
) -> Decoded:
    """Generate up to `max_new_tokens` after `prompt_ids` with `policy` deciding every round.

    Stops after an EOS token, at the budget or the model's context, or when `on_round(tokens,
    accepted_drafts)` returns False. Greedy output equals plain autoregressive greedy output;
    sampled output follows the same distribution.
    """
    prompt = _checked_prompt(prompt_ids, max_new_tokens, model.config.max_position)
    eos = tuple(eos_token_ids)
    head = (exit_head or ExitHead(model)).for_prompt(prompt)
    engine = Engine(model, sampling or Sampling(), eos, head)
    capacity = min(model.config.max_position, len(prompt) + max_new_tokens)
    totals = _Totals(model.num_layers, len(prompt))
    rounds: list[dict[str, Any]] | None = [] if trace else None
    policy.start(head)

    t0 = time.perf_counter()
    engine.prefill(prompt, capacity, policy.warmup_window if policy.collect_hidden else 0)
    synchronize(model.device)
    t1 = time.perf_counter()
    finish = "length"
    while True:
        generated = len(engine.tokens) - len(prompt)
        room = capacity - len(engine.tokens)
        if generated >= max_new_tokens or room <= 0:
            break
        plan = policy.plan()
        cap = min(plan.draft_cap, max_new_tokens - generated - 1, room - 1)
        record = engine.round(
            plan.exit_layer, cap, policy.keep_drafting, policy.collect_hidden, plan.level
        )
        t_obs = time.perf_counter()
        policy.observe(record)
        totals.add(record, time.perf_counter() - t_obs)
        tokens = record.tokens
        stop_at = next((i for i, t in enumerate(tokens) if t in eos), None)
        if stop_at is not None:
            del engine.tokens[len(engine.tokens) - len(tokens) + stop_at + 1 :]
            tokens = tokens[: stop_at + 1]
        if rounds is not None:
            rounds.append(_trace_entry(totals.stats.rounds, record))
        go_on = on_round(tokens, min(record.accepted, len(tokens))) if on_round else True
        if stop_at is not None or not go_on:
            finish = "stop"
            break
    synchronize(model.device)
    t2 = time.perf_counter()
    new = engine.tokens[len(prompt) :][:max_new_tokens]
    return Decoded(new, finish, totals.finish(len(new), t1 - t0, t2 - t1), rounds)


def _checked_prompt(prompt_ids: Sequence[int], max_new_tokens: int, context: int) -> list[int]:
    """`prompt_ids` as a list; `ConfigError` or `ContextLengthError` when there is nothing to
    generate from or no room in the model's `context`."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt = list(prompt_ids)
    if not prompt:
        raise ConfigError("the prompt is empty")
    if len(prompt) >= context:
        raise ContextLengthError(
            f"the prompt has {len(prompt)} tokens but the model's context is {context} tokens"
        )
    return prompt


class _Totals:
    """Sums over a generation's rounds, and the `Stats` they give."""

    def __init__(self, num_layers: int, prompt_tokens: int) -> None:
        self.num_layers = num_layers
        self.stats = Stats(prompt_tokens=prompt_tokens)
        self.layer_loads = self.exit_sum = self.drafting_rounds = 0

    def add(self, record: Round, policy_s: float) -> None:
        """Count a finished round whose `observe` took `policy_s` seconds."""
        stats = self.stats
        stats.policy_s += policy_s
        stats.draft_s += record.draft_s
        stats.verify_s += record.verify_s
        n = len(record.drafted)
        stats.rounds += 1
        stats.drafted += n
        stats.accepted += record.accepted
        self.layer_loads += record.exit_layer * n + self.num_layers
        if n:
            self.exit_sum += record.exit_layer
            self.drafting_rounds += 1

    def finish(self, new_tokens: int, prefill_s: float, decode_s: float) -> Stats:
        """The statistics of a generation of `new_tokens` tokens with these timings."""
        stats = self.stats
        stats.new_tokens = new_tokens
        stats.prefill_ms = prefill_s * 1000
        stats.decode_ms_per_token = decode_s * 1000 / max(1, new_tokens)
        stats.tokens_per_s = new_tokens / decode_s if decode_s > 0 else 0.0
        stats.acceptance_rate = stats.accepted / stats.drafted if stats.drafted else 0.0
        loads = self.layer_loads
        stats.etpl = (stats.accepted + stats.rounds) / loads if loads else 0.0
        stats.mean_draft_length = stats.drafted / stats.rounds if stats.rounds else 0.0
        rounds = self.drafting_rounds
        stats.mean_exit_layer = self.exit_sum / rounds if rounds else 0.0
        stats.policy_share = stats.policy_s / decode_s if decode_s > 0 else 0.0
        return stats


def _trace_entry(index: int, record: Round) -> dict[str, Any]:
    return {
        "round": index,
        "position": record.position,
        "exit_layer": record.exit_layer,
        "level": record.level,
        "drafted": len(record.drafted),
        "accepted": record.accepted,
        "committed": len(record.tokens),
        "draft_ms": round(record.draft_s * 1000, 3),
        "verify_ms": round(record.verify_s * 1000, 3),
        **{
            (k[:-2] + "_ms" if k.endswith("_s") else k): (
                round(v * 1000, 3) if k.endswith("_s") else v
            )
            for k, v in record.extra.items()
        },
    }


class TextStream:
    """Turns a growing list of token ids into text increments.

    Never emits half a UTF-8 character, and holds back text that may still become a stop
    string. `push` returns the (text, kind) pieces that are final; `finish` flushes the rest.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-4:])  # a little context keeps leading spaces right
        self.prefix = 0
        self.read = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.kinds: list[tuple[int, str]] = []  # (end offset in text, kind) per piece
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, tokens: list[int], kind: str) -> list[tuple[str, str]]:
        if self.stopped or not tokens:
            return []
        self.ids.extend(tokens)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return []
        self._append(after[len(before) :], kind)
        self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> list[tuple[str, str]]:
        if not self.stopped:
            before = self._decode(self.ids[self.prefix : self.read])
            after = self._decode(self.ids[self.prefix :])
            if len(after) > len(before):
                self._append(after[len(before) :], "target")
        return self._release(final=True)

    def _append(self, delta: str, kind: str) -> None:
        start = len(self.text)
        self.text += delta
        self.kinds.append((len(self.text), kind))
        for s in self.stop:
            found = self.text.find(s, max(0, start - len(s) + 1))
            if found >= 0:
                self.text = self.text[:found]
                self.stopped = True

    def _release(self, final: bool) -> list[tuple[str, str]]:
        end = (
            len(self.text)
            if final or self.stopped
            else max(self.emitted, len(self.text) - self.hold)
        )
        pieces: list[tuple[str, str]] = []
        start = self.emitted
        for piece_end, kind in self.kinds:
            lo, hi = max(start, self.emitted), min(piece_end, end)
            if hi > lo:
                pieces.append((self.text[lo:hi], kind))
            start = piece_end
        self.emitted = end
        return pieces


def encode_prompt(
    lm: LoadedModel, prompt: str | Sequence[int] | Sequence[dict[str, str]], chat: bool = False
) -> list[int]:
    """Token ids of text, of a chat conversation (through the model's chat template; `chat=True`
    wraps text as one user message), or of token ids (checked against the vocabulary)."""
    if isinstance(prompt, str) and chat:
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, str):
        return lm.tokenizer.encode(prompt)
    if prompt and isinstance(prompt[0], dict):
        text = lm.apply_chat_template(list(prompt))
        return lm.tokenizer.encode(text, add_special_tokens=False)
    ids = list(prompt)
    vocab = lm.model.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ConfigError(f"prompt token id {bad} is outside the vocabulary 0..{vocab - 1}")
    return ids


def generate(
    lm: LoadedModel,
    prompt: str | Sequence[int] | Sequence[dict[str, str]],
    config: DecodeConfig | None = None,
    *,
    sampling: Sampling | None = None,
    max_new_tokens: int = 128,
    stop: Sequence[str] = (),
    chat: bool = False,
    on_text: OnText | None = None,
    should_stop: Callable[[], bool] | None = None,
    trace: bool = False,
    **options: Any,
) -> Result:
    """Generate a continuation of `prompt` as `config` says (default `DecodeConfig()`:
    `del-fast`), greedy unless `sampling` says otherwise.

    `prompt` is text, token ids, or a chat conversation (a list of `{"role", "content"}`);
    `chat=True` wraps text as one user message. `on_text(piece, kind)` receives the final text
    as it is produced, `kind` being "draft" for accepted draft tokens and "target" for tokens
    the full model supplied. `should_stop()` is polled after every round (e.g. a client
    disconnected). Keyword `options` update the config (`DecodeConfig.updated`), e.g.
    `strategy="static", exit_layer=4` or `adapters=None`. The output does not depend on the
    config: greedy output is the model's own greedy output.
    """
    config = (config or DecodeConfig()).updated(**options)
    prompt_ids = encode_prompt(lm, prompt, chat)
    policy = make_policy(config, lm.model.num_layers)
    stream = TextStream(lm.tokenizer, prompt_ids, stop)

    def on_round(tokens: list[int], accepted: int) -> bool:
        pieces = stream.push(tokens[:accepted], "draft") + stream.push(tokens[accepted:], "target")
        if on_text is not None:
            for piece, kind in pieces:
                on_text(piece, kind)
        return not stream.stopped and not (should_stop is not None and should_stop())

    decoded = decode_tokens(
        lm.model,
        prompt_ids,
        policy,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        eos_token_ids=lm.eos_token_ids,
        exit_head=draft_head(lm, config),
        on_round=on_round,
        trace=trace,
    )
    for piece, kind in stream.finish():
        if on_text is not None:
            on_text(piece, kind)
    finish = "stop" if stream.stopped else decoded.finish_reason
    return Result(stream.text, decoded.token_ids, finish, policy.name, decoded.stats, decoded.trace)
