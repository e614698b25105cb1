"""Intrinsics the entries use to reach their arrays and meet at barriers (numba typing and
LLVM IR): typed pointers from addresses (for `numba.carray`), atomics, a spin hint, and the
platform's yield."""

from __future__ import annotations

import ctypes
import platform
import sys
from functools import lru_cache

import numpy as np

__all__ = ["YIELD_SYMBOL", "helpers", "pointer"]

YIELD_SYMBOL = "attnkit_yield"
"""The barrier's yield as the compiled code names it: the library's C runtime defines it
(runtime.c: POSIX `sched_yield`, Win32 `SwitchToThread`); in-process, `_register_yield`
points LLVM's symbol table at the platform's own function."""


def _pointer_intrinsic(element):
    """`ptr(address)` -> a typed C pointer to `element`s at `address` (for `numba.carray`)."""
    from numba import types
    from numba.extending import intrinsic

    def typing(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(element)))

        return types.CPointer(element)(types.int64), codegen

    return intrinsic(typing)


@lru_cache(maxsize=None)
def pointer(dtype: np.dtype):
    """The intrinsic `ptr(address)` -> a C pointer to `dtype` (a NumPy dtype; a structured
    dtype gives records with named fields: `carray(ptr(address), (1,))[0].rows`)."""
    from numba import from_dtype

    return _pointer_intrinsic(from_dtype(np.dtype(dtype)))


def _atomic_intrinsics() -> dict:
    """`_atomic_add(address, value)` -> the int64 before (sequentially consistent),
    `_atomic_load(address)` -> the int64 there (acquire), `_pause()` (x86's spin hint)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    i64 = ir.IntType(64)

    def add_typing(typingctx, address, value):
        def codegen(context, builder, signature, args):
            pointer = builder.inttoptr(args[0], i64.as_pointer())
            return builder.atomic_rmw("add", pointer, args[1], "seq_cst")

        return types.int64(types.int64, types.int64), codegen

    def load_typing(typingctx, address):
        def codegen(context, builder, signature, args):
            pointer = builder.inttoptr(args[0], i64.as_pointer())
            return builder.load_atomic(pointer, "acquire", 8)

        return types.int64(types.int64), codegen

    def pause_typing(typingctx):
        def codegen(context, builder, signature, args):
            if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
                from numba.core import cgutils

                pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                       "llvm.x86.sse2.pause")
                builder.call(pause, [])
            return context.get_dummy_value()

        return types.none(), codegen

    return {"_atomic_add": intrinsic(add_typing), "_atomic_load": intrinsic(load_typing),
            "_pause": intrinsic(pause_typing)}


def _register_yield() -> None:
    """Give LLVM's in-process symbol table `YIELD_SYMBOL`: the address of the platform's
    yield (POSIX `sched_yield` from the C library, Win32 `SwitchToThread` from kernel32)."""
    import llvmlite.binding as ll

    if ll.address_of_symbol(YIELD_SYMBOL):
        return
    if sys.platform == "win32":
        function = ctypes.WinDLL("kernel32").SwitchToThread  # type: ignore[attr-defined]
    else:
        function = ctypes.CDLL(None).sched_yield
    ll.add_symbol(YIELD_SYMBOL, ctypes.cast(function, ctypes.c_void_p).value)


@lru_cache(maxsize=1)
def helpers() -> dict:
    """The intrinsics above by name (`_u8`, `_i8`, `_i32`, `_i64`, `_f32`, `_f64` pointers;
    atomics; `_sched_yield`, the platform's yield), for the namespaces kernels compile in."""
    found = {f"_{short}": pointer(np.dtype(name)) for short, name in
             (("u8", "uint8"), ("i8", "int8"), ("i32", "int32"), ("i64", "int64"), ("f32", "float32"),
              ("f64", "float64"))}
    found.update(_atomic_intrinsics())
    from numba import types
    from numba.core.types import ExternalFunction

    _register_yield()
    found["_sched_yield"] = ExternalFunction(YIELD_SYMBOL, types.int32())
    return found
