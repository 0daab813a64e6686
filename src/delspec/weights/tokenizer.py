"""A loaded model's tokenizer, and its light form that later loads build without transformers.

A GGUF file's cache entry holds the tokenizer transformers makes of the file's metadata, as
transformers saves it. Where that tokenizer does nothing the `tokenizers` library does not do
itself (`_light_is_exact`), the entry also holds its light form: the backend tokenizer exactly as
transformers configured it (`LIGHT_BACKEND`) and what transformers keeps beside it
(`LIGHT_META`: the special tokens, the chat template). `LightTokenizer` is built from those alone.
It answers what delspec asks of a tokenizer (encode, decode, the special tokens and their ids,
the vocabulary, the chat template) as transformers' tokenizer answers, and leaves anything else
to transformers' tokenizer, built from the entry on first need.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from delspec.errors import ModelFormatError
from delspec.weights.chat_template import render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LIGHT_BACKEND = "light-tokenizer.json"  # in the cache entry: the backend tokenizer
LIGHT_META = "light-tokenizer-meta.json"  # ...and what transformers keeps beside it
# transformers' methods whose work `LightTokenizer` does itself: a tokenizer class that overrides
# any of them gets no light form
_LIGHT_METHODS = (
    "encode",
    "decode",
    "_decode",
    "_encode_plus",
    "convert_tokens_to_ids",
    "_convert_token_to_id_with_added_voc",
    "convert_ids_to_tokens",
    "get_vocab",
    "__len__",
    "apply_chat_template",
    "get_chat_template",
)
# `apply_chat_template` arguments that do more than render the template: left to transformers
_TRANSFORMERS_ONLY = frozenset(
    {
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# attributes of its own, never looked up in transformers' tokenizer (one that raises
# AttributeError while being set or computed is missing, not transformers')
_OWN = frozenset(
    {"backend_tokenizer", "special_tokens_map", "_attributes", "_chat_template", "_directory"}
    | {"_full", "transformers_tokenizer", "chat_template", "vocab_size"}
)
_BUILDING = threading.Lock()  # one transformers tokenizer per light one, built once


class LightTokenizer:
    """A cache entry's tokenizer without transformers (module docstring). Read-only, but for
    `chat_template`."""

    def __init__(self, directory: Path) -> None:
        """The light form saved in cache entry `directory` (`ModelFormatError` if unreadable)."""
        try:
            meta = json.loads((directory / LIGHT_META).read_text(encoding="utf-8"))
            backend = tokenizers.Tokenizer.from_file(str(directory / LIGHT_BACKEND))
            self.special_tokens_map: dict[str, str] = dict(meta["special_tokens_map"])
            self._attributes = tuple(meta["special_token_attributes"])
            self._chat_template: str | None = meta["chat_template"]
        except Exception as exc:  # tokenizers raises Exception on a file it cannot parse
            raise ModelFormatError(f"{directory} has no usable tokenizer: {exc}") from exc
        backend.encode_special_tokens = False  # transformers' split_special_tokens, not saved
        self.backend_tokenizer = backend
        self._directory = directory
        self._full: PreTrainedTokenizerBase | None = None

    @property
    def transformers_tokenizer(self) -> PreTrainedTokenizerBase:
        """transformers' tokenizer of the same entry (with this one's chat template), built on
        first use."""
        with _BUILDING:
            if self._full is None:
                full = transformers_tokenizer(self._directory)
                full.chat_template = self._chat_template
                self._full = full
        return self._full

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template
        if self._full is not None:
            self._full.chat_template = template

    def encode(
        self, text: Any, text_pair: Any = None, add_special_tokens: bool = True, **kwargs: Any
    ) -> list[int]:
        if not isinstance(text, str) or text_pair is not None or kwargs:
            return self.transformers_tokenizer.encode(
                text, text_pair, add_special_tokens=add_special_tokens, **kwargs
            )
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
        if isinstance(ids, int):
            ids = [ids]
        if kwargs or not isinstance(ids, list | tuple) or not all(isinstance(i, int) for i in ids):
            return self.transformers_tokenizer.decode(
                token_ids, skip_special_tokens=skip_special_tokens, **kwargs
            )
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | Any) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if skip_special_tokens:
            return self.transformers_tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=True)
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(index)) for index in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.transformers_tokenizer(*args, **kwargs)

    def apply_chat_template(
        self,
        conversation: Any,
        tools: Any = None,
        documents: Any = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """transformers' `apply_chat_template`: rendered here when it asks for the text alone
        (`chat_template.render_chat`), else by transformers."""
        template = self._chat_template if chat_template is None else chat_template
        rendered = None
        renders = not tokenize and not continue_final_message and isinstance(template, str)
        if renders and not _TRANSFORMERS_ONLY & kwargs.keys():
            variables = {**self.special_tokens_map, **kwargs}
            rendered = render_chat(
                template, conversation, tools, documents, add_generation_prompt, variables
            )
        if rendered is not None:
            return rendered
        return self.transformers_tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=tokenize,
            **kwargs,
        )

    def __getattr__(self, name: str) -> Any:
        """The special tokens (`eos_token`, `eos_token_id`, ...) as transformers gives them;
        any other attribute from transformers' tokenizer."""
        if name.startswith("__") or name in _OWN:  # not set yet (while copying)
            raise AttributeError(name)
        base = name.removesuffix("_id")
        if base in self._attributes:
            token = self.special_tokens_map.get(base)
            if token is None or base == name:
                return token
            return self.convert_tokens_to_ids(token)
        return getattr(self.transformers_tokenizer, name)


