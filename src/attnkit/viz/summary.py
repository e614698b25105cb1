"""What each head does, in four numbers.

For every layer and head: how much weight goes to the previous token, to the
first token, to the token itself, and how spread out the weights are (entropy).
The first query row is left out of the three position scores because it has
no previous token, and in a causal model it can only attend to itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attnkit.viz.data import AttentionMaps

PATTERNS = ("previous", "first", "self")
"""The patterns a head can be named after (plus 'broad' and 'mixed')."""


class HeadSummary(NamedTuple):
    """Per-head scores, each of shape (layers, heads).

    previous, first, self: mean weight that a query puts on the token before it,
        on token 0, and on itself (rows 1..T-1; row 0 when T == 1).
    entropy: mean row entropy in bits.
    max_entropy: mean over rows of log2(number of tokens that row may attend to),
        the entropy of uniform attention.
    pattern: the dominant pattern of each head as a string: 'previous', 'first' or
        'self' when that score is at least `threshold`, 'broad' when the entropy is
        at least 80% of max_entropy, else 'mixed'.
    """

    previous: np.ndarray
    first: np.ndarray
    self: np.ndarray
    entropy: np.ndarray
    max_entropy: np.ndarray
    pattern: np.ndarray


def summarize_heads(maps: AttentionMaps, threshold: float = 0.5) -> HeadSummary:
    """Score every head of `maps` (see `HeadSummary`)."""
    T = maps.num_tokens
    Ly, H = maps.num_layers, maps.num_heads
    rows = np.arange(1, T) if T > 1 else np.arange(1)
    previous, first, self_, entropy = (np.zeros((Ly, H)) for _ in range(4))
    for layer in range(Ly):  # one layer at a time: 512 tokens x 30 layers stay small
        w = np.asarray(maps.weights[layer], dtype=np.float64)  # (H, T, T)
        if T > 1:
            previous[layer] = w[:, rows, rows - 1].mean(axis=-1)
        first[layer] = w[:, rows, 0].mean(axis=-1)
        self_[layer] = w[:, rows, rows].mean(axis=-1)
        positive = w > 0
        log_w = np.log2(w, out=np.zeros_like(w), where=positive)  # 0 log 0 = 0
        entropy[layer] = -np.einsum("hij,hij->h", w, log_w) / T
    if maps.causal:
        allowed = np.arange(1, T + 1)  # query i may attend to i + 1 keys
    else:
        allowed = np.full(T, T)
    max_entropy = np.full((Ly, H), np.log2(allowed).mean())

    scores = np.stack([previous, first, self_])  # (3, Ly, H)
    best = scores.argmax(axis=0)
    pattern = np.empty(previous.shape, dtype=object)
    for idx in np.ndindex(previous.shape):
        if scores[(best[idx],) + idx] >= threshold:
            pattern[idx] = PATTERNS[best[idx]]
        elif max_entropy[idx] > 0 and entropy[idx] >= 0.8 * max_entropy[idx]:
            pattern[idx] = "broad"
        else:
            pattern[idx] = "mixed"
    return HeadSummary(previous, first, self_, entropy, max_entropy, pattern)


def pattern_difference(a: AttentionMaps, b: AttentionMaps) -> np.ndarray:
    """How differently each head attends on two texts, in [0, 1], shape (layers, heads).

    When both texts have the same number of tokens this is the mean total
    variation distance between matching rows (half the L1 distance; 0 = same
    weights, 1 = disjoint). Otherwise rows cannot be matched, and it is the
    largest difference of the length-free scores: previous, first, self and
    entropy / max_entropy.
    """
    if a.weights.shape[:2] != b.weights.shape[:2]:
        raise ValueError(
            "expected maps from the same model, got (layers, heads) "
            f"{a.weights.shape[:2]} and {b.weights.shape[:2]}"
        )
    if a.num_tokens == b.num_tokens:
        diff = np.abs(a.weights.astype(np.float64) - b.weights.astype(np.float64))
        return 0.5 * diff.sum(axis=-1).mean(axis=-1)
    sa, sb = summarize_heads(a), summarize_heads(b)

    def normalized(s: HeadSummary) -> np.ndarray:
        return np.where(s.max_entropy > 0, s.entropy / np.where(s.max_entropy > 0, s.max_entropy, 1), 0)

    parts = [
        np.abs(sa.previous - sb.previous),
        np.abs(sa.first - sb.first),
        np.abs(sa.self - sb.self),
        np.abs(normalized(sa) - normalized(sb)),
    ]
    return np.max(parts, axis=0)
