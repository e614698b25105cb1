"""attnkit: attention from first principles to production.

The NumPy core lives in `attnkit.functional` (its main names are re-exported
here), modules in `attnkit.nn`, real checkpoints in `attnkit.models`, views in
`attnkit.viz`, and the PyTorch side in `attnkit.torch` (optional extra).
Importing attnkit never imports torch, matplotlib or a web framework.
"""

from __future__ import annotations

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
    logsumexp,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    softmax,
)

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
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "softmax",
]
