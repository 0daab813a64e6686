"""The types every layer shares: a round's `Plan` (what a policy decides), its `Round` (what
happened, as the engine reports it) and the `Policy` interface, apart from how rounds run."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from delspec.drafting.context_drafts import NO_PROPOSAL, ContextProposal
from delspec.drafting.exit_head import ExitHead


@dataclass(frozen=True)
class Plan:
    """The next round: draft the `context_drafts` tokens (from the round's `ContextProposal`),
    then up to `draft_cap` tokens with layers [0, exit_layer) and the exit head's draft vocabulary
    `level` (`ExitHead.vocabs`).

    No draft at all (`draft_cap == 0`, no `context_drafts`) is a plain autoregressive step
    through the full model.
    """

    exit_layer: int
    draft_cap: int
    level: int = 0
    context_drafts: tuple[int, ...] = ()


@dataclass
class Round:
    """What happened in one round; positions are relative to the round's first input."""

    position: int  # absolute position of the round's input token
    exit_layer: int  # E; 0 for a plain (no-draft) step
    drafted: list[int]
    confidences: list[float]  # exit-head probability of each drafted token
    accepted: int
    tokens: list[int]  # committed: accepted drafts + the target's token
    targets: Tensor  # greedy target token after each of warmup_rows + T + 1 positions
    hidden: Tensor | None = None  # [layers, warmup_rows + T + 1, hidden] when collected
    warmup_rows: int = 0  # leading prompt positions (DEL's warm-up) in `hidden`/`targets`
    level: int = 0  # the exit head's draft vocabulary (`ExitHead.vocabs`) the drafts came from
    from_context: int = 0  # leading drafted tokens that came from the context, not the exit
    context_after: int = 0  # trailing drafted tokens from the context, after the exit layer's
    draft_s: float = 0.0
    verify_s: float = 0.0
    extra: dict = field(default_factory=dict)  # policy annotations for traces
    logits: Tensor | None = None  # the full head's, after the input and each draft token

    @property
    def layer_drafts(self) -> int:
        """How many drafted tokens came from the exit layer."""
        return len(self.drafted) - self.from_context - self.context_after


class Policy:
    """Decides, per round, the exit layer and when to stop drafting.

    The generation loop calls `start` once per prompt, then per round `plan`, the engine calls
    `keep_drafting` after every draft token (except the last allowed one), `observe` gets the
    finished round, and `finish` is called when the sequence ends. `collect_hidden` asks the
    engine for every layer's states of each round; `warmup_window` asks for that many prompt
    positions as teacher-forced context in round 0;
    `context_ngrams` (the n-gram orders of a `ContextIndex`; None: none) asks for a
    `ContextProposal` of up to `context_limit` tokens in each `plan`, and, after each
    exit-layer draft token, for one found after the drafts so far (`follow`).
    Subclasses take the model's depth and their strategy's options (`delspec.decode_config`).
    """

    name = "policy"
    traced = False  # whether the rounds' `extra` is read (a trace is kept); set by the caller
    collect_hidden = False
    warmup_window = 0
    context_ngrams: tuple[int, int] | None = None
    context_limit = 0
    speculates = True  # whether rounds may verify drafts (e.g. tokens a grammar forces)

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def start(self, exit_head: ExitHead) -> None:
        """Reset all per-prompt state."""

    def measure_costs(self, exit_head: ExitHead) -> None:
        """Measure, thoroughly, whatever this machine's timings the policy reads (none here):
        called by long-lived processes before their first `start`."""

    def plan(self, proposal: ContextProposal = NO_PROPOSAL) -> Plan:
        """The next round, given what the context proposes for it."""
        raise NotImplementedError

    def keep_drafting(self, confidence: float) -> bool:
        """Whether to draft another token after one drafted with `confidence`."""
        return True

    def follow(self, proposal: ContextProposal, layer_drafts: int, last: bool) -> list[int]:
        """The context tokens to draft after the round's first `layer_drafts` exit-layer
        drafts (the last ones if `last`), instead of any more of them: a prefix of `proposal`
        (found after the sequence and the round's drafts). None here."""
        return []

    def observe(self, record: Round) -> None:
        """Update statistics from a finished round (now, or with later rounds': a policy that
        holds updates back applies them by `finish` at the latest); annotates `record.extra`
        where `traced`."""

    def finish(self) -> None:
        """The sequence ended (no more `plan` or `observe` until the next `start`): apply any
        updates `observe` held back."""
