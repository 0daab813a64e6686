"""Sampling parameters, their token distribution, and position-keyed draws (`Sampler`).

The processed distribution of one position (`Sampling.probs` is its definition over the whole
vocabulary): the logits, plus `logit_bias`; the repetition penalty over the tokens of the prompt
and of the output so far; the frequency and presence penalties over the output's tokens; divided
by the temperature; then top-k (ties with the k-th logit kept), top-p (the smallest prefix of
the tokens by decreasing probability whose mass reaches top_p, ties in token id order), then
min-p (tokens at least min_p times the most likely one's probability), renormalised.

A `Sampler` draws a position's token by Gumbel-max with noise keyed by (seed, position, token),
a counter-based hash, so the token is a function of the seed, the position and the processed
distribution there alone: however many rounds drafted, rows were batched or draws came before,
every strategy commits the tokens `ar` would with the same seed. A draft token drawn with the
same noise is accepted exactly when it is the target's own draw (see `Engine`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from delspec.errors import ConfigError, is_integer, is_number
from delspec.kernels.scores import row_mass

MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
# keys of the draws that are not a token's: the tail's Gumbel, the uniform that picks in the tail
_TAIL, _TAIL_DRAW = 1 << 62, (1 << 62) + 1
# Candidates: tokens whose scaled logit is within `delta` of the largest (a factor e^-delta of
# its probability), widened through these while a truncation's kept set may reach past them.
DELTAS = (16.0, 20.0, 24.0, 32.0, 64.0, math.inf)
# Narrower sets tried first inside a truncation's candidates: the kept set is usually among them.
SUBLEVELS = (8.0, 12.0)
# Bands below the candidates whose columns are counted to bound the mass outside them.
BANDS = (8.0, 16.0)


@dataclass(frozen=True)
class Sampling:
    """Greedy when `temperature == 0` (the argmax of the biased, penalised logits); otherwise a
    draw from the processed distribution (the module docstring). Ranges and meanings are
    OpenAI's (frequency_penalty, presence_penalty, logit_bias) and vLLM's (min_p,
    repetition_penalty, top_k with 0 = off). `logit_bias` maps token ids to a bias in
    [-100, 100] (given as a mapping; kept as sorted pairs)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        numbers = ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"]
        checks = [(name, is_number(getattr(self, name)), "a number") for name in numbers]
        checks += [
            ("repetition_penalty", is_number(self.repetition_penalty), "a number"),
            ("top_k", is_integer(self.top_k), "an integer"),
            ("seed", self.seed is None or is_integer(self.seed), "an integer or None"),
        ]
        for name, valid, kind in checks:
            if not valid:
                raise ConfigError(f"{name} must be {kind}, got {getattr(self, name)!r}")
        for name, low, high, closed in [
            ("temperature", 0.0, 100.0, True),
            ("top_p", 0.0, 1.0, False),
            ("min_p", 0.0, 1.0, True),
            ("frequency_penalty", -2.0, 2.0, True),
            ("presence_penalty", -2.0, 2.0, True),
        ]:
            value = getattr(self, name)
            if not (low <= value <= high if closed else low < value <= high):
                bounds = f"[{low:g}, {high:g}]" if closed else f"({low:g}, {high:g}]"
                raise ConfigError(f"{name} must be in {bounds}, got {value}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ConfigError(
                f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty}"
            )
        object.__setattr__(self, "logit_bias", checked_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocabulary(self, vocab_size: int) -> None:
        """`ConfigError` for a `logit_bias` token id outside a vocabulary of `vocab_size`."""
        bad = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise ConfigError(
                f"logit_bias token id {bad} is not in the vocabulary 0..{vocab_size - 1}"
            )

    @property
    def adjusts(self) -> bool:
        """Whether logits are biased or penalised before anything else."""
        return bool(self.logit_bias) or self._penalises or self.repetition_penalty != 1.0

    @property
    def _penalises(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def adjusted(self, logits: Tensor, prompt: Sequence[int] = (), output: Sequence[int] = ()):
        """`logits` (`[..., vocab]`, every row after the same tokens) with the bias and the
        penalties of a position after `prompt` and `output` (the generated tokens before it)."""
        z = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32, copy=True)
        for token, bias in self.logit_bias:
            z[..., token] += bias
        if self.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
            x = z[..., seen]
            rp = self.repetition_penalty
            z[..., seen] = torch.where(x > 0, x / rp, x * rp)
        if output:
            ids, counts = torch.tensor(output).unique(return_counts=True)
            z[..., ids] -= self.frequency_penalty * counts + self.presence_penalty
        return z

    def probs(self, logits: Tensor, prompt: Sequence[int] = (), output: Sequence[int] = ()):
        """The processed distribution over the whole vocabulary (`[..., vocab]`), by its
        definition (the reference `Sampler`'s draws follow)."""
        z = self.adjusted(logits, prompt, output) / self.temperature
        if self.top_k and self.top_k < z.shape[-1]:
            kth = torch.topk(z, self.top_k, dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, -math.inf)
        probs = torch.softmax(z, dim=-1)
        if self.top_p < 1.0:
            order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
            sorted_probs = probs.gather(-1, order)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        if self.min_p > 0.0:
            top = probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < self.min_p * top, 0.0)
        return probs / probs.sum(-1, keepdim=True)


