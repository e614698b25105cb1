"""Moved to `attnkit.serve.http_checks`; this path works until attnkit 0.3.0 (see CHANGELOG.md)."""

import warnings
from typing import Any

warnings.warn(
    "attnkit.viz.http_checks moved to attnkit.serve.http_checks; the old path goes in attnkit 0.3.0",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    from attnkit.serve import http_checks

    return getattr(http_checks, name)
