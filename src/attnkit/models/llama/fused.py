"""When a quantized Llama's decode step runs as one compiled call, and the frame it runs on.

`LlamaForCausalLM` runs a decode step (one sequence, one new token) through
`attnkit.models.llama.step.decode_step` instead of its modules when
`compiled_step_reason(model, ids, positions, cache)` is None, and through its modules
otherwise (same logits to float32 rounding; the tests hold them together). That one
function says why not, in words:

- the compiled kernels are off, or a recording or an intervention watches the layers;
- the step is not one token of one sequence at the cache's end, or the cache is not float32,
  holds padding, or a layer's buffer was replaced (`KVCache.stores` is None);
- the model is not the plain quantized one: its matrices are not the GGUF's blocks
  (`from_gguf`, quantized), a layer is not `QuantizedCausalSelfAttention` +
  `QuantizedSwiGLU`, a projection has a bias, a norm is not float32, the layers' scales
  differ, a backend is not a built-in exact one ("naive" or "flash": the one place a
  backend is compared by name), the embedding's or head's rows are permuted.

The frame (`step.prepare`: the addresses of the blocks and the norms, the row orders) is
built from the model's public parts once per model and kept beside it (not in it). It is
rebuilt when a weight or a module was replaced: while `attnkit.nn.module.structure_version()`
has not moved since the last step, nothing was (about 1 us); when it has moved (any module
of the process changed), the attributes the frame was built from are read again and
compared by identity (`_Links.unchanged`, in C: about 40 us for SmolLM2).
"""

from __future__ import annotations

import math
import operator
import weakref
from typing import Any

import numpy as np

from attnkit import kernels
from attnkit.kernels import native
from attnkit.quant.layers import QuantizedCausalSelfAttention, QuantizedEmbedding, QuantizedLinear, \
    QuantizedSwiGLU
from attnkit.nn.cache import KVCache
from attnkit.nn.interface import supports, watching
from attnkit.nn.module import structure_version

__all__ = ["batch_logits", "batch_step_reason", "compiled_step_reason", "fused_logits"]

