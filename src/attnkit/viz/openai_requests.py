"""Moved to `attnkit.serve.openai_requests`; this path works until attnkit 0.3.0 (see CHANGELOG.md)."""

import importlib
import warnings
from typing import Any

warnings.warn(
    "attnkit.viz.openai_requests moved to attnkit.serve.openai_requests; the old path goes in attnkit 0.3.0",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(importlib.import_module("attnkit.serve.openai_requests"), name)  # by name: serve sits above viz
