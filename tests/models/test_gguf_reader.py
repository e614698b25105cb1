"""attnkit's reader of the GGUF layout (attnkit.models.gguf_layout) against the gguf package's.

On the embedded SmolLM2 file, the tiny Llama of tiny_checkpoints and a file holding every
metadata value type (arrays of each, nested, empty): the same metadata (as
`ReaderField.contents()` gives it), the same tensor table and the same tensor bytes. Then
damaged headers: every cut and every mutated length, count or type tag is a ValueError naming
the file, or the metadata the gguf package reads from the same bytes.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from attnkit.models.gguf import GGUFFile
from attnkit.models.gguf_layout import GGML_TYPES, read_layout

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers
from tiny_checkpoints import write_tiny_llama_gguf  # noqa: E402


def package_view(path):
    """(metadata, [(name, dims, type, offset)], data_start, {name: bytes}) by the gguf package."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    table = [(t.name, tuple(int(n) for n in t.shape.tolist()), int(t.tensor_type), int(t.data_offset) - int(reader.data_offset))
             for t in reader.tensors]
    data = {t.name: np.asarray(t.data).view(np.uint8).reshape(-1) for t in reader.tensors}
    return metadata, table, int(reader.data_offset), data


def as_package_gives(metadata: dict) -> dict:
    """`metadata` with arrays of arrays flattened, as the package's `contents()` gives them."""
    return {key: [x for inner in value for x in inner]
            if isinstance(value, list) and value and isinstance(value[0], list) else value
            for key, value in metadata.items()}


def assert_same_as_package(path):
    metadata, table, data_start, data = package_view(path)
    layout = read_layout(path)
    assert as_package_gives(layout.metadata) == metadata
    assert [(t.name, t.dims, t.raw_type, t.offset) for t in layout.tensors] == table
    assert layout.data_start == data_start
    opened = GGUFFile(path)
    for name, expected in data.items():
        np.testing.assert_array_equal(opened.raw(name).reshape(-1), expected)
    return layout


def test_ggml_types_are_the_packages(gguf):
    for number, kind in GGML_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(number)] == (kind.block_size, kind.type_size)
        assert gguf.GGMLQuantizationType(number).name == kind.name


@pytest.mark.slow  # measured > 2 s in the quick loop
def test_embedded_smollm2(smollm2_file, gguf):
    layout = assert_same_as_package(smollm2_file)
    assert len(layout.metadata["tokenizer.ggml.tokens"]) == 49152


def test_tiny_llama(tmp_path, gguf):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path)
    assert_same_as_package(path)


@pytest.fixture(scope="module")
def every_type(tmp_path_factory, gguf):
    path = tmp_path_factory.mktemp("reader") / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    V = gguf.GGUFValueType
    writer.add_uint8("t.u8", 255)
    writer.add_int8("t.i8", -128)
    writer.add_uint16("t.u16", 65535)
    writer.add_int16("t.i16", -32768)
    writer.add_uint32("t.u32", 2**32 - 1)
    writer.add_int32("t.i32", -(2**31))
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**64 - 1)
    writer.add_int64("t.i64", -(2**63))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.text", "é ✓ \x00 end")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.strings", ["a", "", "ü" * 40])
    writer.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type(every_type):
    layout = assert_same_as_package(every_type)
    assert layout.metadata["t.u64"] == 2**64 - 1 and layout.metadata["t.text"] == "é ✓ \x00 end"
    assert layout.metadata["t.nested"] == [[1, 2], [3]]


