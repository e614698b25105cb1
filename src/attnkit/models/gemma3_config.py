"""Gemma 3's hyperparameters (`Gemma3Config`) and the readers of a checkpoint's keys: a
Hugging Face `gemma3_text` config.json (`config_from_hf`) and llama.cpp's "gemma3" GGUF
metadata (`config_from_gguf`), every key read, harmless or refused by name. The model is
in `attnkit.models.gemma3`, the weight names and shapes in `attnkit.models.gemma3_weights`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.checkpoint import CheckpointError, ConfigReader, is_model_file, read_json
from attnkit.models.gguf import GGUFFile, check_metadata_keys
from attnkit.nn.positional import RopeScaling

__all__ = ["FULL", "SLIDING", "Gemma3Config", "config_from_gguf", "config_from_hf", "default_layer_types"]

FULL, SLIDING = "full_attention", "sliding_attention"


def default_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's pattern: every `pattern`-th layer global, the others local."""
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


@dataclass(frozen=True)
class Gemma3Config:
    """Hyperparameters of a Gemma 3 text decoder (defaults: Gemma 3 270M)."""

    vocab_size: int = 262144
    hidden_size: int = 640  # d_model
    intermediate_size: int = 2048  # d_ff of the gated MLP
    num_layers: int = 18  # num_hidden_layers
    num_heads: int = 4  # num_attention_heads
    num_kv_heads: int = 1  # num_key_value_heads
    head_dim: int = 256
    rope_theta: float = 1_000_000.0  # global layers (rope_parameters["full_attention"])
    rope_local_theta: float = 10_000.0  # local layers (rope_parameters["sliding_attention"])
    rope_scaling: RopeScaling | None = None  # global layers only (linear for the larger Gemma 3)
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512  # a local layer's query sees its last `sliding_window` keys, itself included
    layer_types: tuple[str, ...] | None = None  # None: default_layer_types(num_layers)
    query_pre_attn_scalar: float = 256.0  # scores scaled by query_pre_attn_scalar ** -0.5
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768
    bos_token_id: int | None = 2
    eos_token_id: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_id, (int, np.integer)):
            object.__setattr__(self, "eos_token_id", (int(self.eos_token_id),))
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {FULL, SLIDING}:
            raise ValueError(
                f"expected layer_types to give {FULL!r} or {SLIDING!r} for each of the {self.num_layers} layers, "
                f"got {self.layer_types!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"expected num_heads ({self.num_heads}) to be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"expected an even head_dim for rotary embeddings, got {self.head_dim}")
        if self.sliding_window < 1:
            raise ValueError(f"expected sliding_window >= 1, got {self.sliding_window}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: a global layer)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5


# ----------------------------------------------------------------------------- Hugging Face folders

_HF_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rope_local_base_freq", "rope_parameters", "rope_scaling",
    "rms_norm_eps", "sliding_window", "layer_types", "sliding_window_pattern", "_sliding_window_pattern",
    "query_pre_attn_scalar", "final_logit_softcapping", "max_position_embeddings", "bos_token_id",
    "eos_token_id", "hidden_activation", "model_type",
}
_HF_HARMLESS = {
    "pad_token_id", "initializer_range", "attention_dropout", "use_cache", "torch_dtype", "dtype",
    "architectures", "transformers_version", "cache_implementation", "tie_word_embeddings",
}
_HF_NEUTRAL = {
    "attn_logit_softcapping": (None,),
    "attention_bias": (False,),
    "use_bidirectional_attention": (False, None),
    "hidden_act": ("gelu_pytorch_tanh", None),
}


