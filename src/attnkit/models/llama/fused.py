"""When a quantized Llama's decode step runs as one compiled call, and the frame it runs on.

`LlamaForCausalLM` runs a decode step (one new token of each sequence of a `KVCache`)
through `attnkit.models.llama.step` (`decode_step`, `batch_step`) instead of its modules when
`compiled_step_reason(model, ids, positions, cache)` is None, and through its modules
otherwise (same logits to float32 rounding; the tests hold them together). That one
function says why not, in words:

- the compiled kernels are off, or a recording or an intervention watches the layers;
- the step is not one token of each sequence at the cache's end, or the cache is not
  float32, holds padding after a real token (left padding runs), or a layer's buffer was
  replaced (`KVCache.stores` is None);
- the model is not the plain quantized one: its matrices are not the GGUF's blocks
  (`from_gguf`, quantized), a layer is not `QuantizedCausalSelfAttention` (or
  `QuantizedSlidingWindowSelfAttention`: the step attends over the same window) +
  `QuantizedSwiGLU`, a projection has a bias, a norm is not float32, the layers' scales
  differ, a backend is not a built-in exact one ("naive" or "flash": the one place a
  backend is compared by name), the embedding's or head's rows are permuted.

Gemma 3 (`Gemma3ForCausalLM`) runs on the same step with its block's flags (`step.prepare`:
post-sublayer norms, per-head query/key norms, tanh-GELU, the embedding's sqrt(d), the
logits' soft cap, two rotary tables, windows on local layers): its class names the layer
modules the step stands in for (`STEP_MODULES`: its attention and MLP), as Llama's are
`QuantizedCausalSelfAttention` + `QuantizedSwiGLU`.

The frame (`step.prepare`: the addresses of the blocks and the norms, the row orders) is
built from the model's public parts once per model and kept beside it (not in it). It is
rebuilt when a weight or a module was replaced: while `attnkit.nn.module.structure_version()`
has not moved since the last step, nothing was (a cheap check); when it has moved (any module
of the process changed), the attributes the frame was built from are read again and
compared by identity (`_Links.unchanged`, in C). Timings: docs/benchmarks.md, 'Measurements
behind design choices'.
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
from attnkit.models.llama.sliding import QuantizedSlidingWindowSelfAttention
from attnkit.models.llama.step_kernels import LAYER_NORMS
from attnkit.nn.cache import KVCache
from attnkit.nn.interface import supports, watching
from attnkit.nn.module import structure_version

__all__ = ["batch_logits", "batch_step_reason", "compiled_step_reason", "fused_logits"]

_ATTENTIONS = (QuantizedCausalSelfAttention, QuantizedSlidingWindowSelfAttention)
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
    plain attributes through `getattr`. The comparisons run in C (`map`), many times faster
    than reading the links through attribute lookups (docs/benchmarks.md, 'Measurements
    behind design choices')."""

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


def _layout(model: Any) -> tuple:
    """(attention classes, MLP class, the block's extra norms) of the layers the step stands
    in for: the model class's `STEP_MODULES` (Gemma 3) or Llama's."""
    named = getattr(type(model), "STEP_MODULES", None)
    if named is not None:
        return (named[0],), named[1], ("post_attn_norm", "post_mlp_norm")
    return _ATTENTIONS, QuantizedSwiGLU, ()


