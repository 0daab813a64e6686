"""The GGUF block kernels: products against gguf's own dequantisation, row bits independent of
the batch and the thread count, clear refusals, and the announced fallback."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from delspec.errors import ModelFormatError
from delspec.kernels.blocks import KERNEL_TYPES, BlockWeight
from delspec.kernels.build import library, simd_paths
from delspec.kernels.layers import prompt_tiles_ready, set_four_tiles, set_twin_row
from delspec.weights.loading import NAMED_MODELS, default_model_path, load_model, named_model_path

T = gguf.GGMLQuantizationType
# Byte offsets of each type's float16 block fields (scales and minimums).
HALF_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
# Weights multiplied in float (with x as it is), not with 8-bit activations.
FLOAT_TYPES = frozenset({T.F16, T.BF16})
FLOAT_CHAINS = 4  # independent float sums per output (`gguf_blocks.c`)
pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler for the GGUF kernels")


def synthetic_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of `qtype` (every bit pattern of the integer fields, sane float16 scales);
    F16 / BF16: every sign and mantissa, exponents over 2^-30..2^3 (F16's subnormals too)."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT_TYPES:
        bits = rng.integers(0, 1 << 16, (rows, cols), dtype=np.uint16)
        bias, mantissa = (15, 10) if qtype == T.F16 else (127, 7)
        exponent = rng.integers(max(bias - 30, 0), bias + 4, (rows, cols), dtype=np.uint16)
        bits = (bits & np.uint16(0x8000 | ((1 << mantissa) - 1))) | (exponent << mantissa)
        return bits.view(np.uint8)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for offset in HALF_FIELDS[qtype]:
        scale = rng.uniform(0.5, 1.5, blocks.shape[:2]) * (0.01 if values == 256 else 0.1)
        if offset == 2 and values == 32:  # Q4_1 / Q5_1 minimum
            scale = -8 * scale
        blocks[:, :, offset : offset + 2] = (
            scale.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
        )
    return blocks.reshape(rows, -1)


def error_bound(x: torch.Tensor, w: torch.Tensor, qtype: T) -> torch.Tensor:
    """Bound on |kernel - exact| from 8-bit activation rounding: each x in a block of 32 is
    off by at most half its block's step amax/127, so a product is off by at most
    sum over blocks of step/2 * sum |w| over the block (plus float32 accumulation slack).
    F16 / BF16 products take x as it is: only float32 rounding, at most one unit (2^-24) per
    addition a term goes through (K / FLOAT_CHAINS + 2), one for its product and one to spare
    for the second-order terms."""
    magnitude = x.double().abs() @ w.double().abs().T
    if qtype in FLOAT_TYPES:
        return (x.shape[-1] / FLOAT_CHAINS + 4) * 2.0**-24 * magnitude
    step = x.double().reshape(len(x), -1, 32).abs().amax(-1) / 127
    weight_mass = w.double().abs().reshape(len(w), -1, 32).sum(-1)
    return 0.5 * step @ weight_mass.T + 1e-5 * magnitude


def check_product(weight: BlockWeight, qtype: T, raw: np.ndarray, rows: int = 16) -> None:
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(weight.shape)).double()
    x = torch.randn(rows, weight.cols, generator=torch.Generator().manual_seed(1))
    got = weight(x).double()
    exact = x.double() @ reference.T
    bound = error_bound(x, reference, qtype)
    assert bool(((got - exact).abs() <= bound).all()), qtype.name
    # well inside the bound too: the error is a sum of independent roundings
    assert float((got - exact).abs().max()) < 0.5 * float(bound.max())
    torch.testing.assert_close(weight.dequantize().double(), reference, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
def test_synthetic_blocks_match_gguf_dequantisation(qtype):
    raw = synthetic_blocks(qtype, 80, 512)
    check_product(BlockWeight.from_blocks(qtype, torch.from_numpy(raw), 512), qtype, raw)


@pytest.fixture(scope="module")
def smollm2_tensors():
    return {t.name: t for t in gguf.GGUFReader(default_model_path()).tensors}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["blk.3.ffn_up.weight", "blk.7.ffn_down.weight"])
def test_real_smollm2_blocks(smollm2_tensors, name):
    tensor = smollm2_tensors[name]
    check_real_blocks(tensor.tensor_type, np.array(tensor.data), int(tensor.shape[0]))


@pytest.mark.slow
def test_real_smollm2_head_rows(smollm2_tensors):
    tensor = smollm2_tensors["token_embd.weight"]  # Q8_0, the tied LM head
    check_real_blocks(tensor.tensor_type, np.array(tensor.data[::97]), int(tensor.shape[0]))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", sorted(FLOAT_TYPES), ids=lambda t: t.name)
def test_real_values_in_float16_and_bfloat16(smollm2_tensors, qtype):
    """No file here holds F16 / BF16 weights: SmolLM2's real values, converted by gguf."""
    tensor = smollm2_tensors["blk.3.ffn_up.weight"]
    values = dequantize(np.array(tensor.data), tensor.tensor_type)
    raw = np.ascontiguousarray(gguf.quantize(values, qtype)).view(np.uint8)
    check_real_blocks(qtype, raw, int(tensor.shape[0]))


