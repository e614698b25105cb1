"""The compiled loops behind `attnkit.kernels.flash` and `attnkit.kernels.elementwise`
(importing this module imports numba; those modules import it on first use only).

The scalar functions the loops inline (exp32, ...) live here; numba's on-disk cache
checks only the source file of the function it compiled, so `attnkit.kernels` keys its
cache folder on a digest of all its files: a change here recompiles the loops of the
other files (`_flash_loops.py`, the decode step) too.

Plain loops over contiguous float32 rows; numba releases the GIL (nogil) so the
runtime's worker threads and the encoder's threads run them side by side. Loops that
take an exp may only contract multiply-adds (reassociation would undo the exp's
Cody-Waite steps); the reductions (row sums, LayerNorm's mean and variance) may
reassociate (vectorized), the larger ones accumulating in float64. NaN propagates:
no loop assumes finite inputs.

exp(x) for float32 (`exp32`), Cody-Waite reduction and Cephes' expf polynomial:

    n = round(x / ln 2),  r = x - n ln2_hi - n ln2_lo   (|r| <= ln 2 / 2; ln2_hi has
                                                          9 significant bits, so n ln2_hi is exact)
    exp(r) ~= 1 + r + r^2 P(r)                          (P of degree 5, relative error < 1 ulp)
    exp(x) = exp(r) * 2^(n - n//2) * 2^(n//2)           (two powers of two made from their bits:
                                                          each a normal float32, so results down
                                                          to the subnormals and up to inf come out
                                                          right, without a branch)

x is first clamped to [-104, 100] (exp(-104) rounds to 0 and exp(100) overflows to inf,
as they should, and n stays a small integer); NaN propagates. Measured against float64:
at most 0.7 ulp relative error on normal results (NumPy's float32 exp: 1.6 ulp).
"""

from __future__ import annotations

import numpy as np

from attnkit.kernels import numba as _numba

