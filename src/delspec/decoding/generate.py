"""Public generation API: a prompt in, a `Result` (text, token ids, stats, optional trace) out.

A `Decoding` (`delspec.decoding.sequence`, assembled by a `ResolvedConfig`) is the token-level
loop (policy + engine); `TextDecoding` and `generate` add tokenisation, chat templates, streaming
text, and stop strings on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from delspec.decode_config import DecodeConfig
from delspec.decoding.grammar import Grammar
from delspec.decoding.prefix import Held
from delspec.decoding.run import ResolvedConfig, resolve
from delspec.decoding.sampling import Sampling
from delspec.decoding.sequence import Stats, TokenLogprob
from delspec.drafting.draft_pool import DraftPool
from delspec.errors import ConfigError, is_integer

if TYPE_CHECKING:
    from delspec.decoding.session import Session
    from delspec.weights.loading import LoadedModel

OnText = Callable[[str, str], None]
Prompt = str | Sequence[int] | Sequence[dict[str, str]]
SAMPLING_OPTIONS = tuple(f.name for f in fields(Sampling))  # generate's sampling keywords


@dataclass
class Result:
    """What `generate` returns."""

    text: str
    token_ids: list[int]
    finish_reason: str
    strategy: str
    stats: Stats
    trace: list[dict[str, Any]] | None = field(default=None, repr=False)
    # with `logprobs`: per token, its log-probability and the most likely (id, log-probability)
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON values (statistics without a value are None)."""
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "strategy": self.strategy,
            "stats": self.stats.as_dict(),
        }


