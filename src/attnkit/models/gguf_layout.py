"""The GGUF file layout, read straight from a memory map: header, metadata, tensor table.

GGUF (llama.cpp's `docs/gguf.md`), version 2 or 3, little-endian (or big-endian throughout,
as the gguf package writes with `GGUFEndian.BIG`: told apart, as its reader does, by the
version's low 16 bits being zero when read little-endian):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x   (string key | u32 value_type | value)
    tensor_count x (string name | u32 n_dims | u64 dims[n_dims] (fastest first) | u32 ggml_type | u64 offset)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)

    string = u64 length | UTF-8 bytes;   array = u32 element_type | u64 count | elements

Numeric arrays are read by NumPy in one call; string arrays (a tokenizer's 49,152 tokens)
are cut from the map in one loop, with no object per entry beyond the string itself.
Every length, count and offset is checked against the file's size before it is used, so a
damaged header is a `ValueError` naming the file, never a huge allocation, a hang or
another exception. The tensor table's own rules (types, alignment, running offsets) are
`attnkit.models.gguf.check_tensor_table`'s.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any, NamedTuple

import numpy as np

__all__ = ["GGML_TYPES", "GGMLType", "GGUFLayout", "read_layout"]


class GGMLType(NamedTuple):
    """A GGML tensor type: its number in the file, name, values per block and bytes per block."""

    number: int
    name: str
    block_size: int
    type_size: int


# ggml.h's `enum ggml_type` with ggml.c's block sizes (the gguf package's GGML_QUANT_SIZES).
GGML_TYPES: dict[int, GGMLType] = {
    number: GGMLType(number, name, block, size)
    for number, (name, block, size) in {
        0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
        7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
        11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
        15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
        19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
        23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
        28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
        35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
    }.items()
}

# GGUF metadata value types -> NumPy dtype (the byte order is the file's); 7 bool, 8 string, 9 array.
_NUMERIC = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 10: "u8", 11: "i8", 12: "f8"}
_BOOL, _STRING, _ARRAY = 7, 8, 9
_MAX_NESTING = 4  # arrays of arrays: llama.cpp writes none; a deeper chain is damage


class TensorRecord(NamedTuple):
    """One tensor-table entry as stored: GGML dims fastest first, raw type number, offset in the data."""

    name: str
    dims: tuple[int, ...]
    raw_type: int
    offset: int


class GGUFLayout(NamedTuple):
    """What `read_layout` found: version, metadata (plain Python values), tensor table,
    alignment, where the data section starts, the file's size and the map itself."""

    version: int
    metadata: dict[str, Any]
    tensors: list[TensorRecord]
    alignment: int
    data_start: int
    file_size: int
    buffer: np.ndarray  # the whole file, uint8, memory-mapped read-only
    byte_order: str = "<"  # "<" little-endian, ">" big-endian (numbers, metadata and tensor data)


class _Truncated(ValueError):
    pass


