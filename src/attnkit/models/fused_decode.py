"""Moved: when a quantized Llama's decode step runs compiled is `attnkit.models.llama.fused`
(`compiled_step_reason` says why not). This module re-exports its names until 0.3.0, with a
DeprecationWarning when imported."""

import warnings

from attnkit.models.llama.fused import compiled_step_reason, fused_logits

__all__ = ["compiled_step_reason", "fused_logits"]

warnings.warn("attnkit.models.fused_decode is deprecated: use attnkit.models.llama.fused (this module goes in 0.3.0)",
              DeprecationWarning, stacklevel=2)
