"""Learned attention sinks (gpt-oss): one extra logit per query head that joins
every row's softmax denominator and carries no value.

    p_ij = exp(x_ij - m) / (exp(s_h - m) + sum_j exp(x_ij - m)),   m = max(s_h, max_j x_ij)
    output_i = sum_j p_ij v_j                                      (the sink takes no value)

With lse_i the logsumexp of row i's scores alone, the row's weights are the
sink-free ones times w_i = exp(lse_i - lse'_i), where lse'_i = logaddexp(lse_i, s_h)
is the logsumexp with the sink: every attention path computes its ordinary
softmax (and lse) and scales the row by w_i, kept in float64 until the product.
A row with no key allowed has lse -inf, w 0 and output 0 (the sink alone), and
lse' = s_h.

Backward, one line of the forward per step (D'_i = rowsum(dO_i * output_i)):

    forward: p'_ij = w_i p_ij   ->  dS_ij = p'_ij (dP_ij - D'_i)   (the plain softmax rule on p')
    forward: sink weight 1 - w_i = exp(s_h - lse'_i)
                                ->  dL/ds_h = -sum over batch and rows of exp(s_h - lse'_i) D'_i

so a backward that recomputes the weights as exp(s - lse') and takes D from
the sink-scaled output needs nothing more; the sum of a row's dS over its
real keys is exp(s_h - lse'_i) D'_i rather than 0.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class AttentionSinkGrads(NamedTuple):
    """Gradients of a scalar loss with respect to the inputs of attention with sinks."""

    grad_query: np.ndarray  # (..., Hq, L, E)
    grad_key: np.ndarray  # (..., Hkv, S, E)
    grad_value: np.ndarray  # (..., Hkv, S, Ev)
    grad_sinks: np.ndarray  # (Hq,)


def check_sinks(sinks, q_heads: int) -> np.ndarray | None:
    """sinks as a float64 (Hq,) array, or None. Expected: None or a real (Hq,) array."""
    if sinks is None:
        return None
    arr = np.asarray(sinks)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"expected sinks as a real (Hq,) array, got dtype {arr.dtype}")
    if arr.shape != (q_heads,):
        raise ValueError(f"expected sinks of shape ({q_heads},), one logit per query head, got {arr.shape}")
    return arr.astype(np.float64)


def sink_factors(lse: np.ndarray, sinks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(w, lse'): each row's factor w = exp(lse - lse') and its logsumexp with the
    sink lse' = logaddexp(lse, s_h), both float64 (..., Hq, L), from the sink-free
    lse (..., Hq, L) and sinks (Hq,). w is 0 on a row with no key (lse -inf)."""
    lse = np.asarray(lse, dtype=np.float64)
    sink = sinks[:, None]  # (Hq, 1): broadcasts over (..., Hq, L)
    with_sink = np.logaddexp(lse, sink)
    with np.errstate(invalid="ignore"):  # (-inf) - finite is -inf, exp 0; NaN propagates
        w = np.exp(lse - with_sink)
    return w, with_sink


def sink_grad(sinks: np.ndarray, lse_with_sink: np.ndarray, d: np.ndarray) -> np.ndarray:
    """dL/ds_h = -sum over batch and rows of exp(s_h - lse') D' (float64 (Hq,)),
    from lse' (..., Hq, L) and D' = rowsum(dO * output) (..., Hq, L)."""
    weight = np.exp(sinks[:, None] - np.asarray(lse_with_sink, dtype=np.float64))  # (..., Hq, L)
    contrib = -(weight * np.asarray(d, dtype=np.float64))
    return contrib.reshape(-1, *contrib.shape[-2:]).sum(axis=(0, 2))