_nb = _numba()
_EXACT = dict(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")
_SUMS = dict(cache=True, nogil=True, fastmath={"contract", "reassoc", "nsz"}, error_model="numpy")

# ----------------------------------------------------------------------------- scalar functions

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_P = tuple(np.float32(c) for c in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
_P0, _P1, _P2, _P3, _P4, _P5 = _EXP_P
_LOW, _HIGH = np.float32(-104.0), np.float32(100.0)
_HALF, _ONE, _ZERO = np.float32(0.5), np.float32(1.0), np.float32(0.0)


@_nb.njit(inline="always")
def exp32(x):
    """exp of a float32 scalar (see the module docstring)."""
    x = min(max(x, _LOW), _HIGH)  # NaN stays NaN
    n = np.floor(x * _LOG2E + _HALF)
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _P0 * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * r * r + r + _ONE
    k = np.int32(n)
    half = k >> 1  # floor(n / 2)
    low = np.int32((half + 127) << 23).view(np.float32)  # 2^(n//2)
    high = np.int32((k - half + 127) << 23).view(np.float32)  # 2^(n - n//2)
    return p * high * low


# erfc(z) ~ t * exp(-z^2 - 1.26551223 + t * P(t)), t = 1 / (1 + z/2), z >= 0: relative
# error < 1.2e-7 everywhere (Numerical Recipes' Chebyshev fit), the NumPy encoder's own
# GELU (attnkit.models.bert.gelu_inplace), here in one pass.
_ERFC = tuple(np.float32(c) for c in (
    0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807,
    -0.18628806, 0.09678418, 0.37409196, 1.00002368))
_E0, _E1, _E2, _E3, _E4, _E5, _E6, _E7, _E8 = _ERFC
_ERFC_OFFSET = np.float32(1.26551223)
_INV_SQRT2 = np.float32(0.7071067811865476)


@_nb.njit(inline="always")
def gelu32(x):
    """Exact GELU of a float32 scalar: max(x, 0) - |x|/2 erfc(|x| / sqrt(2)), no
    cancellation for negative x."""
    a = abs(x)
    z = a * _INV_SQRT2
    t = _ONE / (_ONE + _HALF * z)
    p = _E0 * t + _E1
    p = p * t + _E2
    p = p * t + _E3
    p = p * t + _E4
    p = p * t + _E5
    p = p * t + _E6
    p = p * t + _E7
    p = p * t + _E8
    e = t * exp32(p * t - _ERFC_OFFSET - z * z)  # erfc(z)
    tail = a * e if e > _ZERO else _ZERO  # (x = inf: inf * 0 would be NaN; GELU(inf) = inf)
    return _HALF * ((x + a) - tail)


# ----------------------------------------------------------------------------- flash attention


@_nb.njit(**_EXACT)
def exp_rows(s):
    """s <- exp(s), s a flat float32 array (any tile, viewed flat)."""
    for i in range(s.shape[0]):
        s[i] = exp32(s[i])


@_nb.njit(**_EXACT)
def shifted_exp_rows(s, shift):
    """s[i, j] <- exp(s[i, j] - shift[i]), s (rows, cols) float32, shift (rows,)."""
    rows, cols = s.shape
    for i in range(rows):
        c = shift[i]
        for j in range(cols):
            s[i, j] = exp32(s[i, j] - c)


@_nb.njit(**_EXACT)
def weighted_grad_rows(ds, p, sums):
    """ds[i, j] <- ds[i, j] * p[i, j] (dS = P * (dP - D), with dP - D in ds) and
    sums[i] <- sum_j p[i, j] (the row's weight in this tile), ds and p (rows, cols) float32."""
    rows, cols = ds.shape
    for i in range(rows):
        for j in range(cols):
            ds[i, j] *= p[i, j]
        sums[i] = _row_sum32(p[i])


@_nb.njit(**_SUMS)
def _row_sum32(x):
    """sum of a float32 row, in any order (vectorized: 16 partial sums)."""
    total = x.dtype.type(0)
    for j in range(x.shape[0]):
        total += x[j]
    return total


# ----------------------------------------------------------------------------- the encoder


@_nb.njit(**_EXACT)
def gelu_rows(x):
    """x <- GELU(x), x a flat float32 array."""
    for i in range(x.shape[0]):
        x[i] = gelu32(x[i])


@_nb.njit(**_EXACT)
def gelu_bias_rows(x, bias):
    """x[i, j] <- GELU(x[i, j] + bias[j]), x (N, F) float32, bias (F,)."""
    rows, cols = x.shape
    for i in range(rows):
        for j in range(cols):
            x[i, j] = gelu32(x[i, j] + bias[j])


@_nb.njit(**_SUMS)
def _mean_and_inverse_std(row, eps):
    """(mean, 1 / sqrt(var + eps)) of a float32 row, summed in float64 (var biased)."""
    n = row.shape[0]
    total = 0.0
    for j in range(n):
        total += np.float64(row[j])
    mean = total / n
    squares = 0.0
    for j in range(n):
        d = np.float64(row[j]) - mean
        squares += d * d
    return mean, 1.0 / np.sqrt(squares / n + eps)


@_nb.njit(**_SUMS)
def layer_norm_rows(x, weight, bias, eps):
    """x[i] <- (x[i] - mean) / sqrt(var + eps) * weight + bias, x (N, D) float32."""
    for i in range(x.shape[0]):
        row = x[i]
        mean, inv = _mean_and_inverse_std(row, eps)
        for j in range(row.shape[0]):
            row[j] = np.float32((np.float64(row[j]) - mean) * inv) * weight[j] + bias[j]


@_nb.njit(**_SUMS)
def add_layer_norm_rows(y, add_bias, residual, weight, bias, eps):
    """y[i] <- LayerNorm((y[i] + add_bias) + residual[i]), y and residual (N, D) float32:
    a linear layer's bias, the residual and the norm in one visit of each row."""
    for i in range(y.shape[0]):
        row = y[i]
        res = residual[i]
        for j in range(row.shape[0]):
            row[j] = (row[j] + add_bias[j]) + res[j]
        mean, inv = _mean_and_inverse_std(row, eps)
        for j in range(row.shape[0]):
            row[j] = np.float32((np.float64(row[j]) - mean) * inv) * weight[j] + bias[j]


@_nb.njit(**_EXACT)
def softmax_rows(s, lse):
    """s[i] <- softmax(s[i]) and lse[i] <- logsumexp(s[i]), s (rows, cols) float32;
    a row of -inf gives weights 0 and lse -inf."""
    rows, cols = s.shape
    for i in range(rows):
        row = s[i]
        top = _row_max(row)
        shift = np.float32(0.0) if top == -np.inf else top  # a fully masked row: exps of -inf, all 0
        for j in range(cols):
            row[j] = exp32(row[j] - shift)
        total = _row_sum(row)  # >= 1 (the max's term is 1), 0 for a fully masked row, or NaN
        if total == 0:
            lse[i] = -np.inf
            for j in range(cols):
                row[j] = np.float32(0.0)
        else:  # (NaN propagates: torch's answer)
            lse[i] = np.float32(np.log(total) + shift)
            scale = np.float32(1.0 / total)
            for j in range(cols):
                row[j] *= scale


@_nb.njit(**_SUMS)
def _row_sum(row):
    """float64 sum of a float32 row (vectorized)."""
    total = 0.0
    for j in range(row.shape[0]):
        total += np.float64(row[j])
    return total


@_nb.njit(cache=True, nogil=True)
def _row_max(row):
    """max of a float32 row; NaN if any element is NaN."""
    top = np.float32(-np.inf)
    for j in range(row.shape[0]):
        v = row[j]
        if v > top or v != v:
            top = v
            if v != v:
                return v
    return top
