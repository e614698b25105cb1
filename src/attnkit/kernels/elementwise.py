"""The encoder's element-wise work, compiled: exact (erf) GELU with its linear layer's
bias, LayerNorm with the residual and bias adds before it, a row softmax, and the
scaled softmax of a packed encoder's short attention rows (with the query bias add
before it), each beside the NumPy lines it replaces (`attnkit.models.bert.gelu_inplace`
and `_layer_norm_inplace`, `attnkit.nn.layers.gelu` and `layer_norm`, the softmax of
`attnkit.functional.attention`, which `attnkit.functional.varlen_attention` runs for
the packed encoder), which stay the reference and run when `usable` says no.

Every function works in place on C-contiguous float32 arrays and returns None.
Error budget (docs/kernels.md): GELU uses the NumPy encoder's own erfc fit (relative
error < 1.2e-7) with an exp within 1 ulp, so it stays within 2x the NumPy path's error;
LayerNorm and softmax sum in float64, so their error is the final roundings only;
`attention_softmax` takes the same exp and float64 row sums (its scale multiplies the
shifted scores: one more float32 rounding); `add_bias_to_leading_columns` is one float32
addition per element, NumPy's bits.
"""

from __future__ import annotations

import math

import numpy as np

from attnkit.kernels import loadable
from attnkit.kernels._checks import apart, array, real
from attnkit.kernels._start import load, started, worth_it

__all__ = ["SAVED_NS", "add_bias_to_leading_columns", "add_layer_norm", "attention_softmax", "gelu", "gelu_bias",
           "layer_norm", "load", "softmax", "started", "usable"]


SAVED_NS = 4.0
"""What the compiled loops save over NumPy's passes per element, in nanoseconds: a round
figure between GELU's saving and LayerNorm's (docs/benchmarks.md); counts towards starting them."""


def usable(*arrays: np.ndarray) -> bool:
    """Whether the compiled loops take these arrays: the kernels are on, each is float32
    and C-contiguous, and the loops have started or this process's work has earned
    their start (`attnkit.kernels._start`; `load()` starts them at once). Anything else
    runs the NumPy reference."""
    if not arrays or not all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous
                             for a in arrays):
        return False
    return worth_it(arrays[0].size, SAVED_NS) and loadable()  # (imports numba: asked last)


def _loops():
    from attnkit.kernels import _loops  # numba loads here, on first use

    return _loops


def gelu(x: np.ndarray) -> None:
    """x <- GELU(x) = x Phi(x) (exact, erf form) in place, x any C-contiguous float32 array."""
    x = array("x", x, written=True)
    _loops().gelu_rows(x.reshape(-1))


def gelu_bias(x: np.ndarray, bias: np.ndarray) -> None:
    """x <- GELU(x + bias) in place, in one pass.

    Arguments:
        x: (N, F) C-contiguous float32 (a linear layer's products).
        bias: (F,) C-contiguous float32, the layer's bias.
    """
    x = array("x", x, ndim=2, written=True)
    bias = array("bias", bias, (x.shape[1],))
    apart(("x", x), ("bias", bias))
    _loops().gelu_bias_rows(x, bias)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> None:
    """x <- (x - mean) / sqrt(var + eps) * weight + bias over the last axis, in place
    (torch's LayerNorm: biased variance, eps inside the root).

    Arguments:
        x: (..., D) C-contiguous float32.
        weight, bias: (D,) C-contiguous float32.
        eps: a finite number added to the variance.
    """
    x = array("x", x, min_ndim=1, written=True)
    D = x.shape[-1]
    weight, bias = array("weight", weight, (D,)), array("bias", bias, (D,))
    eps = real("eps", eps)
    apart(("x", x), ("weight", weight), ("bias", bias))
    _loops().layer_norm_rows(x.reshape(_rows(x), D), weight, bias, eps)


