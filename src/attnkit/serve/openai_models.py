"""The models behind `attnkit serve`'s OpenAI-compatible API, and how a completion is produced.

A `ModelPool` knows, without loading anything, what each name it serves is: an
encoder (embeddings: "minilm", a BERT folder) or a decoder (completions and chat:
"smollm2", "gemma3", a `.gguf` file, a Llama/Qwen2/Mistral/Gemma 3/GPT-2 folder). It loads a model
on the first request that names it (or all at once with `load_all`), once. A decoder's
completions run on its `Engine` (`attnkit.serve.engine`: continuous batching on a paged KV
cache), made on first use; a decoder the batched step does not run (and a request that asks
for attention through the API) runs alone under the model's lock (`attnkit.serve.solo`).
An encoder's requests go through its `EmbeddingBatcher` (`attnkit.serve.embeddings`):
requests that wait together are encoded together.

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

__all__ = ["Completion", "ModelPool", "TextStream", "complete", "end_of_sequence_ids", "model_kind", "token_count"]

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
        engine_options: the keyword arguments of every decoder's `Engine` (max_batch,
            kv_tokens, step_tokens, max_queue); None: no engine, every request runs alone.

    Attributes:
        kinds: {name: EMBEDDINGS or GENERATION}, in the order given.
        engine_reasons: {name: why its decoder runs without the engine}, for those that do.
    """

    def __init__(self, names: Sequence[str], *, engine_options: dict[str, Any] | None = None) -> None:
        self.kinds = {name: kind for name in dict.fromkeys(names) if (kind := model_kind(name))}
        self.engine_options = engine_options
        self.engine_reasons: dict[str, str] = {}
        self._loaded: dict[str, Any] = {}
        self._failed: dict[str, str] = {}
        self._engines: dict[str, Any] = {}
        self._batchers: dict[str, Any] = {}
        self._load_locks = {name: threading.Lock() for name in self.kinds}
        self._locks = {name: threading.Lock() for name in self.kinds}

    def engine(self, name: str) -> Any:
        """Decoder `name`'s `Engine`, made on the first call, or None when it runs without one
        (no engine_options, or the batched step does not take this model: `engine_reasons`)."""
        model = self.get(name)
        with self._load_locks[name]:
            if name not in self._engines:
                self._engines[name] = None
                from attnkit.models.llama import LlamaForCausalLM

                if self.engine_options is None:
                    self.engine_reasons[name] = "this server runs every request alone"
                elif not isinstance(model, LlamaForCausalLM):  # the batched step runs Llama-family decoders
                    self.engine_reasons[name] = ("the batched step runs Llama-family decoders, not "
                                                 f"{type(model).__name__}")
                else:
                    try:
                        from attnkit.serve.engine import Engine

                        self._engines[name] = Engine(model, **self.engine_options)
                    except (ImportError, ValueError, TypeError, NotImplementedError) as error:
                        self.engine_reasons[name] = f"the batched step does not run it: {error}"
            return self._engines[name]

    def embedder(self, name: str) -> Any:
        """Encoder `name`'s `EmbeddingBatcher`, made on the first call."""
        encoder = self.get(name)
        with self._load_locks[name]:
            if name not in self._batchers:
                from attnkit.serve.embeddings import EmbeddingBatcher

                self._batchers[name] = EmbeddingBatcher(encoder, self._locks[name])
            return self._batchers[name]

    def close(self) -> None:
        """Stop the engines' threads (open requests end with EngineStopped)."""
        for engine in list(self._engines.values()):
            if engine is not None:
                engine.close()

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
    cached_tokens: the prompt tokens that came from the prefix cache.
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


def _first_stop(text: str, stops: Sequence[str]) -> int:
    """Where the first stop string starts in `text`, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


class TextStream:
    """A completion's text as its tokens arrive, in pieces that are final.

    `add(token)` returns the text that became final with it ("" while held back) and
    whether the completion has ended (an end-of-sequence token, or a stop string: the text
    ends just before it); `close()` returns the rest. `text`, `finish_reason` ("stop" or
    "length") and `tokens` (every token added) say how it ended; `kept` counts the tokens
    whose text is in the completion (those before an end-of-sequence token or the token
    that completed a stop string).

    A piece is held back while a stop string could still begin in it (the last
    len(longest stop) - 1 characters) or while it ends in half a character.
    """

    def __init__(self, tokenizer: Any, eos: set[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.eos, self.stop = tokenizer, eos, list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text, self.emitted, self.finish_reason, self.kept = "", 0, "length", 0
        self.ended = False

    def add(self, token: int) -> tuple[str, bool]:
        self.tokens.append(int(token))
        if token in self.eos:
            self.finish_reason, self.ended = "stop", True
            return "", True
        text = self.tokenizer.decode([t for t in self.tokens if t not in self.eos], skip_special_tokens=True)
        cut = _first_stop(text, self.stop)
        if cut >= 0:
            self.text, self.finish_reason, self.ended = text[:cut], "stop", True
            return "", True
        self.text, self.kept = text, len(self.tokens)
        safe = len(text) - self.hold
        while safe > self.emitted and text[safe - 1] == "\ufffd":  # half a character so far
            safe -= 1
        if safe > self.emitted:
            piece, self.emitted = text[self.emitted:safe], safe
            return piece, False
        return "", False

    def close(self) -> str:
        """The text not sent yet."""
        rest, self.emitted = self.text[self.emitted:], len(self.text)
        return rest


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
    then one `Completion` (one request at a time, on the model's own `stream`; `attnkit serve`
    batches requests with `attnkit.serve.engine.Engine` instead).

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
    text = TextStream(model.tokenizer, end_of_sequence_ids(model), stop)
    steps = model.stream(np.asarray(prompt_ids, dtype=np.int64), max_tokens, temperature, None, top_p, seed)
    try:
        for step in steps:
            piece, ended = text.add(int(step[0]))
            if piece:
                yield piece
            if ended or cancelled():
                break
    finally:
        steps.close()
    rest = text.close()
    if rest:
        yield rest
    yield Completion(text.text, text.finish_reason, len(prompt_ids), len(text.tokens))