def checked_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, bias) pairs; token ids may be given as digit strings
    (JSON object keys). `ConfigError` for anything else (the server's request model asks here
    too)."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(pairs, Sequence | type({}.items())):
        raise ConfigError(f"logit_bias must map token ids to numbers, got {bias!r}")
    out = {}
    for pair in pairs:
        token, value = pair if isinstance(pair, tuple | list) and len(pair) == 2 else (pair, None)
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if not is_integer(token) or token < 0:
            raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not is_number(value) or not -100.0 <= value <= 100.0:
            raise ConfigError(
                f"logit_bias values must be numbers in [-100, 100], got {value!r} for {token}"
            )
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


def as_rows(logits: Tensor) -> np.ndarray:
    """`logits` as a numpy array on the CPU: float64 stays, everything else float32."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.detach().to("cpu", dtype).numpy()


class Sampler:
    """One sequence's draws under a `Sampling` (greedy too, where logits are biased or
    penalised). `add` the committed tokens; `draw` a position's token from the model's logits
    there.

    Draws are Gumbel-max over the kept tokens with noise keyed by (seed, position, token), so
    only the candidates that can matter get noise: the tokens within a factor e^-16 of the most
    likely one's probability (more while a truncation's kept set may reach past them: top-k,
    top-p and min-p keep a prefix of the tokens by decreasing logit, so a kept set whose last
    candidate is dropped holds no token outside). Without truncation, the tokens outside the
    candidates are one more item whose logit is their logsumexp (the maximum of their Gumbels
    has that law); when it wins, the token is drawn inside it by inverse CDF in token id order.
    Both are exact draws from the processed distribution. The whole vocabulary's mass (which
    top-p's cut and the outside item need) is bounded first and summed only when the bounds
    leave the draw undecided (`_Row`). An unseeded sequence gets a random seed of its own."""

    def __init__(self, sampling: Sampling, vocab_size: int, prompt: Sequence[int]) -> None:
        self.sampling = s = sampling
        self.vocab_size = vocab_size
        seed = secrets.randbits(64) if s.seed is None else s.seed & MASK
        self.seed_key = _mix_int(seed)
        s.check_vocabulary(vocab_size)
        self._counts = self._seen = self._bias = None
        self._ids = np.zeros(0, dtype=np.int64)  # tokens whose logits are adjusted
        if s.adjusts:
            self._counts = np.zeros(vocab_size, dtype=np.int64)  # in the output so far
            self._seen = np.zeros(vocab_size, dtype=bool)  # in the prompt or the output
            self._bias = np.zeros(vocab_size)
            biased = [t for t, _ in s.logit_bias]
            self._bias[biased] = [b for _, b in s.logit_bias]
            self._ids = np.array(biased, dtype=np.int64)
            if s.repetition_penalty != 1.0:
                self._note(prompt, count=False)

    def add(self, tokens: Sequence[int]) -> None:
        """Generated `tokens` joined the sequence."""
        if self._counts is not None and tokens:
            self._note(tokens, count=True)

    def _note(self, tokens: Sequence[int], count: bool) -> None:
        ids = np.asarray(tokens, dtype=np.int64)
        if count:
            np.add.at(self._counts, ids, 1)
        self._seen[ids] = True
        if (count and self.sampling._penalises) or self.sampling.repetition_penalty != 1.0:
            self._ids = np.union1d(self._ids, ids)

    def draw(
        self,
        logits: np.ndarray,
        position: int,
        before: Sequence[int] = (),
        vocab: np.ndarray | None = None,
        confidence: bool = True,
    ) -> tuple[int, float]:
        """The token at `position` (its index in the sequence) and its probability (when
        `confidence`; else NaN) under the processed distribution of the model's `logits`
        there: `[columns]`, the token id of each column given by `vocab` (None: the whole
        vocabulary, in id order). `before`: the tokens between the committed sequence and
        `position` (a round's drafts), which the penalties count too."""
        s = self.sampling
        if s.adjusts:
            if vocab is not None:  # penalties and biases are by token id
                full = np.full(self.vocab_size, -np.inf, dtype=logits.dtype)
                full[vocab] = logits
                logits, vocab = full, None
            logits = logits.copy()
            self._adjust(logits, before)
        if s.greedy:
            column = int(logits.argmax())
            p = math.nan
            if confidence:
                top = logits[column]
                p = 1.0 / float(np.exp(logits - top).sum(dtype=np.float64))
            return (column if vocab is None else int(vocab[column])), p
        column, p = _Row(logits, s.temperature).draw(s, self._key(position), vocab, confidence)
        return (column if vocab is None else int(vocab[column])), p

    def _key(self, position: int) -> int:
        return _mix_int((self.seed_key + (position + 1) * _GOLDEN) & MASK)

    def _adjust(self, z: np.ndarray, before: Sequence[int]) -> None:
        """Bias and penalise the logits `z` (over the whole vocabulary) in place."""
        s = self.sampling
        ids = self._ids
        if before and (s._penalises or s.repetition_penalty != 1.0):
            ids = np.union1d(ids, before)
        if not len(ids):
            return
        counts = self._counts[ids]
        if before:
            counts = counts + (ids[:, None] == np.asarray(before)[None, :]).sum(1)
        x = z[ids] + self._bias[ids]
        if s.repetition_penalty != 1.0:
            rp = s.repetition_penalty
            x = np.where(self._seen[ids] | (counts > 0), np.where(x > 0, x / rp, x * rp), x)
        x -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0)
        z[ids] = x


