"""Head detectors: which heads attend where a known kind of head would.

    score(l, h) = sum_ij A[l, h, i, j] * P[i, j] / sum_ij A[l, h, i, j]

TransformerLens's `detect_head` with its default "mul" measure and no exclusions: A is the
head's (T, T) attention pattern, whose rows sum to one (so the denominator is T), and P the
0/1 detection pattern, lower triangular:

    previous_token   P[i, i-1] = 1                          (i >= 1)
    duplicate_token  P[i, j] = 1 when ids[j] == ids[i], j < i
    induction        P[i, j] = 1 when ids[j-1] == ids[i], 1 <= j < i   (the token after an earlier copy)
    first_token      P[i, 0] = 1                            (attnkit's: attention to the first token)
    self             P[i, i] = 1                            (attnkit's: attention to the token itself)

A head scores 1 when all its weight is on the pattern. Rows without any pattern entry (the
first row for previous_token; every row without an earlier copy for duplicate and induction)
still count in the denominator, so a perfect previous-token head scores (T-1)/T, as in
TransformerLens.

`induction_scores` is the standard induction test instead: on random tokens repeated once,
the mean weight each query of the second copy puts on the token after its earlier copy.
`sink_scores` measures attention sinks (Gu et al., 2024, "When attention sink emerges").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attnkit.interpret._model import attention_maps, token_ids, vocab_size

__all__ = [
    "HEAD_PATTERNS",
    "SinkScores",
    "detect_heads",
    "detection_pattern",
    "induction_scores",
    "repeated_random_tokens",
    "sink_scores",
]

HEAD_PATTERNS = ("previous_token", "duplicate_token", "induction", "first_token", "self")
"""The detection patterns `detect_heads` knows by name."""


def detection_pattern(ids: np.ndarray, pattern: str) -> np.ndarray:
    """The detection pattern named `pattern` for a sequence.

    Arguments:
        ids: (T,) token ids (what duplicate_token and induction compare).
        pattern: a name in `HEAD_PATTERNS` (see the module docstring).

    Returns:
        (T, T) float64 of 0s and 1s, lower triangular.
    """
    ids = np.asarray(ids)
    T = len(ids)
    if pattern == "previous_token":
        return np.eye(T, k=-1)
    if pattern == "first_token":
        out = np.zeros((T, T))
        out[:, 0] = 1.0
        return out
    if pattern == "self":
        return np.eye(T)
    same = (ids[:, None] == ids[None, :]).astype(np.float64)  # (T, T) same[i, j]: ids[i] == ids[j]
    duplicate = np.tril(same, k=-1)
    if pattern == "duplicate_token":
        return duplicate
    if pattern == "induction":
        out = np.zeros((T, T))
        out[:, 1:] = duplicate[:, :-1]  # key j is right after an earlier copy j-1 of the query's token
        return np.tril(out)
    raise ValueError(f"expected pattern to be one of {', '.join(HEAD_PATTERNS)} or a (T, T) array, got {pattern!r}")


def pattern_scores(weights: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """TransformerLens's "mul" score of every head: weights (layers, heads, T, T), pattern
    (T, T) -> (layers, heads) float64 = sum(A * P) / sum(A)."""
    A = np.asarray(weights, dtype=np.float64)
    return np.einsum("lhij,ij->lh", A, pattern) / A.sum(axis=(-2, -1))


def detect_heads(model: Any, ids: Any, pattern: str | np.ndarray) -> np.ndarray:
    """How much of each head's attention follows a detection pattern.

    Arguments:
        model: an attnkit model (decoder or encoder) or a transformers model.
        ids: text (tokenized with the model's tokenizer) or a 1-D sequence of token ids, T >= 2.
        pattern: a name in `HEAD_PATTERNS`, or a (T, T) array of 0s and 1s (lower triangular
            for a decoder).

    Returns:
        (layers, heads) float64 scores in [0, 1], TransformerLens's `detect_head` numbers
        ("mul", no exclusions; see the module docstring).
    """
    ids = token_ids(model, ids)
    if len(ids) < 2:
        raise ValueError(f"expected at least 2 tokens to detect heads, got {len(ids)}")
    if isinstance(pattern, str):
        table = detection_pattern(ids, pattern)
    else:
        table = np.asarray(pattern, dtype=np.float64)
        if table.shape != (len(ids), len(ids)):
            raise ValueError(f"expected a detection pattern of shape {(len(ids), len(ids))}, got {table.shape}")
    return pattern_scores(attention_maps(model, ids), table)


def repeated_random_tokens(model: Any, length: int = 24, seed: int | np.random.Generator | None = 0) -> np.ndarray:
    """The input of the induction test: `length` random tokens, then the same tokens again.

    Arguments:
        model: the model whose vocabulary to draw from (its tokenizer's special tokens left out).
        length: tokens in each copy (>= 2).
        seed: an int or a numpy Generator.

    Returns:
        (2 * length,) int64 token ids.
    """
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 2:
        raise ValueError(f"expected length to be an int >= 2, got {length!r}")
    vocab = vocab_size(model)
    if vocab is None:
        raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__}")
    special = _special_ids(model)
    ordinary = np.setdiff1d(np.arange(vocab), np.fromiter(special, np.int64, len(special)))
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    half = rng.choice(ordinary, size=int(length), replace=len(ordinary) < length)
    return np.concatenate([half, half]).astype(np.int64)


def _special_ids(model: Any) -> set[int]:
    """The ids of the model's special tokens, as far as its tokenizer says."""
    tokenizer = getattr(model, "tokenizer", None)
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    added = getattr(inner, "get_added_tokens_decoder", None)
    found: set[int] = set()
    if callable(added):
        found |= {int(i) for i, token in added().items() if getattr(token, "special", True)}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, (int, np.integer)):
            found.add(int(value))
    return found


def induction_scores(model: Any, length: int = 24, seed: int | np.random.Generator | None = 0) -> np.ndarray:
    """The standard induction test: `length` random tokens, then the same tokens again.

    An induction head, at a token of the second copy, attends to the token that followed the
    same token in the first copy: key i - length + 1 for query i.

    Arguments:
        model: an attnkit model or a transformers model.
        length: tokens in each copy (>= 2).
        seed: the random tokens' seed (an int or a numpy Generator); ordinary tokens only,
            drawn uniformly without special tokens.

    Returns:
        (layers, heads) float64: for each head, the mean over the queries of the second copy
        of A[i, i - length + 1].
    """
    ids = repeated_random_tokens(model, length, seed)
    weights = attention_maps(model, ids).astype(np.float64)  # (layers, heads, 2n, 2n)
    queries = np.arange(length, 2 * length)
    return weights[:, :, queries, queries - length + 1].mean(axis=-1)


class SinkScores(NamedTuple):
    """What `sink_scores` returns.

    scores: (layers, heads, k) float64, the mean weight the queries put on each of the first
        k tokens (k = min(first, T)).
    sinks: (layers, heads) bool, heads whose mean weight on the first token exceeds epsilon.
    ratio: the share of heads that are sinks (Gu et al.'s metric).
    """

    scores: np.ndarray
    sinks: np.ndarray
    ratio: float


def sink_scores(model: Any, ids: Any, epsilon: float = 0.3, *, first: int = 4) -> SinkScores:
    """Attention sinks: how much weight each head puts on the first tokens.

    score(l, h, k) = (1/T) sum_i A[l, h, i, k]; a head is a sink when score(l, h, 0) > epsilon
    (Gu et al., 2024, with their epsilon = 0.3).

    Arguments:
        model: an attnkit model or a transformers model.
        ids: text or a 1-D sequence of token ids.
        epsilon: the threshold in (0, 1).
        first: how many of the first tokens to score (keyword only).

    Returns:
        SinkScores(scores (layers, heads, k), sinks (layers, heads), ratio).
    """
    if not 0 < epsilon < 1:
        raise ValueError(f"expected epsilon in (0, 1), got {epsilon}")
    if isinstance(first, bool) or not isinstance(first, (int, np.integer)) or first < 1:
        raise ValueError(f"expected first to be an int >= 1, got {first!r}")
    weights = attention_maps(model, ids).astype(np.float64)  # (layers, heads, T, T)
    k = min(int(first), weights.shape[-1])
    scores = weights[..., :k].mean(axis=-2)  # (layers, heads, k)
    sinks = scores[..., 0] > epsilon
    return SinkScores(scores=scores, sinks=sinks, ratio=float(sinks.mean()))
