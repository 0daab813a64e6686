"""The compiled layer kernels against torch references: fused attention (norms, RoPE, cache
write, causal attention), RMS norm and the gated activation; rows' bits independent of how many
rows are computed together; a whole layer range in one call equal to the layer-by-layer path; the
greedy pick and logsumexp of rows of scores against torch's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

from delspec.kernels import attention, layer_ops
from delspec.kernels.build import library
from delspec.kernels.layers import LayerKernels, prompt_tiles_ready, set_fetch_first
from delspec.kernels.scores import row_mass, top_logsumexp
from delspec.model.modules import apply_rope, rope_inv_freq, rope_table
from delspec.model.transformer import Transformer

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler for the kernels")
HEADS, KV_HEADS, DIM, LENGTH = 6, 2, 16, 40
T = gguf.GGMLQuantizationType


def reference(qkv, cos, sin, cache, start, window, scale, norms, softcap=None):
    """Torch's attention (float64) of qkv rows at positions start.., with the cache's earlier
    positions as keys and values (scores capped to softcap * tanh(score / softcap) if given)."""
    n = qkv.shape[0]
    q, k, v = qkv.double().split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    q = q.view(n, HEADS, DIM).transpose(0, 1)
    k = k.view(n, KV_HEADS, DIM).transpose(0, 1)
    v = v.view(n, KV_HEADS, DIM).transpose(0, 1)
    if norms is not None:
        q_w, k_w, eps, offset = norms
        q = F.rms_norm(q, (DIM,), (q_w + offset).double(), eps)
        k = F.rms_norm(k, (DIM,), (k_w + offset).double(), eps)
    q, k = apply_rope(q, cos.double(), sin.double()), apply_rope(k, cos.double(), sin.double())
    keys = torch.cat([cache[0, :, :start].double(), k], dim=1)
    values = torch.cat([cache[1, :, :start].double(), v], dim=1)
    rows = torch.arange(start, start + n)[:, None]
    cols = torch.arange(start + n)[None, :]
    allowed = (cols <= rows) & ((cols > rows - window) if window else True)
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = q @ keys.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values
    return out.transpose(0, 1).reshape(n, -1), k, v


@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_norms", [False, True])
def test_matches_reference_and_writes_the_cache(window, with_norms, softcap):
    torch.manual_seed(0)
    cos, sin = rope_table(rope_inv_freq(DIM, 10000.0), LENGTH, torch.float32)
    cache = torch.randn(2, KV_HEADS, LENGTH, DIM)
    start, n = 11, 7
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM)
    norms = (torch.rand(DIM) + 0.5, torch.rand(DIM) + 0.5, 1e-6, 1.0) if with_norms else None
    tables = cos[start : start + n], sin[start : start + n]
    expected, k, v = reference(qkv, *tables, cache, start, window, 0.3, norms, softcap)
    got = attention.fused_attention(qkv, *tables, cache, start, HEADS, window, 0.3, norms, softcap)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)
    if softcap:  # the cap bites: uncapped scores give other outputs
        uncapped, _, _ = reference(qkv, *tables, cache, start, window, 0.3, norms)
        assert not torch.allclose(uncapped, expected, atol=1e-3)
    torch.testing.assert_close(cache[0, :, start : start + n].double(), k, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache[1, :, start : start + n].double(), v)


@pytest.mark.parametrize("threads", [1, 2])
def test_row_bits_do_not_depend_on_the_rows_computed_with_them(threads):
    torch.manual_seed(1)
    cos, sin = rope_table(rope_inv_freq(DIM, 10000.0), LENGTH, torch.float32)
    prefix = torch.randn(2, KV_HEADS, LENGTH, DIM)
    start, n = 20, 9
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = prefix.clone()
        all_rows = attention.fused_attention(
            qkv, cos[start : start + n], sin[start : start + n], together, start, HEADS, 6, 0.25
        )
        alone = prefix.clone()
        for r in range(n):
            p = start + r
            row = attention.fused_attention(
                qkv[r : r + 1], cos[p : p + 1], sin[p : p + 1], alone, p, HEADS, 6, 0.25
            )
            assert torch.equal(row[0], all_rows[r]), r
        assert torch.equal(alone, together)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_reading_the_cache_first_changes_no_bit(threads):
    """Attention with its cache read in order first (`dl_set_fetch_first`, the default) and
    without: the same outputs and cache, for one row and for several."""
    torch.manual_seed(2)
    cos, sin = rope_table(rope_inv_freq(DIM, 10000.0), LENGTH, torch.float32)
    prefix = torch.randn(2, KV_HEADS, LENGTH, DIM)
    start = 30
    previous, before = torch.get_num_threads(), set_fetch_first(True)
    torch.set_num_threads(threads)
    try:
        for n in (1, 4):
            qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM)
            tables = cos[start : start + n], sin[start : start + n]
            outs, caches = [], []
            for fetch in (True, False):
                set_fetch_first(fetch)
                cache = prefix.clone()
                outs.append(attention.fused_attention(qkv, *tables, cache, start, HEADS, None, 0.3))
                caches.append(cache)
            assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1]), n
    finally:
        torch.set_num_threads(previous)
        set_fetch_first(bool(before))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (8, 2), (5, 1)])
def test_heads_computed_together_keep_each_heads_bits(heads, kv_heads, window, threads):
    """Query heads of one key-value head are computed together, over blocks of keys and a tail:
    each equals the same head computed alone (its key-value head repeated for it), and each row of
    a many-row call equals a one-row call at its position."""
    torch.manual_seed(4)
    dim, length, start, n, group = 64, 48, 13, 21, heads // kv_heads
    cos, sin = rope_table(rope_inv_freq(dim, 10000.0), length, torch.float32)
    prefix = torch.randn(2, kv_heads, length, dim)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim)
    norms = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5, 1e-6, 1.0)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)

    def repeated(x):  # each key-value head once per query head
        return x.view(n, kv_heads, dim).repeat_interleave(group, 1).flatten(1)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tables, rest = (cos[start : start + n], sin[start : start + n]), (window, 0.125, norms)
        together = prefix.clone()
        rows = attention.fused_attention(qkv, *tables, together, start, heads, *rest)
        alone_qkv, alone_cache = (
            torch.cat([q, repeated(k), repeated(v)], dim=1),
            prefix.repeat_interleave(group, 1),
        )
        alone = attention.fused_attention(alone_qkv, *tables, alone_cache, start, heads, *rest)
        assert torch.equal(rows, alone)
        for r in range(n):
            p = start + r
            cache = together.clone()
            row = attention.fused_attention(
                qkv[r : r + 1], cos[p : p + 1], sin[p : p + 1], cache, p, heads, *rest
            )
            assert torch.equal(row[0], rows[r]), r
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_torch_and_is_row_exact(offset):
    torch.manual_seed(2)
    x, weight = torch.randn(5, 3, 200) * 4, torch.randn(200)
    expected = F.rms_norm(x.double(), (200,), (weight + offset).double(), 1e-6)
    got = layer_ops.rms_norm(x, weight, 1e-6, offset)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer_ops.rms_norm(x[2:3, 1:2], weight, 1e-6, offset)[0, 0], got[2, 1])


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activation_matches_torch(gelu):
    torch.manual_seed(3)
    gate_up = torch.randn(6, 2 * 96) * 3
    gate, up = gate_up.double().chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    got = layer_ops.gated(gate_up, gelu)
    torch.testing.assert_close(got.double(), act * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer_ops.gated(gate_up[4:5], gelu)[0], got[4])


def test_attention_takes_a_column_major_projection():
    """A narrow product returns its result transposed in memory; the kernel must read it right."""
    torch.manual_seed(4)
    cos, sin = rope_table(rope_inv_freq(DIM, 10000.0), LENGTH, torch.float32)
    qkv = torch.randn(3, (HEADS + 2 * KV_HEADS) * DIM)
    tables = cos[4:7], sin[4:7]
    row_major = attention.fused_attention(
        qkv, *tables, torch.zeros(2, 2, LENGTH, DIM), 4, HEADS, None, 0.3
    )
    column_major = qkv.T.contiguous().T
    assert column_major.stride(-1) != 1
    got = attention.fused_attention(
        column_major, *tables, torch.zeros(2, 2, LENGTH, DIM), 4, HEADS, None, 0.3
    )
    assert torch.equal(got, row_major)


FAMILIES = {
    "llama": {},
    "qwen2 (q/k/v bias)": {"family": "qwen2"},
    "qwen3 (head norms)": {"family": "qwen3"},
    "smollm3 (layers without RoPE)": {"family": "smollm3", "nope_layers": (0, 3)},
    "granite (multipliers)": {"family": "granite", "residual_multiplier": 0.4, "attn_scale": 0.2},
    "olmo2 (norms after attention and MLP, q/k norms over all heads)": {"family": "olmo2"},
    "gemma2 (sandwich norms, GELU, sliding window, capped scores)": {
        "family": "gemma2",
        "sliding_window": 4,
        "layer_types": ("sliding_attention", "full_attention") * 3,
        "attn_softcap": 0.5,
        "final_logit_softcap": 2.0,
    },
    "gemma3 (head norms, sandwich norms, GELU, sliding window)": {
        "family": "gemma3_text",
        "sliding_window": 4,
        "layer_types": ("sliding_attention",) * 5 + ("full_attention",),
        "rope_local_theta": 10000.0,
    },
}


def model_and_prompt(
    family: str, block_type: T, head_dim: int = 8, slots: int = 1
) -> tuple[Transformer, torch.Tensor]:
    """A tiny model of `family` on `block_type` blocks with a cache of 80 positions (in `slots`
    sequence slots), and 70 token ids to run through it."""
    overrides = {**FAMILIES[family], "head_dim": head_dim}
    model = tiny_model(seed=3, dtype=torch.float32, blocks=True, block_type=block_type, **overrides)
    model.setup_cache(80, slots)
    ids = torch.randint(
        0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(4)
    )
    return model, ids


@pytest.mark.parametrize(
    "family, block_type",
    [(family, T.Q8_0) for family in FAMILIES] + [("llama", T.F16), ("llama", T.BF16)],
    ids=lambda v: v.name if isinstance(v, T) else v.split(" ")[0],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_layer_range_equals_one_operation_at_a_time(
    family, block_type, threads, monkeypatch
):
    """A model on block weights runs its layers in one compiled call (`dl_layers`): the same bits
    as the layer-by-layer path (states, collected states, cache), and each row the same whether
    computed alone or with others (fewer and more rows than the cache is written ahead for, and
    than the threads split the per-row steps from). F16 / BF16 weights take the float rows
    themselves, which the compiled call must keep."""
    model, ids = model_and_prompt(family, block_type)
    assert model.compiled_layers() is not None
    count = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            runs = {}
            for kind in ("compiled", "eager"):
                if kind == "eager":  # a model the compiled layers cannot take
                    monkeypatch.setattr(LayerKernels, "for_model", staticmethod(lambda m: None))
                model._layer_binding = None
                assert (model.compiled_layers() is None) == (kind == "eager")
                states: list[torch.Tensor] = []
                out = model.run_layers(model.embed(ids), 0, 0, model.num_layers, states)
                runs[kind] = (out, torch.stack(states), model.cache.clone())
            for a, b in zip(runs["compiled"], runs["eager"], strict=True):
                assert torch.equal(a, b)
            monkeypatch.undo()
            model._layer_binding = None
            full = runs["compiled"][0]
            for rows in (1, 3, 6):  # below and above the rows that write the cache first
                parts = [
                    model.run_layers(model.embed(ids[i : i + rows]), i, 0, model.num_layers)
                    for i in range(0, len(ids), rows)
                ]
                assert torch.equal(torch.cat(parts), full), rows
            assert torch.equal(model.cache, runs["compiled"][2])
            previous = library().dl_set_block_bytes(1)  # products take 8 rows at a time
            try:
                blocked = model.run_layers(model.embed(ids), 0, 0, model.num_layers)
            finally:
                library().dl_set_block_bytes(previous)
            assert torch.equal(blocked, full)
            assert torch.equal(model.cache, runs["compiled"][2])
            compiled, rows = model.compiled_layers(), len(ids)
            for split in (True, False):  # the per-row steps split between the threads or not
                where = (list(range(rows)), [0] * rows, 0, model.num_layers, None)
                assert torch.equal(compiled.run(model.embed(ids), *where, split=split), full)
                assert torch.equal(model.cache, runs["compiled"][2])
    finally:
        torch.set_num_threads(count)


@pytest.mark.skipif(not prompt_tiles_ready(), reason="no AMX-BF16 tiles on this CPU")
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [8, 32], ids=["attention in float", "attention on tiles"])
def test_prompt_rows_on_tiles_keep_their_bits(family, threads, head_dim):
    """A prompt's rows on bfloat16 tiles (and with heads of 32 values or more, their attention):
    each row's states and cache entries the same alone, in chunks, on 1 or 2 threads and in
    blocks of rows (a prompt prefilled in chunks caches what one pass does); other bits than the
    8-bit path's, and close to them."""
    model, ids = model_and_prompt(family, T.Q8_0, head_dim)
    count = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            eight_bit = model.run_layers(model.embed(ids), 0, 0, model.num_layers)
            full = model.run_layers(model.embed(ids), 0, 0, model.num_layers, tiles=True)
            cache = model.cache.clone()
            for rows in (1, 6, 33):
                parts = [
                    model.run_layers(
                        model.embed(ids[i : i + rows]), i, 0, model.num_layers, tiles=True
                    )
                    for i in range(0, len(ids), rows)
                ]
                assert torch.equal(torch.cat(parts), full), rows
                assert torch.equal(model.cache, cache), rows
            previous = library().dl_set_block_bytes(1)  # products take 8 rows at a time
            try:
                blocked = model.run_layers(model.embed(ids), 0, 0, model.num_layers, tiles=True)
            finally:
                library().dl_set_block_bytes(previous)
            assert torch.equal(blocked, full)
    finally:
        torch.set_num_threads(count)
    assert not torch.equal(full, eight_bit)
    torch.testing.assert_close(full, eight_bit, rtol=0.02, atol=0.02 * float(eight_bit.abs().max()))


