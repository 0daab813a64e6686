"""A layer-addressable decoder-only transformer with a static, position-indexed KV cache.

Primitives only: `embed`, `run_layers` over any contiguous layer range (optionally on int8 copies
of the weights, for drafts), and `head` (final norm + LM head). Batch size is 1 and hidden states
are `[tokens, hidden]`. The linear weights and the embedding are float tensors, or (weight formats
`native` and `int8`) `BlockWeight`s: GGUF blocks multiplied by the compiled kernels, with no float
copy kept. Writing position p into the cache overwrites whatever was there, and
attention at p sees exactly positions 0..p, so rejected draft positions never need cropping.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from delspec.architectures import ModelConfig
from delspec.errors import ContextLengthError, ModelFormatError
from delspec.kernels import attention, layer_ops
from delspec.kernels.blocks import BlockWeight
from delspec.kernels.layers import LayerKernels
from delspec.kernels.products import (
    BLOCK_KERNELS,
    FLOAT_KERNELS,
    Int8Weight,
    narrow_product,
    packed_product,
    prepack,
    prepackable,
    row_bucket,
)

# The weight formats a model can be held in (see `Transformer.weights`).
WEIGHT_FORMATS = ("native", "int8", "float")


class Linear(nn.Linear):
    """`nn.Linear` computed by one of the product kernels of `delspec.kernels.products`:
    the one measured fastest on this machine for the product's row count (`kernels`, set by
    `delspec.kernel_choice`), plain `F.linear` (or the block kernel) until measured. With
    `blocks` (a `BlockWeight`, which then replaces `weight`) the products run on GGUF blocks.
    Derived copies of a float weight (oneDNN-prepacked, int8) are made on first use and again
    whenever the weight changes; `forward(x, int8=True)` uses the int8 copy (drafts only).
    """

    blocks: BlockWeight | None = None
    kernels: dict[int, str] | None = None  # per row bucket (`row_bucket`): the kernel chosen

    def forward(self, x: Tensor, int8: bool = False) -> Tensor:
        if int8 and self.blocks is None:
            out = self.int8_weight()(x)
            return out if self.bias is None else out + self.bias
        kernel = self.kernels.get(row_bucket(x.numel() // x.shape[-1])) if self.kernels else None
        return self.compute(x, kernel)

    def candidates(self, x: Tensor) -> tuple[str, ...]:
        """The kernels that can compute this layer's product with `x`. Block weights have one
        at every size: its rows are exact whatever their number, which is what makes a
        verification of k tokens agree with k plain steps (no other kernel may take over for
        some sizes, since a verification can be as long as a draft)."""
        if self.blocks is not None:
            return BLOCK_KERNELS
        return FLOAT_KERNELS if prepackable(x, self.weight) else FLOAT_KERNELS[:2]

    def compute(self, x: Tensor, kernel: str | None = None) -> Tensor:
        """The product through `kernel` (one of `candidates`; None: the default)."""
        if self.blocks is not None:
            out = self.blocks(x)
        elif kernel == "narrow":
            out = narrow_product(x, self.weight)
        elif kernel == "packed" and prepackable(x, self.weight):
            out = packed_product(x, self._copy("packed", prepack))
        else:
            out = F.linear(x, self.weight)
        return out if self.bias is None else out + self.bias

    def drop_copy(self, kind: str) -> None:
        """Free a derived copy of the weight ("packed" or "int8"), if made."""
        self.__dict__.get("_copies", {}).pop(kind, None)

    def int8_weight(self) -> Int8Weight | BlockWeight:
        """The int8 copy of the weight (made now if missing or stale); block weights are
        their own cheap copy."""
        if self.blocks is not None:
            return self.blocks
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
        if layer_ops.available(x):  # one compiled call (torch's rms_norm is several ops)
            return layer_ops.rms_norm(x, self.weight, self.eps, self.offset)
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
    """Grouped-query attention with RoPE over the layer's KV cache. On CPU in float32 it is
    row-exact (`kernels.attention`): a position's result does not depend on how many positions
    are computed with it, so verification and plain steps agree bit for bit."""

    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # a sliding window's length, or None
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
        n, end = x.shape[0], start + x.shape[0]
        qkv = self.qkv(x, int8)
        if attention.available(qkv, self.head_dim):
            norms = None
            if self.q_norm is not None:
                q_norm, k_norm = self.q_norm, self.k_norm
                norms = (q_norm.weight, k_norm.weight, q_norm.eps, q_norm.offset)
            out = attention.fused_attention(
                qkv, cos, sin, cache, start, self.num_heads, self.window, self.scale, norms
            )
            return self.o(out, int8)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim).transpose(0, 1)
        k = k.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
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
        gate_up = self.gate_up(x, int8)
        if layer_ops.available(gate_up):
            return self.down(layer_ops.gated(gate_up, self.gelu), int8)
        gate, up = gate_up.chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(gate * up, int8)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        dim, sandwich = config.hidden_size, config.spec.sandwich_norm
        self.attn_norm = rms_norm(config, dim)
        self.attn = Attention(config, window)
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
        self.layers = nn.ModuleList(
            Block(config, config.sliding_window if config.is_sliding(i) else None)
            for i in range(config.num_layers)
        )
        self.norm = rms_norm(config, config.hidden_size)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embedding.weight
        self.cache: Tensor | None = None  # [layers, 2, slots, kv_heads, length, head_dim]
        self._rope: dict[bool, tuple[Tensor, Tensor]] = {}
        self.embed_blocks: BlockWeight | None = None  # replaces embedding.weight when set
        self.weights = "float"  # the weight format: one of WEIGHT_FORMATS
        # (what it was bound to, the layers as one compiled call or None): see compiled_layers
        self._layer_binding: tuple[tuple[int, ...], LayerKernels | None] | None = None

    def use_blocks(self, blocks: dict[str, BlockWeight], weights: str) -> None:
        """Hold the listed weights as blocks: `blocks` maps a `Linear`'s module name (or
        "embedding") to its weight, whose float parameter is dropped. A tied LM head follows
        the embedding."""
        for name, weight in blocks.items():
            module = self.embedding if name == "embedding" else self.get_submodule(name)
            if tuple(weight.shape) != tuple(module.weight.shape):
                raise ModelFormatError(
                    f"weight {name!r} has shape {tuple(weight.shape)}, "
                    f"but the config implies {tuple(module.weight.shape)}"
                )
            module.weight = None
            if name == "embedding":
                self.embed_blocks = weight
                if self.config.tie_embeddings:
                    self.lm_head.weight, self.lm_head.blocks = None, weight
            else:
                module.blocks = weight
        self.weights = weights

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def block_weights(self) -> list[BlockWeight]:
        """The weights held as blocks, each once."""
        held = [self.embed_blocks] + [getattr(m, "blocks", None) for m in self.modules()]
        return list({id(b): b for b in held if b is not None}.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights take as held (float parameters and blocks)."""
        floats = sum(p.numel() * p.element_size() for p in self.parameters())
        return floats + sum(b.nbytes for b in self.block_weights)

    @property
    def parameter_count(self) -> int:
        """Weights in the model, however they are held."""
        floats = sum(p.numel() for p in self.parameters())
        return floats + sum(b.rows * b.cols for b in self.block_weights)

    @property
    def head_weight(self) -> Tensor | BlockWeight:
        """The LM head's weight `[vocab, hidden]`, as held (float or blocks)."""
        return self.lm_head.weight if self.lm_head.blocks is None else self.lm_head.blocks

    def head_rows(self, tokens: Tensor | None = None) -> Tensor:
        """The float LM head rows of `tokens` (all rows when None)."""
        if self.lm_head.blocks is None:
            return self.lm_head.weight if tokens is None else self.lm_head.weight[tokens]
        rows = self.lm_head.blocks.dequantize(tokens, self.dtype)
        return rows.to(self.device)

    def embedding_rows(self, tokens: Tensor) -> Tensor:
        """The float embedding rows of `tokens`."""
        if self.embed_blocks is None:
            return self.embedding(tokens)
        return self.embed_blocks.dequantize(tokens, self.dtype).to(self.device)

    @property
    def cache_length(self) -> int:
        """Positions each cache slot holds."""
        return 0 if self.cache is None else self.cache.shape[4]

    @property
    def cache_slots(self) -> int:
        """Sequences the cache holds at once (one slot each)."""
        return 0 if self.cache is None else self.cache.shape[2]

    def make_int8_copies(self) -> None:
        """Make every layer's int8 weight copies now, rather than in the first int8 run."""
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.int8_weight()

    def setup_cache(self, length: int, slots: int = 1) -> None:
        """Allocate (or reuse, if large enough) a KV cache of `slots` sequences with positions
        0..length-1 each."""
        cfg = self.config
        if length > cfg.max_position:
            raise ContextLengthError(
                f"{length} positions exceed the model's context of {cfg.max_position} tokens"
            )
        reusable = (
            self.cache is not None and self.cache_length >= length and self.cache_slots >= slots
        )
        # A cache made under torch.inference_mode cannot be written outside it (and vice versa).
        if reusable and self.cache.is_inference() == torch.is_inference_mode_enabled():
            return
        shape = (cfg.num_layers, 2, slots, cfg.num_kv_heads, length, cfg.head_dim)
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
        self._layer_binding = None

    @contextlib.contextmanager
    def scratch_cache(self, length: int, slots: int = 1) -> Iterator[None]:
        """Within the block, a fresh cache of `slots` sequences of `length` positions (for
        timing work); the model's own cache, and the sequences in it, come back after."""
        saved = self.cache, self._rope, self._layer_binding
        self.cache = None
        try:
            self.setup_cache(length, slots)
            yield
        finally:
            self.cache, self._rope, self._layer_binding = saved

    def compiled_layers(self) -> LayerKernels | None:
        """The layers as one compiled call bound to this cache (block weights in float32 on
        CPU), or None. Bound again after the cache, the device or the dtype changed."""
        key = (
            self.cache.data_ptr(),
            self.norm.weight.data_ptr(),
            self.layers[0].attn_norm.weight.data_ptr(),
        )
        if self._layer_binding is None or self._layer_binding[0] != key:
            compiled = LayerKernels.for_model(self)
            if compiled is not None:
                compiled.bind(self.cache, self._rope)
            self._layer_binding = (key, compiled)
        return self._layer_binding[1]

    def __getstate__(self) -> dict[str, Any]:  # a copy binds its own cache and weights
        return {**self.__dict__, "_layer_binding": None}

    def _inv_freq(self, theta: float, sliding: bool) -> Tensor:
        # Gemma 3's local layers use the plain RoPE base without the global layers' scaling.
        scaling = None if sliding else self.config.rope_scaling
        return rope_inv_freq(self.config.head_dim, theta, scaling)

    def embed(self, ids: Tensor) -> Tensor:
        """Token ids `[tokens]` -> hidden states `[tokens, hidden]`."""
        h = self.embedding_rows(ids)
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
        slot: int = 0,
    ) -> Tensor:
        """Run layers `[first, last)` on the states of positions `start..start+len(h)-1` of the
        sequence in cache slot `slot`.

        Writes those positions' keys and values into each layer's cache. If `collect` is a list,
        every layer's output is appended to it. `int8` runs the layers' products on int8 copies
        of their weights (`Int8Weight`): approximate states and cache entries, for drafts only.
        """
        n = h.shape[0]
        self._check_room(start + n - 1, slot)
        compiled = None if int8 else self.compiled_layers()
        if compiled is not None:
            return compiled.run(h, list(range(start, start + n)), [slot] * n, first, last, collect)
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
            cache = self.cache[i, :, slot]
            h = self.layers[i](h, start, cache, cos, sin, masks[sliding], int8)
            if collect is not None:
                collect.append(h)
        return h

    def run_rows(
        self, h: Tensor, positions: list[int], slots: list[int], first: int, last: int
    ) -> Tensor:
        """Run layers `[first, last)` on rows of several sequences at once: row r is position
        `positions[r]` of the sequence in cache slot `slots[r]` (a batched decode step). Each
        row's result has the bits it would have computed alone (compiled layers: one call for
        all rows; otherwise one `run_layers` per run of one sequence's consecutive positions)."""
        for position, slot in zip(positions, slots, strict=True):
            self._check_room(position, slot)
        compiled = self.compiled_layers()
        if compiled is not None:
            return compiled.run(h, positions, slots, first, last, None)
        out, r = [], 0
        while r < len(positions):  # runs of one sequence's consecutive positions, one call each
            end = r + 1
            while (
                end < len(positions)
                and slots[end] == slots[r]
                and positions[end] == positions[r] + end - r
            ):
                end += 1
            out.append(self.run_layers(h[r:end], positions[r], first, last, slot=slots[r]))
            r = end
        return torch.cat(out)

    def _check_room(self, position: int, slot: int) -> None:
        if self.cache is None or position >= self.cache_length:
            raise ContextLengthError(
                f"position {position} is beyond the KV cache of {self.cache_length} positions"
            )
        if not 0 <= slot < self.cache_slots:
            raise ContextLengthError(
                f"slot {slot} is beyond the KV cache's {self.cache_slots} sequence slot(s)"
            )

    def head(
        self, h: Tensor, weight: Tensor | Int8Weight | BlockWeight | None = None, int8: bool = False
    ) -> Tensor:
        """Final norm + LM head -> logits. `weight` may be a row subset of the LM head; without
        one, `int8` uses the LM head's int8 copy."""
        return self.project(self.norm(h), weight, int8)

    def project(
        self, n: Tensor, weight: Tensor | Int8Weight | BlockWeight | None = None, int8: bool = False
    ) -> Tensor:
        """LM head (+ final logit soft-capping) on already normalised states `n`."""
        if weight is None:
            logits = self.lm_head(n, int8)
        elif isinstance(weight, Int8Weight | BlockWeight):
            logits = weight(n)
        else:  # float rows of the head: the kernel chosen for the head's products of that size
            kernels = self.lm_head.kernels or {}
            rows = n.numel() // n.shape[-1]
            if kernels.get(row_bucket(rows)) == "narrow":
                logits = narrow_product(n, weight)
            else:
                logits = F.linear(n, weight)
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
        """Load weights named as in a Hugging Face checkpoint, checking every shape. Weights held
        as blocks (`use_blocks`) are neither read nor needed."""
        cfg, spec = self.config, self.config.spec
        state = {strip_prefix(k): v for k, v in state.items()}

        def put(param: Tensor | None, names: tuple[str, ...], label: str) -> None:
            if param is None:  # held as blocks
                return
            missing = [name for name in names if name not in state]
            if missing:
                raise ModelFormatError(f"weight {missing[0]!r} is missing from the checkpoint")
            value = torch.cat([state[name] for name in names])
            if tuple(param.shape) != tuple(value.shape):
                raise ModelFormatError(
                    f"weight {label!r} has shape {tuple(value.shape)}, "
                    f"but the config implies {tuple(param.shape)}"
                )
            param.copy_(value.to(param.dtype))

        def load(param: Tensor | None, name: str) -> None:
            put(param, (name,), name)

        load(self.embedding.weight, "embed_tokens.weight")
        load(self.norm.weight, "norm.weight")
        if not cfg.tie_embeddings:
            load(self.lm_head.weight, "lm_head.weight")
        mlp_norm = "pre_feedforward_layernorm" if spec.sandwich_norm else "post_attention_layernorm"
        for i, block in enumerate(self.layers):
            p = f"layers.{i}."
            for module, parts in FUSED_LINEARS.items():
                linear = block.get_submodule(module)
                fused = f"{parts[0].split('.')[0]}.{module.split('.')[1]}_proj"
                label = f"{p}{parts[0] if len(parts) == 1 else fused}.weight"
                put(linear.weight, tuple(f"{p}{x}.weight" for x in parts), label)
            if spec.qkv_bias:
                names = tuple(f"{p}self_attn.{x}_proj.bias" for x in "qkv")
                put(block.attn.qkv.bias, names, p + "self_attn.qkv_proj.bias")
            if spec.qk_norm:
                load(block.attn.q_norm.weight, p + "self_attn.q_norm.weight")
                load(block.attn.k_norm.weight, p + "self_attn.k_norm.weight")
            load(block.attn_norm.weight, p + "input_layernorm.weight")
            load(block.mlp_norm.weight, p + mlp_norm + ".weight")
            if spec.sandwich_norm:
                load(block.post_attn_norm.weight, p + "post_attention_layernorm.weight")
                load(block.post_mlp_norm.weight, p + "post_feedforward_layernorm.weight")


# The Hugging Face weights that each fused linear layer of a block is made of, in row order.
FUSED_LINEARS = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.o": ("self_attn.o_proj",),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}


def strip_prefix(name: str) -> str:
    """A Hugging Face weight name without its model prefix (`model.`, ...)."""
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
    blocks: dict[str, BlockWeight] | None = None,
    weights: str = "float",
) -> Transformer:
    """Create a `Transformer` (random init when `state` is None) in eval mode on `device`, with
    the weights in `blocks` held as blocks (see `Transformer.use_blocks`) in format `weights`."""
    with torch.device("meta"):
        model = Transformer(config)
    if blocks:
        model.use_blocks(blocks, weights)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_embeddings and model.embed_blocks is None:
        model.lm_head.weight = model.embedding.weight
    if state is None:
        model.apply(_init_random)
    else:
        model.load_hf_state_dict(state)
    return model.eval().requires_grad_(False)


def _init_random(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding) and module.weight is not None:
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.normal_(module.bias, std=0.02)
    elif isinstance(module, RMSNorm):
        nn.init.constant_(module.weight, 1.0 - module.offset)
