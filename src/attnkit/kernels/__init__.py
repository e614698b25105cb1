"""Compiled hot loops: each kernel beside the NumPy function it replaces.

The NumPy core (`attnkit.functional`, `attnkit.nn`, `attnkit.models`) is the reference:
readable, exact, and what runs when numba is not installed. A kernel here is the same
computation written as plain Python loops and compiled by numba (`pip install
'attnkit[fast]'`), checked against its NumPy reference within the project's error budget
(docs/kernels.md derives it).

Which path runs:

- `enabled()` is True when numba imports and `ATTNKIT_KERNELS` is not "numpy".
  `ATTNKIT_KERNELS=numpy` forces the NumPy reference everywhere (read once per process);
  "numba" and "auto" (or unset) let the kernels run; any other value is a ValueError
  naming the allowed values and what arrived (`setting()`, which the command line checks
  before any command runs).
- numba installed but broken (its import fails): the first use of the loops tries the
  import, gets the NumPy reference instead, and from then on `enabled()` is False and
  `reason_disabled()` says why. `enabled()` itself does not import numba (slow next to a
  short command, which never pays it), so before that first use it answers from the installation.
- The decoder's kernels (quantized products, the decode step) also run from a native
  library built once per version and CPU (`attnkit.kernels.native`): a process that
  finds it never imports numba. `ATTNKIT_KERNELS=numba` runs them in-process instead.
- A caller asks `enabled()` and takes the kernel or the reference; it never imports numba
  itself. `notice()` gives the one line a command shows when it would be faster with numba.
- Compiled code is cached on disk under the user's cache folder, in a folder named by a
  digest of this package's sources (`NUMBA_CACHE_DIR`, set before numba is first imported;
  a user's own setting wins): numba checks only the file a cached function was written in,
  and a kernel here calls kernels of other files (the decode step calls the products), so
  a change to any of them must start a fresh cache. When that folder cannot be made,
  numba's own cache beside the package is used.

This layer imports only `attnkit.runtime` (and numba, lazily).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

__all__ = ["SETTINGS", "enabled", "loadable", "numba", "notice", "reason_disabled", "setting"]

_FORCE_VARIABLE = "ATTNKIT_KERNELS"
SETTINGS = ("auto", "numba", "numpy")
"""The values ATTNKIT_KERNELS takes (case and surrounding spaces ignored; unset or empty is "auto")."""


def _cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnkit" / "numba"


def _sources_digest() -> str:
    """A digest of the compiled code's source files: this package's (native/ included) and
    attnkit.quant's, whose loops the kernels here call."""
    digest = hashlib.sha1()
    here = Path(__file__).parent
    for path in sorted([*here.rglob("*.py"), *here.rglob("*.c"), *(here.parent / "quant").glob("*.py")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _prepare_cache() -> None:
    """Point numba's cache at this version's folder under the user's cache folder (numba
    reads NUMBA_CACHE_DIR when first imported; if something imported it earlier, its
    config is set too). Folders of other versions unused for a week are removed."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    folder = _cache_folder() / _sources_digest()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    os.environ["NUMBA_CACHE_DIR"] = str(folder)
    config = sys.modules.get("numba.core.config")
    if config is not None:
        config.CACHE_DIR = str(folder)
    _remove_old_caches(folder)


def _remove_old_caches(keep: Path, days: float = 7.0) -> None:
    import shutil
    import time

    for other in keep.parent.iterdir():
        try:
            if other != keep and other.is_dir() and time.time() - other.stat().st_mtime > days * 86400:
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            pass


def setting() -> str:
    """The ATTNKIT_KERNELS setting, checked: one of SETTINGS ("auto" when unset or empty).

    Raises:
        ValueError: any other value, naming the allowed ones and what arrived.
    """
    raw = os.environ.get(_FORCE_VARIABLE, "")
    choice = raw.strip().lower() or "auto"
    if choice not in SETTINGS:
        raise ValueError(f"expected {_FORCE_VARIABLE} to be one of {', '.join(SETTINGS)} or unset, got {raw!r}")
    return choice


@lru_cache(maxsize=None)
def _choice() -> str:
    """Why the NumPy reference runs, or '' when the kernels may: answered without importing
    numba (its import is slow next to a short command, which never pays it). A ValueError for
    an ATTNKIT_KERNELS outside SETTINGS (not cached: asked again, it is read again)."""
    if setting() == "numpy":
        return f"{_FORCE_VARIABLE}=numpy"
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
    except Exception as error:  # installed but broken (e.g. a NumPy it does not support; any error its import raises)
        return None, f"numba does not import ({type(error).__name__}: {error})"
    return numba, ""


def reason_disabled() -> str:
    """Why the NumPy reference runs ('' when the kernels run): once numba was imported, the
    outcome of that import; before, what can be told without importing it."""
    return _import()[1] if _import.cache_info().currsize else _choice()


def enabled() -> bool:
    """Whether the compiled kernels run (numba is installed and ATTNKIT_KERNELS is not
    "numpy"). Does not import numba; a numba that then fails to import (`loadable()`, the
    loops' first use) turns this False. Never raises, but for an ATTNKIT_KERNELS outside
    SETTINGS (ValueError)."""
    return not reason_disabled()


def loadable() -> bool:
    """Whether the compiled kernels run, numba imported to know (once per process; a
    failed import makes `enabled()` False from then on, with the reason, and never
    raises). What a caller asks just before it would load the loops."""
    if _choice():
        return False
    return _import()[0] is not None


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
