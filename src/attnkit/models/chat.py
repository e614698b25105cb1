"""A decoder's tokenizer and its chat template.

`DecoderTokenizer` wraps a Hugging Face `tokenizers.Tokenizer` with what a
decoder needs beside the vocabulary: which token starts and ends a sequence,
whether BOS is added, and the chat template, a Jinja program that turns a list
of `{"role": ..., "content": ...}` messages into the exact text the model was
trained on (for SmolLM2: `<|im_start|>user\\nHi<|im_end|>\\n`...).

Templates render in Jinja's sandbox with the same settings transformers uses
(`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII,
`raise_exception`, `strftime_now`), so the text is byte-for-byte what
`tokenizer.apply_chat_template` produces.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["DecoderTokenizer", "check_messages", "folder_tokenizer", "render_chat_template", "load_prompt"]

ROLES = ("system", "user", "assistant")
"""The roles a conversation's messages take (OpenAI's chat messages; chat templates know these)."""


def check_messages(value: Any) -> list[dict[str, str]]:
    """A conversation in OpenAI's messages shape, checked: what `attnkit chat`'s /load reads.

    Arguments:
        value: a list of `{"role": "system" | "user" | "assistant", "content": str}` dicts
            (as `json.load` gives them), or a dict holding such a list under "messages" (an
            OpenAI chat request body). Other keys of a message (`name`) are dropped.

    Returns:
        A new list of `{"role": ..., "content": ...}` dicts.

    Raises:
        ValueError: not a list, or a message that is not a dict, lacks a role or a content,
            has a role outside `ROLES` or a content that is not a string; the message names
            the first such message by its index and what arrived.
    """
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list):
        raise ValueError(f"expected a JSON list of messages ([{{\"role\": ..., \"content\": ...}}, ...]), "
                         f"got {_json_type(value)}")
    checked = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"expected messages[{index}] to be an object with 'role' and 'content', "
                             f"got {_json_type(message)}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"expected messages[{index}] to have '{key}', got keys {sorted(message)}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(f"expected messages[{index}]['role'] to be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"expected messages[{index}]['content'] to be a string, got {_json_type(content)}")
        checked.append({"role": role, "content": content})
    return checked


def _json_type(value: Any) -> str:
    """What a JSON value is, in JSON's words."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


@lru_cache(maxsize=8)
def _compile(template: str):
    from attnkit.runtime import require

    jinja2 = require("jinja2", "chat", "rendering a chat template")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(template)


