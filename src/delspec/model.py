"""A layer-addressable decoder-only transformer with a static, position-indexed KV cache.

Primitives only: `embed`, `run_layers` over any contiguous layer range (optionally on int8 copies
of the weights, for drafts), and `head` (final norm + LM head). Batch size is 1 and hidden states
are `[tokens, hidden]`. Writing position p into the cache overwrites whatever was there, and
attention at p sees exactly positions 0..p, so rejected draft positions never need cropping.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from delspec.architectures import ModelConfig
from delspec.errors import ContextLengthError, ModelFormatError

# Float32 CPU products with up to this many rows run as `weight @ x.T` with two to four
# columns. MKL's matrix-vector kernel (one row) and its general kernel at a few rows reach about
# a third of the memory bandwidth that its two-to-four-column kernel reaches on the CPUs we
# measured, and decoding is bound by streaming the weights. Up to twice as many rows run as two
# such products, which still beats the general kernel. See `linear`.
NARROW_ROWS = 4
# Float32 CPU products of this many rows go through a weight copy prepacked by oneDNN
# (`Linear`): measured faster than `linear` from three rows on, for layers and LM heads alike.
# Longer products (prefills) are compute-bound and stay with `F.linear`.
PACKED_ROWS = range(3, 33)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T (+ bias)` for `x` of shape `[..., in]`, fast at decode-sized inputs.

    On CPU in float32 with 1..2 * NARROW_ROWS rows in all, this computes `weight @ x.T` over
    chunks of at most NARROW_ROWS rows (one row doubled to two): the same product through a
    kernel that streams the weight at full memory bandwidth. Everything else is `F.linear`.
    Results agree with `F.linear` to float32 rounding.
    """
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or x.dtype != torch.float32 or rows > 2 * NARROW_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, -1).contiguous()  # the fast kernel wants x.T column-major
    if rows == 1:
        flat = torch.cat([flat, flat])
    parts = [(weight @ chunk.T).T for chunk in flat.split(NARROW_ROWS)]
    out = (parts[0] if len(parts) == 1 else torch.cat(parts))[:rows]
    out = out.reshape(*x.shape[:-1], -1)
    return out if bias is None else out + bias