def _header_fields(path) -> list[tuple[int, str]]:
    """(byte, '<Q' or '<I') of every length, count and type tag in the header, by the package."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = [(8, "<Q"), (16, "<Q")]  # the tensor count, the kv count
    for field in list(reader.fields.values())[3:]:
        at = field.offset
        for part in field.parts:
            if part.dtype in (np.uint64, np.uint32) and part.size == 1:
                fields.append((at, "<Q" if part.dtype == np.uint64 else "<I"))
            at += part.nbytes
    return fields


def test_damaged_headers_are_refused_clearly(every_type, tmp_path, gguf):
    """Cuts anywhere in the header and every length, count or type tag set to 0, +-1, x2, 13 or
    2**40: a ValueError naming the file, or the metadata the gguf package reads."""
    intact = read_layout(every_type).metadata
    data = every_type.read_bytes()
    end = read_layout(every_type).data_start
    cases = [(data[:cut], f"cut at {cut}") for cut in range(0, end, 3)]
    for at, form in _header_fields(every_type):
        old = struct.unpack_from(form, data, at)[0]
        limit = 2**32 if form == "<I" else 2**64
        for value in {0, old - 1, old + 1, old * 2, 2**40 % limit, 13}:
            damaged = bytearray(data)
            struct.pack_into(form, damaged, at, max(0, value) % limit)
            cases.append((bytes(damaged), f"{form} at {at}: {old} -> {value}"))
    path = tmp_path / "damaged.gguf"
    outcomes = {"refused": 0, "same": 0}
    for blob, what in cases:
        path.write_bytes(blob)
        try:
            layout = GGUFFile(path)
        except ValueError as error:
            assert str(path) in str(error), f"{what}: {error}"
            outcomes["refused"] += 1
            continue
        except Exception as error:  # noqa: BLE001 - what this test looks for
            pytest.fail(f"{what}: {type(error).__name__}: {error}")
        if layout.metadata != intact:  # a type tag changed to another of its size: read as the package reads it
            try:
                theirs = package_view(path)[0]
            except Exception:  # noqa: BLE001 - the package refusing, in its own way
                theirs = None
            assert repr(as_package_gives(layout.metadata)) == repr(theirs), f"{what}: read differently from the package"
        outcomes["same"] += 1
    assert outcomes["refused"] > len(cases) // 2, outcomes


# ----------------------------------------------------------------------------- big-endian files

ELEMENT_TYPES = {"token_embd": "F16", "attn_q": "F32", "attn_k": "F16", "attn_v": "F32", "attn_output": "F16",
                 "ffn_gate": "F32", "ffn_up": "F16", "ffn_down": "F32"}


def test_a_big_endian_file_reads_as_its_little_endian_twin(tmp_path, gguf):
    """The gguf package writes big-endian files (`GGUFEndian.BIG`) and reads them back: the
    same metadata, table and values as the little-endian file of the same model (the old
    reader took its counts little-endian: "claims 1080863910568919040 metadata keys")."""
    from attnkit.models import AutoCausalLM

    little, big = tmp_path / "little.gguf", tmp_path / "big.gguf"
    model = write_tiny_llama_gguf(little, types=ELEMENT_TYPES)
    write_tiny_llama_gguf(big, model, types=ELEMENT_TYPES, big_endian=True)
    assert gguf.GGUFReader(str(big)).endianess == gguf.GGUFEndian.BIG
    ours_little, ours_big = GGUFFile(little), GGUFFile(big)
    assert (ours_little.byte_order, ours_big.byte_order) == ("<", ">")
    assert ours_big.metadata == ours_little.metadata
    assert ours_big.tensor_infos.keys() == ours_little.tensor_infos.keys()
    for name in ours_little.tensor_names:
        assert ours_big.tensor_type(name) == ours_little.tensor_type(name)
        np.testing.assert_array_equal(ours_big.raw(name), ours_little.raw(name))
        np.testing.assert_array_equal(ours_big.tensor(name), ours_little.tensor(name))
    # the package's reader of the big-endian file agrees, value for value
    package = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(big)).tensors}
    for name, values in package.items():
        np.testing.assert_array_equal(ours_big.tensor(name).reshape(-1), values.astype(np.float32).reshape(-1))
    ids = np.array([1, 5, 9, 3, 7])
    np.testing.assert_array_equal(AutoCausalLM.from_pretrained(big)(ids), AutoCausalLM.from_pretrained(little)(ids))


def test_a_big_endian_file_with_quantized_blocks_is_refused_by_name(tmp_path, gguf):
    """A quantized block's byte order in a big-endian file depends on the tool that wrote it
    (the gguf package leaves the blocks as they are; llama.cpp's gguf_convert_endian.py swaps
    their scales): refused, naming the tensor, its type and the way out."""
    path = tmp_path / "big-q8.gguf"
    write_tiny_llama_gguf(path, types={**ELEMENT_TYPES, "attn_q": "Q8_0"}, big_endian=True)
    found = GGUFFile(path)
    assert found.metadata["llama.block_count"] == 2 and found.tensor_type("blk.0.attn_q.weight") == "Q8_0"
    found.tensor("blk.0.attn_k.weight")  # element types read
    with pytest.raises(ValueError, match=r"big-q8\.gguf: tensor 'blk\.0\.attn_q\.weight' is Q8_0 in a big-endian "
                                         r"GGUF file.*gguf_convert_endian\.py"):
        found.raw("blk.0.attn_q.weight")
