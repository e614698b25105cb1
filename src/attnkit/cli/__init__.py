"""The `attnkit` command line. The only part of attnkit that prints.

Each feature's commands live in their own module and register on the shared
Typer app when imported. They load when the app is first asked for (`main()`, or
`from attnkit.cli import app`), so `main()` imports them under the command line's
Ctrl+C policy: interrupted at any point, `attnkit` exits 130 without a traceback.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from attnkit.cli import _interrupt

# Command modules: each registers its commands on `app` when imported.
_SUBMODULES = ("demo", "bench", "embed", "viz", "train", "generate", "chat", "models", "interpret")

if TYPE_CHECKING:
    from attnkit.cli._app import app


def _load_app() -> Any:
    """The Typer app with every command registered."""
    from attnkit.cli._app import app

    for name in _SUBMODULES:
        importlib.import_module(f"attnkit.cli.{name}")
    return app


def __getattr__(name: str) -> Any:
    if name == "app":
        return _load_app()
    raise AttributeError(f"module 'attnkit.cli' has no attribute {name!r}")


def main() -> None:
    _interrupt.install()
    try:
        _load_app()()
    except KeyboardInterrupt:  # Ctrl+C while the commands load or Typer builds them: 130 too
        sys.exit(130)
    except Exception as error:
        if _interrupt.caused(error):  # Ctrl+C wrapped as it landed (a class of rich's being built)
            sys.exit(130)
        raise
    finally:
        # CPython 3.11 remembers a KeyboardInterrupt that left any exec() or eval() of a
        # string (a dataclass being built as Ctrl+C landed), even once it was caught, and
        # under `python -m attnkit` then ends the process by SIGINT instead of with the
        # exit code asked for. Evaluating a string clears that memory.
        eval("None")


__all__ = ["app", "main"]
