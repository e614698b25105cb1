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
- `is_causal=True` is top-left aligned (query i sees keys 0..i) unless
  `causal_align="bottom_right"` (query i sees keys 0..i + S - L, the L new
  queries of a KV cache), and cannot be combined with `attn_mask`: add
  `key_padding_mask`, `window` or `mask_mod` to it, or build the mask you want
  with `attnkit.masks`.
- Beyond torch, the keywords every attention backend takes (see
  `attnkit.functional`): `window` (a sliding window, aligned like the causal
  mask), `key_padding_mask` ((..., S) bool, True = a real key), and
  FlexAttention's `score_mod` / `mask_mod` exactly as `flash_attention`
  defines them (`attnkit.functional.mods`). Here they become one dense mask
  and a rewrite of the dense scores.
- `scale` defaults to 1/sqrt(E).
- Grouped-query attention (`enable_gqa=True`): query head h reads key/value
  head h // (Hq // Hkv), as torch's `repeat_interleave` lays them out.
- A query row with every key masked gives output 0 and weights 0, never NaN;
  so does every row when there is no key (S = 0, or no key/value head), and
  an empty input (a batch, head or length of 0) gives an empty result.
- float16 inputs compute in float32; the output has the input dtype.
- NaN in an input propagates to the rows it touches, as in torch.
- `sinks` (Hq,), gpt-oss's learned attention sinks: one logit per query head
  joins every row's softmax denominator and takes no value
  (`attnkit.functional.sinks`); a row with no key then gives output 0.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

from attnkit.functional._checks import (
    AttentionShapes,
    check_dropout,
    check_key_padding_mask,
    check_mask,
    check_mod,
    check_qkv,
    check_rng,
    check_scale,
    output_ndim,
    require_float_tensor,
    shape_str,
    sum_to_shape,
)
from attnkit.functional.band import Band
from attnkit.functional.mods import DifferentiableScoreMod, bound, create_mask
from attnkit.functional.precision import FEW_ROWS, all_finite, matmul_in_chunks, needs_float64, start_dtype
from attnkit.functional.sinks import AttentionSinkGrads, check_sinks, sink_factors, sink_grad
from attnkit.kernels import elementwise as compiled


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


def _scaled_scores(query, key, shapes, scale, dtype):
    """(query * scale) @ key^T, (..., Hq, L, S) in `dtype`.

    The scale multiplies the query before the product, so a product of large
    inputs does not overflow on its way to being scaled down; torch's math
    backend scales before the product too."""
    q = _group_queries(np.multiply(query, scale, dtype=dtype), shapes)  # (..., Hkv, g*L, E)
    k = key.astype(dtype, copy=False)  # (..., Hkv, S, E)
    scores = np.matmul(q, np.swapaxes(k, -1, -2))  # (..., Hkv, g*L, S)
    return scores.reshape(shapes.scores_shape)  # (..., Hq, L, S)


def _per_head(fn, scores, shapes, out=None):
    """fn(scores[b, h], b, h, q_idx, kv_idx) for every flattened batch index b and
    query head h, as flash calls a mod on a tile: q_idx (L, 1), kv_idx (1, S).
    Writes the results into `out` (default: over `scores`, in place)."""
    flat = scores.reshape(-1, shapes.q_heads, shapes.L, shapes.S)  # (B, Hq, L, S), a view
    dest = flat if out is None else out.reshape(flat.shape)
    q_idx, kv_idx = np.arange(shapes.L)[:, None], np.arange(shapes.S)[None, :]
    for b in range(flat.shape[0]):
        for h in range(shapes.q_heads):
            result = np.asarray(fn(flat[b, h], b, h, q_idx, kv_idx))
            try:
                dest[b, h] = result
            except ValueError:
                raise ValueError(
                    f"expected score_mod to return scores of shape {shape_str((shapes.L, shapes.S))}, "
                    f"got {shape_str(result.shape)}"
                ) from None
    return scores if out is None else out


def _attention_weights(query, key, shapes, scale, attn_mask, score_mod, dtype):
    """Softmax weights (..., Hq, L, S) and lse (..., Hq, L), computed in `dtype`:
    softmax(score_mod((query * scale) @ key^T) + attn_mask), attn_mask already
    holding every mask of the call (see `_validate`)."""
    scores = _scaled_scores(query, key, shapes, scale, dtype)  # (..., Hq, L, S)
    if score_mod is not None:
        _per_head(score_mod, scores, shapes)
    if attn_mask is not None:
        if attn_mask.dtype == np.bool_:
            np.copyto(scores, -np.inf, where=~attn_mask)
        else:
            scores += attn_mask
    return _softmax_inplace(scores, dtype)


