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

The frame the compiled step reads (the addresses of the blocks and the norms, the row
orders) is built once per model and rebuilt when a weight or a module is replaced: while
`attnkit.nn.module.structure_version()` has not moved since the last step, nothing was
(about 1 us); when it has moved (any module of the process changed), the frame's links are
walked again (`_unchanged`, 40-200 us).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from attnkit import kernels
from attnkit.nn.cache import KVCache
from attnkit.nn.interface import watching
from attnkit.nn.module import structure_version

__all__ = ["fused_logits"]

_EXACT_BACKENDS = ("naive", "flash")
_PROJECTIONS = (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "out_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _sources(model: Any) -> list | None:
    """What the compiled step is built from: (container, key, value) for every link from
    the model to each array it reads (modules, blocks, weights, backends), or None when the
    model is not one it runs (see the module docstring). The step is valid while every
    container still holds the same value (`_unchanged`), checked in C where walking the
    modules again took 0.5 ms of a 9 ms step."""
    from attnkit.models.quantized import QuantizedCausalSelfAttention, QuantizedLinear, QuantizedSwiGLU

    links: list = [(model.__dict__, "config", model.config)]
    modules = model.__dict__["_modules"]
    embed_module = modules["embed"]
    embed = embed_module.__dict__.get("quantized")
    if embed is None:
        return None
    links += [(modules, "embed", embed_module), (embed_module.__dict__, "quantized", embed)]
    if not model.config.tie_word_embeddings:
        lm_head = modules.get("lm_head")
        if type(lm_head) is not QuantizedLinear or lm_head._parameters["bias"] is not None:
            return None
        links += [(modules, "lm_head", lm_head), (lm_head.__dict__, "quantized", lm_head.__dict__["quantized"]),
                  (lm_head._parameters, "bias", None)]
    norm = modules["norm"]
    if norm._parameters["weight"].dtype != np.float32:
        return None
    links += [(modules, "norm", norm), (norm._parameters, "weight", norm._parameters["weight"])]
    layers = modules["layers"]
    blocks = layers.__dict__["_modules"]
    links += [(modules, "layers", layers), (layers.__dict__, "_modules", blocks)]
    for key, block in blocks.items():
        parts = block.__dict__["_modules"]
        attn, mlp = parts["attn"], parts["mlp"]
        if type(attn) is not QuantizedCausalSelfAttention or type(mlp) is not QuantizedSwiGLU:
            return None
        if attn.__dict__["_backend"] not in _EXACT_BACKENDS:
            return None
        links += [(blocks, key, block), (parts, "attn", attn), (parts, "mlp", mlp),
                  (attn.__dict__, "_backend", attn.__dict__["_backend"]), (attn.__dict__, "scale", attn.scale)]
        for name in ("attn_norm", "mlp_norm"):
            weight = parts[name]._parameters["weight"]
            if weight.dtype != np.float32:  # a float64 model: the modules
                return None
            links += [(parts, name, parts[name]), (parts[name]._parameters, "weight", weight)]
        for owner, name in _PROJECTIONS:
            holder = parts[owner].__dict__["_modules"]
            linear = holder[name]
            if type(linear) is not QuantizedLinear or linear._parameters["bias"] is not None:
                return None
            links += [(holder, name, linear), (linear.__dict__, "quantized", linear.__dict__["quantized"]),
                      (linear._parameters, "bias", None)]
    return links


def _unchanged(links: tuple, count: int, model: Any) -> bool:
    """Whether every link still holds its value (and the model has as many layers): the
    lookups and comparisons run in C (`map`), about 40 us for SmolLM2's 900 links."""
    containers, keys, values = links
    if len(model.__dict__["_modules"]["layers"].__dict__["_modules"]) != count:
        return False
    return all(map(operator.is_, map(dict.get, containers, keys), values))


def _build(model: Any) -> tuple:
    """The model's frame for `decode_step` (`attnkit.kernels.decode.prepare`), and the blocks
    it points at (kept alive beside it)."""
    from attnkit.kernels import decode
    from attnkit.kernels.quant import QUANT_TYPES

    c = model.config
    heads, kv_heads, E = c.num_heads, c.num_kv_heads, c.head_dim
    blocks, table, orders, norms, eps = [], [], [], [], []

    def add(tensor, offset: int) -> None:
        raw = np.ascontiguousarray(tensor.raw)
        blocks.append(raw)
        table.append((raw.ctypes.data, raw.shape[0], raw.shape[1], QUANT_TYPES[tensor.kind].code, tensor.columns,
                      offset))

    layers = list(model.layers)
    for block in layers:
        group_offset = 0
        for index, (owner, name) in enumerate(_PROJECTIONS):
            tensor = getattr(getattr(block, owner), name).quantized
            if index in (3, 4, 6):  # a new group: output, gate (with up), down
                group_offset = 0
            add(tensor, group_offset)
            group_offset += tensor.shape[0]
        q, k = block.attn.q_proj.quantized, block.attn.k_proj.quantized
        q_order = np.arange(heads * E) if q.row_order is None else q.row_order
        k_order = np.arange(kv_heads * E) if k.row_order is None else k.row_order
        orders.append(np.concatenate([q_order, heads * E + k_order]))
        for norm in (block.attn_norm, block.mlp_norm):
            norms.append(np.ascontiguousarray(norm.weight, np.float32))
            eps.append(norm.eps)
    norms.append(np.ascontiguousarray(model.norm.weight, np.float32))
    eps.append(model.norm.eps)
    embed = model.embed.quantized
    head = embed if c.tie_word_embeddings else model.lm_head.quantized
    add(embed, 0)
    add(head, 0)
    scale = layers[0].attn.scale
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    frame = decode.prepare(np.array(table, np.int64), np.array(orders, np.int64), norms, eps, scale, heads, kv_heads,
                           E, head.shape[0])
    return frame, blocks


class _Built:
    """A model's compiled-step frame and what it was built from."""

    __slots__ = ("links", "frame", "blocks", "layers", "version")

    def __init__(self, links: tuple, frame: Any, blocks: list, layers: int, version: int) -> None:
        self.links, self.frame, self.blocks, self.layers, self.version = links, frame, blocks, layers, version


def _eligible_model(model: Any) -> _Built | None:
    """The model's frame, rebuilt when a link changed; None when the model is not one the
    compiled step runs."""
    version = structure_version()  # read before the links: a change after it moves it again
    built = model.__dict__.get("_fused_decode")
    if isinstance(built, int):  # the version it was found not eligible at
        if built == version:
            return None
    elif built is not None:
        if built.version == version:
            return built
        if _unchanged(built.links, built.layers, model):
            built.version = version
            return built
    links = _sources(model)
    layers = list(model.layers)
    if (links is None or len({block.attn.scale for block in layers}) != 1
            or model.embed.quantized.row_order is not None
            or (not model.config.tie_word_embeddings and model.lm_head.quantized.row_order is not None)):
        model.__dict__["_fused_decode"] = version  # the version it was found not eligible at
        return None
    links = tuple(zip(*links))  # (containers, keys, values)
    built = _Built(links, *_build(model), len(layers), version)
    model.__dict__["_fused_decode"] = built
    return built


def fused_logits(model: Any, ids: np.ndarray, positions: np.ndarray, cache: KVCache, *,
                 parts: int | None = None) -> np.ndarray | None:
    """Logits (1, 1, V) of the decode step `ids` (1, 1) at `positions` (1, 1) through the
    compiled step on `parts` threads (None: the BLAS thread limit in force; at most the CPUs
    this process may use), or None when the module path must run it (see the module
    docstring)."""
    if ids.shape != (1, 1) or not kernels.enabled() or watching():
        return None
    if cache.dtype != np.float32 or cache.batch_size != 1 or cache.has_padding:
        return None
    stores = cache._stores()
    slot = cache.length
    if stores is None or int(positions[0, 0]) != slot:
        return None
    built = _eligible_model(model)
    if built is None:
        return None
    from attnkit.kernels.decode import decode_step
    from attnkit.kernels.quant import current_activations
    from attnkit.runtime import blas_thread_count, cpu_count

    if slot + 1 > cache.max_length:
        raise ValueError(f"cache holds at most {cache.max_length} positions; {slot} are used and 1 more came")
    cos, sin = model.rotary.at(slot)
    keys, values = stores
    parts = max(1, min(blas_thread_count() if parts is None else parts, cpu_count()))
    logits = decode_step(int(ids[0, 0]), slot, built.frame, cos, sin, keys[:, 0], values[:, 0],
                         int8=current_activations() == "int8", parts=parts)
    cache._advance(1)
    return logits[None, None]