def check_real_blocks(qtype: T, raw: np.ndarray, cols: int) -> None:
    check_product(BlockWeight.from_blocks(qtype, torch.from_numpy(raw), cols), qtype, raw)


@pytest.mark.slow
def test_real_gemma3_blocks_of_every_type():
    """Gemma-3-270M's Q8_0 head, Q5_0, Q4_K, Q6_K and Q8_0 layers: the loaded model holds each
    type as blocks, and real rows of each (the file's first tensor of the type) multiply within
    the bound of gguf's dequantisation of the same bytes."""
    entry = NAMED_MODELS["gemma3-270m"]
    if importlib.util.find_spec(entry.package) is None:
        pytest.skip(f"Gemma-3-270M is not installed; install it with: {entry.install}")
    model = load_model("gemma3-270m", weights="native").model
    held = {p.qtype for w in model.block_weights for p in w.parts}
    assert {T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K} <= held
    first: dict[T, gguf.ReaderTensor] = {}
    for tensor in gguf.GGUFReader(named_model_path("gemma3-270m")).tensors:
        first.setdefault(tensor.tensor_type, tensor)
    for qtype in held:
        tensor = first[qtype]
        check_real_blocks(qtype, np.array(tensor.data[:512]), int(tensor.shape[0]))


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
def test_row_bits_do_not_depend_on_batch_or_threads(qtype):
    raw = synthetic_blocks(qtype, 96, 256, seed=2)  # enough rows to run on two threads
    weight = BlockWeight.from_blocks(qtype, torch.from_numpy(raw), 256)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(weight(x))  # 40 rows: chunks of 16, 16 and 8
            for m in range(1, 17):
                together = weight(x[:m])
                for r in range(m):
                    assert torch.equal(together[r], results[0][r]), (count, m, r)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
def test_rows_taken_in_blocks_keep_their_bits(qtype):
    """A product takes the rows of x a block at a time (`dl_row_block`: what fits in a share of
    the core's L2): 43 rows in blocks of 8 give the bits of 43 rows in one block."""
    lib = library()
    raw = synthetic_blocks(qtype, 48, 256, seed=5)
    weight = BlockWeight.from_blocks(qtype, torch.from_numpy(raw), 256)
    x = torch.randn(43, 256, generator=torch.Generator().manual_seed(6))
    previous = lib.dl_set_block_bytes(0)
    try:
        block = lib.dl_row_block(256)  # half of this CPU's L2, in whole chunks of 8 rows
        assert block >= 8 and block % 8 == 0
        lib.dl_set_block_bytes(1 << 40)
        assert lib.dl_row_block(256) >= len(x)
        whole = weight(x)
        lib.dl_set_block_bytes(1)
        assert lib.dl_row_block(256) == 8
        assert torch.equal(weight(x), whole)
    finally:
        lib.dl_set_block_bytes(previous)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
