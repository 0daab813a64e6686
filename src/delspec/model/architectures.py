"""Model configuration and the small per-family differences of supported architectures.

Every supported family is one decoder layout (pre-norm attention + gated MLP, RoPE, optional
grouped-query attention); a family is a short declarative description of how it differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from delspec.errors import ModelFormatError


@dataclass(frozen=True)
class Family:
    """What distinguishes one architecture family from the plain Llama layout."""

    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (Gemma 3, Qwen3)
    sandwich_norm: bool = False  # extra norms after attention and after the MLP (Gemma 3)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    activation: str = "silu"  # "silu" or "gelu_tanh"
    norm_offset: float = 0.0  # RMSNorm scale is (offset + weight), in float32 (Gemma: 1)
    sliding_window_pattern: int | None = None  # every n-th layer global, when no layer_types
    sliding_everywhere: bool = False  # a `sliding_window` applies to every layer (Phi-3)
    fused_tensors: bool = False  # checkpoints hold qkv_proj and gate_up_proj fused (Phi-3)
    gguf: str = ""  # the GGUF `general.architecture` its files declare
    differs: str = ""  # what differs from the Llama layout, in words (`delspec info --families`)


FAMILIES: dict[str, Family] = {
    "llama": Family(gguf="llama", differs="the layout (Llama 2/3/3.x, SmolLM2)"),
    "mistral": Family(gguf="llama", differs="none"),
    "qwen2": Family(qkv_bias=True, gguf="qwen2", differs="q/k/v bias"),
    "qwen3": Family(qk_norm=True, gguf="qwen3", differs="per-head q/k norms"),
    "phi3": Family(
        sliding_everywhere=True,
        fused_tensors=True,
        gguf="phi3",
        differs="fused qkv and gate/up tensors, a sliding window on every layer",
    ),
    # scalar multipliers (`ModelConfig`)
    "granite": Family(gguf="granite", differs="embedding, residual, attention, logit scales"),
    # some layers without RoPE (`ModelConfig.nope_layers`)
    "smollm3": Family(gguf="smollm3", differs="layers without RoPE"),
    # attention scores capped (`ModelConfig.attn_softcap`), logits too (`final_logit_softcap`)
    "gemma2": Family(
        sandwich_norm=True,
        embed_scale=True,
        activation="gelu_tanh",
        norm_offset=1.0,
        sliding_window_pattern=2,
        gguf="gemma2",
        differs="sandwich norms, GELU, scaled embeddings, sliding windows, capped scores",
    ),
    "gemma3_text": Family(
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=True,
        activation="gelu_tanh",
        norm_offset=1.0,
        sliding_window_pattern=6,
        gguf="gemma3",
        differs="q/k norms, sandwich norms, GELU, scaled embeddings, sliding windows",
    ),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only transformer."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = False
    # Gemma 3: per-layer attention type and the local layers' window and RoPE base.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    attn_scale: float | None = None  # softmax scale; default 1/sqrt(head_dim)
    final_logit_softcap: float | None = None
    attn_softcap: float | None = None  # scores capped to c * tanh(score / c) (Gemma 2)
    nope_layers: tuple[int, ...] = ()  # layers whose queries and keys get no RoPE (SmolLM3)
    # Granite: embeddings times `embedding_multiplier`, each layer's attention and MLP outputs
    # times `residual_multiplier` before they join the residual, logits divided by
    # `logits_scaling` (its `attention_multiplier` is the softmax scale).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    eos_token_ids: tuple[int, ...] = field(default=())

    @property
    def spec(self) -> Family:
        return FAMILIES[self.family]

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def rope_kind(self, layer: int) -> str:
        """Which RoPE table a layer rotates by: "global", "local" (sliding-window layers' base)
        or "none" (an identity rotation: the layer attends without positions)."""
        if layer in self.nope_layers:
            return "none"
        local = self.is_sliding(layer) and self.rope_local_theta is not None
        return "local" if local else "global"

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)


def token_ids(raw: int | list[int] | None) -> tuple[int, ...]:
    """A config's token id field (one id, a list, or none) as a tuple."""
    if raw is None:
        return ()
    return tuple(int(i) for i in raw) if isinstance(raw, list | tuple) else (int(raw),)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Build a `ModelConfig` from a Hugging Face `config.json` dictionary.

    Raises `ModelFormatError` naming the architecture when it is not supported.
    """
    model_type = hf.get("model_type")
    if model_type == "gemma3":  # multimodal wrapper: the text model is what we run
        hf = {**hf.get("text_config", {}), "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type not in FAMILIES:
        raise ModelFormatError(
            f"unsupported architecture {model_type!r}; delspec supports: {', '.join(FAMILIES)} "
            "(delspec info --families)"
        )
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        rope_theta, rope_scaling, rope_local_theta = _rope(hf)
        params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ModelFormatError(
                f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported"
            )
        family = FAMILIES[model_type]
        num_layers = int(hf["num_hidden_layers"])
        layer_types = _layer_types(hf, family, num_layers)
        sliding_window = hf.get("sliding_window") if layer_types else None
        query_scale = hf.get("query_pre_attn_scalar")
        attn_scale = float(query_scale) ** -0.5 if query_scale else None
        if hf.get("attention_multiplier") is not None:
            attn_scale = float(hf["attention_multiplier"])
        return ModelConfig(
            family=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            max_position=int(hf.get("max_position_embeddings", 2048)),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6 if family.embed_scale else 1e-5)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", family.embed_scale)),
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=layer_types,
            rope_local_theta=float(rope_local_theta) if rope_local_theta else None,
            attn_scale=attn_scale,
            final_logit_softcap=hf.get("final_logit_softcapping"),
            attn_softcap=hf.get("attn_logit_softcapping"),
            nope_layers=_nope_layers(hf, num_layers),
            embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            logits_scaling=float(hf.get("logits_scaling", 1.0)),
            eos_token_ids=token_ids(hf.get("eos_token_id")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"config.json is missing or has a bad value for {exc}") from exc


def _rope(hf: dict[str, Any]) -> tuple[Any, dict[str, Any] | None, Any]:
    """The config's RoPE base, scaling (None for none) and local layers' base, from the fields
    of transformers < 5 or its `rope_parameters` (per attention type for Gemma 3)."""
    rope_scaling = hf.get("rope_scaling") or None
    rope_theta = hf.get("rope_theta")
    rope_params = hf.get("rope_parameters")  # transformers >= 5 stores RoPE settings here
    rope_local_theta = hf.get("rope_local_base_freq")
    if isinstance(rope_params, dict):
        if "full_attention" in rope_params:  # per attention type (Gemma 3)
            local = rope_params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ModelFormatError("rope scaling on sliding-window layers is not supported")
            rope_local_theta = local.get("rope_theta", rope_local_theta)
            rope_params = rope_params["full_attention"]
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
        None,
        "default",
    ):
        rope_scaling = None
    return rope_theta, rope_scaling, rope_local_theta


def _nope_layers(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers without RoPE: SmolLM3's `no_rope_layers` (1 = RoPE, 0 = none), else every
    `no_rope_layer_interval`-th layer."""
    if hf.get("model_type") != "smollm3":
        return ()
    flags = hf.get("no_rope_layers")
    if not flags:
        interval = int(hf.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ModelFormatError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(i for i, flag in enumerate(flags) if not flag)


def _layer_types(hf: dict[str, Any], family: Family, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention type; configs written before transformers 4.53 give a pattern."""
    layer_types = tuple(hf.get("layer_types") or ())
    if not layer_types and family.sliding_everywhere and hf.get("sliding_window"):
        return ("sliding_attention",) * num_layers
    pattern = hf.get("sliding_window_pattern", family.sliding_window_pattern)
    if not layer_types and pattern:
        layer_types = tuple(
            "full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
            for i in range(num_layers)
        )
    return layer_types
