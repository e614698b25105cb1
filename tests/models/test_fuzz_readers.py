"""Fuzzing the GGUF and safetensors readers (issue 29): damaged files are refused clearly,
or they load a model whose output is the intact file's, bit for bit. Never a hang, a crash,
another exception type, or a silent change.

Each case mutates one thing of a tiny random Llama written by the format libraries
(`tiny_checkpoints`): a bit or a byte of the header, the file cut short, or one field of
the structure (a tensor's type, data offset or dimension, a count, a length prefix, a
header length, a dtype/shape/offset in the safetensors JSON). What counts:

- refused: `CheckpointError` or `ValueError` whose message names the file;
- loaded: logits on fixed ids and the tokenizer's ids for a fixed text equal to the
  intact file's (`np.array_equal`);
- anything else fails the test, with the seed that reproduces it.

Out of scope, because no reader can tell (the formats carry no checksum, and llama.cpp
does not either): the tensor data bytes themselves, and free-form values in the GGUF
metadata (float hyperparameters such as `rms_epsilon`, the token strings, merges and
token types, names, the chat template). Their bytes are not mutated; every length
prefix, type tag, count, integer value and the whole tensor table are.

CI runs `FUZZ_CASES` (500) cases per format from fixed seeds 0-499 (about 8 s). A longer run:

    ATTNKIT_FUZZ_CASES=5000 python -m pytest -q -n 0 tests/models/test_fuzz_readers.py

(docs/models.md records the last long run's count.) A hang is caught by
`faulthandler.dump_traceback_later`, which prints every thread's stack and exits.
"""

from __future__ import annotations

import faulthandler
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from attnkit.models.auto import AutoCausalLM
from attnkit.models.checkpoint import CheckpointError

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers
from tiny_checkpoints import write_tiny_llama_folder, write_tiny_llama_gguf  # noqa: E402

FUZZ_CASES = int(os.environ.get("ATTNKIT_FUZZ_CASES", "500"))
HANG_SECONDS = 60  # one load of the tiny model takes well under a second
IDS = np.array([[5, 40, 80, 120, 160, 200, 7, 9]])
TEXT = "<|im_start|>the theater in the north 123<|im_end|>"


def _pick(rng: np.random.Generator, options):
    """One of `options`, kept a Python object (`rng.choice` would turn 2**63 into a float)."""
    return options[int(rng.integers(len(options)))]


def _fingerprint(model) -> tuple[np.ndarray, list[int]]:
    tokens = model.tokenizer.encode(TEXT) if model.tokenizer is not None else []
    return model(IDS), list(tokens)


def _check_case(path: Path, reference, what: str) -> str:
    """Load `path`: refused with a message naming the file, or identical output. Returns the outcome."""
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    try:
        try:
            model = AutoCausalLM.from_pretrained(path)
        except ValueError as error:  # CheckpointError is one
            message = str(error)
            assert path.name in message or str(path) in message, f"{what}: a refusal that does not name the file: {message!r}"
            return "refused"
        except Exception as error:  # noqa: BLE001 - anything else is the failure this test looks for
            pytest.fail(f"{what}: {type(error).__name__} instead of a CheckpointError: {error}")
        logits, tokens = _fingerprint(model)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert np.array_equal(logits, reference[0]), f"{what}: loaded, but the logits changed"
    assert tokens == reference[1], f"{what}: loaded, but the tokenizer changed"
    return "identical"