class _Cursor:
    """Reads the header from `view` (the file's bytes), every read checked against its end."""

    def __init__(self, view: memoryview, source: str, order: str = "<") -> None:
        self.view = view
        self.size = len(view)
        self.pos = 0
        self.source = source
        self.order = order  # "<" or ">"
        self._u32, self._u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")

    def need(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated(
                f"could not read GGUF file {self.source!r}: {what} at byte {self.pos} needs {n} bytes, "
                f"but the file ends at byte {self.size} (truncated or corrupt)"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return self._u32.unpack_from(self.view, self.need(4, what))[0]

    def u64(self, what: str) -> int:
        return self._u64.unpack_from(self.view, self.need(8, what))[0]

    def string(self, what: str) -> str:
        length = self.u64(f"the length of {what}")
        start = self.need(length, what)
        return self.text(start, length, what)

    def text(self, start: int, length: int, what: str) -> str:
        try:
            return str(self.view[start:start + length], "utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"could not read GGUF file {self.source!r}: {what} is not UTF-8") from None

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in _NUMERIC:
            dtype = np.dtype(self.order + _NUMERIC[kind])
            return np.frombuffer(self.view, dtype, 1, self.need(dtype.itemsize, what)).tolist()[0]
        if kind == _BOOL:
            return bool(self.view[self.need(1, what)])
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            if depth >= _MAX_NESTING:
                raise ValueError(f"could not read GGUF file {self.source!r}: {what} nests arrays deeper than {_MAX_NESTING}")
            return self.array(what, depth + 1)
        raise ValueError(
            f"could not read GGUF file {self.source!r}: {what} has value type {kind}; expected 0 to 12 "
            "(GGUF's uint8 ... float64)"
        )

    def array(self, what: str, depth: int) -> list:
        kind = self.u32(f"the element type of {what}")
        count = self.u64(f"the length of {what}")
        remaining = self.size - self.pos
        if kind in _NUMERIC or kind == _BOOL:
            dtype = np.dtype(self.order + _NUMERIC.get(kind, "u1"))
            start = self.need(count * dtype.itemsize if count <= remaining else remaining + 1, what)
            values = np.frombuffer(self.view, dtype, count, start)
            return (values != 0).tolist() if kind == _BOOL else values.tolist()
        if kind == _STRING:  # each string is at least its 8-byte length
            if count > remaining // 8:
                self.need(remaining + 1, f"{count} strings of {what}")
            view, pos, size, unpack = self.view, self.pos, self.size, self._u64.unpack_from
            spans = []
            for _ in range(count):
                if pos + 8 > size:
                    self.pos = pos
                    self.need(8, f"a string length of {what}")
                length = unpack(view, pos)[0]
                pos += 8
                if length > size - pos:
                    self.pos = pos
                    self.need(length, f"a string of {what}")
                spans.append((pos, length))
                pos += length
            self.pos = pos
            blob = bytes(view[spans[0][0]:pos]) if spans else b""
            base = spans[0][0] if spans else 0
            try:
                return [str(blob[s - base:s - base + n], "utf-8") for s, n in spans]
            except UnicodeDecodeError:
                raise ValueError(f"could not read GGUF file {self.source!r}: a string of {what} is not UTF-8") from None
        if kind == _ARRAY:
            if count > remaining // 12:  # a nested array is at least its type and length
                self.need(remaining + 1, f"{count} arrays of {what}")
            return [self.value(kind, what, depth) for _ in range(count)]
        raise ValueError(
            f"could not read GGUF file {self.source!r}: {what} has element type {kind}; expected 0 to 12"
        )


def _map(path: str | os.PathLike[str]) -> np.ndarray:
    """The file as a read-only uint8 array backed by the page cache (an empty file: no map)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return np.zeros(0, np.uint8)
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mapped, np.uint8)


def read_layout(path: str | os.PathLike[str]) -> GGUFLayout:
    """Read a GGUF file's header, metadata and tensor table from a memory map.

    Arguments:
        path: the file (its magic bytes and version checked already, see `GGUFFile`).

    Returns:
        `GGUFLayout`; `metadata` holds Python values as the gguf package's
        `ReaderField.contents()` gives them (int, float, bool, str, lists of them).

    Raises:
        ValueError: naming the file: a length, count or offset that runs past its end, an
            unknown value type, text that is not UTF-8, a key given twice, a bad alignment.
    """
    source = str(path)
    buffer = _map(path)
    order = "<"
    if len(buffer) >= 8 and int.from_bytes(bytes(buffer[4:8]), "little") & 0xFFFF == 0:
        order = ">"  # the version (2 or 3) stored big-endian: the whole file is (the gguf package's test)
    cursor = _Cursor(memoryview(buffer), source, order)
    cursor.need(4, "the magic bytes")
    version = cursor.u32("the version")
    tensor_count = cursor.u64("the tensor count")
    kv_count = cursor.u64("the metadata count")
    if kv_count > cursor.size // 13 or tensor_count > cursor.size // 24:  # the smallest key/value, tensor entry
        raise ValueError(
            f"could not read GGUF file {source!r}: it claims {kv_count} metadata keys and {tensor_count} tensors, "
            f"more than its {cursor.size} bytes can hold (corrupt counts)"
        )
    metadata: dict[str, Any] = {}
    for index in range(kv_count):
        key = cursor.string(f"metadata key {index}")
        if key in metadata:
            raise ValueError(f"could not read GGUF file {source!r}: metadata key {key!r} appears twice")
        kind = cursor.u32(f"the value type of {key!r}")
        metadata[key] = cursor.value(kind, f"the value of {key!r}")
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(
            f"could not read GGUF file {source!r}: expected general.alignment to be a power of two, got {alignment!r}"
        )
    tensors = []
    for index in range(tensor_count):
        name = cursor.string(f"the name of tensor {index}")
        n_dims = cursor.u32(f"the dimension count of tensor {name!r}")
        if n_dims > 4:
            raise _tensor_error(source, name, f"expected 1 to 4 dims (n_dims), got {n_dims}")
        dims = struct.unpack_from(f"{order}{n_dims}Q", cursor.view, cursor.need(8 * n_dims, f"the dims of {name!r}"))
        raw_type = cursor.u32(f"the type of tensor {name!r}")
        offset = cursor.u64(f"the data offset of tensor {name!r}")
        tensors.append(TensorRecord(name, tuple(dims), raw_type, offset))
    data_start = -(-cursor.pos // alignment) * alignment
    return GGUFLayout(version, metadata, tensors, alignment, data_start, cursor.size, buffer, order)


def _tensor_error(source: str, name: str, message: str) -> ValueError:
    from attnkit.models.checkpoint import CheckpointError

    return CheckpointError(f"{source}: tensor {name!r}: {message}")
