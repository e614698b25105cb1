"""Scaled dot-product attention and its backward, written as plainly as the math.

    scores  = (query * scale) @ key^T  (+ mask)       # (..., H, L, S)
    weights = softmax(scores)                          # each row sums to 1
    output  = weights @ value                          # (..., H, L, Ev)

The scale multiplies the query before the product, so large inputs whose
scaled scores fit do not overflow on the way; scores beyond the compute
dtype's range (float32 inputs near 1e19 and up), or a scale below 2^-16, are
computed in float64 instead: finite inputs give torch's math-backend answer in
float64, rounded to the input dtype, never NaN.

Semantics follow torch's `F.scaled_dot_product_attention`:

- Layout (..., H, L, E): any leading batch dims, then heads, query length L
  (key length S), head dim E; value may have its own head dim Ev. Leading
  dims broadcast as in torch: ranks may differ, a dim of 1 stretches, and a
  single head on either side serves every head of the other.
- `attn_mask`: boolean True = may attend, or a float mask added to the scores;
  either broadcasts to (..., H, L, S).
- `is_causal=True` is top-left aligned (query i sees keys 0..i) and cannot be
  combined with `attn_mask`: build the mask you want with `attnkit.masks`.
- `scale` defaults to 1/sqrt(E).
- Grouped-query attention (`enable_gqa=True`): query head h reads key/value
  head h // (Hq // Hkv), as torch's `repeat_interleave` lays them out.
- A query row with every key masked gives output 0 and weights 0, never NaN;
  so does every row when there is no key (S = 0, or no key/value head), and
  an empty input (a batch, head or length of 0) gives an empty result.
- float16 inputs compute in float32; the output has the input dtype.
- NaN in an input propagates to the rows it touches, as in torch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attnkit.functional._checks import (
    AttentionShapes,
    all_finite,
    check_dropout,
    check_mask,
    check_qkv,
    check_rng,
    check_scale,
    needs_float64,
    output_ndim,
    require_float_tensor,
    shape_str,
    start_dtype,
    sum_to_shape,
)
from attnkit.functional.masks import causal_mask


class AttentionOutput(NamedTuple):
    """What `scaled_dot_product_attention` returns when extras are asked for.

    output:  (..., Hq, L, Ev)
    weights: (..., Hq, L, S) the weights that multiplied value (after dropout),
             or None unless `return_weights=True`
    lse:     (..., Hq, L) natural-log logsumexp of each row of masked, scaled
             scores (-inf for a fully masked row), or None unless `return_lse=True`
    """

    output: np.ndarray
    weights: np.ndarray | None
    lse: np.ndarray | None


class AttentionGrads(NamedTuple):
    """Gradients of a scalar loss with respect to the attention inputs."""

    grad_query: np.ndarray  # (..., Hq, L, E)
    grad_key: np.ndarray  # (..., Hkv, S, E)
    grad_value: np.ndarray  # (..., Hkv, S, Ev)


def _group_queries(x: np.ndarray, shapes: AttentionShapes) -> np.ndarray:
    """(..., Hq, L, D) -> (..., Hkv, group * L, D): the query heads that share a
    key/value head become one taller matrix, so GQA needs no copy of key/value."""
    return x.reshape(*shapes.batch, shapes.kv_heads, shapes.group * x.shape[-2], x.shape[-1])


def _ungroup_queries(x: np.ndarray, shapes: AttentionShapes) -> np.ndarray:
    """(..., Hkv, group * L, D) -> (..., Hq, L, D)."""
    return x.reshape(*shapes.batch, shapes.q_heads, shapes.L, x.shape[-1])


def _attention_weights(query, key, shapes, scale, attn_mask, is_causal, dtype):
    """Softmax weights (..., Hq, L, S) and lse (..., Hq, L), computed in `dtype`.

    The scale multiplies the query before the product, (query * scale) @ key^T,
    so a product of large inputs does not overflow on its way to being scaled
    down; torch's math backend scales before the product too."""
    q = _group_queries(np.multiply(query, scale, dtype=dtype), shapes)  # (..., Hkv, g*L, E)
    k = key.astype(dtype, copy=False)  # (..., Hkv, S, E)
    scores = np.matmul(q, np.swapaxes(k, -1, -2))  # (..., Hkv, g*L, S)
    scores = scores.reshape(shapes.scores_shape)  # (..., Hq, L, S)
    if is_causal:
        attn_mask = causal_mask(shapes.L, shapes.S)
    if attn_mask is not None:
        if attn_mask.dtype == np.bool_:
            np.copyto(scores, -np.inf, where=~attn_mask)
        else:
            scores += attn_mask

    # Stable softmax in place: shift by the row max (0 for an all -inf row, so
    # its exponentials are exactly 0), exponentiate, normalize.
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)  # -inf also when S = 0
    row_max[np.isneginf(row_max)] = 0
    scores -= row_max
    np.exp(scores, out=scores)
    total = np.sum(scores, axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + row_max)[..., 0]  # -inf for a fully masked row
    total[total == 0] = 1
    scores /= total
    return scores, lse


