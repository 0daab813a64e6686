"""A model's layers run by one compiled call per layer range (`layers.c`), for models whose
linear weights are all tiled GGUF blocks, in float32 on a CPU.

`LayerKernels.for_model` describes the model's weights to the C code once (pointers to the
tiles, norms and biases); `bind` adds the KV cache and RoPE tables whenever they are allocated;
`run` is then `Transformer.run_layers` without a Python call per operation.

The model layer builds on the kernels, so the model here is any `nn.Module` of its layout: a
`delspec.model.transformer.Transformer`, whose linear layers are `delspec.model.modules.Linear`.
"""

from __future__ import annotations

import ctypes
import time

import torch
from torch import Tensor, nn

from delspec.kernels.blocks import TILE
from delspec.kernels.build import library
from delspec.kernels.team import TEAM

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
MAX_PARTS = 3
# Calls of this many rows or more split their per-row steps between the threads, with and
# without tiles, until measured on the machine (`kernel_choice.measure_split_rows`).
SPLIT_ROWS = {False: 64, True: 64}
# The steps of a layer that `LayerKernels.run` can time (`layers.c`), in order.
STEPS = (
    "norm",
    "q/k/v projection",
    "attention (norms, RoPE, cache, scores)",
    "output projection",
    "residual + MLP norm",
    "gate/up projection + activation",
    "down projection",
    "residual",
)


class _Linear(ctypes.Structure):
    _fields_ = [
        ("parts", _INT),
        ("type", _INT * MAX_PARTS),
        ("tiles", _P * MAX_PARTS),
        ("rows", _I64 * MAX_PARTS),
        ("bias", _P),
        ("N", _I64),
        ("K", _I64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _Linear) for name in ("qkv", "o", "gate_up", "down")),
        *((name, _P) for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm")),
        *((name, _P) for name in ("q_norm", "k_norm", "keys", "values", "cos", "sin")),
        ("window", _I64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _INT) for name in ("hidden", "heads", "kv_heads", "dim", "intermediate", "gelu")),
        *((name, _F32) for name in ("eps", "norm_offset", "scale", "residual_scale")),
        ("attn_softcap", _F32),
        ("qk_norm_full", _INT),
        ("length", _I64),
        ("slot_stride", _I64),
        ("num_layers", _INT),
        ("layers", ctypes.POINTER(_Layer)),
    ]