def test_tiles_together_have_the_bits_of_single_tiles(qtype):
    """56 rows (four tiles, then a pair, computed at once with AVX-512, and an odd tile) give
    the bits of each tile of 8 rows alone."""
    raw = synthetic_blocks(qtype, 56, 512, seed=8)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(9))

    def product(rows: np.ndarray) -> torch.Tensor:
        return BlockWeight.from_blocks(qtype, torch.from_numpy(rows), 512)(x)

    alone = torch.cat([product(raw[i : i + 8]) for i in range(0, 56, 8)], -1)
    assert torch.equal(product(raw), alone)
    before = set_four_tiles(False)  # pairs of tiles only, where four is the default
    try:
        assert torch.equal(product(raw), alone)
    finally:
        if before is not None:
            set_four_tiles(before)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
def test_one_row_twinned_keeps_its_bits(qtype):
    """A product of one row run as two (the row and its copy: `dl_set_twin_row`) gives the
    row's bits, on four tiles, a pair and a lone tile (56 weight rows), and with pairs only;
    rows of a batch are not twinned."""
    raw = synthetic_blocks(qtype, 56, 512, seed=10)
    weight = BlockWeight.from_blocks(qtype, torch.from_numpy(raw), 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(11))
    batch = weight(x)
    before, before_four = set_twin_row(True), set_four_tiles(True)
    try:
        for four in (True, False):
            set_four_tiles(four)
            for r in range(3):
                assert torch.equal(weight(x[r : r + 1])[0], batch[r]), (four, r)
            assert torch.equal(weight(x), batch)
    finally:
        set_twin_row(bool(before))
        if before_four is not None:
            set_four_tiles(before_four)


def tile_product(weight: BlockWeight, x: torch.Tensor) -> torch.Tensor:
    """x . W^T on bfloat16 tiles (`dl_prompt_tiles`), 32 weight rows a call, as the compiled
    layers call it for a prompt's rows."""
    lib = library()
    rows, cols = x.shape
    xb = torch.zeros(rows + 32, cols, dtype=torch.int16)  # and 32 more rows the tiles read
    lib.dl_bf16_rows(x.data_ptr(), cols, 0, rows, cols, xb.data_ptr())
    y = torch.empty(rows, weight.rows)
    first = 0
    for part in weight.parts:
        stride = lib.dl_tile_stride(int(part.qtype), cols)
        for row in range(0, part.rows, 32):
            tile = part.tiles.data_ptr() + row // 8 * stride
            width = min(32, part.rows - row)
            out = y[:, first + row :].data_ptr()
            status = lib.dl_prompt_tiles(
                int(part.qtype), tile, cols, width, xb.data_ptr(), rows, out, weight.rows
            )
            assert status == 0
        first += part.rows
    return y


TILES = pytest.mark.skipif(
    not prompt_tiles_ready(), reason="no AMX-BF16 tiles on this CPU (or in this build)"
)


@TILES
@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES - FLOAT_TYPES), ids=lambda t: t.name)
def test_prompt_tiles_match_dequantisation_to_bfloat16_rounding(qtype):
    """A prompt's products on bfloat16 tiles: x and the weights each rounded to bfloat16
    (half a unit of 2^-8 relative), summed in float32; each row's bits its own (whatever rows
    run with it). 40 weight rows: a group of 4 tiles and one alone."""
    raw = synthetic_blocks(qtype, 40, 512, seed=11)
    weight = BlockWeight.from_blocks(qtype, torch.from_numpy(raw), 512)
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(weight.shape)).double()
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(12))
    got = tile_product(weight, x)
    error = (got.double() - x.double() @ reference.T).abs()
    bound = (2.0**-8 + 2.0**-16 + 512 * 2.0**-24) * (x.double().abs() @ reference.abs().T)
    assert bool((error <= bound).all()), qtype.name
    assert float(error.max()) < 0.25 * float(bound.max())  # independent roundings
    for rows in (1, 5, 16, 17, 33):
        assert torch.equal(tile_product(weight, x[-rows:]), got[-rows:]), rows


