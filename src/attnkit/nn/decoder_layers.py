"""The pieces a Llama-family decoder adds to the transformer block.

- `Embedding`: token id -> row of a (vocab, d) table.
- `RMSNorm`: LayerNorm without centering or bias, x / sqrt(mean(x^2) + eps) * weight.
- `RotaryEmbedding`: rotary position embeddings (RoPE). Each pair of channels
  (x_i, x_{i+E/2}) of a query or key is rotated by the angle position * theta_i,
  theta_i = base^(-2i/E), so the score q_m . k_n depends on m - n only.
- `SwiGLU`: the gated feed-forward, down(silu(gate(x)) * up(x)), optionally with biases.
- `CausalSelfAttention`: multi-head (or grouped-query) self-attention that
  appends to a `KVCache` and attends through it, with optional rotary embeddings.

Weights are in torch layout ((out_features, in_features)). `SwiGLU` also keeps
a fused, pre-transposed copy of gate and up, (d_model, 2 * d_ff), and
`CausalSelfAttention` one of query, key and value, (d_model, (Hq + 2 Hkv) E), so
a decode step makes one matrix-vector product where it would make two or three.
The copies are rebuilt whenever a weight array is replaced.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from attnkit.nn.cache import KVCache
from attnkit.nn.interface import AttentionModule
from attnkit.nn.linear import Linear
from attnkit.nn.module import Module, make_rng
from attnkit.nn.positional import RopeScaling, rope_frequencies

__all__ = ["CausalSelfAttention", "Embedding", "RMSNorm", "RotaryEmbedding", "SwiGLU", "silu"]


class Embedding(Module):
    """A lookup table: ids (...,) -> (..., embedding_dim).

    Parameters: ``weight`` (num_embeddings, embedding_dim), initialized N(0, 1) like torch.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, seed: int | np.random.Generator | None = None):
        super().__init__()
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        rng = make_rng(seed)
        weight = rng.standard_normal((self.num_embeddings, self.embedding_dim), dtype=np.float32)
        self.register_parameter("weight", weight)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"expected integer token ids, got dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise ValueError(
                f"expected token ids in [0, {self.num_embeddings}), got values from {ids.min()} to {ids.max()}"
            )
        return self.weight[ids]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class RMSNorm(Module):
    """Root-mean-square normalization: y = x / sqrt(mean(x^2, last axis) + eps) * weight.

    Computed in float32 at least (like Hugging Face's LlamaRMSNorm); output in x's dtype.
    Parameters: ``weight`` (d,), initialized to ones.
    """

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.d = int(d)
        self.eps = float(eps)
        self.register_parameter("weight", np.ones(self.d))

    def forward(self, x: np.ndarray, out_dtype: np.dtype | type | None = None) -> np.ndarray:
        """x (..., d) -> (..., d) in `out_dtype` (default x's dtype)."""
        if x.shape[-1] != self.d:
            raise ValueError(f"expected x of shape (..., {self.d}), got {x.shape}")
        x32 = x.astype(np.promote_types(x.dtype, np.float32), copy=False)
        if x.size == self.d:  # one vector, as a decode step normalizes twice a layer
            # its mean square is one dot product, and the root a Python float: three calls
            # where the rows' path below makes seven (each costs more than its arithmetic here)
            flat = x32.reshape(-1)
            y = np.divide(x32, math.sqrt(float(np.dot(flat, flat)) / self.d + self.eps))
        else:
            # np.mean's arithmetic (sum, then divide by d) without its Python overhead
            mean_square = np.add.reduce(np.square(x32), axis=-1, keepdims=True)  # (..., 1)
            mean_square /= self.d
            mean_square += x32.dtype.type(self.eps)
            np.sqrt(mean_square, out=mean_square)
            y = x32 / mean_square
        # times the weight, rounded once into the output dtype (as y * weight, then astype)
        out = np.empty(y.shape, x.dtype if out_dtype is None else out_dtype)
        return np.multiply(y, self.__dict__["_parameters"]["weight"], out=out, casting="same_kind")

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


