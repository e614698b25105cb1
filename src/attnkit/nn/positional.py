"""Sinusoidal positional encoding (Vaswani et al. 2017, section 3.5)."""

from __future__ import annotations

import math

import numpy as np

from attnkit.nn.module import parameter_dtype


def sinusoidal_positional_encoding(
    num_positions: int,
    d_model: int,
    *,
    start: int = 0,
    base: float = 10000.0,
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """The fixed sinusoidal table of "Attention Is All You Need".

    PE[pos, 2i]   = sin(pos / base^(2i / d_model))
    PE[pos, 2i+1] = cos(pos / base^(2i / d_model))

    for pos = start, ..., start + num_positions - 1 (pass `start` to continue a
    sequence, e.g. when decoding token by token). An odd d_model ends with a
    sine column. Computed in float64, returned in `dtype`.

    Returns:
        (num_positions, d_model) array; add it to (B, L, d_model) embeddings.
    """
    for name, value in (("num_positions", num_positions), ("d_model", d_model), ("start", start)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"expected {name} to be an int, got {type(value).__name__}")
    if num_positions < 0:
        raise ValueError(f"expected num_positions >= 0, got {num_positions}")
    if d_model < 1:
        raise ValueError(f"expected d_model >= 1, got {d_model}")
    if start < 0:
        raise ValueError(f"expected start >= 0, got {start}")
    if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1):
        raise ValueError(f"expected base to be a finite number > 1, got {base!r}")
    dt = parameter_dtype(dtype)
    position = np.arange(start, start + num_positions, dtype=np.float64)[:, None]  # (P, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)  # (ceil(d/2),)
    inv_freq = np.exp(two_i * (-math.log(base) / d_model))  # base^(-2i/d)
    angles = position * inv_freq  # (P, ceil(d/2))
    table = np.empty((num_positions, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return table.astype(dt)
