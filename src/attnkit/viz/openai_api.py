"""Moved to `attnkit.serve.openai_api`; this path works until attnkit 0.3.0 (see CHANGELOG.md)."""

import importlib
import warnings
from typing import Any

warnings.warn(
    "attnkit.viz.openai_api moved to attnkit.serve.openai_api; the old path goes in attnkit 0.3.0",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(importlib.import_module("attnkit.serve.openai_api"), name)  # by name: serve sits above viz