def _hf_rope(config: dict[str, Any], source) -> tuple[float, float, RopeScaling | None]:
    """(global base, local base, global scaling) from `rope_parameters` (transformers 5: one
    entry per layer type) or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    if isinstance(params, dict) and {FULL, SLIDING} & set(params):
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    else:
        full = dict(params or {}, rope_theta=config.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    for kind, entry in ((FULL, full), (SLIDING, local)):
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        allowed = ("default", "linear") if kind == FULL else ("default",)
        if rope_type not in allowed:
            raise CheckpointError(f"{source}: rope type {rope_type!r} of the {kind} layers is not supported by "
                                  f"attnkit's Gemma 3 (expected {' or '.join(allowed)})")
    scaling = None
    if full.get("rope_type", full.get("type")) == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(full["factor"]))
    return float(full.get("rope_theta", 1_000_000.0)), float(local.get("rope_theta", 10_000.0)), scaling


def config_from_hf(config: dict[str, Any], source: str | os.PathLike[str] = "config.json") -> Gemma3Config:
    """A `Gemma3Config` from a `gemma3_text` config.json (every key read, harmless, or refused)."""
    read = ConfigReader(config, source)
    if config.get("model_type") != "gemma3_text":
        raise CheckpointError(f"{source}: expected model_type 'gemma3_text', got {config.get('model_type')!r}")
    read.check_keys(_HF_KEYS, neutral=_HF_NEUTRAL, harmless=_HF_HARMLESS, what="attnkit's Gemma 3")
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise CheckpointError(f"{source}: expected hidden_activation 'gelu_pytorch_tanh', got {activation!r}")
    if config.get("tie_word_embeddings", True) is not True:
        raise CheckpointError(f"{source}: attnkit's Gemma 3 ties its output head to the embedding; "
                              "tie_word_embeddings false is not supported")
    layers = read.integer("num_hidden_layers")
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = default_layer_types(layers, int(config.get("sliding_window_pattern", 6)))
    rope_theta, rope_local_theta, scaling = _hf_rope(config, source)
    cap = config.get("final_logit_softcapping")
    eos = read.token_ids("eos_token_id")
    bos = read.token_ids("bos_token_id")
    try:
        return Gemma3Config(
            vocab_size=read.integer("vocab_size"),
            hidden_size=read.integer("hidden_size"),
            intermediate_size=read.integer("intermediate_size"),
            num_layers=layers,
            num_heads=read.integer("num_attention_heads"),
            num_kv_heads=read.integer("num_key_value_heads"),
            head_dim=read.integer("head_dim"),
            rope_theta=rope_theta,
            rope_local_theta=rope_local_theta,
            rope_scaling=scaling,
            rms_norm_eps=read.number("rms_norm_eps", 1e-6, positive=True),
            sliding_window=read.integer("sliding_window"),
            layer_types=tuple(layer_types),
            query_pre_attn_scalar=read.number("query_pre_attn_scalar", 256.0, positive=True),
            final_logit_softcapping=None if cap is None else float(cap),
            max_position_embeddings=read.integer("max_position_embeddings", 32768),
            bos_token_id=bos[0] if bos else None,
            eos_token_id=eos or (1,),
        )
    except ValueError as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{source}: {error}") from None


def _with_generation_config(config: Gemma3Config, folder: Path) -> Gemma3Config:
    path = folder / "generation_config.json"
    if not is_model_file(path):
        return config
    eos = ConfigReader(read_json(path), path).token_ids("eos_token_id")
    return replace(config, eos_token_id=eos) if eos else config


# ----------------------------------------------------------------------------- GGUF files

_GGUF_KEYS = {  # any other gemma3.* key (attn_logit_softcapping, rope.scaling.*, ...) is refused by name
    "final_logit_softcapping", "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "attention.sliding_window", "rope.dimension_count", "vocab_size",
}
def config_from_gguf(gguf_file: GGUFFile) -> Gemma3Config:
    """A `Gemma3Config` from llama.cpp's "gemma3" metadata: the layer pattern (every sixth layer
    global) and the local rope base (10 000) are llama.cpp's fixed choices, not in the file."""
    source = gguf_file.path
    if gguf_file.architecture != "gemma3":
        raise CheckpointError(f"{source}: expected a GGUF of architecture 'gemma3', got {gguf_file.architecture!r}")
    metadata = gguf_file.metadata
    check_metadata_keys(gguf_file, "gemma3", known=_GGUF_KEYS, harmless=set(),
                        neutral={}, what="attnkit's Gemma 3")
    read = ConfigReader(metadata, source, prefix="gemma3.")
    head_dim = read.integer("attention.key_length")
    if read.integer("attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{source}: expected gemma3.attention.value_length equal to the key length {head_dim}")
    if read.integer("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"{source}: expected gemma3.rope.dimension_count equal to the head dimension {head_dim}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{source} lacks tokenizer.ggml.tokens (the vocabulary), which a Gemma 3 GGUF needs")
    vocab_size = read.integer("vocab_size", len(tokens))
    if vocab_size != len(tokens):
        raise CheckpointError(f"{source}: gemma3.vocab_size is {vocab_size} but the vocabulary has {len(tokens)} tokens")
    special = ConfigReader(metadata, source, prefix="tokenizer.ggml.")
    stop_ids = [i for key in ("eos_token_id", "eot_token_id") for i in special.token_ids(key)]
    # "<end_of_turn>" ends a turn as EOS does (llama.cpp stops on it too)
    if "<end_of_turn>" in tokens:
        stop_ids.append(tokens.index("<end_of_turn>"))
    bos = special.token_ids("bos_token_id")
    layers = read.integer("block_count")
    cap = read.get("final_logit_softcapping")
    try:
        return Gemma3Config(
            vocab_size=vocab_size,
            hidden_size=read.integer("embedding_length"),
            intermediate_size=read.integer("feed_forward_length"),
            num_layers=layers,
            num_heads=read.integer("attention.head_count"),
            num_kv_heads=read.integer("attention.head_count_kv"),
            head_dim=head_dim,
            rope_theta=read.number("rope.freq_base", 1_000_000.0, positive=True),
            rms_norm_eps=read.number("attention.layer_norm_rms_epsilon", 1e-6, positive=True),
            sliding_window=read.integer("attention.sliding_window"),
            query_pre_attn_scalar=float(head_dim),  # llama.cpp: 1/sqrt(head dim) (all but the 27B)
            final_logit_softcapping=None if cap is None else float(cap),
            max_position_embeddings=read.integer("context_length", 32768),
            bos_token_id=bos[0] if bos else None,
            eos_token_id=tuple(dict.fromkeys(stop_ids)),
        )
    except ValueError as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{source}: {error}") from None
