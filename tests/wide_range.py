"""Inputs across float32's range, with torch's math backend in float64 as their truth.

Finite in, finite out (issue 12): for finite float32 inputs of any magnitude,
every attention path gives the answer of torch's math backend computed in
float64, rounded to float32 (and clipped to float32's largest value where it
is larger), never NaN. The tests that check it (test_functional, test_flash,
test_torch_flash, test_nn_attention, test_torch_modules) draw magnitudes from
1e-30 to 1e30 with these helpers and hold each path to conftest's budget rule,
`assert_within_budget`: attnkit's float32 error against the float64 truth at
most 2x (3x for gradients) torch's math backend's float32 error, plus 8 ulps.
Where torch's float32 answer overflows (NaN or inf where the truth is a
float32 number), the truth rounded to float32 stands in for it: the budget is
then the epsilon alone.

The epsilon is counted at each quantity's natural size (`natural_sizes`), the
size float32 rounding errors scale with, rather than at the result's largest
entry: a softmax row of scores s_abs ~ |scale| max sum_e |q_e k_e| has each
score off by ~u s_abs / sqrt(E) (u = 2^-24, a random walk over E terms), which
moves the output by that much times max|v| times the row's spread (1 - its
largest weight): a one-hot row does not move, an evenly spread one does. With
inputs up to 1e30 the spread is what keeps the budget tight: their scores are
far apart and their rows one-hot, so attnkit must give exactly the value of the
top key (to 8 ulps), as the float64 truth does.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from conftest import assert_within_budget, reference_attention

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal number, 2^-126

EXPONENTS = st.integers(-30, 30)  # magnitudes 10^e of the inputs
SCALES = st.sampled_from([None, 1e-38, 1e-20, 1e-6, 0.37, 3.0, 1e6, 1e20, 1e30])


def wide(rng: np.random.Generator, shape, exponent: int) -> np.ndarray:
    """float32 normal draws times 10^exponent."""
    return (rng.standard_normal(shape) * 10.0**exponent).astype(np.float32)


def torch_math(torch, q, k, v, mask=None, scale=None, enable_gqa=False, dtype="float64", d_out=None):
    """torch's math backend in `dtype` on these (float32) values, as float64 arrays:
    the output, or with d_out (output, (dq, dk, dv)) through autograd. `mask` is
    boolean (True = may attend) or None."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    td = getattr(torch, dtype)
    grad = d_out is not None
    tq, tk, tv = (torch.tensor(np.asarray(x), dtype=td, requires_grad=grad) for x in (q, k, v))
    tmask = None if mask is None else torch.tensor(np.asarray(mask))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=tmask, scale=scale, enable_gqa=enable_gqa
        )
    if not grad:
        return out.detach().double().numpy()
    out.backward(torch.tensor(np.asarray(d_out), dtype=td))
    return out.detach().double().numpy(), tuple(x.grad.double().numpy() for x in (tq, tk, tv))


def _rows_weight(q, k, P, sc):
    """Per query row: max(1, cond * spread), cond = s_abs / sqrt(E) the score's error in
    ulps, spread = 1 - max_j P the share of the weights a score error can move."""
    E = q.shape[-1]
    s_abs = sc * np.max(np.abs(q) @ np.swapaxes(np.abs(k), -1, -2), axis=-1, initial=0.0)  # (..., L)
    spread = P.sum(-1) - P.max(-1, initial=0.0)  # 0 for a one-hot or a fully masked row
    return np.maximum(1.0, s_abs / math.sqrt(max(E, 1)) * spread)


