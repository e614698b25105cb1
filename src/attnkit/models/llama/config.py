"""A Llama-family model's configuration, read from a checkpoint's keys.

`LlamaConfig` (frozen) holds the hyperparameters. `LlamaConfig.from_hf` reads a Hugging
Face `config.json` (model_type "llama", "qwen2" or "mistral") and `LlamaConfig.from_gguf`
a llama.cpp file's `{arch}.` metadata keys: every key is read, implemented at the listed
values only, or refused by name (the tables below), and sizes are checked before anything
is allocated. Rotary scaling (`rope_scaling` / `rope_parameters`, GGUF `rope_freqs.weight`)
becomes a `RopeScaling`.
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

__all__ = ["HF_COMPUTED_KEYS", "LlamaConfig"]

@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama-family decoder (defaults: SmolLM2-135M)."""

    vocab_size: int = 49152
    hidden_size: int = 576  # d_model
    intermediate_size: int = 1536  # d_ff of SwiGLU
    num_layers: int = 30  # num_hidden_layers
    num_heads: int = 9  # num_attention_heads: query heads
    num_kv_heads: int = 3  # num_key_value_heads (GQA when fewer than num_heads)
    head_dim: int = 64
    rope_theta: float = 100000.0
    rope_scaling: RopeScaling | None = None  # rope_scaling / rope_parameters; GGUF rope_freqs.weight
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192  # context length
    tie_word_embeddings: bool = True  # head = embedding matrix
    attention_bias: bool = False  # biases on q/k/v/o projections
    qkv_bias: bool = False  # biases on q/k/v only, none on o (Qwen2)
    sliding_window: int | None = None  # a query sees its last `sliding_window` keys, itself included (Mistral)
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" or "sliding_attention" (Qwen2);
    # None: every layer slides when sliding_window is set
    mlp_bias: bool = False  # biases on gate/up/down projections
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = (2,)  # any of them ends a sequence (an int is taken as one id)

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_id, (int, np.integer)):
            object.__setattr__(self, "eos_token_id", (int(self.eos_token_id),))
        elif self.eos_token_id is None:
            object.__setattr__(self, "eos_token_id", ())
        else:
            object.__setattr__(self, "eos_token_id", tuple(int(i) for i in self.eos_token_id))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"expected num_heads ({self.num_heads}) to be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"expected an even head_dim for rotary embeddings, got {self.head_dim}")
        if not (np.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ValueError(f"expected rms_norm_eps > 0, got {self.rms_norm_eps!r}")
        if not (np.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"expected rope_theta > 1, got {self.rope_theta!r}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
            raise ValueError(f"expected sliding_window to be a positive int or None, got {window!r}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(_LAYER_TYPES):
                raise ValueError(
                    f"expected layer_types to name {self.num_layers} layers, each one of {', '.join(_LAYER_TYPES)}, "
                    f"got {list(self.layer_types)!r}"
                )
            if window is None and "sliding_attention" in self.layer_types:
                raise ValueError("expected a sliding_window for the layers of layer_types 'sliding_attention'")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to every earlier position)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return int(self.sliding_window)

    @classmethod
    def from_hf(cls, config: dict[str, Any], source: str | os.PathLike[str] = "config.json") -> "LlamaConfig":
        """From a Hugging Face `config.json` (model_type "llama", "qwen2" or "mistral").

        Every key is in the family's table of computed keys (`HF_COMPUTED_KEYS`: read, or
        implemented at the listed values only and refused by name at others), or metadata
        (`checkpoint.is_metadata_key`, and `_HF_LLAMA_HARMLESS`); any other key is refused by
        name. Sizes must be positive and the heads must divide.

        Raises:
            CheckpointError (a ValueError): naming `source`, the key, what was expected and found.
        """
        read = ConfigReader(config, source)
        model_type = config.get("model_type")
        if model_type not in HF_COMPUTED_KEYS:
            raise CheckpointError(
                f"{source}: expected model_type {' or '.join(map(repr, HF_COMPUTED_KEYS))}, got {model_type!r}"
            )
        computed = HF_COMPUTED_KEYS[model_type]
        read.check_keys([key for key, values in computed.items() if values is None],
                        neutral={key: values for key, values in computed.items() if values is not None},
                        harmless=_HF_LLAMA_HARMLESS, what=f"attnkit's {_FAMILY_NAMES[model_type]}")
        activation = read.text("hidden_act", "silu")
        if activation != "silu":
            raise CheckpointError(f"{source}: expected hidden_act 'silu' (SwiGLU), got {activation!r}")
        hidden = read.integer("hidden_size")
        num_heads = read.integer("num_attention_heads")
        num_kv_heads = read.integer("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"{source}: expected num_attention_heads ({num_heads}) to be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        if read.has("head_dim"):
            head_dim = read.integer("head_dim")
        elif hidden % num_heads:
            raise CheckpointError(
                f"{source}: expected hidden_size ({hidden}) to be a multiple of num_attention_heads "
                f"({num_heads}), or a head_dim key"
            )
        else:
            head_dim = hidden // num_heads
        if head_dim % 2:
            raise CheckpointError(f"{source}: expected an even head dimension for rotary embeddings, got {head_dim}")
        max_positions = read.integer("max_position_embeddings", 2048)
        theta, scaling = _hf_rope(config, read, max_positions, source)
        eos = read.token_ids("eos_token_id")
        bos = read.token_ids("bos_token_id")
        return cls(
            vocab_size=read.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=read.integer("intermediate_size"),
            num_layers=read.integer("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=read.number("rms_norm_eps", 1e-6, positive=True),
            max_position_embeddings=max_positions,
            tie_word_embeddings=read.flag("tie_word_embeddings", False),
            attention_bias=read.flag("attention_bias", False),
            mlp_bias=read.flag("mlp_bias", False),
            qkv_bias=model_type == "qwen2",  # Qwen2's q/k/v projections always have biases, o none
            **_hf_sliding_window(model_type, read, source),
            bos_token_id=bos[0] if bos else None,
            eos_token_id=eos,
        )

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> "LlamaConfig":
        """A `LlamaConfig` from llama.cpp's metadata keys (`llama.block_count`, ...) and the
        tensors the file has (a separate head, biases, `rope_freqs.weight`).

        Raises:
            ValueError: naming the file: not a Llama model, a missing or invalid key, a key or
                feature attnkit does not implement (yarn, a partial rotary dimension, ...).
        """
        arch = _require_gguf_architecture(gguf_file)
        check_metadata_keys(gguf_file, arch, known=_GGUF_LLAMA_KEYS, harmless=_GGUF_LLAMA_HARMLESS,
                            neutral=_GGUF_LLAMA_NEUTRAL, what="attnkit's Llama")
        source = gguf_file.path
        read = ConfigReader(gguf_file.metadata, source, prefix=f"{arch}.")
        hidden_size = read.integer("embedding_length")
        num_heads = read.integer("attention.head_count")
        num_kv_heads = read.integer("attention.head_count_kv", num_heads)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"{source}: expected {arch}.attention.head_count ({num_heads}) to be a multiple of "
                f"{arch}.attention.head_count_kv ({num_kv_heads})"
            )
        if read.has("attention.key_length"):
            head_dim = read.integer("attention.key_length")
        elif hidden_size % num_heads:
            raise CheckpointError(
                f"{source}: expected {arch}.embedding_length ({hidden_size}) to be a multiple of "
                f"{arch}.attention.head_count ({num_heads}), or an attention.key_length key"
            )
        else:
            head_dim = hidden_size // num_heads
        value_dim = read.integer("attention.value_length", head_dim)
        if value_dim != head_dim:
            raise CheckpointError(
                f"{source}: expected {arch}.attention.value_length equal to the key length {head_dim}, got {value_dim}"
            )
        if head_dim % 2:
            raise CheckpointError(f"{source}: expected an even head dimension for rotary embeddings, got {head_dim}")
        rotary_dim = read.integer("rope.dimension_count", head_dim)
        if rotary_dim != head_dim:
            raise CheckpointError(
                f"{source}: expected {arch}.rope.dimension_count equal to the head dimension {head_dim}, got "
                f"{rotary_dim} (partial rotary embeddings are not supported)"
            )
        tokens = gguf_file.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise CheckpointError(f"{source} lacks tokenizer.ggml.tokens (the vocabulary), which a Llama GGUF needs")
        vocab_size = read.integer("vocab_size", len(tokens))
        if vocab_size != len(tokens):
            raise CheckpointError(
                f"{source}: {arch}.vocab_size is {vocab_size} but tokenizer.ggml.tokens has {len(tokens)} tokens"
            )
        infos = gguf_file.tensor_infos
        layers = read.integer("block_count")
        bias_names = [f"blk.{i}.{part}.bias" for i in range(layers) for part in _GGUF_ATTENTION_PARTS]
        mlp_bias_names = [f"blk.{i}.{part}.bias" for i in range(layers) for part in _GGUF_MLP_PARTS]
        special = ConfigReader(gguf_file.metadata, source, prefix="tokenizer.ggml.")
        # llama.cpp ends generation at any of EOS, end-of-turn and end-of-message; so does attnkit
        stop_ids = [i for key in ("eos_token_id", "eot_token_id", "eom_token_id") for i in special.token_ids(key)]
        bos = special.token_ids("bos_token_id")
        outside = [i for i in [*stop_ids, *bos] if i >= vocab_size]
        if outside:
            raise CheckpointError(
                f"{source}: bos/eos/eot/eom token id(s) {outside} are outside the vocabulary of {vocab_size} tokens"
            )
        try:
            return cls(
                vocab_size=vocab_size,
                hidden_size=hidden_size,
                intermediate_size=read.integer("feed_forward_length"),
                num_layers=layers,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                rope_theta=read.number("rope.freq_base", 10000.0, positive=True),
                rope_scaling=_gguf_rope_scaling(gguf_file, read, arch, head_dim),
                rms_norm_eps=read.number("attention.layer_norm_rms_epsilon", 1e-5, positive=True),
                max_position_embeddings=read.integer("context_length", 2048),
                tie_word_embeddings="output.weight" not in infos,
                attention_bias=any(name in infos for name in bias_names),
                mlp_bias=any(name in infos for name in mlp_bias_names),
                bos_token_id=bos[0] if bos else None,
                eos_token_id=tuple(dict.fromkeys(stop_ids)),
            )
        except ValueError as error:
            if isinstance(error, CheckpointError):
                raise
            raise CheckpointError(f"{source}: {error}") from None


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _hf_sliding_window(model_type: str, read: ConfigReader, source) -> dict[str, Any]:
    """`sliding_window` and `layer_types` as transformers reads them: Mistral slides every layer
    by `sliding_window` (null: none); Qwen2 only when `use_sliding_window`, on the layers
    `layer_types` names (default: from `max_window_layers` on)."""
    if model_type == "mistral":
        return {"sliding_window": read.integer("sliding_window", None)}
    if model_type != "qwen2":
        return {}
    layers = read.integer("num_hidden_layers")
    window = read.integer("sliding_window", None) if read.flag("use_sliding_window", False) else None
    types = read.get("layer_types")
    if types is None:
        first = read.integer("max_window_layers", 28, minimum=0)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    if not (isinstance(types, list) and len(types) == layers and all(t in _LAYER_TYPES for t in types)):
        raise CheckpointError(
            f"{source}: expected layer_types to be a list of {layers} names, each one of {', '.join(_LAYER_TYPES)}; "
            f"got {types!r}"
        )
    if window is None:
        if "sliding_attention" in types:
            raise CheckpointError(
                f"{source}: layer_types names sliding_attention layers, but use_sliding_window is false "
                "or sliding_window is null; expected a window for them"
            )
        return {}
    return {"sliding_window": window, "layer_types": tuple(types)}


# config.json keys of a Llama: read and implemented ...
_HF_LLAMA_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_theta", "rope_scaling", "rope_parameters",
    "original_max_position_embeddings", "bos_token_id", "eos_token_id",
}
# ... harmless at inference (training-only, or a marker) ...
_HF_LLAMA_HARMLESS = {
    "attention_dropout", "mlp_dropout",
    "pretraining_tp",  # splits the projections into slices during pretraining: the same products
    "is_llama_config",  # SmolLM2's marker
    "is_decoder",  # a decoder is causal whatever it says
}
# ... and harmless at these values only.
_HF_LLAMA_NEUTRAL = {
    "rope_interleaved": (False,),  # nanotron: True rotates adjacent pairs instead of halves
    "partial_rotary_factor": (1.0, 1),
    "sliding_window": (None,),
    "use_sliding_window": (False,),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
}
# The table of computed keys of each family: key -> None (read and implemented) or the values
# at which attnkit implements it (any other value is refused by name). Every other key must
# be metadata (`checkpoint.is_metadata_key`, `_HF_LLAMA_HARMLESS`) or is refused by name.
HF_COMPUTED_KEYS: dict[str, dict[str, tuple | None]] = {
    "llama": {**dict.fromkeys(_HF_LLAMA_KEYS), **_HF_LLAMA_NEUTRAL},
    # Qwen2/Qwen2.5: a Llama with biases on q/k/v (always) and optional sliding windows per layer
    "qwen2": {
        **dict.fromkeys(_HF_LLAMA_KEYS - {"attention_bias", "mlp_bias"}),
        **{key: values for key, values in _HF_LLAMA_NEUTRAL.items() if key not in ("sliding_window", "use_sliding_window")},
        **dict.fromkeys(("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")),
    },
    # Mistral: a Llama without biases, every layer sliding by `sliding_window` (null: full attention)
    "mistral": {
        **dict.fromkeys(_HF_LLAMA_KEYS - {"attention_bias", "mlp_bias"}),
        **{key: values for key, values in _HF_LLAMA_NEUTRAL.items() if key != "sliding_window"},
        "sliding_window": None,
    },
}
_FAMILY_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}

# rope_scaling / rope_parameters keys by type (as transformers validates them)
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"},
}


