"""The exit head: how drafts are made from an early layer's states (final norm + LM head over
a vocabulary), and whether draft layers run on int8 weights."""

from __future__ import annotations

import torch
from torch import Tensor

from delspec.errors import ConfigError
from delspec.kernels.products import Int8Weight, int8_supported
from delspec.model.transformer import Transformer


def int8_drafts(model: Transformer, int8: bool) -> bool:
    """Whether drafts on `model` run on int8 weight copies when `int8` asks for them: a float
    model's do (a model held in quantised weights drafts on those); `ConfigError` where the
    device cannot run them."""
    int8 = int8 and model.weights == "float"
    if int8 and not int8_supported(model.device):
        raise ConfigError(
            f"int8 drafts are not supported on {model.device} by this torch build; "
            "draft in full precision (int8_draft=False, --int8-draft off)"
        )
    return int8


class ExitHead:
    """How drafts are made: logits of an early exit (final norm + LM head over a vocabulary, all
    rows by default), and whether drafts run on int8 weights.

    A head offers one or more draft vocabularies ("levels", `vocabs`), smallest first; a round
    drafts with one of them. With `int8`, draft layers and this head's own draft products use
    `Int8Weight` copies (shadow tokens are scored on exact states; a head with a pruned
    vocabulary projects them through its int8 rows). Subclasses may prune vocabularies (token id
    of each logit column) or transform the exit state.
    """

    def __init__(self, model: Transformer, int8: bool = False, full_head: bool = True) -> None:
        """`full_head`: whether drafts may project onto the whole LM head (with `int8`, its int8
        copy is then made now rather than in the first round). A model held in quantised
        weights (`Transformer.weights`) drafts on them: `int8` is then ignored."""
        self.model = model
        self.int8 = int8 = int8_drafts(model, int8)
        if int8:
            model.make_int8_copies()
            if full_head:
                model.lm_head.int8_weight()
        # per level: the LM head rows drafts project onto (None: the whole head, in id order)
        self.draft_weights: list[Tensor | Int8Weight | None] = [None]
        # per level: the token id of each logit column (None: column = token id)
        self.vocabs: list[Tensor | None] = [None]
        self.admissions = 0  # `admit` calls so far (where a head counts them)

    @property
    def vocab(self) -> Tensor | None:
        """Token ids of the smallest level's columns (the shadow tokens' vocabulary)."""
        return self.vocabs[0]

    @property
    def cheaper_at_final_layer(self) -> bool:
        """Whether a draft from the final layer costs less than a plain step (a pruned
        vocabulary or int8 weights); otherwise it would be the plain step itself. (Asks no
        vocabulary for its tokens: a head widens them with a sequence's tokens when first asked.)"""
        return self.vocab_sizes[0] < self.model.config.vocab_size or self.int8

    @property
    def vocab_sizes(self) -> list[int]:
        """LM head rows a draft token reads at each level, not counting context tokens."""
        return [self.model.config.vocab_size]

    def __call__(self, h: Tensor, exit_layer: int, level: int = 0) -> Tensor:
        """Logits `[tokens, len(vocabs[level])]` of layer `exit_layer`'s states `h`."""
        return self.model.head(h, self.draft_weights[level], self.int8)

    def exit_states(self, hidden: Tensor, exit_layers: list[int]) -> Tensor:
        """Each listed layer's states `[layers, positions, hidden]` as the head projects them:
        after the final norm."""
        return self.model.norm(hidden)

    def shadow(self, hidden: Tensor, exit_layers: list[int]) -> Tensor:
        """Batched logits `[layers, positions, len(vocab)]` of each listed layer's states, over
        the smallest level's vocabulary (in full precision here)."""
        return self.model.project(self.exit_states(hidden, exit_layers))

    def token_logits(self, hidden: Tensor, exit_layers: list[int], tokens: Tensor) -> Tensor:
        """`[layers, positions]`: each listed layer's logit of `tokens[p]` at position p, in
        full precision (comparable with `shadow`'s, up to int8 rounding there)."""
        n = self.exit_states(hidden, exit_layers)
        return self.model.softcap((n * self.model.head_rows(tokens)).sum(-1))

    @property
    def final_layer_is_full_head(self) -> bool:
        """Whether a draft from the final layer is the full head's greedy token restricted to
        the level's vocabulary (no int8 weights, no adapter there): it then drafts a position's
        target exactly when the level holds that token (ties between logits aside), which a
        verification's targets tell for every position at no model cost."""
        return not self.int8 and not self._adapts(self.model.num_layers)

    def _adapts(self, exit_layer: int) -> bool:
        """Whether drafts from `exit_layer` go through an exit adapter (none here)."""
        return False

    def covered(self, tokens: Tensor) -> Tensor:
        """`held` as a `[levels, tokens]` tensor."""
        return torch.tensor(self.held(tokens.tolist()), dtype=torch.bool).view(-1, len(tokens))

    def held(self, tokens: list[int], admission: int | None = None) -> list[list[bool]]:
        """Per level, whether it could draft each of `tokens` before the latest `admit`, or
        before the one that made `admissions` this `admission` (what it answered then, asked
        later); everything, for a head without pruned vocabularies. Plain Python: a policy asks
        about a few tokens every round, right after a step has streamed the weights through
        the caches, where each numpy or torch call costs 5-10 times what it does in a loop."""
        return [[True] * len(tokens) for _ in self.vocabs]

    def for_prompt(self, prompt: list[int]) -> ExitHead:
        """The head for one sequence starting with `prompt` (this one, unless it adapts)."""
        return self

    def admit(self, tokens: list[int]) -> None:
        """`tokens` joined the sequence (a head may widen its vocabularies with them; it counts
        its calls in `admissions`)."""