def row_natural_sizes(q, k, v, mask=None, scale=None, group=1, d_out=None) -> dict[str, np.ndarray]:
    """The natural size of each row of the output and, given d_out, of dq, dk and dv:
    what their float32 rounding errors scale with (module docstring), from float64
    weights. Shapes: out and dq (..., Hq, L); dk and dv (..., Hkv, S).

    out_i ~ max|v| w_i; dq_i ~ sc max|k| dp_i w_i; dk_j ~ sc max|q| sum_i P_ij dp_i w_i;
    dv_j ~ sum_i P_ij max|dO_i| w_i; with w the rows' weight (`_rows_weight`) and
    dp_i = max_j sum_e |dO_ie v_je| the size of the dP row whose D cancels.
    Query heads sharing a key/value head add up for dk and dv."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    sc = abs(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    P = reference_attention(q, k, v, mask, scale)[1]  # (..., Hq, L, S) float64
    w = _rows_weight(q, k, P, sc)  # (..., Hq, L)
    big = lambda x: float(np.max(np.abs(x), initial=0.0))  # noqa: E731
    sizes = {"out": big(v) * w}
    if d_out is None:
        return sizes
    d_out = np.asarray(d_out, dtype=np.float64)
    dp = np.max(np.abs(d_out) @ np.swapaxes(np.abs(v), -1, -2), axis=-1, initial=0.0)  # (..., Hq, L)
    # dP and D below float32's normal range are off by up to Ev subnormal steps
    # (2^-149 = F32_TINY * eps) however small they are, and dQ, dK multiply that
    # error by |K| scale, |Q| scale: count dp as at least 2 Ev F32_TINY
    dp = np.maximum(dp, 2 * v.shape[-1] * F32_TINY)

    def per_key(row_values):  # sum_i P_ij x_i, then over the query heads of each kv head
        per_head = np.einsum("...ls,...l->...s", P, row_values)  # (..., Hq, S)
        return per_head.reshape(*per_head.shape[:-2], -1, group, per_head.shape[-1]).sum(-2)

    sizes["dq"] = sc * big(k) * dp * w
    sizes["dk"] = sc * big(q) * per_key(dp * w)
    sizes["dv"] = per_key(np.max(np.abs(d_out), axis=-1, initial=0.0) * w)
    return sizes


def natural_sizes(q, k, v, mask=None, scale=None, group=1, d_out=None) -> dict[str, float]:
    """`row_natural_sizes` at their largest: one size per quantity."""
    rows = row_natural_sizes(q, k, v, mask, scale, group, d_out)
    return {name: float(np.max(size, initial=0.0)) for name, size in rows.items()}


def _clip(x) -> np.ndarray:
    return np.clip(np.asarray(x, dtype=np.float64), -F32_MAX, F32_MAX)


def assert_like_truth(ours, oracle32, truth64, natural: float, what: str, factor: float = 2.0):
    """conftest's budget against the float64 truth, for results that may pass float32's
    range: no NaN; values beyond float32 compare as float32's largest (inf is right
    there); torch's float32 entries that overflowed count as the truth rounded."""
    ours = np.asarray(ours, dtype=np.float64)
    assert not np.isnan(ours).any(), f"{what}: NaN from finite inputs"
    truth = _clip(truth64)
    oracle = np.asarray(oracle32, dtype=np.float64)
    oracle = np.where(np.isfinite(oracle), oracle, truth.astype(np.float32))
    # Results in float32's subnormal range round to a fixed step, 2^-149, not to
    # relative ulps: a natural size of at least 8 times the smallest normal number
    # (2^-126) makes the epsilon 64 such steps, room for a sum of that many roundings.
    natural = max(natural, 8 * F32_TINY)
    return assert_within_budget(_clip(ours), _clip(oracle), truth, what, factor=factor, scale=natural)


def mha_natural_size(query, key, value, weights: dict, num_heads: int, mask=None) -> float:
    """The natural size of a multi-head attention layer's output: its heads'
    (`natural_sizes`, on the float64 projections of query, key and value) through
    out_proj, times the largest row sum of |W_o|. `weights` holds q, k, v, o
    weights (out, in) and biases (or None) as arrays: q_w, q_b, ..., o_w, o_b."""
    def project(x, name):
        w, b = (np.asarray(weights[f"{name}_{p}"], dtype=np.float64) if weights[f"{name}_{p}"] is not None
                else None for p in ("w", "b"))
        y = np.asarray(x, dtype=np.float64) @ w.T + (0.0 if b is None else b)  # (B, N, D)
        return y.reshape(*y.shape[:-1], num_heads, -1).swapaxes(-2, -3)  # (B, H, N, E)

    q, k, v = project(query, "q"), project(key, "k"), project(value, "v")
    heads = natural_sizes(q, k, v, mask)["out"]
    return heads * float(np.abs(np.asarray(weights["o_w"], dtype=np.float64)).sum(-1).max())
