"""The GGML tensor types the products run on: one table, keyed by ggml's own numbers.

`GGMLType` is an `IntEnum` whose values are ggml's (`ggml_type` in ggml.h, and
`gguf.GGMLQuantizationType` in the gguf package: the tests hold the two equal), so a type
read from a GGUF file's tensor table is a `GGMLType` as it stands. Each member carries its
traits, as ggml's `type_traits[]` does: how many values a block holds and how many bytes
it takes. Every loop asks this table (`GGMLType.Q4_1.type_size`); no type is spelled as a
number anywhere else.

The blocks (ggml-common.h; d, m, dmin are float16, little-endian):

| type | values | bytes | layout |
|---|---|---|---|
| F32 / F16 / BF16 | 1 | 4 / 2 / 2 | the value |
| Q4_0 | 32 | 18 | d, 16 bytes of nibbles: w = d (q - 8) |
| Q4_1 | 32 | 20 | d, m, 16 bytes of nibbles: w = d q + m |
| Q5_0 | 32 | 22 | d, 4 bytes of fifth bits, 16 of nibbles: w = d (q - 16) |
| Q5_1 | 32 | 24 | d, m, 4 bytes of fifth bits, 16 of nibbles: w = d q + m |
| Q8_0 | 32 | 34 | d, 32 int8: w = d q |
| Q4_K | 256 | 144 | d, dmin, 12 bytes of six-bit scales and minimums, 128 of nibbles |
| Q5_K | 256 | 176 | as Q4_K, 32 bytes of fifth bits before the nibbles |
| Q6_K | 256 | 210 | 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d |
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

__all__ = ["GGMLType", "INT8_TYPES", "Traits", "ggml_type", "row_bytes"]


class Traits(NamedTuple):
    """What a loop needs to know of a type: values per block, bytes per block."""

    block_size: int
    type_size: int


class GGMLType(IntEnum):
    """A GGML tensor type, numbered as ggml numbers it (`gguf.GGMLQuantizationType`)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30

    @property
    def traits(self) -> Traits:
        """This type's row of `TRAITS`."""
        return TRAITS[self]

    @property
    def block_size(self) -> int:
        """Values per block (1 for the float types)."""
        return TRAITS[self].block_size

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return TRAITS[self].type_size


TRAITS: dict[GGMLType, Traits] = {
    GGMLType.F32: Traits(1, 4),
    GGMLType.F16: Traits(1, 2),
    GGMLType.BF16: Traits(1, 2),
    GGMLType.Q4_0: Traits(32, 18),
    GGMLType.Q4_1: Traits(32, 20),
    GGMLType.Q5_0: Traits(32, 22),
    GGMLType.Q5_1: Traits(32, 24),
    GGMLType.Q8_0: Traits(32, 34),
    GGMLType.Q4_K: Traits(256, 144),
    GGMLType.Q5_K: Traits(256, 176),
    GGMLType.Q6_K: Traits(256, 210),
}
"""Every type's traits: the one table the loops ask."""

INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")
"""The types whose decode products can run on 8-bit activations (`activations("int8")`):
x is quantized per block of 32 (`quantize_activations`) and each block's dot product is an
exact integer sum, as llama.cpp computes them. Not the default: a step runs faster
(docs/benchmarks.md), with llama.cpp's size of logit error instead of float32's;
docs/kernels.md."""


def ggml_type(kind: str | int | GGMLType) -> GGMLType:
    """The `GGMLType` named by `kind`: a member, its name ("Q4_1") or ggml's number.

    Raises:
        ValueError: for anything else, naming the types there are.
    """
    if isinstance(kind, GGMLType):
        return kind
    if isinstance(kind, str) and kind in GGMLType.__members__:
        return GGMLType[kind]
    if isinstance(kind, int) and not isinstance(kind, bool) and kind in GGMLType._value2member_map_:
        return GGMLType(kind)
    raise ValueError(f"expected a GGML type of {', '.join(GGMLType.__members__)}, got {kind!r}")


def row_bytes(kind: str | int | GGMLType, columns: int) -> int:
    """Bytes of one row of `columns` values of GGML type `kind`."""
    kind = ggml_type(kind)
    if columns % kind.block_size:
        raise ValueError(
            f"expected a row length that is a multiple of {kind.block_size} for {kind.name}, got {columns}")
    return columns // kind.block_size * kind.type_size
