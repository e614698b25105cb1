"""Llama-family decoders (Llama 2/3 layout, SmolLM2) on attnkit's attention.

One block, pre-norm:

    h   = x + out_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms_norm(x)
    out = h + down_proj(silu(gate_proj(m)) * up_proj(m))                          m = rms_norm(h)

with grouped-query attention (SmolLM2-135M: 9 query heads share 3 key/value
heads, head dim 64), rotary position embeddings (base `rope_theta`, 100000 for
SmolLM2; scaled as `rope_scaling` says: linear, dynamic, yarn, llama3), and a
final RMSNorm before the output head, which is either the token embedding
itself (tied, as SmolLM2) or its own matrix. The projections carry biases when
the checkpoint says so (`attention_bias`, `mlp_bias`, or bias tensors in a GGUF).

Loaders: `LlamaForCausalLM.from_gguf(path)` (llama.cpp files, any quantization
the `gguf` package dequantizes) and `LlamaForCausalLM.from_folder(path)`
(Hugging Face `config.json` + safetensors). Both follow the checkpoint rule of
`attnkit.models.checkpoint`: every key understood or refused by name, shapes
checked against the file header before anything is allocated, every tensor used.
The names of both formats stop here: `LlamaConfig.from_hf` / `from_gguf` read the
config keys, `_HF_LLAMA_NAMES` / `_GGUF_LLAMA_NAMES` map the tensor names
(`attnkit.models.gguf` only reads the file).

One detail of GGUF matters for correctness: llama.cpp's converter permutes the
rows of the query and key projections (and their biases) so that its rotary
embedding can rotate adjacent pairs (x0, x1), (x2, x3), ... instead of the two
halves (x_i, x_{i+E/2}) that Hugging Face's Llama rotates. `state_from_gguf`
undoes that permutation (`unpermute_rotary_rows`), as transformers does, so one
rotary embedding serves GGUF and safetensors checkpoints alike.

What a Llama GGUF may carry beyond the plain model, and what attnkit does with it:

- `blk.N.attn_{q,k,v,output}.bias`, `blk.N.ffn_{gate,up,down}.bias`: biases
  (a missing one of a set is zero). llama.cpp uses them; transformers' GGUF
  loader drops them.
- `rope_freqs.weight`: llama.cpp's per-frequency divisors of the rotary
  frequencies, which is how its converter stores Llama 3.1's rope scaling
  (no scaling-type key). transformers' GGUF loader ignores it.
- `{arch}.rope.scaling.type` "linear" (or `rope.scale_linear`) with its
  factor; "yarn" and "longrope" are refused.

Speed: a decode step is a chain of matrix-vector products, bound by reading
the weights once per token. Each layer keeps its query/key/value projections
fused into one pre-transposed (d_model, (Hq + 2 Hkv) E) matrix and its gate/up
projections into one (d_model, 2 d_ff) matrix, so a token costs two products
per sublayer instead of five; the head keeps a (d_model, vocab) transposed copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.chat import folder_tokenizer
from attnkit.models.checkpoint import (
    CheckpointError,
    ConfigReader,
    check_folder,
    is_model_file,
    check_tensors,
    check_tied_copy,
    find_safetensors,
    map_names,
    read_config,
    read_header,
    read_json,
    read_safetensors,
)
from attnkit.models.causal_lm import CausalLM
from attnkit.models.gguf import GGUFFile, check_metadata_keys, tokenizer_from_gguf
from attnkit.models.fused_decode import fused_logits
from attnkit.models.quantized import (
    QuantizedCausalSelfAttention,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedSwiGLU,
    QuantizedTensor,
    quantized_types,
)
from attnkit.nn.cache import KVCache
from attnkit.nn.decoder_layers import CausalSelfAttention, Embedding, RMSNorm, RotaryEmbedding, SwiGLU
from attnkit.nn.linear import Linear
from attnkit.nn.module import Module, ModuleList, make_rng
from attnkit.nn.positional import RopeScaling

__all__ = ["LlamaConfig", "LlamaBlock", "LlamaForCausalLM", "unpermute_rotary_rows"]


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


class SlidingWindowSelfAttention(CausalSelfAttention):
    """`CausalSelfAttention` whose queries see only their last `window` keys, themselves
    included (Mistral's and Qwen2's `sliding_window`: key j is seen from position i when
    i - window < j <= i): the attention call gets attnkit's `window=window - 1` keys to the
    left, aligned bottom-right like the causal band. The cache keeps every key; the band
    excludes the old ones exactly (weight 0)."""

    def __init__(self, *args: Any, window: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window = int(window)

    def attend(self, query, key, value, **options):
        return super().attend(query, key, value, window=self.window - 1, **options)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"


class LlamaBlock(Module):
    """Pre-norm decoder block: attention then SwiGLU, each around a residual.

    Children: ``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``.
    """

    def __init__(
        self, config: LlamaConfig, layer: int = 0, *, seed: int | np.random.Generator | None = None
    ) -> None:
        super().__init__()
        rng = make_rng(seed)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        window = config.window_of(layer)
        sizes = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim)
        bias = config.attention_bias or config.qkv_bias
        if window is None:
            self.attn = CausalSelfAttention(*sizes, bias=bias, seed=rng)
        else:
            self.attn = SlidingWindowSelfAttention(*sizes, window=window, bias=bias, seed=rng)
        if config.qkv_bias and not config.attention_bias:
            self.attn.out_proj.bias = np.zeros_like(self.attn.out_proj.bias)  # Qwen2: no output bias
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, seed=rng)

    def forward(self, x, cos, sin, cache, layer) -> np.ndarray:
        """x: the residual stream (B, T, d), float64 (see `_hidden_states`); the
        sublayers compute in the parameters' dtype."""
        dt = self.attn_norm.weight.dtype
        h = x + self.attn(self.attn_norm(x, dt), cache, layer, cos=cos, sin=sin)
        h += self.mlp(self.mlp_norm(h, dt))
        return h


