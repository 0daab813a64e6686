"""Pruned draft vocabularies: ranking tokens and choosing the K highest-ranked ones.

A draft vocabulary of K keeps the LM-head rows of the K highest-ranked tokens: ranked by the
calibration's token counts (`ExitAdapters.ranking`) or, without calibration, by
`fallback_ranking`. Several sizes give nested vocabularies ("levels"), smallest first.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from delspec.errors import ConfigError
from delspec.weights.gguf_file import byte_characters, token_scores


def fallback_ranking(source: str | os.PathLike, vocab_size: int) -> Tensor:
    """A token ranking without calibration data: tokenizer scores, else token id order.

    A GGUF file's `tokenizer.ggml.scores` (SentencePiece: unigram log-probabilities, or minus
    the merge rank for BPE vocabularies such as Gemma's) rank tokens by descending score, ties
    by id. A SentencePiece BPE vocabulary lists its single characters after every merge, so by
    score alone digits, punctuation and the bare space would rank last: the file's single
    characters of the byte range (`byte_characters`), which texts in every language use, come
    first, in their own order. Otherwise ids are taken in order, which follows the merge order
    (a frequency proxy) for byte-level BPE vocabularies such as SmolLM2's, whose bytes come
    first. Model rows beyond the tokenizer come last.
    """
    path = Path(source)
    scores = _gguf_scores(path)
    if scores is None:
        return torch.arange(vocab_size)
    scores = scores[:vocab_size]
    order = np.argsort(-scores, kind="stable")
    common = np.zeros(len(scores), dtype=bool)
    found = byte_characters(path)[: len(scores)]
    common[: len(found)] = found
    order = np.concatenate([order[common[order]], order[~common[order]]])
    return torch.cat([torch.from_numpy(order).long(), torch.arange(len(scores), vocab_size)])


def _gguf_scores(path: Path) -> np.ndarray | None:
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return None
    scores = token_scores(path)
    if scores is None:
        return None
    scores = scores.astype(np.float64)
    return None if np.unique(scores).size < 2 else scores


def top_tokens(ranking: Tensor, k: int) -> Tensor:
    """The `k` highest-ranked token ids, ascending (so that ties break as in the full head)."""
    if not 1 <= k <= len(ranking):
        raise ConfigError(f"draft vocabulary must be in 1..{len(ranking)} tokens, got {k}")
    return ranking[:k].sort().values


def vocabulary_sizes(
    draft_vocab: int | Sequence[int | None] | None, vocab_size: int
) -> tuple[int | None, ...] | None:
    """`draft_vocab` as ascending draft vocabulary sizes, None (last) for the full vocabulary;
    None when nothing is pruned. Raises `ConfigError` for a size outside 1..`vocab_size`."""
    if draft_vocab is None:
        return None
    if isinstance(draft_vocab, str):
        raise ConfigError(f"draft vocabulary: expected sizes or 'auto', got {draft_vocab!r}")
    listed = [draft_vocab] if isinstance(draft_vocab, int) else list(draft_vocab)
    for k in listed:
        if k is not None and not 1 <= k <= vocab_size:
            raise ConfigError(f"draft vocabulary must be in 1..{vocab_size} tokens, got {k}")
    if len(listed) == 1:  # one size: that many rows, even all of them
        return tuple(listed) if listed[0] is not None else None
    pruned = sorted({k for k in listed if k is not None and k < vocab_size})
    full = any(k is None or k == vocab_size for k in listed)
    return (*pruned, *[None] * full) if pruned else None


def draft_vocabularies(
    ranking: Tensor, sizes: tuple[int | None, ...] | None
) -> list[Tensor | None] | None:
    """The draft vocabularies of `sizes` (see `vocabulary_sizes`): top-ranked tokens, or None."""
    if sizes is None:
        return None
    return [None if k is None else top_tokens(ranking, k) for k in sizes]