def _walk(model: Any) -> tuple[_Links, tuple, str | None]:
    """What a frame of `model` is built from (the links, the blocks), and why the model is not
    one the step runs (None: it is)."""
    links = _Links()
    attentions, mlp_type, extra_norms = _layout(model)
    names = " or ".join(kind.__name__ for kind in attentions) + " + " + mlp_type.__name__
    config = links.attribute(model, "config")
    embed = links.child(model, "embed")
    if not isinstance(embed, QuantizedEmbedding):
        return links, (), "the weights are not the GGUF's blocks (load with from_gguf(path, quantized=True))"
    if links.attribute(embed, "quantized").row_order is not None:
        return links, (), "the embedding's rows are permuted"
    if not getattr(config, "tie_word_embeddings", True):
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
        if type(attn) not in attentions or type(mlp) is not mlp_type:
            return links, blocks, f"layer {index} is {type(attn).__name__} + {type(mlp).__name__}, not {names}"
        if type(attn) is not QuantizedCausalSelfAttention:
            links.attribute(attn, "window")
        backend = links.attribute(attn, "backend")
        if not _exact(backend):
            return links, blocks, (f"layer {index} attends through backend {backend!r}; the step stands in "
                                   "only for a backend with the 'exact' capability (attnkit.nn.supports)")
        scales.add(links.attribute(attn, "scale"))
        norms = [(block, name) for name in ("attn_norm", "mlp_norm", *extra_norms)]
        norms += [(attn, name) for name in ("q_norm", "k_norm") if extra_norms]
        for owner, name in norms:
            if links.parameter(links.child(owner, name), "weight").dtype != np.float32:
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
    gemma = bool(_layout(model)[2])

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
        for owner, name in zip((block,) * 4 + (block.attn,) * 2, LAYER_NORMS):
            if gemma or name in ("attn_norm", "mlp_norm"):
                norm = getattr(owner, name)
                norms.append(np.ascontiguousarray(norm.weight, np.float32))
                eps.append(norm.eps)
    norms.append(np.ascontiguousarray(model.norm.weight, np.float32))
    eps.append(model.norm.eps)
    embed = model.embed.quantized
    head = embed if getattr(c, "tie_word_embeddings", True) else model.lm_head.quantized
    add(embed, 0)
    add(head, 0)
    scale = layers[0].attn.scale
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    windows = [getattr(block.attn, "window", None) or 0 for block in layers]  # 0: no window
    flags: dict[str, Any] = {}
    if gemma:  # global layers rotate with table 0 (rotary_global), local ones with 1 (`_rotaries`)
        flags = dict(ropes=[0 if w == 0 else 1 for w in windows], post_norms=True, qk_norm=True, gelu_tanh=True,
                     embed_scale=math.sqrt(c.hidden_size), softcap=c.final_logit_softcapping)
    frame = step.prepare(np.array(table, np.int64), np.array(orders, np.int64), norms, eps, scale, heads, kv_heads,
                         E, head.shape[0], windows, **flags)
    return frame, blocks


def _rotaries(model: Any) -> tuple:
    """The model's rotary embeddings in the frame's table order (Llama: one; Gemma 3: global, local)."""
    if getattr(type(model), "STEP_MODULES", None) is not None:
        return model.rotary_global, model.rotary_local
    return (model.rotary,)


