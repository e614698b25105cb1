"""attnkit's NumPy core: pure functions, no state, no printing.

Every attention implementation here has the signature of
`scaled_dot_product_attention` and is chosen by name from `ATTENTION_BACKENDS`
(see `get_attention`), never by a chain of fast-path conditions.
"""

from __future__ import annotations

from typing import Callable

from attnkit.functional import masks
from attnkit.functional.attention import (
    AttentionGrads,
    AttentionOutput,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from attnkit.functional.softmax import log_softmax, logsumexp, softmax
from attnkit.functional import mods
from attnkit.functional.flash import (
    AttentionState,
    flash_attention,
    flash_attention_backward,
    flash_backend,
    merge_attention_states,
)
from attnkit.functional.varlen import VarlenOutput, varlen_attention

ATTENTION_BACKENDS: dict[str, Callable] = {
    "naive": scaled_dot_product_attention,
    "flash": flash_backend,
}

# Backends that never form the (L, S) weights. When weights are only wanted for
# recording (attnkit.record_attention), an attention module uses "naive" for that
# call instead, as transformers falls back to eager attention for output_attentions.
# A user-registered backend that cannot return weights belongs here too.
WEIGHTLESS_BACKENDS: set[str] = {"flash"}


def get_attention(name: str) -> Callable:
    """The attention implementation registered under `name` (e.g. "naive", "flash")."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; expected one of {sorted(ATTENTION_BACKENDS)}"
        ) from None


__all__ = [
    "ATTENTION_BACKENDS",
    "WEIGHTLESS_BACKENDS",
    "AttentionGrads",
    "AttentionOutput",
    "AttentionState",
    "VarlenOutput",
    "flash_attention",
    "flash_attention_backward",
    "merge_attention_states",
    "mods",
    "get_attention",
    "log_softmax",
    "logsumexp",
    "masks",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "softmax",
    "varlen_attention",
]
