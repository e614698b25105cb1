"""Reading GGUF files: metadata, tensors dequantized to float32, and the tokenizer.

GGUF is llama.cpp's single-file format: a header of typed key/value metadata
(the architecture, its hyperparameters, the tokenizer's vocabulary and merges,
the chat template) followed by tensors, often quantized in blocks (Q4_1 stores
32 weights as 4-bit integers with one float16 scale and one float16 minimum).

attnkit reads the layout itself (`attnkit.models.gguf_layout`, from a memory map, every
length and offset checked against the file); the `gguf` package (llama.cpp's reference, the
pip extra `attnkit[gguf]`) dequantizes tensors to float32 through its public API
(`gguf.quants.dequantize`). `attnkit.quant` runs the blocks without dequantizing.
This module knows the format and nothing about any one model:

    gguf_file = GGUFFile(path)                    # metadata, tensor shapes and types
    gguf_file.tensor("token_embd.weight")         # one tensor, float32
    gguf_file.raw("token_embd.weight")            # its stored blocks, a view of the map
    tokenizer = tokenizer_from_gguf(gguf_file)    # the `tokenizer.*` keys, rebuilt
    check_metadata_keys(gguf_file, ...)           # every key read, harmless, or refused

What the keys and tensors of an architecture mean lives with the model: the
Llama mapping (config keys, tensor names, llama.cpp's rotary row permutation)
is in `attnkit.models.llama`. `attnkit.models.auto` picks the model class by
`general.architecture`.
"""

from __future__ import annotations

import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from attnkit.models.checkpoint import CheckpointError, ConfigReader, TensorInfo, is_model_file
from attnkit.models.gguf_layout import GGML_TYPES, read_layout
from attnkit.models.gguf_tokenizer import GGUF_PRE_TOKENIZERS, tokenizer_from_gguf  # re-exported: they lived here
from attnkit.runtime import require

__all__ = [
    "GGUFFile",
    "GGUFTensorEntry",
    "GGUF_PRE_TOKENIZERS",
    "check_tensor_table",
    "check_metadata_counts",
    "check_metadata_keys",
    "supported_tensor_types",
    "tokenizer_from_gguf",
]

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)


def _gguf():
    """The `gguf` package, or a `MissingExtraError` naming the extra that installs it."""
    return require("gguf", "gguf", "reading GGUF files")


@lru_cache(maxsize=1)
def supported_tensor_types() -> tuple[str, ...]:
    """Names of the GGML tensor types this reader turns into float32.

    F32, F16, BF16, F64 and every block quantization that `gguf.quants.dequantize`
    implements (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, the IQ types, ...): each type
    of `gguf.GGML_QUANT_SIZES` is asked to dequantize one block of zeros.
    """
    gguf = _gguf()
    from gguf.quants import dequantize

    names = {"F64"}  # converted in `GGUFFile.tensor`: the package has no dequantizer for it
    for kind, (_, type_size) in gguf.GGML_QUANT_SIZES.items():
        try:
            dequantize(np.zeros(type_size, dtype=np.uint8), kind)
        except (NotImplementedError, ValueError, TypeError, KeyError):
            continue
        names.add(kind.name)
    return tuple(sorted(names))


def _check_magic(path: Path) -> None:
    if not is_model_file(path):  # a FIFO or device is refused here, before anything opens it
        raise ValueError(f"expected a GGUF file, got {str(path)!r}, which is not a file")
    with open(path, "rb") as handle:
        head = handle.read(8)
    if head[:4] != GGUF_MAGIC:
        raise ValueError(
            f"expected a GGUF file starting with the magic bytes b'GGUF', got {head[:4]!r} in {str(path)!r}"
        )
    if len(head) < 8:
        raise ValueError(f"could not read GGUF file {str(path)!r}: it ends inside its header (truncated)")
    version = int.from_bytes(head[4:8], "little")
    if version not in GGUF_VERSIONS and int.from_bytes(head[4:8], "big") not in GGUF_VERSIONS:
        raise ValueError(
            f"could not read GGUF file {str(path)!r}: expected GGUF version 2 or 3, got {version}"
        )


