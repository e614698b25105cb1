"""Reading Hugging Face checkpoint folders: config, safetensors weights, name mapping.

The loaders of every model family (BERT encoders, GPT-2 and Llama decoders) go
through the same three steps, each written once here:

1. `read_config(folder)` reads `config.json`.
2. `read_safetensors(files)` reads the weights through safetensors' NumPy API
   (never pickle), one file or the shards listed in `model.safetensors.index.json`.
3. `map_names(...)` renames checkpoint keys into attnkit's names with a short
   table of regular expressions, and `check_shapes(...)` compares every tensor
   against the shapes the attnkit model expects.

Checkpoint names stop here: no attnkit class attribute takes a checkpoint's
spelling. Every problem raises `CheckpointError` (a `ValueError`) naming the
file and the tensor: a missing, unexpected or mis-shaped tensor, a truncated or
corrupt file, a folder with no weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_FILES = ("pytorch_model.bin", "model.pt", "model.pth", "pytorch_model.bin.index.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


# ----------------------------------------------------------------------------- files


def read_json(path: str | Path) -> dict:
    """Read one JSON object from `path`, with errors that name the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
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
    if single.is_file():
        return [single]
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map' object")
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
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
    from safetensors import SafetensorError, safe_open

    paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, Path] = {}
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"weights file {path} does not exist")
        try:
            with safe_open(str(path), framework="numpy") as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise CheckpointError(
                            f"tensor {name!r} appears in both {origin[name]} and {path}"
                        )
                    if handle.get_slice(name).get_dtype() == "BF16":
                        tensors[name] = _read_bfloat16(path, name)
                    else:
                        tensors[name] = handle.get_tensor(name)
                    origin[name] = path
        except SafetensorError as error:
            raise CheckpointError(
                f"{path} is not a readable safetensors file (truncated or corrupt?): {error}"
            ) from None
        except OSError as error:
            raise CheckpointError(f"cannot read {path}: {error}") from None
    return tensors


# ----------------------------------------------------------------------------- names


def map_names(
    tensors: Mapping[str, np.ndarray],
    table: Sequence[tuple[str, str]],
    *,
    ignore: Iterable[str] = (),
    source: str | Path = "checkpoint",
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Rename checkpoint tensors into attnkit's names.

    Arguments:
        tensors: checkpoint name -> array.
        table: (regex, replacement) pairs; the first regex that fully matches a
            name gives its attnkit name (`re.fullmatch`, `\\1` groups allowed).
        ignore: regexes of checkpoint names that are dropped on purpose (buffers
            such as `position_ids`, heads the model does not use).
        source: the file the tensors came from, for messages.

    Returns:
        (attnkit name -> array, attnkit name -> checkpoint name).

    Raises:
        CheckpointError: a tensor no rule maps (unexpected), or two checkpoint
            tensors that map onto the same attnkit name.
    """
    compiled = [(re.compile(pattern), replacement) for pattern, replacement in table]
    ignored = [re.compile(pattern) for pattern in ignore]
    mapped: dict[str, np.ndarray] = {}
    original: dict[str, str] = {}
    unexpected: list[str] = []
    for name, array in tensors.items():
        for pattern, replacement in compiled:
            match = pattern.fullmatch(name)
            if match is not None:
                new_name = match.expand(replacement)
                if new_name in mapped:
                    raise CheckpointError(
                        f"tensors {original[new_name]!r} and {name!r} in {source} both map "
                        f"to {new_name!r}"
                    )
                mapped[new_name] = array
                original[new_name] = name
                break
        else:
            if not any(pattern.fullmatch(name) for pattern in ignored):
                unexpected.append(name)
    if unexpected:
        shown = ", ".join(repr(name) for name in sorted(unexpected)[:8])
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        raise CheckpointError(f"unexpected tensor(s) in {source}: {shown}{more}")
    return mapped, original


def check_shapes(
    tensors: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[int, ...]],
    *,
    original: Mapping[str, str] | None = None,
    source: str | Path = "checkpoint",
) -> None:
    """Check that `tensors` holds exactly the names in `expected`, each with its shape.

    Arguments:
        tensors: attnkit name -> array (after `map_names`).
        expected: attnkit name -> shape the model needs.
        original: attnkit name -> checkpoint name, so messages show both.
        source: the file, for messages.

    Raises:
        CheckpointError: missing tensors, unexpected tensors, or a shape mismatch;
            all of them are listed.
    """
    original = original or {}

    def describe(name: str) -> str:
        checkpoint_name = original.get(name, name)
        return repr(name) if checkpoint_name == name else f"{checkpoint_name!r} (-> {name!r})"

    problems = []
    missing = [name for name in expected if name not in tensors]
    if missing:
        problems.append("missing tensor(s): " + ", ".join(repr(name) for name in missing))
    unexpected = [name for name in tensors if name not in expected]
    if unexpected:
        problems.append("unexpected tensor(s): " + ", ".join(describe(n) for n in unexpected))
    for name, shape in expected.items():
        if name in tensors and tuple(tensors[name].shape) != tuple(shape):
            problems.append(
                f"tensor {describe(name)} has shape {tuple(tensors[name].shape)}, "
                f"expected {tuple(shape)}"
            )
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


def load_state_dict(
    folder: str | Path,
    table: Sequence[tuple[str, str]],
    expected: Mapping[str, tuple[int, ...]],
    *,
    ignore: Iterable[str] = (),
    dtype: np.dtype | type = np.float32,
) -> dict[str, np.ndarray]:
    """Read a folder's safetensors weights, rename them, check them, cast them.

    Arguments:
        folder: a Hugging Face model folder.
        table, ignore: the name mapping (see `map_names`).
        expected: attnkit name -> shape (see `check_shapes`).
        dtype: floating dtype of the returned arrays (integer tensors are kept).

    Returns:
        attnkit name -> C-contiguous array of `dtype`, exactly the names in `expected`.
    """
    files = find_safetensors(folder)
    source = files[0] if len(files) == 1 else f"{files[0].parent} ({len(files)} shards)"
    tensors = read_safetensors(files)
    mapped, original = map_names(tensors, table, ignore=ignore, source=source)
    check_shapes(mapped, expected, original=original, source=source)
    out = {}
    for name, array in mapped.items():
        if np.issubdtype(array.dtype, np.floating):
            array = array.astype(dtype, copy=False)
        out[name] = np.ascontiguousarray(array)
    return out


__all__ = [
    "CheckpointError",
    "check_folder",
    "check_shapes",
    "find_safetensors",
    "load_state_dict",
    "map_names",
    "read_config",
    "read_json",
    "read_safetensors",
]
