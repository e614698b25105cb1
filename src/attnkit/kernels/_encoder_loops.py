"""The compiled loops behind `attnkit.kernels.elementwise.attention_softmax` and
`add_bias_to_leading_columns` (importing this module imports numba; elementwise imports
it on first use only).

An encoder's packed sequences are short (MiniLM on sentences: 9 to 52 tokens), so its
attention's score rows are short too, and a loop over one short row vectorizes badly:
the compiler's vector loop handles 32 or 64 elements at a time and leaves a row of 24 to
its scalar remainder. Here the exp, the costly part, runs once over the whole block of
rows viewed flat (a long loop, fully vectorized); only the cheap steps (the row max and
shift, the row sum and scaling) go row by row:

    pass 1, per row:   m = max(s);  s <- (s - m) * scale     (m = 0 for a row of -inf)
    pass 2, flat:      s <- exp(s)                            (attnkit.kernels._loops.exp32)
    pass 3, per row:   s <- s / sum(s)                        (summed in float64; a row
                                                               summing to 0 stays 0)

Multiplying by `scale` after the shift is exact algebra for scale > 0
(max(scale * s) = scale * max(s)); in float32 it rounds once where the reference
(q * scale) k^T rounds the scaled query, within the budget of tests/kernels/test_elementwise_kernels.py.

exp32 is inlined from attnkit.kernels._loops (the compiled-code cache is keyed on a digest
of every file of `attnkit.kernels`, so a change there recompiles these loops).
"""

from __future__ import annotations

import numpy as np

from attnkit.kernels import numba as _numba
from attnkit.kernels._loops import exp32

_nb = _numba()
_EXACT = dict(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")
_SUMS = dict(cache=True, nogil=True, fastmath={"contract", "reassoc", "nsz"}, error_model="numpy")


@_nb.njit(**_SUMS)
def _row_top(row):
    """The largest of a float32 row's numbers (NaN is skipped, unless it comes first: the
    caller's later passes make a row holding NaN all NaN either way)."""
    top = row[0]
    for j in range(1, row.shape[0]):
        v = row[j]
        top = v if v > top else top  # no branch on NaN: the loop stays vectorized
    return top


@_nb.njit(**_EXACT)
def _shift_rows(s, scale):
    """s[i] <- (s[i] - max(s[i])) * scale for every row of s (rows, cols); a row of -inf
    is not shifted (its exps are 0). NaN in a row: the shifted row holds NaN, so its exps
    and their sum do, and `_normalize_rows` makes the whole row NaN."""
    rows, cols = s.shape
    for i in range(rows):
        row = s[i]
        top = _row_top(row)
        if top == -np.inf:
            top = np.float32(0.0)
        for j in range(cols):
            row[j] = (row[j] - top) * scale


@_nb.njit(**_EXACT)
def _exp_flat(x):
    """x <- exp(x), x a flat float32 array."""
    for k in range(x.shape[0]):
        x[k] = exp32(x[k])


@_nb.njit(**_SUMS)
def _normalize_rows(s):
    """s[i] <- s[i] / sum(s[i]), the sum in float64; a row summing to 0 stays 0, a row
    summing to NaN (it holds NaN) becomes all NaN."""
    rows, cols = s.shape
    for i in range(rows):
        row = s[i]
        total = 0.0
        for j in range(cols):
            total += np.float64(row[j])
        if total != 0.0:
            inverse = np.float32(1.0 / total)
            for j in range(cols):
                row[j] *= inverse


@_nb.njit(cache=True, nogil=True)
def softmax_short_rows(s, scale):
    """s[i] <- softmax(scale * s[i]) for s (rows, cols) C-contiguous float32, scale > 0."""
    _shift_rows(s, scale)
    _exp_flat(s.reshape(-1))
    _normalize_rows(s)


@_nb.njit(**_EXACT)
def add_to_leading_columns(x, bias):
    """x[i, :F] += bias for every row of x (N, C), bias (F,), F <= C."""
    width = bias.shape[0]
    for i in range(x.shape[0]):
        row = x[i]
        for j in range(width):
            row[j] += bias[j]