class LlamaForCausalLM(CausalLM):
    """A Llama-family language model: ids (B, T) -> logits (B, T, vocab).

    Children: ``embed``, ``layers.{i}`` (`LlamaBlock`), ``norm``, and ``lm_head`` unless the
    head is tied to the embedding. Random weights from `seed`; load real ones with
    `from_gguf`, `from_folder` or `attnkit.models.AutoCausalLM.from_pretrained`.
    """

    def __init__(self, config: LlamaConfig, *, seed: int | np.random.Generator | None = None, tokenizer=None):
        super().__init__()
        rng = make_rng(seed)
        self.config = config
        self.tokenizer = tokenizer
        self.embed = Embedding(config.vocab_size, config.hidden_size, seed=rng)
        self.layers = ModuleList(LlamaBlock(config, i, seed=rng) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, seed=rng)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self._head_from = None

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, max_length, dtype=self.dtype)

    def embed_inputs(self, ids, positions):
        # The residual stream is carried in float64: 30 layers each add a float32
        # sublayer output to it, and rounding those sums in float32 doubled the
        # logits' distance from transformers (1.04e-4 -> 7.9e-5 on SmolLM2). It is
        # one d-wide vector per token, so this costs nothing next to the matmuls.
        return self.embed.weight[ids].astype(np.float64)  # (B, T, d)

    def run_layers(self, x, positions, cache, start=0, stop=None):
        cos, sin = self.rotary.cos_sin(positions)  # (B, T, E) each
        for index in range(start, len(self.layers) if stop is None else stop):
            x = self.layers[index](x, cos, sin, cache, index)
        return x

    def final_norm(self, x):
        return self.norm(x).astype(self.norm.weight.dtype, copy=False)  # the parameters' dtype

    def _compiled_step(self, ids, positions, cache, threads):
        # a quantized model's decode step runs in one compiled call when nothing watches the
        # layers (attnkit.models.fused_decode says when); else layer by layer
        return fused_logits(self, ids, positions, cache, parts=threads)

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        source = self.embed.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if self._head_from is not source:  # (d, vocab); blocks stay blocks (`QuantizedTensor.T`)
            self._head_t = source.T if isinstance(source, QuantizedTensor) else np.ascontiguousarray(source.T)
            self._head_from = source
        return hidden @ self._head_t  # (B, T, vocab)

    @property
    def context_length(self) -> int:
        """`max_position_embeddings`; with "dynamic" rope scaling, `factor` times that (the
        length dynamic NTK scaling stretches the model to; transformers sets no limit)."""
        c = self.config
        if c.rope_scaling is not None and c.rope_scaling.is_dynamic:
            return int(c.max_position_embeddings * c.rope_scaling.factor)
        return int(c.max_position_embeddings)

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | GGUFFile, *, quantized: bool | None = None) -> "LlamaForCausalLM":
        """Load a llama.cpp GGUF file (tokenizer from metadata).

        The metadata and the tensor shapes are checked before any tensor is read; every
        tensor is used (`LlamaConfig.from_gguf`, `state_from_gguf`).

        Arguments:
            path: the `.gguf` file, or the `GGUFFile` already opened on it.
            quantized: True: weight matrices stay in the file's blocks, memory-mapped, and run
                on the compiled kernels (`attnkit.models.quantized`; no float32 copy, loads in a
                fraction of a second); False: every weight dequantized to float32 (the
                reference); None (default): quantized when `attnkit.kernels.enabled()`, every
                matrix's type is one `quantized_types()` lists and no layer has a sliding window.

        Raises:
            ValueError: naming the file: not a GGUF file, not a Llama model, a key or tensor
                attnkit does not implement, sizes that disagree, an unsupported tensor type.
            MissingExtraError: the `gguf` package is not installed (`pip install 'attnkit[gguf]'`).
        """
        gguf_file = path if isinstance(path, GGUFFile) else GGUFFile(path)
        config = LlamaConfig.from_gguf(gguf_file)
        tokenizer = tokenizer_from_gguf(gguf_file)
        if quantized is None:
            quantized = _runs_quantized(gguf_file, config)
        if quantized:
            return _quantized_model(cls, config, state_from_gguf(gguf_file, config, quantized=True), tokenizer)
        state = state_from_gguf(gguf_file, config)
        model = cls(config, seed=0, tokenizer=tokenizer)
        model.load_state_dict(state)
        return model

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> "LlamaForCausalLM":
        """Load a Hugging Face Llama folder: config.json, model.safetensors (or shards),
        generation_config.json and tokenizer.json if present.

        The config is validated, then checked against the tensor shapes in the safetensors
        headers, before any weight is read; every tensor must be used (rotary `inv_freq`
        buffers excepted). `eos_token_id` from generation_config.json, when there, is what
        transformers' `generate` stops on, and so is it here.
        """
        folder = check_folder(folder)
        config = LlamaConfig.from_hf(read_config(folder), source=folder / "config.json")
        config = _with_generation_config(config, folder)
        files = find_safetensors(folder)
        source = files[0] if len(files) == 1 else f"{folder} ({len(files)} shards)"
        expected, optional = hf_tensor_shapes(config)
        check_tensors(read_header(files), expected, optional=optional, ignore=_HF_LLAMA_IGNORE, source=source,
                      config=_describe(config))
        tokenizer = folder_tokenizer(folder, config.vocab_size, source)  # checked before any weight is read
        tensors = read_safetensors(files)
        if config.tie_word_embeddings:
            check_tied_copy(tensors, "lm_head.weight", "model.embed_tokens.weight", source=source)
            tensors.pop("lm_head.weight", None)
        state, _ = map_names(tensors, _HF_LLAMA_NAMES, ignore=_HF_LLAMA_IGNORE, source=source)
        if config.qkv_bias and not config.attention_bias:  # Qwen2: no output bias, so zero
            for i in range(config.num_layers):
                state[f"layers.{i}.attn.out_proj.bias"] = np.zeros(config.hidden_size, np.float32)
        model = cls(config, seed=0)
        model.load_state_dict(state)
        model.tokenizer = tokenizer
        return model


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


