"""The GGML block formats in one home, split the way ggml splits them.

- `attnkit.quant.types`: `GGMLType`, ggml's type numbers (equal to
  `gguf.GGMLQuantizationType`'s), each with its block size and bytes per block: the one
  traits table every loop asks;
- `attnkit.quant.reference`: the NumPy reference (`dequantize`, `matmul_reference`,
  `quantize_activations`, `matmul_int8_reference`), what the fast paths are tested against;
- `attnkit.quant.loops`: the compiled loops, plain Python for numba, and the native
  entries with their named frames (`PRODUCT_FRAME`, `DEQUANTIZE_FRAME`);
- `attnkit.quant.ir`: the one file that writes LLVM IR (the four-row block dot products);
- `attnkit.quant.compiled`: the loops compiled into one explicit namespace;
- `attnkit.quant.products`: `matmul`, `matmul_stack`, `dequantize_compiled`, the thread
  split, and `activations("int8")` (scoped to the calling thread or task);
- `attnkit.quant.layers`: `QuantizedTensor`, `QuantizedLinear`, ... (loaded on first use).

    from attnkit import quant
    y = quant.matmul(x, raw, quant.GGMLType.Q4_1, 576)   # x (N, 576) @ W.T
"""

from __future__ import annotations

import importlib
from typing import Any

from attnkit.quant.products import (
    DECODE_ROWS,
    PARALLEL_MACS,
    activations,
    compiled_available,
    current_activations,
    dequantize_compiled,
    matmul,
    matmul_stack,
)
from attnkit.quant.reference import dequantize, matmul_int8_reference, matmul_reference, quantize_activations
from attnkit.quant.types import INT8_TYPES, TRAITS, GGMLType, Traits, ggml_type, row_bytes

_LAZY = {  # the layers import attnkit.nn: loaded when first asked for
    "QuantizedCausalSelfAttention": "layers",
    "QuantizedEmbedding": "layers",
    "QuantizedLinear": "layers",
    "QuantizedSwiGLU": "layers",
    "QuantizedTensor": "layers",
    "quantized_types": "layers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnkit.quant' has no attribute {name!r}")
    return getattr(importlib.import_module(f"attnkit.quant.{module}"), name)


__all__ = sorted([
    "DECODE_ROWS", "GGMLType", "INT8_TYPES", "PARALLEL_MACS", "TRAITS", "Traits", "activations",
    "compiled_available", "current_activations", "dequantize", "dequantize_compiled", "ggml_type", "matmul",
    "matmul_int8_reference", "matmul_reference", "matmul_stack", "quantize_activations", "row_bytes", *_LAZY,
])


def __dir__() -> list[str]:
    return sorted({*__all__, "compiled", "ir", "layers", "loops", "products", "reference", "types"})
