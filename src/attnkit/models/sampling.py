"""Decoding helpers, written once for every decoder: prompts as one padded batch, and
the choice of the next token.

- `prepare_prompts`: one sequence, a batch, or a list of sequences of different
  lengths -> (B, T) ids, left-padded, with the (B, T) mask of real tokens.
- `sample_next_token`: greedy when `temperature == 0`, otherwise temperature,
  top-k and top-p (nucleus) sampling in the order transformers applies them,
  from a NumPy Generator.
- `apply_repetition_penalty`: transformers' repetition penalty on the tokens seen.

`attnkit.models.causal_lm.CausalLM` (`generate`, `stream`) calls them; they are
plain functions on arrays, usable without a model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["apply_repetition_penalty", "prepare_prompts", "sample_next_token"]


# ----------------------------------------------------------------------------- inputs


def prepare_prompts(
    input_ids: Any, attention_mask: Any = None, pad_token_id: int = 0
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Token ids as a (B, T) int64 array with its (B, T) bool mask of real tokens.

    Accepts one sequence (T,), a batch (B, T), or a list of sequences of different lengths,
    which are left-padded with `pad_token_id`.

    Returns:
        (ids (B, T), mask (B, T), was_1d).
    """
    if isinstance(input_ids, (list, tuple)) and input_ids and all(
        isinstance(row, (list, tuple, np.ndarray)) for row in input_ids
    ):
        rows = [np.asarray(row) for row in input_ids]
        if any(row.ndim != 1 for row in rows):
            raise ValueError("expected each prompt to be a 1-D sequence of token ids")
        if attention_mask is not None:
            raise ValueError("expected no attention_mask with a list of prompts (it is built by left padding)")
        width = max(len(row) for row in rows)
        ids = np.full((len(rows), width), pad_token_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=bool)
        for index, row in enumerate(rows):
            if len(row):
                ids[index, width - len(row) :] = row
                mask[index, width - len(row) :] = True
        was_1d = False
    else:
        ids = np.asarray(input_ids)
        was_1d = ids.ndim == 1
        if was_1d:
            ids = ids[None]
        if ids.ndim != 2:
            raise ValueError(f"expected input_ids of shape (T,) or (B, T), got {ids.shape}")
        mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
        if mask.shape != ids.shape:
            raise ValueError(f"expected attention_mask of shape {ids.shape} like input_ids, got {mask.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"expected integer token ids, got dtype {ids.dtype}")
    if ids.shape[1] == 0:
        raise ValueError("expected at least one prompt token, got an empty prompt")
    if not mask.any(axis=1).all():
        raise ValueError("expected every prompt to have at least one real token, got an all-padding row")
    return ids.astype(np.int64, copy=False), mask, was_1d


# ----------------------------------------------------------------------------- sampling


def sample_next_token(
    logits: np.ndarray,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Pick the next token of each row from logits (B, V).

    temperature == 0: argmax (greedy; the first index on ties, like torch.argmax).
    Otherwise logits / temperature, then top-k (keep the k largest, ties kept), then top-p
    (keep the smallest set of most likely tokens whose probability reaches top_p, at least
    one), then a draw from the renormalized softmax with `rng`.

    Returns:
        (B,) int64.
    """
    if temperature == 0.0:
        return np.argmax(logits, axis=-1)
    if rng is None:
        rng = np.random.default_rng()
    scores = logits.astype(np.float64) / float(temperature)  # (B, V)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = -np.partition(-scores, top_k - 1, axis=-1)[:, top_k - 1 : top_k]  # (B, 1)
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")  # ascending
        sorted_scores = np.take_along_axis(scores, order, axis=-1)
        probs = np.exp(sorted_scores - sorted_scores[:, -1:])
        probs /= probs.sum(axis=-1, keepdims=True)
        cumulative = np.cumsum(probs, axis=-1)
        remove_sorted = cumulative <= 1.0 - top_p
        remove_sorted[:, -1] = False  # keep at least the most likely token
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        scores = np.where(remove, -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    cumulative = np.cumsum(probs, axis=-1)  # (B, V)
    draws = rng.random(len(scores)) * cumulative[:, -1]
    choice = np.array([np.searchsorted(row, draw, side="right") for row, draw in zip(cumulative, draws)])
    return np.minimum(choice, scores.shape[-1] - 1).astype(np.int64)


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """transformers' repetition penalty (`RepetitionPenaltyLogitsProcessor`, from CTRL): the logit
    of every token already in the context is divided by `penalty` when positive and multiplied
    by it when negative, so `penalty` > 1 makes repeats less likely and 1 changes nothing.

    Arguments:
        logits: (B, V) next-token logits.
        seen: (B, V) bool, True for the tokens already in each row's context.
        penalty: > 0.

    Returns:
        (B, V) logits of the same dtype.
    """
    if penalty == 1.0:
        return logits
    penalized = np.where(logits > 0, logits / penalty, logits * penalty)
    return np.where(seen, penalized, logits).astype(logits.dtype, copy=False)


def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool):
        raise TypeError(f"expected max_new_tokens to be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"expected max_new_tokens >= 0, got {max_new_tokens}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"expected a finite temperature >= 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"expected top_k to be a positive int or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"expected top_p in (0, 1] or None, got {top_p!r}")