class RotaryEmbedding(Module):
    """Rotary position embeddings in the "rotate half" layout of Hugging Face's Llama.

    Channel i and channel i + E/2 of each head form a pair rotated by position * theta_i,
    theta_i = base^(-2i/E) unless `scaling` stretches them (`attnkit.nn.positional.RopeScaling`:
    linear, dynamic, yarn, llama3, or llama.cpp's per-frequency divisors). Frequencies,
    angles and their cos and sin are computed in float64 and rounded once into the model's
    dtype: a float64 model is float64 throughout, and a float32 one gets the correctly rounded
    cos and sin of the exact angle (transformers rounds the angle position * theta_i to float32
    first, an error that grows with the position: half an ulp of 240 rad is 7.6e-6). cos and
    sin are multiplied by the scaling's attention factor (yarn). The table grows on demand;
    with "dynamic" scaling, positions past `max_position_embeddings` use frequencies of the
    current length (max position + 1), as transformers' forward does.

    A module without parameters: `astype` on the model that holds it sets the tables' dtype
    (float32 until then).

    Arguments:
        head_dim: E (even).
        base: theta base (10000 for Llama 2, 100000 for SmolLM2; `rope_theta` in configs).
        scaling: a `RopeScaling`, or None for the original frequencies.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, scaling=None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"expected an even head_dim for rotary embeddings, got {head_dim}")
        self.head_dim = int(head_dim)
        self.base = float(base)
        self.scaling = scaling or RopeScaling()
        self.inv_freq = rope_frequencies(self.head_dim, self.base, self.scaling, dtype=np.float64)  # (E/2,)
        self.attention_scaling = self.scaling.attention_scaling()
        self._dtype_changed(np.dtype(np.float32))

    def _dtype_changed(self, dtype: np.dtype) -> None:
        # (cos, sin) as one tuple, replaced whole when it grows: a reader in another
        # thread takes both from the same table, never a new cos with an old, shorter sin
        # (written past Module.__setattr__: a table is not a change of the model's structure)
        empty = np.zeros((0, self.head_dim), dtype)
        object.__setattr__(self, "_tables", (empty, empty))

    @property
    def table_dtype(self) -> np.dtype:
        """The dtype of cos and sin: the model's (float32 or float64)."""
        return self._tables[0].dtype

    def _table(self, positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        angles = positions.astype(np.float64)[..., None] * inv_freq  # (..., E/2), exact to float64
        angles = np.concatenate([angles, angles], axis=-1)  # (..., E)
        cos, sin = np.cos(angles), np.sin(angles)
        if self.attention_scaling != 1.0:
            cos *= self.attention_scaling
            sin *= self.attention_scaling
        dtype = self.table_dtype
        return cos.astype(dtype), sin.astype(dtype)  # each rounded once

    def _grow(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        length = max(length, 2 * len(self._tables[0]), 64)
        tables = self._table(np.arange(length), self.inv_freq)
        object.__setattr__(self, "_tables", tables)  # one attribute write: readers see the old pair or the new one
        return tables

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin for integer `positions` (any shape P): each (*P, E), in `table_dtype`."""
        positions = np.asarray(positions)
        top = int(positions.max()) + 1 if positions.size else 0
        if self.scaling.is_dynamic and top > self.scaling.max_position_embeddings:
            inv_freq = rope_frequencies(self.head_dim, self.base, self.scaling, seq_len=top, dtype=np.float64)
            return self._table(positions, inv_freq)
        cos, sin = self._tables
        if top > len(cos):
            cos, sin = self._grow(top)
        return cos[positions], sin[positions]

    def at(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of one position (a decode step's): each (E,) in `table_dtype`,
        C-contiguous (the rows `cos_sin` gives, without its array work)."""
        if self.scaling.is_dynamic and position >= self.scaling.max_position_embeddings:
            cos, sin = self.cos_sin(np.array([position]))
            return cos[0], sin[0]
        cos, sin = self._tables
        if position >= len(cos):
            cos, sin = self._grow(position + 1)
        return cos[position], sin[position]

    def extra_repr(self) -> str:
        return f"{self.head_dim}, base={self.base:g}, rope_type={self.scaling.rope_type!r}"

    @staticmethod
    def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate x (..., E) by angles whose cos and sin broadcast against it.

        x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[E/2:], x[:E/2]).
        """
        half = x.shape[-1] // 2
        out = x * cos
        # the same products and sums as forming rotate_half(x) * sin, without building it
        term = x[..., half:] * sin[..., :half]
        out[..., :half] -= term
        np.multiply(x[..., :half], sin[..., half:], out=term)
        out[..., half:] += term
        return out


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) = x / (1 + exp(-x)), as torch computes it.

    exp's argument is capped at 80 so nothing overflows (float32 exp(89) would); below
    x = -80 the result is within 1e-32 of the true value, which is 0 to float32.
    """
    denominator = np.negative(x)
    np.minimum(denominator, 80, out=denominator)
    np.exp(denominator, out=denominator)
    denominator += 1
    return np.divide(x, denominator, out=denominator)


class SwiGLU(Module):
    """Gated feed-forward of Llama: down_proj(silu(gate_proj(x)) * up_proj(x)).

    Arguments:
        d_model: input and output size.
        d_ff: hidden size (`intermediate_size`).
        bias: biases on the three projections (Hugging Face's `mlp_bias`).

    Parameters: ``gate_proj.weight``, ``up_proj.weight`` (d_ff, d_model), ``down_proj.weight``
    (d_model, d_ff), and their biases when `bias`.
    """

    def __init__(
        self, d_model: int, d_ff: int, *, bias: bool = False, seed: int | np.random.Generator | None = None
    ) -> None:
        super().__init__()
        rng = make_rng(seed)
        self.d_model, self.d_ff = int(d_model), int(d_ff)
        self.gate_proj = Linear(d_model, d_ff, bias=bias, seed=rng)
        self.up_proj = Linear(d_model, d_ff, bias=bias, seed=rng)
        self.down_proj = Linear(d_ff, d_model, bias=bias, seed=rng)
        self._fused_from: tuple = ()

    def _fused(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(gate_up_t (d_model, 2*d_ff), gate_up_bias (2*d_ff,) or None, down_t (d_ff, d_model), a view),
        rebuilt when a weight is replaced."""
        modules = self.__dict__["_modules"]  # (attribute lookup through Module.__getattr__ is slow)
        params = [modules[name]._parameters for name in ("gate_proj", "up_proj", "down_proj")]
        sources = tuple(p["weight"] for p in params) + tuple(p["bias"] for p in params)
        if len(self._fused_from) != len(sources) or not all(map(operator.is_, sources, self._fused_from)):
            gate, up, down = self.gate_proj, self.up_proj, self.down_proj
            self._gate_up_t = np.ascontiguousarray(np.concatenate([gate.weight, up.weight], axis=0).T)
            self._gate_up_bias = None if gate.bias is None else np.concatenate([gate.bias, up.bias])
            # down.weight (d_model, d_ff) kept row-major and read as its transpose: a decode
            # step's vector-matrix product then runs BLAS's transposed gemv, a dot product per
            # row (d_ff long), which reads memory faster than over a (d_ff, d_model) copy
            # (docs/benchmarks.md, "Measurements behind design choices")
            self._down_t = np.ascontiguousarray(down.weight).T
            self._fused_from = sources
        return self._gate_up_t, self._gate_up_bias, self._down_t

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x: (..., d_model) -> (..., d_model)."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"expected x of shape (..., {self.d_model}), got {x.shape}")
        gate_up_t, gate_up_bias, down_t = self._fused()
        gate_up = x @ gate_up_t  # (..., 2 * d_ff)
        if gate_up_bias is not None:
            gate_up += gate_up_bias
        gate, up = gate_up[..., : self.d_ff], gate_up[..., self.d_ff :]
        hidden = silu(gate)
        hidden *= up
        out = hidden @ down_t  # (..., d_model)
        down_bias = self._fused_from[5]
        if down_bias is not None:
            out += down_bias
        return out

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, bias={self.gate_proj.bias is not None}"


class CausalSelfAttention(AttentionModule):
    """Self-attention of a decoder, through a `KVCache`.

    Projects x to queries (Hq heads), keys and values (Hkv heads, Hq a multiple of Hkv:
    grouped-query attention when fewer), optionally rotates queries and keys (RoPE), appends
    keys and values to the cache and attends over everything cached with bottom-right
    causal alignment (`KVCache.attend`), through `self.backend` (an `AttentionModule`:
    `model.set_attention_backend(name)` reaches it, `record_attention` records it).

    Arguments:
        d_model: model width.
        num_heads: Hq.
        num_kv_heads: Hkv (default Hq).
        head_dim: E (default d_model // Hq).
        bias: biases on the four projections.
        scale: score scale (default 1/sqrt(E)).

    Parameters: ``q_proj.weight`` (Hq*E, d), ``k_proj.weight``/``v_proj.weight`` (Hkv*E, d),
    ``out_proj.weight`` (d, Hq*E), and their biases when `bias`.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        bias: bool = False,
        scale: float | None = None,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        super().__init__()
        rng = make_rng(seed)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = d_model // num_heads if head_dim is None else head_dim
        if num_heads % num_kv_heads:
            raise ValueError(f"expected num_heads ({num_heads}) to be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = int(num_heads), int(num_kv_heads), int(head_dim)
        self.scale = scale
        self.q_proj = Linear(d_model, num_heads * head_dim, bias=bias, seed=rng)
        self.k_proj = Linear(d_model, num_kv_heads * head_dim, bias=bias, seed=rng)
        self.v_proj = Linear(d_model, num_kv_heads * head_dim, bias=bias, seed=rng)
        self.out_proj = Linear(num_heads * head_dim, d_model, bias=bias, seed=rng)
        self._fused_from: tuple = ()

    def _fused(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
        """(qkv_t (d, (Hq+2Hkv)E), qkv_bias, out_t (Hq*E, d), out_bias)."""
        modules = self.__dict__["_modules"]  # (attribute lookup through Module.__getattr__ is slow)
        params = [modules[name]._parameters for name in ("q_proj", "k_proj", "v_proj", "out_proj")]
        sources = tuple(p["weight"] for p in params) + tuple(p["bias"] for p in params)
        if len(self._fused_from) != len(sources) or not all(map(operator.is_, sources, self._fused_from)):
            q, k, v, o = self.q_proj, self.k_proj, self.v_proj, self.out_proj
            self._qkv_t = np.ascontiguousarray(np.concatenate([q.weight, k.weight, v.weight], axis=0).T)
            self._qkv_bias = None if q.bias is None else np.concatenate([q.bias, k.bias, v.bias])
            self._out_t = np.ascontiguousarray(o.weight.T)
            self._out_bias = o.bias
            self._fused_from = sources
        return self._qkv_t, self._qkv_bias, self._out_t, self._out_bias

    def forward(
        self,
        x: np.ndarray,
        cache: KVCache,
        layer: int,
        *,
        cos: np.ndarray | None = None,
        sin: np.ndarray | None = None,
    ) -> np.ndarray:
        """x (B, T, d) -> (B, T, d).

        Arguments:
            cache, layer: where this layer's keys and values are appended.
            cos, sin: (B, T, E) rotary tables for the T positions, or None for no rotation.
        """
        B, T, _ = x.shape
        Hq, Hkv, E = self.num_heads, self.num_kv_heads, self.head_dim
        qkv_t, qkv_bias, out_t, out_bias = self._fused()
        qkv = x @ qkv_t  # (B, T, (Hq + 2 Hkv) E)
        if qkv_bias is not None:
            qkv += qkv_bias
        qkv = qkv.reshape(B, T, Hq + 2 * Hkv, E)  # the query heads, then the key heads, then the value heads
        qk = qkv[:, :, : Hq + Hkv]
        if cos is not None:  # queries and keys rotated together: half the calls of a decode step's rotation
            qk = RotaryEmbedding.apply(qk, cos[:, :, None], sin[:, :, None])  # cos, sin (B, T, 1, E)
        q = qk[:, :, :Hq].transpose(0, 2, 1, 3)  # (B, Hq, T, E)
        k = qk[:, :, Hq:].transpose(0, 2, 1, 3)  # (B, Hkv, T, E)
        v = qkv[:, :, Hq + Hkv :].transpose(0, 2, 1, 3)  # (B, Hkv, T, E)
        result = cache.attend(layer, q, k, v, scale=self.scale, backend=self.attend)  # (B, Hq, T, E)
        out = result.transpose(0, 2, 1, 3).reshape(B, T, Hq * E)  # (B, T, Hq*E)
        out = out @ out_t  # (B, T, d)
        if out_bias is not None:
            out += out_bias
        return out

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