def _tables(model: Any, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (kinds, N, E) float32 C-contiguous of the rows at `positions` (N,)."""
    pairs = [rotary.cos_sin(positions) for rotary in _rotaries(model)]
    return (np.ascontiguousarray(np.stack([pair[i] for pair in pairs]), np.float32) for i in (0, 1))


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


def _starts(cache: KVCache) -> np.ndarray | None:
    """(B,) the first real position of each sequence of a cache whose padding (if any) is
    left padding, its new position included (`add_padding` was called for it); None when a
    padded position follows a real one."""
    stop = min(cache.length + 1, cache.max_length)
    if not cache.has_padding:
        return np.zeros(cache.batch_size, np.int64)
    real = cache.key_padding[:, :stop]
    starts = np.argmax(real, axis=1)  # the first True (0 when none: refused below)
    if not (real.sum(axis=1) == stop - starts).all():
        return None
    return starts.astype(np.int64)


def _call_reason(ids: np.ndarray | None, positions: np.ndarray | None, cache: KVCache | None) -> str | None:
    """Why this call's step does not run compiled (None: it may), before the model is asked."""
    if not kernels.enabled():
        return f"the compiled kernels are off: {kernels.reason_disabled()}"
    if watching():
        return "a recording or an intervention watches the layers"
    if ids is not None and (np.ndim(ids) != 2 or np.shape(ids)[1] != 1):
        return f"the step runs one token of each sequence, got ids of shape {np.shape(ids)}"
    if cache is None:
        return None
    if ids is not None and cache.batch_size != np.shape(ids)[0]:
        return f"the cache holds {cache.batch_size} sequences, the step {np.shape(ids)[0]}"
    if cache.dtype != np.float32:
        return f"the step runs a float32 cache, got {cache.dtype}"
    if cache.stores is None:
        return "a layer's cache buffer was replaced (KVCache.stores is None)"
    starts = _starts(cache)
    if starts is None:
        return "the cache's padding is not left padding before the new token (the step skips only that)"
    if positions is not None:
        expected = cache.length - starts
        got = np.asarray(positions).reshape(-1)
        if got.shape != expected.shape or (got != expected).any():
            return f"the tokens' positions {got.tolist()} are not the cache's ends {expected.tolist()}"
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
        model: a `LlamaForCausalLM` or a `Gemma3ForCausalLM`.
        ids, positions: (B, 1) the step's tokens and their positions (None: not asked).
        cache: the `KVCache` it appends to (None: not asked).

    Returns:
        None, or one sentence naming the first thing that sends the step to the modules.
    """
    found = _ready(model, ids, positions, cache)
    return found if isinstance(found, str) else None


def fused_logits(model: Any, ids: np.ndarray, positions: np.ndarray, cache: KVCache, *,
                 parts: int | None = None) -> np.ndarray | None:
    """Logits (B, 1, V) of the decode step `ids` (B, 1) at `positions` (B, 1) through the
    compiled step on `parts` threads (None: the BLAS thread limit in force; at most the CPUs
    this process may use), or None when the modules must run it (`compiled_step_reason`).
    One sequence runs as `step.decode_step`; B sequences (left-padded or not) as one
    `step.batch_step` of B rows, the cache's (L, B, Hkv, max, E) stores read as B blocks of
    max_length positions."""
    found = _ready(model, ids, positions, cache)
    if isinstance(found, str):
        return None
    from attnkit.quant import current_activations
    from attnkit.models.llama import step

    slot = cache.length
    if slot + 1 > cache.max_length:
        raise ValueError(f"cache holds at most {cache.max_length} positions; {slot} are used and 1 more came")
    keys, values = cache.stores
    int8, B = current_activations() == "int8", ids.shape[0]
    try:
        if B == 1 and not cache.has_padding:
            rotaries = _rotaries(model)
            if len(rotaries) == 1:
                cos, sin = rotaries[0].at(slot)
            else:
                cos, sin = (np.stack(t) for t in zip(*(rotary.at(slot) for rotary in rotaries)))
            logits = step.decode_step(int(ids[0, 0]), slot, found.frame, cos, sin, keys[:, 0], values[:, 0],
                                      int8=int8, parts=_parts(parts))[None]
        else:
            where = np.asarray(positions).reshape(-1)
            cos, sin = _tables(model, where)
            tables = np.arange(B, dtype=np.int32)[:, None]  # sequence b: block b, max_length long
            logits = step.batch_step(np.asarray(ids).reshape(-1), np.full(B, slot), tables, np.ones(B, bool),
                                     found.frame, cos, sin, keys, values, int8=int8, parts=_parts(parts),
                                     starts=_starts(cache))
    except native.Unavailable:  # no library and numba does not import: the modules run the step
        return None
    cache.advance(1)
    return logits[:, None]


def batch_step_reason(model: Any, cache: Any) -> str | None:
    """Why `BatchStep(model, cache)` runs its steps through the modules, or None when the
    compiled batched step runs them (the model one `compiled_step_reason` accepts, a float32
    `PagedKVCache`)."""
    reason = _call_reason(None, None, None)
    if reason is None and cache.dtype != np.float32:
        reason = f"the step runs a float32 cache, got {cache.dtype}"
    return _prepared(model).reason if reason is None else reason


def _parts(threads: int | None) -> int:
    from attnkit import runtime

    return max(1, min(runtime.blas_thread_count() if threads is None else threads, runtime.cpu_count()))


def batch_logits(model: Any, cache: Any, rows: list, runs: list, threads: int | None) -> np.ndarray | None:
    """Logits (rows with logits, V) of a checked batched step (`BatchStep.run`: `runs` are
    its (sequence, first row, stop row)) through the compiled kernel on `threads` threads
    (None: the BLAS thread limit in force), or None when the modules must run it (a recording
    or an intervention opened since, or no compiled code). The caller appends the tokens."""
    found = _ready(model, None, None, None)
    if isinstance(found, str):
        return None
    from attnkit.quant import current_activations
    from attnkit.models.llama import step

    n = len(rows)
    slots = np.empty(n, np.int64)
    width = max(len(cache.block_table(seq)) for seq, _, _ in runs)
    tables = np.zeros((n, width), np.int32)
    for seq, first, stop in runs:
        table, length = cache.block_table(seq), cache.length(seq)
        slots[first:stop] = np.arange(length, length + stop - first)
        tables[first:stop, :len(table)] = table
    tokens = np.array([row.token for row in rows], np.int64)
    wanted = np.array([row.logits for row in rows], bool)
    cos, sin = _tables(model, slots)
    try:
        return step.batch_step(tokens, slots, tables, wanted, found.frame, cos, sin, cache.keys, cache.values,
                               int8=current_activations() == "int8", parts=_parts(threads))
    except native.Unavailable:  # no library and numba does not import: the modules run the step
        return None