class TextStream:
    """Turns a growing list of token ids into text increments: the one detokenizer of the
    library's results, the CLI's and the server's streams.

    Never emits half a UTF-8 character (as vLLM's incremental detokenizer, a text that ends in
    U+FFFD waits for the tokens that complete it), and holds back text that may still become a
    stop string. `push` returns the (text, kind) pieces that are final; `finish` flushes the
    rest, except a character the generation ended inside (its token limit or its caller cut
    it): the U+FFFD its first bytes decode to is no text the model wrote. A U+FFFD that more
    text follows stays.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-4:])  # a little context keeps leading spaces right
        self.prefix = 0
        self.read = len(self.ids)
        self.stop = list(stop)
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
            after = self._decode(self.ids[self.prefix :]).rstrip("\ufffd")
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
    lm: LoadedModel, prompt: Prompt, chat: bool = False, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of text, of a chat conversation (through the model's chat template, with
    `tools` for a template that takes them; `chat=True` wraps text as one user message, which
    must not be empty), or of token ids (checked against the vocabulary). `ConfigError` for
    anything else."""
    if isinstance(prompt, str) and chat:
        if not prompt:
            raise ConfigError("the chat message is empty")
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, str):
        return lm.tokenizer.encode(checked_text(prompt, "the prompt"))
    if not isinstance(prompt, Sequence):
        raise ConfigError(
            "the prompt must be text, token ids or a chat conversation (a list of "
            f"{{'role', 'content'}} dicts), got {type(prompt).__name__}"
        )
    if prompt and all(isinstance(m, dict) for m in prompt):
        text = lm.apply_chat_template(_checked_conversation(prompt), tools)
        return lm.tokenizer.encode(text, add_special_tokens=False)
    ids = list(prompt)
    vocab = lm.model.config.vocab_size
    bad = next((t for t in ids if not is_integer(t) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ConfigError(
            f"prompt token id {bad!r} is not an integer in the vocabulary 0..{vocab - 1}"
        )
    return ids


def _checked_conversation(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as a list, after checking each has a text `role` and `content`."""
    for i, message in enumerate(messages):
        if not all(isinstance(message.get(key), str) for key in ("role", "content")):
            raise ConfigError(f"chat message {i} needs a text 'role' and 'content': {message!r}")
        for key in ("role", "content"):
            checked_text(message[key], f"chat message {i}'s {key}")
    return list(messages)


def checked_text(text: str, name: str) -> str:
    """`text`, if it is Unicode text that UTF-8 can encode; else `ConfigError` naming `name`
    (the tokenizer would fail on it): the text a user gives goes through here, in the library,
    the CLI and the server. A lone surrogate is what a JSON escape such as "\\ud800" and bytes
    that are not UTF-8 (read with Python's surrogateescape: a command line's, a pipe's) become.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise ConfigError(
            f"{name} is not valid text: {bad!r} at character {exc.start} is a lone surrogate "
            "(from bytes that are not UTF-8, or a JSON \\u escape of half a character)"
        ) from None
    return text


def checked_stop(stop: str | Sequence[str]) -> list[str]:
    """Stop strings as a list (one string is one stop string); `ConfigError` for an empty one
    (it would stop before the first token) or one that is not text."""
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ConfigError(f"stop strings must be non-empty text, got {s!r}")
        checked_text(s, "a stop string")
    return stops


def checked_sampling(
    sampling: Sampling | Mapping[str, Any] | None, options: dict[str, Any]
) -> Sampling:
    """The `Sampling` of `generate`'s arguments: `sampling` (a `Sampling`, a dict of its fields,
    or None: greedy) or the `SAMPLING_OPTIONS` keywords, which are taken out of `options`.
    `ConfigError` when both are given, or for unknown fields."""
    given = {k: options.pop(k) for k in SAMPLING_OPTIONS if k in options}
    if given and sampling is not None:
        raise ConfigError(f"pass {', '.join(given)} either as keywords or in sampling=, not both")
    if isinstance(sampling, Sampling):
        return sampling
    if sampling is not None and not isinstance(sampling, Mapping):
        raise ConfigError(
            "sampling must be a delspec.Sampling or a dict of its fields, "
            f"got {type(sampling).__name__}"
        )
    given = dict(sampling or given)
    unknown = sorted(set(given) - set(SAMPLING_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown sampling option(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_OPTIONS)}"
        )
    return Sampling(**given)


class TextDecoding:
    """A `Decoding` whose tokens become text as they come: `advance` (one round of its own) and
    `take` (tokens a batched step committed) return the text pieces that are final, as
    (text, kind) with kind "draft" for accepted drafts and "target" for the full model's
    tokens; a stop string ends it. `finish` returns the rest of the text and the `Result`.

    `run` (a `ResolvedConfig`) assembles the `Decoding` of `prompt_ids` from the `options` of
    `ResolvedConfig.decoding`; `decoding` is it, for what runs several together
    (`delspec.decoding.batch`, `delspec.decoding.prefill`)."""

    def __init__(
        self, run: ResolvedConfig, prompt_ids: list[int], stop: Sequence[str] = (), **options: Any
    ) -> None:
        self.strategy = run.strategy
        self.decoding = run.decoding(prompt_ids, **options)
        self.stream = TextStream(run.lm.tokenizer, prompt_ids, checked_stop(stop))

    @property
    def slot(self) -> int:
        """The model's KV cache slot the sequence runs on."""
        return self.decoding.slot

    @property
    def done(self) -> bool:
        """Whether the sequence has ended (its text may still hold pieces: `finish`)."""
        return self.decoding.done

    def start(self, cached: int = 0) -> None:
        """Prefill the prompt but for its first `cached` positions (`Decoding.start`)."""
        self.decoding.start(cached)

    def stop(self, reason: str = "stop") -> None:
        """End the sequence here: "stop", or "cancelled" (its caller)."""
        self.decoding.stop(reason)

    def held(self, written: int | None = None) -> Held:
        """What its cache slot holds (`Decoding.held`)."""
        return self.decoding.held(written)

    def advance(self) -> list[tuple[str, str]]:
        return self.take(*self.decoding.advance())

    def take(self, tokens: list[int], accepted: int = 0) -> list[tuple[str, str]]:
        stream = self.stream
        pieces = stream.push(tokens[:accepted], "draft") + stream.push(tokens[accepted:], "target")
        if stream.stopped:
            self.decoding.stop()
        return pieces

    def finish(self) -> tuple[list[tuple[str, str]], Result]:
        pieces = self.stream.finish()
        decoded = self.decoding.finish()
        finish = "stop" if self.stream.stopped else decoded.finish_reason
        result = Result(
            self.stream.text, decoded.token_ids, finish, self.strategy, decoded.stats,
            decoded.trace, decoded.logprobs,
        )  # fmt: skip
        return pieces, result


def generate(
    lm: LoadedModel,
    prompt: Prompt,
    config: DecodeConfig | None = None,
    *,
    sampling: Sampling | Mapping[str, Any] | None = None,
    max_new_tokens: int = 128,
    stop: str | Sequence[str] = (),
    chat: bool = False,
    on_text: OnText | None = None,
    should_stop: Callable[[], bool] | None = None,
    trace: bool = False,
    logprobs: int | None = None,
    session: Session | None = None,
    grammar: Grammar | None = None,
    draft_pool: DraftPool | None = None,
    **options: Any,
) -> Result:
    """Generate a continuation of `prompt` as `config` says (default `DecodeConfig()`:
    `del-fast`), greedy unless `sampling` (a `Sampling`, or a dict of its fields) or the
    keywords `temperature`, `top_k`, `top_p`, `seed`, `min_p`, `frequency_penalty`,
    `presence_penalty`, `repetition_penalty`, `logit_bias` (not both) say otherwise. With the
    same seed, every strategy and config gives the same sampled tokens (`Sampler`).

    `prompt` is text, token ids, or a chat conversation (a list of `{"role", "content"}`);
    `chat=True` wraps text as one user message. `on_text(piece, kind)` receives the final text
    as it is produced, `kind` being "draft" for accepted draft tokens and "target" for tokens
    the full model supplied. `should_stop()` is polled before every round (e.g. a client
    disconnected): once it returns true, generation ends with finish reason "cancelled".
    `logprobs=k`: the result's `logprobs` give each token's log-probability and the k most
    likely tokens' (the model's own distribution, the same under every strategy).
    `session` (a `delspec.Session` of `lm`): reuse the cache entries it holds of the prompt's
    first tokens (the conversation so far) and keep this prompt's and reply's for its next call.
    `grammar` (`json_grammar(schema)`: JSON matching a schema, or any JSON object) constrains
    the output to it (needs the `grammar` extra); every strategy gives constrained `ar`'s tokens.
    `draft_pool` (a `DraftPool`, shared by the calls that pass it): a strategy that drafts from
    its context also drafts from the replies the pool holds, and this reply is added to it.
    Keyword `options` update the config (`DecodeConfig.updated`), e.g.
    `strategy="static", exit_layer=4` or `adapters=None`. The output does not depend on the
    config: greedy output is the model's own greedy output. Bad arguments raise `ConfigError`.
    """
    sampling = checked_sampling(sampling, options)
    sampling.check_vocabulary(lm.model.config.vocab_size)
    run = resolve((config or DecodeConfig()).updated(**options), lm)
    text = TextDecoding(
        run,
        encode_prompt(lm, prompt, chat),
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        stop=stop,
        trace=trace,
        logprobs=logprobs,
        grammar=grammar,
        draft_pool=draft_pool,
    )
    emit = on_text or (lambda piece, kind: None)
    if session is None:
        return _decode_text(text, emit, should_stop)
    if session.lm is not lm:
        raise ConfigError("the session belongs to another model: make one with Session(lm)")
    with session.running(text.decoding) as cached:
        return _decode_text(text, emit, should_stop, cached)


def _decode_text(
    text: TextDecoding, emit: OnText, should_stop: Callable[[], bool] | None, cached: int = 0
) -> Result:
    """Start `text` (its slot holding the first `cached` prompt positions already) and run it
    to its end, its text to `emit`."""
    text.start(cached)
    while not text.done:
        if should_stop is not None and should_stop():
            text.stop("cancelled")
            break
        for piece, kind in text.advance():
            emit(piece, kind)
    pieces, result = text.finish()
    for piece, kind in pieces:
        emit(piece, kind)
    return result