_PROJECTIONS = (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "out_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _exact(backend) -> bool:
    """Whether the step computes `backend`'s attention exactly (the backend table's 'exact')."""
    try:
        return supports(backend, "exact")
    except (TypeError, ValueError):  # not a registered backend: never stand in for it
        return False


class _Links:
    """What a frame was built from, to compare by identity later: child modules and
    parameters through the modules' live views (`Module.child_modules`, `own_parameters`),
    plain attributes through `getattr`. The comparisons run in C (`map`): about 40 us for
    SmolLM2's 900 links, where reading them through attribute lookups took 0.4 ms."""

    def __init__(self) -> None:
        self.views: list = []  # (view, key, value): module views
        self.keys: list = []
        self.held: list = []
        self.owners: list = []  # (owner, name, value): plain attributes
        self.names: list = []
        self.values: list = []

    def child(self, module: Any, name: str) -> Any:
        """module's child `name`, remembered."""
        return self._viewed(module.child_modules, name)

    def parameter(self, module: Any, name: str) -> Any:
        """module's parameter `name` (None: absent), remembered."""
        return self._viewed(module.own_parameters, name)

    def _viewed(self, view: Any, key: str) -> Any:
        value = view[key]
        self.views.append(view)
        self.keys.append(key)
        self.held.append(value)
        return value

    def attribute(self, owner: Any, name: str) -> Any:
        """owner.name (a plain attribute or a property), remembered."""
        value = getattr(owner, name)
        self.owners.append(owner)
        self.names.append(name)
        self.values.append(value)
        return value

    def unchanged(self) -> bool:
        """Whether every link still holds its value."""
        try:
            return (all(map(operator.is_, map(operator.getitem, self.views, self.keys), self.held))
                    and all(map(operator.is_, map(getattr, self.owners, self.names), self.values)))
        except (KeyError, AttributeError):
            return False


def _linear_reason(links: _Links, owner: Any, name: str) -> str | None:
    linear = links.child(owner, name)
    if type(linear) is not QuantizedLinear:
        return f"{name} is a {type(linear).__name__}, not the file's blocks (QuantizedLinear)"
    links.attribute(linear, "quantized")
    if links.parameter(linear, "bias") is not None:
        return f"{name} has a bias"
    return None


def _walk(model: Any) -> tuple[_Links, tuple, str | None]:
    """What a frame of `model` is built from (the links, the blocks), and why the model is not
    one the step runs (None: it is)."""
    links = _Links()
    config = links.attribute(model, "config")
    embed = links.child(model, "embed")
    if not isinstance(embed, QuantizedEmbedding):
        return links, (), "the weights are not the GGUF's blocks (load with from_gguf(path, quantized=True))"
    if links.attribute(embed, "quantized").row_order is not None:
        return links, (), "the embedding's rows are permuted"
    if not config.tie_word_embeddings:
        reason = _linear_reason(links, model, "lm_head")
        if reason is not None:
            return links, (), reason
        if model.lm_head.quantized.row_order is not None:
            return links, (), "the output head's rows are permuted"
    norm = links.child(model, "norm")
    if links.parameter(norm, "weight").dtype != np.float32:
        return links, (), "the final norm is not float32"
    layers = links.child(model, "layers")
    blocks = tuple(links.child(layers, name) for name in layers.child_modules)
    scales = set()
    for index, block in enumerate(blocks):
        attn, mlp = links.child(block, "attn"), links.child(block, "mlp")
        if type(attn) is not QuantizedCausalSelfAttention or type(mlp) is not QuantizedSwiGLU:
            return links, blocks, (f"layer {index} is {type(attn).__name__} + {type(mlp).__name__}, not "
                                   "QuantizedCausalSelfAttention + QuantizedSwiGLU")
        backend = links.attribute(attn, "backend")
        if not _exact(backend):
            return links, blocks, (f"layer {index} attends through backend {backend!r}; the step stands in "
                                   "only for a backend with the 'exact' capability (attnkit.nn.supports)")
        scales.add(links.attribute(attn, "scale"))
        for name in ("attn_norm", "mlp_norm"):
            if links.parameter(links.child(block, name), "weight").dtype != np.float32:
                return links, blocks, f"layer {index}'s {name} is not float32"
        for owner, name in _PROJECTIONS:
            reason = _linear_reason(links, attn if owner == "attn" else mlp, name)
            if reason is not None:
                return links, blocks, f"layer {index}: {reason}"
    if len(scales) > 1:
        return links, blocks, "the layers' score scales differ"
    return links, blocks, None


def _build(model: Any) -> tuple:
    """The model's frame for `decode_step` (`step.prepare`), and the blocks it points at
    (kept alive beside it)."""
    from attnkit.quant import GGMLType
    from attnkit.models.llama import step

    c = model.config
    heads, kv_heads, E = c.num_heads, c.num_kv_heads, c.head_dim
    blocks, table, orders, norms, eps = [], [], [], [], []

    def add(tensor, offset: int) -> None:
        raw = np.ascontiguousarray(tensor.raw)
        blocks.append(raw)
        table.append((raw.ctypes.data, raw.shape[0], raw.shape[1], int(GGMLType[tensor.kind]), tensor.columns,
                      offset))  # the columns of step_kernels.TABLE_COLUMNS

    layers = list(model.layers)
    for block in layers:
        group_offset = 0
        for owner, name in _PROJECTIONS:
            tensor = getattr(getattr(block, owner), name).quantized
            if name in ("out_proj", "gate_proj", "down_proj"):  # a new group: output, gate (with up), down
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
    frame = step.prepare(np.array(table, np.int64), np.array(orders, np.int64), norms, eps, scale, heads, kv_heads,
                         E, head.shape[0])
    return frame, blocks


class _Prepared:
    """What a model was found to be at `version`: its frame and what it was built from, or
    the reason the step does not run it (`frame` None)."""

    __slots__ = ("links", "layers", "frame", "keep", "reason", "version")

    def __init__(self, links: _Links, layers: tuple, frame: Any, keep: list, reason: str | None, version: int):
        self.links, self.layers, self.frame, self.keep, self.reason, self.version = (links, layers, frame, keep,
                                                                                     reason, version)

    def unchanged(self, model: Any) -> bool:
        """Whether the model still has the parts the frame was built from (and as many layers)."""
        return self.links.unchanged() and len(model.layers) == len(self.layers)


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Prepared (a cache, dropped with it)


def _prepared(model: Any) -> _Prepared:
    """The model's frame or the reason it has none, found again when a module changed."""
    version = structure_version()  # read before the links: a change after it moves it again
    found = _PREPARED.get(model)
    if found is not None:
        if found.version == version:
            return found
        if found.frame is not None and found.unchanged(model):
            found.version = version
            return found
    links, layers, reason = _walk(model)
    frame, keep = _build(model) if reason is None else (None, [])
    found = _Prepared(links, layers, frame, keep, reason, version)
    _PREPARED[model] = found
    return found


def _call_reason(ids: np.ndarray | None, positions: np.ndarray | None, cache: KVCache | None) -> str | None:
    """Why this call's step does not run compiled (None: it may), before the model is asked."""
    if not kernels.enabled():
        return f"the compiled kernels are off: {kernels.reason_disabled()}"
    if watching():
        return "a recording or an intervention watches the layers"
    if ids is not None and np.shape(ids) != (1, 1):
        return f"the step runs one token of one sequence, got ids of shape {np.shape(ids)}"
    if cache is None:
        return None
    if cache.dtype != np.float32 or cache.batch_size != 1 or cache.has_padding:
        return (f"the step runs a float32 cache of one sequence without padding, got {cache.dtype}, batch "
                f"{cache.batch_size}{', padded' if cache.has_padding else ''}")
    if cache.stores is None:
        return "a layer's cache buffer was replaced (KVCache.stores is None)"
    position = None if positions is None else int(np.asarray(positions).reshape(-1)[0])
    if position is not None and position != cache.length:
        return f"the token's position {position} is not the cache's length {cache.length}"
    return None


def _ready(model: Any, ids, positions, cache) -> _Prepared | str:
    reason = _call_reason(ids, positions, cache)
    if reason is not None:
        return reason
    found = _prepared(model)
    return found if found.reason is None else found.reason


def compiled_step_reason(model: Any, ids: np.ndarray | None = None, positions: np.ndarray | None = None,
                         cache: KVCache | None = None) -> str | None:
    """Why a decode step of `model` does not run as one compiled call, or None when it does.

    Arguments:
        model: a `LlamaForCausalLM`.
        ids, positions: (1, 1) the step's token and its position (None: not asked).
        cache: the `KVCache` it appends to (None: not asked).

    Returns:
        None, or one sentence naming the first thing that sends the step to the modules.
    """
    found = _ready(model, ids, positions, cache)
    return found if isinstance(found, str) else None


def fused_logits(model: Any, ids: np.ndarray, positions: np.ndarray, cache: KVCache, *,
                 parts: int | None = None) -> np.ndarray | None:
    """Logits (1, 1, V) of the decode step `ids` (1, 1) at `positions` (1, 1) through the
    compiled step on `parts` threads (None: the BLAS thread limit in force; at most the CPUs
    this process may use), or None when the modules must run it (`compiled_step_reason`)."""
    found = _ready(model, ids, positions, cache)
    if isinstance(found, str):
        return None
    from attnkit import runtime
    from attnkit.quant import current_activations
    from attnkit.models.llama import step

    slot = cache.length
    if slot + 1 > cache.max_length:
        raise ValueError(f"cache holds at most {cache.max_length} positions; {slot} are used and 1 more came")
    cos, sin = model.rotary.at(slot)
    keys, values = cache.stores
    parts = max(1, min(runtime.blas_thread_count() if parts is None else parts, runtime.cpu_count()))
    try:
        logits = step.decode_step(int(ids[0, 0]), slot, found.frame, cos, sin, keys[:, 0], values[:, 0],
                                  int8=current_activations() == "int8", parts=parts)
    except native.Unavailable:  # no library and numba does not import: the modules run the step
        return None
    cache.advance(1)
    return logits[None, None]


def batch_step_reason(model: Any, cache: Any) -> str | None:
    """Why `BatchStep(model, cache)` runs its steps through the modules, or None when the
    compiled batched step runs them (the model one `compiled_step_reason` accepts, a float32
    `PagedKVCache`)."""
    reason = _call_reason(None, None, None)
    if reason is None and cache.dtype != np.float32:
        reason = f"the step runs a float32 cache, got {cache.dtype}"
    if reason is None:
        found = _prepared(model)
        reason = found.reason
    if reason is None:
        reason = "the batched compiled step is not built yet"
    return reason


def batch_logits(model: Any, cache: Any, rows: list, runs: list, threads: int | None) -> np.ndarray | None:
    """Logits (rows with logits, V) of a checked batched step through the compiled kernel, or
    None when the modules must run it (a recording or an intervention opened since)."""
    return None
