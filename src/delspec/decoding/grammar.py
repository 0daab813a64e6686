"""Constrained decoding: output that must match a grammar (any JSON object, a JSON schema), with
llguidance (the optional `grammar` extra: `pip install 'delspec[grammar]'`).

A `Grammar` is compiled once per request (`json_grammar`, checked against the model's tokenizer
by `check_grammar`); a `Constraint` is one sequence's state in it: llguidance's matcher after
the sequence's committed tokens. The engine asks it, for every row it verifies, which tokens
are allowed after the tokens before that row (the committed ones and the round's drafts so
far: `push` and `pop` move the matcher ahead and back), masks the others' logits, and accepts
as usual; so every strategy commits exactly the tokens constrained `ar` commits (greedy) or
draws from the same masked distribution (sampling). Drafts are cut at their first token the
grammar rejects (`valid`), exit-layer drafts are drawn from masked logits, and the tokens the
grammar forces (`forced`) may be drafted for free.

JSON is generated compact (no whitespace between tokens of the syntax): a model cannot then
loop on whitespace, and the text is what `json.dumps(..., separators=(",", ":"))` writes.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from delspec.errors import ConfigError, DelspecError
from delspec.weights.tokenizer import full_tokenizer

if TYPE_CHECKING:
    from delspec.weights.loading import LoadedModel

INSTALL_HINT = "pip install 'delspec[grammar]'"
# llguidance's JSON options: compact JSON (see the module docstring)
_JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance tokenizers per HF tokenizer (building one reads the whole vocabulary)
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


class MissingGrammarEngine(ConfigError):
    """Structured output was asked for but llguidance is not installed."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        raise MissingGrammarEngine(
            f"structured output needs llguidance, which is not installed: {INSTALL_HINT}"
        ) from None
    return llguidance


def grammar_available() -> bool:
    """Whether llguidance is installed."""
    try:
        _llguidance()
    except MissingGrammarEngine:
        return False
    return True


@dataclass(frozen=True)
class Grammar:
    """What the output must match: `text` is llguidance's grammar (its JSON form), `name` says
    what it came from (for messages)."""

    text: str
    name: str = "grammar"


def json_grammar(schema: Mapping[str, Any] | bool | None = None, name: str = "schema") -> Grammar:
    """The grammar of JSON text matching `schema` (a JSON schema; None: any JSON object).
    `ConfigError` naming `name` when `schema` is not a JSON schema object."""
    llguidance = _llguidance()
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, Mapping | bool):
        raise ConfigError(f"{name} must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=_JSON_OPTIONS
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{name} is not a valid JSON schema: {exc}") from None
    return Grammar(text, name)


def grammar_tokenizer(lm: LoadedModel) -> Any:
    """llguidance's view of `lm`'s tokenizer (its whole logits width, its EOS tokens), made
    once per tokenizer."""
    llguidance = _llguidance()
    vocab, eos = lm.model.config.vocab_size, tuple(lm.eos_token_ids)
    made = _TOKENIZERS.setdefault(lm.tokenizer, {})
    key = (vocab, eos)
    if key not in made:
        try:
            made[key] = llguidance.hf.from_tokenizer(
                full_tokenizer(lm.tokenizer), n_vocab=vocab, eos_token=list(eos)
            )
        except Exception as exc:  # a slow (Python) tokenizer, or one llguidance cannot read
            raise DelspecError(
                f"structured output is not available for this tokenizer: {exc}"
            ) from None
    return made[key]


def check_grammar(lm: LoadedModel, grammar: Grammar) -> None:
    """`ConfigError` naming the grammar's source when llguidance refuses it (an unsupported
    or invalid schema)."""
    llguidance = _llguidance()
    error = llguidance.LLMatcher.validate_grammar(grammar.text, grammar_tokenizer(lm))
    if error:
        raise ConfigError(f"{grammar.name} is not supported: {error}")


class Constraint:
    """One sequence's state in a `Grammar` (module docstring). `commit` the sequence's tokens;
    `push` a round's drafts ahead of them and `pop` back; `allowed` is the mask after what is
    consumed now."""

    def __init__(self, lm: LoadedModel, grammar: Grammar) -> None:
        llguidance = _llguidance()
        self._numpy = llguidance.numpy
        self.vocab_size = lm.model.config.vocab_size
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(lm), grammar.text, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"{grammar.name} is not supported: {self.matcher.get_error()}")
        self._bits = self._numpy.allocate_token_bitmask(1, self.vocab_size)
        self.eos = frozenset(lm.eos_token_ids)
        self.ahead = 0  # tokens consumed past the committed ones

    def allowed(self) -> np.ndarray:
        """Which tokens may come next (bool, one per column of the logits)."""
        self._numpy.fill_next_token_bitmask(self.matcher, self._bits, 0)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size]
        if not bits.any():
            raise DelspecError(f"the grammar allows no token: {self.matcher.get_error()}")
        return bits.view(bool)

    def valid(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a prefix) the grammar accepts after what is consumed now."""
        if not tokens:
            return 0
        valid = self.matcher.validate_tokens(list(tokens))
        if valid < len(tokens) and tokens[valid] in self.eos:
            # llguidance's list validation refuses an end of sequence where its grammar has
            # ended; one token at a time takes it wherever the grammar accepts
            consumed = self._consume(tokens[:valid])
            accepting = self.matcher.is_accepting()
            if consumed:
                self.matcher.rollback(consumed)
            valid += accepting
        return valid

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (its canonical tokenization of forced text)."""
        return self.matcher.compute_ff_tokens()

    def push(self, tokens: Sequence[int]) -> None:
        """Consume draft `tokens` (which `valid` accepts) ahead of the committed ones."""
        self.ahead += self._consume(tokens)

    def pop(self) -> None:
        """Back to the committed tokens."""
        if self.ahead:
            self.matcher.rollback(self.ahead)
            self.ahead = 0

    def commit(self, tokens: Sequence[int]) -> None:
        """The sequence committed `tokens` (each one the grammar allowed)."""
        self.pop()
        self._consume(tokens)

    def _consume(self, tokens: Sequence[int]) -> int:
        """Consume `tokens` up to an end of sequence, which ends the sequence and is not
        given to the matcher (llguidance's rollback does not count one taken after the
        grammar's end); how many it consumed."""
        count = 0
        for token in tokens:
            if token in self.eos:
                break
            if not self.matcher.consume_token(token):
                raise DelspecError(f"the grammar rejected a token: {self.matcher.get_error()}")
            count += 1
        return count