def _hf_rope(config: dict[str, Any], read, max_positions: int, source) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling or None) from `rope_parameters` (transformers 5) or `rope_scaling` +
    `rope_theta` (earlier), with transformers' precedence: `rope_scaling`, then `rope_parameters`;
    the dict's own `rope_theta`, then the top-level one."""
    name = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(name) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: expected {name} to be an object, got {params!r}")
    where = f"{source} ({name})"
    rope = ConfigReader(params, where)
    rope_type = rope.text("rope_type", None) or rope.text("type", "default")
    if rope_type not in _ROPE_KEYS:
        raise CheckpointError(
            f"{where}: rope_type {rope_type!r} is not supported; expected one of {', '.join(_ROPE_KEYS)} "
            "(longrope and the others are refused rather than run with the wrong positions)"
        )
    rope.check_keys(_ROPE_KEYS[rope_type] | {"rope_type", "type", "rope_theta"}, common=False,
                    neutral={"partial_rotary_factor": (1.0, 1)}, what=f"rope_type {rope_type!r}")
    theta = rope.number("rope_theta", None, positive=True)
    if theta is None:
        theta = read.number("rope_theta", 10000.0, positive=True)
    if rope_type == "default":
        return theta, None
    original = read.integer("original_max_position_embeddings", None)  # a top-level key wins, as in transformers
    if original is None:
        original = rope.integer("original_max_position_embeddings", max_positions)
    factor = rope.number("factor", None, positive=True)
    if factor is None and rope_type == "yarn":
        factor = max_positions / original
    if factor is None:
        raise CheckpointError(f"{where} lacks the key 'factor', which rope_type {rope_type!r} needs")
    try:
        return theta, RopeScaling(
            rope_type=rope_type,
            factor=factor,
            original_max_position_embeddings=original,
            max_position_embeddings=max_positions,
            low_freq_factor=rope.number("low_freq_factor") if rope_type == "llama3" else 1.0,
            high_freq_factor=rope.number("high_freq_factor") if rope_type == "llama3" else 4.0,
            beta_fast=rope.number("beta_fast", 0.0) or 32.0,  # transformers: `get("beta_fast") or 32`
            beta_slow=rope.number("beta_slow", 0.0) or 1.0,
            attention_factor=rope.number("attention_factor", None),
            mscale=rope.number("mscale", None),
            mscale_all_dim=rope.number("mscale_all_dim", None),
            truncate=rope.flag("truncate", True),
        )
    except ValueError as error:
        raise CheckpointError(f"{where}: {error}") from None


