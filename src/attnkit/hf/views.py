"""attnkit's views of any transformers architecture: a model folder in, every head's map out.

    from attnkit.hf.views import TransformersViewModel

    model = TransformersViewModel.from_folder("qwen2-folder")   # config.json + weights + tokenizer.json
    result = model.attention("The cat sat on the mat.")
    result.tokens, result.weights        # T token texts, (layers, H, T, T) float32

This is what `attnkit show TEXT --model PATH` runs for a folder of an architecture
attnkit has no port of (attnkit.viz.providers chooses). The model loads through
transformers with attnkit's "attnkit" attention (`attnkit.hf.register()`), and its
maps come from `attnkit.record_attention(model)`, the recorder attnkit's own models
use (`attnkit.hf.recording` finds the attention modules).

- Encoder (BERT-like) and decoder (GPT-like): one map per layer.
- Encoder-decoder (BART, T5): the decoder reads the same tokens as the encoder
  (teacher forcing), so every map is (T, T): the encoder's layers, then each decoder
  layer's self attention and its cross attention (queries: the decoder's tokens,
  keys: the encoder's), named in `layer_names`.

The tokenizer is the folder's tokenizer.json, read by Hugging Face `tokenizers`, and
it tokenizes as transformers' tokenizer call does: no padding and no truncation from
tokenizer.json (only `max_tokens` and the model's positions cut a text).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from attnkit import runtime
from attnkit.hf import recording

__all__ = ["AttentionResult", "TransformersViewModel"]

_PURPOSE = "Showing a transformers model's attention"
"""What needs the `hf` extra, for the message naming it."""

_CROSS_KWARGS = ("key_value_states", "encoder_hidden_states")
"""The keyword with which transformers hands an attention module the encoder's states:
a call with one of them set is cross attention."""


@dataclass(frozen=True)
class AttentionResult:
    """One text through a transformers model.

    tokens: the T token texts. weights: (layers, H, T, T) float32, one map per
    attention call in call order. layer_names: a name per layer ("encoder 0",
    "decoder 0", "decoder 0 cross attention"), or None when every layer is the same kind.
    full_count: tokens in the whole text (more than T when it was truncated).
    special: T flags, True for the tokenizer's special tokens.
    """

    tokens: list[str]
    weights: np.ndarray
    layer_names: tuple[str, ...] | None
    full_count: int
    special: list[bool]


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' loading without its progress bars and warnings (the CLI prints; the
    library does not), restored afterwards."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


class TransformersViewModel:
    """A transformers model with its tokenizer, run for attnkit's views.

    Arguments:
        model: a transformers model loaded with attn_implementation="attnkit" (any
            "attnkit*" implementation records), in eval mode.
        tokenizer: a `tokenizers.Tokenizer`.
    """

    def __init__(self, model: Any, tokenizer: Any) -> None:
        implementation = getattr(model.config, "_attn_implementation", None)
        if not str(implementation).startswith("attnkit"):
            raise ValueError(
                f"expected a model loaded with attn_implementation='attnkit', got {implementation!r}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        self.max_positions = _max_positions(model)
        self.modules = recording.attention_modules(model)
        self._layer_names: tuple[str, ...] | None = None
        self.causal = bool(self.modules) and not self.encoder_decoder and all(
            bool(getattr(m, "is_causal", False)) for m in self.modules
        )

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> "TransformersViewModel":
        """Load a transformers model folder (config.json, its weights, tokenizer.json).

        Raises:
            MissingExtraError: torch or transformers is not installed (the `hf` extra).
            ValueError: the folder has no config.json or tokenizer.json, or transformers
                cannot build the architecture with attnkit's attention.
        """
        torch = runtime.require("torch", "hf", _PURPOSE)
        transformers = runtime.require("transformers", "hf", _PURPOSE)
        from tokenizers import Tokenizer

        from attnkit.hf import register

        folder = Path(path).expanduser()
        for needed in ("config.json", "tokenizer.json"):
            if not (folder / needed).is_file():
                raise ValueError(
                    f"expected a transformers model folder holding {needed}, found none in {str(folder)!r}"
                )
        try:
            model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError) as error:
            raise ValueError(f"cannot read {str(folder / 'config.json')!r}: {error}") from error
        register()
        with _quiet(transformers):
            try:
                model = transformers.AutoModel.from_pretrained(
                    folder, attn_implementation="attnkit", dtype=torch.float32
                )
            except (ValueError, KeyError, OSError) as error:
                raise ValueError(
                    f"transformers cannot load the {model_type!r} model in {str(folder)!r} with attnkit's "
                    f"attention: {error}"
                ) from error
        model.eval()
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # As transformers' tokenizer call does: the padding and truncation a tokenizer.json may
        # carry (sentence-transformers' MiniLM: padded to a fixed 128, cut at 128) apply only
        # when asked. Kept, a 7-word sentence would be 128 positions, most of them [PAD].
        tokenizer.no_padding()
        tokenizer.no_truncation()
        return cls(model, tokenizer)

    def layer_names(self) -> tuple[str, ...] | None:
        """The name of each map `attention` returns (see `AttentionResult`), found by running one token."""
        if not self.encoder_decoder:
            return None
        if self._layer_names is None:
            ids = self.tokenizer.encode("a").ids or [0]
            self._layer_names = self.run(ids[:1])[1]
        return self._layer_names

    def attention(self, text: str, *, max_tokens: int | None = None) -> AttentionResult:
        """Every attention map of the model on `text` (see `AttentionResult`).

        Arguments:
            max_tokens: keep at most this many tokens (also at most the model's positions).

        Raises:
            ValueError: the text has no token, or the model's attention calls cannot be
                stacked (layers with different head counts, or maps that are not (T, T)).
        """
        limit = max_tokens
        if self.max_positions is not None:
            limit = self.max_positions if limit is None else min(limit, self.max_positions)
        encoding = self.tokenizer.encode(text)
        full = len(encoding.ids)
        if limit is not None and full > limit:  # cut to `limit` tokens, the special tokens kept
            self.tokenizer.enable_truncation(limit)
            try:
                encoding = self.tokenizer.encode(text)
            finally:
                self.tokenizer.no_truncation()
        ids = list(encoding.ids)
        if not ids:
            raise ValueError("expected a text with at least one token, got none")
        weights, names = self.run(ids)
        tokens = [self.tokenizer.decode([i], skip_special_tokens=False) or token
                  for i, token in zip(ids, encoding.tokens)]
        special = [bool(s) for s in encoding.special_tokens_mask]
        return AttentionResult(tokens, weights, names, full, special)

    def run(self, ids: list[int]) -> tuple[np.ndarray, tuple[str, ...] | None]:
        """The maps of one forward pass on token `ids`: (layers, H, T, T) float32 and the layer names."""
        import torch

        from attnkit.nn.interface import record_attention

        input_ids = torch.tensor([ids], dtype=torch.long)  # (1, T)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        if self.encoder_decoder:
            inputs["decoder_input_ids"] = input_ids  # teacher forcing on the same tokens: all maps (T, T)
        if getattr(self.model.config, "use_cache", None):
            inputs["use_cache"] = False  # one pass: no cache to build
        calls: list[tuple[Any, bool]] = []

        def note(module: Any, args: tuple, kwargs: dict) -> None:
            calls.append((module, any(kwargs.get(name) is not None for name in _CROSS_KWARGS)))

        hooks = [m.register_forward_pre_hook(note, with_kwargs=True) for m in self.modules]
        try:
            with torch.no_grad(), record_attention(self.model) as maps:
                self.model(**inputs)
        finally:
            for hook in hooks:
                hook.remove()
        return _stack(list(maps), self._names(calls, len(maps)))

    def _names(self, calls: list[tuple[Any, bool]], count: int) -> tuple[str, ...] | None:
        """A name per map for an encoder-decoder ("encoder 3", "decoder 1", "decoder 1 cross
        attention"); None for a model whose layers are all alike."""
        if not self.encoder_decoder:
            return None
        if len(calls) != count:
            raise ValueError(
                f"expected one attention map per attention module call, got {count} maps from {len(calls)} calls "
                f"in {type(self.model).__name__}"
            )
        names, encoder, decoder = [], 0, -1
        for module, cross in calls:
            if cross:
                names.append(f"decoder {decoder} cross attention")
            elif getattr(module, "is_causal", False) or getattr(module, "is_decoder", False):
                decoder += 1
                names.append(f"decoder {decoder}")
            else:
                names.append(f"encoder {encoder}")
                encoder += 1
        return tuple(names)


def _stack(maps: list[np.ndarray], names: tuple[str, ...] | None) -> tuple[np.ndarray, tuple[str, ...] | None]:
    """One (B=1, H, T, T) map per call -> (layers, H, T, T)."""
    if not maps:
        raise ValueError("the model made no attention call that attnkit recorded")
    shapes = sorted({m.shape for m in maps})
    if len(shapes) != 1 or shapes[0][0] != 1 or shapes[0][2] != shapes[0][3]:
        raise ValueError(f"expected every attention map of shape (1, H, T, T) to show them together, got {shapes}")
    return np.stack([m[0] for m in maps]).astype(np.float32, copy=False), names


def _max_positions(model: Any) -> int | None:
    """The most tokens the model's position embeddings take, or None (relative positions, T5).
    RoBERTa-like embeddings start counting after the padding id, so they take fewer."""
    config = model.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if getattr(config, "model_type", "") == "t5" or not isinstance(positions, int):
        return None
    padding = getattr(getattr(model, "embeddings", None), "padding_idx", None)
    return positions - (padding + 1) if isinstance(padding, int) else positions