def _prepackable(x: Tensor, weight: Tensor) -> bool:
    """Whether oneDNN can take this product with a prepacked weight (CPU, float32, no grad)."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Int8Weight:
    """A weight-only int8 copy of a linear weight: symmetric, one scale per output row.

    Products take bfloat16 activations (the fast path of `torch._weight_int8pack_mm` on CPU and
    GPU) and return the input's dtype. A quarter of float32's bytes, so a memory-bound product
    runs several times faster; results are approximate, which is all a draft needs.
    """

    def __init__(self, weight: Tensor) -> None:
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.weight = (w / scale[:, None]).round().to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    def __getitem__(self, rows: slice) -> Int8Weight:
        """A range of output rows (views, no copy), as `weight[rows]` would be."""
        part = copy.copy(self)
        part.weight, part.scale = self.weight[rows], self.scale[rows]
        return part

    def __call__(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.weight, self.scale)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


@functools.cache
def int8_supported(device: torch.device) -> bool:
    """Whether this torch build runs `Int8Weight` products on `device` (a tiny trial)."""
    try:
        Int8Weight(torch.ones(8, 64, device=device))(torch.ones(1, 64, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Linear(nn.Linear):
    """`nn.Linear` computed by `linear`, with two derived copies of the weight made on first use
    (and again whenever the weight changes):

    - on CPU in float32, products of `PACKED_ROWS` rows go through a copy prepacked by oneDNN,
      whose cost barely grows with the row count: verifying several tokens then reads the
      weights about once (`linear` reads them once per NARROW_ROWS rows). This doubles the
      float32 weights' memory once such a product has run;
    - `forward(x, int8=True)` uses an `Int8Weight` copy (drafts only).
    """

    def forward(self, x: Tensor, int8: bool = False) -> Tensor:
        if int8:
            out = self.int8_weight()(x)
            return out if self.bias is None else out + self.bias
        if x.numel() // x.shape[-1] not in PACKED_ROWS or not _prepackable(x, self.weight):
            return linear(x, self.weight, self.bias)
        packed = self._copy("packed", _prepack)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def int8_weight(self) -> Int8Weight:
        """The int8 copy of the weight (made now if missing or stale)."""
        return self._copy("int8", Int8Weight)

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles leave the derived copies out
        return {k: v for k, v in self.__dict__.items() if k != "_copies"}

    def _copy(self, kind: str, make: Callable[[Tensor], Any]) -> Any:
        copies = self.__dict__.setdefault("_copies", {})
        weight = self.weight  # inference tensors have no version counter (nor in-place edits)
        key = (weight.device, weight.data_ptr(), 0 if weight.is_inference() else weight._version)
        cached = copies.get(kind)
        if cached is None or cached[0] != key:
            copies.pop(kind, None)  # free the stale copy first
            cached = copies[kind] = (key, make(self.weight.detach()))
        return cached[1]


def _prepack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 2 * NARROW_ROWS)


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32 at least, as the reference implementations do.

    The scale is `offset + weight`, with `weight` as stored in Hugging Face checkpoints. With an
    offset (Gemma) it is applied before casting back to the input dtype, otherwise after.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float32, torch.float64):  # one fused kernel, the same arithmetic
            scale = self.weight + self.offset if self.offset else self.weight
            return F.rms_norm(x, scale.shape, scale, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.to(xf.dtype))).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def rms_norm(config: ModelConfig, dim: int) -> RMSNorm:
    """An `RMSNorm` of `dim` features with the family's epsilon and weight offset."""
    return RMSNorm(dim, config.rms_eps, config.spec.norm_offset)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> Tensor:
    """Inverse RoPE frequencies (float32, as transformers computes them), with `scaling` (a
    transformers `rope_scaling` dict: linear or llama3) applied."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**steps)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        old_len = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelFormatError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def rope_table(inv_freq: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables `[length, head_dim]` in the rotate-half layout."""
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        spec = config.spec
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = rms_norm(config, config.head_dim) if spec.qk_norm else None
        self.k_norm = rms_norm(config, config.head_dim) if spec.qk_norm else None
        self.scale = config.softmax_scale

    def forward(
        self,
        x: Tensor,
        start: int,
        cache: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        int8: bool = False,
    ) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x, int8).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim).transpose(0, 1)
        k = k.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        end = start + n
        cache[0, :, start:end] = k
        cache[1, :, start:end] = v
        keys, values = cache[0, :, :end], cache[1, :, :end]
        # Grouped-query attention without copying keys: fold each group's heads into rows.
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(self.num_kv_heads, group * n, self.head_dim)
        if mask is not None and group > 1:
            mask = mask.repeat(group, 1)
        # 4-D inputs take the fused CPU kernel (3-D ones the slower reference path).
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, scale=self.scale
        )
        out = out.reshape(self.num_heads, n, self.head_dim).transpose(0, 1).reshape(n, -1)
        return self.o(out, int8)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gelu = config.spec.activation == "gelu_tanh"

    def forward(self, x: Tensor, int8: bool = False) -> Tensor:
        gate, up = self.gate_up(x, int8).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(gate * up, int8)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, sandwich = config.hidden_size, config.spec.sandwich_norm
        self.attn_norm = rms_norm(config, dim)
        self.attn = Attention(config)
        self.post_attn_norm = rms_norm(config, dim) if sandwich else None
        self.mlp_norm = rms_norm(config, dim)
        self.mlp = MLP(config)
        self.post_mlp_norm = rms_norm(config, dim) if sandwich else None

    def forward(self, x, start, cache, cos, sin, mask, int8=False) -> Tensor:
        a = self.attn(self.attn_norm(x), start, cache, cos, sin, mask, int8)
        x = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        m = self.mlp(self.mlp_norm(x), int8)
        return x + (m if self.post_mlp_norm is None else self.post_mlp_norm(m))


