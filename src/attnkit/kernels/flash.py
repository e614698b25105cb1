"""Flash attention's per-tile element-wise work, compiled: the shifted exp of a
score tile and dS = P * (dP - D) with the tile's row sums, each beside the NumPy
lines of `attnkit.functional.flash` it replaces (those stay the reference, and
run when `usable` says no).

The fused tiles (`band_exp_tile`, `grad_scores_tile`) do all of a tile's element-wise
work in one visit of its rows: the shift, the exp, a band's mask and the row sums in
the forward; the weights, dS, the dominant key and dS's row sums in the backward. A
plan takes them for a whole call (`wants`), so that its forward and its backward
cut and shift the same tiles the same way; their products then run at the head's
own width, without the ones columns that carry the shift and the sums through BLAS
on the reference path.

Every function works in place on C-contiguous float32 arrays and returns None.
Error budget (docs/kernels.md): the exp is within 1 ulp of the float64 exp (NumPy's
float32 exp: within 2), so a tile's weights, their sums and the outputs built from
them are within the NumPy path's float32 error.
"""

from __future__ import annotations

import math

import numpy as np

from attnkit.kernels import loadable
from attnkit.kernels._checks import INT64, apart, array, converted, integer, real
from attnkit.kernels._start import load, started, worth_it

__all__ = ["NO_BAND", "SAVED_NS", "SMALL_TILE", "band_exp_tile", "exp_tile", "grad_scores_tile",
           "load", "shifted_exp_tile", "started", "usable", "wants", "weighted_grad_tile"]

NO_BAND = 1 << 62
"""A band side that excludes nothing (`band_exp_tile`'s lo = -NO_BAND, hi = NO_BAND)."""


SMALL_TILE = 1024
"""Tiles with fewer elements stay on NumPy: below about this size a compiled call's
dispatch costs more than NumPy's exp (decode steps, thin band pieces; docs/benchmarks.md)."""


SAVED_NS = 1.0
"""What the compiled exp saves over NumPy's per element, in nanoseconds: a round figure
between CPUs where NumPy's float32 exp is vectorized (AVX-512) and where it is scalar
(docs/benchmarks.md); counts towards starting them."""


def usable(*arrays: np.ndarray) -> bool:
    """Whether the compiled loops take these arrays: the kernels are on, each is float32
    and C-contiguous, the first holds at least SMALL_TILE elements, and the loops have
    started or this process's work has earned their start (`attnkit.kernels._start`;
    `load()` starts them at once). Anything else runs the NumPy reference."""
    if not all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays):
        return False  # (anything else, nothing at all included, runs the NumPy reference)
    if not arrays or arrays[0].size < SMALL_TILE:
        return False
    return worth_it(arrays[0].size, SAVED_NS) and loadable()  # (imports numba: asked last)


def wants(elements: int) -> bool:
    """Whether a whole flash call over `elements` score elements takes the fused tiles:
    the kernels are on and this process's work has earned their start (`usable`'s rule,
    asked once for the call instead of once per tile)."""
    return worth_it(elements, SAVED_NS) and loadable()


def _loops():
    from attnkit.kernels import _loops  # numba loads here, on first use

    return _loops


def exp_tile(s: np.ndarray) -> None:
    """s <- exp(s) in place: NumPy's `np.exp(s, out=s)`.

    Arguments:
        s: a C-contiguous float32 array of any shape (a tile of scores less their shift).
    """
    s = array("s", s, written=True)
    _exp_tile(s)


def _exp_tile(s: np.ndarray) -> None:
    """`exp_tile` unchecked (the library's tiles, C-contiguous float32 by construction)."""
    _loops().exp_rows(s.reshape(-1))


def shifted_exp_tile(s: np.ndarray, shift: np.ndarray) -> None:
    """s <- exp(s - shift[..., None]) in place: NumPy's `s -= shift[..., None];
    np.exp(s, out=s)` in one pass.

    Arguments:
        s: (..., rows, cols) C-contiguous float32 scores.
        shift: (..., rows), s's shape less its last axis: per-row shifts in any layout and
            real dtype (converted to float32), not sharing s's memory.
    """
    s = array("s", s, min_ndim=1, written=True)
    shift = converted("shift", shift, s.shape[:-1])
    apart(("s", s), ("shift", shift))
    _shifted_exp_tile(s, shift)


