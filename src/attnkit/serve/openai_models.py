"""The models behind `attnkit serve`'s OpenAI-compatible API, and how a completion is produced.

A `ModelPool` knows, without loading anything, what each name it serves is: an
encoder (embeddings: "minilm", a BERT folder) or a decoder (completions and chat:
"smollm2", "gemma3", a `.gguf` file, a Llama/Qwen2/Mistral/Gemma 3/GPT-2 folder). It loads a model
on the first request that names it (or all at once with `load_all`), once, and
keeps one lock per model: the requests of one model run one after another (its
weights are shared and a generation holds a KV cache of its own, but NumPy work
from two requests would only share the same CPUs), those of different models side
by side.

`complete` turns prompt ids into text as OpenAI's API does: stop strings end the
text before them (and count only in the generated text, never in the prompt),
an end-of-sequence token ends it with finish_reason "stop", `max_tokens` with
"length". It yields the text in pieces that are final (nothing that a stop string
could still take back, no half of a UTF-8 character), then a `Completion`: the
pieces joined are exactly the completion's text, streamed or not.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Completion", "ModelPool", "complete", "end_of_sequence_ids", "model_kind", "token_count"]

EMBEDDINGS = "embeddings"
"""The kind of an encoder: it answers /v1/embeddings."""
GENERATION = "generation"
"""The kind of a decoder: it answers /v1/completions and /v1/chat/completions."""


def model_kind(name: str) -> str | None:
    """What a served name is, read from names and config files only (nothing loads):
    EMBEDDINGS, GENERATION, or None (no text model: "random", a transformers-only
    architecture, a path that holds no model)."""
    if name == "minilm":
        return EMBEDDINGS
    if name in ("smollm2", "gemma3"):  # the embedded decoders
        return GENERATION
    if name == "random":
        return None
    path = Path(name).expanduser()
    if path.is_file():
        return GENERATION if path.suffix.lower() == ".gguf" else None
    if not path.is_dir():
        return None
    config = path / "config.json"
    if not config.is_file():
        return GENERATION if len(list(path.glob("*.gguf"))) == 1 else None
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
        model_type, architectures = settings.get("model_type"), settings.get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    if model_type == "bert":
        return EMBEDDINGS
    from attnkit.models.auto import CAUSAL_LM_TYPES

    language_model = not architectures or any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    return GENERATION if model_type in CAUSAL_LM_TYPES and language_model else None


class ModelLoadError(ValueError):
    """A served model could not be loaded; the message says why (and how to install it)."""


class ModelPool:
    """The encoders and decoders one server answers for, loaded on first use.

    Arguments:
        names: model names ("minilm", "smollm2") and paths, as `attnkit serve --model`
            takes them; those that are neither an encoder nor a decoder attnkit runs
            ("random", a transformers-only folder) are left out.

    Attributes:
        kinds: {name: EMBEDDINGS or GENERATION}, in the order given.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.kinds = {name: kind for name in dict.fromkeys(names) if (kind := model_kind(name))}
        self._loaded: dict[str, Any] = {}
        self._failed: dict[str, str] = {}
        self._load_locks = {name: threading.Lock() for name in self.kinds}
        self._locks = {name: threading.Lock() for name in self.kinds}

    def lock(self, name: str) -> threading.Lock:
        """The lock every use of model `name` holds (one request at a time per model)."""
        return self._locks[name]

    def get(self, name: str) -> Any:
        """Model `name`, loaded on the first call: a `SentenceEncoder` or a `CausalLM`.

        Raises:
            KeyError: not a name this pool serves.
            ModelLoadError: it cannot be loaded (the same error again on every later call).
        """
        with self._load_locks[name]:
            if name in self._failed:
                raise ModelLoadError(self._failed[name])
            if name not in self._loaded:
                try:
                    self._loaded[name] = self._load(name)
                except ModelLoadError as error:
                    self._failed[name] = str(error)
                    raise
            return self._loaded[name]

    def is_loaded(self, name: str) -> bool:
        """Whether model `name` has been loaded (by a request, or `load_all`)."""
        return name in self._loaded

    def load_all(self) -> None:
        """Load every model now (`attnkit serve --preload`); raises the first ModelLoadError."""
        for name in self.kinds:
            self.get(name)

    def _load(self, name: str) -> Any:
        from attnkit.extras import MissingExtraError

        try:
            if self.kinds[name] == EMBEDDINGS:
                from attnkit.models.sentence import SentenceEncoder

                return SentenceEncoder.from_pretrained(name)
            from attnkit.models.auto import AutoCausalLM

            model = AutoCausalLM.from_pretrained(name)
        except MissingExtraError as error:
            raise ModelLoadError(str(error)) from error
        except Exception as error:  # noqa: BLE001 - whatever a model file makes a loader raise, said once
            raise ModelLoadError(f"cannot load the model {name!r}: {type(error).__name__}: {error}") from error
        if model.tokenizer is None:
            raise ModelLoadError(f"the model {name!r} has no tokenizer.json; the API needs one to read text")
        return model


