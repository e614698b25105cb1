"""Deprecated location: the quantized layers moved to `attnkit.quant.layers` (one release).

`from attnkit.models.quantized import QuantizedLinear` keeps working; import them from
`attnkit.quant` instead.
"""

from __future__ import annotations

from attnkit.quant.layers import (  # noqa: F401 - re-exported
    QuantizedCausalSelfAttention,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedSwiGLU,
    QuantizedTensor,
    _Transposed,
    quantized_types,
)

__all__ = [
    "QuantizedCausalSelfAttention",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedSwiGLU",
    "QuantizedTensor",
    "quantized_types",
]
