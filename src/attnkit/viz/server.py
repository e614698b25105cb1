"""Moved to `attnkit.serve.server`; this path works until attnkit 0.3.0 (see CHANGELOG.md)."""

import importlib
import warnings
from typing import Any

warnings.warn(
    "attnkit.viz.server moved to attnkit.serve.server; the old path goes in attnkit 0.3.0",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(importlib.import_module("attnkit.serve.server"), name)  # by name: serve sits above viz
