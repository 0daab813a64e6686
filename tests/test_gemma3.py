"""Gemma 3 (text): the engine against transformers' `Gemma3ForCausalLM`, and the real 270M model."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_hf_gemma3
from transformers import Gemma3TextConfig

from delspec.bench.backends import load_transformers_model
from delspec.decode_config import DecodeConfig
from delspec.drafting.draft_head import draft_head
from delspec.errors import ModelFormatError
from delspec.model.architectures import config_from_hf
from delspec.weights.checkpoint import build_model
from delspec.weights.loading import load_model
from delspec.weights.named_models import NAMED_MODELS, NamedModel, named_model_of, named_model_path

SHAPES = [
    dict(),
    dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),  # global layers only
    dict(num_key_value_heads=1, tie_word_embeddings=False, final_logit_softcapping=None),
]
# transformers' Gemma3RMSNorm computes in float32 even for float64 inputs, so float64 parity is
# at float32 level (with that norm made float64, the difference is ~1e-14).
TOLERANCES = [(torch.float32, 3e-5), (torch.float64, 1e-5)]


@pytest.mark.parametrize("dtype,tol", TOLERANCES)
@pytest.mark.parametrize("extra", SHAPES)
@torch.no_grad()
def test_logits_match_transformers(extra, dtype, tol):
    reference = tiny_hf_gemma3(dtype, **extra)
    config = config_from_hf(reference.config.to_dict())
    ours = build_model(config, reference.state_dict(), dtype=dtype)
    ids = torch.randint(0, 101, (24,))
    expected = reference(ids[None]).logits[0]
    ours.setup_cache(64)
    assert (ours(ids) - expected).abs().max().item() < tol
    # The window counts the current token: one more key changes the logits.
    wider = build_model(replace(config, sliding_window=6), reference.state_dict(), dtype=dtype)
    wider.setup_cache(64)
    assert (wider(ids) - expected).abs().max().item() > 1e-2


def test_layer_types_from_a_sliding_window_pattern():
    """Configs written before transformers 4.53 give a pattern instead of `layer_types`."""
    hf = Gemma3TextConfig(num_hidden_layers=8).to_dict()  # transformers' default pattern: 6
    assert hf["layer_types"][5] == "full_attention"
    expected = config_from_hf(hf).layer_types
    del hf["layer_types"]
    assert config_from_hf(hf).layer_types == expected
    hf["sliding_window_pattern"] = 2
    assert config_from_hf(hf).layer_types == 4 * ("sliding_attention", "full_attention")


def test_scaled_rope_on_sliding_layers_is_rejected():
    hf = Gemma3TextConfig(num_hidden_layers=2).to_dict()
    hf["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0)
    with pytest.raises(ModelFormatError, match="sliding-window layers"):
        config_from_hf(hf)


# --- a model assembled from chunk packages -----------------------------------------------------

CHUNKED_PACKAGE = """
calls = []


def assemble(path):
    calls.append(path)
    path.write_bytes(b"GGUF")


def broken(path):
    raise FileNotFoundError("Missing chunk files: part2")
