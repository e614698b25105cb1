"""Decode steps of a quantized Llama model in one compiled call.

`LlamaForCausalLM` runs a decode step (one sequence, one new token) through
`attnkit.kernels.decode.decode_step` instead of its modules when all of this holds, and
through its modules otherwise (same logits to float32 rounding; the tests hold them
together):

- the compiled kernels are on and the model keeps its GGUF blocks (`from_gguf`, quantized);
- every layer is the plain pre-norm block: `QuantizedCausalSelfAttention` (no sliding
  window) and `QuantizedSwiGLU`, no biases, float32 norms, a built-in exact backend
  ("naive" or "flash");
- nothing watches the layers in this context: no `record_attention`, no `intervene`;
- the cache is float32, holds one sequence without padding, and its buffers are its own.

The arrays the compiled step reads (numba typed lists of the blocks, the norms, the row
orders) are built once per model and rebuilt when a weight or a module is replaced.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from attnkit import kernels
from attnkit.nn.cache import KVCache
from attnkit.nn.interface import watching

__all__ = ["fused_logits"]

_EXACT_BACKENDS = ("naive", "flash")
_PROJECTIONS = (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "out_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _sources(model: Any) -> tuple | None:
    """What the compiled step is built from, by identity, or None when the model is not
    one it runs (see the module docstring)."""
    from attnkit.models.quantized import QuantizedCausalSelfAttention, QuantizedLinear, QuantizedSwiGLU

    modules = model.__dict__["_modules"]
    embed = modules["embed"].__dict__.get("quantized")
    if embed is None:
        return None
    if model.config.tie_word_embeddings:
        head = embed
    else:
        lm_head = modules.get("lm_head")
        if type(lm_head) is not QuantizedLinear or lm_head._parameters["bias"] is not None:
            return None
        head = lm_head.__dict__["quantized"]
    final = modules["norm"]._parameters["weight"]
    if final.dtype != np.float32:
        return None
    items: list = [embed, head, final]
    for block in modules["layers"].__dict__["_modules"].values():
        parts = block.__dict__["_modules"]
        attn, mlp = parts["attn"], parts["mlp"]
        if type(attn) is not QuantizedCausalSelfAttention or type(mlp) is not QuantizedSwiGLU:
            return None
        if attn.__dict__["_backend"] not in _EXACT_BACKENDS:
            return None
        norms = (parts["attn_norm"]._parameters["weight"], parts["mlp_norm"]._parameters["weight"])
        if norms[0].dtype != np.float32 or norms[1].dtype != np.float32:  # a float64 model: the modules
            return None
        items += [*norms, attn.scale]
        for owner, name in _PROJECTIONS:
            linear = parts[owner].__dict__["_modules"][name]
            if type(linear) is not QuantizedLinear or linear._parameters["bias"] is not None:
                return None
            items.append(linear.__dict__["quantized"])
    return tuple(items)


def _readonly(array: np.ndarray) -> np.ndarray:
    view = np.ascontiguousarray(array).view()
    view.flags.writeable = False  # one numba type for the file's read-only blocks and any other
    return view


def _build(model: Any) -> tuple:
    """(matrices, values, table, orders, norms, eps, heads, kv_heads, E) for `decode_step`."""
    from attnkit.kernels.quant import QUANT_TYPES

    List = kernels.numba().typed.List  # noqa: N806 - numba's class (imported through kernels: its cache folder)

    c = model.config
    heads, kv_heads, E = c.num_heads, c.num_kv_heads, c.head_dim
    matrices, table, orders, norms, eps = List(), [], List(), List(), []
    layers = list(model.layers)
    for block in layers:
        group_offset = 0
        for index, (owner, name) in enumerate(_PROJECTIONS):
            tensor = getattr(getattr(block, owner), name).quantized
            if index in (3, 4, 6):  # a new group: output, gate (with up), down
                group_offset = 0
            matrices.append(_readonly(tensor.raw))
            table.append((QUANT_TYPES[tensor.kind].code, tensor.columns, group_offset))
            group_offset += tensor.shape[0]
        q, k = block.attn.q_proj.quantized, block.attn.k_proj.quantized
        q_order = np.arange(heads * E) if q.row_order is None else q.row_order
        k_order = np.arange(kv_heads * E) if k.row_order is None else k.row_order
        orders.append(np.concatenate([q_order, heads * E + k_order]).astype(np.int64))
        for norm in (block.attn_norm, block.mlp_norm):
            norms.append(np.ascontiguousarray(norm.weight, np.float32))
            eps.append(norm.eps)
    norms.append(np.ascontiguousarray(model.norm.weight, np.float32))
    eps.append(model.norm.eps)
    embed = model.embed.quantized
    head = embed if c.tie_word_embeddings else model.lm_head.quantized
    for tensor in (embed, head):
        matrices.append(_readonly(tensor.raw))
        table.append((QUANT_TYPES[tensor.kind].code, tensor.columns, 0))
    values = List()
    for raw in matrices:
        values.append(raw.view(np.int8))
    scale = layers[0].attn.scale
    return (matrices, values, np.asarray(table, np.int64), orders, norms, np.asarray(eps, np.float64), heads,
            kv_heads, E), (1.0 / math.sqrt(E) if scale is None else float(scale))


def _eligible_model(model: Any) -> tuple | None:
    """The built arrays for `model`, rebuilt when what they come from changed; None when the
    model is not one the compiled step runs."""
    sources = _sources(model)
    if sources is None:
        return None
    built = model.__dict__.get("_fused_decode")
    if built is None or len(built[0]) != len(sources) or not all(map(operator.is_, built[0], sources)):
        if len({block.attn.scale for block in model.layers}) != 1:
            return None
        if sources[0].row_order is not None or sources[1].row_order is not None:
            return None
        built = (sources, *_build(model))
        model.__dict__["_fused_decode"] = built
    return built


def fused_logits(model: Any, ids: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray | None:
    """Logits (1, 1, V) of the decode step `ids` (1, 1) at `positions` (1, 1) through the
    compiled step, or None when the module path must run it (see the module docstring)."""
    if ids.shape != (1, 1) or not kernels.enabled() or watching():
        return None
    if cache.dtype != np.float32 or cache.batch_size != 1 or cache.has_padding:
        return None
    stores = cache._stores()
    if stores is None or int(positions[0, 0]) != cache.length:
        return None
    built = _eligible_model(model)
    if built is None:
        return None
    from attnkit.kernels.decode import decode_step
    from attnkit.kernels.quant import current_activations
    from attnkit.runtime import blas_thread_count

    _, arrays, scale = built
    slot = cache.length
    if slot + 1 > cache.max_length:
        raise ValueError(f"cache holds at most {cache.max_length} positions; {slot} are used and 1 more came")
    cos, sin = model.rotary.cos_sin(positions[0])  # (1, E) each
    keys, values = stores
    parts = max(1, min(blas_thread_count(), kernels.numba().config.NUMBA_NUM_THREADS))
    logits = decode_step(int(ids[0, 0]), slot, arrays, np.ascontiguousarray(cos[0], np.float32),
                         np.ascontiguousarray(sin[0], np.float32), keys[:, 0], values[:, 0], scale,
                         int8=current_activations() == "int8", parts=parts)
    cache._advance(1)
    return logits[None, None]
