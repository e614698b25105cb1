"""Reading a checkpoint's files: config.json, the safetensors weights and their headers.

Every reader refuses what is not a regular file (a FIFO named config.json would wait
forever) and turns the OS's and safetensors' errors into a `CheckpointError` naming the
file. The name mapping, the shape checks and the config reader that use these are in
`attnkit.models.checkpoint`, which re-exports every name here: import them from there.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_FILES = ("pytorch_model.bin", "model.pt", "model.pth", "pytorch_model.bin.index.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


# ----------------------------------------------------------------------------- files


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def is_model_file(path: str | Path) -> bool:
    """True when `path` is a regular file (a symlink to one counts), False when nothing is
    there. Anything else (a FIFO, a socket, a device, a directory) is refused: reading a FIFO
    named config.json would wait forever for a writer, and skipping it as absent would load
    the folder without it.

    Raises:
        CheckpointError: naming the file and what it is.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return False
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"expected {path} to be a regular file, got {_kind(mode)}")
    return True


def read_model_bytes(path: str | Path) -> bytes:
    """The bytes of the regular file `path`. The file is opened without blocking and checked
    on the opened descriptor, so a FIFO swapped in after a check cannot hang the read.

    Raises:
        CheckpointError: the file does not exist, is not a regular file, or cannot be read.
    """
    path = Path(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    with os.fdopen(descriptor, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"expected {path} to be a regular file, got {_kind(mode)}")
        try:
            return handle.read()
        except OSError as error:
            raise CheckpointError(f"cannot read {path}: {error}") from None


def read_model_text(path: str | Path) -> str:
    """The UTF-8 text of the regular file `path` (`read_model_bytes`).

    Raises:
        CheckpointError: as `read_model_bytes`, or bytes that are not UTF-8 (naming the byte offset).
    """
    data = read_model_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(
            f"{path} is not UTF-8 text: byte {error.start} ({data[error.start:error.start + 1]!r}) "
            f"{error.reason}"
        ) from None


def read_json(path: str | Path) -> dict:
    """Read one JSON object from the regular file `path`, with errors that name the file."""
    path = Path(path)
    text = read_model_text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"expected a JSON object in {path}, got {type(value).__name__}")
    return value


def read_config(folder: str | Path) -> dict:
    """Read `config.json` from a model folder."""
    folder = check_folder(folder)
    return read_json(folder / "config.json")


def check_folder(folder: str | Path) -> Path:
    """Return `folder` as a Path after checking that it is an existing directory."""
    if not isinstance(folder, (str, Path)):
        raise TypeError(f"expected a model folder as str or Path, got {type(folder).__name__}")
    path = Path(folder).expanduser()
    if not path.exists():
        raise CheckpointError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"expected a model folder, got the file {path}")
    return path


def find_safetensors(folder: str | Path) -> list[Path]:
    """The safetensors files of a model folder: one file, or the shards of an index.

    Raises:
        CheckpointError: no `model.safetensors` and no `model.safetensors.index.json`
            (the message says when only pickle weights are present and how to convert).
    """
    folder = check_folder(folder)
    single = folder / SAFETENSORS_FILE
    if is_model_file(single):
        return [single]
    index = folder / SAFETENSORS_INDEX
    if is_model_file(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map' object")
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not is_model_file(shard):
                raise CheckpointError(f"shard {shard.name} listed in {index} does not exist")
        return shards
    pickles = [name for name in _PICKLE_FILES if (folder / name).exists()]
    hint = (
        f"; found only pickle weights ({', '.join(pickles)}), which attnkit never loads: "
        "convert them to safetensors first (safetensors.torch.save_file)"
        if pickles
        else ""
    )
    raise CheckpointError(
        f"no weights in {folder}: expected {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}{hint}"
    )


def _read_bfloat16(path: Path, name: str) -> np.ndarray:
    """Read one bfloat16 tensor as float32 (NumPy has no bfloat16 dtype).

    The safetensors header (8-byte little-endian length, then JSON) gives the
    tensor's byte range; bfloat16 is the top half of a float32's bits.
    """
    with path.open("rb") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_length))
    entry = header[name]
    start, end = entry["data_offsets"]
    raw = np.fromfile(path, dtype="<u2", count=(end - start) // 2, offset=8 + header_length + start)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def read_safetensors(files: str | Path | Sequence[str | Path]) -> dict[str, np.ndarray]:
    """Read every tensor of one or more safetensors files into NumPy arrays.

    Arguments:
        files: a file, or the shards of one checkpoint.

    Returns:
        name -> array, as stored (bfloat16 becomes float32). A name found in two
        shards is an error.

    Raises:
        CheckpointError: a missing, truncated or corrupt file, naming it.
    """
    from safetensors import safe_open

    infos = read_header(files)  # checks every file and every name before anything is read
    tensors: dict[str, np.ndarray] = {}
    for path in dict.fromkeys(info.file for info in infos.values()):
        with _reading(path), safe_open(str(path), framework="numpy") as handle:
            for name, info in infos.items():
                if info.file == path:
                    tensors[name] = _read_bfloat16(path, name) if info.dtype == "BF16" else handle.get_tensor(name)
    return tensors


@contextmanager
def _reading(path: Path):
    """Turn safetensors' and the OS's errors about `path` into a CheckpointError naming it."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as error:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {error}") from None
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None


class TensorInfo(NamedTuple):
    """What a file's header says about one tensor, read without loading it."""

    shape: tuple[int, ...]
    dtype: str  # safetensors ("F32", "BF16", ...) or GGML ("Q8_0", ...) type name
    file: Path


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def read_header(files: str | Path | Sequence[str | Path]) -> dict[str, TensorInfo]:
    """Name, shape and dtype of every tensor in one or more safetensors files, from their
    headers only (nothing is loaded or allocated).

    Raises:
        CheckpointError: a missing, truncated or corrupt file, or a name in two shards.
    """
    from safetensors import safe_open

    paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
    infos: dict[str, TensorInfo] = {}
    for path in paths:
        if not is_model_file(path):
            raise CheckpointError(f"weights file {path} does not exist")
        with _reading(path), safe_open(str(path), framework="numpy") as handle:
            for name in handle.keys():
                if name in infos:
                    raise CheckpointError(f"tensor {name!r} appears in both {infos[name].file} and {path}")
                piece = handle.get_slice(name)
                infos[name] = TensorInfo(tuple(int(n) for n in piece.get_shape()), str(piece.get_dtype()), path)
    return infos