class _Undecided(Exception):
    """The kept set depends on where the whole row's mass lies inside its bounds."""


class _Row:
    """One row of logits under a temperature, read as little as a draw needs: its maximum,
    the columns within a distance of it, and bounds on the whole row's mass (the sum of
    e^(z - top) over every column, z the scaled logits) made tighter only while they do not
    decide the draw: a column more than `delta` below the top weighs less than e^-delta, so
    counting the columns in bands below the candidates bounds the rest, and the exact sum
    is the last resort."""

    def __init__(self, logits: np.ndarray, temperature: float) -> None:
        self.logits, self.temperature = logits, temperature
        self.inv_t = 1.0 / temperature
        self.top_raw = float(logits.max())
        self.top = self.top_raw * self.inv_t
        self._total: float | None = None

    @property
    def total(self) -> float:
        if self._total is None:
            self._total = row_mass(self.logits, self.inv_t, self.top)
        return self._total

    def _count(self, delta: float) -> int:
        """How many columns lie within `delta` of the top (scaled)."""
        return int(np.count_nonzero(self.logits >= self.top_raw - delta * self.temperature))

    def candidates(self, delta: float) -> tuple[np.ndarray, np.ndarray]:
        """The columns whose scaled logit is within `delta` of the top, and those scaled
        logits (float64)."""
        if delta == math.inf:
            columns = np.arange(len(self.logits))
        else:
            columns = np.flatnonzero(self.logits >= self.top_raw - delta * self.temperature)
        return columns, self.logits[columns].astype(np.float64) * self.inv_t

    def bounds(self, mass: float, columns: int, delta: float) -> Iterator[tuple[float, float]]:
        """Ever tighter bounds on the row's mass, given the `mass` of its `columns`
        candidates within `delta` of the top: the rest counted as one band, then in bands
        BANDS apart, then the exact sum."""
        n = len(self.logits)
        if columns == n:
            yield mass, mass
            return
        yield mass, mass + (n - columns) * math.exp(-delta)
        edges = [delta + band for band in BANDS]
        counts = [columns, *(self._count(edge) for edge in edges), n]
        high = mass + sum(
            (counts[i + 1] - counts[i]) * math.exp(-edge) for i, edge in enumerate([delta, *edges])
        )
        yield mass, high
        yield self.total, self.total

    def draw(
        self, s: Sampling, key: int, vocab: np.ndarray | None, confidence: bool
    ) -> tuple[int, float]:
        """Gumbel-max over the kept columns (`Sampler`'s docstring): the column and, when
        `confidence`, its probability (else NaN)."""
        if not s.truncates:
            return self._draw_untruncated(key, vocab, confidence)
        top = self.top
        for delta in DELTAS:
            columns, values = self.candidates(delta)
            every = len(columns) == len(self.logits)
            mass = float(np.exp(values - top).sum())
            # Inside wide candidates, the nearest ones first: sorting them is the cost. The
            # candidates within each sublevel are a prefix of the decreasing order, so each
            # level sorts only those the last one did not hold (ties stay in column order, as
            # one sort of all would leave them).
            before = None  # which candidates are sorted so far (v, c)
            for inner in [d for d in SUBLEVELS if d < delta] + [delta]:
                pick = values >= top - inner if inner < delta else None
                if pick is not None and pick.all():
                    continue
                fresh = pick if before is None else ~before if pick is None else pick & ~before
                new = np.arange(len(values)) if fresh is None else np.flatnonzero(fresh)
                if not len(new) and pick is not None:
                    continue
                order = new[np.argsort(-values[new], kind="stable")]
                if before is None:
                    v, c = values[order], columns[order]
                else:
                    v, c = np.concatenate([v, values[order]]), np.concatenate([c, columns[order]])
                before = pick
                bounds = self.bounds(mass, len(columns), delta)
                kept = self._decided(s, v, bounds, every and pick is None)
                if kept is not None:
                    v, c = v[:kept], c[:kept]
                    ids = c if vocab is None else vocab[c]
                    best = int((v + _gumbel(key, ids)).argmax())
                    p = math.nan
                    if confidence:
                        p = math.exp(float(v[best] - top)) / np.exp(v - top).sum()
                    return int(c[best]), p
        raise AssertionError("unreachable: the whole vocabulary decides")

    def _decided(
        self, s: Sampling, values: np.ndarray, bounds: Iterator[tuple[float, float]], every: bool
    ) -> int | None:
        """`_kept` under the first of the `bounds` on the row's mass that decides it."""
        for low, high in bounds:
            try:
                return _kept(s, values, self.top, (low, high), every)
            except _Undecided:
                continue
        raise AssertionError("unreachable: the exact mass decides")

    def _draw_untruncated(
        self, key: int, vocab: np.ndarray | None, confidence: bool
    ) -> tuple[int, float]:
        """The candidates within DELTAS[0], plus one item for the rest whose logit is their
        logsumexp; when it wins, the token is drawn inside the rest by inverse CDF."""
        top = self.top
        columns, values = self.candidates(DELTAS[0])
        ids = columns if vocab is None else vocab[columns]
        scores = values + _gumbel(key, ids)
        best = int(scores.argmax())
        mass = float(np.exp(values - top).sum())
        tail = 0.0
        if len(columns) < len(self.logits):
            noise = float(_gumbel(key, [_TAIL])[0])
            for low, high in self.bounds(mass, len(columns), DELTAS[0]):
                if low == high or (
                    not confidence and top + math.log(high - mass) + noise <= scores[best]
                ):
                    tail = max(0.0, low - mass)
                    break
            if tail > 0.0 and top + math.log(tail) + noise > scores[best]:
                z = self.logits * self.logits.dtype.type(self.inv_t)
                weights = np.exp(z - z.dtype.type(top)).astype(np.float64)
                weights[columns] = 0.0
                cdf = np.cumsum(weights)
                u = _uniform(key, [_TAIL_DRAW])[0]
                column = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
                column = min(column, len(self.logits) - 1)
                return column, float(weights[column]) / self.total
        p = math.exp(float(values[best] - top)) / (mass + tail) if confidence else math.nan
        return int(columns[best]), p


