"""What runs one benchmark generation: delspec itself, or a peer library on the same weights.

A backend is built once per run from the loaded model; `Backend.generator(strategy, options)`
checks the options and returns a `Generate`: ``(prompt ids, max new tokens) -> Output``, greedy,
stopping after an EOS token of the model (with a `Sampling` as a third argument, a sampled
`Generate`, which takes a seed as its third). The transformers and economize peers load the Hugging
Face checkpoint that delspec loaded (for a GGUF file, its cached conversion) in the same dtype,
on the same device; the llama.cpp peer loads the GGUF file itself, with its own kernels (and,
for a quantized file, its quantized weights, where delspec runs the dequantized ones).

A backend whose library is not installed raises `BackendUnavailable`; the runner then skips its
methods with that message.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from delspec.bench.methods import method_config
from delspec.decode_config import exit_layer_for, strategy_options
from delspec.decoding.run import resolve
from delspec.decoding.sampling import Sampling
from delspec.decoding.sequence import Stats
from delspec.errors import ConfigError, ModelFormatError
from delspec.weights.gguf_file import GGUFFile
from delspec.weights.loading import LoadedModel, load_model

ECONOMIZE_INSTALL = "pip install --no-deps economize==0.3.2"
# llama-cpp-python compiles llama.cpp on install. Its default build (-march=native, AMX when the
# CPU has it) can die with SIGILL on virtual machines whose CPU flags differ from the host's; this
# portable AVX2 build runs on any x86-64 CPU from 2013 on. Also the Makefile's `install-llama`.
LLAMA_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "
    "-DLLAMA_CURL=OFF"
)
LLAMA_INSTALL = (
    f"CMAKE_ARGS=\"{LLAMA_CMAKE_ARGS}\" pip install 'delspec[llama]' (in a checkout: "
    "make install-llama)"
)

# llama.cpp rounds a context up to a multiple of this (llama-context.cpp: GGML_PAD(n_ctx, 256)).
# llama-cpp-python sizes its token buffer by the n_ctx asked for, but its prompt-lookup drafts
# run up to llama.cpp's (past the buffer: a ValueError), so the bench asks for the rounded size.
LLAMA_CTX_PAD = 256

# Prompt lookup's defaults, transformers' and llama-cpp-python's alike: up to 10 tokens copied per
# round, after the last 2 (or failing that 1) tokens found earlier in the context.
LOOKUP_DEFAULTS = {"draft_length": 10, "ngram": 2}


class BackendUnavailable(ConfigError):
    """A peer library is not installed (or does not load); its methods are skipped."""


@dataclass
class Output:
    """The new tokens of one generation; delspec methods add their stats and per-round trace,
    `layers` naming the exit layers of the trace's alpha vectors (DEL variants)."""

    token_ids: list[int]
    stats: Stats | None = None
    trace: list[dict[str, Any]] | None = None
    layers: list[int] | None = None
    # Seconds of the prompt's forward pass and of everything after it (all new tokens), where
    # the backend can tell them apart.
    prefill_s: float | None = None
    decode_s: float | None = None


# (prompt ids, max new tokens[, seed]): the seed of a sampled run (`Backend.generator`'s sampling)
Generate = Callable[..., Output]


class Backend(Protocol):
    """What runs a method. A backend that allocates a fixed context per generator also has
    ``reserve(tokens)``, which the runner calls before making its generators, with the most
    tokens (prompt and new) that one generation of the run can need."""

    def generator(
        self, strategy: str, options: Mapping[str, Any], sampling: Sampling | None = None
    ) -> Generate:
        """A generation function; invalid options raise `ConfigError` here, not on first use.
        With `sampling` (not greedy), it samples with those settings, seeded by its `seed`
        argument (backends that cannot sample raise `ConfigError`)."""
        ...


def timed(
    generate: Generate, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None
) -> tuple[Output, float]:
    """`generate`'s output (with `seed`, if given) and the wall-clock seconds around it
    (prefill included)."""
    seeded = () if seed is None else (seed,)
    start = time.perf_counter()
    output = generate(prompt_ids, max_new_tokens, *seeded)
    return output, time.perf_counter() - start


