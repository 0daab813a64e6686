"""Every strategy is lossless on every supported family's layout, in float and on GGUF blocks:
what an early exit means (the final norm and head over a layer's hidden state) is the same
contract whatever the layer holds (head norms, q/k/v bias, sandwich norms, sliding windows,
capped scores)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from delspec.decoding.sequence import Decoding
from delspec.policies import STRATEGIES, make_policy

FAMILIES = {
    "llama": {},
    "qwen2": {"family": "qwen2"},
    "qwen3": {"family": "qwen3", "head_dim": 24},
    "smollm3": {"family": "smollm3", "nope_layers": (1, 3)},
    "phi3": {
        "family": "phi3",
        "sliding_window": 5,
        "layer_types": ("sliding_attention",) * 6,
    },
    "phi4 (a quarter of each head not rotated, longrope)": {
        "family": "phi3",
        "head_dim": 16,
        "rotary_dim": 12,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.3, 1.6, 1.9, 2.2, 2.5],
            "original_max_position_embeddings": 256,
            "attention_factor": 1.2,
        },
    },
    "granite": {
        "family": "granite",
        "embedding_multiplier": 4.0,
        "residual_multiplier": 0.5,
        "logits_scaling": 3.0,
        "attn_scale": 0.1,
    },
    "olmo2": {"family": "olmo2"},
    "gemma2": {
        "family": "gemma2",
        "sliding_window": 4,
        "layer_types": ("sliding_attention", "full_attention") * 3,
        "attn_softcap": 0.5,
        "final_logit_softcap": 2.0,
    },
    "gemma3_text": {
        "family": "gemma3_text",
        "sliding_window": 4,
        "layer_types": ("sliding_attention",) * 5 + ("full_attention",),
        "rope_local_theta": 10000.0,
    },
}
OPTIONS = {
    "static": dict(exit_layer=2, draft_length=4),
    "fs": dict(exit_layer=2, draft_length=2),
    "dv": dict(exit_layer=2),
    "del-fast": dict(warmup=4),
    "lookup": dict(ngram_min=1),
}


@pytest.mark.parametrize("blocks", [False, True], ids=["float", "blocks"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_strategy_matches_ar(family, blocks):
    model = tiny_model(seed=1, shallow=2, blocks=blocks, **FAMILIES[family])
    assert model.config.family == FAMILIES[family].get("family", "llama")
    prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = Decoding(model, prompt, make_policy("ar", model.num_layers), max_new_tokens=24).run()
    for strategy in sorted(set(STRATEGIES) - {"ar"}):
        policy = make_policy(strategy, model.num_layers, **OPTIONS.get(strategy, {}))
        got = Decoding(model, prompt, policy, max_new_tokens=24).run()
        assert got.token_ids == expected.token_ids, strategy