def _shifted_exp_tile(s: np.ndarray, shift: np.ndarray) -> None:
    """`shifted_exp_tile` unchecked (the library's tiles: s C-contiguous float32, shift
    s.shape[:-1] in any layout)."""
    cols = s.shape[-1]
    rows = s.size // cols if cols else math.prod(s.shape[:-1])
    if shift.dtype != np.float32 or not shift.flags.c_contiguous:
        shift = np.ascontiguousarray(shift, dtype=np.float32)
    _loops().shifted_exp_rows(s.reshape(rows, cols), shift.reshape(rows))


def weighted_grad_tile(ds: np.ndarray, p: np.ndarray, sums: np.ndarray) -> None:
    """ds <- ds * p and sums <- p's row sums, in one pass: NumPy's `np.multiply(ds,
    p, out=ds)` and `p @ ones`.

    Arguments:
        ds: (rows, cols) C-contiguous float32, dP - D on entry, dS on return.
        p: (rows, cols) C-contiguous float32 weights.
        sums: (rows,) C-contiguous float32, written.
        (ds and sums share no memory with each other or with p.)
    """
    ds = array("ds", ds, ndim=2, written=True)
    p = array("p", p, ds.shape)
    sums = array("sums", sums, ds.shape[:1], written=True)
    apart(("ds", ds), ("p", p), ("sums", sums))
    apart(("sums", sums), ("p", p))
    _weighted_grad_tile(ds, p, sums)


def _weighted_grad_tile(ds: np.ndarray, p: np.ndarray, sums: np.ndarray) -> None:
    """`weighted_grad_tile` unchecked (the library's tiles and scratch rows)."""
    _loops().weighted_grad_rows(ds, p, sums)


_FUSED = []  # the loops' module, once imported (a tile's call skips the import statement)


def _fused():
    if not _FUSED:
        from attnkit.kernels import _flash_loops  # numba loads here, on first use

        _FUSED.append(_flash_loops)
    return _FUSED[0]