class Transformer(nn.Module):
    """Decoder-only transformer addressable by layer range. See the module docstring."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = rms_norm(config, config.hidden_size)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embedding.weight
        self.cache: Tensor | None = None  # [layers, 2, kv_heads, length, head_dim]
        self._rope: dict[bool, tuple[Tensor, Tensor]] = {}

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    @property
    def cache_length(self) -> int:
        return 0 if self.cache is None else self.cache.shape[3]

    def make_int8_copies(self) -> None:
        """Make every layer's int8 weight copies now, rather than in the first int8 run."""
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.int8_weight()

    def setup_cache(self, length: int) -> None:
        """Allocate (or reuse, if large enough) a KV cache for positions 0..length-1."""
        cfg = self.config
        if length > cfg.max_position:
            raise ContextLengthError(
                f"{length} positions exceed the model's context of {cfg.max_position} tokens"
            )
        reusable = self.cache is not None and self.cache_length >= length
        # A cache made under torch.inference_mode cannot be written outside it (and vice versa).
        if reusable and self.cache.is_inference() == torch.is_inference_mode_enabled():
            return
        shape = (cfg.num_layers, 2, cfg.num_kv_heads, length, cfg.head_dim)
        self.cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        local = cfg.rope_local_theta
        tables = {False: cfg.rope_theta, True: local if local is not None else cfg.rope_theta}
        self._rope = {
            sliding: tuple(
                t.to(self.device)
                for t in rope_table(self._inv_freq(theta, sliding), length, self.dtype)
            )
            for sliding, theta in tables.items()
        }

    def _inv_freq(self, theta: float, sliding: bool) -> Tensor:
        # Gemma 3's local layers use the plain RoPE base without the global layers' scaling.
        scaling = None if sliding else self.config.rope_scaling
        return rope_inv_freq(self.config.head_dim, theta, scaling)

    def embed(self, ids: Tensor) -> Tensor:
        """Token ids `[tokens]` -> hidden states `[tokens, hidden]`."""
        h = self.embedding(ids)
        if self.config.spec.embed_scale:  # rounded to float32 first, as transformers does
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(h.dtype)
        return h

    def _mask(self, start: int, n: int, window: int | None) -> Tensor | None:
        end = start + n
        if n == 1 and (window is None or end <= window):
            return None
        rows = torch.arange(start, end, device=self.device)[:, None]
        cols = torch.arange(end, device=self.device)[None, :]
        allowed = cols <= rows
        if window is not None:
            allowed &= cols > rows - window
        return allowed

    def run_layers(
        self,
        h: Tensor,
        start: int,
        first: int,
        last: int,
        collect: list[Tensor] | None = None,
        int8: bool = False,
    ) -> Tensor:
        """Run layers `[first, last)` on the states of positions `start..start+len(h)-1`.

        Writes those positions' keys and values into each layer's cache. If `collect` is a list,
        every layer's output is appended to it. `int8` runs the layers' products on int8 copies
        of their weights (`Int8Weight`): approximate states and cache entries, for drafts only.
        """
        n = h.shape[0]
        if self.cache is None or start + n > self.cache_length:
            raise ContextLengthError(
                f"position {start + n - 1} is beyond the KV cache of {self.cache_length} positions"
            )
        cfg = self.config
        masks = {False: self._mask(start, n, None)}
        if cfg.sliding_window is not None:
            masks[True] = self._mask(start, n, cfg.sliding_window)
        ropes = {
            s: (c[start : start + n], si[start : start + n]) for s, (c, si) in self._rope.items()
        }
        for i in range(first, last):
            sliding = cfg.is_sliding(i)
            cos, sin = ropes[sliding]
            h = self.layers[i](h, start, self.cache[i], cos, sin, masks[sliding], int8)
            if collect is not None:
                collect.append(h)
        return h

    def head(
        self, h: Tensor, weight: Tensor | Int8Weight | None = None, int8: bool = False
    ) -> Tensor:
        """Final norm + LM head -> logits. `weight` may be a row subset of the LM head; without
        one, `int8` uses the LM head's int8 copy."""
        return self.project(self.norm(h), weight, int8)

    def project(
        self, n: Tensor, weight: Tensor | Int8Weight | None = None, int8: bool = False
    ) -> Tensor:
        """LM head (+ final logit soft-capping) on already normalised states `n`."""
        if weight is None:
            logits = self.lm_head(n, int8)
        elif isinstance(weight, Int8Weight):
            logits = weight(n)
        else:
            logits = linear(n, weight)
        return self.softcap(logits)

    def softcap(self, logits: Tensor) -> Tensor:
        """Final logit soft-capping, for models that have it (the identity otherwise)."""
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        """Full pass over `ids` at positions `start..`: logits `[tokens, vocab]`."""
        return self.head(self.run_layers(self.embed(ids), start, 0, self.num_layers))

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load weights named as in a Hugging Face checkpoint, checking every shape."""
        cfg, spec = self.config, self.config.spec
        state = {_strip_prefix(k): v for k, v in state.items()}

        def take(name: str) -> Tensor:
            if name not in state:
                raise ModelFormatError(f"weight {name!r} is missing from the checkpoint")
            return state[name]

        def put(param: Tensor, value: Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ModelFormatError(
                    f"weight {name!r} has shape {tuple(value.shape)}, "
                    f"but the config implies {tuple(param.shape)}"
                )
            param.copy_(value.to(param.dtype))

        put(self.embedding.weight, take("embed_tokens.weight"), "embed_tokens.weight")
        put(self.norm.weight, take("norm.weight"), "norm.weight")
        if not cfg.tie_embeddings:
            put(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        mlp_norm = "pre_feedforward_layernorm" if spec.sandwich_norm else "post_attention_layernorm"
        for i, block in enumerate(self.layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            qkv = [take(a + f"{x}_proj.weight") for x in "qkv"]
            put(block.attn.qkv.weight, torch.cat(qkv), a + "qkv_proj.weight")
            if spec.qkv_bias:
                bias = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"])
                put(block.attn.qkv.bias, bias, a + "qkv_proj.bias")
            put(block.attn.o.weight, take(a + "o_proj.weight"), a + "o_proj.weight")
            if spec.qk_norm:
                put(block.attn.q_norm.weight, take(a + "q_norm.weight"), a + "q_norm")
                put(block.attn.k_norm.weight, take(a + "k_norm.weight"), a + "k_norm")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            put(block.mlp.gate_up.weight, gate_up, p + "mlp.gate_up_proj.weight")
            put(block.mlp.down.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
            name = p + "input_layernorm.weight"
            put(block.attn_norm.weight, take(name), name)
            put(block.mlp_norm.weight, take(p + mlp_norm + ".weight"), p + mlp_norm)
            if spec.sandwich_norm:
                name = p + "post_attention_layernorm.weight"
                put(block.post_attn_norm.weight, take(name), name)
                name = p + "post_feedforward_layernorm.weight"
                put(block.post_mlp_norm.weight, take(name), name)


def _strip_prefix(name: str) -> str:
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def build_model(
    config: ModelConfig,
    state: dict[str, Tensor] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Transformer:
    """Create a `Transformer` (random init when `state` is None) in eval mode on `device`."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_embeddings:
        model.lm_head.weight = model.embedding.weight
    if state is None:
        model.apply(_init_random)
    else:
        model.load_hf_state_dict(state)
    return model.eval().requires_grad_(False)


def _init_random(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.normal_(module.bias, std=0.02)
    elif isinstance(module, RMSNorm):
        nn.init.constant_(module.weight, 1.0 - module.offset)