@pytest.mark.skipif(not prompt_tiles_ready(), reason="no AMX-BF16 tiles on this CPU")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_attention_on_tiles_takes_rows_of_several_sequences(family):
    """Two prompts' rows in one call on tiles (a server's prefill chunk), in pieces of either
    beside the other: each row has the bits of its prompt computed alone, and each prompt's
    cache slot holds them."""
    model, ids = model_and_prompt(family, T.Q8_0, head_dim=32, slots=2)
    other = ids.flip(0)[:50]
    with torch.inference_mode():
        alone = [
            model.run_layers(model.embed(prompt), 0, 0, model.num_layers, slot=slot, tiles=True)
            for slot, prompt in ((0, ids), (1, other))
        ]
        cache = model.cache.clone()
        model.cache.zero_()
        done = [0, 0]
        for take in ((23, 9), (1, 30), (46, 11)):  # rows of prompt 0, then of prompt 1
            rows = [(0, p) for p in range(done[0], done[0] + take[0])]
            rows += [(1, p) for p in range(done[1], done[1] + take[1])]
            tokens = torch.stack([(ids, other)[slot][p] for slot, p in rows])
            out = model.run_rows(
                model.embed(tokens),
                [p for _, p in rows],
                [slot for slot, _ in rows],
                0,
                model.num_layers,
                tiles=True,
            )
            for slot in (0, 1):
                mine = [i for i, (s, _) in enumerate(rows) if s == slot]
                got = out[mine]
                assert torch.equal(got, alone[slot][done[slot] : done[slot] + len(mine)])
                done[slot] += len(mine)
        assert done == [70, 50]
    assert torch.equal(model.cache, cache)


