"""Sliding-window attention layers (Mistral's and Qwen2's `sliding_window`), on float weights
and on a GGUF's quantized blocks.

A query sees its last `window` keys, itself included: key j is seen from position i when
i - window < j <= i. The attention call gets attnkit's `window=window - 1` keys to the
left, aligned bottom-right like the causal band. The cache keeps every key; the band
excludes the old ones exactly (weight 0). The compiled decode step
(`attnkit.models.llama.fused`) reads `window` from the layer and attends over the same keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnkit.nn.decoder_layers import CausalSelfAttention
from attnkit.quant.layers import QuantizedCausalSelfAttention

__all__ = ["QuantizedSlidingWindowSelfAttention", "SlidingWindowSelfAttention"]


def _checked(window: Any) -> int:
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"expected window to be a positive int, got {window!r}")
    return int(window)


class _Band:
    """The band of a sliding-window layer over its base class's attention."""

    window: int

    def attend(self, query, key, value, **options):
        return super().attend(query, key, value, window=self.window - 1, **options)  # type: ignore[misc]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"  # type: ignore[misc]


class SlidingWindowSelfAttention(_Band, CausalSelfAttention):
    """`CausalSelfAttention` whose queries see only their last `window` keys, themselves
    included (see the module docstring). Arguments: `CausalSelfAttention`'s, and `window`."""

    def __init__(self, *args: Any, window: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window = _checked(window)


class QuantizedSlidingWindowSelfAttention(_Band, QuantizedCausalSelfAttention):
    """`QuantizedCausalSelfAttention` (projections on a GGUF's blocks) whose queries see only
    their last `window` keys, themselves included. Arguments: `QuantizedCausalSelfAttention`'s,
    and `window`."""

    def __init__(self, *args: Any, window: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window = _checked(window)
