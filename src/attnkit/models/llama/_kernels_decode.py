"""What the deprecated path `attnkit.kernels.decode` gives until 0.3.0: the compiled Llama
decode step moved to `attnkit.models.llama.step` (its compiled code
`attnkit.models.llama.step_kernels`); `attnkit/__init__.py` maps the old path here, and
importing it warns. Its names resolve there on first use."""

from typing import Any

__all__ = ["FRAME", "compiled", "decode_step", "prepare", "shared_size"]


def compiled():
    """The step's compiled function (`attnkit.models.llama.step_kernels.build().step`)."""
    from attnkit.models.llama import step_kernels

    return step_kernels.build().step


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'attnkit.kernels.decode' has no attribute {name!r}")
    from attnkit.models.llama import step

    return getattr(step, name)
