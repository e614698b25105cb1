"""Flash attention's per-tile element-wise work, compiled: the shifted exp of a
score tile and dS = P * (dP - D) with the tile's row sums, each beside the NumPy
lines of `attnkit.functional.flash` it replaces (those stay the reference, and
run when `usable` says no).

Every function works in place on C-contiguous float32 arrays and returns None.
Error budget (docs/kernels.md): the exp is within 1 ulp of the float64 exp (NumPy's
float32 exp: within 2), so a tile's weights, their sums and the outputs built from
them are within the NumPy path's float32 error.
"""

from __future__ import annotations

import numpy as np

from attnkit.kernels import enabled
from attnkit.kernels._start import load, started, worth_it

__all__ = ["SAVED_NS", "SMALL_TILE", "exp_tile", "load", "shifted_exp_tile", "started", "usable", "weighted_grad_tile"]


SMALL_TILE = 1024
"""Tiles with fewer elements stay on NumPy: below about this size a compiled call's
dispatch (~0.8 µs) costs more than NumPy's exp (decode steps, thin band pieces)."""


SAVED_NS = 1.0
"""What the compiled exp saves over NumPy's per element, about (0.2 ns with NumPy's
AVX-512 exp, 5 ns where NumPy's float32 exp is scalar): counts towards starting them."""


def usable(*arrays: np.ndarray) -> bool:
    """Whether the compiled loops take these arrays: the kernels are on, each is float32
    and C-contiguous, the first holds at least SMALL_TILE elements, and the loops have
    started or this process's work has earned their start (`attnkit.kernels._start`;
    `load()` starts them at once). Anything else runs the NumPy reference."""
    if arrays[0].size < SMALL_TILE or not all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays):
        return False
    return worth_it(arrays[0].size, SAVED_NS) and enabled()  # (enabled() imports numba: asked last)


def _loops():
    from attnkit.kernels import _loops  # numba loads here, on first use

    return _loops


def exp_tile(s: np.ndarray) -> None:
    """s <- exp(s) in place: NumPy's `np.exp(s, out=s)`.

    Arguments:
        s: a C-contiguous float32 array of any shape (a tile of scores less their shift).
    """
    _loops().exp_rows(s.reshape(-1))


def shifted_exp_tile(s: np.ndarray, shift: np.ndarray) -> None:
    """s <- exp(s - shift[..., None]) in place: NumPy's `s -= shift[..., None];
    np.exp(s, out=s)` in one pass.

    Arguments:
        s: (..., rows, cols) C-contiguous float32 scores.
        shift: (..., rows) per-row shifts (any layout; converted to float32).
    """
    rows = s.shape[-1]
    flat = s.reshape(-1, rows)
    c = np.ascontiguousarray(shift, dtype=np.float32).reshape(-1)
    assert c.shape[0] == flat.shape[0], (s.shape, np.shape(shift))
    _loops().shifted_exp_rows(flat, c)


def weighted_grad_tile(ds: np.ndarray, p: np.ndarray, sums: np.ndarray) -> None:
    """ds <- ds * p and sums <- p's row sums, in one pass: NumPy's `np.multiply(ds,
    p, out=ds)` and `p @ ones`.

    Arguments:
        ds: (rows, cols) C-contiguous float32, dP - D on entry, dS on return.
        p: (rows, cols) C-contiguous float32 weights.
        sums: (rows,) float32, written.
    """
    _loops().weighted_grad_rows(ds, p, sums)
