"""Softmax, log-softmax and logsumexp that stay finite for any finite input.

The shift by the row maximum is what makes these stable: softmax is unchanged
when a constant is subtracted from every entry of a row, and after the shift
the largest exponent is exp(0) = 1, so nothing overflows. A row whose entries
are all -inf (every position masked) has no finite maximum; we shift it by 0
instead, which makes every exponential exactly 0, and define softmax of such a
row as all zeros rather than the 0/0 = NaN the textbook formula gives.
"""

from __future__ import annotations

import numpy as np

from attnkit.functional._checks import as_float_array, compute_dtype_of


def _finite_row_max(x: np.ndarray, axis, replace_posinf: bool = False) -> np.ndarray:
    """Row maximum with -inf (an all-masked row, or an empty one) replaced by 0,
    keepdims. With `replace_posinf`, +inf is replaced by 0 too (logsumexp of a
    row holding +inf is then +inf, as in torch, rather than inf - inf = NaN)."""
    row_max = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    bad = np.isinf(row_max) if replace_posinf else np.isneginf(row_max)
    return np.where(bad, row_max.dtype.type(0), row_max)


def softmax(x, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along `axis`.

    Arguments:
        x: array of real numbers, any shape; -inf entries mean "excluded".
        axis: the axis that sums to one.

    Returns:
        An array of x's shape and floating dtype. Each slice along `axis` sums
        to 1, except a slice that is entirely -inf, which comes out all zeros.
        float16 is computed in float32 and returned as float16.
    """
    x = as_float_array(x, "x")
    work = x.astype(compute_dtype_of(x.dtype), copy=True)
    work -= _finite_row_max(work, axis)
    np.exp(work, out=work)
    total = np.sum(work, axis=axis, keepdims=True)
    # An all -inf row has total 0; dividing by 1 there leaves its zeros as zeros.
    total = np.where(total == 0, total.dtype.type(1), total)
    work /= total
    return work.astype(x.dtype, copy=False)


def logsumexp(x, axis: int = -1, keepdims: bool = False) -> np.ndarray:
    """log(sum(exp(x))) along `axis`, without overflow.

    A slice that is entirely -inf, or empty, gives -inf (the log of an empty
    sum); one that holds +inf gives +inf, as torch.logsumexp does.
    """
    x = as_float_array(x, "x")
    work = x.astype(compute_dtype_of(x.dtype), copy=False)
    row_max = _finite_row_max(work, axis, replace_posinf=True)
    with np.errstate(divide="ignore"):  # log(0) = -inf is the intended answer
        out = np.log(np.sum(np.exp(work - row_max), axis=axis, keepdims=True)) + row_max
    if not keepdims:
        out = np.squeeze(out, axis=axis)
    return out.astype(x.dtype, copy=False)


def log_softmax(x, axis: int = -1) -> np.ndarray:
    """log(softmax(x)) along `axis`, computed as (x - max) - log(sum(exp(x - max)))
    so it never takes the log of an underflowed zero and keeps the precision of
    the shifted values. An all -inf slice gives all -inf."""
    x = as_float_array(x, "x")
    shifted = x.astype(compute_dtype_of(x.dtype), copy=True)
    shifted -= _finite_row_max(shifted, axis)
    with np.errstate(divide="ignore"):  # an all -inf row: log(0) = -inf, kept as -inf
        log_total = np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))
    log_total = np.where(np.isneginf(log_total), log_total.dtype.type(0), log_total)
    shifted -= log_total
    return shifted.astype(x.dtype, copy=False)
