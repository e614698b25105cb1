"""Optional packages: which pip extra brings which package, and `require`, which imports
one or raises `MissingExtraError` naming the extra that installs it
(`pip install 'attnkit[png]'`). The command line prints that message as its one error line.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "gguf": ("gguf", "numba"),
    "fast": ("numba",),
    "chat": ("jinja2", "prompt_toolkit"),
    "png": ("matplotlib",),
    "serve": ("fastapi", "uvicorn"),
    "torch": ("torch",),
    "hf": ("transformers", "torch"),
}
"""pip extra -> the packages it brings (pyproject.toml's optional-dependencies, by import name)."""


class MissingExtraError(ImportError):
    """An optional package is not installed. The message names the pip extra that installs it."""


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""PyTorch's index of CPU-only wheels (PyPI's Linux torch bundles CUDA: about 3 GB)."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import the optional package `module`, or say which extra installs it.

    Arguments:
        module: the import name (`"matplotlib"`, `"gguf"`).
        extra: the pip extra that brings it (a key of `EXTRAS`).
        purpose: what needs it, for the message (`"PNG output"`).

    Raises:
        MissingExtraError: `module` (or a package it needs) is not installed.
    """
    assert module in EXTRAS[extra], f"{module} is not in the {extra!r} extra"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = error.name or module
        hint = ""
        if missing.split(".")[0] == "torch":  # PyPI's Linux torch is the CUDA build, about 3 GB
            hint = (" (no GPU? install the CPU build first, far smaller: "
                    f"pip install torch --index-url {TORCH_CPU_INDEX})")
        raise MissingExtraError(
            f"{purpose} needs the package {missing!r}, which is not installed; "
            f"install it with: pip install 'attnkit[{extra}]'{hint}",
            name=missing,
        ) from None