def hf_tensor_shapes(config: LlamaConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(expected, optional): Hugging Face tensor name -> shape for `config`. Optional: a tied
    head saved anyway (it must equal the embedding)."""
    c = config
    d, q, kv, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    expected: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        expected.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        })
        if c.attention_bias or c.qkv_bias:
            expected.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                             p + "self_attn.v_proj.bias": (kv,)})
        if c.attention_bias:
            expected[p + "self_attn.o_proj.bias"] = (d,)
        if c.mlp_bias:
            expected.update({p + "mlp.gate_proj.bias": (ff,), p + "mlp.up_proj.bias": (ff,),
                             p + "mlp.down_proj.bias": (d,)})
    head = {"lm_head.weight": (c.vocab_size, d)}
    if c.tie_word_embeddings:
        return expected, head
    return {**expected, **head}, {}


# Hugging Face Llama checkpoint names -> attnkit names.
_HF_LLAMA_NAMES = [
    (r"model\.embed_tokens\.weight", r"embed.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", r"layers.\1.attn.\2_proj.\3"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"layers.\1.attn.out_proj.\2"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.(weight|bias)", r"layers.\1.mlp.\2_proj.\3"),
    (r"model\.norm\.weight", r"norm.weight"),
    (r"lm_head\.weight", r"lm_head.weight"),
]
# The ignore list: rotary inverse-frequency buffers older transformers saved (recomputed from the config).
_HF_LLAMA_IGNORE = [r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq"]


# ----------------------------------------------------------------------------- GGUF tensors


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a query or key projection (or its bias).

    llama.cpp's converter reorders each head's rows from halves
    (r_0..r_{E/2-1}, r_{E/2}..r_{E-1}) to interleaved pairs (r_0, r_{E/2}, r_1, ...).
    This restores the halves order Hugging Face's `rotate_half` expects.

    Arguments:
        weight: (num_heads * head_dim, in_features) or (num_heads * head_dim,) as stored.
        num_heads: heads of this projection (query heads for Q, key/value heads for K).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # stored row h*E + 2*i + j  came from  original row h*E + j*E/2 + i
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # (H, E/2, 2, ...)
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


# GGUF tensor names -> attnkit Llama names ({i} = layer index).
_GGUF_LLAMA_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.attn.out_proj.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
    "blk.{i}.attn_q.bias": "layers.{i}.attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "layers.{i}.attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "layers.{i}.attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "layers.{i}.attn.out_proj.bias",
    "blk.{i}.ffn_gate.bias": "layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "layers.{i}.mlp.down_proj.bias",
}
_GGUF_ATTENTION_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output")
_GGUF_MLP_PARTS = ("ffn_gate", "ffn_up", "ffn_down")


def gguf_tensor_shapes(config: LlamaConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(expected, optional): GGUF tensor name -> shape (NumPy order) for a `LlamaConfig`.

    Optional: biases (a missing one of a present set is zero), `rope_freqs.weight` (read into
    the config already).
    """
    c = config
    d, q, kv, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    expected: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, d), "output_norm.weight": (d,)}
    if not c.tie_word_embeddings:
        expected["output.weight"] = (c.vocab_size, d)
    optional: dict[str, tuple[int, ...]] = {"rope_freqs.weight": (c.head_dim // 2,)}
    for i in range(c.num_layers):
        p = f"blk.{i}."
        expected.update({
            p + "attn_norm.weight": (d,), p + "attn_q.weight": (q, d), p + "attn_k.weight": (kv, d),
            p + "attn_v.weight": (kv, d), p + "attn_output.weight": (d, q), p + "ffn_norm.weight": (d,),
            p + "ffn_gate.weight": (ff, d), p + "ffn_up.weight": (ff, d), p + "ffn_down.weight": (d, ff),
        })
        optional.update({
            p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,), p + "attn_output.bias": (d,),
            p + "ffn_gate.bias": (ff,), p + "ffn_up.bias": (ff,), p + "ffn_down.bias": (d,),
        })
    return expected, optional


def state_from_gguf(gguf_file: GGUFFile, config: LlamaConfig, *, quantized: bool = False) -> dict[str, Any]:
    """All weights of a Llama GGUF as float32 arrays under attnkit's names.

    Every tensor's name and shape is checked against `config` first (nothing is dequantized
    before); query and key rows, and their biases, are un-permuted (`unpermute_rotary_rows`);
    a bias missing from a set the file has is zero. With `quantized`, every matrix is a
    `QuantizedTensor` on the file's blocks instead (query and key rows un-permuted by
    `row_order`, no byte moved), norms and biases float32.

    Raises:
        CheckpointError (a ValueError): naming the file and every missing, unused or mis-shaped tensor.
    """
    arch = _require_gguf_architecture(gguf_file)
    permuted = arch == "llama"  # llama.cpp permutes Llama's q/k rows; its Qwen2 converter does not
    c = config
    expected, optional = gguf_tensor_shapes(c)
    check_tensors(
        gguf_file.tensor_infos, expected, optional=optional, dtypes=None, source=gguf_file.path,
        config=(
            f"embedding_length={c.hidden_size}, feed_forward_length={c.intermediate_size}, head_count={c.num_heads}, "
            f"head_count_kv={c.num_kv_heads}, head dimension {c.head_dim}, vocabulary {c.vocab_size}"
        ),
    )
    if quantized:
        _check_quantized_types(gguf_file)
    else:
        gguf_file.check_tensor_types()
    wanted = {**optional, **expected}
    state: dict[str, np.ndarray] = {}
    for layer in [None, *range(c.num_layers)]:
        for gguf_pattern, ours_pattern in _GGUF_LLAMA_NAMES.items():
            if ("{i}" in gguf_pattern) != (layer is not None):
                continue
            gguf_name = gguf_pattern.format(i=layer)
            ours = ours_pattern.format(i=layer)
            is_bias = gguf_name.endswith(".bias")
            if is_bias and not (c.attention_bias if gguf_name.split(".")[2] in _GGUF_ATTENTION_PARTS else c.mlp_bias):
                continue
            if gguf_name not in gguf_file.tensor_infos:
                if is_bias:
                    state[ours] = np.zeros(wanted[gguf_name], np.float32)
                continue  # output.weight of a tied model
            if quantized and len(wanted[gguf_name]) == 2:
                heads = c.num_heads if ".attn_q." in gguf_name else c.num_kv_heads
                order = None
                if permuted and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
                    order = unpermute_rotary_rows(np.arange(wanted[gguf_name][0]), heads)
                state[ours] = QuantizedTensor(gguf_file.raw(gguf_name), gguf_file.tensor_type(gguf_name),
                                              wanted[gguf_name][1], row_order=order)
                continue
            weight = gguf_file.tensor(gguf_name)
            if permuted and ".attn_q." in gguf_name:
                weight = unpermute_rotary_rows(weight, c.num_heads)
            elif permuted and ".attn_k." in gguf_name:
                weight = unpermute_rotary_rows(weight, c.num_kv_heads)
            state[ours] = weight
    return state


# ----------------------------------------------------------------------------- GGUF blocks, kept


def _check_quantized_types(gguf_file: GGUFFile) -> None:
    """Refuse a matrix whose GGML type the quantized products do not run (naming it)."""
    runs = quantized_types()
    for name, info in gguf_file.tensor_infos.items():
        if len(info.shape) == 2 and info.dtype not in runs:
            raise ValueError(
                f"tensor {name!r} in {str(gguf_file.path)!r} has GGML type {info.dtype}, which attnkit's quantized "
                f"products do not run; expected one of {', '.join(runs)} (load it with quantized=False)"
            )


def _runs_quantized(gguf_file: GGUFFile, config: LlamaConfig) -> bool:
    """Whether `from_gguf` keeps the blocks by default: compiled kernels on, every matrix of a
    type they run, no sliding-window layer (those run the float32 model)."""
    from attnkit.kernels.quant import compiled_available

    if not compiled_available() or any(config.window_of(i) is not None for i in range(config.num_layers)):
        return False
    runs = set(quantized_types())
    return all(info.dtype in runs for info in gguf_file.tensor_infos.values() if len(info.shape) == 2)


def _quantized_model(cls, config: LlamaConfig, state: dict[str, Any], tokenizer) -> "LlamaForCausalLM":
    """A `LlamaForCausalLM` whose matrices are `state`'s `QuantizedTensor`s: built part by part
    as `LlamaForCausalLM.__init__` builds it, without drawing random weights to replace."""
    c = config
    if any(c.window_of(i) is not None for i in range(c.num_layers)):
        raise ValueError("attnkit's quantized Llama has no sliding-window layers; load it with quantized=False")

    def norm(name: str) -> RMSNorm:
        module = RMSNorm(c.hidden_size, c.rms_norm_eps)
        module.weight = state[name]
        return module

    def linear(name: str) -> QuantizedLinear:
        return QuantizedLinear(state[name + ".weight"], state.get(name + ".bias"))

    model = cls.__new__(cls)
    CausalLM.__init__(model)
    model.config = c
    model.tokenizer = tokenizer
    model.embed = QuantizedEmbedding(state["embed.weight"])
    blocks = []
    for i in range(c.num_layers):
        p = f"layers.{i}."
        block = LlamaBlock.__new__(LlamaBlock)
        Module.__init__(block)
        block.attn_norm = norm(p + "attn_norm.weight")
        block.attn = QuantizedCausalSelfAttention(
            *(linear(p + f"attn.{part}_proj") for part in ("q", "k", "v", "out")),
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        )
        block.mlp_norm = norm(p + "mlp_norm.weight")
        block.mlp = QuantizedSwiGLU(*(linear(p + f"mlp.{part}_proj") for part in ("gate", "up", "down")))
        blocks.append(block)
    model.layers = ModuleList(blocks)
    model.norm = norm("norm.weight")
    if not c.tie_word_embeddings:
        model.lm_head = linear("lm_head")
    model.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
    model._head_from = None
    return model
