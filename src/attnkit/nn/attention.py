"""Attention modules: one self-attention head, and batch-first multi-head attention.

Both attend through their backend (`AttentionModule.attend`, "naive" =
`attnkit.functional.scaled_dot_product_attention` by default); this file only
projects, splits heads, builds masks and merges heads.

Masks use attnkit's one polarity: boolean True = may attend, float masks are
added to the scores. `key_mask` (B, S) is True for a real token. torch's
`nn.MultiheadAttention` reads a boolean True as *masked*; convert its masks
with `attnkit.masks.from_torch_mask` (or `~mask`).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import numpy as np

from attnkit.functional.masks import causal_mask
from attnkit.nn.cache import KVCache
from attnkit.nn.interface import AttentionModule
from attnkit.nn.linear import Linear, linear
from attnkit.nn.module import check_float_input, compute_dtype, make_rng
from attnkit.nn.spec import (
    KEY_PADDING_HINT,
    attention_extra_repr,
    check_attention_inputs,
    check_attn_mask_shape,
    check_dropout,
    check_is_causal,
    check_key_mask_shape,
)


class AttentionResult(NamedTuple):
    """(output, weights) from an attention module.

    weights is None unless asked for (need_weights=True on MultiHeadAttention).
    """

    output: np.ndarray
    weights: np.ndarray | None


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    return int(value)


class AttentionDims(NamedTuple):
    """Checked sizes of a multi-head attention layer."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kdim: int
    vdim: int


