"""The pieces a Llama-family decoder adds to the transformer block.

- `Embedding`: token id -> row of a (vocab, d) table.
- `RMSNorm`: LayerNorm without centering or bias, x / sqrt(mean(x^2) + eps) * weight.
- `RotaryEmbedding`: rotary position embeddings (RoPE). Each pair of channels
  (x_i, x_{i+E/2}) of a query or key is rotated by the angle position * theta_i,
  theta_i = base^(-2i/E), so the score q_m . k_n depends on m - n only.
- `SwiGLU`: the gated feed-forward, down(silu(gate(x)) * up(x)).

Weights are in torch layout ((out_features, in_features)). `SwiGLU` also keeps
a fused, pre-transposed copy of gate and up, (d_model, 2 * d_ff), so a decode
step makes one matrix-vector product instead of two.
"""

from __future__ import annotations

import numpy as np

from attnkit.nn.linear import Linear
from attnkit.nn.module import Module, make_rng

__all__ = ["Embedding", "RMSNorm", "RotaryEmbedding", "SwiGLU", "silu"]


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

    def forward(self, x: np.ndarray) -> np.ndarray:
        if x.shape[-1] != self.d:
            raise ValueError(f"expected x of shape (..., {self.d}), got {x.shape}")
        x32 = x.astype(np.promote_types(x.dtype, np.float32), copy=False)
        mean_square = np.mean(np.square(x32), axis=-1, keepdims=True)  # (..., 1)
        mean_square += x32.dtype.type(self.eps)
        y = x32 / np.sqrt(mean_square)
        y *= self.weight
        return y.astype(x.dtype, copy=False)

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


class RotaryEmbedding:
    """Rotary position embeddings in the "rotate half" layout of Hugging Face's Llama.

    Channel i and channel i + E/2 of each head form a pair rotated by position * theta_i,
    theta_i = base^(-2i/E). Angles are computed in float32 as transformers does, so
    logits agree to float32 rounding. The cos/sin table grows on demand.

    Arguments:
        head_dim: E (even).
        base: theta base (10000 for Llama 2, 100000 for SmolLM2; `rope_theta` in configs).
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        if head_dim % 2:
            raise ValueError(f"expected an even head_dim for rotary embeddings, got {head_dim}")
        self.head_dim = int(head_dim)
        self.base = float(base)
        exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
        self.inv_freq = (np.float32(1.0) / np.power(np.float32(base), exponent)).astype(np.float32)  # (E/2,)
        self._cos = np.zeros((0, head_dim), np.float32)
        self._sin = np.zeros((0, head_dim), np.float32)

    def _grow(self, length: int) -> None:
        length = max(length, 2 * len(self._cos), 64)
        positions = np.arange(length, dtype=np.float32)
        angles = positions[:, None] * self.inv_freq[None, :]  # (T, E/2), float32 like transformers
        angles = np.concatenate([angles, angles], axis=-1)  # (T, E)
        self._cos, self._sin = np.cos(angles), np.sin(angles)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin for integer `positions` (any shape P): each (*P, E), float32."""
        positions = np.asarray(positions)
        top = int(positions.max()) + 1 if positions.size else 0
        if top > len(self._cos):
            self._grow(top)
        return self._cos[positions], self._sin[positions]

    @staticmethod
    def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate x (..., E) by angles whose cos and sin broadcast against it.

        x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[E/2:], x[:E/2]).
        """
        half = x.shape[-1] // 2
        rotated = np.empty_like(x)
        np.negative(x[..., half:], out=rotated[..., :half])
        rotated[..., half:] = x[..., :half]
        rotated *= sin
        out = x * cos
        out += rotated
        return out


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), with sigmoid(x) = (1 + tanh(x / 2)) / 2 so nothing overflows."""
    half = x.dtype.type(0.5) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else 0.5
    out = np.tanh(x * half)
    out *= half
    out += half
    out *= x
    return out


class SwiGLU(Module):
    """Gated feed-forward of Llama: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases.

    Arguments:
        d_model: input and output size.
        d_ff: hidden size (`intermediate_size`).

    Parameters: ``gate_proj.weight``, ``up_proj.weight`` (d_ff, d_model), ``down_proj.weight``
    (d_model, d_ff).
    """

    def __init__(self, d_model: int, d_ff: int, *, seed: int | np.random.Generator | None = None) -> None:
        super().__init__()
        rng = make_rng(seed)
        self.d_model, self.d_ff = int(d_model), int(d_ff)
        self.gate_proj = Linear(d_model, d_ff, bias=False, seed=rng)
        self.up_proj = Linear(d_model, d_ff, bias=False, seed=rng)
        self.down_proj = Linear(d_ff, d_model, bias=False, seed=rng)
        self._fused_from: tuple = ()

    def _fused(self) -> tuple[np.ndarray, np.ndarray]:
        """(gate_up_t (d_model, 2*d_ff), down_t (d_ff, d_model)), rebuilt when a weight is replaced."""
        sources = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if len(self._fused_from) != 3 or any(a is not b for a, b in zip(sources, self._fused_from)):
            gate, up, down = sources
            self._gate_up_t = np.ascontiguousarray(np.concatenate([gate, up], axis=0).T)
            self._down_t = np.ascontiguousarray(down.T)
            self._fused_from = sources
        return self._gate_up_t, self._down_t

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x: (..., d_model) -> (..., d_model)."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"expected x of shape (..., {self.d_model}), got {x.shape}")
        gate_up_t, down_t = self._fused()
        gate_up = x @ gate_up_t  # (..., 2 * d_ff)
        gate, up = gate_up[..., : self.d_ff], gate_up[..., self.d_ff :]
        hidden = silu(gate)
        hidden *= up
        return hidden @ down_t  # (..., d_model)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}"
