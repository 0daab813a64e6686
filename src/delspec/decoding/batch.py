"""Several sequences advanced together: their prompts prefilled in one batched pass
(`start_together`), and one round each in one batched pass over the weights (`step_together`).
A sequence's greedy tokens are the model's own greedy tokens (the kernels' rows are exact however
many are computed together), and sampled tokens keep its distribution."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from delspec.decoding.prefill import Prefill, prefill_chunk
from delspec.decoding.sequence import Decoding
from delspec.machine.timing import synchronize


def start_together(decodings: Sequence[Decoding]) -> None:
    """`Decoding.start` for several decodings (on distinct cache slots of one model) in one
    batched pass over the weights: every prompt's rows at once (`prefill_chunk` without a
    budget; the server prefills in chunks). (No DEL warm-up context is kept: its first round
    scores its own positions only.)"""
    prefill_chunk([Prefill(d) for d in decodings])


@torch.inference_mode()
def step_together(
    decodings: Sequence[Decoding], drafts: Sequence[list[int]] | None = None
) -> list[tuple[list[int], int]]:
    """One round for each of `decodings` (on distinct cache slots of one model) in one batched
    pass over the weights: each one's newest token's row and, with `drafts`, a row for each of
    its context draft tokens (`Decoding.proposal`), verified as in a round of its own. Returns
    each one's committed tokens (none when it stopped) and how many were accepted drafts."""
    model = decodings[0].model
    start = time.perf_counter()
    drafts = drafts or [[] for _ in decodings]
    ids, positions, slots = [], [], []
    for decoding, draft in zip(decodings, drafts, strict=True):
        tokens = decoding.tokens
        first = len(tokens) - 1
        ids += [tokens[-1], *draft]
        positions += range(first, first + 1 + len(draft))
        slots += [decoding.slot] * (1 + len(draft))
    inputs = model.embed(ids)
    logits = model.head(model.run_rows(inputs, positions, slots, 0, model.num_layers))
    synchronize(model.device)
    seconds = (time.perf_counter() - start) / len(decodings)  # each sequence's share
    done, row = [], 0
    for decoding, draft in zip(decodings, drafts, strict=True):
        done.append(decoding.commit(draft, logits[row : row + 1 + len(draft)], seconds))
        row += 1 + len(draft)
    return done