def _kept(
    s: Sampling, values: np.ndarray, top: float, bounds: tuple[float, float], every: bool
) -> int | None:
    """How many of the candidates `values` (scaled logits, decreasing) truncation keeps;
    None when the kept set may reach past them (unless they are `every` column). `bounds`:
    the row's whole mass lies within them; `_Undecided` when top-p's cut depends on where."""
    kept = len(values)
    if s.top_k and kept > s.top_k:
        kept = int(np.searchsorted(-values, -values[s.top_k - 1], side="right"))
    if s.top_k and kept == len(values) and not every:
        return None  # the k-th largest logit, or a tie with it, may lie outside
    if s.top_p < 1.0:
        w = np.exp(values[:kept] - top)
        before = np.cumsum(w) - w
        if s.top_k:
            cut = int(np.searchsorted(before, s.top_p * w.sum(), side="left"))
        else:
            low, high = bounds
            cut = int(np.searchsorted(before, s.top_p * low, side="left"))
            if cut != int(np.searchsorted(before, s.top_p * high, side="left")):
                raise _Undecided
        kept = cut
    if s.min_p > 0.0:
        floor = top + math.log(s.min_p)
        kept = min(kept, int(np.searchsorted(-values, -floor, side="right")))
    return kept if kept < len(values) or every else None


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python integer (64 bits)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _uniform(key: int, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A uniform in (0, 1) for each of `ids` under `key`: splitmix64's output number `id + 1`
    of the stream that starts at `key` (wrapping uint64 arithmetic)."""
    x = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
    x = x * np.uint64(_GOLDEN) + np.uint64(key)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _gumbel(key: int, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Standard Gumbel noise for each of `ids` under `key`."""
    return -np.log(-np.log(_uniform(key, ids)))