# ----------------------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    gguf = pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("fuzz") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    reader = gguf.GGUFReader(str(path))
    value_types = gguf.GGUFValueType
    free_form = {value_types.STRING, value_types.FLOAT32, value_types.FLOAT64}
    mutable = np.zeros(reader.data_offset, dtype=bool)  # which header bytes may change
    lengths = []  # byte positions of u64 string-length and array-length prefixes
    for field in reader.fields.values():
        position = field.offset
        is_array = field.types and field.types[0] == value_types.ARRAY
        for index, part in enumerate(field.parts):
            size = int(part.nbytes)
            data = index in field.data
            if not data or not (is_array or field.types[-1] in free_form):
                mutable[position:position + size] = True
            if part.dtype == np.uint64 and size == 8 and not data and index > 0:
                lengths.append(position)
            position += size
    tables = []
    for tensor in reader.tensors:
        parts = tensor.field.parts  # name_len, name, n_dims, dims, type, offset
        start = tensor.field.offset
        sizes = [int(p.nbytes) for p in parts]
        mutable[start:start + sum(sizes)] = True
        tables.append({"dims": start + sum(sizes[:3]), "n_dims": int(parts[2][0]), "type": start + sum(sizes[:4]),
                       "offset": start + sum(sizes[:5]), "n_dims_at": start + sum(sizes[:2])})
    mutable[mutable.size - (reader.data_offset - max(t["offset"] + 8 for t in tables)):] = True  # padding
    model = AutoCausalLM.from_pretrained(path)
    return {
        "path": path, "bytes": path.read_bytes(), "mutable": np.flatnonzero(mutable), "lengths": lengths,
        "tables": tables, "alignment": int(reader.alignment), "reference": _fingerprint(model),
        "types": [int(kind) for kind in gguf.GGML_QUANT_SIZES],
    }


