"""The layer-addressable engine against transformers, and partial passes against full ones."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import HF_SHAPE, tiny_hf_llama, tiny_model
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from delspec.drafting.draft_head import default_int8_draft
from delspec.drafting.exit_head import ExitHead
from delspec.errors import ConfigError, ContextLengthError, ModelFormatError
from delspec.kernels.products import (
    FLOAT_KERNELS,
    ROW_BUCKETS,
    Int8Weight,
    int8_supported,
    narrow_product,
)
from delspec.model.architectures import config_from_hf
from delspec.model.modules import Linear
from delspec.weights.checkpoint import build_model

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.06, logits_scaling=4.0
)
# Gemma 2 with caps small enough that random weights' scores and logits meet them, and
# sliding windows of 5 keys that 24 positions cross
GEMMA2_CAPPED = dict(
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=0.5,
    final_logit_softcapping=0.8,
    sliding_window=5,
    hidden_activation="gelu_pytorch_tanh",
)
SHAPES = [
    (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, tie_word_embeddings=False)),
    (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=1, rope_scaling=LLAMA3_ROPE)),
    (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, head_dim=32)),
    (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=32)),  # head norms
    # layers without RoPE: every third here, and a list of its own
    (
        SmolLM3Config,
        SmolLM3ForCausalLM,
        dict(num_key_value_heads=2, no_rope_layer_interval=3, pad_token_id=None),
    ),
    (
        SmolLM3Config,
        SmolLM3ForCausalLM,
        dict(num_key_value_heads=4, no_rope_layers=[0, 1, 1], pad_token_id=None),
    ),
    (Gemma2Config, Gemma2ForCausalLM, GEMMA2_CAPPED),  # capped scores and logits
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-6)])
@pytest.mark.parametrize("config_cls,model_cls,extra", SHAPES)
def test_logits_match_transformers(config_cls, model_cls, extra, dtype, tol):
    torch.manual_seed(0)
    hf_config = config_cls(**{**HF_SHAPE, "vocab_size": 101, "num_hidden_layers": 3, **extra})
    reference = model_cls(hf_config).to(dtype).eval()
    ours = build_model(config_from_hf(hf_config.to_dict()), reference.state_dict(), dtype=dtype)
    ids = torch.randint(0, 101, (24,))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
        ours.setup_cache(64)
        got = ours(ids)
    assert (got - expected).abs().max().item() < tol
    assert (got.argmax(-1) == expected.argmax(-1)).all()


# Gemma 3 layout with sliding windows of 4 keys, which the pieces below cross.
GEMMA3_TINY = dict(
    family="gemma3_text",
    layer_types=("sliding_attention", "full_attention", "sliding_attention") * 2,
    sliding_window=4,
    rope_local_theta=100.0,
    attn_scale=0.3,
    final_logit_softcap=5.0,
    tie_embeddings=True,
)


@pytest.mark.parametrize("overrides", [{}, GEMMA3_TINY], ids=["llama", "gemma3"])
def test_layer_ranges_and_piecewise_cache_equal_one_full_pass(overrides):
    model = tiny_model(seed=3, **overrides)
    ids = torch.randint(0, 64, (19,))
    model.setup_cache(32)
    full = model(ids)
    # Overwrite the cache with garbage, then rebuild it through several partial passes.
    model.cache.normal_()
    L = model.num_layers
    h = model.embed(ids[:11])
    h = model.run_layers(h, 0, 0, 2)
    h = model.run_layers(h, 0, 2, L)
    first = model.head(h)
    pieces = [first]
    for start, end in [(11, 12), (12, 16), (16, 19)]:
        e = start % (L - 1) + 1  # a different split point each time
        x = model.run_layers(model.embed(ids[start:end]), start, 0, e)
        pieces.append(model.head(model.run_layers(x, start, e, L)))
    assert torch.equal(torch.cat(pieces).argmax(-1), full.argmax(-1))
    assert (torch.cat(pieces) - full).abs().max() < 1e-12


def test_rewriting_a_position_overwrites_it():
    model = tiny_model(seed=4)
    ids = torch.randint(0, 64, (10,))
    model.setup_cache(16)
    expected = model(ids)[-1]
    model(ids[:9])
    model(torch.tensor([(int(ids[9]) + 1) % 64]), 9)  # a "rejected draft" at position 9
    assert (model(ids[9:], 9)[-1] - expected).abs().max() < 1e-12


def test_context_errors():
    model = tiny_model(seed=0, max_position=16)
    with pytest.raises(ContextLengthError, match="context of 16"):
        model.setup_cache(17)
    model.setup_cache(8)
    with pytest.raises(ContextLengthError, match="KV cache of 8"):
        model(torch.zeros(9, dtype=torch.long))


def test_shape_mismatch_is_named():
    hf = tiny_hf_llama()
    state = hf.state_dict()
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 40)
    with pytest.raises(ModelFormatError, match=r"layers\.1\.mlp\.down_proj.*\(64, 40\)"):
        build_model(config_from_hf(hf.config.to_dict()), state)


def test_unsupported_architecture_is_named():
    with pytest.raises(ModelFormatError, match="unsupported architecture 'gpt2'"):
        config_from_hf({"model_type": "gpt2"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape",
    [(1, 24), (2, 24), (4, 24), (5, 24), (12, 24), (2, 1, 24)],
)
def test_narrow_product_equals_the_plain_product(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    weight = torch.randn(40, 24, generator=gen, dtype=dtype)
    out = narrow_product(x, weight)
    expected = x.double() @ weight.double().T
    assert out.shape == (*shape[:-1], 40) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_lm_head_over_many_rows_matches_and_follows_weight_changes():
    model = tiny_model(seed=2, dtype=torch.float32, vocab_size=300)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 4, 5, 12):
            h = torch.randn(rows, model.config.hidden_size, generator=gen)
            expected = model.norm(h).double() @ model.lm_head.weight.double().T
            torch.testing.assert_close(model.head(h).double(), expected, rtol=1e-5, atol=1e-5)
        model.lm_head.weight.mul_(-2)  # a prepacked copy must not outlive the weight it copies
        expected = model.norm(h).double() @ model.lm_head.weight.double().T
        torch.testing.assert_close(model.head(h).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", FLOAT_KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 33])
def test_layer_products_match_with_every_kernel_and_follow_weight_changes(kernel, rows):
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(48, 40, bias=True).requires_grad_(False)
    layer.weight.copy_(torch.randn(40, 48, generator=gen))
    layer.kernels = dict.fromkeys(ROW_BUCKETS, kernel)
    x = torch.randn(rows, 48, generator=gen)
    with torch.inference_mode():
        for _ in range(2):  # the second time, after the weight changed under its copies
            expected = x.double() @ layer.weight.double().T + layer.bias.double()
            torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
            layer.weight.mul_(-2)


def test_int8_products_are_close_and_their_copies_follow_the_weight():
    gen = torch.Generator().manual_seed(0)
    layer = Linear(256, 96, bias=False).requires_grad_(False)
    layer.weight.copy_(torch.randn(96, 256, generator=gen))
    x = torch.randn(3, 256, generator=gen)
    for _ in range(2):
        exact = x @ layer.weight.T
        approx = layer(x, int8=True)
        assert approx.dtype == x.dtype and approx.shape == exact.shape
        error = (approx - exact).norm() / exact.norm()
        assert 0 < error < 0.02  # int8 weights, bfloat16 activations: close, not exact
        assert isinstance(layer.int8_weight(), Int8Weight)
        assert layer.int8_weight().weight.dtype == torch.int8
        layer.weight.mul_(-3)


def test_models_with_derived_weight_copies_can_be_copied():
    model = tiny_model(seed=5, dtype=torch.float32)
    ids = torch.arange(6)
    with torch.inference_mode():
        model.setup_cache(8)
        logits = model(ids)  # six rows: packed copies on CPU
        model.make_int8_copies()
    twin = copy.deepcopy(model)
    with torch.inference_mode():
        twin.setup_cache(8)
        torch.testing.assert_close(twin(ids), logits)


def test_devices_without_int8_products_fall_back_or_refuse(monkeypatch):
    def unsupported(*args):
        raise NotImplementedError("no int8 kernel here")

    model = tiny_model(seed=0)
    int8_supported.cache_clear()
    monkeypatch.setattr(torch, "_weight_int8pack_mm", unsupported)
    try:
        assert not default_int8_draft("del-fast", model.device)  # "auto": full precision
        with pytest.raises(ConfigError, match="int8 drafts are not supported on cpu"):
            ExitHead(model, int8=True)
    finally:
        int8_supported.cache_clear()
    monkeypatch.undo()
    assert default_int8_draft("del-fast", model.device)
    assert not default_int8_draft("del", model.device)