def _weights(query, key, shapes, scale, attn_mask, is_causal):
    """(weights, lse, dtype): the softmax weights in the compute dtype, or in
    float64 when the compute dtype cannot hold the scores (a scale below
    TINY_SCALE, or scores beyond float32's range: then the result is torch's
    math backend's in float64). Finite inputs never give NaN this way."""
    dtype = start_dtype(shapes.compute_dtype, scale)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is redone below
        weights, lse = _attention_weights(query, key, shapes, scale, attn_mask, is_causal, dtype)
    if needs_float64(query, key, scale, dtype, lse):
        dtype = np.dtype(np.float64)
        weights, lse = _attention_weights(query, key, shapes, scale, attn_mask, is_causal, dtype)
    return weights, lse, dtype


def _validate(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """Checked inputs as broadcast views of rank >= 3, their sizes, the scale,
    the mask, and how many leading axes to drop from results (1 when every
    input was (L, E), which runs with a head axis of 1)."""
    drop = max(3 - output_ndim(query, key, value), 0)
    q, k, v, shapes = check_qkv(query, key, value, enable_gqa)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"expected is_causal to be a bool, got {type(is_causal).__name__}")
    scale = check_scale(scale, shapes.E)
    mask = check_mask(attn_mask, shapes, bool(is_causal))
    return q, k, v, shapes, scale, mask, drop


def scaled_dot_product_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rng: np.random.Generator | int | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
) -> np.ndarray | AttentionOutput:
    """softmax(query @ key^T * scale + mask) @ value, with torch SDPA's semantics.

    Arguments:
        query: (..., Hq, L, E) floating array.
        key: (..., Hkv, S, E), same dtype and batch dims as query.
        value: (..., Hkv, S, Ev).
        attn_mask: bool (True = may attend) or float (added to the scores),
            broadcastable to (..., Hq, L, S).
        dropout_p: probability of zeroing each weight; kept weights are scaled
            by 1 / (1 - dropout_p). Drawn from `rng`.
        is_causal: top-left causal mask (query i sees keys 0..i); not with attn_mask.
        scale: multiplies the scores; default 1/sqrt(E).
        enable_gqa: allow Hq to be a multiple of Hkv (grouped-query attention).
        rng: numpy Generator or integer seed for dropout (a fresh unseeded
            Generator if None).
        return_weights: also return the (..., Hq, L, S) weights.
        return_lse: also return the (..., Hq, L) logsumexp of each score row.

    Returns:
        The output (..., Hq, L, Ev) in query's dtype, or, when return_weights or
        return_lse is set, AttentionOutput(output, weights, lse) with the fields
        not asked for set to None. A query whose keys are all masked gets
        output 0, weights 0 and lse -inf.
    """
    dropout_p = check_dropout(dropout_p)
    if rng is not None:
        check_rng(rng)  # a bad rng is an error even when dropout is off
    q, k, v, shapes, scale, mask, drop = _validate(query, key, value, attn_mask, is_causal, scale, enable_gqa)

    if shapes.nothing_to_do:  # an empty result, or no key at all: zeros, as torch gives
        weights = np.zeros(shapes.scores_shape, dtype=shapes.dtype)
        lse = np.full(shapes.scores_shape[:-1], -np.inf, dtype=shapes.dtype)
        out = np.zeros((*shapes.batch, shapes.q_heads, shapes.L, shapes.Ev), dtype=shapes.dtype)
    else:
        weights, lse, cd = _weights(q, k, shapes, scale, mask, is_causal)  # (..., Hq, L, S)
        if dropout_p > 0.0:
            rng = check_rng(rng)
            keep = rng.random(weights.shape) >= dropout_p
            weights = np.where(keep, weights * cd.type(1.0 / (1.0 - dropout_p)), cd.type(0))
        out = np.matmul(_group_queries(weights, shapes), v.astype(cd, copy=False))  # (..., Hkv, g*L, Ev)
        out = _ungroup_queries(out, shapes).astype(shapes.dtype, copy=False)  # (..., Hq, L, Ev)

    if drop:
        out, weights, lse = out[0], weights[0], lse[0]
    if not (return_weights or return_lse):
        return out
    return AttentionOutput(
        output=out,
        weights=weights.astype(shapes.dtype, copy=False) if return_weights else None,
        lse=lse.astype(shapes.dtype, copy=False) if return_lse else None,
    )