def _mutate_gguf(base, rng: np.random.Generator) -> tuple[bytes, str]:
    data = bytearray(base["bytes"])
    kind = _pick(rng, ["bit", "byte", "truncate", "type", "offset", "dim", "n_dims", "count", "length"])
    if kind in ("bit", "byte"):
        at = int(_pick(rng, base["mutable"]))
        if kind == "bit":
            bit = int(rng.integers(8))
            data[at] ^= 1 << bit
            return bytes(data), f"bit {bit} of byte {at} flipped"
        value = int(rng.integers(256))
        data[at] = value
        return bytes(data), f"byte {at} set to {value}"
    if kind == "truncate":
        at = int(rng.integers(len(data)))
        return bytes(data[:at]), f"cut at byte {at} of {len(data)}"
    table = base["tables"][int(rng.integers(len(base["tables"])))]
    if kind == "type":
        value = int(_pick(rng, base["types"] + [39, 99, 2**31]))
        struct.pack_into("<I", data, table["type"], value)
        return bytes(data), f"type at byte {table['type']} set to {value}"
    if kind == "offset":
        old = struct.unpack_from("<Q", data, table["offset"])[0]
        shift = int(_pick(rng, [-3, -2, -1, 1, 2, 3])) * base["alignment"] if rng.random() < 0.7 else int(rng.integers(-40, 40))
        value = max(old + shift, 0) if rng.random() < 0.95 else 2**63
        struct.pack_into("<Q", data, table["offset"], value)
        return bytes(data), f"offset at byte {table['offset']} {old} -> {value}"
    if kind == "dim":
        at = table["dims"] + 8 * int(rng.integers(table["n_dims"]))
        old = struct.unpack_from("<Q", data, at)[0]
        value = int(_pick(rng, [0, 1, old - 1, old + 1, old * 2, old // 2, 32, 2**40, 2**63]))
        struct.pack_into("<Q", data, at, max(value, 0))
        return bytes(data), f"dim at byte {at} {old} -> {value}"
    if kind == "n_dims":
        value = int(_pick(rng, [0, 1, 2, 3, 5, 2**31]))
        struct.pack_into("<I", data, table["n_dims_at"], value)
        return bytes(data), f"n_dims at byte {table['n_dims_at']} set to {value}"
    if kind == "count":
        at = int(_pick(rng, [8, 16]))  # tensor count, kv count
        old = struct.unpack_from("<Q", data, at)[0]
        value = int(_pick(rng, [old - 1, old + 1, 0, 2**40]))
        struct.pack_into("<Q", data, at, max(value, 0))
        return bytes(data), f"{'tensor' if at == 8 else 'kv'} count {old} -> {value}"
    at = int(_pick(rng, base["lengths"]))
    old = struct.unpack_from("<Q", data, at)[0]
    value = int(_pick(rng, [old - 1, old + 1, 0, old * 2, 2**40]))
    struct.pack_into("<Q", data, at, max(value, 0))
    return bytes(data), f"length prefix at byte {at} {old} -> {value}"


def _run(base, mutate, seeds, tmp_path, suffix):
    counts: dict[str, int] = {}
    path = tmp_path / f"mutated{suffix}"
    for seed in seeds:
        rng = np.random.default_rng(seed)
        blob, what = mutate(base, rng)
        target = path if suffix else path / "model.safetensors"
        if not suffix:
            target.parent.mkdir(exist_ok=True)
            (target.parent / "config.json").write_bytes(base["config"])
        target.write_bytes(blob)
        outcome = _check_case(target if suffix else target.parent, base["reference"], f"seed {seed}: {what}")
        counts[outcome] = counts.get(outcome, 0) + 1
    print(f"{len(seeds)} cases: {counts}")
    return counts


def test_fuzz_gguf_reader(gguf_base, tmp_path):
    counts = _run(gguf_base, _mutate_gguf, range(FUZZ_CASES), tmp_path, ".gguf")
    assert counts.get("refused", 0) > FUZZ_CASES // 3  # the mutations reach the checks


# ----------------------------------------------------------------------------- safetensors


@pytest.fixture(scope="module")
def safetensors_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz") / "llama"
    write_tiny_llama_folder(folder)
    model = AutoCausalLM.from_pretrained(folder)
    data = (folder / "model.safetensors").read_bytes()
    header_length = struct.unpack_from("<Q", data, 0)[0]
    return {
        "bytes": data, "header_length": header_length, "header": json.loads(data[8:8 + header_length]),
        "config": (folder / "config.json").read_bytes(), "reference": _fingerprint(model),
    }


def _with_header(base, header: dict) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + base["bytes"][8 + base["header_length"]:]


def _mutate_safetensors(base, rng: np.random.Generator) -> tuple[bytes, str]:
    data = bytearray(base["bytes"])
    end = 8 + base["header_length"]
    kind = _pick(rng, ["bit", "byte", "truncate", "header_length", "dtype", "shape", "offsets"])
    if kind in ("bit", "byte"):
        at = int(rng.integers(end))
        if kind == "bit":
            bit = int(rng.integers(8))
            data[at] ^= 1 << bit
            return bytes(data), f"bit {bit} of byte {at} flipped"
        value = int(rng.integers(256))
        data[at] = value
        return bytes(data), f"byte {at} set to {value}"
    if kind == "truncate":
        at = int(rng.integers(len(data)))
        return bytes(data[:at]), f"cut at byte {at} of {len(data)}"
    if kind == "header_length":
        value = int(_pick(rng, [base["header_length"] + d for d in (-8, -1, 1, 8)] + [0, 2**40, 2**64 - 1]))
        struct.pack_into("<Q", data, 0, max(value, 0))
        return bytes(data), f"header length {base['header_length']} -> {value}"
    header = json.loads(json.dumps(base["header"]))
    names = sorted(name for name in header if name != "__metadata__")
    name = names[int(rng.integers(len(names)))]
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = str(_pick(rng, ["F16", "BF16", "F64", "I32", "U8", "BOOL", "F8_E4M3", "X9"]))
        return _with_header(base, header), f"{name} dtype -> {entry['dtype']}"
    if kind == "shape":
        shape = entry["shape"]
        choice = int(rng.integers(3))
        if choice == 0 and len(shape) == 2:
            entry["shape"] = shape[::-1]
        elif choice == 1:
            entry["shape"] = shape + [1]
        else:
            axis = int(rng.integers(len(shape)))
            shape[axis] = int(_pick(rng, [0, shape[axis] - 1, shape[axis] + 1, shape[axis] * 2]))
        return _with_header(base, header), f"{name} shape -> {entry['shape']}"
    start, stop = entry["data_offsets"]
    shift = int(_pick(rng, [-4, 4, -256, 256]))
    entry["data_offsets"] = [max(start + shift, 0), stop] if rng.random() < 0.5 else [start, max(stop + shift, 0)]
    return _with_header(base, header), f"{name} data_offsets -> {entry['data_offsets']}"


def test_fuzz_safetensors_reader(safetensors_base, tmp_path):
    counts = _run(safetensors_base, _mutate_safetensors, range(FUZZ_CASES), tmp_path, "")
    assert counts.get("refused", 0) > FUZZ_CASES // 3
