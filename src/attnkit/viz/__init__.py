"""Views of attention: terminal heatmaps, PNG, a self-contained HTML file, a notebook view.

Every view draws an `AttentionMaps` (tokens + weights of shape
(layers, heads, T, T)); providers (`get_provider("minilm")`) compute one from
a text. In Jupyter, `head_view(...)` and `model_view(...)` render inline. matplotlib
(PNG) is imported only when its functions are first used: `import attnkit.viz` stays
light. The local web app that serves these views is `attnkit.serve` (`create_app` and
`BackgroundServer` here are its old spellings, with a DeprecationWarning, until 0.3.0).
"""

from __future__ import annotations

import importlib
from typing import Any

from attnkit.viz.data import AttentionMaps, maps_from_random_model
from attnkit.viz.summary import HeadSummary, pattern_difference, summarize_heads

_LAZY = {
    "heatmap": "terminal",
    "maps_heatmap": "terminal",
    "summary_table": "terminal",
    "save_head_png": "png",
    "save_grid_png": "png",
    "render_html": "html",
    "save_html": "html",
    "create_app": "server",  # the old spelling of attnkit.serve.create_app (the shim warns)
    "BackgroundServer": "server",  # the old spelling of attnkit.serve.BackgroundServer
    "head_view": "notebook",
    "model_view": "notebook",
    "NotebookView": "notebook",
    "get_provider": "providers",
    "ModelNotAvailableError": "providers",
    "PROVIDERS": "providers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnkit.viz' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"attnkit.viz.{module}"), name)
    globals()[name] = value
    return value


_MOVED = ("create_app", "BackgroundServer")  # resolvable until 0.3.0, no longer advertised

__all__ = [
    "AttentionMaps",
    "HeadSummary",
    "maps_from_random_model",
    "pattern_difference",
    "summarize_heads",
    *(name for name in _LAZY if name not in _MOVED),
]
