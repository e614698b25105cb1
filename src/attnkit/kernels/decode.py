"""Moved: the compiled Llama decode step is `attnkit.models.llama.step` (its compiled code
`attnkit.models.llama.step_kernels`). This module re-exports its names until 0.3.0, with
a DeprecationWarning when imported."""

import warnings

from attnkit.models.llama.step import FRAME, decode_step, prepare, shared_size

__all__ = ["FRAME", "compiled", "decode_step", "prepare", "shared_size"]

warnings.warn("attnkit.kernels.decode is deprecated: use attnkit.models.llama.step (this module goes in 0.3.0)",
              DeprecationWarning, stacklevel=2)


def compiled():
    """The step's compiled function (`attnkit.models.llama.step_kernels.build().step`)."""
    from attnkit.models.llama.step_kernels import build

    return build().step
