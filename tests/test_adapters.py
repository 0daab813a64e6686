"""Exit adapters: training, the sidecar file, and drafting with them stays lossless."""

from __future__ import annotations

import copy
import json

import gguf
import pytest
import torch
from tiny_models import save_hf_dir, tiny_model

from delspec.calibration.calibrate import fit_adapters, read_prompts
from delspec.cli import main
from delspec.decode_config import DecodeConfig, default_draft_vocab
from delspec.decoding.sampling import Sampling
from delspec.decoding.sequence import Decoding
from delspec.drafting.adapters import (
    ExitAdapters,
    default_adapters_path,
    load_adapters,
    save_adapters,
)
from delspec.drafting.draft_head import DraftHead, draft_head
from delspec.drafting.draft_vocab import fallback_ranking, top_tokens, vocabulary_sizes
from delspec.drafting.exit_head import ExitHead
from delspec.errors import ConfigError, ModelFormatError
from delspec.policies import STRATEGIES, make_policy
from delspec.weights.loading import LoadedModel

OPTIONS = {
    "static": dict(exit_layer=2, draft_length=4),
    "fs": dict(exit_layer=3, draft_length=2),
    "dv": dict(exit_layer=2),
    # Measured costs of a tiny model are all timing noise and may never let a draft pay; the
    # paper's layer cost makes del-fast draft here deterministically (all else as shipped).
    # (context drafts are chosen by measured cost only: off here)
    "del-fast": dict(cost="layers", warmup=4, context_drafts=False),
    "lookup": dict(ngram_min=1),
}
DRAFTING = sorted(set(STRATEGIES) - {"ar"})
VOCAB = 64
# adapters "auto", the full vocabulary, exact drafts
ADAPTED = DecodeConfig().updated(draft_vocab=None, int8_draft=False)


