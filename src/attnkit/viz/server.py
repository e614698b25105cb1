"""Moved to `attnkit.serve.server`; this path works until attnkit 0.3.0 (see CHANGELOG.md)."""

import warnings
from typing import Any

warnings.warn(
    "attnkit.viz.server moved to attnkit.serve.server; the old path goes in attnkit 0.3.0",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    from attnkit.serve import server

    return getattr(server, name)