def render_chat_template(
    template: str,
    messages: Sequence[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render a chat template as transformers' `apply_chat_template(..., tokenize=False)` does.

    Arguments:
        template: the Jinja source (GGUF `tokenizer.chat_template`, or `chat_template` in
            `tokenizer_config.json`).
        messages: `[{"role": "system"|"user"|"assistant", "content": str}, ...]`.
        add_generation_prompt: end with the header that starts the assistant's reply.
        variables: more template variables (`bos_token`, `eos_token`, ...).
    """
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"expected messages[{index}] to be a dict with 'role' and 'content', got {message!r}")
    return _compile(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
    )


class DecoderTokenizer:
    """Text <-> token ids for a decoder, plus its special tokens and chat template.

    BOS and EOS are added by the tokenizer's post-processor, as transformers does: a
    `tokenizer.json` brings its own (Llama 3's adds `<|begin_of_text|>`; SmolLM2's adds
    nothing), and `add_bos_token` / `add_eos_token` install one (what a GGUF file's
    `tokenizer.ggml.add_bos_token` asks for). Like transformers, BOS is added even when the
    text already starts with it.

    Arguments:
        tokenizer: a `tokenizers.Tokenizer`.
        bos_token, eos_token, pad_token: the special tokens' text, or None.
        add_bos_token, add_eos_token: replace the tokenizer's post-processor with one that puts
            BOS first / EOS last (transformers' `update_post_processor`); False leaves the
            tokenizer's own post-processor as it is.
        chat_template: Jinja source, or None for a model without one.
    """

    def __init__(
        self,
        tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        add_bos = add_bos_token and self.bos_token_id is not None
        add_eos = add_eos_token and self.eos_token_id is not None
        if add_bos or add_eos:  # transformers' update_post_processor
            from tokenizers import processors

            bos, eos = [f"{bos_token}:0"] if add_bos else [], [f"{eos_token}:0"] if add_eos else []
            single = [*bos, "$A:0", *eos]
            pair = [*single, *(f"{bos_token}:1" for _ in bos), "$B:1", *(f"{eos_token}:1" for _ in eos)]
            special = {bos_token: self.bos_token_id} if add_bos else {}
            special.update({eos_token: self.eos_token_id} if add_eos else {})
            tokenizer.post_processor = processors.TemplateProcessing(
                single=" ".join(single), pair=" ".join(pair), special_tokens=list(special.items())
            )

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode` puts BOS first (the post-processor's doing)."""
        bos = self.bos_token_id
        ids = self.tokenizer.encode("", add_special_tokens=True).ids
        return bos is not None and bool(ids) and ids[0] == bos

    # -- ids of special tokens -------------------------------------------------------------
    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        pad = self.token_to_id(self.pad_token)
        return self.eos_token_id if pad is None else pad

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # -- encoding and decoding -------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the post-processor adds them.

        Special tokens written in the text (`<|im_start|>`) become their single id.
        """
        if not isinstance(text, str):
            raise TypeError(f"expected text as str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def tokens(self, ids: Iterable[int]) -> list[str]:
        """Each id as readable text (byte-level pieces decoded, so `Ġcat` reads ` cat`)."""
        return [self.tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]

    def stream_decoder(self, *, skip_special_tokens: bool = True):
        """A `tokenizers.decoders.DecodeStream`: `.step(tokenizer.tokenizer, id)` gives the new text
        (or None while a multi-byte character is incomplete)."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the text the model was trained on (see `render_chat_template`)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; expected one for chat, got None")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
        )

    def encode_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (the template writes its own special tokens)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt),
                           add_special_tokens=False)

    # -- Hugging Face folders --------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> "DecoderTokenizer":
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `special_tokens_map.json`) from a folder.

        Every file is read only if it is a regular file (`checkpoint.is_model_file`).

        Raises:
            CheckpointError (a ValueError): no `tokenizer.json`, a file that is not a regular
                file, not UTF-8 or not a tokenizer; naming the file.
        """
        from tokenizers import Tokenizer

        from attnkit.models.checkpoint import CheckpointError, is_model_file, read_json, read_model_text

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not is_model_file(path):
            raise CheckpointError(f"expected {str(path)!r} (a Hugging Face fast tokenizer), found no such file")
        try:  # read here (a regular file, UTF-8), parsed by tokenizers: it never opens the path itself
            tokenizer = Tokenizer.from_str(read_model_text(path))
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise CheckpointError(f"cannot read {path}: {error}") from None
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            extra = folder / name
            if is_model_file(extra):
                config.update(read_json(extra))

        def text_of(value: Any) -> str | None:
            if isinstance(value, dict):
                return value.get("content")
            return value

        template = config.get("chat_template")
        chat_file = folder / "chat_template.jinja"
        if template is None and is_model_file(chat_file):
            template = read_model_text(chat_file)
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        # add_bos_token / add_eos_token in tokenizer_config.json are not read: transformers 5
        # builds its tokenizer from tokenizer.json, whose post-processor alone decides (measured
        # with every combination in tests/models/test_checkpoint_decoders.py), and so does attnkit.
        return cls(
            tokenizer,
            bos_token=text_of(config.get("bos_token")),
            eos_token=text_of(config.get("eos_token")),
            pad_token=text_of(config.get("pad_token")),
            chat_template=template,
        )


def folder_tokenizer(folder: str | os.PathLike[str], vocab_size: int, model: Any) -> DecoderTokenizer | None:
    """The decoder tokenizer of a Hugging Face folder (None without tokenizer.json), refused
    when it can produce an id past the model's `vocab_size` (`checkpoint.check_token_ids`).

    Arguments:
        model: the weights file, for the message.
    """
    from attnkit.models.checkpoint import check_token_ids, is_model_file

    path = Path(folder) / "tokenizer.json"
    if not is_model_file(path):
        return None
    tokenizer = DecoderTokenizer.from_folder(folder)
    check_token_ids(tokenizer.tokenizer, vocab_size, source=path, model=model)
    return tokenizer


def load_prompt(name: str = "attention-explainer") -> str:
    """A prompt shipped with attnkit (`attnkit/prompts/<name>.md`), e.g. the attention explainer."""
    from importlib.resources import files

    resource = files("attnkit").joinpath("prompts", f"{name}.md")
    if not resource.is_file():
        raise ValueError(f"expected a prompt shipped in attnkit/prompts, got unknown name {name!r}")
    return resource.read_text(encoding="utf-8")
