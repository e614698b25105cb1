"""Deprecated spellings, kept working for one release (CHANGELOG.md lists each).

- `renamed_keyword(...)`: a keyword's old spelling, still taken with a DeprecationWarning.
- `keyword_only(*names)`: parameters that became keyword-only, still taken positionally
  with a DeprecationWarning.
- `MovedModules`: old module paths that still import, each giving the module that now
  holds its names, with a DeprecationWarning (the table lives in `attnkit/__init__.py`,
  above every module it names).
- `REMOVED_IN`: the release in which the old spellings stop working.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["REMOVED_IN", "MovedModules", "keyword_only", "renamed_keyword"]

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


class MovedModules:
    """An import hook (a `sys.meta_path` finder and its loader) for module paths that moved:
    `import old` still works for one release, warns (DeprecationWarning naming the new home)
    and gives the module that now holds the old module's names: the new module itself, or
    a small alias module beside it where the old one differed (old codes, say).

    Arguments:
        moved: old dotted path -> (the module to load in its place, the new home the
            warning names).

    `install()` puts the hook first on `sys.meta_path` (once: a second install of an
    equal table is a no-op). Nothing is imported until an old path is.
    """

    def __init__(self, moved: Mapping[str, tuple[str, str]]) -> None:
        for old, target in moved.items():
            if not (isinstance(old, str) and isinstance(target, tuple) and len(target) == 2
                    and all(isinstance(part, str) for part in target)):
                raise TypeError(f"expected old path -> (module, new home) strings, got {old!r}: {target!r}")
        self.moved = dict(moved)

    def install(self) -> MovedModules:
        """Put this hook first on `sys.meta_path`, unless an equal one is there; returns the one in use."""
        for finder in sys.meta_path:
            if isinstance(finder, MovedModules) and finder.moved == self.moved:
                return finder
        sys.meta_path.insert(0, self)
        return self

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moved:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        """The default module: `exec_module` puts the moved module in its place."""

    def exec_module(self, module: Any) -> None:
        """Warn, import the module that holds the old names, and make it `sys.modules[old]`
        (the import system returns what stands there after this call; the moved module's own
        `__spec__` and `__name__` stay its own)."""
        old = module.__spec__.name
        target, home = self.moved[old]
        warnings.warn(f"{old} is deprecated: use {home} (the old path goes in {REMOVED_IN})",
                      DeprecationWarning, stacklevel=2)  # the importer's line (warnings skips importlib's frames)
        sys.modules[old] = importlib.import_module(target)