@TILES
@pytest.mark.parametrize("qtype", sorted(FLOAT_TYPES), ids=lambda t: t.name)
def test_prompt_tiles_leave_float_weights_to_the_float_products(qtype):
    lib = library()
    weight = BlockWeight.from_blocks(qtype, torch.from_numpy(synthetic_blocks(qtype, 8, 64)), 64)
    xb, y = torch.zeros(33, 64, dtype=torch.int16), torch.empty(1, 8)
    tile = weight.parts[0].tiles.data_ptr()
    assert lib.dl_prompt_tiles(int(qtype), tile, 64, 8, xb.data_ptr(), 1, y.data_ptr(), 8) == -1


def test_simd_paths_widest_first():
    """The paths tried for a CPU's flags, widest first, each narrower one a fallback for a
    compiler too old for the wider; a cap never lets a wider one in."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 paths")
    avx2 = {"avx2", "fma", "f16c"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    names = [
        [" ".join(flags) or "portable" for flags in simd_paths(frozenset(cpu), cap)]
        for cpu, cap in [
            (avx512 | {"avx_vnni"}, None),
            (avx2 | {"avx_vnni"}, None),
            (avx512, "avx2"),
            (avx512, "portable"),
            ({"avx2", "fma"}, None),  # no F16C: no AVX2 path
        ]
    ]
    assert [len(paths) for paths in names] == [4, 3, 2, 1, 1]
    assert "-mavx512vnni" in names[0][0] and "-mavxvnni" in names[0][1]
    assert "-mavxvnni" in names[1][0] and names[1][1:] == names[2]
    assert names[2][0] == "-mavx2 -mfma -mf16c" and names[3] == names[4] == ["portable"]


@pytest.mark.parametrize("path, level", [("portable", 0), ("avx2", 1)])
def test_narrower_simd_paths(monkeypatch, path, level):
    """The paths this CPU would not take (portable C runs wherever AVX2 is missing): built on
    request, each type within the bound of gguf's dequantisation, row bits independent of the
    batch."""
    if level == 1 and library().dl_simd_level() < 1:
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv("DELSPEC_KERNEL_SIMD", path)
    library.cache_clear()
    try:
        assert library().dl_simd_level() == level
        for qtype in sorted(KERNEL_TYPES):
            raw = synthetic_blocks(qtype, 24, 512, seed=6)
            weight = BlockWeight.from_blocks(qtype, torch.from_numpy(raw), 512)
            check_product(weight, qtype, raw, rows=9)
            x = torch.randn(9, 512, generator=torch.Generator().manual_seed(7))
            alone = torch.cat([weight(x[r : r + 1]) for r in range(9)])
            assert torch.equal(weight(x), alone), qtype.name
            before = set_twin_row(True)  # one row run as two there too
            twinned = torch.cat([weight(x[r : r + 1]) for r in range(9)])
            set_twin_row(bool(before))
            assert torch.equal(twinned, alone), qtype.name
    finally:
        monkeypatch.undo()
        library.cache_clear()


def test_parts_and_row_subsets():
    a, b = synthetic_blocks(T.Q4_1, 8, 64, 4), synthetic_blocks(T.Q8_0, 5, 64, 5)
    wa = BlockWeight.from_blocks(T.Q4_1, torch.from_numpy(a), 64)
    wb = BlockWeight.from_blocks(T.Q8_0, torch.from_numpy(b), 64)
    both = BlockWeight.stack([wa, wb, wb])
    assert [p.qtype for p in both.parts] == [T.Q4_1, T.Q8_0] and both.shape == (18, 64)
    x = torch.randn(3, 64)
    assert torch.equal(both(x), torch.cat([wa(x), wb(x), wb(x)], -1))
    rows = torch.tensor([4, 0, 2])
    assert torch.equal(wa[rows](x), wa(x)[:, rows])
    assert torch.equal(wa[2:5].dequantize(), wa.dequantize()[2:5])
    assert torch.equal(wa.dequantize(rows), wa.dequantize()[rows])
    # row numbers as a list (an embedding's lookup): the same rows, and the same range check
    assert torch.equal(wa.dequantize(rows.tolist()), wa.dequantize()[rows])
    assert torch.equal(both.dequantize([17, 3]), both.dequantize()[[17, 3]])
    assert wa.dequantize([]).shape == (0, 64)
    for outside in ([8], [-1], torch.tensor([8])):
        with pytest.raises(IndexError, match="out of range for 8 rows"):
            wa.dequantize(outside)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
def test_gathered_rows_keep_their_values(qtype):
    """Rows taken out of tiles in any order, to any place in a tile (a pruned draft head), and
    parts merged into one: the same values as the rows they came from."""
    raw = synthetic_blocks(qtype, 21, 512, seed=11)
    weight = BlockWeight.from_blocks(qtype, torch.from_numpy(raw), 512)
    rows = torch.randperm(21, generator=torch.Generator().manual_seed(12))[:13]
    full = weight.dequantize()
    assert torch.equal(weight[rows].dequantize(), full[rows])
    merged = BlockWeight.stack([weight[rows[:5]], weight[rows[5:]]])
    assert len(merged.parts) == 1 and torch.equal(merged.dequantize(), full[rows])


def test_pieces_are_repacked_where_they_lie():
    """Rows given as several pieces, strided views among them, repack to the tiles of the
    pieces' rows copied one after another."""
    for qtype in sorted(KERNEL_TYPES):
        a = torch.from_numpy(synthetic_blocks(qtype, 12, 256, 8))
        b = torch.from_numpy(synthetic_blocks(qtype, 7, 256, 9))
        pieces = [a[1::2], b, a[::3]]
        copied = BlockWeight.from_blocks(qtype, torch.cat(pieces), 256).parts[0]
        in_place = BlockWeight.from_blocks(qtype, pieces, 256).parts[0]
        assert in_place.rows == 17 and torch.equal(in_place.tiles, copied.tiles), qtype.name