def check_attention_dims(
    d_model: Any, num_heads: Any, num_kv_heads: Any = None, kdim: Any = None, vdim: Any = None
) -> AttentionDims:
    """Validate a multi-head layer's sizes (shared by attnkit.nn and attnkit.torch)."""
    d_model = _positive_int("d_model", d_model)
    num_heads = _positive_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
    if d_model % num_heads:
        raise ValueError(f"expected num_heads to divide d_model, got d_model={d_model} and num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"expected num_kv_heads to divide num_heads, got num_heads={num_heads} and num_kv_heads={num_kv_heads}"
        )
    kdim = d_model if kdim is None else _positive_int("kdim", kdim)
    vdim = d_model if vdim is None else _positive_int("vdim", vdim)
    return AttentionDims(d_model, num_heads, num_kv_heads, d_model // num_heads, kdim, vdim)


def attention_options(
    attn_mask: np.ndarray | None,
    key_mask: np.ndarray | None,
    *,
    is_causal: bool,
    batch: int,
    num_heads: int,
    L: int,
    S: int,
    dtype: np.dtype,
    causal_align: str = "top_left",
    key_padding: np.ndarray | None = None,
) -> dict[str, Any]:
    """A module call's masks as the keywords every attention backend takes.

    Causality and key padding travel as keywords (`is_causal`, `causal_align`,
    `key_padding_mask`), never as a dense mask, so a tiled backend can skip the tiles
    they exclude. Only an explicit `attn_mask` together with `is_causal` (which the
    backends take one at a time) is combined into one dense mask.

    Arguments:
        attn_mask: None, bool (True = may attend) or float (added), shaped (L, S) or
            4-D broadcastable to (B, H, L, S), e.g. (B, 1, L, S).
        key_mask: None or bool (B, S), True = a real token that may be attended.
        is_causal: causal, aligned by `causal_align` ("bottom_right" for a KV cache).
        dtype: the compute dtype, for float masks.
        key_padding: None or bool (B, S), more padding to combine (a KV cache's).

    Returns:
        {"attn_mask", "is_causal", "causal_align", "key_padding_mask"} for `attend`.
    """
    check_is_causal(is_causal)
    if key_mask is not None:
        key_mask = np.asarray(key_mask)
        if key_mask.dtype != np.bool_:
            raise TypeError(
                f"expected key_mask to be boolean (True = real token), got dtype {key_mask.dtype}; " + KEY_PADDING_HINT
            )
        check_key_mask_shape(key_mask.shape, batch, S)
    if key_padding is not None:
        key_mask = key_padding if key_mask is None else key_mask & key_padding
    options = {"attn_mask": None, "is_causal": bool(is_causal), "causal_align": causal_align,
               "key_padding_mask": key_mask}
    if attn_mask is None:
        return options
    attn_mask = np.asarray(attn_mask)
    if attn_mask.dtype != np.bool_ and not np.issubdtype(attn_mask.dtype, np.floating):
        raise TypeError(
            "expected attn_mask to be boolean (True = may attend) or floating (added to the scores), "
            f"got dtype {attn_mask.dtype}"
        )
    check_attn_mask_shape(attn_mask.shape, batch, num_heads, L, S)
    if attn_mask.dtype != np.bool_:
        attn_mask = attn_mask.astype(dtype, copy=False)
    if is_causal:  # the backends take attn_mask or is_causal: one dense mask here
        allowed = causal_mask(L, S, align=causal_align)  # (L, S)
        attn_mask = attn_mask & allowed if attn_mask.dtype == np.bool_ else np.where(allowed, attn_mask,
                                                                                       dtype.type(-np.inf))
        options["is_causal"] = False
    options["attn_mask"] = attn_mask
    return options


def build_attention_mask(
    attn_mask: np.ndarray | None,
    key_mask: np.ndarray | None,
    is_causal: bool,
    batch: int,
    num_heads: int,
    L: int,
    S: int,
    dtype: np.dtype,
) -> tuple[np.ndarray | None, bool]:
    """Deprecated (0.2.0; removed in 0.3.0): use `attention_options`, which passes
    causality and key padding to the backend as keywords instead of a dense mask.

    Returns (mask, is_causal): one dense mask broadcastable to (B, H, L, S), or None
    and is_causal when no mask is needed.
    """
    warnings.warn("build_attention_mask is deprecated; use attention_options (keywords, no dense mask)",
                  DeprecationWarning, stacklevel=2)
    options = attention_options(attn_mask, key_mask, is_causal=is_causal and attn_mask is not None, batch=batch,
                                num_heads=num_heads, L=L, S=S, dtype=dtype)
    mask, padding = options["attn_mask"], options["key_padding_mask"]
    if padding is None:
        return mask, bool(is_causal) and mask is None
    allowed = padding[:, None, None, :]  # (B, 1, 1, S)
    if is_causal and mask is None:
        allowed = allowed & causal_mask(L, S)
    if mask is None:
        return allowed, False
    if mask.dtype == np.bool_:
        return mask & allowed, False
    return np.where(allowed, mask, dtype.type(-np.inf)), False


class SingleHeadSelfAttention(AttentionModule):
    """One self-attention head (the first seed's class, with torch-layout weights).

    output = softmax(q @ k^T / sqrt(d_head) + mask) @ v, with q, k, v = x @ W.T.

    Arguments:
        d_model: size of the input embeddings.
        d_head: size of the query, key and value vectors.
        bias: biases on the projections (the seed has none).
        seed: int, Generator or None.

    Parameters: ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``, each
    (d_head, d_model) (plus ``*.bias`` (d_head,) with bias=True).
    """

    returns_weights = True  # forward returns (output, weights)

    def __init__(
        self, d_model: int, d_head: int, bias: bool = False, *, seed: int | np.random.Generator | None = None
    ) -> None:
        super().__init__()
        self.d_model = _positive_int("d_model", d_model)
        self.d_head = _positive_int("d_head", d_head)
        rng = make_rng(seed)
        self.q_proj = Linear(d_model, d_head, bias, seed=rng)
        self.k_proj = Linear(d_model, d_head, bias, seed=rng)
        self.v_proj = Linear(d_model, d_head, bias, seed=rng)

    def forward(self, x: np.ndarray, mask: np.ndarray | None = None, *, is_causal: bool = False) -> AttentionResult:
        """Attend over a sequence.

        Arguments:
            x: (L, d_model) or (..., L, d_model).
            mask: bool (True = may attend) or float (added), broadcastable to (..., L, L).
                The seed's 0/1 float "look-ahead" matrix is not a mask here:
                pass ``attnkit.masks.causal_mask(L)`` or is_causal=True.
            is_causal: top-left causal mask.

        Returns:
            AttentionResult(output (..., L, d_head), weights (..., L, L)), x's dtype.
        """
        x = check_float_input("x", x)
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"expected x of shape (L, {self.d_model}) or (..., L, {self.d_model}), got {x.shape}")
        dt = compute_dtype(x.dtype, self.q_proj.weight.dtype)
        xc = x.astype(dt, copy=False)
        q = linear(xc, self.q_proj.weight, self.q_proj.bias)  # (..., L, d_head)
        k = linear(xc, self.k_proj.weight, self.k_proj.bias)
        v = linear(xc, self.v_proj.weight, self.v_proj.bias)
        result = self.attend(q, k, v, attn_mask=mask, is_causal=is_causal, return_weights=True)
        return AttentionResult(result.output.astype(x.dtype, copy=False), result.weights.astype(x.dtype, copy=False))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_head={self.d_head}"