def token_count(encoder: Any, texts: Sequence[str]) -> list[int]:
    """How many tokens each text has for `encoder` (a `SentenceEncoder`), [CLS] and [SEP]
    included, counting what its tokenizer would cut at `max_seq_length`."""
    counts = []
    for encoding in encoder.tokenizer.encode(list(texts)):
        # what did not fit is in `overflowing`, each part with its own [CLS]/[SEP]
        counts.append(len(encoding.ids) + sum(
            len(part.ids) - sum(part.special_tokens_mask) for part in encoding.overflowing
        ))
    return counts


def end_of_sequence_ids(model: Any) -> set[int]:
    """Every token id that ends a decoder's text: its config's (an id or a list) and its tokenizer's."""
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    ids.add(model.tokenizer.eos_token_id)
    return {int(i) for i in ids if i is not None}


@dataclass(frozen=True)
class Completion:
    """How a completion ended.

    text: the completion's text (the pieces `complete` yielded, joined).
    finish_reason: "stop" (an end-of-sequence token or a stop string) or "length" (max_tokens).
    prompt_tokens, completion_tokens: the usage counts (every generated token, the one
        that ended the text included).
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def _first_stop(text: str, stops: Sequence[str]) -> int:
    """Where the first stop string starts in `text`, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


def complete(
    model: Any,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    cancelled: Callable[[], bool] = lambda: False,
) -> Iterator[str | Completion]:
    """Generate from `prompt_ids` with a `CausalLM`: yields text pieces as they become final,
    then one `Completion`.

    Arguments:
        model: a decoder with a tokenizer.
        prompt_ids: the prompt's token ids (the chat template already applied for chat).
        max_tokens: the most tokens to generate (>= 1; the caller checks the context).
        temperature, top_p, seed: sampling as `CausalLM.stream` does it (0 = greedy).
        stop: strings that end the text; the text ends just before the first one, and
            never holds it.
        cancelled: polled before each new token; True stops (the client went away).

    A piece is held back while a stop string could still begin in it (the last
    len(longest stop) - 1 characters) or while it ends in half a character.
    """
    tokenizer = model.tokenizer
    eos = end_of_sequence_ids(model)
    hold = max((len(s) for s in stop), default=1) - 1
    new: list[int] = []
    text, emitted, finish = "", 0, "length"
    steps = model.stream(np.asarray(prompt_ids, dtype=np.int64), max_tokens, temperature, None, top_p, seed)
    try:
        for step in steps:
            token = int(step[0])
            new.append(token)
            if token in eos:
                finish = "stop"
                break
            text = tokenizer.decode(new, skip_special_tokens=True)
            cut = _first_stop(text, stop)
            if cut >= 0:
                text, finish = text[:cut], "stop"
                break
            safe = len(text) - hold
            while safe > emitted and text[safe - 1] == "\ufffd":  # half a character so far
                safe -= 1
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if cancelled():
                break
    finally:
        steps.close()
    if len(text) > emitted:
        yield text[emitted:]
    yield Completion(text, finish, len(prompt_ids), len(new))
