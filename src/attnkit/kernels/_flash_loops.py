"""The fused tile loops behind `attnkit.kernels.flash` (importing this module imports
numba; `attnkit.kernels.flash` imports it on first use only).

Each loop does in one visit of a tile's rows what the NumPy reference does in several
passes, so that a tile of flash attention costs its BLAS products, and beside them one
pass over the scores in the forward and two in the backward:

- `band_exp_rows`: p = exp((s - shift) - extra) * scale per row, 0 outside a band (the
  causal diagonal, a window's edges: no separate -inf bias pass), and each row's sum of
  p. The forward calls it with extra = 0 and scale = 1 (x - 0 and x * 1 are x,
  bitwise), the backward with extra = lse - shift and its per-row factor f: both form
  the same s - shift, so the backward rebuilds exactly the weights whose sums the
  forward saved. (Its loops over a row's three spans each run from 0: a loop over
  range(j0, j1) did not vectorize, numba's index could be negative, and ran many times
  slower: docs/benchmarks.md.)
- `grad_scores_rows`: dS = P (dP - D) per row, a dominant key's dS left out (a weight
  above `peak`, recorded in `top`), and the row's sum of the dS kept.

The exp is `attnkit.kernels._loops.exp32`, inlined (within 1 ulp of float64's exp). The
loops that take an exp only contract multiply-adds; the row sums run in their own loop
over the row, still in L1, in any order (vectorized). NaN propagates.

Kept beside `_loops.py` rather than in it so that each file stays one subject (the
compiled-code cache is keyed on a digest of every file of `attnkit.kernels`, so a change
to `exp32` recompiles these loops too).
"""

from __future__ import annotations

import numpy as np

from attnkit.kernels import numba as _numba
from attnkit.kernels._loops import _row_sum32, exp32

_nb = _numba()
_EXACT = dict(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")

@_nb.njit(**_EXACT)
def band_exp_rows(s, shift, extra, scale, sums, period, lo, hi):
    """s[i, j] <- exp((s[i, j] - shift[i]) - extra[i]) * scale[i] where lo <= j - i % period
    <= hi, else 0; sums[i] <- sum_j s[i, j]. s (rows, cols) float32 (heads' rows stacked,
    `period` rows a head), shift, extra, scale and sums (rows,) float32."""
    rows, cols = s.shape
    for i in range(rows):
        local = i % period
        j0 = min(max(local + lo, 0), cols)
        j1 = min(max(local + hi + 1, j0), cols)
        c = shift[i]
        d = extra[i]
        f = scale[i]
        row = s[i]
        before, inside, after = row[:j0], row[j0:j1], row[j1:]  # (loops from 0 vectorize: no negative index)
        for j in range(before.shape[0]):
            before[j] = np.float32(0.0)
        for j in range(inside.shape[0]):
            inside[j] = exp32((inside[j] - c) - d) * f
        for j in range(after.shape[0]):
            after[j] = np.float32(0.0)
        sums[i] = _row_sum32(inside)


@_nb.njit(**_EXACT)
def grad_scores_rows(ds, p, d, weight, peak, top, ds_sums):
    """ds[i, j] <- p[i, j] * (ds[i, j] - d[i]) (dS = P (dP - D), dP in ds on entry);
    then a row whose weights sum (`weight[i]`) above `peak` has its largest weight's
    key (NumPy's argmax: the first) checked: if that weight is above `peak` too, its
    dS is set to 0 and its column goes to top[i] (else top[i] = -1); ds_sums[i] <- the
    row's sum of dS after that. ds, p (rows, cols) float32; d, weight, ds_sums (rows,)
    float32; top (rows,) int64. Returns how many rows have a dominant key."""
    rows, cols = ds.shape
    found = 0
    for i in range(rows):
        row, w = ds[i], p[i]
        di = d[i]
        for j in range(cols):
            row[j] = w[j] * (row[j] - di)
        top[i] = -1
        if weight[i] > peak:
            best, at = w[0], 0
            for j in range(1, cols):
                if w[j] > best:
                    best, at = w[j], j
            if best > peak:
                row[at] = np.float32(0.0)
                top[i] = at
                found += 1
        ds_sums[i] = _row_sum32(row)
    return found
