"""The decode kernels as a native library: built once, then loaded without numba.

numba compiles a kernel when a process first calls it, and even from its on-disk cache it
starts LLVM to load the code: about 150 MB of memory and a second, in every process, before
the first token. The kernels a quantized model's `generate` runs (the decode step, the
decode products, the prefill's tile dequantization) are therefore also built ahead of time
as shared libraries:

- each is an *entry* `entry(frame, part)`: `frame` the address of the entry's frame (a
  record with named fields, its layout the entry's module's to define), `part` which share
  of the work this call does;
- numba compiles each entry as a C callback (`numba.cfunc`), llvmlite emits it as a
  position-independent object (`build.py`), and the system's C compiler links the objects
  with the C runtime shipped beside this file (`runtime.c`: memory for the scratch arrays,
  the platform's yield; numba's error paths, which the entries never take, abort);
- the library is kept under the user's cache folder (`~/.cache/attnkit/native/`), named by
  a digest of the kernels' sources, numba's and llvmlite's versions and the CPU, and later
  processes load it with ctypes: numba is not imported and LLVM never starts. A SHA-256 of
  the library is kept beside it: a library whose bytes changed is rebuilt (a warning says
  so). A build removes the folders no process loaded for a week.

`entries(name, sources)` gives a module's entries as ctypes functions; they release the GIL
while they run. Off Linux on x86-64, when no C compiler is found or a build fails (a
`NativeKernelsWarning`), or with ATTNKIT_KERNELS=numba, the same entries run as numba's
in-process callbacks. When numba does not import at all, `entries` raises `Unavailable`
and the caller runs the NumPy reference.

The library never prints. What a build does is told to the callback of `reporting(...)`,
scoped to the calling thread or task, as `BuildEvent`s: "start" (with an estimate, before
any work), then "built", "loaded" (another process built it meanwhile), "rebuilt" or
"failed". `build_needed()` says beforehand whether a call would build (the command line
shows a notice and progress then; `attnkit.cli.generate`).
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, NamedTuple

from attnkit import kernels
from attnkit.kernels.native.build import FASTMATH, SIGNATURE, Damaged, build_locked, compiler, library_path, load
from attnkit.kernels.native.intrinsics import helpers, pointer

__all__ = ["FASTMATH", "LIBRARIES", "BuildEvent", "Entries", "NativeKernelsWarning", "Unavailable", "build_needed",
           "entries", "helpers", "in_process", "library_path", "pointer", "reporting"]

LIBRARIES = ("quant", "decode")
"""The libraries a quantized decoder's `generate` loads: the products (`attnkit.quant`)
and the decode step."""
DEFAULT_ESTIMATE_S = 20.0
"""A library's build time, in seconds, assumed before one was measured here (a round
figure above the builds seen; docs/benchmarks.md)."""

Entry = Callable[[int, int], None]
Sources = Callable[[], dict]  # () -> {entry name: Python function}, its globals bound for numba


class Entries(dict):
    """name -> entry(frame address, part), and where they come from (`route`)."""

    route: str = ""


class Unavailable(RuntimeError):
    """The compiled kernels cannot run in this process (numba does not import, or they are
    off): the caller runs the NumPy reference."""


class NativeKernelsWarning(RuntimeWarning):
    """The native library could not be built or loaded as it was (numba runs the entries)."""


class BuildEvent(NamedTuple):
    """What a build is doing, for `reporting`'s callback.

    stage: "start" (before any work; `seconds` the estimate), "built", "loaded" (another
        process built it while this one waited), "rebuilt" (it was damaged) or "failed"
        (`detail` says why; numba's callbacks run instead); then `seconds` it took.
    library: its name ("quant", "decode"); detail: the folder, or the reason.
    """

    stage: str
    library: str
    seconds: float
    detail: str = ""


_REPORTER: ContextVar[Callable[[BuildEvent], None] | None] = ContextVar("attnkit.kernels.native.reporter",
                                                                        default=None)


@contextmanager
def reporting(callback: Callable[[BuildEvent], None]) -> Iterator[None]:
    """Within the block (this thread or task), builds tell `callback` what they do."""
    token = _REPORTER.set(callback)
    try:
        yield
    finally:
        _REPORTER.reset(token)


def _report(stage: str, library: str, seconds: float, detail: str = "") -> None:
    callback = _REPORTER.get()
    if callback is not None:
        callback(BuildEvent(stage, library, seconds, detail))


def _native_route() -> bool:
    return os.environ.get(kernels._FORCE_VARIABLE, "").strip().lower() != "numba"


def build_needed(names: tuple[str, ...] = LIBRARIES) -> bool:
    """Whether loading `names` would build a library now: the kernels may run, the library
    route is on, a C compiler is found and one of them is not on disk. Never imports numba."""
    if _loaded.keys() >= set(names) or not kernels.enabled() or not _native_route() or compiler() is None:
        return False
    return any(not library_path(name).exists() for name in names if name not in _loaded)


def estimate(name: str) -> float:
    """Seconds the last build of `name` took here (`DEFAULT_ESTIMATE_S` before one did)."""
    try:
        return float(json.loads(_timings_path().read_text())[name])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_ESTIMATE_S


def _timings_path():
    return library_path("quant").parent.parent / "build-seconds.json"


def _remember(name: str, seconds: float) -> None:
    path = _timings_path()
    try:
        timings = json.loads(path.read_text())
    except (OSError, ValueError):
        timings = {}
    try:
        timings[name] = round(seconds, 1)
        path.write_text(json.dumps(timings))
    except (OSError, TypeError):
        pass


def _callbacks(sources: Sources, cache: bool) -> dict:
    """The entries compiled by numba as C callbacks."""
    nb = kernels.numba()
    return {name: nb.cfunc(SIGNATURE, cache=cache, fastmath=FASTMATH, error_model="numpy")(fn)
            for name, fn in sources().items()}


def in_process(sources: Sources) -> Entries:
    """The entries as numba's in-process C callbacks (cached on disk by numba)."""
    found = Entries()
    for name, callback in _callbacks(sources, cache=True).items():
        found[name] = callback.ctypes
    found.route = "in-process"
    return found


def _from_library(target) -> Entries:
    library, functions = load(target)
    found = Entries(functions)
    found.route = "library"
    found.library = library  # kept alive with the functions
    return found


_loaded: dict[str, Entries] = {}
_loading = threading.Lock()


def entries(name: str, sources: Sources) -> Entries:
    """The entries of library `name` (see the module docstring): the library when it was
    built for this version and CPU (built now, once, when a C compiler is found), else
    numba's in-process callbacks. `sources` gives the entries' Python functions (only
    called to compile them).

    Raises:
        Unavailable: the compiled kernels cannot run here (off, or numba does not import).
    """
    found = _loaded.get(name)
    if found is not None:
        return found
    with _loading:
        if name not in _loaded:
            _loaded[name] = _entries(name, sources)
        return _loaded[name]


def _unavailable() -> Unavailable:
    return Unavailable(f"compiled kernels are off: {kernels.reason_disabled()}")


def _entries(name: str, sources: Sources) -> Entries:
    if not kernels.enabled():
        raise _unavailable()
    target = library_path(name)
    if _native_route():
        damaged = ""
        if target.exists() or target.with_suffix(".json").exists():
            try:
                return _from_library(target)
            except Damaged as error:
                damaged = str(error)
        cc = compiler()
        if cc is not None:
            try:
                kernels.numba()  # a numba that does not import builds nothing: say nothing of a build
            except RuntimeError as error:
                raise _unavailable() from error
            _report("start", name, estimate(name), str(target.parent))
            started = time.perf_counter()
            try:
                how = build_locked(target, lambda: _callbacks(sources, cache=False), cc)
                found = _from_library(target)
            except (OSError, RuntimeError, Damaged) as error:
                seconds = time.perf_counter() - started
                if not kernels.enabled():  # numba did not import: no route but the reference
                    _report("failed", name, seconds, kernels.reason_disabled())
                    raise _unavailable() from error
                _report("failed", name, seconds, str(error))
                warnings.warn(f"attnkit: the native kernels could not be built ({error}); numba runs them in-process",
                              NativeKernelsWarning, stacklevel=3)
            else:
                seconds = time.perf_counter() - started
                if damaged:
                    warnings.warn(f"attnkit: the native kernels' library was damaged ({damaged}): rebuilt it",
                                  NativeKernelsWarning, stacklevel=3)
                    how = "rebuilt"
                if how != "loaded":
                    _remember(name, seconds)
                _report(how, name, seconds, str(target.parent))
                return found
        elif damaged:
            warnings.warn(f"attnkit: the native kernels' library is damaged ({damaged}) and no C compiler rebuilds it; "
                          "numba runs them in-process", NativeKernelsWarning, stacklevel=3)
    try:
        return in_process(sources)
    except RuntimeError as error:  # numba does not import
        if kernels.enabled():
            raise
        raise _unavailable() from error


_compiler = compiler  # the old private name (tests of 0.1.0)
