"""Ctrl+C, remembered: the record behind the command line's exit 130.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread happens
to be, and a few places lose it: C code that clears errors (a dict lookup that calls a
Python `__eq__`), a library's `except BaseException`, Python wrapping it in another
error while a class is built. A command that must stop on Ctrl+C (a server) asks this
record instead of trusting the exception to arrive.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

_received: list[int] = []
_python_unraisable_hook = sys.unraisablehook


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    raise KeyboardInterrupt


def _unraisable(info: Any) -> None:
    """A Ctrl+C that lands in code Python cannot raise from (a weakref callback such as the
    import system's module-lock one, a __del__) is printed as "Exception ignored" with a
    traceback; it is recorded already, and the command exits 130 by the record: say nothing."""
    if isinstance(info.exc_value, KeyboardInterrupt) and _received:
        return
    _python_unraisable_hook(info)


def install() -> None:
    """Take SIGINT where Python's own handler has it: note it, then raise as Python does.
    (A background job that inherited SIGINT ignored keeps ignoring it.)"""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        sys.unraisablehook = _unraisable


def note(signum: int = signal.SIGINT) -> None:
    """Record a Ctrl+C taken by another handler (the server's)."""
    _received.append(signum)


def received() -> bool:
    """Whether Ctrl+C reached this process since the command line started."""
    return bool(_received)


def caused(error: BaseException) -> bool:
    """Whether `error` came of Ctrl+C: a KeyboardInterrupt among its causes (Python wraps
    one raised while a class is built, in `__set_name__`, in a RuntimeError with the
    interrupt as its cause: rich's dataclasses as the commands load), or any error once
    this record holds a Ctrl+C (a library may turn the interrupt into an error of its own
    that keeps only its text: pydantic-core's SchemaError, when Ctrl+C lands while a
    model's validator is built as the server's commands load)."""
    if received():
        return True
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False