# GGUF (llama.cpp) metadata: the architectures read as a Llama, and its `{arch}.` keys ...
_GGUF_ARCHITECTURES = ("llama", "qwen2")  # qwen2: a Llama with q/k/v biases, its q/k rows not permuted
_GGUF_LLAMA_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "vocab_size",
    "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
}
# ... that change nothing for the models attnkit runs ...
_GGUF_LLAMA_HARMLESS = {
    "rope.scaling.original_context_length",  # read by yarn only, which is refused
    "rope.scaling.finetuned",
}
# ... and that are harmless at these values only.
_GGUF_LLAMA_NEUTRAL = {
    "expert_count": (0,),
    "expert_used_count": (0,),
    "attention.causal": (True,),
    "rope.scaling.attn_factor": (1.0,),
}


def _require_gguf_architecture(gguf_file: GGUFFile) -> str:
    """`general.architecture` "llama" or "qwen2" and `general.type` "model" (not an adapter), or a ValueError."""
    architecture = gguf_file.architecture
    if architecture not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"expected a GGUF model of architecture {' or '.join(map(repr, _GGUF_ARCHITECTURES))}, "
            f"got {architecture!r} in {str(gguf_file.path)!r}"
        )
    general_type = gguf_file.metadata.get("general.type", "model")
    if general_type != "model":
        raise CheckpointError(
            f"{gguf_file.path}: general.type is {general_type!r}; expected 'model' (adapters and other "
            "partial files cannot run on their own)"
        )
    return architecture