# GGML's element (non-block) types: bytes per value, swapped as one number in a big-endian file
_ELEMENT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "I16": 2, "I32": 4, "I64": 8}


# llama.cpp's limits on a tensor-info entry (ggml.h: GGML_MAX_DIMS, GGML_MAX_NAME).
_GGML_MAX_DIMS = 4
_GGML_MAX_NAME = 64


class GGUFTensorEntry(NamedTuple):
    """One entry of a GGUF tensor table, as stored: GGML dims (fastest first), the raw type
    number, and the data offset relative to the start of the data section."""

    name: str
    dims: tuple[int, ...]
    raw_type: int
    offset: int


def check_tensor_table(
    entries: list[GGUFTensorEntry], *, data_start: int, alignment: int, file_size: int, source: str | os.PathLike[str]
) -> None:
    """Refuse a tensor table that llama.cpp's loader (`gguf_init_from_file_impl`) would refuse.

    For each tensor, in file order: at most 4 dims, each >= 0; a name shorter than 64 bytes,
    seen once; a type GGML knows (`GGML_TYPES`, the gguf package's `GGML_QUANT_SIZES`); a
    first dim that is a multiple of the type's block size; a data offset that is a multiple
    of `general.alignment` and equals the running sum of the previous tensors' byte sizes,
    each padded to the alignment (so no overlap, no gap, no reordering); its bytes (type size
    x elements / block size) inside the file. And, beyond llama.cpp: nothing after the last
    tensor's padded data (which a changed type of the last tensor would leave). Nothing is
    read from the data section.

    Raises:
        CheckpointError: naming the file, the tensor, the field, what was expected and found.
    """
    seen: set[str] = set()
    expected_offset = 0
    for entry in entries:
        where = f"{source}: tensor {entry.name!r}"
        if len(entry.name.encode("utf-8")) >= _GGML_MAX_NAME:
            raise CheckpointError(f"{where}: expected a name shorter than {_GGML_MAX_NAME} bytes (GGML_MAX_NAME)")
        if entry.name in seen:
            raise CheckpointError(f"{where}: appears twice in the tensor table; expected each name once")
        seen.add(entry.name)
        if not 1 <= len(entry.dims) <= _GGML_MAX_DIMS:
            raise CheckpointError(f"{where}: expected 1 to {_GGML_MAX_DIMS} dims (n_dims), got {len(entry.dims)}")
        kind = GGML_TYPES.get(entry.raw_type)
        if kind is None:
            raise CheckpointError(
                f"{where}: type is {entry.raw_type}, which is not a GGML tensor type; expected one of "
                f"{', '.join(f'{k.number} ({k.name})' for k in GGML_TYPES.values())}"
            )
        block_size, type_size = kind.block_size, kind.type_size
        if entry.dims[0] % block_size:
            raise CheckpointError(
                f"{where}: type {kind.name} stores blocks of {block_size} values, but its first dimension is "
                f"{entry.dims[0]}; expected a multiple of {block_size} (dims {list(entry.dims)})"
            )
        elements = 1
        for n in entry.dims:
            elements *= n
        n_bytes = elements // block_size * type_size
        if entry.offset % alignment:
            raise CheckpointError(
                f"{where}: data offset {entry.offset} is not a multiple of the alignment {alignment} "
                "(general.alignment, default 32)"
            )
        if entry.offset != expected_offset:
            raise CheckpointError(
                f"{where}: expected data offset {expected_offset} (the previous tensors' sizes, each padded to "
                f"{alignment} bytes), got {entry.offset}; the tensor table is corrupt (a changed offset, type "
                "or shape)"
            )
        end = data_start + entry.offset + n_bytes
        if end > file_size:
            raise CheckpointError(
                f"{where}: its data ({kind.name}, dims {list(entry.dims)}: {n_bytes} bytes at byte "
                f"{data_start + entry.offset}) ends at byte {end}, past the end of the file ({file_size} bytes); "
                "expected it inside the file (truncated, or a changed type or shape)"
            )
        expected_offset += -(-n_bytes // alignment) * alignment
    # Beyond llama.cpp, which reads the data section and ignores what follows: every GGUF
    # writer (llama.cpp's, the gguf package's) ends the file with the last tensor's data and its
    # padding, so bytes after that mean the last tensor's type or shape was changed to a
    # smaller one (no next offset disagrees with it) and are refused.
    if entries and file_size > data_start + expected_offset:
        last = entries[-1]
        raise CheckpointError(
            f"{source}: tensor {last.name!r}: the file has {file_size - data_start - expected_offset} bytes after "
            f"its data (padded to {alignment} bytes), which ends at byte {data_start + expected_offset}; expected "
            "the file to end there (a changed type or shape of the last tensor, or bytes appended to the file)"
        )


class GGUFFile:
    """An opened GGUF file: `metadata` (a dict of plain Python values) and its tensors.

    The file is memory-mapped and its header read by attnkit's own reader of the GGUF layout
    (`attnkit.models.gguf_layout`: numeric arrays in one NumPy call each, no Python object per
    vocabulary entry beyond its string); the tensor table is checked (`check_tensor_table`)
    before any tensor is touched. `tensor_infos` gives shapes and types without reading data;
    `tensor(name)` dequantizes one to float32 (`attnkit.quant.dequantize` for the types
    it knows, value for value the gguf package's; the package for the others);
    `raw(name)` is its stored blocks, a read-only view of the map (no copy).

    Arguments:
        path: the `.gguf` file.

    Raises:
        ValueError: the file does not exist, is not GGUF, or its header is truncated or corrupt;
            the message names the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        _check_magic(self.path)
        try:
            layout = read_layout(self.path)
        except ValueError:
            raise
        except (OSError, OverflowError, MemoryError, struct.error) as error:
            raise ValueError(f"could not read GGUF file {str(self.path)!r}: {error}") from None
        entries = [GGUFTensorEntry(t.name, t.dims, t.raw_type, t.offset) for t in layout.tensors]
        check_tensor_table(entries, data_start=layout.data_start, alignment=layout.alignment,
                           file_size=layout.file_size, source=self.path)
        self._buffer = layout.buffer
        self._data_start = layout.data_start
        self.byte_order = layout.byte_order  # "<", or ">" for a big-endian file
        self.metadata: dict[str, Any] = layout.metadata
        self._entries = {entry.name: entry for entry in entries}
        self.tensor_infos: dict[str, TensorInfo] = {
            entry.name: TensorInfo(tuple(reversed(entry.dims)), GGML_TYPES[entry.raw_type].name, self.path)
            for entry in entries  # GGML lists dims fastest-first
        }

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def tensor_names(self) -> list[str]:
        return list(self._entries)

    def tensor_type(self, name: str) -> str:
        """The GGML type name of tensor `name` (`"Q4_1"`, `"F32"`, ...)."""
        return self._info(name).dtype

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensor_infos:
            raise ValueError(f"GGUF file {str(self.path)!r} has no tensor {name!r}")
        return self.tensor_infos[name]

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name`'s stored bytes as a read-only uint8 view of the map, (rows, bytes per row).

        Rows are the NumPy shape's leading dims flattened; a row holds `shape[-1]` values in
        blocks of the type (`GGML_TYPES`). Nothing is copied or read until used.
        """
        self._info(name)  # an unknown name is a ValueError naming the file
        entry = self._entries[name]
        kind = GGML_TYPES[entry.raw_type]
        columns = entry.dims[0]
        rows = 1
        for n in entry.dims[1:]:
            rows *= n
        row_bytes = columns // kind.block_size * kind.type_size
        start = self._data_start + entry.offset
        stored = self._buffer[start:start + rows * row_bytes].reshape(rows, row_bytes)
        if self.byte_order == "<":
            return stored
        return self._little_endian(name, kind.name, stored)

    def _little_endian(self, name: str, kind: str, stored: np.ndarray) -> np.ndarray:
        """A big-endian file's tensor bytes in little-endian order (a copy): its values swapped
        one by one for the element types (F32, F16, BF16, F64, I8 ... I64), as the gguf package
        writes them. Block types are refused: the gguf package writes their bytes unswapped,
        llama.cpp's gguf_convert_endian.py swaps the scales inside each block, and the file does
        not say which it holds."""
        width = _ELEMENT_BYTES.get(kind)
        if width is None:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is {kind} in a big-endian GGUF file; attnkit reads big-endian "
                "files' F32, F16, BF16, F64 and integer tensors only (the byte order inside a quantized block "
                "depends on the tool that wrote it); convert the file with the gguf package's "
                "gguf_convert_endian.py FILE little"
            )
        if width == 1:
            return stored
        swapped = stored.view(f">u{width}").astype(f"<u{width}")  # (rows, row_bytes / width)
        return swapped.view(np.uint8).reshape(stored.shape)

    def check_tensor_types(self, names: Any = None) -> None:
        """Refuse, before anything is dequantized, a tensor whose GGML type has no dequantizer.

        Arguments:
            names: the tensors to check (default: every tensor of the file).

        Raises:
            ValueError: naming the file, the tensor, its type and the supported types.
        """
        supported = supported_tensor_types()
        for name in self.tensor_infos if names is None else names:
            kind = self._info(name).dtype
            if kind not in supported:
                raise ValueError(
                    f"tensor {name!r} in {str(self.path)!r} has GGML type {kind}, which attnkit cannot "
                    f"dequantize; expected one of {', '.join(supported)}"
                )

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in NumPy (row-major) order, e.g. (out_features, in_features).

        Raises:
            ValueError: no tensor of that name, a type with no dequantizer, or data that does
                not fit its shape; naming the file and the tensor.
            MissingExtraError: the gguf package (the dequantizer of the types attnkit does not
                dequantize itself) is not installed.
        """
        from attnkit.quant.reference import dequantize as dequantize_blocks
        from attnkit.quant.types import GGMLType

        info = self._info(name)
        if info.dtype not in GGMLType.__members__ and info.dtype != "F64":
            self.check_tensor_types([name])
        raw = self.raw(name)
        try:
            if info.dtype == "F64":
                values = raw.view(np.float64).astype(np.float32)
            elif info.dtype in GGMLType.__members__:  # attnkit's NumPy reference, value for value the package's
                values = dequantize_blocks(raw, info.dtype, info.shape[-1] if info.shape else 1)
            else:
                gguf = _gguf()
                from gguf.quants import dequantize

                values = dequantize(raw, gguf.GGMLQuantizationType[info.dtype])
            return np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape)
        except (ValueError, IndexError, TypeError, NotImplementedError):
            raise ValueError(
                f"could not read tensor {name!r} ({info.dtype}, shape {info.shape}) from {str(self.path)!r}: "
                "its data is truncated or does not match its type and shape"
            ) from None


# ----------------------------------------------------------------------------- metadata keys

# `tokenizer.` keys read by `tokenizer_from_gguf`, and those that change nothing for a
# byte-level BPE tokenizer.
_TOKENIZER_KEYS = {
    "ggml.model", "ggml.pre", "ggml.tokens", "ggml.token_type", "ggml.merges", "ggml.bos_token_id",
    "ggml.eos_token_id", "ggml.eot_token_id", "ggml.eom_token_id", "ggml.padding_token_id",
    "ggml.add_bos_token", "ggml.add_eos_token", "chat_template",
}
_TOKENIZER_HARMLESS = {
    "ggml.scores",  # sentencepiece merge scores; byte-level BPE ranks merges by their order
    "ggml.token_type_count", "ggml.unknown_token_id", "ggml.seperator_token_id", "ggml.separator_token_id",
    "ggml.cls_token_id", "ggml.mask_token_id",
    "ggml.prefix_token_id", "ggml.suffix_token_id", "ggml.middle_token_id",  # fill-in-the-middle ids
    "ggml.fim_pre_token_id", "ggml.fim_suf_token_id", "ggml.fim_mid_token_id", "ggml.fim_pad_token_id",
    "ggml.fim_rep_token_id", "ggml.fim_sep_token_id",
    # sentencepiece-only settings; llama.cpp and transformers ignore them for byte-level BPE
    "ggml.add_space_prefix", "ggml.remove_extra_whitespaces", "ggml.precompiled_charsmap",
    "huggingface.json",  # a copy of tokenizer.json; llama.cpp and transformers build from ggml.* keys
    "chat_templates",  # the names of extra chat templates (`tokenizer.chat_template.NAME`), unused
}
_TOKENIZER_NEUTRAL = {"ggml.add_sep_token": (False,)}


def check_metadata_keys(
    gguf_file: GGUFFile,
    arch: str,
    *,
    known: set[str],
    harmless: set[str],
    neutral: dict[str, tuple[Any, ...]],
    what: str,
) -> None:
    """Refuse, by name, every metadata key a GGUF model may not carry unread.

    `general.*` (names, license, quantization) and `quantize.*` (importance-matrix notes) never
    change the math; `split.count` above 1 means this file holds only part of the tensors;
    `tokenizer.*` keys are this module's (`tokenizer_from_gguf`); the `{arch}.` keys are the
    model's, given as `ConfigReader.check_keys` takes them.

    Arguments:
        arch: the architecture prefix (`"llama"`).
        known, harmless, neutral: the `{arch}.` keys (without the prefix) that the model reads,
            that change nothing, and that change nothing at the listed values only.
        what: the model, for messages (`"attnkit's Llama"`).

    Raises:
        CheckpointError (a ValueError): naming the file and the key.
    """
    source = gguf_file.path
    metadata = gguf_file.metadata
    split = metadata.get("split.count", 1)
    if split != 1:
        raise CheckpointError(
            f"{source} is one of {split} parts of a split GGUF (split.count); merge them first "
            "(llama-gguf-split --merge)"
        )
    ConfigReader(metadata, source, prefix=f"{arch}.").check_keys(
        known, neutral=neutral, harmless=harmless, common=False, what=what
    )
    check_metadata_counts(gguf_file, arch)
    named_templates = {key.removeprefix("tokenizer.") for key in metadata if key.startswith("tokenizer.chat_template.")}
    ConfigReader(metadata, source, prefix="tokenizer.").check_keys(
        _TOKENIZER_KEYS, neutral=_TOKENIZER_NEUTRAL, harmless=_TOKENIZER_HARMLESS | named_templates, common=False,
        what="attnkit's GGUF tokenizer",
    )
    prefixes = ("general.", "quantize.", "split.", "tokenizer.", f"{arch}.")
    other = [key for key in metadata if not key.startswith(prefixes)]
    if other:
        raise CheckpointError(
            f"{source}: {what} does not know the metadata key(s) {', '.join(map(repr, sorted(other)))}; "
            "they may change what the model computes, so the file is refused"
        )


def _block_indices(names: list[str]) -> set[int]:
    """The N of every `blk.N.` tensor name (llama.cpp's name for layer N's tensors)."""
    found = set()
    for name in names:
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            found.add(int(parts[1]))
    return found


def check_metadata_counts(gguf_file: GGUFFile, arch: str) -> None:
    """Refuse metadata counts that the tensor table contradicts, before anything is sized by them.

    llama.cpp names tensors the same way in every architecture, so each count is checked
    against the tensors it counts: `{arch}.block_count` against the layers `blk.0.` ... present
    (exactly those), `embedding_length` and `vocab_size` against `token_embd.weight`'s
    (vocab, d), `feed_forward_length` against `blk.0.ffn_up.weight`'s rows, and the head counts
    against `blk.0.attn_q.weight` / `attn_k.weight` (rows a multiple of the count, the same
    head size for both). A per-layer count (a list) has one entry per block. A count whose
    tensor is absent is left to the model's own shape checks. So a block_count of 2^31 over two
    layers of tensors is an error naming the key, not a list of 2^31 tensor names.

    Raises:
        CheckpointError (a ValueError): naming the file, the key, its value and what the
            tensors say.
    """
    source, metadata, infos = gguf_file.path, gguf_file.metadata, gguf_file.tensor_infos

    def count(key: str) -> Any:
        value = metadata.get(f"{arch}.{key}")
        if value is None or isinstance(value, list) or (type(value) is int and value >= 0):
            return value
        raise CheckpointError(f"{source}: expected {arch}.{key} to be a count (an integer >= 0), got {value!r}")

    def disagree(key: str, value: Any, tensors: str) -> CheckpointError:
        return CheckpointError(
            f"{source}: {arch}.{key} is {value} but {tensors}; the metadata and the tensor table disagree "
            "(corrupt or edited metadata)"
        )

    blocks = count("block_count")
    present = _block_indices(list(infos))
    if blocks is not None:
        # distinct indices >= 0: exactly 0 .. blocks - 1 when there are `blocks` of them, the last blocks - 1
        if isinstance(blocks, list) or len(present) != blocks or (present and max(present) != blocks - 1):
            held = (f"the tensor table holds {len(present)} layers (blk.N. for N in "
                    f"{min(present)}..{max(present)})" if present else "the tensor table holds no blk.N. layer")
            raise disagree("block_count", blocks, held)
    for key, value in metadata.items():  # per-layer lists: one entry a layer
        if key.startswith(f"{arch}.") and isinstance(value, list) and blocks is not None \
                and key.endswith(("head_count", "head_count_kv", "feed_forward_length")) and len(value) != blocks:
            raise disagree(key.removeprefix(f"{arch}."), f"a list of {len(value)}", f"block_count is {blocks}")

    def rows(name: str) -> int | None:  # a weight's output features (GGML dims are fastest first)
        info = infos.get(name)
        return info.shape[0] if info is not None and len(info.shape) == 2 else None

    embedding = infos.get("token_embd.weight")
    if embedding is not None and len(embedding.shape) == 2:
        vocab, width = embedding.shape
        for key, expected in (("embedding_length", width), ("vocab_size", vocab)):
            value = count(key)
            if isinstance(value, int) and value != expected:
                raise disagree(key, value, f"token_embd.weight is (vocab, d) = {embedding.shape}")
    ffn = count("feed_forward_length")
    if isinstance(ffn, int) and rows("blk.0.ffn_up.weight") not in (None, ffn):
        raise disagree("feed_forward_length", ffn, f"blk.0.ffn_up.weight has {rows('blk.0.ffn_up.weight')} rows")
    heads, kv_heads = count("attention.head_count"), count("attention.head_count_kv")
    q_rows, k_rows = rows("blk.0.attn_q.weight"), rows("blk.0.attn_k.weight")
    sizes = {}
    for key, value, total, name in (("attention.head_count", heads, q_rows, "attn_q"),
                                    ("attention.head_count_kv", kv_heads, k_rows, "attn_k")):
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and value > 0 and total is not None:  # 0: the reader's ">= 1" says so
            if total % value:
                raise disagree(key, value, f"blk.0.{name}.weight has {total} rows, not a multiple of it")
            sizes[name] = total // value
    if len(set(sizes.values())) > 1:
        raise disagree("attention.head_count_kv", kv_heads,
                       f"it makes heads of {sizes['attn_k']} values where head_count makes heads of {sizes['attn_q']}")