class MultiHeadAttention(AttentionModule):
    """Multi-head attention, batch-first, split-head (one projection per role).

    Arguments:
        d_model: model width; query input size and output size.
        num_heads: query heads; head_dim = d_model // num_heads.
        num_kv_heads: key/value heads for grouped-query attention (default
            num_heads; 1 is multi-query attention). Query head h reads
            key/value head h // (num_heads // num_kv_heads).
        bias: biases on all four projections.
        dropout: dropout on the attention weights, only in training mode.
        kdim, vdim: input sizes of key and value (default d_model), for cross attention.
        seed: int, Generator or None; initializes q, k, v, out in that order,
            then drives dropout.

    Parameters (torch layout): ``q_proj.weight`` (d_model, d_model),
    ``k_proj.weight`` (num_kv_heads * head_dim, kdim), ``v_proj.weight``
    (num_kv_heads * head_dim, vdim), ``out_proj.weight`` (d_model, d_model),
    and a ``.bias`` for each with bias=True.

    Self-attention (key and value omitted or the very same array as query)
    runs one fused QKV matrix product; the concatenated weight is built once
    and rebuilt whenever a projection's parameters are replaced.

    The attention itself is ``ATTENTION_BACKENDS[self.backend]`` ("naive" by
    default; set ``mha.backend = "flash"``, or ``set_attention_backend`` on a
    parent module, for the tiled kernel, which returns no weights), called
    through `AttentionModule.attend`, which records maps for `record_attention`.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        kdim: int | None = None,
        vdim: int | None = None,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        super().__init__()
        dims = check_attention_dims(d_model, num_heads, num_kv_heads, kdim, vdim)
        self.d_model, self.num_heads, self.num_kv_heads = dims.d_model, dims.num_heads, dims.num_kv_heads
        self.head_dim, self.kdim, self.vdim = dims.head_dim, dims.kdim, dims.vdim
        self.dropout = check_dropout(dropout)
        rng = make_rng(seed)
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = Linear(self.d_model, self.d_model, bias, seed=rng)
        self.k_proj = Linear(self.kdim, kv_width, bias, seed=rng)
        self.v_proj = Linear(self.vdim, kv_width, bias, seed=rng)
        self.out_proj = Linear(self.d_model, self.d_model, bias, seed=rng)
        self.rng = rng
        self._fused: dict[tuple[str, np.dtype], tuple[tuple, np.ndarray, np.ndarray | None]] = {}

    # ----- fused projections ---------------------------------------------------------

    def _parameters_changed(self) -> None:
        self._fused.clear()

    FUSED_PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "kv": ("k_proj", "v_proj")}

    def fused_weights(self, role: str, dtype) -> tuple[np.ndarray, np.ndarray | None]:
        """The projections `role` names as one matrix, so that one product projects them all.

        Arguments:
            role: "qkv" (q_proj, k_proj, v_proj: self-attention, needs kdim == vdim == d_model)
                or "kv" (k_proj, v_proj: needs kdim == vdim).
            dtype: the dtype of the returned arrays (float32 or float64, like the input).

        Returns:
            (weight, bias): weight (sum of the projections' outs, in), laid out so that
            `x @ weight.T` is a plain matrix product whose columns are the projections'
            outputs in `role`'s order (for "qkv": d_model query columns, then
            num_kv_heads * head_dim key columns, then as many value columns); bias
            (sum of outs,), or None for a module without biases. Both are cached per
            dtype while the projections hold the same parameter arrays, and read-only.
        """
        names = self.FUSED_PROJECTIONS.get(role)
        if names is None:
            raise ValueError(f"expected role to be one of {sorted(self.FUSED_PROJECTIONS)}, got {role!r}")
        projections = tuple(getattr(self, name) for name in names)
        widths = {p.weight.shape[1] for p in projections}
        if len(widths) != 1:
            raise ValueError(f"fused_weights({role!r}) needs projections of one input width, got "
                             + ", ".join(f"{name} {p.weight.shape[1]}" for name, p in zip(names, projections)))
        return self._fused_weights(role, projections, np.dtype(dtype))

    def _fused_weights(self, name: str, projections: tuple[Linear, ...], dtype: np.dtype):
        """Concatenated (sum of outs, in) weight and bias of `projections`, cached
        per dtype while the projections hold the same parameter arrays (the
        implementation of `fused_weights`; models/bert.py called it before 0.2.0)."""
        sources = tuple(a for p in projections for a in (p.weight, p.bias))
        cached = self._fused.get((name, dtype))
        if cached is not None and len(cached[0]) == len(sources) and all(a is b for a, b in zip(cached[0], sources)):
            return cached[1], cached[2]
        # (sum of outs, in), column-major like Linear.weight so x @ weight.T is a plain GEMM
        weight = np.concatenate([p.weight.T for p in projections], axis=1).astype(dtype, copy=False).T
        bias = None
        if projections[0].bias is not None:
            bias = np.concatenate([p.bias for p in projections]).astype(dtype, copy=False)
            bias.flags.writeable = False
        weight.flags.writeable = False  # the cache hands out the same arrays: nobody writes to them
        self._fused[(name, dtype)] = (sources, weight, bias)
        return weight, bias

    def _project(self, query, key, value, dtype):
        """q (B, L, d_model), k and v (B, S, num_kv_heads * head_dim) in `dtype`."""
        q_width, kv_width = self.d_model, self.num_kv_heads * self.head_dim
        if key is query and value is query and self.kdim == self.vdim == self.d_model:
            weight, bias = self._fused_weights("qkv", (self.q_proj, self.k_proj, self.v_proj), dtype)
            qkv = linear(query.astype(dtype, copy=False), weight, bias)  # (B, L, q_width + 2 kv_width)
            return qkv[..., :q_width], qkv[..., q_width : q_width + kv_width], qkv[..., q_width + kv_width :]
        q = linear(query.astype(dtype, copy=False), self.q_proj.weight, self.q_proj.bias)  # (B, L, d_model)
        if key is value and self.kdim == self.vdim:
            weight, bias = self._fused_weights("kv", (self.k_proj, self.v_proj), dtype)
            kv = linear(key.astype(dtype, copy=False), weight, bias)  # (B, S, 2 kv_width)
            return q, kv[..., :kv_width], kv[..., kv_width:]
        k = linear(key.astype(dtype, copy=False), self.k_proj.weight, self.k_proj.bias)  # (B, S, kv_width)
        v = linear(value.astype(dtype, copy=False), self.v_proj.weight, self.v_proj.bias)
        return q, k, v

    # ----- forward ---------------------------------------------------------------------

    def _check_inputs(self, query, key, value):
        return check_attention_inputs(self, query, key, value, check_float_input)

    def forward(
        self,
        query: np.ndarray,
        key: np.ndarray | None = None,
        value: np.ndarray | None = None,
        *,
        attn_mask: np.ndarray | None = None,
        key_mask: np.ndarray | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        kv_cache: KVCache | None = None,
        layer: int = 0,
    ) -> AttentionResult:
        """Attend from query to key/value.

        Arguments:
            query: (B, L, d_model).
            key: (B, S, kdim); omitted for self-attention (key = value = query).
            value: (B, S, vdim); defaults to key.
            attn_mask: bool (True = may attend) or float (added to the scores),
                (L, S) or 4-D broadcastable to (B, num_heads, L, S).
            key_mask: bool (B, S), True = a real token (the opposite of torch's
                key_padding_mask).
            is_causal: top-left causal mask; with a kv_cache, bottom-right (the L
                new queries are the last L of the S keys); combines with the other masks.
            need_weights: also return the attention weights.
            average_attn_weights: average the weights over heads -> (B, L, S);
                otherwise per head (B, num_heads, L, S).
            kv_cache, layer: self-attention decoding: this call's keys and values are
                appended to `kv_cache` (see `new_kv_cache`) at `layer` and the queries
                attend to all S cached, with its padding (`KVCache.add_padding`);
                attn_mask and key_mask then cover the S cached keys.

        Returns:
            AttentionResult(output (B, L, d_model), weights or None), in query's
            dtype. A query that may attend to no key gets attention output 0
            (so the layer output is out_proj's bias), never NaN.
        """
        self_attention = key is None and value is None
        query, key, value = self._check_inputs(query, key, value)
        if kv_cache is not None and not self_attention:
            raise ValueError("kv_cache is for self-attention decoding: pass neither key nor value")
        B, L, _ = query.shape
        S = key.shape[1]
        H, Hkv, E = self.num_heads, self.num_kv_heads, self.head_dim
        dt = compute_dtype(np.result_type(query, key, value), self.q_proj.weight.dtype)

        q, k, v = self._project(query, key, value, dt)
        q = q.reshape(B, L, H, E).transpose(0, 2, 1, 3)  # (B, H, L, E)
        k = k.reshape(B, S, Hkv, E).transpose(0, 2, 1, 3)  # (B, Hkv, S, E)
        v = v.reshape(B, S, Hkv, E).transpose(0, 2, 1, 3)  # (B, Hkv, S, E)
        if kv_cache is None:
            options = attention_options(attn_mask, key_mask, is_causal=is_causal, batch=B, num_heads=H, L=L, S=S,
                                        dtype=dt)
        else:
            k, v = (x.astype(dt, copy=False) for x in kv_cache.update(layer, k, v))  # (B, Hkv, past + L, E)
            S = k.shape[2]
            # the call's masks over the S cached keys: causal bottom-right, with the cache's padding
            options = attention_options(
                attn_mask, key_mask, is_causal=is_causal, batch=B, num_heads=H, L=L, S=S, dtype=dt,
                causal_align="bottom_right", key_padding=kv_cache.key_padding[:, :S] if kv_cache.has_padding else None,
            )
        result = self.attend(
            q, k, v, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=Hkv != H, rng=self.rng, return_weights=need_weights, **options,
        )
        heads = result.output if need_weights else result  # (B, H, L, E)
        merged = heads.transpose(0, 2, 1, 3).reshape(B, L, H * E)  # (B, L, d_model)
        out = linear(merged, self.out_proj.weight, self.out_proj.bias).astype(query.dtype, copy=False)
        weights = None
        if need_weights:
            weights = result.weights  # (B, H, L, S)
            if average_attn_weights:
                weights = weights.mean(axis=1)  # (B, L, S)
            weights = weights.astype(query.dtype, copy=False)
        return AttentionResult(out, weights)

    def new_kv_cache(self, batch_size: int, max_length: int, num_layers: int = 1) -> KVCache:
        """An empty KVCache shaped for this module, in its parameters' dtype."""
        dtype = self.k_proj.weight.dtype
        return KVCache(num_layers, batch_size, self.num_kv_heads, self.head_dim, max_length,
                       dtype=dtype if dtype in (np.float32, np.float64) else np.float32)

    def extra_repr(self) -> str:
        return attention_extra_repr(self)
