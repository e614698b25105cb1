"""When the compiled loops start in a process: not before the work would pay for them.

Loading them costs time once per process (numba's import, then the first dispatch of
each loop, even from the on-disk cache; the figures: docs/benchmarks.md, "Measurements
behind design choices"). A short command (`attnkit show` on one sentence, a few small
flash calls) would lose that load and gain far less. So, the rule of renting
skis: the NumPy reference runs while the time the loops would have saved, summed over the
process, stays under what loading them costs; past it they load and run from then on.
That wastes at most the load time in a short process, and nothing in a long one.
`load()` starts them at once (benchmarks, tests, a server that knows it will run long).
"""

from __future__ import annotations

import sys

from attnkit.kernels import loadable

LOAD_SECONDS = 1.0
"""What starting the compiled loops costs a process, about (see the module docstring)."""

_LOOPS = "attnkit.kernels._loops"
_saved = 0.0  # seconds the loops would have saved so far (races only delay the switch by a call)


def started() -> bool:
    """Whether the compiled loops are loaded in this process."""
    return _LOOPS in sys.modules


def worth_it(elements: int, saved_ns: float) -> bool:
    """Whether a call over `elements` elements, each of which the loops would do
    `saved_ns` nanoseconds faster than NumPy, should take them: once started always,
    before that only when the savings missed so far reach LOAD_SECONDS."""
    global _saved
    if _LOOPS in sys.modules:
        return True
    _saved += elements * saved_ns * 1e-9
    return _saved >= LOAD_SECONDS


def load() -> bool:
    """Start the compiled loops now (when the kernels are on and numba imports); returns
    whether they run."""
    if not loadable():
        return False
    from attnkit.kernels import _loops  # noqa: F401  (numba loads here)

    return True
