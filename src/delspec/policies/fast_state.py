"""What `del-fast` keeps besides DEL's per-layer statistics: the realized speed of the rounds
that ran (`Realized`), the acceptance of context proposals (`ContextScore`), and what one
generation hands the next with the same model, head and options (`Learned`, kept by the loaded
model: `LoadedModel.learned`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from delspec.drafting.context_drafts import NO_PROPOSAL, POOL, ContextProposal
from delspec.machine.profile import MachineProfile
from delspec.policies.exit_statistics import ExitStatistics, position_sums
from delspec.policies.protocol import Round

REALIZED_ROUNDS = 3.0  # (decayed) rounds of exit-layer drafts before their realized speed counts
# The most (decayed) rounds of each kind a generation's carried realized speeds cover: a verdict
# formed under another moment's load (a busy host) is judged again from the new generation's own
# rounds once they decay below REALIZED_ROUNDS (23 rounds in at the default decay), not after
# however long the previous generations ran.
CARRIED_ROUNDS = 2 * REALIZED_ROUNDS
PLAIN_SEEN = 0.25  # (decayed) plain rounds that still tell what a plain step delivers now
# Unseen misses counted for the shortest context matches (under the default `prior`), and the
# pseudo-counts by which each longer class starts from the next shorter one's rates: a class's
# first tokens are seen once per proposal, not at every position as a layer's are, and what a
# previous reply carried over (code: single-token matches often right) can be far from this
# one's (chat: rarely); with 1, such drafts kept being made on short replies.
CONTEXT_PRIOR = 3.0
# The shortest match length (`ContextProposal.match_length`) of each class of context proposals
# with statistics of its own: a first token's chance of acceptance grows with the length of the
# match, steeply over the first few tokens, so the short lengths have classes of their own and
# the long ones share (per n-gram order alone, the longest class would mix very different
# rates).
MATCH_CLASSES = (1, 2, 3, 4, 6, 10)


@dataclass
class Learned:
    """What a `FastDynamicExit` generation learned, for the next one with the same model, head
    and options to start from (the live objects: the generation that runs keeps them current)."""

    stats: ExitStatistics
    context: ExitStatistics
    below: ExitStatistics
    realized: Realized
    cost: object  # MeasuredCost or LayerCost
    row_cost: float = 0.0  # measured seconds per scored (layer, position)


@dataclass(frozen=True)
class PolicyInputs:
    """What a `FastDynamicExit` takes from outside its options: where its measured costs come
    from (the loaded model's `MachineProfile`; None: one of the model's own, made at start),
    what earlier runs with the same model learned (`LoadedModel.learned`; None: nothing
    carried), and the most new tokens this run may make (None: unbounded)."""

    machine: MachineProfile | None = None
    learned: dict[tuple, Learned] | None = None
    budget: int | None = None


NO_INPUTS = PolicyInputs()  # nothing from outside: a profile of the model's own, nothing carried


class Realized:
    """Decayed tokens and seconds of the rounds that ran, by kind: plain steps, and rounds that
    drafted from an exit layer (context drafts before them or not). Every round decays both
    kinds by `decay`, so each kind's figures are recent: a machine's speed drifts, and rates
    taken at different times would compare the drift, not the kinds."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.sums = {"plain": [0.0, 0.0, 0.0], "layer": [0.0, 0.0, 0.0]}  # tokens, s, rounds

    def capped(self, rounds: float) -> Realized:
        """A copy in which neither kind covers more than `rounds` rounds (a kind that covered
        more scaled down to it): the same rates, no more evidence."""
        carried = Realized(self.decay)
        for kind, (tokens, seconds, count) in self.sums.items():
            scale = min(1.0, rounds / count) if count > 0 else 1.0
            carried.sums[kind] = [tokens * scale, seconds * scale, count * scale]
        return carried

    def add(self, record: Round, overhead: float) -> None:
        """Count a finished round (of either kind; a context-only round only decays them),
        with the `overhead` seconds the policy spent on it."""
        for sums in self.sums.values():
            sums[:] = [self.decay * value for value in sums]
        if record.layer_drafts:
            kind = "layer"
        elif not record.drafted:
            kind = "plain"
        else:
            return
        seconds = record.draft_s + record.verify_s + overhead
        for i, add in enumerate((len(record.tokens), seconds, 1.0)):
            self.sums[kind][i] += add

    def verdict(self) -> str:
        """What the rounds that ran say of drafting from a layer next: "draft" (not seen often
        enough, `REALIZED_ROUNDS`, to judge, or as fast as recent plain steps at least), "lose"
        (fewer tokens per second than recent plain steps), or "see" (no plain step recent
        enough, `PLAIN_SEEN`, to compare with: take one)."""
        (tokens, seconds, rounds), (plain_tokens, plain_seconds, plain_rounds) = (
            self.sums["layer"],
            self.sums["plain"],
        )
        if rounds < REALIZED_ROUNDS or not seconds:
            return "draft"
        if plain_rounds < PLAIN_SEEN or not plain_seconds:
            return "see"
        return "draft" if tokens / seconds >= plain_tokens / plain_seconds else "lose"


