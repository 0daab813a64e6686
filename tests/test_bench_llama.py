"""The `llama-cpp` and `llama-cpp-lookup` bench methods (llama-cpp-python) on the embedded
SmolLM2 GGUF file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from delspec.bench.backends import DelspecBackend, LlamaCppBackend
from delspec.bench.methods import parse_methods
from delspec.bench.prompt_sets import select_prompts
from delspec.bench.report import markdown
from delspec.bench.runner import run_bench
from delspec.errors import ConfigError
from delspec.weights.loading import LoadedModel
from delspec.weights.named_models import default_model_path

NO_LLAMA = "llama-cpp-python is not installed (make install-llama)"
# A prompt whose greedy continuation is decided (top-2 logit gaps >= 3 in both libraries).
PROMPT = "1, 2, 3, 4, 5,"


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": PROMPT, "id": "count"}) + "\n")
    return path


def spy_on_llamas(monkeypatch) -> list[dict]:
    """The keyword arguments of every `llama_cpp.Llama` made from now on (skips without it)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason=NO_LLAMA)
    made: list[dict] = []
    real = llama_cpp.Llama

    def spy(**kwargs):
        made.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(llama_cpp, "Llama", spy)
    return made


@pytest.mark.slow
def test_llama_cpp_greedy_tokens_equal_ar(smollm2: LoadedModel, monkeypatch):
    """Same GGUF file, same prompt ids: llama.cpp's greedy tokens are delspec `ar`'s.

    They are not the same arithmetic: delspec runs the Q4_1 weights dequantized to float32,
    llama.cpp multiplies the Q4_1 blocks by activations it rounds to 8 bits. Where the top two
    logits are close the two can part: after "The capital of France is", both say " Paris.\n\nThe"
    and then float32 prefers " answer" by 0.22 while llama.cpp prefers " United" by 0.02. This
    prompt's tokens are decided by 3 or more, so all 8 must agree.
    """
    made = spy_on_llamas(monkeypatch)
    ids = smollm2.tokenizer.encode(PROMPT)
    assert smollm2.source == str(default_model_path())
    ar = DelspecBackend(smollm2).generator("ar", {})(ids, 8)
    backend = LlamaCppBackend(smollm2)
    backend.reserve(len(ids) + 8)
    generate = backend.generator("greedy", {})
    output = generate(ids, 8)
    assert output.token_ids == ar.token_ids and len(output.token_ids) == 8
    assert output.prefill_s > 0 and output.decode_s > 0
    (made,) = made
    assert made["model_path"] == smollm2.source and made["verbose"] is False
    assert made["n_threads"] == made["n_threads_batch"] == torch.get_num_threads()
    assert made["n_ctx"] == 256  # len(ids) + 8, rounded up as llama.cpp does
    assert generate(ids, 8).token_ids == ar.token_ids  # a second run starts afresh
    with pytest.raises(ConfigError, match="takes no options"):
        backend.generator("greedy", {"top_k": 3})


@pytest.mark.slow
def test_llama_cpp_stops_after_eos_like_ar(smollm2: LoadedModel):
    pytest.importorskip("llama_cpp", reason=NO_LLAMA)
    text = smollm2.apply_chat_template([{"role": "user", "content": "Say just: Hello"}])
    ids = smollm2.tokenizer.encode(text)
    ar = DelspecBackend(smollm2).generator("ar", {})(ids, 40)
    output = LlamaCppBackend(smollm2).generator("greedy", {"n_ctx": 256})(ids, 40)
    assert ar.token_ids[-1] in smollm2.eos_token_ids and len(ar.token_ids) < 40
    assert output.token_ids == ar.token_ids


@pytest.mark.slow
def test_llama_cpp_lookup_equals_llama_cpp_greedy(smollm2: LoadedModel, monkeypatch):
    """llama-cpp-python's prompt lookup keeps llama.cpp's greedy tokens, on a prompt whose
    continuation repeats it (drafts accepted) and on one past n_batch (512) tokens, where its
    logits buffer must hold every position (``logits_all``)."""
    made = spy_on_llamas(monkeypatch)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    short = smollm2.tokenizer.encode(PROMPT)
    long = smollm2.tokenizer.encode(" ".join(map(str, range(1, 200))))  # "1 2 3 ... 199"
    assert len(long) > 512
    backend = LlamaCppBackend(smollm2)
    backend.reserve(len(long) + 24)
    greedy = backend.generator("greedy", {})
    lookup = backend.generator("lookup", {"draft_length": 4})
    drafter = made[-1]["draft_model"]
    assert isinstance(drafter, LlamaPromptLookupDecoding) and made[-1]["logits_all"] is True
    assert (drafter.num_pred_tokens, drafter.max_ngram_size) == (4, 2)
    for ids in (short, long, short):  # the last run starts afresh after the long one
        expected = greedy(ids, 24)
        output = lookup(ids, 24)
        assert output.token_ids == expected.token_ids and len(output.token_ids) == 24
        assert output.prefill_s > 0 and output.decode_s > 0
    with pytest.raises(ConfigError, match="prompt lookup takes the options draft_length"):
        backend.generator("lookup", {"top_k": 3})


@pytest.mark.slow
def test_llama_cpp_lookup_drafts_into_the_context_llama_cpp_rounds_up_to(smollm2: LoadedModel):
    """llama.cpp rounds n_ctx up to a multiple of 256, and llama-cpp-python's lookup drafts run
    up to that size: its token buffer, sized by the n_ctx asked for, must be that size too."""
    pytest.importorskip("llama_cpp", reason=NO_LLAMA)
    ids = smollm2.tokenizer.encode(PROMPT)
    generate = LlamaCppBackend(smollm2).generator("lookup", {"n_ctx": len(ids) + 2})
    assert len(generate(ids, 8).token_ids) == 8


@pytest.mark.slow
@pytest.mark.parametrize("method", ["llama-cpp", "llama-cpp-lookup:d=4"])
def test_llama_cpp_bench_row(smollm2: LoadedModel, prompts_file, method):
    pytest.importorskip("llama_cpp", reason=NO_LLAMA)
    methods = parse_methods(f"ar,{method}")
    prompts = select_prompts(None, 1, 0, prompts_file)
    result = run_bench(smollm2, methods, prompts, max_new_tokens=8, progress=False)
    assert list(result.methods) == ["ar", method] and result.settings["skipped"] == {}
    ar, row = result.records
    assert row["method"] == method and row["new_tokens"] == 8 and row["lossless"]
    assert row["stats"] is None and result.methods[method]["peer"]
    for record in (ar, row):
        assert record["tokens_per_s"] > 0 and record["wall_s"] > 0
        assert record["prefill_tokens_per_s"] > 0 and record["decode_tokens_per_s"] > 0
        assert record["prefill_s"] + record["decode_s"] <= record["wall_s"]
    overall = result.aggregates["overall"][method]
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):  # one prompt: the same
        assert overall[key] == pytest.approx(row[key], rel=1e-3)
    memory = result.methods[method]["memory"]
    assert memory["shared_mib"] is None  # a peer: its weights are its own, in setup
    assert memory["setup_mib"] > 20  # llama.cpp's copy of the ~90 MB file (and its KV cache)
    assert memory["peak_mib"] == pytest.approx(memory["setup_mib"] + memory["run_mib"], abs=0.2)
    assert memory["process_peak_mib"] > memory["peak_mib"]
    assert result.methods["ar"]["memory"]["shared_mib"] > 50  # delspec's model
    table = markdown(result)
    assert f"| {method} | " in table and "peak RSS MiB (own / process)" in table