def add_layer_norm(y: np.ndarray, add_bias: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                   bias: np.ndarray, eps: float) -> None:
    """y <- LayerNorm((y + add_bias) + residual) in place, one visit of each row: a
    post-LN block's `y += linear.bias; y += x; norm(y)`.

    Arguments:
        y: (N, D) C-contiguous float32, a linear layer's products.
        add_bias: (D,) C-contiguous float32, that layer's bias.
        residual: (N, D) C-contiguous float32, the block's input (not sharing y's memory).
        weight, bias, eps: the LayerNorm's ((D,) C-contiguous float32; a finite number).
    """
    y = array("y", y, ndim=2, written=True)
    N, D = y.shape
    add_bias, residual = array("add_bias", add_bias, (D,)), array("residual", residual, (N, D))
    weight, bias = array("weight", weight, (D,)), array("bias", bias, (D,))
    eps = real("eps", eps)
    apart(("y", y), ("add_bias", add_bias), ("residual", residual), ("weight", weight), ("bias", bias))
    _loops().add_layer_norm_rows(y, add_bias, residual, weight, bias, eps)


def softmax(scores: np.ndarray, lse: np.ndarray) -> None:
    """scores <- softmax(scores) over the last axis in place, and lse <- each row's
    logsumexp. A row of -inf (nothing allowed) gives weights 0 and lse -inf, and so
    does a row of no scores (S = 0); NaN propagates.

    Arguments:
        scores: (..., S) C-contiguous float32.
        lse: (...) C-contiguous float32, written (not sharing scores' memory).
    """
    scores = array("scores", scores, min_ndim=1, written=True)
    lse = array("lse", lse, scores.shape[:-1], written=True)
    apart(("scores", scores), ("lse", lse))
    _softmax(scores, lse)


def _softmax(scores: np.ndarray, lse: np.ndarray) -> None:
    """`softmax` unchecked, for the library's attention, which makes both arrays itself
    (C-contiguous float32, lse of scores.shape[:-1], apart)."""
    _loops().softmax_rows(scores.reshape(lse.size, scores.shape[-1]), lse.reshape(-1))


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _rows(x: np.ndarray) -> int:
    """The rows of x (..., D) viewed as (rows, D), also when D = 0."""
    return math.prod(x.shape[:-1])


def _encoder_loops():
    from attnkit.kernels import _encoder_loops  # numba loads here, on first use

    return _encoder_loops


def attention_softmax(scores: np.ndarray, scale: float) -> None:
    """scores <- softmax(scale * scores) over the last axis, in place: the attention
    weights of unmasked score rows, fast for short rows (an encoder's sentences; the exp
    runs over all rows at once, see attnkit.kernels._encoder_loops). A row of -inf gives
    weights 0; NaN in a row makes the row NaN.

    Arguments:
        scores: (..., S) C-contiguous float32, q k^T before scaling.
        scale: > 0 and within float32's range, the attention's scale (1 / sqrt(E) by default).
    """
    scores = array("scores", scores, min_ndim=1, written=True)
    scale = real("scale", scale, positive=True)
    if not scale <= _FLOAT32_MAX:  # (the loop multiplies in float32)
        raise ValueError(f"expected scale within float32's range, got {scale}")
    if scores.size:  # (the loop reads each row's first score)
        _attention_softmax(scores, scale)


def _attention_softmax(scores: np.ndarray, scale: float) -> None:
    """`attention_softmax` unchecked, for the packed encoder's score blocks (C-contiguous
    float32 products it made, at least one score; scale > 0)."""
    _encoder_loops().softmax_short_rows(scores.reshape(-1, scores.shape[-1]), np.float32(scale))


def add_bias_to_leading_columns(x: np.ndarray, bias: np.ndarray) -> None:
    """x[:, :F] += bias in place: NumPy's `x[:, :F] += bias`, which runs row by row over a
    strided view (the query columns of fused q/k/v products).

    Arguments:
        x: (N, C) C-contiguous float32.
        bias: (F,) C-contiguous float32, F <= C, not sharing x's memory.
    """
    x = array("x", x, ndim=2, written=True)
    bias = array("bias", bias, ndim=1)
    if bias.shape[0] > x.shape[1]:
        raise ValueError(f"expected bias of at most x's {x.shape[1]} columns, got {bias.shape[0]}")
    apart(("x", x), ("bias", bias))
    _encoder_loops().add_to_leading_columns(x, bias)