def scaled_dot_product_attention_backward(
    grad_output: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> AttentionGrads:
    """Gradients of `scaled_dot_product_attention` (without dropout).

    Takes the forward's arguments and grad_output = dLoss/doutput, shaped
    (..., Hq, L, Ev). The weights P are recomputed rather than stored.

    Derivation, one line of the forward per step (S = scores, P = softmax(S)):

        forward: output = P @ value        -> grad_value = P^T @ grad_output
                                              grad_P     = grad_output @ value^T
        forward: P = softmax(S) row-wise   -> grad_S = P * (grad_P - rowsum(P * grad_P))
        forward: S = (query * scale) @ key^T -> grad_query = grad_S @ (key * scale)
                                                grad_key   = grad_S^T @ (query * scale)

    rowsum(P * grad_P) equals rowsum(grad_output * output), FlashAttention's D.
    With GQA the query heads sharing a key/value head add their contributions.
    Masked positions have P = 0 and so receive no gradient; a fully masked row
    contributes exactly zero. Where the compute dtype cannot hold the scores or
    a gradient on the way, the whole backward runs in float64, as the forward.

    Returns:
        AttentionGrads(grad_query, grad_key, grad_value), each in its input's
        shape and dtype.
    """
    q, k, v, shapes, scale, mask, drop = _validate(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    grad_output = require_float_tensor(grad_output, "grad_output", 2)
    expected = (*shapes.batch, shapes.q_heads, shapes.L, shapes.Ev)
    if grad_output.shape != expected[drop:]:
        raise ValueError(
            f"expected grad_output of the output's shape {shape_str(expected[drop:])}, "
            f"got {shape_str(grad_output.shape)}"
        )
    d_out = grad_output.reshape(expected)
    if shapes.nothing_to_do:  # an empty result, or no key at all: zero gradients
        return AttentionGrads(*(np.zeros(np.shape(x), dtype=shapes.dtype) for x in (query, key, value)))

    P, _, dtype = _weights(q, k, shapes, scale, mask, is_causal)  # (..., Hq, L, S)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is redone below
        grads = _attention_grads(P, d_out, q, k, v, shapes, scale, dtype)
    if dtype != np.float64 and not all_finite(*grads) and all_finite(q, k, v, d_out):
        # a gradient beyond the compute dtype's range on the way: torch's float64 answer
        P, _ = _attention_weights(q, k, shapes, scale, mask, is_causal, np.dtype(np.float64))
        grads = _attention_grads(P, d_out, q, k, v, shapes, scale, np.dtype(np.float64))

    # Inputs that were broadcast (smaller rank, a dim of 1) sum their gradient back.
    grads = (sum_to_shape(grad, np.shape(x)) for grad, x in zip(grads, (query, key, value)))
    return AttentionGrads(*(g.astype(shapes.dtype, copy=False) for g in grads))


def _attention_grads(P, d_out, q, k, v, shapes, scale, dtype):
    """(grad_query, grad_key, grad_value) in `dtype` from the weights P (..., Hq, L, S)."""
    q, k, v, d_out = (x.astype(dtype, copy=False) for x in (q, k, v, d_out))
    P = _group_queries(P, shapes)  # (..., Hkv, g*L, S)
    d_out = _group_queries(d_out, shapes)  # (..., Hkv, g*L, Ev)

    # forward: output = P @ value
    grad_value = np.matmul(np.swapaxes(P, -1, -2), d_out)  # (..., Hkv, S, Ev)
    grad_P = np.matmul(d_out, np.swapaxes(v, -1, -2))  # (..., Hkv, g*L, S)
    # forward: P = softmax(scores)
    grad_P -= np.sum(P * grad_P, axis=-1, keepdims=True)
    grad_scores = P * grad_P
    # forward: scores = (query * scale) @ key^T. The scale multiplies key and query
    # before the products: grad_scores @ key of tiny factors would underflow before
    # a large scale could bring it back.
    grad_query = np.matmul(grad_scores, k * dtype.type(scale))  # (..., Hkv, g*L, E)
    q_scaled = _group_queries(q * dtype.type(scale), shapes)  # (..., Hkv, g*L, E)
    grad_key = np.matmul(np.swapaxes(grad_scores, -1, -2), q_scaled)  # (..., Hkv, S, E)
    return _ungroup_queries(grad_query, shapes), grad_key, grad_value  # (..., Hq, L, E), ...