def _pointer(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _linear(module: nn.Module) -> _Linear:
    blocks = module.blocks
    parts = blocks.parts
    out = _Linear(parts=len(parts), bias=_pointer(module.bias), N=blocks.rows, K=blocks.cols)
    for i, part in enumerate(parts):
        out.type[i], out.tiles[i], out.rows[i] = int(part.qtype), part.tiles.data_ptr(), part.rows
    return out


def _tiled(module: nn.Module) -> bool:
    """Whether the layer kernels can take this linear layer: block weights in at most
    `MAX_PARTS` parts of whole tiles."""
    parts = module.blocks.parts if module.blocks is not None else []
    return 0 < len(parts) <= MAX_PARTS and all(p.rows % TILE == 0 for p in parts)


def _linears(block) -> dict[str, nn.Module]:
    """A block's linear layers by their name in `_Layer`."""
    return {"qkv": block.attn.qkv, "o": block.attn.o, "gate_up": block.mlp.gate_up,
            "down": block.mlp.down}  # fmt: skip


def _norm(module) -> int | None:
    return None if module is None else module.weight.data_ptr()


def set_four_tiles(on: bool) -> bool | None:
    """Have the products take four tiles of weight rows at once where they can (`on`) or pairs
    of tiles (`dl_set_four_tiles`: the same bits, process-wide); the previous setting, or None
    where the compiled kernels have no four-tile path (or there are none)."""
    lib = library()
    before = -1 if lib is None else lib.dl_set_four_tiles(int(on))
    return None if before < 0 else bool(before)


def set_twin_row(on: bool) -> bool | None:
    """Have a product of one row run the two-row loop on the row and a copy of it (`on`) or
    the one-row loop (`dl_set_twin_row`: the same bits, process-wide); the previous setting, or
    None without the compiled kernels."""
    lib = library()
    return None if lib is None else bool(lib.dl_set_twin_row(int(on)))


def set_fetch_first(on: bool) -> bool | None:
    """Have attention read a sequence's cached keys and values once in order before its
    products (`on`) or not (`dl_set_fetch_first`: the same results, process-wide); the previous
    setting, or None without the compiled kernels."""
    lib = library()
    return None if lib is None else bool(lib.dl_set_fetch_first(int(on)))


def prompt_tiles_ready() -> bool:
    """Whether the compiled layers can run a prompt's products on bfloat16 tiles here (a CPU
    with AMX-BF16, whose tile state the process is granted)."""
    lib = library()
    return lib is not None and bool(lib.dl_prompt_tiles_ready())


class LayerKernels:
    """The compiled layer range of one model. See the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.model = model
        self.layers = (_Layer * cfg.num_layers)()
        for layer, block in zip(self.layers, model.layers, strict=True):
            for name, module in _linears(block).items():
                setattr(layer, name, _linear(module))
            for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
                setattr(layer, name, _norm(getattr(block, name)))
            layer.q_norm, layer.k_norm = _norm(block.attn.q_norm), _norm(block.attn.k_norm)
            layer.window = block.attn.window or 0
        self.description = _Model(
            hidden=cfg.hidden_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            dim=cfg.head_dim,
            intermediate=cfg.intermediate_size,
            gelu=int(cfg.spec.activation == "gelu_tanh"),
            eps=cfg.rms_eps,
            norm_offset=cfg.spec.norm_offset,
            scale=cfg.softmax_scale,
            residual_scale=cfg.residual_multiplier,
            attn_softcap=cfg.attn_softcap or 0.0,
            qk_norm_full=int(cfg.spec.qk_norm_full),
            length=0,
            num_layers=cfg.num_layers,
            layers=self.layers,
        )
        self._tables: tuple[Tensor, dict] | None = None
        self._waits = torch.zeros(2, dtype=torch.int64)  # barrier waits, and those that slept

    @staticmethod
    def for_model(model: nn.Module) -> LayerKernels | None:
        """The compiled layers of `model`, or None where they cannot run it: weights not all
        blocks in whole tiles, not float32 on a CPU, a head size that is not a multiple of 8,
        no compiler."""
        cfg = model.config
        if (
            model.device.type != "cpu"
            or model.dtype != torch.float32
            or cfg.head_dim % 8
            or cfg.intermediate_size % TILE
            or not all(_tiled(m) for block in model.layers for m in _linears(block).values())
            or library() is None
        ):
            return None
        return LayerKernels(model)

    def bind(self, cache: Tensor, ropes: dict[str, tuple[Tensor, Tensor]]) -> None:
        """Point every layer at its part of `cache` `[layers, 2, slots, kv_heads, length, dim]`
        and at its RoPE tables (`ropes[config.rope_kind(layer)]` = cos, sin `[length, dim]`)."""
        cfg = self.model.config
        self.description.length = cache.shape[4]
        self.description.slot_stride = cache.stride(2)
        for i, layer in enumerate(self.layers):
            layer.keys, layer.values = cache[i, 0].data_ptr(), cache[i, 1].data_ptr()
            cos, sin = ropes[cfg.rope_kind(i)]
            layer.cos, layer.sin = cos.data_ptr(), sin.data_ptr()
        self._tables = (cache, ropes)  # keep them alive while pointed at

    def run(
        self,
        h: Tensor,
        positions: list[int],
        slots: list[int],
        first: int,
        last: int,
        collect: list[Tensor] | None,
        profile: Tensor | None = None,
        tiles: bool = False,
        split: bool | None = None,
    ) -> Tensor:
        """Layers `[first, last)` on states `h` `[rows, hidden]`, row r at position
        `positions[r]` of cache slot `slots[r]`; each layer's output is appended to `collect` if
        given. `tiles`: the products (and attention, for heads of 32 values or a multiple) on
        bfloat16 tiles where the CPU has them (a long prompt's rows: `Transformer.on_tiles`).
        `split`: whether the threads split the per-row steps between them (the same bits
        either way; default: from the model's `split_rows_from[tiles]` rows on). `profile`
        (float64 `[len(STEPS)]`): seconds per step of a layer (`STEPS`) are added to it.
        Threads: as many as `TEAM` says (torch's count unless contended)."""
        out = h.contiguous().clone()
        rows = out.shape[0]
        if split is None:
            split = rows >= self.model.split_rows_from[tiles]
        where = torch.tensor([positions, slots], dtype=torch.int64)
        states = torch.empty(last - first, rows, out.shape[1]) if collect is not None else None
        shape = (rows, first, last)
        threads = TEAM.threads(shape)
        start = time.perf_counter()
        status = library().dl_layers(
            ctypes.byref(self.description),
            out.data_ptr(),
            rows,
            where[0].data_ptr(),
            where[1].data_ptr(),
            first,
            last,
            None if states is None else states.data_ptr(),
            threads,
            int(tiles),
            int(split),
            None if profile is None else profile.data_ptr(),
            self._waits.data_ptr(),
        )
        waits, slept = self._waits.tolist()
        TEAM.report(shape, threads, time.perf_counter() - start, waits, slept)
        if status:
            raise MemoryError("out of memory in the compiled layers")
        if states is not None:
            collect.extend(states.unbind(0))
        return out
