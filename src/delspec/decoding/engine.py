"""The draft/verify engine: prefill and one self-speculative round at a time (LayerSkip mechanics).

A round starts from the newest committed token (not yet run through any layer). It may first take
draft tokens from the context (a `ContextProposal`: they cost no model work). Drafting runs layers
[0, E) plus the exit head on the newest token (with the context's tokens, in one pass),
autoregressively; after the exit layer's drafts, the round may take more context tokens, found
after the sequence and its drafts. Verification runs layers [0, E) on the last draft token (and
those context tokens) only, then layers [E, L) over every unverified position in one pass, using
the layer-E states kept from drafting (with no exit-layer draft: every layer over the input and
the context's tokens). E = L drafts from the final layer's own states through the exit head;
verification is then the full LM head over every unverified position (and every layer over
those context tokens), which pays when the exit head is much cheaper (a pruned vocabulary). With an
int8 exit head (`ExitHead.int8`), drafts run layers [0, E) on int8 weight copies; their states and
cache entries are approximate, so verification runs every layer over every unverified position
(their cache entries are then rewritten exactly). Acceptance is the longest prefix of drafts
that are the target's own tokens, plus the target's next token: its greedy tokens, or under
sampling its draws with noise keyed by the sequence's seed and position (`Sampler`, which drafts
draw with too), so every strategy commits the tokens `ar` commits. The engine knows no policy:
it is told the context draft tokens, the exit layer and the draft cap, and asked after each draft
token whether to go on and which context tokens, if any, to take instead.

With a `Constraint` (a grammar the output must match: `decoding.grammar`), every verified row's
logits are masked to the tokens the grammar allows after the tokens before that row, and the
rows are read one at a time, only while drafts are accepted; exit-layer drafts come from masked
logits too, and context tokens after the drafts are cut at the first one the grammar rejects.
The committed tokens are then those constrained `ar` commits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from delspec.decoding.grammar import Constraint
from delspec.decoding.sampling import Sampler, Sampling, as_rows
from delspec.drafting.context_drafts import MAX_MATCH, NO_PROPOSAL, ContextIndex, ContextProposal
from delspec.drafting.draft_pool import DraftPool
from delspec.drafting.exit_head import ExitHead
from delspec.kernels.scores import greedy_tokens, top_logsumexp
from delspec.model.transformer import Transformer
from delspec.policies.protocol import Round


@dataclass
class _Draft:
    """One round's draft so far."""

    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)  # exit-head probability of each
    states: list[Tensor] = field(default_factory=list)  # per pass: layer-E states of its inputs
    early: list[Tensor] = field(default_factory=list)  # per pass: [E, inputs, hidden], collected
    masks: dict[int, np.ndarray] = field(default_factory=dict)  # the grammar's, by draft index


