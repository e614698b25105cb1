"""attnkit: attention from first principles to production.

The NumPy core lives in `attnkit.functional` (its main names are re-exported
here), modules in `attnkit.nn`, real checkpoints in `attnkit.models`, views in
`attnkit.viz`, and the PyTorch side in `attnkit.torch` (optional extra).
`attnkit.nn`, `attnkit.models` and `attnkit.viz` are attributes of the package
that load on first use (PEP 562), like `torch.nn` after `import torch`.
Importing attnkit never imports torch, matplotlib or a web framework.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from attnkit import masks
from attnkit.functional import (
    ATTENTION_BACKENDS,
    AttentionGrads,
    AttentionOutput,
    AttentionState,
    flash_attention,
    flash_attention_backward,
    get_attention,
    merge_attention_states,
    log_softmax,
    register_attention,
    logsumexp,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    softmax,
    varlen_attention,
)

# Subpackages reachable as attributes, imported on first access.
_SUBMODULES = ("nn", "models", "viz")
# Names from those subpackages, also imported on first access.
_LAZY_NAMES = {"record_attention": "attnkit.nn.interface"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
        globals()[name] = value
        return value
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
    return importlib.import_module(f"attnkit.{name}")  # also sets it as an attribute of this package


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_SUBMODULES) + list(_LAZY_NAMES))


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionGrads",
    "AttentionOutput",
    "AttentionState",
    "flash_attention",
    "flash_attention_backward",
    "merge_attention_states",
    "get_attention",
    "log_softmax",
    "logsumexp",
    "masks",
    "record_attention",
    "register_attention",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "softmax",
    "varlen_attention",
]