def _rows(x: np.ndarray, n: int) -> np.ndarray:
    """x as n contiguous float32 values (a per-row vector of a tile; copied only when a
    strided view or another dtype)."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    return x.reshape(n)


def band_exp_tile(s: np.ndarray, shift: np.ndarray, extra: np.ndarray, scale: np.ndarray, sums: np.ndarray,
                  lo: int, hi: int) -> None:
    """s <- exp((s - shift[..., None]) - extra[..., None]) * scale[..., None] where the
    band allows a pair, 0 where it does not, and sums <- the rows' sums of s, in one
    visit of each row: the NumPy reference's bias add, `s -= shift[..., None]`,
    `np.exp(s, out=s)`, the rows' factor and `s @ 1`.

    Arguments:
        s: (..., rows, cols) C-contiguous float32 scores (heads side by side).
        shift, extra, scale: (..., rows), s's shape less its last axis: per-row values in
            any layout and real dtype (converted to float32). (s - shift) - extra is
            formed in that order: the forward passes extra = 0 and scale = 1, the
            backward extra = lse - shift and its factor f, on the same s - shift.
        sums: (..., rows) C-contiguous float32, written.
        lo, hi: integers, the band on the tile's own positions: pair (i, j) is allowed
            when lo <= j - i <= hi (-NO_BAND, NO_BAND: no band).
        (s and sums share no memory with each other or with the per-row values.)
    """
    s = array("s", s, min_ndim=2, written=True)
    rows = s.shape[:-1]
    shift, extra, scale = converted("shift", shift, rows), converted("extra", extra, rows), converted("scale", scale, rows)
    sums = array("sums", sums, rows, written=True)
    lo, hi = integer("lo", lo), integer("hi", hi)
    apart(("s", s), ("shift", shift), ("extra", extra), ("scale", scale), ("sums", sums))
    apart(("sums", sums), ("shift", shift), ("extra", extra), ("scale", scale))
    _band_exp_tile(s, shift, extra, scale, sums, lo, hi)


def _band_exp_tile(s: np.ndarray, shift: np.ndarray, extra: np.ndarray, scale: np.ndarray, sums: np.ndarray,
                   lo: int, hi: int) -> None:
    """`band_exp_tile` unchecked (the library's tiles: s and sums C-contiguous float32, the
    per-row values s.shape[:-1] in any layout)."""
    rows, cols = s.shape[-2], s.shape[-1]
    n = s.size // cols if cols else math.prod(s.shape[:-1])
    _fused().band_exp_rows(s.reshape(n, cols), _rows(shift, n), _rows(extra, n), _rows(scale, n), sums.reshape(n),
                           max(rows, 1), int(max(lo, -NO_BAND)), int(min(hi, NO_BAND)))


def _band_exp_loop():
    """The compiled loop behind `band_exp_tile`, unchecked, for the flash forward's many
    small pieces, which hold their arguments in the loop's layout already
    (`band_exp_tile`'s checks and conversions cost about as much as the dispatch):
    `loop(s, shift, extra, scale, sums, period, lo, hi)` with s (n, cols) and the
    per-row vectors (n,) C-contiguous float32, `period` the rows of one head (>= 1) and
    lo, hi within +-NO_BAND, as `band_exp_tile` passes them. Memory is only safe with
    exactly those."""
    return _fused().band_exp_rows


def band_exp_loop():
    """Deprecated: the raw loop it returned took any arguments unchecked. Returns a
    callable with the loop's arguments, `(s, shift, extra, scale, sums, period, lo, hi)`,
    that checks them (s (n, cols) and the per-row vectors (n,) C-contiguous float32, sums
    written, period >= 1); `band_exp_tile` is the entry to use."""
    import warnings

    warnings.warn("attnkit.kernels.flash.band_exp_loop() is deprecated (its loop took arguments unchecked); "
                  "use band_exp_tile", DeprecationWarning, stacklevel=2)
    return _checked_band_exp_loop


def _checked_band_exp_loop(s, shift, extra, scale, sums, period, lo, hi) -> None:
    s = array("s", s, ndim=2, written=True)
    n = s.shape[0]
    shift, extra, scale = array("shift", shift, (n,)), array("extra", extra, (n,)), array("scale", scale, (n,))
    sums = array("sums", sums, (n,), written=True)
    period, lo, hi = integer("period", period), integer("lo", lo), integer("hi", hi)
    if period < 1:
        raise ValueError(f"expected period >= 1, got {period}")
    apart(("s", s), ("shift", shift), ("extra", extra), ("scale", scale), ("sums", sums))
    apart(("sums", sums), ("shift", shift), ("extra", extra), ("scale", scale))
    _fused().band_exp_rows(s, shift, extra, scale, sums, period, max(lo, -NO_BAND), min(hi, NO_BAND))


def grad_scores_tile(ds: np.ndarray, p: np.ndarray, d: np.ndarray, weight: np.ndarray, peak: float,
                     top: np.ndarray, ds_sums: np.ndarray) -> int:
    """ds <- p * (ds - d[:, None]) (dS = P (dP - D), dP in ds on entry); a row whose
    weights sum above `peak` (weight) and whose largest weight is above it too gets
    that key's dS set to 0 and its column in top (else -1; the first largest, as
    NumPy's argmax); ds_sums <- the rows' sums of dS after that. One visit of each
    row: the reference's `[dO, -D] . [V, 1]` column, `ds *= p`, the dominant key's
    search and `dS @ 1`.

    Arguments:
        ds, p: (rows, cols) C-contiguous float32.
        d, weight: (rows,) real numbers in any layout (converted to float32): D and the
            rows' weight sums.
        peak: a number, not NaN (inf: no row has a dominant key).
        top: (rows,) C-contiguous int64, written. ds_sums: (rows,) C-contiguous float32, written.
        (ds, top and ds_sums share no memory with each other or with the other arguments.)

    Returns:
        How many rows have a dominant key (top >= 0); none when cols = 0.
    """
    ds = array("ds", ds, ndim=2, written=True)
    rows = ds.shape[:1]
    p = array("p", p, ds.shape)
    d, weight = converted("d", d, rows), converted("weight", weight, rows)
    peak = real("peak", peak, infinite=True)
    top = array("top", top, rows, written=True, dtype=INT64)
    ds_sums = array("ds_sums", ds_sums, rows, written=True)
    apart(("ds", ds), ("p", p), ("d", d), ("weight", weight), ("top", top), ("ds_sums", ds_sums))
    apart(("top", top), ("p", p), ("d", d), ("weight", weight), ("ds_sums", ds_sums))
    apart(("ds_sums", ds_sums), ("p", p), ("d", d), ("weight", weight))
    if ds.shape[1] == 0:  # (the loop reads a row's first weight)
        top[...], ds_sums[...] = -1, 0
        return 0
    return _grad_scores_tile(ds, p, d, weight, peak, top, ds_sums)


def _grad_scores_tile(ds: np.ndarray, p: np.ndarray, d: np.ndarray, weight: np.ndarray, peak: float,
                      top: np.ndarray, ds_sums: np.ndarray) -> int:
    """`grad_scores_tile` unchecked (the library's tiles, at least one column)."""
    rows = ds.shape[0]
    return _fused().grad_scores_rows(ds, p, _rows(d, rows), _rows(weight, rows), np.float32(peak), top, ds_sums)