class Engine:
    """Holds one sequence's committed tokens and runs rounds on its slot of a model's KV
    cache. With `context_ngrams` (n-gram orders), it keeps a `ContextIndex` of the sequence
    (`propose`), and with a `pool` also proposes from what was generated before where the pool's
    match reaches further back than the sequence's own. With `constraint`, its output matches a
    grammar (module docstring)."""

    def __init__(
        self,
        model: Transformer,
        sampling: Sampling,
        eos_token_ids: tuple[int, ...] = (),
        exit_head: ExitHead | None = None,
        slot: int = 0,
        context_ngrams: tuple[int, int] | None = None,
        constraint: Constraint | None = None,
        pool: DraftPool | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.grammar = constraint
        self.slot = slot
        self.sampling = sampling
        self.eos = frozenset(eos_token_ids)
        self.exit_head = exit_head or ExitHead(model)
        self.sampler: Sampler | None = None
        self.tokens: list[int] = []
        # the warm-up's prompt rows for the first round: every layer's states, greedy targets
        self._warmup: tuple[Tensor, Tensor] | None = None
        self.context_ngrams = context_ngrams
        self.index: ContextIndex | None = None

    @torch.inference_mode()
    def prefill(self, prompt: list[int], capacity: int, window: int = 0, cached: int = 0) -> None:
        """Start a sequence: run all but the last prompt token through every layer.

        `capacity` is the number of positions to reserve. With `window > 0`, the per-layer states
        of the last `window` prefilled positions and their target tokens are handed to the first
        round as its leading rows (DEL's warm-up: `Round.warmup_rows`). `cached`: the first
        positions the slot holds already (`delspec.decoding.prefix.reusable`; at most the rows
        before the window), which are not run again.
        """
        self.begin(prompt, capacity)
        model = self.model
        rows = len(prompt) - 1
        if rows <= cached:
            return
        collect: list[Tensor] | None = [] if window else None
        states = model.embed(prompt[cached:-1])
        tiles = model.on_tiles(rows)  # as a cold prefill of the whole prompt decides
        model.run_layers(states, cached, 0, model.num_layers, collect, slot=self.slot, tiles=tiles)
        if collect:
            w = min(window, rows - cached)
            hidden = torch.stack([h[-w:] for h in collect])
            self._warmup = (hidden, greedy_tokens(model.head(hidden[-1])))

    def begin(self, prompt: list[int], capacity: int) -> None:
        """Start a sequence whose prompt (all but its last token) the caller runs through every
        layer: reserve `capacity` positions in its slot."""
        self.tokens = list(prompt)
        self._warmup = None
        sampling = self.sampling
        if not sampling.greedy or sampling.adjusts:
            self.sampler = Sampler(sampling, self.model.config.vocab_size, prompt)
        ngrams = self.context_ngrams
        self.index = None if ngrams is None else ContextIndex(prompt, *ngrams)
        self.model.setup_cache(capacity, self.slot + 1)

    def commit(self, tokens: list[int]) -> None:
        """Append committed `tokens` to the sequence (and to what knows of it)."""
        self.tokens.extend(tokens)
        if self.sampler is not None:
            self.sampler.add(tokens)
        self.exit_head.admit(tokens)
        if self.index is not None:
            self.index.extend(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)

    def propose(self, limit: int, after: list[int] | None = None) -> ContextProposal:
        """Up to `limit` context draft tokens after the newest one, or after it and the tokens
        `after` (none without an index): the sequence's own proposal, or the pool's where its
        match is longer (the pool is not asked when the sequence's reaches `MAX_MATCH`)."""
        if self.index is None:
            return NO_PROPOSAL
        own = self.index.propose(limit, after or ())
        pool = self.pool
        if pool is None or not pool.tokens or own.match_length >= MAX_MATCH:
            return own
        recent = self.tokens[-MAX_MATCH:]
        if after:
            recent = recent + after
        found = pool.propose(recent, limit)
        return found if found.match_length > own.match_length else own

    def discard_warmup(self) -> None:
        """Forget the prompt states kept for the first round (it is not this engine's)."""
        self._warmup = None

    @torch.inference_mode()
    def round(
        self,
        exit_layer: int,
        draft_cap: int,
        keep_drafting: Callable[[float], bool],
        collect: bool = False,
        level: int = 0,
        context_drafts: list[int] | None = None,
        then: Callable[[list[int], bool], list[int]] | None = None,
    ) -> Round:
        """Run one round and commit its tokens: the `context_drafts` tokens (if any), then up to
        `draft_cap` drafts from layer `exit_layer` with the exit head's vocabulary `level`.
        After each of these, `then(drafts so far, whether the layer's drafting ends there)`
        may give context tokens to draft next (up to an end of sequence), which end the
        layer's drafting. No draft at all is a plain full step."""
        pos = len(self.tokens) - 1
        context_drafts = through_eos(context_drafts or [], self.eos)
        if context_drafts and context_drafts[-1] in self.eos:
            draft_cap = 0  # nothing is drafted past an end of sequence
        if draft_cap < 1 or not 0 < exit_layer <= self.model.num_layers:
            exit_layer, draft_cap, level = 0, 0, 0
        t0 = time.perf_counter()
        draft = self._context_draft(context_drafts)
        if self.grammar is not None:  # the context tokens are ones it accepts (`Decoding`)
            self.grammar.push(context_drafts)
        after = self._draft(draft, pos, exit_layer, draft_cap, keep_drafting, collect, level, then)
        if self.grammar is not None:
            self.grammar.pop()
        t1 = time.perf_counter()
        logits, deep = self._verify(pos, exit_layer, draft, collect)
        targets, accepted, next_token = self._accept(logits, draft)
        committed = [*draft.tokens[:accepted], next_token]
        self.commit(committed)
        t2 = time.perf_counter()

        hidden = None
        if collect:
            per_layer = [torch.cat(draft.early, 1)] if draft.early else []
            hidden = torch.cat(per_layer + ([torch.stack(deep)] if deep else []))
        record = Round(
            pos,
            exit_layer,
            draft.tokens,
            draft.confidences,
            accepted,
            committed,
            targets,
            hidden,
            level=level,
            from_context=len(context_drafts),
            context_after=after,
        )
        record.draft_s, record.verify_s = t1 - t0, t2 - t1
        record.logits = logits
        if self._warmup is not None:
            warmup_hidden, warmup_targets = self._warmup
            self._warmup = None
            if collect:
                record.hidden = torch.cat([warmup_hidden, hidden], 1)
                record.targets = torch.cat([warmup_targets, targets])
                record.warmup_rows = warmup_hidden.shape[1]
        return record

    def settle(self, context_drafts: list[int], logits: Tensor) -> Round:
        """Verify and commit a round computed outside (a batched step): `logits` are the full
        head's after the newest token and after each of the `context_drafts` tokens (which end
        at an end of sequence, if they hold one). The same acceptance as `round`'s."""
        position = len(self.tokens) - 1
        draft = self._context_draft(context_drafts)
        targets, accepted, next_token = self._accept(logits, draft)
        committed = [*context_drafts[:accepted], next_token]
        self.commit(committed)
        record = Round(position, 0, context_drafts, draft.confidences, accepted, committed, targets)
        record.from_context, record.logits = len(context_drafts), logits
        return record

    def _context_draft(self, tokens: list[int]) -> _Draft:
        """A draft of context `tokens`, each drafted with certainty (probability 1)."""
        draft = _Draft()
        self._add_certain(draft, tokens)
        return draft

    def _add_certain(self, draft: _Draft, tokens: list[int]) -> None:
        """Add context `tokens` to `draft`, each drafted with certainty (probability 1)."""
        draft.tokens.extend(tokens)
        draft.confidences.extend([1.0] * len(tokens))

    def _draft(
        self,
        draft: _Draft,
        pos: int,
        exit_layer: int,
        draft_cap: int,
        keep_drafting: Callable[[float], bool],
        collect: bool,
        level: int,
        then: Callable[[list[int], bool], list[int]] | None,
    ) -> int:
        """Add up to `draft_cap` tokens to `draft` (the context's tokens so far) with layers
        [0, exit_layer) and the exit head's vocabulary `level`; stops at EOS, when
        `keep_drafting(confidence)` says no, or when `then` gives context tokens to add after
        a draft token (returns how many it added). The first pass runs the round's input (at
        position `pos`) and the context's tokens together."""
        model = self.model
        int8 = self.exit_head.int8
        inputs = [self.tokens[-1], *draft.tokens]
        for step in range(draft_cap):
            layers: list[Tensor] | None = [] if collect and not int8 else None
            start = pos + len(draft.tokens) + 1 - len(inputs)
            h = model.run_layers(model.embed(inputs), start, 0, exit_layer, layers, int8, self.slot)
            draft.states.append(h)
            if layers is not None:
                draft.early.append(torch.stack(layers))
            allowed = self._allowed(draft)
            drawn = self._draft_token(h[-1:], exit_layer, level, draft.tokens, allowed)
            if drawn is None:  # the grammar allows none of the head's tokens: this pass's
                draft.states.pop()  # states are not kept (verification runs its input)
                if layers is not None:
                    draft.early.pop()
                break
            token, confidence = drawn
            draft.tokens.append(token)
            draft.confidences.append(confidence)
            if self.grammar is not None:
                self.grammar.push([token])
            if token in self.eos:
                break
            last = step + 1 == draft_cap or not keep_drafting(confidence)
            after = through_eos(then(list(draft.tokens), last), self.eos) if then else []
            if self.grammar is not None:
                after = after[: self.grammar.valid(after)]
                self.grammar.push(after)
            if after:
                self._add_certain(draft, after)
                return len(after)
            if last:
                break
            inputs = [token]
        return 0

    def _allowed(self, draft: _Draft) -> np.ndarray | None:
        """The grammar's mask after `draft`'s tokens (None without a grammar), kept in
        `draft.masks` for verification; the grammar has consumed them."""
        if self.grammar is None:
            return None
        at = len(draft.tokens)
        if at not in draft.masks:
            draft.masks[at] = self.grammar.allowed()
        return draft.masks[at]

    def _verify(
        self, pos: int, exit_layer: int, draft: _Draft, collect: bool
    ) -> tuple[Tensor, list[Tensor] | None]:
        """The full model's logits after the round's input and each draft token, and (when
        `collect`) the states of the layers it ran over all of them; `draft.early` gets the
        early-layer states of the draft tokens drafting did not run (the last one, and the
        context's after it)."""
        model = self.model
        deep: list[Tensor] | None = [] if collect else None
        if not draft.states or self.exit_head.int8:  # every layer over the input and drafts
            inputs = [self.tokens[-1], *draft.tokens]
            h = model.run_layers(
                model.embed(inputs), pos, 0, model.num_layers, deep, slot=self.slot
            )
        else:
            last: list[Tensor] | None = [] if collect else None
            ran = sum(len(states) for states in draft.states)  # positions from `pos` on
            last_input = model.embed(draft.tokens[ran - 1 :])
            h_last = model.run_layers(last_input, pos + ran, 0, exit_layer, last, slot=self.slot)
            states = torch.cat([*draft.states, h_last])
            h = model.run_layers(states, pos, exit_layer, model.num_layers, deep, slot=self.slot)
            if collect:
                draft.early.append(torch.stack(last))
        return model.head(h), deep

    def _accept(self, logits: Tensor, draft: _Draft) -> tuple[Tensor, int, int]:
        """The greedy targets after each position (the model's own), how many drafts are
        accepted, and the token that follows them. A draft is accepted when it is the token
        the target draws at its position (`Sampler.draw`: under sampling, with the noise of
        the sequence's seed at that position), so the committed tokens are those `ar` commits."""
        targets = greedy_tokens(logits)
        if self.grammar is not None:
            return self._accept_constrained(logits, draft, targets)
        n = len(draft.tokens)
        if self.sampler is None:
            target_list = targets.tolist()
            accepted = next((i for i in range(n) if draft.tokens[i] != target_list[i]), n)
            return targets, accepted, target_list[accepted]
        rows, first = as_rows(logits), len(self.tokens)
        for i in range(n + 1):  # each row's draw only until one differs from its draft
            before = draft.tokens[:i]
            token = self.sampler.draw(rows[i], first + i, before, confidence=False)[0]
            if i == n or token != draft.tokens[i]:
                return targets, i, token
        raise AssertionError("unreachable")

    def _accept_constrained(
        self, logits: Tensor, draft: _Draft, targets: Tensor
    ) -> tuple[Tensor, int, int]:
        """`_accept` under the grammar: row i's logits masked to the tokens it allows after
        the round's first i drafts, read only while drafts are accepted; the greedy targets of
        the rows read are the masked ones."""
        grammar, sampler, n = self.grammar, self.sampler, len(draft.tokens)
        rows = None if sampler is None else as_rows(logits)
        picks: list[int] = []
        for i in range(n + 1):
            allowed = draft.masks.get(i)
            if allowed is None:
                allowed = grammar.allowed()
            if sampler is None:
                mask = torch.from_numpy(~allowed).to(logits.device)
                token = int(logits[i].masked_fill(mask, -math.inf).argmax())
            else:
                row = rows[i].copy()
                row[~allowed] = -np.inf
                before = draft.tokens[:i]
                token = sampler.draw(row, len(self.tokens) + i, before, confidence=False)[0]
            picks.append(token)
            if i == n or token != draft.tokens[i]:
                break
            grammar.push([token])
        grammar.pop()
        if sampler is None:
            targets = targets.clone()
            targets[: len(picks)] = torch.tensor(picks, dtype=targets.dtype)
        return targets, len(picks) - 1, picks[-1]

    def _draft_token(
        self,
        h: Tensor,
        exit_layer: int,
        level: int,
        drafted: list[int],
        allowed: np.ndarray | None = None,
    ) -> tuple[int, float] | None:
        """One draft token from the exit head after the round's `drafted` tokens so far, and
        its probability: the greedy one, or the draw `Sampler.draw` makes with the target's
        noise at its position; with the grammar's mask `allowed`, among the tokens it allows
        (None when it allows none of the head's)."""
        logits = self.exit_head(h, exit_layer, level)[0]
        vocab = self.exit_head.vocabs[level]
        if allowed is not None:
            columns = allowed if vocab is None else allowed[vocab.cpu().numpy()]
            if not columns.any():
                return None
            logits = logits.masked_fill(torch.from_numpy(~columns).to(logits.device), -math.inf)
        if self.sampler is None:  # the first of equal maxima, and its probability
            at, top, lse = top_logsumexp(logits[None])
            column, confidence = int(at[0]), math.exp(float(top[0]) - float(lse[0]))
            return (column if vocab is None else int(vocab[column])), confidence
        ids = None if vocab is None else vocab.cpu().numpy()
        return self.sampler.draw(as_rows(logits), len(self.tokens) + len(drafted), drafted, ids)


def through_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """`tokens` up to and including the first end-of-sequence token."""
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if end is None else tokens[: end + 1]
