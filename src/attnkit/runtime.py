"""The machine attnkit runs on: how many CPUs, BLAS threads, and the optional packages.

- `cpu_count()`: the CPUs this process may use (its affinity mask on Linux,
  which a container or `taskset` narrows; `os.cpu_count()` elsewhere). The
  default thread count of `flash_attention`, `SentenceEncoder` and the benchmarks.
- `one_blas_thread()`: a context in which BLAS (OpenBLAS, MKL, ...) runs on one
  thread, restored on exit (threadpoolctl); `blas_threads(n)` on n threads. Used
  wherever attnkit spreads work over its own threads, so that the two thread
  pools do not fight over the cores, and for decode steps, whose matrix-vector
  products a second BLAS thread slows down on a busy machine.
- `require(module, extra, purpose)`: import an optional package, or raise
  `MissingExtraError` naming the pip extra that installs it
  (`pip install 'attnkit[png]'`). The command line prints that message as its
  one error line.

Nothing here is imported eagerly: threadpoolctl loads on the first
`one_blas_thread()`, and each optional package when `require` asks for it.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import Any

__all__ = ["EXTRAS", "MissingExtraError", "blas_threads", "cpu_count", "one_blas_thread", "require"]


def cpu_count() -> int:
    """The number of CPUs this process may run on (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=1)
def _blas_controller() -> Any:
    """threadpoolctl's view of the BLAS libraries NumPy loaded, found once (finding them scans
    the process's libraries)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def one_blas_thread() -> Any:
    """A context manager in which BLAS runs single-threaded; leaving it restores the limits.

        with one_blas_thread():
            ...  # matrix products here use one BLAS thread
    """
    return _blas_controller().limit(limits=1)


def blas_threads(n: int) -> Any:
    """A context manager in which BLAS runs on `n` threads; leaving it restores the
    limits. `blas_threads(1)` is `one_blas_thread()`."""
    return _blas_controller().limit(limits=int(n))


# ----------------------------------------------------------------------------- optional packages

EXTRAS: dict[str, tuple[str, ...]] = {
    "gguf": ("gguf",),
    "chat": ("jinja2", "prompt_toolkit"),
    "png": ("matplotlib",),
    "serve": ("fastapi", "uvicorn"),
    "torch": ("torch",),
    "hf": ("transformers", "torch"),
}
"""pip extra -> the packages it brings (pyproject.toml's optional-dependencies, by import name)."""


class MissingExtraError(ImportError):
    """An optional package is not installed. The message names the pip extra that installs it."""


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
        raise MissingExtraError(
            f"{purpose} needs the package {error.name or module!r}, which is not installed; "
            f"install it with: pip install 'attnkit[{extra}]'",
            name=error.name or module,
        ) from None