"""


def test_assembled_named_model_is_built_once_into_the_cache(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DELSPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "fake_chunked_model").mkdir()
    (tmp_path / "fake_chunked_model" / "__init__.py").write_text(CHUNKED_PACKAGE)
    monkeypatch.syspath_prepend(tmp_path)
    fake = NamedModel("fake_chunked_model", "m.gguf", "pip install fake-model==1.0", "broken")
    install = re.escape(fake.install)
    monkeypatch.setitem(NAMED_MODELS, "fake", fake._replace(package="not_installed_model"))
    with pytest.raises(ModelFormatError, match=f"not installed.*{install}"):
        named_model_path("fake")
    monkeypatch.setitem(NAMED_MODELS, "fake", fake)
    with pytest.raises(ModelFormatError, match=f"Missing chunk files.*{install}"):
        named_model_path("fake")
    assert not any((tmp_path / "cache" / "models").iterdir())  # nothing half-written is kept
    monkeypatch.setitem(NAMED_MODELS, "fake", fake._replace(assemble="assemble"))
    path = named_model_path("fake")
    assert path.read_bytes() == b"GGUF" and path.is_relative_to(tmp_path / "cache" / "models")
    assert named_model_path("fake") == path
    assert len(sys.modules["fake_chunked_model"].calls) == 1
    os.utime(tmp_path / "fake_chunked_model" / "__init__.py", ns=(0, 0))  # reinstalled
    again = named_model_path("fake")
    assert again != path and again.read_bytes() == b"GGUF"
    assert [again.parent] == list((tmp_path / "cache" / "models").iterdir())  # old one removed


def test_asking_whether_a_file_is_a_named_model_assembles_nothing(tmp_path: Path, monkeypatch):
    """A user's own file is told apart from the named models without assembling any of them
    (the real Gemma-3-270M would cost a new user a 253 MB file); an assembled file is known."""
    monkeypatch.setenv("DELSPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "fake_chunked_model").mkdir()
    (tmp_path / "fake_chunked_model" / "__init__.py").write_text(CHUNKED_PACKAGE)
    monkeypatch.syspath_prepend(tmp_path)
    fake = NamedModel("fake_chunked_model", "m.gguf", "pip install fake-model==1.0", "assemble")
    monkeypatch.setitem(NAMED_MODELS, "fake", fake)
    mine = tmp_path / "m.gguf"
    mine.write_bytes(b"GGUF")
    module = sys.modules.get("fake_chunked_model")
    calls = len(module.calls) if module else 0
    assert named_model_of(mine) is None
    assert not (tmp_path / "cache" / "models").exists()
    module = sys.modules.get("fake_chunked_model")
    assert (len(module.calls) if module else 0) == calls
    assert named_model_of(named_model_path("fake")) == "fake"


# --- the real Gemma-3-270M ----------------------------------------------------------------------


@pytest.mark.slow
@torch.no_grad()
def test_gemma3_270m_matches_transformers():
    entry = NAMED_MODELS["gemma3-270m"]
    if importlib.util.find_spec(entry.package) is None:
        pytest.skip(f"Gemma-3-270M is not installed; install it with: {entry.install}")
    loaded = load_model("gemma3-270m", weights="float")  # float32 on CPU: the reference
    assert loaded.model.config.family == "gemma3_text" and loaded.eos_token_ids == (1,)
    reference = load_transformers_model(loaded)
    ids = torch.tensor(loaded.tokenizer("The capital of France is")["input_ids"])
    assert ids[0] == loaded.tokenizer.bos_token_id == 2  # Gemma needs its BOS
    loaded.model.setup_cache(len(ids))
    ours, theirs = loaded.model(ids), reference(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)
    assert loaded.tokenizer.decode(ours[-1:].argmax(-1)) == " the"


def test_gemma3_270m_drafts_with_the_characters_every_text_uses():
    """Gemma's vocabulary lists its single characters after its 236k merges: the smallest draft
    vocabulary still holds the digits, the punctuation and the bare space."""
    entry = NAMED_MODELS["gemma3-270m"]
    if importlib.util.find_spec(entry.package) is None:
        pytest.skip(f"Gemma-3-270M is not installed; install it with: {entry.install}")
    lm = load_model("gemma3-270m")
    head = draft_head(lm, DecodeConfig())
    smallest = set(head.vocabs[0].tolist())
    text = "0123456789 .,:;!?()[]{}#=+-*/_'\"<>"
    ids = [lm.tokenizer.encode(c, add_special_tokens=False) for c in text]
    assert all(len(one) == 1 and one[0] in smallest for one in ids)
    assert len(smallest) == head.vocab_sizes[0] < lm.model.config.vocab_size
