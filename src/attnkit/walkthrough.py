"""The numeric walkthrough: 3 tokens, d_model = 4, 2 heads, identity projections.

With W_Q = W_K = W_V = I the projections are the input itself, so every number
can be checked by hand: head h reads columns 2h and 2h + 1 of X. This module
computes each intermediate and returns them; `attnkit walkthrough` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnkit.functional import scaled_dot_product_attention, softmax

# Three tokens with 4-dimensional embeddings, chosen so the arithmetic is small.
WALKTHROUGH_X = np.array(
    [
        [1.0, 0.0, 1.0, 0.0],  # token 0
        [0.0, 1.0, 0.0, 1.0],  # token 1
        [1.0, 1.0, 0.0, 0.0],  # token 2
    ]
)


@dataclass(frozen=True)
class HeadTrace:
    """Every intermediate of one head."""

    query: np.ndarray  # (T, d_head)
    key: np.ndarray  # (T, d_head)
    value: np.ndarray  # (T, d_head)
    scores: np.ndarray  # (T, T) query @ key^T
    scaled_scores: np.ndarray  # (T, T) scores / sqrt(d_head)
    weights: np.ndarray  # (T, T) softmax of each row
    output: np.ndarray  # (T, d_head) weights @ value


@dataclass(frozen=True)
class WalkthroughTrace:
    x: np.ndarray  # (T, d_model)
    d_head: int
    heads: tuple[HeadTrace, ...]
    concatenated: np.ndarray  # (T, d_model): the heads' outputs side by side


def walkthrough(x: np.ndarray = WALKTHROUGH_X, num_heads: int = 2) -> WalkthroughTrace:
    """Trace multi-head self-attention with identity projections, step by step.

    Arguments:
        x: (T, d_model) token embeddings.
        num_heads: must divide d_model.

    Returns:
        WalkthroughTrace with every intermediate. Its concatenation equals
        `scaled_dot_product_attention` on the split heads (checked here).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected x of shape (T, d_model), got {x.shape}")
    T, d_model = x.shape
    if num_heads < 1 or d_model % num_heads:
        raise ValueError(f"expected num_heads to divide d_model={d_model}, got {num_heads}")
    d_head = d_model // num_heads
    projected = x @ np.eye(d_model)  # Q = K = V = X @ I
    heads = []
    for h in range(num_heads):
        part = projected[:, h * d_head : (h + 1) * d_head]  # (T, d_head)
        scores = part @ part.T
        scaled = scores / np.sqrt(d_head)
        weights = softmax(scaled, axis=-1)
        heads.append(HeadTrace(part, part, part, scores, scaled, weights, weights @ part))
    concatenated = np.concatenate([h.output for h in heads], axis=-1)  # (T, d_model)

    split = projected.reshape(T, num_heads, d_head).transpose(1, 0, 2)  # (H, T, d_head)
    fused = scaled_dot_product_attention(split, split, split).transpose(1, 0, 2).reshape(T, d_model)
    assert np.allclose(fused, concatenated, rtol=1e-12, atol=1e-12)
    return WalkthroughTrace(x=x, d_head=d_head, heads=tuple(heads), concatenated=concatenated)