def sequences(count: int = 18, length: int = 48) -> list[list[int]]:
    """Random token sequences: self-distillation needs no particular text."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (count, length), generator=gen).tolist()


@pytest.fixture(scope="module")
def model():
    """Layers 1-2 are poor exits, later ones good ones (small residual updates after layer 3)."""
    return tiny_model(seed=0, shallow=3, residual_scale=0.3)


@pytest.fixture(scope="module")
def data() -> list[list[int]]:
    return sequences()


@pytest.fixture(scope="module")
def adapters(model, data) -> ExitAdapters:
    # Calibrating after decoding: the engine's KV cache (an inference tensor) is reused.
    Decoding(model, [1], make_policy("ar", model.num_layers), max_new_tokens=60).run()
    return fit_adapters(model, data, rank=8, steps=120, lr=1e-2)


def test_adapters_improve_held_out_agreement_and_kl(adapters):
    rows = adapters.calibration["layers"]
    assert [r["layer"] for r in rows] == adapters.layers == [1, 2, 3, 4, 5]
    assert all(r["kl_after"] < 0.7 * r["kl_before"] for r in rows), rows
    before = sum(r["agreement_before"] for r in rows)
    assert sum(r["agreement_after"] for r in rows) > before + 0.1, rows
    assert adapters.down.shape == (5, 8, 32) and adapters.up.shape == (5, 32, 8)


def test_shared_prefixes_are_counted_once(model):
    prefix = [5] * 10  # e.g. a chat template's system prompt: the same states every time
    data = [[*prefix, i, *s[:20]] for i, s in enumerate(sequences(12))]
    info = fit_adapters(model, data, layers=[2], rank=4, steps=0).calibration
    assert info["train_positions"] + info["heldout_positions"] == len(prefix) + 12 * 21


def test_ranking_orders_tokens_by_final_layer_frequency(model, data, adapters):
    ranking = adapters.ranking
    assert sorted(ranking.tolist()) == list(range(VOCAB))
    with torch.inference_mode():
        finals = []
        for seq in data:
            model.setup_cache(len(seq))
            finals.append(model(torch.tensor(seq)).argmax(-1))
    counts = torch.bincount(torch.cat(finals), minlength=VOCAB)
    assert counts[ranking].tolist() == sorted(counts.tolist(), reverse=True)
    unseen = ranking[counts[ranking] == 0].tolist()
    assert unseen == sorted(unseen)  # ties in fallback (id) order


def test_file_round_trip_is_bit_exact(model, adapters, tmp_path):
    path = save_adapters(adapters, tmp_path / "a.adapters.safetensors")
    loaded = load_adapters(path, model)
    assert loaded.layers == adapters.layers
    for name in ("down", "up", "ranking"):
        a, b = getattr(adapters, name), getattr(loaded, name)
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert loaded.identity == adapters.identity
    assert loaded.probes.keys() == adapters.probes.keys()
    assert all(torch.equal(loaded.probes[k], v) for k, v in adapters.probes.items())
    assert loaded.calibration == adapters.calibration


def test_same_checkpoint_in_another_dtype_is_accepted(model, adapters, tmp_path):
    path = save_adapters(adapters, tmp_path / "a.safetensors")
    load_adapters(path, copy.deepcopy(model).to(torch.bfloat16))


@pytest.mark.parametrize(
    "other,message",
    [
        (dict(seed=1), "final norm weights differ|embedding weights differ"),
        (dict(num_layers=4), "layers 6 \\(model: 4\\)"),
        (dict(vocab_size=80), "vocabulary size 64 \\(model: 80\\)"),
    ],
)
def test_another_models_file_is_refused(adapters, tmp_path, other, message):
    path = save_adapters(adapters, tmp_path / "a.safetensors")
    with pytest.raises(ModelFormatError, match=message) as info:
        load_adapters(path, tiny_model(**other))
    assert str(path) in str(info.value) and "delspec calibrate" in str(info.value)


def test_other_files_are_refused(model, tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelFormatError, match="cannot read adapters file"):
        load_adapters(junk, model)
    with pytest.raises(ModelFormatError, match="cannot read adapters file"):
        load_adapters(tmp_path / "missing.safetensors", model)


def test_pruned_head_columns_are_the_kept_tokens(model, adapters):
    vocab = top_tokens(adapters.ranking, 20)
    assert vocab.tolist() == sorted(adapters.ranking[:20].tolist())
    h = torch.randn(7, 32, dtype=model.dtype)
    hidden = torch.randn(3, 5, 32, dtype=model.dtype)
    layers = [1, 3, 5]
    for source in (None, adapters):
        full, pruned = DraftHead(model, source), DraftHead(model, source, vocab)
        assert pruned.vocab.tolist() == vocab.tolist() and full.vocab is None
        for layer in layers:
            torch.testing.assert_close(pruned(h, layer), full(h, layer)[:, vocab])
        shadow = full.shadow(hidden, layers)
        torch.testing.assert_close(pruned.shadow(hidden, layers), shadow[..., vocab])
        for row, layer in enumerate(layers):
            torch.testing.assert_close(shadow[row], full(hidden[row], layer))
        tokens = torch.randint(model.config.vocab_size, (5,))  # one per position
        reach = full.token_logits(hidden, layers, tokens)
        torch.testing.assert_close(reach, shadow[:, torch.arange(5), tokens])
    plain = ExitHead(model)
    torch.testing.assert_close(DraftHead(model)(h, 2), plain(h, 2))
    # with int8 drafts, shadow tokens go through the int8 rows the smallest level drafts with
    int8 = DraftHead(model, adapters, [vocab, None], context_vocab=False, int8=True)
    shadow = int8.shadow(hidden, layers)
    exact = DraftHead(model, adapters, vocab).shadow(hidden, layers)
    for row, layer in enumerate(layers):
        assert torch.equal(shadow[row], int8(hidden[row], layer, 0))
    assert not torch.equal(shadow, exact)
    torch.testing.assert_close(shadow, exact, atol=0.05 * float(exact.abs().max()), rtol=0)
    assert not torch.allclose(DraftHead(model, adapters)(h, 2), plain(h, 2))


def test_draft_vocabulary_bounds():
    with pytest.raises(ConfigError, match="draft vocabulary"):
        top_tokens(torch.arange(VOCAB), 0)
    with pytest.raises(ConfigError, match="draft vocabulary"):
        top_tokens(torch.arange(VOCAB), VOCAB + 1)


def test_draft_vocabulary_sizes():
    assert vocabulary_sizes(None, 100) is None
    assert vocabulary_sizes(10, 100) == (10,)
    assert vocabulary_sizes(100, 100) == (100,)  # one size: that many rows, even all
    assert vocabulary_sizes([40, 10, None, 10], 100) == (10, 40, None)
    assert vocabulary_sizes([10, 100], 100) == (10, None)  # all rows: the model's own head
    assert vocabulary_sizes([None], 100) is None
    for bad in (0, 101, [10, 0], [10, 101]):
        with pytest.raises(ConfigError, match=r"1\.\.100"):
            vocabulary_sizes(bad, 100)
    with pytest.raises(ConfigError, match="sizes"):
        vocabulary_sizes("many", 100)
    assert default_draft_vocab("del-fast", 262144) == [16384, 32768, 65536, None]
    assert default_draft_vocab("del-fast", 49152) == [16384, None]
    assert default_draft_vocab("del-fast", 32767) is None
    assert default_draft_vocab("del", 262144) is None


def test_draft_vocabulary_levels_are_nested_and_widened_by_the_context(model, adapters):
    levels = [top_tokens(adapters.ranking, 8), top_tokens(adapters.ranking, 24), None]
    shared = DraftHead(model, adapters, levels)
    assert shared.vocab_sizes == [8, 24, VOCAB]
    assert shared.vocabs[1][:8].tolist() == shared.vocab.tolist() == levels[0].tolist()
    assert set(shared.vocabs[1].tolist()) == set(levels[1].tolist())
    small, large = set(levels[0].tolist()), set(levels[1].tolist())
    middle = next(t for t in range(VOCAB) if t in large - small)
    outside = [t for t in range(VOCAB) if t not in large]
    head = shared.for_prompt([middle, outside[0], int(levels[0][0])])
    # each level drafts the context tokens it lacks; the full one lacks none
    assert head.vocabs[0].tolist()[8:] == [middle, outside[0]]
    assert head.vocabs[1].tolist()[24:] == [outside[0]]
    assert head.vocabs[2] is None and shared.vocabs[0].tolist() == levels[0].tolist()
    full = DraftHead(model, adapters)
    h = torch.randn(3, 32, dtype=model.dtype)
    for layer in (2, model.num_layers):
        for level, ids in enumerate(head.vocabs):
            expected = full(h, layer) if ids is None else full(h, layer)[:, ids]
            torch.testing.assert_close(head(h, layer, level), expected)
    hidden = torch.randn(2, 4, 32, dtype=model.dtype)
    torch.testing.assert_close(
        head.shadow(hidden, [2, 3]), full.shadow(hidden, [2, 3])[..., head.vocab]
    )
    # coverage: which levels could draft a token before the latest admission
    new = outside[1]
    tokens = torch.tensor([int(levels[0][1]), middle, outside[0], new])
    expected = [[True, True, True, False], [True, True, True, False], [True] * 4]
    assert head.covered(tokens).tolist() == expected
    head.admit([new])
    assert head.covered(torch.tensor([new])).tolist() == [[False], [False], [True]]
    head.admit([])
    assert head.covered(torch.tensor([new])).tolist() == [[True], [True], [True]]
    fixed = DraftHead(model, adapters, levels, context_vocab=False).for_prompt([new])
    assert fixed.covered(torch.tensor([new, middle])).tolist() == [
        [False, False],
        [False, True],
        [True, True],
    ]
    with pytest.raises(ConfigError, match="contain the smaller"):
        DraftHead(model, None, [levels[1], levels[0]])
    with pytest.raises(ConfigError, match="only the last"):
        DraftHead(model, None, [None, levels[0]])


@pytest.mark.parametrize("strategy", DRAFTING)
def test_drafting_with_adapters_and_pruned_vocab_is_lossless(model, adapters, strategy):
    head = DraftHead(model, adapters, top_tokens(adapters.ranking, 24))
    gen = torch.Generator().manual_seed(7)
    drafted = accepted = 0
    for prompt_len, max_new in [(1, 9), (6, 33), (30, 20)]:
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist()
        ar = make_policy("ar", model.num_layers)
        expected = Decoding(model, prompt, ar, max_new_tokens=max_new).run()
        policy = make_policy(strategy, model.num_layers, **OPTIONS.get(strategy, {}))
        got = Decoding(model, prompt, policy, max_new_tokens=max_new, exit_head=head).run()
        assert got.token_ids == expected.token_ids, (strategy, prompt_len)
        drafted += got.stats.drafted
        accepted += got.stats.accepted
    assert drafted and accepted


def test_context_tokens_join_a_sequences_draft_vocabulary(model, adapters):
    vocab = top_tokens(adapters.ranking, 8)
    shared = DraftHead(model, adapters, vocab)
    outside = [t for t in range(VOCAB) if t not in set(vocab.tolist())]
    prompt = [outside[0], int(vocab[0]), outside[1], outside[0]]
    head = shared.for_prompt(prompt)
    assert shared.vocab.tolist() == vocab.tolist()  # the shared head stays as it was
    assert head.vocab.tolist() == vocab.tolist() + outside[:2]
    head.admit([outside[2], outside[1], int(vocab[1])])
    assert head.vocab.tolist() == vocab.tolist() + outside[:3]
    assert head.vocab_sizes == shared.vocab_sizes == [len(vocab)]
    full = DraftHead(model, adapters)
    h = torch.randn(5, 32, dtype=model.dtype)
    for layer in (2, model.num_layers):
        torch.testing.assert_close(head(h, layer), full(h, layer)[:, head.vocab])
    hidden = torch.randn(2, 5, 32, dtype=model.dtype)
    torch.testing.assert_close(
        head.shadow(hidden, [2, 3]), full.shadow(hidden, [2, 3])[..., head.vocab]
    )
    fixed = DraftHead(model, adapters, vocab, context_vocab=False).for_prompt(prompt)
    assert fixed.vocab.tolist() == vocab.tolist()


def test_drafting_from_the_final_layer_through_a_pruned_head_is_lossless(model, adapters):
    num_layers = model.num_layers
    head = DraftHead(model, None, top_tokens(adapters.ranking, 16))
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    expected = Decoding(model, prompt, make_policy("ar", num_layers), max_new_tokens=40).run()
    policy = make_policy("static", num_layers, exit_layer=num_layers, draft_length=3)
    got = Decoding(model, prompt, policy, max_new_tokens=40, exit_head=head).run()
    assert got.token_ids == expected.token_ids
    # A final-layer draft is the target's token whenever the pruned head holds it.
    assert 0 < got.stats.accepted < got.stats.drafted


def test_del_adds_the_final_layer_only_with_a_cheaper_draft(model, adapters):
    num_layers = model.num_layers
    middle = list(range(1, num_layers))
    for head, expected in [
        (ExitHead(model), middle),
        (DraftHead(model, adapters), middle),
        (DraftHead(model, adapters, top_tokens(adapters.ranking, 16)), [*middle, num_layers]),
        (ExitHead(model, int8=True), [*middle, num_layers]),
    ]:
        policy = make_policy("del", num_layers)
        policy.start(head)
        assert policy.candidates == expected
    policy = make_policy("del", num_layers, candidates=[2, 3])
    policy.start(DraftHead(model, adapters, top_tokens(adapters.ranking, 16)))
    assert policy.candidates == [2, 3]


@pytest.mark.parametrize("strategy", DRAFTING)
def test_sampling_with_a_draft_head_runs(model, adapters, strategy):
    head = DraftHead(model, adapters, top_tokens(adapters.ranking, 16))
    policy = make_policy(strategy, model.num_layers, **OPTIONS.get(strategy, {}))
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=3)
    out = Decoding(
        model, [1, 2, 3], policy, sampling=sampling, max_new_tokens=25, exit_head=head
    ).run()
    assert len(out.token_ids) == 25 and all(0 <= t < VOCAB for t in out.token_ids)


def fake_lm(model, source) -> LoadedModel:
    return LoadedModel(model, None, "tiny", str(source), ())


def test_draft_head_finds_the_sidecar_next_to_the_model(model, adapters, tmp_path):
    directory = tmp_path / "tiny-model"
    directory.mkdir()
    lm = fake_lm(model, directory)
    assert default_adapters_path(lm) == tmp_path / "tiny-model.adapters.safetensors"
    assert type(draft_head(lm, ADAPTED)) is ExitHead  # nothing to apply
    save_adapters(adapters, default_adapters_path(lm))
    head = draft_head(lm, ADAPTED)
    assert isinstance(head, DraftHead) and head.adapted == set(adapters.layers)
    assert draft_head(lm, ADAPTED) is head  # cached
    assert type(draft_head(lm, ADAPTED.updated(adapters="none"))) is ExitHead
    pruned = draft_head(lm, ADAPTED.updated(draft_vocab=10))
    assert pruned.vocab.tolist() == sorted(adapters.ranking[:10].tolist())
    gguf_lm = fake_lm(model, tmp_path / "m.gguf")
    assert default_adapters_path(gguf_lm) == tmp_path / "m.adapters.safetensors"


def test_draft_head_refuses_a_mismatched_file(adapters, tmp_path):
    path = save_adapters(adapters, tmp_path / "a.safetensors")
    lm = fake_lm(tiny_model(seed=5), tmp_path)
    with pytest.raises(ModelFormatError, match="not this model"):
        draft_head(lm, ADAPTED.updated(adapters=path))


def test_fallback_ranking_uses_gguf_scores(tmp_path):
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list([f"t{i}" for i in range(6)])
    writer.add_token_scores([-5.0, -1.0, -3.0, -1.0, 0.0, -2.0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert fallback_ranking(path, 8).tolist() == [4, 1, 3, 5, 2, 0, 6, 7]
    assert fallback_ranking(tmp_path, 5).tolist() == [0, 1, 2, 3, 4]
    assert fallback_ranking(tmp_path / "missing.gguf", 3).tolist() == [0, 1, 2]


def test_fallback_ranking_puts_byte_range_characters_before_merges(tmp_path):
    """A SentencePiece BPE vocabulary lists its single characters after every merge: the byte
    range's characters (the word-start mark as a space) come first, in their own order; other
    characters and merges keep their score order."""
    pieces = ["<unk>", "\u2581the", "ing", "\u2581a", "\u2581", ".", "\u4e2d", "7", "\u00e9"]
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert fallback_ranking(path, 10).tolist() == [4, 5, 7, 8, 0, 1, 2, 3, 6, 9]


def test_prompt_files(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert read_prompts(text) == [("first prompt", False), ("second prompt", False)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('"a question"\n{"prompt": "def f():", "chat": false}\n')
    assert read_prompts(jsonl) == [("a question", True), ("def f():", False)]
    jsonl.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match=r"p\.jsonl:1"):
        read_prompts(jsonl)


def test_cli_calibrates_and_generate_finds_the_file(tmp_path, capsys):
    model_dir = save_hf_dir(tmp_path / "tiny-llama")  # two layers: exit layer 1
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["hello", "the cat", "once upon", "why", "def f", "one", "we"]))
    calibrate = ["calibrate", str(model_dir), "--prompts", str(prompts), "--rank", "4"]
    assert main([*calibrate, "--max-new-tokens", "12", "--steps", "3", "--layers", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "tiny-llama.adapters.safetensors").is_file()
    generate = ["generate", "hello", "--model", str(model_dir), "--json", "--max-new-tokens", "20"]
    generate += ["--strategy", "static", "--exit-layer", "1"]
    outputs = []
    for extra in (["--adapters", "none"], ["--draft-vocab", "100"]):
        assert main(generate + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1]


def test_auto_draft_options_follow_the_strategy(model, tmp_path):
    lm = fake_lm(model, tmp_path / "no-sidecar")
    fast = draft_head(lm, DecodeConfig().updated(adapters=None))
    assert fast.int8 and fast.vocab is None  # 64 tokens: too few to prune
    paper = draft_head(lm, DecodeConfig("del").updated(adapters=None))
    assert not paper.int8 and paper.vocab is None