class DelspecBackend:
    """delspec's token-level decoding loop with a named strategy (no text streaming, like the
    peers), traced every round. Option ``weights`` runs it on the same checkpoint held in another
    weight format (loaded once)."""

    def __init__(self, lm: LoadedModel) -> None:
        self.models = {lm.model.weights: lm}
        self.lm = lm

    def model_in(self, weights: str | None) -> LoadedModel:
        """The checkpoint in weight format `weights` (None: as loaded)."""
        if weights is None:
            return self.lm
        if weights not in self.models:
            lm = self.lm
            self.models[weights] = load_model(
                lm.source, device=str(lm.model.device), dtype=lm.model.dtype, weights=weights
            )
        return self.models[weights]

    def generator(
        self, strategy: str, options: Mapping[str, Any], sampling: Sampling | None = None
    ) -> Generate:
        """`strategy` with `options` (`delspec.bench.methods.method_config`)."""
        config, weights = method_config(strategy, options)
        # bad options are rejected now; a benchmark times the policy with its thorough costs
        run = resolve(config, self.model_in(weights))
        run.warm_up()

        def generate(prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Output:
            decoding = run.decoding(
                prompt_ids,
                sampling=None if sampling is None else replace(sampling, seed=seed),
                max_new_tokens=max_new_tokens,
                trace=True,
            )
            decoded = decoding.run()
            layers = getattr(decoding.policy, "candidates", None)
            stats = decoded.stats
            decode_s = stats.decode_ms_per_token * max(1, stats.new_tokens) / 1000
            return Output(
                decoded.token_ids, stats, decoded.trace, layers, stats.prefill_ms / 1000, decode_s
            )

        return generate


class TransformersBackend:
    """transformers' own greedy `generate`, plain ("greedy"), with its LayerSkip early-exit
    assistant ("early-exit": `exit_layer` E and `draft_length` d, defaulting to the `static`
    strategy's; drafts exactly d tokens per round, no confidence cut-off), or with prompt-lookup
    decoding ("lookup": `lookup_setting`'s d and ngram as ``prompt_lookup_num_tokens`` and
    ``max_matching_ngram_size``)."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.model = load_transformers_model(lm)

    def generator(
        self, strategy: str, options: Mapping[str, Any], sampling: Sampling | None = None
    ) -> Generate:
        """With `sampling`: `do_sample` with its temperature, top-k and top-p, after
        `torch.manual_seed(seed)`."""
        how: dict[str, Any] = {"sampling": sampling}
        if strategy == "greedy" and not options:
            return lambda ids, n, seed=0: self._generate(ids, n, seed=seed, **how)
        if strategy == "early-exit":
            exit_layer, draft_length = static_setting(self.lm, options)
            how.update(exit_layer=exit_layer, draft_length=draft_length)
            return lambda ids, n, seed=0: self._generate(ids, n, seed=seed, **how)
        if strategy == "lookup":
            draft_length, ngram = lookup_setting(options)
            how.update(draft_length=draft_length, ngram=ngram)
            return lambda ids, n, seed=0: self._generate(ids, n, seed=seed, **how)
        raise ConfigError(f"transformers {strategy} takes no options {dict(options)}")

    def _generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        exit_layer: int | None = None,
        draft_length: int = 0,
        ngram: int | None = None,
        sampling: Sampling | None = None,
        seed: int = 0,
    ) -> Output:
        """Greedy tokens (sampled with `sampling`, seeded by `seed`); with `exit_layer`, drafted
        by the early exit, with `ngram`, looked up in the context; `draft_length` tokens per
        round either way."""
        from transformers import GenerationConfig

        eos = list(self.lm.eos_token_ids)
        sampled = {}
        if sampling is not None:
            torch.manual_seed(seed)
            sampled = dict(
                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p
            )
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=sampling is not None,
            **sampled,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
            assistant_early_exit=exit_layer,
            prompt_lookup_num_tokens=draft_length if ngram is not None else None,
            max_matching_ngram_size=ngram,
        )
        if exit_layer is not None:
            # transformers 5 reads the drafting schedule from the model's own generation config
            own = self.model.generation_config
            own.num_assistant_tokens = draft_length
            own.num_assistant_tokens_schedule = "constant"
            own.assistant_confidence_threshold = 0.0  # no confidence cut-off, as in `static`
        ids = torch.tensor([prompt_ids], device=self.model.device)
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config
        )
        return Output(out[0, len(prompt_ids) :].tolist())


class EconomizeBackend:
    """The `economize` package's LayerSkip drafter ("early-exit": the model's first E layers
    with its shared norm and head, frozen; d drafts per cycle), through its own decoding loop.

    `economize.apply` attaches to a model, so each generator loads its own copy of the weights.
    """

    def __init__(self, lm: LoadedModel) -> None:
        if importlib.util.find_spec("economize") is None:
            raise ConfigError(f"economize methods need the economize package: {ECONOMIZE_INSTALL}")
        self.lm = lm

    def generator(
        self, strategy: str, options: Mapping[str, Any], sampling: Sampling | None = None
    ) -> Generate:
        if sampling is not None:
            raise ConfigError("economize methods decode greedily only (no --temperature)")
        import economize
        from economize.techniques.early_exit import EarlyExitConfig

        if strategy != "early-exit":
            raise ConfigError(f"unknown economize strategy {strategy!r}")
        exit_layer, draft_length = static_setting(self.lm, options)
        drafter = EarlyExitConfig(exit_layer=exit_layer, head="shared", adaptation="frozen")
        model = economize.apply(load_transformers_model(self.lm), drafter)
        decoding = economize.DecodeConfig(cycle_length=draft_length + 1, lossless=True)
        eos = list(self.lm.eos_token_ids)

        def generate(prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Output:
            ids = torch.tensor(prompt_ids, device=model.device)
            result = model.decode(ids, max_new_tokens, decoding=decoding, stop=eos or None)
            return Output(result.tokens.tolist())

        return generate


class LlamaCppBackend:
    """llama.cpp through llama-cpp-python, on the GGUF file delspec loaded: greedy one token per
    step ("greedy"), or llama-cpp-python's own speculative loop with its prompt-lookup drafter
    ("lookup": `LlamaPromptLookupDecoding`, `lookup_setting`'s d as ``num_pred_tokens`` and
    ngram as ``max_ngram_size``; each round checks the drafts in one batch).

    It runs the same prompt token ids (no re-tokenization) with llama.cpp's greedy sampler,
    stopping after an EOS token of the model (delspec's EOS ids) or at the maximum, as delspec
    does; `n_threads` (prompt and decode) is torch's thread count, which is the bench's
    ``--threads``. Its context is `n_ctx` tokens (an option; by default what the run needs, see
    `reserve`, at most the model's context; rounded up to `LLAMA_CTX_PAD`, as llama.cpp does),
    allocated once per generator; "lookup" also keeps every context position's logits
    (``logits_all``, which llama-cpp-python's speculative loop needs): n_ctx x vocabulary floats
    more. The prompt's forward pass and the decoding after it are timed apart, as for delspec
    ("lookup": up to the first new token, which its loop samples in the same step).
    """

    def __init__(self, lm: LoadedModel) -> None:
        try:
            import llama_cpp
        except (ImportError, OSError, RuntimeError) as exc:
            reason = "not installed" if isinstance(exc, ImportError) else f"not loadable ({exc})"
            raise BackendUnavailable(
                f"llama-cpp-python is {reason}; install it with: {LLAMA_INSTALL}"
            ) from exc
        if Path(lm.source).suffix.lower() != ".gguf":
            raise ConfigError(f"llama.cpp needs a GGUF model; {lm.source} is not a .gguf file")
        self.llama_cpp = llama_cpp
        self.lm = lm
        self.context = lm.model.config.max_position

    def reserve(self, tokens: int) -> None:
        self.context = max(1, min(tokens, self.lm.model.config.max_position))

    def generator(
        self, strategy: str, options: Mapping[str, Any], sampling: Sampling | None = None
    ) -> Generate:
        """With `sampling`: llama.cpp's temperature, top-k (0: off) and top-p samplers in that
        order (delspec's), then its seeded draw."""
        options = dict(options)
        n_ctx = options.pop("n_ctx", self.context)
        if not isinstance(n_ctx, int) or n_ctx < 2:
            raise ConfigError(f"n_ctx must be an integer >= 2, got {n_ctx!r}")
        if strategy == "lookup":
            return self._lookup(n_ctx, *lookup_setting(options), sampling)
        if strategy != "greedy" or options:
            raise ConfigError(f"llama.cpp {strategy} takes no options {options}")
        llama_cpp = self.llama_cpp
        llm = self._llama(n_ctx)
        eos = set(self.lm.eos_token_ids)

        def generate(prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Output:
            limit = self._limit(llm, prompt_ids, max_new_tokens)
            llm.reset()  # no reuse of the previous prompt's KV cache
            sampler = self._sampler(sampling, seed)
            start = time.perf_counter()
            llm.eval(prompt_ids)
            prefilled = time.perf_counter()
            tokens: list[int] = []
            while True:
                token = llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1)
                tokens.append(token)
                if token in eos or len(tokens) >= limit:
                    break
                llm.eval([token])
            end = time.perf_counter()
            llama_cpp.llama_sampler_free(sampler)
            return Output(tokens, prefill_s=prefilled - start, decode_s=end - prefilled)

        return generate

    def _sampler(self, sampling: Sampling | None, seed: int) -> Any:
        """llama.cpp's greedy sampler (the argmax of the last position's logits), or its chain
        of `sampling`'s samplers and a draw seeded with `seed`."""
        llama_cpp = self.llama_cpp
        if sampling is None:
            return llama_cpp.llama_sampler_init_greedy()
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        for sampler in (
            llama_cpp.llama_sampler_init_temp(sampling.temperature),
            llama_cpp.llama_sampler_init_top_k(sampling.top_k),
            llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1),
            llama_cpp.llama_sampler_init_dist(seed),
        ):
            llama_cpp.llama_sampler_chain_add(chain, sampler)
        return chain

    def _lookup(
        self, n_ctx: int, draft_length: int, ngram: int, sampling: Sampling | None = None
    ) -> Generate:
        """`Llama.generate` at temperature 0 (or `sampling`'s temperature, top-k and top-p,
        seeded; its own sampler order) with the prompt-lookup drafter."""
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        drafter = LlamaPromptLookupDecoding(max_ngram_size=ngram, num_pred_tokens=draft_length)
        # logits_all sizes the logits buffer for every context position, which the speculative
        # loop fills (with its default, n_batch rows, a context past n_batch tokens overflows it)
        llm = self._llama(n_ctx, draft_model=drafter, logits_all=True)
        eos = set(self.lm.eos_token_ids)

        settings = {"temp": 0.0}
        if sampling is not None:
            settings = {"temp": sampling.temperature, "top_k": sampling.top_k}
            settings.update(top_p=sampling.top_p, min_p=0.0)

        def generate(prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Output:
            limit = self._limit(llm, prompt_ids, max_new_tokens)
            llm.reset()  # no reuse of the previous prompt's KV cache
            llm.set_seed(seed)
            start = time.perf_counter()
            # no repeat penalty; at temperature 0 llama.cpp's greedy sampler alone
            stream = llm.generate(prompt_ids, repeat_penalty=1.0, **settings)
            tokens = [next(stream)]
            prefilled = time.perf_counter()
            while tokens[-1] not in eos and len(tokens) < limit:
                tokens.append(next(stream))
            end = time.perf_counter()
            return Output(tokens, prefill_s=prefilled - start, decode_s=end - prefilled)

        return generate

    def _llama(self, n_ctx: int, **options: Any) -> Any:
        """A `llama_cpp.Llama` on the GGUF file with a context of `n_ctx` tokens rounded up to
        `LLAMA_CTX_PAD`, `--threads` threads, and `options` (further constructor arguments)."""
        n_ctx = -(-n_ctx // LLAMA_CTX_PAD) * LLAMA_CTX_PAD
        threads = torch.get_num_threads()
        return self.llama_cpp.Llama(
            model_path=self.lm.source,
            n_ctx=n_ctx,
            n_batch=min(n_ctx, 512),
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **options,
        )

    def _limit(self, llm: Any, prompt_ids: list[int], max_new_tokens: int) -> int:
        """How many new tokens fit after `prompt_ids` in `llm`'s context, at most
        `max_new_tokens`; raises `ConfigError` when the prompt itself does not fit."""
        context = min(llm.n_ctx(), self.lm.model.config.max_position)
        if len(prompt_ids) >= context:
            raise ConfigError(
                f"the prompt has {len(prompt_ids)} tokens but llama.cpp's context is "
                f"{context} (n_ctx)"
            )
        return min(max_new_tokens, context - len(prompt_ids))


BACKENDS: dict[str, Callable[[LoadedModel], Backend]] = {
    "delspec": DelspecBackend,
    "transformers": TransformersBackend,
    "economize": EconomizeBackend,
    "llama-cpp": LlamaCppBackend,
}


def lookup_setting(options: Mapping[str, Any]) -> tuple[int, int]:
    """(d, ngram) of prompt-lookup decoding from `options`: `draft_length` d, the most tokens
    copied from the context per round, and `ngram`, the longest n-gram of the context's end
    looked up earlier in it (`LOOKUP_DEFAULTS`). Raises `ConfigError` for another option or a
    value that is not a positive integer."""
    if unknown := sorted(set(options) - set(LOOKUP_DEFAULTS)):
        raise ConfigError(
            f"prompt lookup takes the options draft_length (d) and ngram, not {', '.join(unknown)}"
        )
    setting = {**LOOKUP_DEFAULTS, **options}
    for name, value in setting.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return setting["draft_length"], setting["ngram"]


def static_setting(lm: LoadedModel, options: Mapping[str, Any]) -> tuple[int, int]:
    """(E, d) from `options` (`exit_layer`, `draft_length`), with the `static` strategy's
    defaults and checks."""
    static = strategy_options("static", options)
    return exit_layer_for(static.exit_layer, lm.model.num_layers), static.draft_length


def load_transformers_model(lm: LoadedModel) -> Any:
    """The transformers model of the checkpoint `lm` was loaded from, in its dtype and device
    (a GGUF file's tensors as transformers' GGUF loader dequantises them, with the config delspec
    reads from the file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = Path(lm.source)
    if source.is_dir():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=lm.model.dtype)
    else:
        file = GGUFFile(source)
        config = AutoConfig.from_pretrained(file.directory)
        model = AutoModelForCausalLM.from_config(config, dtype=lm.model.dtype)
        state = {file.tensors[name].hf_name: file.get(short) for short, name in file.names.items()}
        missing = model.load_state_dict(state, strict=False).missing_keys
        if set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
            raise ModelFormatError(f"{source} has no tensor for {missing[0]!r}")
    return model.to(lm.model.device).eval()
