"""Activations, dropout, LayerNorm and the position-wise FeedForward network."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from attnkit.kernels import elementwise as compiled
from attnkit.nn.linear import Linear, linear
from attnkit.nn.module import Module, check_float_input, compute_dtype, make_rng
from attnkit.nn.spec import check_dropout, feed_forward_extra_repr

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ----- activations -------------------------------------------------------------
# Each takes a float array and returns a new array of the same dtype (float16
# computes in float32). Python-float constants keep float32 float32.


def _as_compute(x: np.ndarray) -> np.ndarray:
    return x.astype(compute_dtype(x.dtype, np.float32), copy=False)


def relu(x: np.ndarray) -> np.ndarray:
    """max(x, 0)."""
    x = check_float_input("x", x)
    return np.maximum(x, 0)


# erf for float32: Eigen's rational minimax approximation on [-4, 4] (beyond
# it erf is +-1 in float32): erf(x) ~= x * P(x^2) / Q(x^2). Max error 4.2e-7
# against the float64 erf, the same size as torch's own float32 GELU's; faster
# than an erf that computes float32 in double (docs/benchmarks.md).
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)  # highest power first
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)
_CHUNK = 65536  # elements per step: the scratch arrays stay in cache


def _gelu_float32(x: np.ndarray) -> np.ndarray:
    """Exact-formula GELU for a float32 array, in cache-sized chunks."""
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty_like(flat)
    n = min(_CHUNK, flat.size)
    x2, p, q = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)
    for start in range(0, flat.size, _CHUNK):
        xs = flat[start : start + _CHUNK]
        m = xs.size
        t, x2m, pm, qm = out[start : start + m], x2[:m], p[:m], q[:m]
        np.multiply(xs, _INV_SQRT2, out=t)  # t = x / sqrt(2)
        np.clip(t, -4.0, 4.0, out=t)
        np.multiply(t, t, out=x2m)
        np.multiply(x2m, _ERF_P[0], out=pm)  # Horner in t^2
        for c in _ERF_P[1:-1]:
            pm += c
            pm *= x2m
        pm += _ERF_P[-1]
        pm *= t
        np.multiply(x2m, _ERF_Q[0], out=qm)
        for c in _ERF_Q[1:-1]:
            qm += c
            qm *= x2m
        qm += _ERF_Q[-1]
        np.divide(pm, qm, out=t)  # t = erf(x / sqrt(2))
        t += 1.0
        t *= xs
        t *= 0.5
    return out.reshape(x.shape)


def _erf_float64(t: np.ndarray) -> np.ndarray:
    """erf of each element of a float64 array by Python's `math.erf` (the C library's erf,
    within an ulp or so): the float64 reference path, exact rather than fast (a Python call
    an element)."""
    flat = np.fromiter(map(math.erf, t.ravel().tolist()), dtype=np.float64, count=t.size)
    return flat.reshape(t.shape)


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU, x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2))), torch's default GELU.

    float64 uses the C library's erf (`math.erf`, exact to rounding); float32 (and float16,
    computed in float32) a rational erf approximation whose error matches
    torch's float32 GELU (about 1e-6 absolute).
    """
    x = check_float_input("x", x)
    xc = _as_compute(x)
    if xc.dtype == np.float32:
        if compiled.usable(xc):  # one compiled pass (attnkit.kernels.elementwise.gelu)
            out = np.array(xc, order="C", copy=True)
            compiled.gelu(out)
            return out.astype(x.dtype, copy=False)
        return _gelu_float32(xc).astype(x.dtype, copy=False)
    t = _erf_float64(xc * _INV_SQRT2)
    t += 1.0
    t *= xc
    t *= 0.5
    return t.astype(x.dtype, copy=False)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """Tanh-approximated GELU, torch's GELU(approximate="tanh"), GPT-2's "gelu_new":
    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))."""
    x = check_float_input("x", x)
    xc = _as_compute(x)
    t = xc * xc
    t *= 0.044715
    t += 1.0
    t *= xc
    t *= _SQRT_2_OVER_PI
    np.tanh(t, out=t)
    t += 1.0
    t *= xc
    t *= 0.5
    return t.astype(x.dtype, copy=False)


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
}


def get_activation(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """Look up an activation by name: "relu", "gelu" (exact) or "gelu_tanh"."""
    if name not in ACTIVATIONS:
        raise ValueError(f"expected activation to be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


# ----- dropout -------------------------------------------------------------------


def dropout(x: np.ndarray, p: float, rng: np.random.Generator) -> np.ndarray:
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p).

    Returns `x` itself when p == 0. Draws from `rng` only.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"expected dropout probability in [0, 1), got {p}")
    if p == 0.0:
        return x
    keep = rng.random(x.shape, dtype=np.float32 if x.dtype != np.float64 else np.float64) >= p
    out = x * keep
    out *= 1.0 / (1.0 - p)
    return out