class ContextScore:
    """Decayed acceptance statistics of context proposals, from each round's proposal compared
    with the tokens the sequence commits after it (a proposal stays pending until those tokens
    settle it). Per class of match length (`MATCH_CLASSES`), two rows: its proposals' first
    tokens (whose alpha is the chance a first token is accepted) and all their tokens (whose
    continuation is the chance a token after an accepted one is). One row of all tokens would
    mix the two: where the first token is rarely right but a right one runs on (single-token
    matches on chat replies), its alpha would read well above the first token's chance, and
    proposals that missed would keep being drafted.

    A class's estimates start from the next shorter class's (`prior` pseudo-counts at its
    rates; the shortest: `prior` unseen misses, and continuation towards its own alpha): a
    longer match is no worse a guess than a shorter one, so a class seen a few times is not
    priced as if its proposals had missed.

    Each source of proposals (`ContextProposal.source`: the sequence, the draft pool) has rows
    of its own: a match of the same length in earlier replies and in the sequence itself need
    not be as good a guess."""

    CLASSES = len(MATCH_CLASSES)
    SOURCES = POOL + 1

    def __init__(self, omega: float, prior: float) -> None:
        self.prior = prior
        # per source: first-token rows, then all-token rows
        self.stats = ExitStatistics(2 * self.CLASSES * self.SOURCES, omega)
        self.committed_tokens: list[int] = []  # since `origin`
        self.origin: int | None = None  # sequence position of committed_tokens[0]
        self.pending: list[tuple[int, ContextProposal]] = []  # (index in committed_tokens, ...)
        self.taken: list[int] = []  # len(committed_tokens) after each `take` since `settle`
        self.proposal = NO_PROPOSAL  # this round's
        self.after = NO_PROPOSAL  # this round's after its exit-layer drafts
        self.after_drafts = 0  # how many exit-layer drafts `after` followed

    def learned(self, stats: ExitStatistics) -> None:
        """Start from `stats` (a previous sequence's) instead of nothing."""
        self.stats = stats

    @staticmethod
    def match_class(match_length: int) -> int:
        """The statistics class of a proposal whose match reached `match_length` tokens."""
        return bisect.bisect_right(MATCH_CLASSES, match_length) - 1

    def acceptance(self, match_length: int, source: int = 0) -> tuple[float, float]:
        """A proposal from `source` whose match reached `match_length` tokens: the chance its
        first token is accepted, and that a token after an accepted one is."""
        rates, prior, classes = self.stats.rates, self.prior, self.CLASSES
        base = 2 * classes * source
        first, then = rates(base, prior)[0], rates(base + classes, prior)[1]
        for row in range(base + 1, base + self.match_class(match_length) + 1):
            first = rates(row, prior, (first, None))[0]
            then = rates(classes + row, prior, (0.0, then))[1]
        return first, then

    def proposed(self, proposal: ContextProposal) -> None:
        """The round about to run had this proposal (drafted or not)."""
        self.proposal, self.after = proposal, NO_PROPOSAL

    def followed(self, proposal: ContextProposal, layer_drafts: int) -> None:
        """The round had this proposal after its first `layer_drafts` exit-layer drafts
        (drafted or not; the last one given is kept): it is scored if they were accepted (else
        it followed tokens the sequence does not have)."""
        self.after, self.after_drafts = proposal, layer_drafts

    def committed(self, record: Round) -> None:
        """Take the round's committed tokens (`take`); settle the proposals they decide."""
        self.take(record)
        self.settle()

    def take(self, record: Round) -> None:
        """Take the round's committed tokens and its proposals, pending until `settle`."""
        start = record.position + 1  # where this round's tokens (and its proposal) begin
        if self.origin is None or start - self.origin != len(self.committed_tokens):
            # the first round, or tokens committed without a round (batched steps): restart
            self.settle()
            self.origin, self.committed_tokens, self.pending = start, [], []
        index = len(self.committed_tokens)
        self.committed_tokens.extend(record.tokens)
        self.taken.append(len(self.committed_tokens))
        if self.proposal.tokens:
            self.pending.append((index, self.proposal))
        followed = record.from_context + self.after_drafts  # drafts before `after`'s
        if self.after.tokens and record.accepted >= followed:
            self.pending.append((index + followed, self.after))
        self.proposal = self.after = NO_PROPOSAL

    def settle(self) -> None:
        """Count the pending proposals that the tokens taken so far decide: those each `take`
        decided together, take after take (the decay as if each take had been settled)."""
        # (take, source) -> its decided proposals
        settled: dict[tuple[int, int], list[tuple[int, list[bool]]]] = {}
        still = []
        for index, proposal in self.pending:
            outcome = _settled(proposal.tokens, self.committed_tokens, index)
            if outcome is None:
                still.append((index, proposal))
            else:
                take = bisect.bisect_left(self.taken, index + len(outcome))
                key = (take, proposal.source)
                settled.setdefault(key, []).append((proposal.match_length, outcome))
        self.pending, self.taken = still, []
        for take, source in sorted(settled):
            self.count(settled[take, source], source)

    def count(self, settled: list[tuple[int, list[bool]]], source: int = 0) -> None:
        """Add settled proposals from `source`, (match length, whether each token matched up to
        and including the first miss), in one update of each row they touch (confidence 1 for
        every token)."""
        sums: dict[int, list[float]] = {}  # row -> ExitStatistics' six sums
        for match_length, outcome in settled:
            first = self.match_class(match_length) + 2 * self.CLASSES * source
            for row, match in ((first, outcome[:1]), (self.CLASSES + first, outcome)):
                add = position_sums(match, [1.0] * len(match))
                into = sums.setdefault(row, [0.0] * 6)
                into[:] = [kept + new for kept, new in zip(into, add, strict=True)]
        for row, values in sums.items():
            self.stats.add_to(row, values)


def _settled(proposed: list[int], committed: list[int], start: int) -> list[bool] | None:
    """Whether each proposed token matched, up to and including the first miss, once the
    tokens `committed` from index `start` on decide it; else None."""
    outcome = []
    for want, at in zip(proposed, range(start, len(committed)), strict=False):
        outcome.append(want == committed[at])
        if not outcome[-1]:
            return outcome
    return outcome if len(outcome) == len(proposed) else None
