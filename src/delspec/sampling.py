"""Sampling parameters, the processed token distribution, and speculative acceptance."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from delspec.errors import ConfigError, is_integer, is_number


@dataclass(frozen=True)
class Sampling:
    """Greedy when `temperature == 0`; otherwise temperature, then top-k, then top-p filtering."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, valid, kind in [
            ("temperature", is_number(self.temperature), "a number"),
            ("top_k", is_integer(self.top_k), "an integer"),
            ("top_p", is_number(self.top_p), "a number"),
            ("seed", self.seed is None or is_integer(self.seed), "an integer or None"),
        ]:
            if not valid:
                raise ConfigError(f"{name} must be {kind}, got {getattr(self, name)!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ConfigError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen

    def probs(self, logits: Tensor) -> Tensor:
        """The distribution tokens are drawn from, `[..., vocab]`, in float32 at least."""
        logits = logits.float() if logits.dtype != torch.float64 else logits
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


def greedy_tokens(scores: Tensor) -> Tensor:
    """`scores.argmax(-1)` (the first of equal maxima), through numpy for float32 and float64
    on the CPU: torch's CPU argmax took 82 us for one row of SmolLM2's 49k logits and 860 us
    for 3 rows of Gemma's 262k on an Intel Xeon with 2 threads, numpy's 4 and 88 us."""
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        return torch.as_tensor(scores.detach().numpy().argmax(-1))
    return scores.argmax(-1)


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def speculative_accept(
    target: Tensor, draft: Tensor, tokens: list[int], generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative sampling over a drafted chain.

    `target` is `[T+1, vocab]` (target distributions after each prefix), `draft` is `[T, vocab]`
    (the distributions the draft tokens were drawn from). Returns `(accepted, next_token)`: the
    number of draft tokens kept and the token that follows them, drawn so that the output is
    distributed exactly as sampling from `target` one token at a time.
    """
    for i, token in enumerate(tokens):
        p, q = target[i, token], draft[i, token]
        u = torch.rand((), generator=generator, device=target.device, dtype=target.dtype)
        if u * q < p:  # accept with probability min(1, p/q)
            continue
        residual = (target[i] - draft[i]).clamp_min(0.0)
        total = residual.sum()
        return i, draw(residual / total if total > 0 else target[i], generator)
    return len(tokens), draw(target[len(tokens)], generator)
