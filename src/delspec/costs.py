"""Cost models for choosing the exit layer and draft length: what a round costs."""

from __future__ import annotations

from torch import Tensor


class LayerCost:
    """The paper's cost: layer loads per round, d*l (drafting) + L (verification)."""

    name = "layers"

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def grid(self, exit_layers: Tensor, draft_lengths: Tensor) -> Tensor:
        """`[exit layers, draft lengths]` cost of one round."""
        return draft_lengths[None, :].double() * exit_layers[:, None].double() + self.num_layers

    def plain_step(self) -> float:
        return float(self.num_layers)