@pytest.mark.parametrize("width", [1, 7, 8, 9, 4099, 49152])
def test_top_logsumexp_matches_torch_and_takes_the_first_of_equal_maxima(width):
    """The compiled greedy pick, its score and the logsumexp over a row's columns equal
    torch's: the same position, the score exactly, the logsumexp to float32 rounding; of equal
    maxima, the first (a tie planted after an earlier one)."""
    gen = torch.Generator().manual_seed(width)
    scores = torch.randn(3, width, generator=gen) * 8
    if width > 2:  # row 1: the maximum twice, the first one early
        scores[1, [1, width - 1]] = float(scores[1].max()) + 1.0
    at, top, lse = top_logsumexp(scores)
    expected = torch.tensor([int(torch.nonzero(row == row.max())[0]) for row in scores])
    assert torch.equal(at, expected)
    assert torch.equal(top, scores.max(-1).values)
    torch.testing.assert_close(lse, torch.logsumexp(scores.double(), -1).float())
    reference = top_logsumexp(scores.double())  # torch's own operations
    assert torch.equal(reference[0], at)
    torch.testing.assert_close(reference[2].float(), lse)
    with pytest.raises(ValueError, match="no columns"):
        top_logsumexp(scores[:, :0])


@pytest.mark.parametrize("width", [1, 15, 16, 17, 262147])
def test_row_mass_is_numpy_s_to_float32_rounding(width):
    """A sampled draw's mass of a whole float32 row (the sum of e^(z * scale - shift)), compiled:
    each term within a few float32 roundings of the exact exponential of the same float32
    argument (numpy's float32 exp is within one), on every path (vector lanes and the tail),
    for arguments down to and past float32's smallest normal exponential; the sum numpy's."""
    rng = np.random.default_rng(width)
    row = (rng.standard_normal(width) * 12).astype(np.float32)
    scale, shift = 1 / 0.7, float(row.max()) / 0.7
    z = row * np.float32(scale) - np.float32(shift)  # the float32 arguments numpy makes
    inside = z >= -87.0  # below, the kernel takes e^-87 (a value numpy's float32 rounds to 0)
    exact = np.exp(z.astype(np.float64))
    terms = np.array([row_mass(row[i : i + 1], scale, shift) for i in range(min(width, 4000))])
    n = len(terms)
    assert np.abs(terms[inside[:n]] / exact[:n][inside[:n]] - 1).max() < 3e-7
    assert (terms[~inside[:n]] < 2e-38).all()
    numpy_sum = float(np.exp(z).sum(dtype=np.float64))
    assert row_mass(row, scale, shift) == pytest.approx(numpy_sum, rel=1e-6)
    wide = row.astype(np.float64)  # float64 rows: numpy's own operations, in float64
    assert row_mass(wide, scale, shift) == pytest.approx(np.exp(wide * scale - shift).sum())
