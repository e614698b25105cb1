"""The `attnkit` command line. The only part of attnkit that prints.

Each feature's commands live in their own module and register on the shared
Typer app when imported below.
"""

from __future__ import annotations

from attnkit.cli._app import app

# Command modules: each registers its commands on `app` when imported.
from attnkit.cli import demo  # noqa: F401,E402
from attnkit.cli import bench  # noqa: F401,E402
from attnkit.cli import embed  # noqa: F401,E402
from attnkit.cli import viz  # noqa: F401,E402
from attnkit.cli import train  # noqa: F401,E402
from attnkit.cli import generate  # noqa: F401,E402
from attnkit.cli import chat  # noqa: F401,E402
from attnkit.cli import models  # noqa: F401,E402


def main() -> None:
    app()


__all__ = ["app", "main"]
