"""Deprecated spellings, kept working for one release (CHANGELOG.md lists each).

- `renamed_keyword(...)`: a keyword's old spelling, still taken with a DeprecationWarning.
- `keyword_only(*names)`: parameters that became keyword-only, still taken positionally
  with a DeprecationWarning.
- `REMOVED_IN`: the release in which the old spellings stop working.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["REMOVED_IN", "keyword_only", "renamed_keyword"]

REMOVED_IN = "0.3.0"
"""The release in which a deprecated spelling stops working."""


def renamed_keyword(where: str, old: str, old_value: Any, new: str, new_value: Any, default: Any) -> Any:
    """The value of keyword `new`, taking one still passed under its old name `old`
    (`old_value` None: not passed). Warns when `old` is used; refuses both at once
    (TypeError) unless `new` kept its default."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise TypeError(f"{where}: expected {new}= alone, got both {new}= and its old spelling {old}=")
    warnings.warn(f"{where}: {old}= is deprecated, use {new}= (the old spelling goes in {REMOVED_IN})",
                  DeprecationWarning, stacklevel=3)
    return old_value


def keyword_only(*names: str) -> Callable[[Callable], Callable]:
    """Decorator for a function whose parameters `names` (in their old positional order)
    became keyword-only: a call that still passes them positionally works for one
    release, with a DeprecationWarning naming the keywords to use.

        @keyword_only("quick", "progress", "threads")
        def run(*, quick: bool, progress: Progress, threads: int | None = None): ...

        run(True, progress)  # warns: pass quick=, progress= by keyword
    """

    def decorate(fn: Callable) -> Callable:
        import inspect

        parameters = inspect.signature(fn).parameters.values()
        positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
        where = f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) > positional:
                extra = args[positional:]
                if len(extra) > len(names):
                    raise TypeError(f"{where}() takes {positional + len(names)} positional arguments at most "
                                    f"(and those after {positional} only until {REMOVED_IN}), got {len(args)}")
                given = names[: len(extra)]
                for name in given:
                    if name in kwargs:
                        raise TypeError(f"{where}() got multiple values for argument {name!r}")
                warnings.warn(f"{where}: pass {', '.join(f'{name}=' for name in given)} by keyword "
                              f"(positional arguments there stop working in {REMOVED_IN})",
                              DeprecationWarning, stacklevel=2)
                kwargs.update(zip(given, extra))
                args = args[:positional]
            return fn(*args, **kwargs)

        return call

    return decorate
