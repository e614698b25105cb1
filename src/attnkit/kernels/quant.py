"""Deprecated location: the GGML block formats moved to `attnkit.quant` (one release).

The public names below are re-exported as they were (CHANGELOG.md lists them). Two differ
in kind, not in use: `QUANT_TYPES` maps each type's name to a `BlockType` whose `code` is
this module's old numbering (0..10, kept for code that stored it); `attnkit.quant.GGMLType`
numbers the types as ggml does. The private `_compiled()` still gives the decode step
(`attnkit.kernels.decode`, which numbers its matrices' types the old way) the loops it
calls, those taking a type code translating the old numbers through `_FROM_OLD_CODE`.
"""

from __future__ import annotations

from functools import lru_cache
from types import FunctionType
from typing import Any, NamedTuple

from attnkit.quant.ir import dot_instructions as _dot_instructions  # noqa: F401 - old private name
from attnkit.quant.products import (  # noqa: F401 - re-exported
    DECODE_ROWS,
    PARALLEL_MACS,
    activations,
    compiled_available,
    current_activations,
    dequantize_compiled,
    half_table as _half_table,
    matmul,
    matmul_stack,
)
from attnkit.quant.reference import (  # noqa: F401 - re-exported
    TILE_VALUES as _TILE_VALUES,
    dequantize,
    matmul_int8_reference,
    matmul_reference,
    quantize_activations,
)
from attnkit.quant.types import INT8_TYPES, GGMLType, row_bytes

__all__ = [
    "INT8_TYPES", "QUANT_TYPES", "BlockType", "activations", "compiled_available", "current_activations", "dequantize",
    "dequantize_compiled", "matmul", "matmul_int8_reference", "matmul_reference", "matmul_stack",
    "quantize_activations", "row_bytes",
]


class BlockType(NamedTuple):
    """A GGML block type: values per block, bytes per block, its old code here."""

    block_size: int
    type_size: int
    code: int


_OLD_ORDER = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
              GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
"""The types in this module's old numbering: old code = position."""
_FROM_OLD_CODE = tuple(int(kind) for kind in _OLD_ORDER)

QUANT_TYPES: dict[str, BlockType] = {kind.name: BlockType(kind.block_size, kind.type_size, code)
                                     for code, kind in enumerate(_OLD_ORDER)}


def _rows_old(raw, values, code, half, x, out, first, stop):  # pragma: no cover - compiled
    _matvec_rows(raw, values, _FROM_OLD_CODE[code], half, x, out, first, stop)  # noqa: F821 - bound when compiled


def _int8_old(raw, code, q, dx, xs, qsum, out, first, stop):  # pragma: no cover - compiled
    _matvec_int8(raw, _FROM_OLD_CODE[code], q, dx, xs, qsum, out, first, stop)  # noqa: F821


def _dequantize_row_old(raw, values, r, code, half, out):  # pragma: no cover - compiled
    _dequantize_row(raw, values, r, _FROM_OLD_CODE[code], half, out)  # noqa: F821


@lru_cache(maxsize=1)
def _legacy() -> dict[str, Any]:
    """The loops the decode step binds, by its names, those taking a type code on the old
    numbering."""
    from attnkit import kernels
    from attnkit.kernels import native
    from attnkit.quant.compiled import compiled

    nb = kernels.numba()
    loops = compiled().loops
    namespace = {"_FROM_OLD_CODE": _FROM_OLD_CODE, **loops}
    options = dict(cache=True, fastmath=native.FASTMATH, nogil=True)

    def jit(function):
        return nb.njit(**options)(FunctionType(function.__code__, namespace, function.__name__))

    return {
        "q4_1": loops["_matvec_q4_1"], "q4_0": loops["_matvec_q4_0"], "q8_0": loops["_matvec_q8_0"],
        "quantize_x": loops["_quantize_x"], "rows": jit(_rows_old), "int8": jit(_int8_old),
        "dequantize": loops["_dequantize_rows"], "_dequantize_row": jit(_dequantize_row_old),
        "_split_x": loops["_split_x"], "_part_rows": loops["_part_rows"],
    }


def _compiled() -> dict:
    """The loops by the decode step's names (deprecated: `attnkit.quant.compiled`)."""
    return _legacy()


def _entries():
    """The products' native entries (deprecated: `attnkit.quant.compiled.entries`)."""
    from attnkit.quant.compiled import entries

    return entries()


def _entry_sources() -> dict:
    from attnkit.quant.compiled import compiled

    return compiled().entries


def _rows4_intrinsic(kind, dot=None):
    """Deprecated: `attnkit.quant.ir.rows4_intrinsic` (takes a `GGMLType`)."""
    from attnkit.quant.ir import rows4_intrinsic

    return rows4_intrinsic(GGMLType[kind.upper()] if isinstance(kind, str) else kind, dot)


def __getattr__(name: str) -> Any:
    if name in ("_dequantize_row", "_split_x", "_part_rows"):  # bound into the decode step's globals
        return _legacy()[name]
    raise AttributeError(f"module 'attnkit.kernels.quant' has no attribute {name!r}")
