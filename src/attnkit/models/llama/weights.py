"""A Llama checkpoint's tensors under attnkit's names: the name maps and the shape tables.

`_HF_LLAMA_NAMES` maps Hugging Face safetensors names and `_GGUF_LLAMA_NAMES` llama.cpp's
GGUF names to the module's (`layers.{i}.attn.q_proj.weight`, ...); `hf_tensor_shapes` and
`gguf_tensor_shapes` give what a `LlamaConfig` expects, checked against the file's header
before any tensor is read. `state_from_gguf` reads a GGUF's tensors (float32, or kept as
`QuantizedTensor` blocks), undoing llama.cpp's permutation of the query and key rows
(`unpermute_rotary_rows`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnkit.models.checkpoint import check_tensors
from attnkit.models.gguf import GGUFFile
from attnkit.models.llama.config import (
    _GGUF_ATTENTION_PARTS,
    LlamaConfig,
    _require_gguf_architecture,
)
from attnkit.quant.layers import QuantizedTensor, quantized_types

__all__ = ["gguf_tensor_shapes", "hf_tensor_shapes", "state_from_gguf", "unpermute_rotary_rows"]


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