def _gguf_rope_scaling(gguf_file: GGUFFile, read: ConfigReader, arch: str, head_dim: int) -> RopeScaling | None:
    """RoPE scaling from `rope_freqs.weight` (divisors) or `rope.scaling.type` "linear"."""
    source = gguf_file.path
    kind = read.text("rope.scaling.type", "none")
    factor = read.number("rope.scaling.factor", None, positive=True)
    if factor is None:
        factor = read.number("rope.scale_linear", None, positive=True)
    if kind not in ("none", "linear"):
        raise CheckpointError(
            f"{source}: {arch}.rope.scaling.type {kind!r} is not supported; expected 'none' or 'linear' "
            "(yarn and longrope GGUF files are refused rather than run with the wrong positions)"
        )
    has_freqs = "rope_freqs.weight" in gguf_file.tensor_infos
    linear = factor is not None and factor != 1.0
    if linear and kind == "none":
        raise CheckpointError(
            f"{source}: {arch}.rope.scaling.type is 'none' but rope.scaling.factor is {factor}; expected "
            "one of them to say how positions are scaled"
        )
    if linear and has_freqs:
        raise CheckpointError(
            f"{source}: both rope_freqs.weight and a linear rope scaling factor ({factor}); attnkit "
            "implements one at a time"
        )
    if has_freqs:
        info = gguf_file.tensor_infos["rope_freqs.weight"]
        if info.shape != (head_dim // 2,):
            raise CheckpointError(
                f"{source}: tensor 'rope_freqs.weight' has shape {info.shape}, expected ({head_dim // 2},) "
                "(one divisor per rotary frequency, head_dim / 2)"
            )
        divisors = gguf_file.tensor("rope_freqs.weight")
        if not (np.all(np.isfinite(divisors)) and np.all(divisors > 0)):
            raise CheckpointError(f"{source}: expected rope_freqs.weight to hold finite divisors > 0")
        return RopeScaling(rope_type="divisors", divisors=tuple(float(x) for x in divisors))
    if linear:
        return RopeScaling(rope_type="linear", factor=factor)
    return None


_GGUF_ATTENTION_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output")
_GGUF_MLP_PARTS = ("ffn_gate", "ffn_up", "ffn_down")


def _describe(config: LlamaConfig) -> str:
    c = config
    return (
        f"vocab_size={c.vocab_size}, hidden_size={c.hidden_size}, intermediate_size={c.intermediate_size}, "
        f"num_attention_heads={c.num_heads}, num_key_value_heads={c.num_kv_heads}, head_dim={c.head_dim}"
    )


def _with_generation_config(config: LlamaConfig, folder: Path) -> LlamaConfig:
    """`eos_token_id` of generation_config.json, which transformers' `generate` uses over config.json's."""
    path = folder / "generation_config.json"
    if not is_model_file(path):
        return config
    eos = ConfigReader(read_json(path), path).token_ids("eos_token_id")
    return replace(config, eos_token_id=eos) if eos else config