def _softmax_inplace(scores: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(weights, lse): softmax over the last axis of `scores` (..., S), in place, in
    `dtype` (scores' own), and each row's logsumexp (...): a fully masked row (all
    -inf) gives weights 0 and lse -inf. float32 rows take the compiled softmax when
    the kernels run (`attnkit.kernels.elementwise.softmax`), else these NumPy lines,
    the reference. Callers ignore over/invalid/divide floating-point warnings."""
    if compiled.usable(scores):  # float32: the compiled row softmax, one visit of each row
        lse = np.empty(scores.shape[:-1], np.float32)  # (..., Hq, L)
        compiled._softmax(scores, lse)
        return scores, lse

    # The reference. Stable softmax in place: shift by the row max, exponentiate, normalize. An
    # all -inf row (fully masked) is shifted by the dtype's lowest finite value
    # instead, so its exponentials are exactly 0, its lse -inf and its weights 0.
    # (Ufuncs called directly: a decode step makes these calls on tiny arrays,
    # where np.max's and np.sum's Python wrappers cost more than the work.)
    row_max = np.maximum.reduce(scores, axis=-1, keepdims=True)  # S >= 1: no key is nothing_to_do
    np.maximum(row_max, np.finfo(dtype).min, out=row_max)
    scores -= row_max
    np.exp(scores, out=scores)
    total = np.add.reduce(scores, axis=-1, keepdims=True)  # >= 1 (the max's term is 1) unless the row is empty
    lse = (np.log(total) + row_max)[..., 0]  # -inf for a fully masked row (callers ignore divide by zero)
    np.maximum(total, 1, out=total)  # 0 -> 1 for a fully masked row, whose weights stay 0
    scores /= total
    return scores, lse


def _weights(query, key, shapes, scale, attn_mask, score_mod, sinks=None):
    """(weights, lse, dtype): the softmax weights in the compute dtype, or in
    float64 when the compute dtype cannot hold the scores (a scale below
    TINY_SCALE, or scores beyond float32's range: then the result is torch's
    math backend's in float64). Finite inputs never give NaN this way. With
    `sinks` (float64 (Hq,)) each row is scaled by its sink factor and lse holds
    the sink (`attnkit.functional.sinks`)."""
    dtype = start_dtype(shapes.compute_dtype, scale)
    # an overflow is redone below; log(0) is a fully masked row's lse, -inf
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        weights, lse = _attention_weights(query, key, shapes, scale, attn_mask, score_mod, dtype)
    if needs_float64(query, key, scale, dtype, lse):
        dtype = np.dtype(np.float64)
        with np.errstate(divide="ignore"):
            weights, lse = _attention_weights(query, key, shapes, scale, attn_mask, score_mod, dtype)
    if sinks is not None:
        # forward: p'_ij = p_ij * w_i, w_i = exp(lse_i - logaddexp(lse_i, s_h))
        w, lse = sink_factors(lse, sinks)  # float64 (..., Hq, L)
        weights *= w[..., None].astype(dtype)
        lse = lse.astype(dtype)
    return weights, lse, dtype


def _validate(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align, window,
              key_padding_mask, score_mod, mask_mod):
    """Checked inputs as broadcast views of rank >= 3, their sizes, the scale,
    one mask standing for every mask of the call (None, bool or float), the
    bound score_mod, and how many leading axes to drop from results (1 when
    every input was (L, E), which runs with a head axis of 1)."""
    drop = max(3 - output_ndim(query, key, value), 0)
    q, k, v, shapes = check_qkv(query, key, value, enable_gqa)
    band = Band.from_options(is_causal=is_causal, causal_align=causal_align, window=window, L=shapes.L, S=shapes.S)
    scale = check_scale(scale, shapes.E)
    mask = check_mask(attn_mask, shapes, bool(is_causal))
    padding = check_key_padding_mask(key_padding_mask, shapes)  # (*batch, S) or None
    score_mod = check_mod(score_mod, "score_mod", 5, "(score, b, h, q_idx, kv_idx)")
    mask_mod = check_mod(mask_mod, "mask_mod", 4, "(b, h, q_idx, kv_idx)")
    if score_mod is not None:  # for this call's lengths (resolves bottom_right), as flash binds it
        score_mod = bound(score_mod, shapes.L, shapes.S)

    # The structural masks as one boolean (..., Hq | 1, L | 1, S) array, True = may attend.
    allowed = None
    # The band (causal, window) as flash's; one that spans every pair (a decode step's one
    # bottom-right row) excludes nothing, and no mask is built for it
    if not band.excludes_nothing(shapes.L, shapes.S):
        allowed = band.dense(shapes.L, shapes.S)  # (L, S)
    if padding is not None:
        allowed = _and(allowed, padding[..., None, None, :])  # (*batch, 1, 1, S)
    if mask_mod is not None:
        B = int(np.prod(shapes.batch, dtype=np.int64))
        dense = create_mask(mask_mod, B, shapes.q_heads, shapes.L, shapes.S)  # (B, Hq, L, S)
        allowed = _and(allowed, dense.reshape(shapes.scores_shape))
    if allowed is not None:
        if mask is None or mask.dtype == np.bool_:
            mask = _and(allowed, mask)
        else:  # a float mask: -inf where a structural mask excludes the pair
            mask = np.where(allowed, mask, shapes.compute_dtype.type(-np.inf))
    return q, k, v, shapes, scale, mask, score_mod, drop


def _and(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    return b if a is None else a if b is None else a & b


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
    causal_align: str = "top_left",
    window: int | tuple[int | None, int | None] | None = None,
    key_padding_mask: np.ndarray | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    rng: np.random.Generator | int | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    sinks: np.ndarray | None = None,
) -> np.ndarray | AttentionOutput:
    """softmax(score_mod(query @ key^T * scale) + mask) @ value, with torch SDPA's
    semantics and the keywords of every attnkit attention backend.

    Arguments:
        query: (..., Hq, L, E) floating array.
        key: (..., Hkv, S, E), same dtype and batch dims as query.
        value: (..., Hkv, S, Ev).
        attn_mask: bool (True = may attend) or float (added to the scores),
            broadcastable to (..., Hq, L, S).
        dropout_p: probability of zeroing each weight; kept weights are scaled
            by 1 / (1 - dropout_p). Drawn from `rng`.
        is_causal: causal mask, aligned by `causal_align`; not with attn_mask.
        scale: multiplies the scores; default 1/sqrt(E).
        enable_gqa: allow Hq to be a multiple of Hkv (grouped-query attention).
        causal_align: "top_left" (torch's is_causal; query i sees keys 0..i) or
            "bottom_right" (query i sees keys 0..i + S - L, as with a KV cache).
            Also aligns `window`.
        window: sliding window: an int `left` or a pair (left, right); query i
            sees keys i - left .. i + right (None = unbounded), exactly like
            `masks.sliding_window_mask(left=, right=)`.
        key_padding_mask: bool (..., S), True = a real key (may be attended);
            its leading dims broadcast to the batch dims. Combines with every
            other mask (also with is_causal).
        score_mod: `score_mod(score, b, h, q_idx, kv_idx)` returning new scores,
            applied to the scaled scores before any mask, called per (b, h) with
            score (L, S), q_idx (L, 1), kv_idx (1, S); b indexes the flattened
            batch dims, h the query head. See `attnkit.functional.mods`.
        mask_mod: `mask_mod(b, h, q_idx, kv_idx)` returning booleans (True = may
            attend), evaluated into a dense mask.
        rng: numpy Generator or integer seed for dropout (a fresh unseeded
            Generator if None).
        return_weights: also return the (..., Hq, L, S) weights.
        return_lse: also return the (..., Hq, L) logsumexp of each score row
            (with the sink's logit in it when `sinks` is given).
        sinks: (Hq,) real, learned attention sinks (gpt-oss): head h's logit
            s_h joins each row's softmax denominator, p_ij = exp(x_ij) /
            (exp(s_h) + sum_j exp(x_ij)), and takes no value. See
            `attnkit.functional.sinks`.

    Returns:
        The output (..., Hq, L, Ev) in query's dtype, or, when return_weights or
        return_lse is set, AttentionOutput(output, weights, lse) with the fields
        not asked for set to None. A query whose keys are all masked gets
        output 0, weights 0 and lse -inf.
    """
    if (attn_mask is None and window is None and key_padding_mask is None and score_mod is None
            and mask_mod is None and rng is None and not return_weights and not return_lse and sinks is None):
        out = _unmasked(query, key, value, dropout_p, is_causal, scale, enable_gqa, causal_align)
        if out is not None:
            return out
    dropout_p = check_dropout(dropout_p)
    if rng is not None:
        check_rng(rng)  # a bad rng is an error even when dropout is off
    q, k, v, shapes, scale, mask, score_mod, drop = _validate(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align, window, key_padding_mask,
        score_mod, mask_mod,
    )
    sinks = check_sinks(sinks, shapes.q_heads)

    if shapes.nothing_to_do:  # an empty result, or no key at all: zeros, as torch gives
        weights = np.zeros(shapes.scores_shape, dtype=shapes.dtype)
        lse = np.full(shapes.scores_shape[:-1], -np.inf, dtype=shapes.dtype)
        if sinks is not None:  # the sink alone: lse = s_h
            lse = sink_factors(lse, sinks)[1].astype(shapes.dtype)
        out = np.zeros((*shapes.batch, shapes.q_heads, shapes.L, shapes.Ev), dtype=shapes.dtype)
    else:
        weights, lse, cd = _weights(q, k, shapes, scale, mask, score_mod, sinks)  # (..., Hq, L, S)
        if dropout_p > 0.0:
            rng = check_rng(rng)
            keep = rng.random(weights.shape) >= dropout_p
            weights = np.where(keep, weights * cd.type(1.0 / (1.0 - dropout_p)), cd.type(0))
        out = _few_rows_matmul(_group_queries(weights, shapes), v.astype(cd, copy=False))  # (..., Hkv, g*L, Ev)
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


def _unmasked(query, key, value, dropout_p, is_causal, scale, enable_gqa, causal_align) -> np.ndarray | None:
    """The output of a call that masks nothing, or None when the call needs the
    general path (or is an error, which that path reports).

    A decode step calls attention 30 times a token with one query row over the
    cache, where the general path's checks and mask plumbing cost several times
    the arithmetic. This takes only calls that need none of it: arrays of one
    float32/float64 dtype and rank >= 3 with the same leading dims and no
    broadcasting, no mask of any kind (is_causal only where it excludes no key:
    one bottom-right row, or a single key), no dropout, a scale the compute dtype
    holds. It makes the general path's own operations in the same order, so its
    output is the same bits; where a score row's maximum is not finite (an
    overflow or NaN) it returns None and the general path decides.
    """
    if not (type(query) is np.ndarray and type(key) is np.ndarray and type(value) is np.ndarray):
        return None
    dtype = query.dtype
    if not (dtype == key.dtype == value.dtype and dtype.char in "fd" and query.ndim == key.ndim == value.ndim >= 3):
        return None
    *batch, Hq, L, E = query.shape
    *kv_batch, Hkv, S, Ek = key.shape
    if not (kv_batch == batch == list(value.shape[:-3]) and value.shape[-3:-1] == (Hkv, S) and Ek == E
            and query.size and key.size and value.size and Hq % Hkv == 0
            and (Hq == Hkv or Hkv == 1 or enable_gqa is True)):
        return None
    if type(dropout_p) not in (float, int) or dropout_p != 0:
        return None
    if causal_align != "top_left" and causal_align != "bottom_right":
        return None
    if is_causal is not False and not (is_causal is True and (L == 1 if causal_align == "bottom_right" else S == 1)):
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    elif type(scale) is not float or not math.isfinite(scale):
        return None
    if start_dtype(dtype, scale) != dtype:  # a scale too small for float32: the general path runs float64
        return None
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow goes to the general path
        q = np.multiply(query, scale, dtype=dtype).reshape(*batch, Hkv, Hq // Hkv * L, E)
        scores = np.matmul(q, np.swapaxes(key, -1, -2))  # (..., Hkv, g*L, S)
        if compiled.usable(scores):  # float32: the compiled row softmax (the general path takes it too)
            lse = np.empty(scores.shape[:-1], np.float32)
            compiled._softmax(scores, lse)
            if not math.isfinite(np.add.reduce(lse, axis=None)):  # a row max not finite: the general path decides
                return None
            return np.matmul(scores, value).reshape(*batch, Hq, L, value.shape[-1])
        row_max = np.maximum.reduce(scores, axis=-1, keepdims=True)
        if not math.isfinite(np.add.reduce(row_max, axis=None)):  # (a sum too large to hold also goes)
            return None
        scores -= row_max
        np.exp(scores, out=scores)
        scores /= np.add.reduce(scores, axis=-1, keepdims=True)  # >= 1: the maximum's term is 1
        return np.matmul(scores, value).reshape(*batch, Hq, L, value.shape[-1])


def scaled_dot_product_attention_backward(
    grad_output: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: int | tuple[int | None, int | None] | None = None,
    key_padding_mask: np.ndarray | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    sinks: np.ndarray | None = None,
) -> AttentionGrads | AttentionSinkGrads:
    """Gradients of `scaled_dot_product_attention` (without dropout).

    Takes the forward's arguments and grad_output = dLoss/doutput, shaped
    (..., Hq, L, Ev). The weights P are recomputed rather than stored.

    Derivation, one line of the forward per step (S = scores, P = softmax(S)):

        forward: output = P @ value        -> grad_value = P^T @ grad_output
                                              grad_P     = grad_output @ value^T
        forward: P = softmax(S) row-wise   -> grad_S = P * (grad_P - rowsum(P * grad_P))
        forward: S = (query * scale) @ key^T -> grad_query = grad_S @ (key * scale)
                                                grad_key   = grad_S^T @ (query * scale)

        forward: S = score_mod(raw) -> grad_raw = grad_S * score_mod.grad(raw, ...)

    rowsum(P * grad_P) equals rowsum(grad_output * output), FlashAttention's D.
    A score_mod needs its derivative, as in `flash_attention_backward`: a
    `mods.ScoreMod(fn, grad)` (grad=None for a mod that only adds a bias).
    With GQA the query heads sharing a key/value head add their contributions.
    Masked positions have P = 0 and so receive no gradient; a fully masked row
    contributes exactly zero. Where the compute dtype cannot hold the scores or
    a gradient on the way, the whole backward runs in float64, as the forward.

    With `sinks` (Hq,) the weights are the sink-scaled p' (their rows sum to
    1 - p_sink), dS = p' (dP - rowsum(p' dP)) as above, and the sinks get
    dL/ds_h = -sum over batch and rows of p_sink * rowsum(p' dP)
    (`attnkit.functional.sinks`).

    Returns:
        AttentionGrads(grad_query, grad_key, grad_value), each in its input's
        shape and dtype; with `sinks`, AttentionSinkGrads(grad_query, grad_key,
        grad_value, grad_sinks) with grad_sinks (Hq,) in the inputs' dtype.
    """
    q, k, v, shapes, scale, mask, score_mod, drop = _validate(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align, window, key_padding_mask,
        score_mod, mask_mod,
    )
    sinks = check_sinks(sinks, shapes.q_heads)
    if score_mod is not None and not isinstance(score_mod, DifferentiableScoreMod):
        raise TypeError(
            "scaled_dot_product_attention_backward needs the derivative of score_mod: wrap it as "
            "attnkit.functional.mods.ScoreMod(fn, grad) (grad=None if the mod only adds a bias)"
        )
    grad_output = require_float_tensor(grad_output, "grad_output", 2)
    expected = (*shapes.batch, shapes.q_heads, shapes.L, shapes.Ev)
    if grad_output.shape != expected[drop:]:
        raise ValueError(
            f"expected grad_output of the output's shape {shape_str(expected[drop:])}, "
            f"got {shape_str(grad_output.shape)}"
        )
    d_out = grad_output.reshape(expected)
    if shapes.nothing_to_do:  # an empty result, or no key at all: zero gradients
        zeros = [np.zeros(np.shape(x), dtype=shapes.dtype) for x in (query, key, value)]
        if sinks is None:
            return AttentionGrads(*zeros)
        return AttentionSinkGrads(*zeros, np.zeros(shapes.q_heads, dtype=shapes.dtype))

    P, lse, dtype = _weights(q, k, shapes, scale, mask, score_mod, sinks)  # (..., Hq, L, S)
    rows = []  # receives D = rowsum(P * dP), (..., Hq, L)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is redone below
        mod_grad = _mod_grad(score_mod, q, k, shapes, scale, dtype)  # (..., Hq, L, S) or None
        grads = _attention_grads(P, d_out, q, k, v, shapes, scale, dtype, mod_grad, rows)
    if dtype != np.float64 and not all_finite(*grads) and all_finite(q, k, v, d_out):
        # a gradient beyond the compute dtype's range on the way: torch's float64 answer
        wide = np.dtype(np.float64)
        with np.errstate(divide="ignore"):
            P, lse = _attention_weights(q, k, shapes, scale, mask, score_mod, wide)
        if sinks is not None:
            w, lse = sink_factors(lse, sinks)
            P *= w[..., None]
        mod_grad = _mod_grad(score_mod, q, k, shapes, scale, wide)
        rows.clear()
        grads = _attention_grads(P, d_out, q, k, v, shapes, scale, wide, mod_grad, rows)

    # Inputs that were broadcast (smaller rank, a dim of 1) sum their gradient back.
    grads = [sum_to_shape(grad, np.shape(x)).astype(shapes.dtype, copy=False)
             for grad, x in zip(grads, (query, key, value))]
    if sinks is None:
        return AttentionGrads(*grads)
    # forward: the sink's weight exp(s_h - lse') -> dL/ds_h = -sum exp(s_h - lse') D
    return AttentionSinkGrads(*grads, sink_grad(sinks, lse, rows[0]).astype(shapes.dtype))


def _few_rows_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b over the keys, a (..., rows, S): with fewer than FEW_ROWS rows (a decode
    step, a short chunk) the sum over S runs in chunks (`matmul_in_chunks`), as
    flash's few-row tiles do; OpenBLAS would round each output over all S keys
    in one run (3 rows over 799 keys: 2.2x torch's error). More rows keep one
    product (an inner side of 128 slows a large sgemm down)."""
    if a.shape[-2] < FEW_ROWS:
        return matmul_in_chunks(a, b)
    return np.matmul(a, b)


def _mod_grad(score_mod, q, k, shapes, scale, dtype):
    """d score_mod / d raw score at the raw scaled scores, (..., Hq, L, S) in `dtype`;
    None without a score_mod or for an additive one (derivative 1)."""
    if score_mod is None or score_mod.grad is None:
        return None
    raw = _scaled_scores(q, k, shapes, scale, dtype)  # (..., Hq, L, S)
    return _per_head(score_mod.grad, raw, shapes, out=np.empty_like(raw))


def _attention_grads(P, d_out, q, k, v, shapes, scale, dtype, mod_grad=None, rows=None):
    """(grad_query, grad_key, grad_value) in `dtype` from the weights P (..., Hq, L, S),
    and mod_grad (..., Hq, L, S), the score_mod's derivative, or None. `rows`, a
    list if given, receives D = rowsum(P * dP) (..., Hq, L)."""
    q, k, v, d_out = (x.astype(dtype, copy=False) for x in (q, k, v, d_out))
    P = _group_queries(P, shapes)  # (..., Hkv, g*L, S)
    d_out = _group_queries(d_out, shapes)  # (..., Hkv, g*L, Ev)

    # forward: output = P @ value
    grad_value = np.matmul(np.swapaxes(P, -1, -2), d_out)  # (..., Hkv, S, Ev)
    grad_P = np.matmul(d_out, np.swapaxes(v, -1, -2))  # (..., Hkv, g*L, S)
    # forward: P = softmax(scores)
    row_d = np.sum(P * grad_P, axis=-1, keepdims=True)  # (..., Hkv, g*L, 1)
    grad_P -= row_d
    if rows is not None:
        rows.append(_ungroup_queries(row_d, shapes)[..., 0])  # (..., Hq, L)
    grad_scores = P * grad_P
    if mod_grad is not None:  # forward: scores = score_mod(raw)
        grad_scores *= _group_queries(mod_grad, shapes)
    # forward: scores = (query * scale) @ key^T. The scale multiplies key and query
    # before the products: grad_scores @ key of tiny factors would underflow before
    # a large scale could bring it back.
    grad_query = _few_rows_matmul(grad_scores, k * dtype.type(scale))  # (..., Hkv, g*L, E)
    q_scaled = _group_queries(q * dtype.type(scale), shapes)  # (..., Hkv, g*L, E)
    grad_key = np.matmul(np.swapaxes(grad_scores, -1, -2), q_scaled)  # (..., Hkv, S, E)
    return _ungroup_queries(grad_query, shapes), grad_key, grad_value  # (..., Hq, L, E), ...