def load_tokenizer(directory: Path, cache_entry: bool) -> LightTokenizer | PreTrainedTokenizerBase:
    """The tokenizer saved in `directory`: a GGUF file's cache entry (`cache_entry`), in its
    light form where it has one, else a Hugging Face model directory's, by transformers."""
    if not cache_entry:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    if (directory / LIGHT_META).is_file():
        return LightTokenizer(directory)
    return transformers_tokenizer(directory)


def transformers_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer saved in cache entry `directory`, by the class saved with it
    (AutoTokenizer would first import the model's transformers modules for its config)."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    path = directory / "tokenizer_config.json"
    try:
        name = json.loads(path.read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelFormatError(f"cannot read {path}: {exc}") from exc
    tokenizer_class = tokenizer_class_from_name(name) if isinstance(name, str) else None
    if tokenizer_class is None:
        raise ModelFormatError(f"{directory} names no known tokenizer class ({name!r})")
    return tokenizer_class.from_pretrained(directory)


def full_tokenizer(tokenizer: Any) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for `tokenizer`: itself, or the one a light tokenizer stands for."""
    return tokenizer.transformers_tokenizer if isinstance(tokenizer, LightTokenizer) else tokenizer


def write_light_tokenizer(directory: Path) -> None:
    """Write the light form of the tokenizer saved in cache entry `directory` into it, where
    that tokenizer has one (`_light_is_exact`)."""
    full = transformers_tokenizer(directory)
    if not _light_is_exact(full):
        return
    (directory / LIGHT_BACKEND).write_text(full.backend_tokenizer.to_str(), encoding="utf-8")
    meta = {
        "special_tokens_map": full.special_tokens_map,
        "special_token_attributes": list(full.SPECIAL_TOKENS_ATTRIBUTES),
        "chat_template": full.chat_template,
    }
    (directory / LIGHT_META).write_text(json.dumps(meta), encoding="utf-8")


def _light_is_exact(full: PreTrainedTokenizerBase) -> bool:
    """Whether `LightTokenizer` behaves as transformers' tokenizer `full`: a fast tokenizer of a
    class that keeps transformers' own encoding, decoding and chat template methods, with one
    chat template (or none), no clean-up of decoded text, special tokens not split, and neither
    truncation nor padding in its backend."""
    from transformers import TokenizersBackend

    if not isinstance(full, TokenizersBackend):
        return False
    kind, backend = type(full), full.backend_tokenizer
    return (
        all(getattr(kind, m) is getattr(TokenizersBackend, m) for m in _LIGHT_METHODS)
        and (full.chat_template is None or isinstance(full.chat_template, str))
        and not full.clean_up_tokenization_spaces
        and not full.split_special_tokens
        and backend.truncation is None
        and backend.padding is None
    )
