"""Tiny random-weight models for unit tests, from this one place: delspec's own (`tiny_model`,
built in memory) and transformers' (`tiny_hf_llama`, `tiny_hf_gemma3`, with `tiny_tokenizer`
and `save_hf_dir` to write a Hugging Face model directory)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from delspec.kernels.blocks import BlockWeight
from delspec.model.architectures import ModelConfig
from delspec.model.modules import Linear
from delspec.model.transformer import Transformer
from delspec.weights.checkpoint import build_model


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        family="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position=256,
        tie_embeddings=False,
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    shallow: int | None = None,
    residual_scale: float = 0.05,
    blocks: bool = False,
    block_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
    **overrides,
) -> Transformer:
    """A random model; with `shallow=k`, layers k.. barely change the residual stream, so early
    exits at or after layer k agree with the final layer most of the time (drafts get accepted).
    With `blocks`, its linear weights and embedding are then held as `block_type` blocks (Q8_0,
    F16 or BF16: the types gguf's Python quantises; format int8).
    """
    torch.manual_seed(seed)
    model = build_model(tiny_config(**overrides), dtype=dtype)
    with torch.no_grad():  # larger weights than the init: peaked, varied predictions
        model.embedding.weight.normal_(0.0, 1.0)
        if not model.config.tie_embeddings:
            model.lm_head.weight.normal_(0.0, 1.0)
        for block in model.layers:
            block.attn.qkv.weight.normal_(0.0, 0.3)
            block.mlp.gate_up.weight.normal_(0.0, 0.3)
        if shallow is not None:
            for block in model.layers[shallow:]:
                block.attn.o.weight.mul_(residual_scale)
                block.mlp.down.weight.mul_(residual_scale)
    if blocks:
        named = {n: m.weight for n, m in model.named_modules() if isinstance(m, Linear)}
        named["embedding"] = model.embedding.weight
        if model.config.tie_embeddings:
            named.pop("lm_head")
        model.use_blocks({n: as_blocks(w, block_type) for n, w in named.items()}, "int8")
    return model


def as_blocks(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> BlockWeight:
    """`weight` as blocks of `qtype`, quantised by gguf."""
    values = weight.detach().float().numpy()
    raw = np.ascontiguousarray(gguf.quantize(values, qtype)).view(np.uint8)
    return BlockWeight.from_blocks(qtype, torch.from_numpy(raw), values.shape[1])


TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# A byte-level BPE vocabulary: the 256 byte symbols, two merges, then BOS and EOS.
TOKENS = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "he", "ll", "<s>", "</s>"]
MERGES = [("h", "e"), ("l", "l")]
BOS, EOS = len(TOKENS) - 2, len(TOKENS) - 1


# The transformers models' shared shape: hidden size 64, 4 query and 2 KV heads, 128 positions.
HF_SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of `TOKENS` with a chat template."""
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def tiny_hf_llama(**overrides) -> LlamaForCausalLM:
    """A random transformers Llama (seed 0) for `tiny_tokenizer`: 2 layers, hidden size 64, 4
    query and 2 KV heads, 128 positions; `overrides` replace any config field."""
    torch.manual_seed(0)
    options = dict(
        HF_SHAPE, vocab_size=len(TOKENS), num_hidden_layers=2, bos_token_id=BOS, eos_token_id=EOS
    )
    return LlamaForCausalLM(LlamaConfig(**{**options, **overrides})).eval()


def save_hf_dir(directory: Path, model: LlamaForCausalLM | None = None, **save_options) -> Path:
    """`model` (default `tiny_hf_llama()`) and `tiny_tokenizer` as a Hugging Face directory."""
    (model or tiny_hf_llama()).save_pretrained(directory, **save_options)
    tiny_tokenizer().save_pretrained(directory)
    return directory


GEMMA3_LAYER_TYPES = [
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "full_attention",
]


def tiny_hf_gemma3(dtype: torch.dtype, **overrides) -> Gemma3ForCausalLM:
    """A random transformers Gemma 3 (seed 0): windows (5) shorter than the test sequences, GQA,
    head_dim != hidden/heads, distinct RoPE bases and a query_pre_attn_scalar that is not
    head_dim; weights large enough to matter."""
    torch.manual_seed(0)
    options = dict(
        HF_SHAPE,
        vocab_size=101,
        num_hidden_layers=len(GEMMA3_LAYER_TYPES),
        head_dim=24,
        query_pre_attn_scalar=20,
        sliding_window=5,
        layer_types=GEMMA3_LAYER_TYPES,
        rope_theta=50000.0,
        rope_local_base_freq=300.0,
        final_logit_softcapping=30.0,
    )
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**options, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3 if "norm" in name else 0.2)
    return model.to(dtype).eval()
