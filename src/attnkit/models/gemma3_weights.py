"""Gemma 3's weights: the Hugging Face and GGUF tensor names mapped onto attnkit's, the
shapes checked before anything is read, `state_from_gguf` (matrices on the file's blocks or
as float32) and `random_weights` for tiny models.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnkit.models.checkpoint import check_tensors
from attnkit.models.gemma3_config import Gemma3Config
from attnkit.models.gguf import GGUFFile
from attnkit.quant.layers import QuantizedTensor, quantized_types

__all__ = ["hf_tensor_shapes", "random_weights", "state_from_gguf"]


def random_weights(config: Gemma3Config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Weights drawn like torch's defaults (uniform +-1/sqrt(fan_in), N(0, 1) embedding), norms
    as multipliers near 1: for tests and tiny models."""
    c = config
    d, q, kv, ff, E = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size, \
        c.head_dim

    def matrix(rows: int, cols: int) -> np.ndarray:
        bound = 1.0 / math.sqrt(cols)
        return rng.uniform(-bound, bound, (rows, cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    state = {"embed.weight": rng.standard_normal((c.vocab_size, d), dtype=np.float32), "norm.weight": norm(d)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        state.update({
            p + "attn_norm.weight": norm(d), p + "post_attn_norm.weight": norm(d),
            p + "mlp_norm.weight": norm(d), p + "post_mlp_norm.weight": norm(d),
            p + "attn.q_norm.weight": norm(E), p + "attn.k_norm.weight": norm(E),
            p + "attn.q_proj.weight": matrix(q, d), p + "attn.k_proj.weight": matrix(kv, d),
            p + "attn.v_proj.weight": matrix(kv, d), p + "attn.out_proj.weight": matrix(d, q),
            p + "mlp.gate_proj.weight": matrix(ff, d), p + "mlp.up_proj.weight": matrix(ff, d),
            p + "mlp.down_proj.weight": matrix(d, ff),
        })
    return state


# ----------------------------------------------------------------------------- names and shapes

def _hf_names(config: Gemma3Config) -> dict[str, str]:
    """Hugging Face tensor name -> attnkit's."""
    names = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    parts = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
        "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm",
        "self_attn.q_proj": "attn.q_proj", "self_attn.k_proj": "attn.k_proj", "self_attn.v_proj": "attn.v_proj",
        "self_attn.o_proj": "attn.out_proj", "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
        "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj", "mlp.down_proj": "mlp.down_proj",
    }
    for i in range(config.num_layers):
        for theirs, ours in parts.items():
            names[f"model.layers.{i}.{theirs}.weight"] = f"layers.{i}.{ours}.weight"
    return names


def hf_tensor_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for `config`."""
    ours = _shapes(config)
    return {theirs: ours[name] for theirs, name in _hf_names(config).items()}


def _shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """attnkit's weight name -> shape."""
    c = config
    d, q, kv, ff, E = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size, \
        c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, d), "norm.weight": (d,)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,), p + "post_attn_norm.weight": (d,), p + "mlp_norm.weight": (d,),
            p + "post_mlp_norm.weight": (d,), p + "attn.q_norm.weight": (E,), p + "attn.k_norm.weight": (E,),
            p + "attn.q_proj.weight": (q, d), p + "attn.k_proj.weight": (kv, d), p + "attn.v_proj.weight": (kv, d),
            p + "attn.out_proj.weight": (d, q), p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        })
    return shapes


# ----------------------------------------------------------------------------- GGUF files

_GGUF_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attn_norm.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm.weight",
    "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_mlp_norm.weight",
    "blk.{i}.attn_q_norm.weight": "layers.{i}.attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "layers.{i}.attn.k_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.attn.out_proj.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
}


def _gguf_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    ours = _shapes(config)
    shapes = {}
    for theirs, name in _GGUF_NAMES.items():
        for i in range(config.num_layers) if "{i}" in theirs else [None]:
            shapes[theirs.format(i=i)] = ours[name.format(i=i)]
    return shapes


def _runs_quantized(gguf_file: GGUFFile) -> bool:
    from attnkit.quant import compiled_available

    runs = set(quantized_types())
    return compiled_available() and all(
        info.dtype in runs for info in gguf_file.tensor_infos.values() if len(info.shape) == 2)


def state_from_gguf(gguf_file: GGUFFile, config: Gemma3Config, *, quantized: bool = False) -> dict[str, Any]:
    """Every tensor of a Gemma 3 GGUF under attnkit's names (checked against `config` first):
    matrices as float32, or as `QuantizedTensor`s on the file's blocks with `quantized`; norms
    as stored (llama.cpp stores 1 + w). No row permutation: llama.cpp rotates Gemma's halves
    (NeoX order), as Hugging Face does."""
    expected = _gguf_shapes(config)
    c = config
    check_tensors(gguf_file.tensor_infos, expected, optional={}, dtypes=None, source=gguf_file.path,
                  config=f"embedding_length={c.hidden_size}, block_count={c.num_layers}, head_count={c.num_heads}, "
                         f"head_count_kv={c.num_kv_heads}, key_length={c.head_dim}, vocabulary {c.vocab_size}")
    if quantized:
        runs = quantized_types()
        for name, info in gguf_file.tensor_infos.items():
            if len(info.shape) == 2 and info.dtype not in runs:
                raise ValueError(f"tensor {name!r} in {str(gguf_file.path)!r} has GGML type {info.dtype}, which "
                                 f"attnkit's quantized products do not run; load it with quantized=False")
    else:
        gguf_file.check_tensor_types()
    state: dict[str, Any] = {}
    for theirs, ours in _GGUF_NAMES.items():
        for i in range(c.num_layers) if "{i}" in theirs else [None]:
            name, shape = theirs.format(i=i), expected[theirs.format(i=i)]
            if quantized and len(shape) == 2:
                state[ours.format(i=i)] = QuantizedTensor(gguf_file.raw(name), gguf_file.tensor_type(name), shape[1])
            else:
                state[ours.format(i=i)] = gguf_file.tensor(name)
    return state
