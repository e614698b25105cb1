"""Compiled hot loops: each kernel beside the NumPy function it replaces.

The NumPy core (`attnkit.functional`, `attnkit.nn`, `attnkit.models`) is the reference:
readable, exact, and what runs when numba is not installed. A kernel here is the same
computation written as plain Python loops and compiled by numba (`pip install
'attnkit[fast]'`), checked against its NumPy reference within the project's error budget
(docs/kernels.md derives it).

Which path runs:

- `enabled()` is True when numba imports and `ATTNKIT_KERNELS` is not "numpy".
  `ATTNKIT_KERNELS=numpy` forces the NumPy reference everywhere (read once per process).
- A caller asks `enabled()` and takes the kernel or the reference; it never imports numba
  itself. `notice()` gives the one line a command shows when it would be faster with numba.
- Compiled code is cached on disk: numba's own cache beside the package, or, when that
  folder is not writable, `NUMBA_CACHE_DIR` under the user's cache folder (set before numba
  is first imported; a user's own setting wins).

This layer imports only `attnkit.runtime` (and numba, lazily).
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from types import ModuleType

__all__ = ["enabled", "numba", "notice", "reason_disabled"]

_FORCE_VARIABLE = "ATTNKIT_KERNELS"


def _cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnkit" / "numba"


def _prepare_cache() -> None:
    """Point numba's cache at a writable folder when the package folder is not writable."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    if os.access(Path(__file__).parent, os.W_OK):
        return
    folder = _cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    os.environ["NUMBA_CACHE_DIR"] = str(folder)


@lru_cache(maxsize=None)
def _choice() -> str:
    """Why the NumPy reference runs, or '' when the kernels may: answered without importing
    numba (its import costs about 0.6 s; a short command never pays it)."""
    choice = os.environ.get(_FORCE_VARIABLE, "").strip().lower()
    if choice == "numpy":
        return f"{_FORCE_VARIABLE}=numpy"
    if choice not in ("", "numba", "auto"):
        raise ValueError(f"{_FORCE_VARIABLE} must be 'numpy', 'numba' or unset, got {choice!r}")
    if importlib.util.find_spec("numba") is None:
        return "numba is not installed"
    return ""


@lru_cache(maxsize=None)
def _import() -> tuple[ModuleType | None, str]:
    """numba imported (once), or None and the reason."""
    reason = _choice()
    if reason:
        return None, reason
    _prepare_cache()
    try:
        import numba
    except ImportError as error:  # installed but broken (e.g. a NumPy it does not support)
        return None, f"numba does not import ({error})"
    return numba, ""


def reason_disabled() -> str:
    """Why the NumPy reference runs ('' when the kernels run): once numba was imported, the
    outcome of that import; before, what can be told without importing it."""
    return _import()[1] if _import.cache_info().currsize else _choice()


def enabled() -> bool:
    """Whether the compiled kernels run (numba is installed and ATTNKIT_KERNELS is not
    "numpy"). Does not import numba; a numba that then fails to import turns this False."""
    return not reason_disabled()


def numba() -> ModuleType:
    """The numba module, imported on first call (only call when `enabled()`)."""
    module, reason = _import()
    if module is None:
        raise RuntimeError(f"compiled kernels are off: {reason}")
    return module


def notice(what: str) -> str:
    """The one line a command shows when `what` would run faster with the kernels, or ''
    when they run (or were switched off on purpose with ATTNKIT_KERNELS=numpy)."""
    reason = reason_disabled()
    if not reason or reason.startswith(_FORCE_VARIABLE):
        return ""
    return f"{what} runs on the NumPy reference ({reason}); pip install 'attnkit[fast]' makes it faster"
