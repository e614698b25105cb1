"""What every public entry of the compiled kernels checks before compiled code touches
memory: numba's loops index without bounds checks, so a vector one element short reads
past its end, and a row longer than its vector writes past the end of the other.

- `array`: a NumPy array (TypeError otherwise) of the dtype the loop is compiled for
  (float32, or int64 for an index vector; TypeError: byte-swapped float32 is another
  dtype), of the shape expected (ValueError), C-contiguous and aligned (ValueError: a
  strided view is not silently copied, since the call writes in place), writable when
  the call writes it (ValueError).
- `converted`: a per-row vector that the entry documents as taken in any layout and real
  dtype, copied to contiguous float32 when it is not already, of the shape expected.
- `apart`: an array the call writes shares no memory with another argument (ValueError:
  the loop would read what it has just written).
- `real`, `integer`: the scalars.

Every message names the argument, what was expected and what arrived. The checks cost
about a microsecond a call (docs/kernels.md, "What the entries check"): the public entries
run them; the library's own hot loops, which make their arrays themselves, call the
unchecked loops behind them.
"""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np

FLOAT32 = np.dtype(np.float32)
INT64 = np.dtype(np.int64)


def _shape_text(shape: tuple) -> str:
    parts = ["n" if d is None else str(d) for d in shape]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def array(name: str, a, shape: tuple | None = None, *, ndim: int | None = None, min_ndim: int = 0,
          written: bool = False, dtype: np.dtype = FLOAT32) -> np.ndarray:
    """`a` as the plain ndarray a loop takes, or a TypeError/ValueError saying what is wrong.

    Arguments:
        name: the argument's name, for the message.
        a: what arrived.
        shape: the exact shape expected (None: any, within `ndim` / `min_ndim`).
        ndim, min_ndim: the number of axes expected, exactly or at least (with shape None).
        written: whether the call writes `a` (then it must be writable).
        dtype: the dtype the loop is compiled for.
    Returns:
        `a` itself (an ndarray subclass viewed as a plain ndarray: the same memory).
    """
    if type(a) is not np.ndarray:
        if not isinstance(a, np.ndarray):
            raise TypeError(f"expected {name} as a NumPy array of {dtype}, got {type(a).__name__}")
        a = a.view(np.ndarray)
    if a.dtype is not dtype and a.dtype != dtype:  # (the builtin dtypes are singletons: the first test settles it)
        raise TypeError(f"expected {name} of dtype {dtype}, got {a.dtype}")
    if shape is not None:
        if a.shape != shape:
            raise ValueError(f"expected {name} of shape {_shape_text(shape)}, got {a.shape}")
    elif ndim is not None:
        if a.ndim != ndim:
            raise ValueError(f"expected {name} with {ndim} axes {_shape_text((None,) * ndim)}, got shape {a.shape}")
    elif a.ndim < min_ndim:
        raise ValueError(f"expected {name} with at least {min_ndim} axes, got shape {a.shape}")
    flags = a.flags
    if not (flags.c_contiguous and flags.aligned):
        raise ValueError(f"expected {name} C-contiguous and aligned, got a view with strides {a.strides}")
    if written and not flags.writeable:
        raise ValueError(f"expected {name} writable (the call writes it), got a read-only array")
    return a


def converted(name: str, a, shape: tuple) -> np.ndarray:
    """A per-row vector `a` of exactly `shape`, in any layout and real dtype, as contiguous
    float32 (copied only when it is not already): the arguments documented as converted."""
    flags = a.flags if isinstance(a, np.ndarray) and (a.dtype is FLOAT32 or a.dtype == FLOAT32) else None
    if flags is not None and flags.c_contiguous and flags.aligned:
        out = a.view(np.ndarray) if type(a) is not np.ndarray else a
    else:
        try:
            values = np.asarray(a)
        except (TypeError, ValueError) as error:
            raise TypeError(f"expected {name} as an array of real numbers, got {type(a).__name__} ({error})") from None
        if values.dtype.kind not in "fiu":
            raise TypeError(f"expected {name} as an array of real numbers, got dtype {values.dtype}")
        out = np.ascontiguousarray(values, dtype=FLOAT32)
    if out.shape != shape:
        raise ValueError(f"expected {name} of shape {_shape_text(shape)}, got {out.shape}")
    return out


def apart(written: tuple, *others: tuple) -> None:
    """ValueError when the array the call writes shares memory with another argument.

    Arguments:
        written: (name, array) the call writes.
        others: (name, array) of every other argument (contiguous arrays: overlapping
            bounds are shared memory).
    """
    name, a = written
    for other, b in others:
        if (a is b) if (a.base is None and b.base is None) else np.may_share_memory(a, b):  # owners: only itself
            raise ValueError(f"expected {name} not to share memory with {other}, got overlapping arrays")


def real(name: str, value, *, positive: bool = False, infinite: bool = False) -> float:
    """A finite real number (a positive one with `positive`; +-inf allowed too with
    `infinite`, never NaN), as float."""
    if type(value) is float:
        if math.isfinite(value) and (value > 0 or not positive):
            return value
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"expected {name} as a real number, got {type(value).__name__}")
    value = float(value)
    if infinite and math.isinf(value) and (value > 0 or not positive):
        return value
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"expected {name} as a finite{' positive' if positive else ''} number, got {value}")
    return value


def integer(name: str, value) -> int:
    """An integer (Python's or NumPy's), as int."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"expected {name} as an integer, got {type(value).__name__}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"expected {name} as an integer, got {type(value).__name__}") from None
