"""`attnkit.quant` as a package: GGMLType is ggml's numbering with one traits table, every
public entry checks what it is given before compiled code runs, the old import paths keep
working for one release, and the loops keep their promises (no type code spelled as a
number, no module globals changed, named frames)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from attnkit import quant
from attnkit.quant import GGMLType

QUANT_SOURCES = Path(quant.__file__).parent


def test_ggml_types_are_ggmls_numbers_and_sizes(gguf):
    """Each member's value is `gguf.GGMLQuantizationType`'s, and its block size and bytes
    are the gguf package's `GGML_QUANT_SIZES`."""
    for kind in GGMLType:
        assert int(kind) == int(gguf.GGMLQuantizationType[kind.name]), kind
        assert (kind.block_size, kind.type_size) == tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind.name]])
    assert quant.ggml_type("Q4_1") is GGMLType.Q4_1 and quant.ggml_type(3) is GGMLType.Q4_1
    with pytest.raises(ValueError, match="expected a GGML type of F32, F16, .*got 'Q3_K'"):
        quant.ggml_type("Q3_K")
    assert quant.row_bytes(GGMLType.Q6_K, 512) == 420 == quant.row_bytes("Q6_K", 512)


def test_no_type_code_is_spelled_as_a_number_in_the_package():
    """The loops compare types with `GGMLType`'s members (or constants read from them), never
    `code == 4`; and nothing in the package changes a module's globals."""
    for path in QUANT_SOURCES.glob("*.py"):
        text = path.read_text()
        assert not re.findall(r"\b(?:code|kind|code0)\s*(?:==|!=|<=|>=|<|>)\s*\d", text), path.name
        assert "globals()" not in text, path.name


def _q4_1(rows: int, columns: int, rng) -> np.ndarray:
    blocks = rng.integers(0, 256, (rows, columns // 32, 20), dtype=np.uint8)
    blocks[..., 0:4] = np.array([0.01, 0.5], np.float16).view(np.uint8)  # d, m
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("compiled", [None, False])
def test_public_entries_check_what_they_are_given(compiled):
    """Wrong shapes, dtypes, types and part lists are a ValueError or TypeError naming what
    was expected and what arrived, before any compiled code reads memory."""
    rng = np.random.default_rng(0)
    raw, x = _q4_1(8, 64, rng), rng.standard_normal((2, 64)).astype(np.float32)
    cases = [
        (lambda: quant.matmul(x[:, :32], raw, "Q4_1", 64, compiled=compiled), ValueError,
         r"expected x of shape \(N, 64\), got \(2, 32\)"),
        (lambda: quant.matmul(x.astype(np.int32), raw, "Q4_1", 64, compiled=compiled), TypeError,
         "expected x of dtype float16, float32 or float64, got int32"),
        (lambda: quant.matmul(x.tolist(), raw, "Q4_1", 64, compiled=compiled), TypeError,
         "expected x as a NumPy array"),
        (lambda: quant.matmul(x, raw[:, :-1], "Q4_1", 64, compiled=compiled), ValueError,
         "expected 40 bytes per row for 64 Q4_1 values, got 39"),
        (lambda: quant.matmul(x, raw.view(np.int8), "Q4_1", 64, compiled=compiled), TypeError,
         "expected raw blocks as a 2-D uint8 array"),
        (lambda: quant.matmul(x, raw, "Q4_2", 64, compiled=compiled), ValueError, "expected a GGML type of"),
        (lambda: quant.matmul(x, raw, "Q4_1", 48, compiled=compiled), ValueError,
         "expected a row length that is a multiple of 32 for Q4_1, got 48"),
        (lambda: quant.matmul_stack(x, [raw], 64, compiled=compiled), TypeError, r"expected each part as a \(raw, kind\)"),
        (lambda: quant.matmul_stack(x, [], 64, compiled=compiled), TypeError, "non-empty list"),
        (lambda: quant.dequantize(raw, "Q4_1", 0), ValueError, "expected columns to be a positive integer, got 0"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_dequantize_compiled_checks_before_it_runs():
    from attnkit import kernels

    rng = np.random.default_rng(1)
    raw = _q4_1(4, 64, rng)
    with pytest.raises(ValueError, match="expected 40 bytes per row for 64 Q4_1 values, got 20"):
        quant.dequantize_compiled(raw[:, :20], "Q4_1", 64)
    if kernels.enabled():
        np.testing.assert_array_equal(quant.dequantize_compiled(raw, GGMLType.Q4_1, 64), quant.dequantize(raw, "Q4_1", 64))


def test_strided_inputs_give_the_contiguous_results():
    """A view with strides (every other row, a transposed x) is read as its values, not as
    the memory under it."""
    rng = np.random.default_rng(2)
    raw = _q4_1(16, 64, rng)
    x = np.asfortranarray(rng.standard_normal((3, 64)).astype(np.float32))
    np.testing.assert_array_equal(quant.matmul(x, raw[::2], "Q4_1", 64),
                                  quant.matmul(np.ascontiguousarray(x), np.ascontiguousarray(raw[::2]), "Q4_1", 64))


def test_frames_are_named_records():
    from attnkit.quant.loops import DEQUANTIZE_FRAME, PRODUCT_FRAME, frame

    assert PRODUCT_FRAME.names[:4] == ("raw", "rows", "row_bytes", "type")
    record = frame(DEQUANTIZE_FRAME, **{name: i for i, name in enumerate(DEQUANTIZE_FRAME.names)})
    assert record["count"][0] == DEQUANTIZE_FRAME.names.index("count")
    with pytest.raises(ValueError, match=r"missing \['half'\]"):
        frame(PRODUCT_FRAME, **{name: 0 for name in PRODUCT_FRAME.names if name != "half"})


def test_old_import_paths_keep_working():
    """`attnkit.kernels.quant` and `attnkit.models.quantized` re-export the public names for
    one release; `QUANT_TYPES` keeps its old codes beside the new GGMLType."""
    from attnkit.kernels import quant as old
    from attnkit.models import quantized as old_layers

    for name in ("INT8_TYPES", "activations", "compiled_available", "current_activations", "dequantize",
                 "dequantize_compiled", "matmul", "matmul_int8_reference", "matmul_reference", "matmul_stack",
                 "quantize_activations", "row_bytes"):
        assert getattr(old, name) is getattr(quant, name), name
    assert old.QUANT_TYPES["Q4_1"] == old.BlockType(32, 20, 4) and len(old.QUANT_TYPES) == len(GGMLType)
    for name in old_layers.__all__:
        assert getattr(old_layers, name) is getattr(quant, name), name
