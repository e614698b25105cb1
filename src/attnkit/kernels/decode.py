"""Moved: the compiled Llama decode step is `attnkit.models.llama.step` (its compiled code
`attnkit.models.llama.step_kernels`). This module's names resolve there, on first use and
loaded by name (this lower layer holds no import of a higher one), until 0.3.0, with a
DeprecationWarning when imported."""

import importlib
import warnings
from typing import Any

__all__ = ["FRAME", "compiled", "decode_step", "prepare", "shared_size"]

warnings.warn("attnkit.kernels.decode is deprecated: use attnkit.models.llama.step (this module goes in 0.3.0)",
              DeprecationWarning, stacklevel=2)


def compiled():
    """The step's compiled function (`attnkit.models.llama.step_kernels.build().step`)."""
    return importlib.import_module("attnkit.models.llama.step_kernels").build().step


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'attnkit.kernels.decode' has no attribute {name!r}")
    return getattr(importlib.import_module("attnkit.models.llama.step"), name)
