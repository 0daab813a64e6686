"""A layer-addressable decoder-only transformer with a static, position-indexed KV cache.

Primitives only: `embed`, `run_layers` over any contiguous layer range of one sequence
(optionally on int8 copies of the weights, for drafts), `run_rows` (rows of several sequences in
their cache slots), and `head` (final norm + LM head). Hidden states are `[tokens, hidden]`. The
linear weights and the embedding are float tensors, or (weight formats `native` and `int8`)
`BlockWeight`s: GGUF blocks multiplied by the compiled kernels, with no float copy kept. Writing
position p into the cache overwrites whatever was there, and attention at p sees exactly
positions 0..p, so rejected draft positions never need cropping. The modules it is made of are
in `delspec.model.modules`; loading checkpoint weights into it, in `delspec.weights.checkpoint`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from delspec.errors import ContextLengthError, ModelFormatError
from delspec.kernels.blocks import BlockWeight
from delspec.kernels.layers import SPLIT_ROWS, LayerKernels
from delspec.kernels.products import (
    Int8Weight,
    narrow_product,
    row_bucket,
)
from delspec.model.architectures import ModelConfig
from delspec.model.modules import Block, Linear, rms_norm, rope_inv_freq, rope_table

# The weight formats a model can be held in (see `Transformer.weights`).
WEIGHT_FORMATS = ("native", "int8", "float")


class Transformer(nn.Module):
    """Decoder-only transformer addressable by layer range. See the module docstring."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # left uninitialised (build_model loads or initialises it): nn.Embedding's own random
        # init, on the meta device build_model makes it on, imports torch._dynamo (slow)
        shape = (config.vocab_size, config.hidden_size)
        self.embedding = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(
            Block(config, config.sliding_window if config.is_sliding(i) else None)
            for i in range(config.num_layers)
        )
        self.norm = rms_norm(config, config.hidden_size)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embedding.weight
        self.cache: Tensor | None = None  # [layers, 2, slots, kv_heads, length, head_dim]
        self._rope: dict[str, tuple[Tensor, Tensor]] = {}  # by `rope_kind`
        self.embed_blocks: BlockWeight | None = None  # replaces embedding.weight when set
        self.weights = "float"  # the weight format: one of WEIGHT_FORMATS
        # prompts of at least this many rows run on bfloat16 tiles (kernel_choice), None: never
        self.prompt_tiles_from: int | None = None
        # per tiles or not, compiled calls of at least this many rows split their per-row steps
        # between the threads (kernel_choice)
        self.split_rows_from = dict(SPLIT_ROWS)
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

    def embedding_rows(self, tokens: Tensor | Sequence[int]) -> Tensor:
        """The float embedding rows of `tokens` (a tensor or a list of ids)."""
        device = self.device
        if self.embed_blocks is None:
            return self.embedding(torch.as_tensor(tokens, device=device))
        rows = self.embed_blocks.dequantize(tokens, self.dtype)
        return rows if device.type == "cpu" else rows.to(device)

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
        self._use_cache(torch.zeros(shape, dtype=self.dtype, device=self.device))

    def _use_cache(self, cache: Tensor) -> None:
        """Make `cache` the KV cache, with RoPE tables of its length."""
        cfg = self.config
        self.cache = cache
        kinds = {cfg.rope_kind(i) for i in range(cfg.num_layers)}
        self._rope = {kind: self._rope_table(kind, cache.shape[4]) for kind in kinds}
        self._layer_binding = None

    @contextlib.contextmanager
    def swapped_cache(self, cache: Tensor) -> Iterator[None]:
        """Within the block, `cache` (`[layers, 2, slots, kv_heads, length, head_dim]`, made as
        `setup_cache` makes one) is the KV cache: a library session keeps its sequence's cache
        between calls this way. The model's own cache comes back after; a cache `setup_cache`
        makes meanwhile is left in `self.cache` until then."""
        saved = self.cache, self._rope, self._layer_binding
        try:
            self._use_cache(cache)
            yield
        finally:
            self.cache, self._rope, self._layer_binding = saved

    @property
    def rows_exact(self) -> bool:
        """Whether each row's bits are its own, whatever rows run with it and however its
        prompt was split into chunks (the compiled layers run this model): then positions
        cached for one prompt can stand in for another prompt's with the same tokens."""
        if self.cache is not None:
            return self.compiled_layers() is not None
        return LayerKernels.for_model(self) is not None

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

    def on_tiles(self, prompt_rows: int) -> bool:
        """Whether a prompt of `prompt_rows` rows (all but its last token) runs its products on
        bfloat16 tiles: from `prompt_tiles_from` rows on, the count from which they were
        measured to pay on this machine (`kernel_choice`)."""
        return self.prompt_tiles_from is not None and prompt_rows >= self.prompt_tiles_from

    def __getstate__(self) -> dict[str, Any]:  # a copy binds its own cache and weights
        return {**self.__dict__, "_layer_binding": None}

    def _rope_table(self, kind: str, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin `[length, head_dim]` of a `ModelConfig.rope_kind`. Gemma 3's local layers
        use their own base without the global layers' scaling; "none" rotates by nothing."""
        cfg = self.config
        if kind == "none":
            inv_freq = torch.zeros(cfg.head_dim // 2)
        elif kind == "local":
            local = cfg.rope_local_theta
            inv_freq = rope_inv_freq(cfg.head_dim, local if local is not None else cfg.rope_theta)
        else:
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return tuple(t.to(self.device) for t in rope_table(inv_freq, length, self.dtype))

    def embed(self, ids: Tensor | Sequence[int]) -> Tensor:
        """Token ids `[tokens]` (a tensor, or a list: GGUF embeddings then look them up with no
        torch operation) -> hidden states `[tokens, hidden]`."""
        h = self.embedding_rows(ids)
        if self.config.spec.embed_scale:  # rounded to float32 first, as transformers does
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(h.dtype)
        if self.config.embedding_multiplier != 1.0:
            h = h * self.config.embedding_multiplier
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
        tiles: bool = False,
    ) -> Tensor:
        """Run layers `[first, last)` on the states of positions `start..start+len(h)-1` of the
        sequence in cache slot `slot`.

        Writes those positions' keys and values into each layer's cache. If `collect` is a list,
        every layer's output is appended to it. `int8` runs the layers' products on int8 copies
        of their weights (`Int8Weight`): approximate states and cache entries, for drafts only.
        `tiles`: the rows are a prompt's that `on_tiles` sends to bfloat16 tiles (compiled layers
        only; other bits than the 8-bit path's, so every row of that prompt must take it).
        """
        n = h.shape[0]
        self._check_room(start + n - 1, slot)
        if first == last:  # no layer (a verification of drafts from the final layer)
            return h
        compiled = None if int8 else self.compiled_layers()
        if compiled is not None:
            positions = list(range(start, start + n))
            return compiled.run(h, positions, [slot] * n, first, last, collect, tiles=tiles)
        cfg = self.config
        masks = {False: self._mask(start, n, None)}
        if cfg.sliding_window is not None:
            masks[True] = self._mask(start, n, cfg.sliding_window)
        ropes = {
            s: (c[start : start + n], si[start : start + n]) for s, (c, si) in self._rope.items()
        }
        for i in range(first, last):
            cos, sin = ropes[cfg.rope_kind(i)]
            cache = self.cache[i, :, slot]
            h = self.layers[i](h, start, cache, cos, sin, masks[cfg.is_sliding(i)], int8)
            if collect is not None:
                collect.append(h)
        return h

    def run_rows(
        self,
        h: Tensor,
        positions: list[int],
        slots: list[int],
        first: int,
        last: int,
        tiles: bool = False,
    ) -> Tensor:
        """Run layers `[first, last)` on rows of several sequences at once: row r is position
        `positions[r]` of the sequence in cache slot `slots[r]` (a batched decode step). Each
        row's result has the bits it would have computed alone (compiled layers: one call for
        all rows; otherwise one `run_layers` per run of one sequence's consecutive positions).
        `tiles`: as for `run_layers`, for every row."""
        for position, slot in zip(positions, slots, strict=True):
            self._check_room(position, slot)
        compiled = self.compiled_layers()
        if compiled is not None:
            return compiled.run(h, positions, slots, first, last, None, tiles=tiles)
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
        """The final logits' scaling (Granite divides them) and soft-capping (Gemma), for models
        that have them (the identity otherwise)."""
        cfg = self.config
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        cap = cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        """Full pass over `ids` at positions `start..`: logits `[tokens, vocab]`."""
        return self.head(self.run_layers(self.embed(ids), start, 0, self.num_layers))
