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
from typing import TYPE_CHECKING, Any

from attnkit.deprecation import MovedModules

__version__ = "0.1.0"

# Module paths that moved in 0.2, importable until 0.3.0 with a DeprecationWarning
# (CHANGELOG.md): old path -> (the module given in its place, the new home the warning
# names). The table lives here, at the top, so that no module points up at the layer its
# names moved to; nothing is imported until an old path is.
MOVED_MODULES = MovedModules({
    **{f"attnkit.viz.{name}": (f"attnkit.serve.{name}", f"attnkit.serve.{name}")
       for name in ("server", "openai_api", "openai_models", "openai_requests", "http_checks")},
    "attnkit.kernels.quant": ("attnkit.quant._kernels_quant", "attnkit.quant"),
    "attnkit.kernels.decode": ("attnkit.models.llama._kernels_decode", "attnkit.models.llama.step"),
}).install()

# Every public name loads on first use (PEP 562), so `import attnkit` costs nothing
# until something is used: the command line can take Ctrl+C from its first line on.
# public name -> the submodule (under attnkit) that defines it
_LAZY = {
    "ATTENTION_BACKENDS": "functional",
    "AttentionGrads": "functional",
    "AttentionOutput": "functional",
    "AttentionState": "functional",
    "flash_attention": "functional",
    "flash_attention_backward": "functional",
    "get_attention": "functional",
    "merge_attention_states": "functional",
    "log_softmax": "functional",
    "register_attention": "functional",
    "logsumexp": "functional",
    "scaled_dot_product_attention": "functional",
    "scaled_dot_product_attention_backward": "functional",
    "softmax": "functional",
    "varlen_attention": "functional",
    "record_attention": "nn.interface",
}
# Subpackages reachable as attributes, imported on first access.
_SUBMODULES = ("functional", "masks", "nn", "models", "interpret", "viz")

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ loads these
    from attnkit import functional, interpret, masks, models, nn, viz  # noqa: F401
    from attnkit.functional import (  # noqa: F401
        ATTENTION_BACKENDS,
        AttentionGrads,
        AttentionOutput,
        AttentionState,
        flash_attention,
        flash_attention_backward,
        get_attention,
        log_softmax,
        logsumexp,
        merge_attention_states,
        register_attention,
        scaled_dot_product_attention,
        scaled_dot_product_attention_backward,
        softmax,
        varlen_attention,
    )
    from attnkit.nn.interface import record_attention  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"attnkit.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
    return importlib.import_module(f"attnkit.{name}")  # also sets it as an attribute of this package


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_SUBMODULES) + list(_LAZY))


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
