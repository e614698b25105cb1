"""The compiled loops, built into one explicit namespace.

numba compiles a function against its globals: the names it calls must be bound when it
compiles. The loops of `attnkit.quant.loops` call names that only exist once numba is
imported (the IR intrinsics of `attnkit.quant.ir`, numba's `carray`, the pointer helpers of
`attnkit.kernels.native`), so `compiled()` builds them a namespace of their own: a dict
with the loops' module constants, those helpers, and each loop compiled by numba under its
own name, every loop rebound to that dict (`_rebind`). No module's globals change; the
compiled loops are attributes of the `Compiled` it returns.
"""

from __future__ import annotations

from functools import lru_cache
from types import FunctionType
from typing import Any, Callable, NamedTuple

from attnkit import kernels
from attnkit.kernels import native
from attnkit.quant import ir, loops

__all__ = ["Compiled", "compiled", "entries"]


class Compiled(NamedTuple):
    """The loops compiled by numba, by name (`loops["_matvec_q4_1"]`, ...), and the native
    entries' Python functions bound to the same namespace (`entries["product"]`)."""

    loops: dict[str, Any]
    entries: dict[str, Callable]


def _rebind(function: FunctionType, namespace: dict) -> FunctionType:
    """`function` with `namespace` as its globals (its code, name and defaults kept, so
    numba's on-disk cache finds it by its file and name)."""
    bound = FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                         function.__closure__)
    bound.__qualname__, bound.__doc__ = function.__qualname__, function.__doc__
    return bound


@lru_cache(maxsize=1)
def compiled() -> Compiled:
    """The loops compiled by numba (cached on disk by numba), and the entries bound beside
    them. Only call when `attnkit.kernels.enabled()`."""
    nb = kernels.numba()
    namespace = {name: value for name, value in vars(loops).items() if not isinstance(value, FunctionType)}
    namespace.update(native.helpers())
    namespace["carray"] = nb.carray
    namespace["_product_frame"] = native.pointer(loops.PRODUCT_FRAME)
    namespace["_dequantize_frame"] = native.pointer(loops.DEQUANTIZE_FRAME)
    for kind in ir.FLOAT_TYPES:
        namespace[ir.loop_name("_rows4f", kind)] = ir.rows4f_intrinsic(kind)
    for kind in ir.MANY_TYPES:
        for many in (1, 2, ir.MANY_X_ROWS):
            namespace[ir.loop_name(f"_rows4f{many}", kind)] = ir.rows4f_many_intrinsic(kind, many)
    for kind in ir.INT8_LOOP_TYPES:
        namespace[ir.loop_name("_rows4", kind)] = ir.rows4_intrinsic(kind)
    serial = dict(cache=True, fastmath=native.FASTMATH, nogil=True)
    found = {}
    for function in loops.LOOPS:
        options = dict(cache=True) if function is loops._part_rows else serial
        found[function.__name__] = namespace[function.__name__] = nb.njit(**options)(_rebind(function, namespace))
    return Compiled(found, {name: _rebind(entry, namespace) for name, entry in loops.ENTRIES.items()})


def _entry_sources() -> dict:
    return compiled().entries


def entries() -> native.Entries:
    """The native entries ("product", "dequantize"; `attnkit.kernels.native`): the library
    built for this version and CPU, or numba's in-process callbacks."""
    return native.entries("quant", _entry_sources)