def test_malformed_blocks_are_refused():
    raw = torch.from_numpy(synthetic_blocks(T.Q4_1, 4, 64))
    with pytest.raises(ModelFormatError, match="Q4_1 block data of shape"):
        BlockWeight.from_blocks(T.Q4_1, raw[:, :-1], 64)  # a byte short per row
    with pytest.raises(ModelFormatError, match="not whole Q4_K blocks"):
        BlockWeight.from_blocks(T.Q4_K, raw, 64)
    refusal = r"no block kernel for GGUF type IQ4_NL \(supported: F16, Q4_0, .*, Q6_K, BF16\)"
    with pytest.raises(ModelFormatError, match=refusal):
        BlockWeight.from_blocks(T.IQ4_NL, raw, 64)


@pytest.mark.slow
def test_fallback_is_announced_and_used(tmp_path):
    """Without the compiled kernels a GGUF model loads in float (said once); asking for native
    weights is a clear error, not a traceback."""
    env = {**os.environ, "DELSPEC_NO_KERNELS": "1"}
    command = [sys.executable, "-m", "delspec.cli", "generate", "Hi", "--max-new-tokens", "2"]
    ok = subprocess.run([*command, "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert ok.returncode == 0, ok.stderr
    assert "compiled GGUF kernels disabled" in ok.stderr
    assert '"weights": "float"' in ok.stdout
    refused = subprocess.run(
        [*command, "--weights", "native"], capture_output=True, text=True, env=env, timeout=600
    )
    assert refused.returncode != 0
    assert "need the compiled GGUF kernels" in refused.stderr
    assert "Traceback" not in refused.stderr