# ----- LayerNorm -------------------------------------------------------------------


def layer_norm(x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, eps: float) -> np.ndarray:
    """torch.nn.functional.layer_norm over the last axis:
    (x - mean) / sqrt(var + eps) * weight + bias, var biased (divide by d).

    `x` must already be in the compute dtype; returns a new array of that dtype.
    float32 with float32 weight and bias runs one compiled pass per row when the
    kernels are on (`attnkit.kernels.elementwise.layer_norm`); these NumPy lines
    are its reference.
    """
    if weight is not None and bias is not None and x.ndim >= 1 and x.size:
        fits = np.shape(weight) == np.shape(bias) == (x.shape[-1],)
        if fits and compiled.usable(weight, bias) and x.dtype == np.float32:
            y = np.array(x, order="C", copy=True)
            compiled.layer_norm(y, weight, bias, eps)
            return y
    mean = x.mean(axis=-1, keepdims=True)  # (..., 1)
    y = x - mean  # (..., d)
    var = np.einsum("...i,...i->...", y, y)[..., None]  # (..., 1), sum of squares
    var *= 1.0 / x.shape[-1]
    var += eps
    np.sqrt(var, out=var)
    y /= var
    if weight is not None:
        y *= weight
    if bias is not None:
        y += bias
    return y


class LayerNorm(Module):
    """Layer normalization over the last axis, exactly torch.nn.LayerNorm:
    y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance
    and eps inside the square root. float16 input computes in float32.

    Parameters: ``weight`` (d,) ones, ``bias`` (d,) zeros (absent with bias=False).
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        if not isinstance(normalized_shape, (int, np.integer)) or isinstance(normalized_shape, bool) or normalized_shape < 1:
            raise ValueError(f"expected normalized_shape to be a positive int, got {normalized_shape!r}")
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"expected eps to be a finite float >= 0, got {eps!r}")
        self.normalized_shape = int(normalized_shape)
        self.eps = float(eps)
        self.register_parameter("weight", np.ones(self.normalized_shape))
        self.register_parameter("bias", np.zeros(self.normalized_shape) if bias else None)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x: (..., d) -> (..., d), in x's dtype."""
        x = check_float_input("x", x)
        if x.ndim < 1 or x.shape[-1] != self.normalized_shape:
            raise ValueError(f"expected x of shape (..., {self.normalized_shape}), got {x.shape}")
        dt = compute_dtype(x.dtype, self.weight.dtype)
        y = layer_norm(x.astype(dt, copy=False), self.weight, self.bias, self.eps)
        return y.astype(x.dtype, copy=False)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}"


# ----- FeedForward -------------------------------------------------------------------


class FeedForward(Module):
    """Position-wise feed-forward network: fc2(dropout(activation(fc1(x)))).

    Arguments:
        d_model: input and output size.
        d_ff: hidden size.
        activation: "relu", "gelu" (exact, erf) or "gelu_tanh".
        dropout: dropout after the activation, applied only in training mode.
        bias: biases on fc1 and fc2.
        seed: int, Generator or None; initializes fc1 then fc2, then drives dropout.

    Parameters: ``fc1.weight`` (d_ff, d_model), ``fc1.bias``, ``fc2.weight``
    (d_model, d_ff), ``fc2.bias``.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str = "relu",
        dropout: float = 0.0,
        bias: bool = True,
        *,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        super().__init__()
        self.activation = activation
        self._act = get_activation(activation)
        self.dropout = check_dropout(dropout)
        rng = make_rng(seed)
        self.fc1 = Linear(d_model, d_ff, bias, seed=rng)
        self.fc2 = Linear(d_ff, d_model, bias, seed=rng)
        self.rng = rng
        self.d_model = self.fc1.in_features
        self.d_ff = self.fc1.out_features

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x: (..., d_model) -> (..., d_model), in x's dtype."""
        x = check_float_input("x", x)
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"expected x of shape (..., {self.d_model}), got {x.shape}")
        dt = compute_dtype(x.dtype, self.fc1.weight.dtype)
        return self._forward(x.astype(dt, copy=False)).astype(x.dtype, copy=False)

    def _forward(self, x: np.ndarray) -> np.ndarray:
        # x is checked and in the compute dtype.
        h = linear(x, self.fc1.weight, self.fc1.bias)  # (..., d_ff)
        if self.activation == "relu":
            np.maximum(h, 0, out=h)
        else:
            h = self._act(h)
        if self.training and self.dropout > 0.0:
            h = dropout(h, self.dropout, self.rng)
        return linear(h, self.fc2.weight, self.fc2.bias)  # (..., d_model)

    def extra_repr(self) -> str:
        return feed_forward_extra_repr(self)
