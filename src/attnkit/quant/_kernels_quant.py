"""What the deprecated path `attnkit.kernels.quant` gives until 0.3.0 (the GGML block
formats moved to `attnkit.quant`; `attnkit/__init__.py` maps the old path here, and
importing it warns).

Its public names resolve, on first use, to `attnkit.quant`'s (CHANGELOG.md lists them).
One differs in kind, not in use: `QUANT_TYPES` maps each type's name to a `BlockType`
whose `code` is this module's old numbering (0..10, for code that stored it);
`attnkit.quant.GGMLType` numbers the types as ggml does. The private helpers this module
had (`_compiled`, `_entries`, ...) are gone: `attnkit.quant.compiled` holds the loops.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

__all__ = [
    "INT8_TYPES", "QUANT_TYPES", "BlockType", "activations", "compiled_available", "current_activations", "dequantize",
    "dequantize_compiled", "matmul", "matmul_int8_reference", "matmul_reference", "matmul_stack",
    "quantize_activations", "row_bytes",
]

_OLD_ORDER = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
"""The types in this module's old numbering: old code = position."""


class BlockType(NamedTuple):
    """A GGML block type: values per block, bytes per block, its old code here."""

    block_size: int
    type_size: int
    code: int


@functools.cache
def _quant_types() -> dict[str, BlockType]:
    from attnkit.quant import GGMLType

    return {kind: BlockType(GGMLType[kind].block_size, GGMLType[kind].type_size, code)
            for code, kind in enumerate(_OLD_ORDER)}


def __getattr__(name: str) -> Any:
    if name not in __all__ and name not in ("DECODE_ROWS", "PARALLEL_MACS"):
        raise AttributeError(f"module 'attnkit.kernels.quant' has no attribute {name!r}; see attnkit.quant")
    if name == "QUANT_TYPES":
        return _quant_types()
    if name == "BlockType":
        return BlockType
    from attnkit import quant

    return getattr(quant, name)
