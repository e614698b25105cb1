"""The backend-neutral spec of the attention twins (attnkit.nn and attnkit.torch).

What the NumPy modules and their torch twins must agree on, written once:
argument checks and their messages, the shape checks of a call's inputs and
masks, and the `extra_repr` strings. Nothing here computes; the array type of
each side enters through a small callable (`as_input`) and through `.shape`.
NumPy only, never torch: attnkit.torch imports this module, attnkit.nn never
imports attnkit.torch.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = [
    "attention_extra_repr",
    "block_extra_repr",
    "check_attention_inputs",
    "check_attn_mask_shape",
    "check_dropout",
    "check_is_causal",
    "check_key_mask_shape",
    "feed_forward_extra_repr",
]

KEY_PADDING_HINT = "for torch's key_padding_mask (True = padding) pass ~key_padding_mask"


def check_dropout(p: float) -> float:
    """A module's dropout probability, a float in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)) or not 0.0 <= p < 1.0:
        raise ValueError(f"expected dropout to be a float in [0, 1), got {p!r}")
    return float(p)


def check_is_causal(is_causal: Any) -> None:
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"expected is_causal to be a bool, got {type(is_causal).__name__}")


def check_attention_inputs(module: Any, query: Any, key: Any, value: Any, as_input: Callable[[str, Any], Any]):
    """MultiHeadAttention's (query, key, value) checks: shapes against the module's
    d_model, kdim and vdim; key=None means self-attention. `as_input(name, x)` checks
    the array type of the backend and returns the array. Returns (query, key, value)."""
    query = as_input("query", query)
    shape = tuple(query.shape)
    if len(shape) != 3 or shape[-1] != module.d_model:
        raise ValueError(
            f"expected query of shape (B, L, d_model={module.d_model}), got {shape}"
            + ("; add a batch axis with x[None]" if len(shape) == 2 and shape[-1] == module.d_model else "")
        )
    if key is None:
        if value is not None:
            raise ValueError("got value without key; pass key too (or neither, for self-attention)")
        if module.kdim != module.d_model or module.vdim != module.d_model:
            raise ValueError(f"this module has kdim={module.kdim}, vdim={module.vdim}: pass key and value")
        return query, query, query
    key = as_input("key", key)
    value = key if value is None else as_input("value", value)
    k_shape, v_shape = tuple(key.shape), tuple(value.shape)
    if len(k_shape) != 3 or k_shape[0] != shape[0] or k_shape[-1] != module.kdim:
        raise ValueError(f"expected key of shape (B={shape[0]}, S, kdim={module.kdim}), got {k_shape}")
    if len(v_shape) != 3 or v_shape[:2] != k_shape[:2] or v_shape[-1] != module.vdim:
        raise ValueError(
            f"expected value of shape (B={k_shape[0]}, S={k_shape[1]}, vdim={module.vdim}), got {v_shape}"
        )
    return query, key, value


def check_key_mask_shape(shape: tuple[int, ...], batch: int, S: int) -> None:
    if tuple(shape) != (batch, S):
        raise ValueError(f"expected key_mask of shape (B, S) = ({batch}, {S}), got {tuple(shape)}")


def check_attn_mask_shape(shape: tuple[int, ...], batch: int, num_heads: int, L: int, S: int) -> None:
    """attn_mask is (L, S) or 4-D broadcastable to (B, H, L, S)."""
    shape = tuple(int(n) for n in shape)
    target = (batch, num_heads, L, S)
    ok = len(shape) in (2, 4)
    if ok:
        try:
            ok = np.broadcast_shapes(shape, target) == target
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(
            f"expected attn_mask of shape (L, S) = ({L}, {S}) or 4-D broadcastable to (B, H, L, S) = {target}, "
            f"got {shape}"
            + ("; torch's 3-D (B*H, L, S) masks must be reshaped to (B, H, L, S)" if len(shape) == 3 else "")
        )


def attention_extra_repr(module: Any) -> str:
    """MultiHeadAttention's extra_repr, on both sides."""
    extra = f", num_kv_heads={module.num_kv_heads}" if module.num_kv_heads != module.num_heads else ""
    if module.kdim != module.d_model or module.vdim != module.d_model:
        extra += f", kdim={module.kdim}, vdim={module.vdim}"
    return f"d_model={module.d_model}, num_heads={module.num_heads}{extra}, dropout={module.dropout}"


def block_extra_repr(module: Any) -> str:
    """TransformerBlock's extra_repr, on both sides."""
    return f"norm_first={module.norm_first}, dropout={module.dropout}"


def feed_forward_extra_repr(module: Any) -> str:
    """FeedForward's extra_repr, on both sides."""
    return f"activation={module.activation!r}, dropout={module.dropout}"
