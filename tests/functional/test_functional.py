"""The NumPy core: the softmax family, scaled_dot_product_attention and its
backward, and the masks, against a float64 reference, torch (SDPA, autograd,
its causal bias classes) and finite differences.

float64 results meet the float64 truth to ~1e-10. float32 and float16 results
never meet an absolute threshold: their error against the float64 truth must
stay within conftest.assert_within_budget's budget, set by torch's own error
in the same dtype on the same (already rounded) inputs.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import attnkit
from attnkit import masks
from attnkit.functional import (
    AttentionGrads,
    AttentionOutput,
    scaled_dot_product_attention as sdpa,
    scaled_dot_product_attention_backward as sdpa_backward,
)
from conftest import F32_EPS, assert_close, assert_within_budget, max_rel_err, optional, reference_attention, score_conditioning
from wide_range import EXPONENTS, SCALES, assert_like_truth, natural_sizes, torch_math, wide

torch = optional("torch")
F = torch.nn.functional if torch else None

DTYPES = [np.float16, np.float32, np.float64]
F64_EPS = float(np.finfo(np.float64).eps)
F16_EPS = float(np.finfo(np.float16).eps)
# The budget's epsilon, in float32 ulps at max|truth| (assert_within_budget's unit):
# 8 for float32 (conftest's default); for float16, storing the result in float16
# alone costs half a float16 ulp, so 2 float16 ulps (2 * 2^-10 / 2^-23 float32 ulps).
ULPS = {np.float32: 8.0, np.float16: 2 * F16_EPS / F32_EPS}


def T(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def tdtype(dtype):
    return getattr(torch, np.dtype(dtype).name)


def torch_sdpa(q, k, v, mask=None, dtype=np.float64, **kw):
    """torch's SDPA computing in `dtype` on the (already rounded) inputs. Fully
    masked rows come back as 0 (torch's math path gives 0 there, other kernels NaN)."""
    td = tdtype(dtype)
    m = None if mask is None else (T(mask) if np.asarray(mask).dtype == np.bool_ else T(mask).to(td))
    out = F.scaled_dot_product_attention(T(q).to(td), T(k).to(td), T(v).to(td), attn_mask=m, **kw)
    return np.nan_to_num(out.double().numpy())


def assert_budget(actual, oracle, truth, dtype, what, factor=2.0, natural=None):
    """A float32 or float16 result against the float64 truth: entries where the
    truth is infinite (a -inf lse, an inf logsumexp) must be matched exactly, the
    finite ones meet the budget set by the oracle's error in the same dtype, its
    epsilon counted at `natural` (see conftest.score_conditioning) when given."""
    actual, oracle, truth = (np.asarray(a, dtype=np.float64) for a in (actual, oracle, truth))
    finite = np.isfinite(truth)
    np.testing.assert_array_equal(actual[~finite], truth[~finite], err_msg=what)
    assert_within_budget(actual[finite], oracle[finite], truth[finite], what=what, factor=factor, ulps=ULPS[dtype],
                         scale=natural)


def check_result(actual, truth, oracle, dtype, what, factor=2.0, natural=None):
    """float64: within 1e-10 of the float64 truth (relative to its largest entry).
    float32/float16: the budget; `oracle` is a callable giving torch's result in
    that dtype (only called there)."""
    if dtype == np.float64:
        truth = np.asarray(truth)
        finite = np.isfinite(truth)
        np.testing.assert_array_equal(actual[~finite], truth[~finite], err_msg=what)
        if finite.any():
            assert_close(actual[finite], truth[finite], 1e-10, what)
    else:
        assert_budget(actual, oracle(), truth, dtype, what, factor, natural)


# ================================================================ softmax family


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_family_huge_logits_minus_inf_entries_and_rows_sum_to_one(torch, dtype):
    big = 3e4 if dtype == np.float16 else 3e8  # float16 tops out at 65504
    x = np.array([[1e4, -1e4, 0.0, -np.inf], [-np.inf, big, big, -np.inf],
                  [1e4, 1e4 + 1, 1e4 + 2, -np.inf], [-1e4, 0.0, 1e4, -np.inf]]).astype(dtype)
    t64 = T(x.astype(np.float64))
    for name, ours, f in [("softmax", attnkit.softmax(x, axis=1), torch.softmax),
                          ("log_softmax", attnkit.log_softmax(x, axis=1), torch.log_softmax),
                          ("logsumexp", attnkit.logsumexp(x, axis=1), torch.logsumexp)]:
        assert ours.dtype == dtype
        assert not np.isnan(ours).any()
        check_result(ours, f(t64, 1).numpy(), lambda: f(T(x), 1).double().numpy(), dtype, name)
    # each row sums to one: at most one rounding per term (n terms) and per partial sum
    p = attnkit.softmax(x, axis=1).astype(np.float64)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=2 * x.shape[1] * float(np.finfo(dtype).eps))


def test_softmax_all_masked_row_is_zero_not_nan(torch):
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 1.0]], dtype=np.float32)
    p = attnkit.softmax(x)
    assert p.dtype == np.float32
    assert np.array_equal(p[0], np.zeros(3))
    truth = torch.softmax(T(x[1].astype(np.float64)), -1).numpy()
    assert_budget(p[1], torch.softmax(T(x[1]), -1).numpy(), truth, np.float32, "softmax")
    assert np.isneginf(attnkit.logsumexp(x)[0])
    assert np.isneginf(attnkit.log_softmax(x)[0]).all()


@given(
    st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=1, max_size=20),
    st.sampled_from(DTYPES),
)
def test_softmax_family_matches_torch(torch, values, dtype):
    x = np.array(values, dtype=dtype).reshape(1, -1)
    t64 = T(x.astype(np.float64))
    for name, ours, f in [
        ("softmax", attnkit.softmax(x), torch.softmax),
        ("log_softmax", attnkit.log_softmax(x), torch.log_softmax),
        ("logsumexp", attnkit.logsumexp(x), torch.logsumexp),
    ]:
        assert ours.dtype == dtype
        assert np.isfinite(ours).all()
        check_result(ours, f(t64, -1).numpy(), lambda: f(T(x), -1).double().numpy(), dtype, name)


def test_logsumexp_of_a_row_holding_inf_is_inf_like_torch(torch):
    x = np.array([[np.inf, 1.0], [np.inf, -np.inf], [-np.inf, -np.inf], [np.nan, 1.0], [1.0, 2.0]])
    ours = attnkit.logsumexp(x)
    theirs = torch.logsumexp(T(x), -1).numpy()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    np.testing.assert_allclose(ours[~np.isnan(ours)], theirs[~np.isnan(theirs)], rtol=1e-15)
    assert ours[0] == np.inf and ours[2] == -np.inf


def test_softmax_family_on_an_empty_axis_and_a_scalar_matches_torch(torch):
    empty = np.zeros((3, 0))
    assert attnkit.softmax(empty).shape == (3, 0)
    assert attnkit.log_softmax(empty).shape == (3, 0)
    np.testing.assert_array_equal(attnkit.logsumexp(empty), torch.logsumexp(T(empty), -1).numpy())  # -inf
    for f, tf in [(attnkit.softmax, torch.softmax), (attnkit.log_softmax, torch.log_softmax),
                  (attnkit.logsumexp, torch.logsumexp)]:
        assert float(f(np.float64(2.5))) == float(tf(torch.tensor(2.5, dtype=torch.float64), -1))


@pytest.mark.parametrize("axis", [0, 1, -1, (0, 2), (-1, -2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_logsumexp_axes_and_keepdims_match_torch(torch, axis, keepdims):
    x = np.random.default_rng(0).standard_normal((3, 4, 5)) * 50
    ours = attnkit.logsumexp(x, axis=axis, keepdims=keepdims)
    theirs = torch.logsumexp(T(x), dim=axis, keepdim=keepdims).numpy()
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-13)


def test_softmax_axis_and_integer_input():
    x = np.arange(12).reshape(3, 4)
    p = attnkit.softmax(x, axis=0)
    assert p.dtype == np.float64
    np.testing.assert_allclose(p.sum(axis=0), 1.0, rtol=6 * F64_EPS)  # 3 terms, 3 roundings each
    with pytest.raises(TypeError, match="real numbers"):
        attnkit.softmax(np.array(["a", "b"]))


def test_softmax_family_rejects_non_real_input():
    for f in (attnkit.softmax, attnkit.log_softmax, attnkit.logsumexp):
        with pytest.raises(TypeError, match="real numbers.*bool"):
            f(np.array([True, False]))
        with pytest.raises(TypeError, match="real numbers.*complex"):
            f(np.array([1 + 1j]))


# ================================================================ SDPA forward


@st.composite
def attention_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=3)))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    L = draw(st.one_of(st.integers(1, 7), st.just(17)))
    S = draw(st.one_of(st.integers(1, 7), st.just(16)))
    E = draw(st.sampled_from([1, 3, 4, 8, 59, 111]))
    Ev = draw(st.sampled_from([E, 5, 7]))
    mask_kind = draw(st.sampled_from(["none", "causal", "bool", "float", "bool_bcast", "float_bcast"]))
    scale = draw(st.sampled_from([None, 0.0, 0.3, 1.7, -1.7]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, batch, kv_heads, group, L, S, E, Ev, mask_kind, scale, seed


def _case_mask(rng, kind, scores_shape, dtype):
    """bool/float: a random broadcastable shape (trailing dims dropped or set to 1),
    float with -inf entries; bool_bcast: (L, S), rows fully masked now and then;
    float_bcast: (1, L, S), finite."""
    if kind in ("none", "causal"):
        return None
    L, S = scores_shape[-2:]
    if kind == "bool_bcast":
        return rng.random((L, S)) > 0.5
    if kind == "float_bcast":
        return (rng.standard_normal((1, L, S)) * 2).astype(dtype)
    ndim = rng.integers(1, len(scores_shape) + 1)
    shape = [d if rng.random() < 0.6 else 1 for d in scores_shape[-ndim:]]
    if kind == "bool":
        return rng.random(shape) < 0.7
    m = rng.standard_normal(shape) * 2
    m[rng.random(shape) < 0.25] = -np.inf
    return m.astype(dtype)


def _torch_weights_and_lse(q, k, group, scale, mask, causal, dtype):
    """The math path in torch: softmax and logsumexp of the masked scaled scores,
    computed in `dtype` (float16 computes in float32 like attnkit, then rounds)."""
    cd = torch.float32 if dtype == np.float16 else tdtype(dtype)
    tq, tk = T(q).to(cd), T(np.repeat(k, group, axis=-3)).to(cd)
    scores = tq @ tk.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    L, S = scores.shape[-2:]
    if causal:
        scores = scores.masked_fill(~T(masks.causal_mask(L, S)), -math.inf)
    elif mask is not None and mask.dtype == np.bool_:
        scores = scores.masked_fill(~T(np.broadcast_to(mask, scores.shape).copy()), -math.inf)
    elif mask is not None:
        scores = scores + T(mask).to(cd)
    td = tdtype(dtype)
    weights = torch.softmax(scores, -1).nan_to_num(0.0).to(td).double().numpy()  # fully masked rows: 0
    return weights, torch.logsumexp(scores, -1).to(td).double().numpy()


@given(attention_case())
@settings(max_examples=60)
def test_sdpa_matches_torch_and_reference(torch, case):
    dtype, batch, kv_heads, group, L, S, E, Ev, mask_kind, scale, seed = case
    rng = np.random.default_rng(seed)
    H = kv_heads * group
    q = rng.standard_normal((*batch, H, L, E)).astype(dtype)
    k = rng.standard_normal((*batch, kv_heads, S, E)).astype(dtype)
    v = rng.standard_normal((*batch, kv_heads, S, Ev)).astype(dtype)
    mask = _case_mask(rng, mask_kind, (*batch, H, L, S), dtype)
    causal = mask_kind == "causal"
    out = sdpa(q, k, v, mask, is_causal=causal, scale=scale, enable_gqa=group > 1, return_weights=True, return_lse=True)
    assert out.output.dtype == dtype and out.output.shape == (*batch, H, L, Ev)
    assert out.weights.shape == (*batch, H, L, S) and out.lse.shape == (*batch, H, L)
    assert not np.isnan(out.output).any() and not np.isnan(out.weights).any()

    ref_mask = masks.causal_mask(L, S) if causal else mask
    truth, truth_w, truth_lse = reference_attention(q, k, v, ref_mask, scale, group)

    def torch_out(dt):
        if causal and (scale is None or scale > 0):
            return torch_sdpa(q, k, v, None, dt, is_causal=True, scale=scale, enable_gqa=group > 1)
        # torch 2.13's is_causal with a scale <= 0 gives NaN (the -inf of its causal bias
        # gets scaled too), so the causal mask goes in explicitly; torch takes no 1-D masks
        full = None if ref_mask is None else np.broadcast_to(ref_mask, (*batch, H, L, S)).copy()
        return torch_sdpa(q, k, v, full, dt, scale=scale, enable_gqa=group > 1)

    # torch in float64 is a second float64 truth, and must agree with the reference
    assert_close(torch_out(np.float64), truth, 1e-10, "torch float64 vs reference")
    size = score_conditioning(q, k, scale, group)
    vmax = float(np.abs(v).max()) if v.size else 0.0
    check_result(out.output, truth, lambda: torch_out(dtype), dtype, "output", natural=vmax * size)
    oracle = None if dtype == np.float64 else _torch_weights_and_lse(q, k, group, scale, mask, causal, dtype)
    check_result(out.weights, truth_w, lambda: oracle[0], dtype, "weights", natural=size)
    np.testing.assert_array_equal(np.isneginf(out.lse), np.isneginf(truth_lse))
    check_result(out.lse, truth_lse, lambda: oracle[1], dtype, "lse", natural=size)


MASK_SHAPES = [(6,), (1, 6), (4, 6), (3, 1, 6), (3, 4, 6), (2, 1, 1, 6), (2, 3, 4, 6), (5, 2, 1, 1, 6),
               (5, 1, 3, 4, 1), (1, 1, 1, 1, 1), ()]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_every_broadcastable_mask_rank(torch, shape, kind):
    rng = np.random.default_rng(len(shape))
    q = rng.standard_normal((5, 2, 3, 4, 8))
    k = rng.standard_normal((5, 2, 3, 6, 8))
    v = rng.standard_normal((5, 2, 3, 6, 7))
    mask = rng.random(shape) < 0.6 if kind == "bool" else np.where(rng.random(shape) < 0.6, rng.standard_normal(shape), -np.inf)
    ours = sdpa(q, k, v, mask)
    full = np.broadcast_to(mask, (5, 2, 3, 4, 6)).copy()  # torch gets the explicit full-size mask
    np.testing.assert_allclose(ours, torch_sdpa(q, k, v, full), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("shape", [(2, 4, 7), (4, 5), (7, 2, 3, 4, 6), (2, 4, 6)], ids=str)
def test_masks_that_do_not_broadcast_name_expected_and_got(shape):
    q = np.zeros((5, 2, 3, 4, 8))
    k = v = np.zeros((5, 2, 3, 6, 8))
    with pytest.raises(ValueError, match=rf"attn_mask broadcastable to .*\(5, 2, 3, 4, 6\).*got \({shape[0]}"):
        sdpa(q, k, v, np.ones(shape, bool))


@pytest.mark.parametrize("L,S", [(6, 3), (3, 6), (1, 5), (5, 1), (1, 1), (4, 4)])
def test_is_causal_is_top_left_for_any_L_and_S(torch, L, S):
    rng = np.random.default_rng(L * 10 + S)
    q, k, v = rng.standard_normal((2, 3, L, 16)), rng.standard_normal((2, 3, S, 16)), rng.standard_normal((2, 3, S, 4))
    out = sdpa(q, k, v, is_causal=True, return_weights=True)
    np.testing.assert_allclose(out.output, torch_sdpa(q, k, v, is_causal=True), rtol=1e-12, atol=1e-14)
    # weight exactly where the top-left causal mask allows, nowhere else
    np.testing.assert_array_equal(out.weights > 0, np.broadcast_to(np.tril(np.ones((L, S), bool)), out.weights.shape))
    assert not out.weights[..., ~masks.causal_mask(L, S)].any()
    np.testing.assert_array_equal(out.output, sdpa(q, k, v, masks.causal_mask(L, S)))


def test_no_keys_gives_zeros_like_torch_and_zero_gradients(torch):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3, 4, 8)), np.zeros((2, 3, 0, 8)), np.zeros((2, 3, 0, 5))
    out = sdpa(q, k, v, return_weights=True, return_lse=True)
    np.testing.assert_array_equal(out.output, torch_sdpa(q, k, v))
    assert out.output.shape == (2, 3, 4, 5) and not out.output.any()
    assert out.weights.shape == (2, 3, 4, 0) and np.isneginf(out.lse).all()
    grads = sdpa_backward(np.ones((2, 3, 4, 5)), q, k, v)
    assert not grads.grad_query.any() and grads.grad_key.shape == (2, 3, 0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_are_zero_with_lse_minus_inf_and_zero_gradients(dtype):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, 4, 8)).astype(dtype) for _ in range(3))
    allowed = rng.random((2, 1, 4, 4)) < 0.7
    allowed[:, :, 1] = False
    outputs = []
    for mask in (allowed, masks.to_additive(allowed, dtype)):
        out = sdpa(q, k, v, mask, return_weights=True, return_lse=True)
        assert out.output.dtype == dtype and not np.isnan(out.output).any()
        assert not out.output[:, :, 1].any() and not out.weights[:, :, 1].any()
        assert np.isneginf(out.lse[:, :, 1]).all() and np.isfinite(out.lse[:, :, [0, 2, 3]]).all()
        g = sdpa_backward(np.ones_like(out.output), q, k, v, mask)
        for grad in g:
            assert grad.dtype == dtype and np.isfinite(grad).all()
        assert not g.grad_query[:, :, 1].any()
        outputs.append(out.output)
    # an additive mask adds exactly 0 or -inf: the same result as the boolean mask
    np.testing.assert_array_equal(outputs[1], outputs[0])
    # a 2-D call: queries 1 and 2 see no key
    mask2 = np.zeros((4, 3), bool)
    mask2[0, :2] = True
    mask2[3] = True
    g = sdpa_backward(np.ones((4, 8), dtype), q[0, 0], k[0, 0, :3], v[0, 0, :3], attn_mask=mask2)
    assert all(np.isfinite(grad).all() for grad in g)
    assert not g.grad_query[1:3].any()
    # every row masked: output zeros, not NaN
    none = np.zeros((4, 4), bool)
    assert not sdpa(q, k, v, none).any() and not sdpa(q, k, v, masks.to_additive(none, dtype)).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_match_torch(torch, dtype):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, 4, 8)).astype(dtype) for _ in range(3))
    allowed = rng.random((2, 1, 4, 4)) < 0.7
    allowed[:, :, 1] = False
    truth = reference_attention(q, k, v, allowed)[0]
    for mask in (allowed, masks.to_additive(allowed, dtype)):
        out = sdpa(q, k, v, mask)
        check_result(out, truth, lambda: torch_sdpa(q, k, v, mask, dtype), dtype, "output")


def test_float16_mask_with_float16_inputs_matches_torch_float16(torch):
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 7, 16)).astype(np.float16) for _ in range(3))
    m = np.where(rng.random((7, 7)) < 0.7, rng.standard_normal((7, 7)), -np.inf).astype(np.float16)
    ours = sdpa(q, k, v, m)
    assert ours.dtype == np.float16
    # no worse than torch's own float16 against the float64 truth
    assert_budget(ours, torch_sdpa(q, k, v, m, np.float16), torch_sdpa(q, k, v, m), np.float16, "float16 output")


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_logits_match_torch_and_never_give_nan(torch, dtype):
    rng = np.random.default_rng(3)
    q = (rng.standard_normal((2, 4, 8)) * (1e4 if dtype != np.float16 else 2e2)).astype(dtype)
    k, v = rng.standard_normal((2, 5, 8)).astype(dtype), rng.standard_normal((2, 5, 8)).astype(dtype)
    out = sdpa(q, k, v, scale=1.0)
    assert np.isfinite(out).all()
    check_result(out, torch_sdpa(q, k, v, scale=1.0), lambda: torch_sdpa(q, k, v, None, dtype, scale=1.0), dtype, "output")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates_only_where_it_touches(dtype):
    rng = np.random.default_rng(3)
    q = (rng.standard_normal((2, 4, 8)) * (1e4 if dtype != np.float16 else 2e2)).astype(dtype)
    k, v = rng.standard_normal((2, 5, 8)).astype(dtype), rng.standard_normal((2, 5, 8)).astype(dtype)
    qn = q.copy()
    qn[0, 1, 3] = np.nan
    out = sdpa(qn, k, v, scale=1.0)
    assert np.isnan(out[0, 1]).all() and not np.isnan(np.delete(out[0], 1, axis=0)).any() and not np.isnan(out[1]).any()
    kn = k.copy()
    kn[1, 2, 0] = np.nan
    out = sdpa(q, kn, v, scale=1.0)
    assert np.isnan(out[1]).all() and not np.isnan(out[0]).any()
    # a NaN in a key that is also the value: every output of that sequence is NaN, like torch
    out = sdpa(q, kn, kn, scale=1.0)
    assert np.isnan(out[1]).all() and not np.isnan(out[0]).any()


def test_result_fields_for_each_combination_of_extras_and_2d_inputs():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, 4, 8)), rng.standard_normal((3, 5, 8)), rng.standard_normal((3, 5, 2))
    plain = sdpa(q, k, v)
    assert isinstance(plain, np.ndarray) and not isinstance(plain, tuple)
    for rw, rl in [(True, False), (False, True), (True, True)]:
        r = sdpa(q, k, v, return_weights=rw, return_lse=rl)
        assert isinstance(r, AttentionOutput) and isinstance(r, attnkit.AttentionOutput)
        assert r._fields == ("output", "weights", "lse")
        np.testing.assert_array_equal(r.output, plain)
        assert (r.weights is not None) == rw and (r.lse is not None) == rl
    # 2-D inputs: (L, E), (S, E), (S, Ev)
    out = sdpa(q[0], k[0], v[0])
    assert isinstance(out, np.ndarray) and out.shape == (4, 2)
    r = sdpa(q[0], k[0], v[0], return_weights=True, return_lse=True)
    assert r.output.shape == (4, 2) and r.weights.shape == (4, 5) and r.lse.shape == (4,)
    ref, ref_w, ref_lse = reference_attention(q[:1], k[:1], v[:1])
    assert_close(r.output, ref[0], 1e-12, "2-D output")
    assert_close(r.weights, ref_w[0], 1e-12, "2-D weights")
    np.testing.assert_allclose(r.weights @ v[0], r.output, rtol=1e-13)
    scores = q[0] @ k[0].T / math.sqrt(8)
    np.testing.assert_allclose(r.lse, np.log(np.exp(scores).sum(-1)), rtol=1e-13)
    np.testing.assert_allclose(r.lse, ref_lse[0], rtol=1e-13)


def test_float32_stays_float32_with_numpy_scalar_scale():
    q = np.ones((1, 2, 4), dtype=np.float32)
    out = attnkit.scaled_dot_product_attention(q, q, q, scale=np.float64(0.5))
    assert out.dtype == np.float32


def test_gqa_maps_query_head_to_kv_head_h_div_group_with_masks_over_heads(torch):
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 6, 4, 8)), rng.standard_normal((2, 2, 5, 8)), rng.standard_normal((2, 2, 5, 3))
    for mask in (rng.random((6, 4, 5)) < 0.7, rng.random((2, 1, 4, 5)) < 0.7, np.where(rng.random((2, 6, 1, 5)) < 0.7, 0.5, -np.inf)):
        ours = sdpa(q, k, v, mask, enable_gqa=True)
        np.testing.assert_allclose(ours, torch_sdpa(q, k, v, mask, enable_gqa=True), rtol=1e-12, atol=1e-14)
        for h in range(6):  # by hand: head h reads kv head h // 3
            hm = np.broadcast_to(mask, (2, 6, 4, 5))[:, h]
            np.testing.assert_allclose(ours[:, h], sdpa(q[:, h], k[:, h // 3], v[:, h // 3], hm), rtol=1e-13, atol=1e-15)


# ================================================================ dropout

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "q_shape, kv_shape, kw",
    [
        ((1, 9, 1, 64), (1, 3, 90, 64), dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)),  # decode
        ((2, 4, 1, 16), (2, 1, 7, 16), dict(is_causal=True, causal_align="bottom_right")),  # one kv head stretches
        ((3, 5, 8), (3, 11, 8), dict(scale=0.3)),  # rank 3, not causal
        ((2, 2, 4, 6, 8), (2, 2, 4, 1, 8), dict(is_causal=True)),  # top-left over a single key
    ],
)
def test_calls_that_mask_nothing_give_the_general_paths_bits(dtype, q_shape, kv_shape, kw):
    """A call with no mask of any kind (a decode step's) takes a short path; it must
    give exactly the bits of the general path, which an all-True padding mask forces."""
    from attnkit.functional.attention import _unmasked

    rng = np.random.default_rng(11)
    q = rng.standard_normal(q_shape).astype(dtype) * 3
    cache = rng.standard_normal((*kv_shape[:-2], kv_shape[-2] + 5, kv_shape[-1])).astype(dtype)  # a cache's view
    k, v = cache[..., : kv_shape[-2], :], cache[..., 5:, :]
    args = (kw.get("is_causal", False), kw.get("scale"), kw.get("enable_gqa", False), kw.get("causal_align", "top_left"))
    assert _unmasked(q, k, v, 0.0, *args) is not None  # the short path is taken
    everything = np.ones(kv_shape[-2], dtype=bool)
    short, general = sdpa(q, k, v, **kw), sdpa(q, k, v, key_padding_mask=everything, **kw)
    assert short.dtype == dtype and short.shape == general.shape
    np.testing.assert_array_equal(short, general)
    # and, as a sanity check on top of the general path's own tests, the float64 truth (no key is masked)
    truth = reference_attention(q, k, v, scale=kw.get("scale"), gqa_group=q_shape[-3] // kv_shape[-3])[0]
    assert_close(short, truth, rtol=2e-5 if dtype == np.float32 else 1e-13, what="unmasked call")


def test_calls_that_mask_nothing_leave_overflow_to_the_general_path(torch):
    """Scores beyond float32's range: the short path declines (no NaN, no warning) and the
    answer is the general path's float64 one, torch's math backend's."""
    from attnkit.functional.attention import _unmasked

    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((1, 2, 1, 8)).astype(np.float32) * 3e19 for _ in range(3))
    assert _unmasked(q, k, v, 0.0, True, None, False, "bottom_right") is None
    out = sdpa(q, k, v, is_causal=True, causal_align="bottom_right")
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, torch_sdpa(q, k, v), rtol=1e-6)


def test_dropout_is_reproducible_rescaled_and_drawn_from_the_given_generator():
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((4, 8, 16)), rng.standard_normal((4, 32, 16)), rng.standard_normal((4, 32, 16))
    clean = sdpa(q, k, v, return_weights=True)
    a = sdpa(q, k, v, dropout_p=0.3, rng=np.random.default_rng(9), return_weights=True)
    b = sdpa(q, k, v, dropout_p=0.3, rng=np.random.default_rng(9), return_weights=True)
    c = sdpa(q, k, v, dropout_p=0.3, rng=9, return_weights=True)  # an integer seed works too
    np.testing.assert_array_equal(a.output, b.output)
    np.testing.assert_array_equal(a.output, c.output)
    kept = a.weights != 0
    np.testing.assert_allclose(a.weights[kept], clean.weights[kept] / 0.7, rtol=1e-13)
    # the kept fraction of 4*8*32 = 1024 weights: standard deviation sqrt(0.3*0.7/1024) = 0.014; 0.05 is 3.5 of them
    assert abs(1 - kept.mean() - 0.3) < 0.05
    np.testing.assert_allclose(a.output, a.weights @ v, rtol=1e-12)
    assert not np.array_equal(sdpa(q, k, v, dropout_p=0.3, rng=np.random.default_rng(10)), a.output)
    # the expectation over many draws is the clean output (1/(1-p) rescaling): with N draws the
    # mean of output[i, c] = sum_j w_ij m_j v_jc / (1-p) has variance p/(1-p) sum_j w_ij^2 v_jc^2 / N;
    # every entry must sit within 5 standard deviations (a chance of 6e-7 each)
    g = np.random.default_rng(11)
    for p in (0.3, 0.5):
        draws = 400
        mean = np.mean([sdpa(q[:1], k[:1], v[:1], dropout_p=p, rng=g) for _ in range(draws)], axis=0)
        w = clean.weights[:1]
        sigma = np.sqrt(p / (1 - p) * ((w**2) @ (v[:1] ** 2)) / draws)
        z = np.abs(mean - clean.output[:1]) / sigma
        assert z.max() < 5, f"p={p}: the mean of {draws} dropout draws is {z.max():.1f} standard deviations off"
    # global NumPy state untouched
    state = np.random.get_state()[1].copy()
    sdpa(q, k, v, dropout_p=0.5)
    np.testing.assert_array_equal(np.random.get_state()[1], state)


@pytest.mark.parametrize("bad,exc", [("seed", TypeError), (1.5, TypeError), (True, TypeError), (-1, ValueError)])
def test_dropout_rejects_a_bad_rng(bad, exc):
    x = np.zeros((2, 3, 4))
    with pytest.raises(exc, match="rng"):
        sdpa(x, x, x, dropout_p=0.5, rng=bad)


# ================================================================ backward


def _torch_grads(q, k, v, d_out, mask=None, dtype=np.float64, **kw):
    """torch autograd through its SDPA, computing in `dtype` on the (rounded) inputs."""
    td = tdtype(dtype)
    tq, tk, tv = (T(x).to(td).requires_grad_() for x in (q, k, v))
    m = None if mask is None else (T(mask) if mask.dtype == np.bool_ else T(mask).to(td))
    F.scaled_dot_product_attention(tq, tk, tv, attn_mask=m, **kw).backward(T(d_out).to(td))
    return [x.grad.double().numpy() for x in (tq, tk, tv)]


@given(attention_case())
def test_backward_matches_torch_autograd(torch, case):
    batch, kv_heads, group, L, S, E, Ev, mask_kind, scale, seed = case[1:]
    rng = np.random.default_rng(seed)
    Hq = kv_heads * group
    q = rng.standard_normal((*batch, Hq, L, E))
    k = rng.standard_normal((*batch, kv_heads, S, E))
    v = rng.standard_normal((*batch, kv_heads, S, Ev))
    d_out = rng.standard_normal((*batch, Hq, L, Ev))
    mask, is_causal = None, False
    if mask_kind == "causal":
        is_causal = True
    elif mask_kind in ("bool", "bool_bcast"):
        mask = rng.random((L, S)) > 0.3
        mask[..., 0] = True  # torch's gradient is NaN on fully masked rows; ours is 0 (tested above)
    elif mask_kind in ("float", "float_bcast"):
        mask = rng.standard_normal((1, L, S))
    grads = attnkit.scaled_dot_product_attention_backward(
        d_out, q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
    )
    if is_causal and scale is not None and scale <= 0:  # torch's is_causal: NaN for scale <= 0
        expected = _torch_grads(q, k, v, d_out, masks.causal_mask(L, S), scale=scale, enable_gqa=group > 1)
    else:
        expected = _torch_grads(q, k, v, d_out, mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1)
    # Relative to each gradient's natural size, not to max|torch's|: with one key
    # (S = 1) dQ and dK are exactly 0 here and torch's are its rounding, ~1e-13.
    sc = 1.0 / np.sqrt(E) if scale is None else abs(scale)
    dp_abs = float((np.abs(d_out) @ np.swapaxes(np.abs(np.repeat(v, group, -3)), -1, -2)).max())
    sizes = (dp_abs * np.abs(k).max() * sc, dp_abs * np.abs(q).max() * sc, np.abs(d_out).max())
    for name, ours, theirs, size in zip(("query", "key", "value"), grads, expected, sizes):
        assert ours.shape == theirs.shape, name
        err = float(np.abs(ours - theirs).max()) if ours.size else 0.0
        assert err <= 1e-10 * max(float(np.abs(theirs).max(initial=0)), size), (
            f"grad_{name}: error {err:.3e} against torch's float64, size {size:.3e}")


VARIANTS = ["plain", "gqa", "float_mask", "causal_L_gt_S", "causal_L_lt_S", "scale"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_backward_matches_torch_autograd_in_every_dtype(torch, dtype, variant):
    rng = np.random.default_rng(zlib.crc32(variant.encode()) % 1000)  # a seed that is the same in every process
    Hq, Hkv, L, S = (6, 2, 5, 7) if variant == "gqa" else (2, 2, 5, 7)
    if variant == "causal_L_gt_S":
        L, S = 7, 4
    q = rng.standard_normal((2, Hq, L, 59)).astype(dtype)
    k = rng.standard_normal((2, Hkv, S, 59)).astype(dtype)
    v = rng.standard_normal((2, Hkv, S, 11)).astype(dtype)
    g = rng.standard_normal((2, Hq, L, 11)).astype(dtype)
    kw, mask = {}, None
    if variant == "gqa":
        kw["enable_gqa"] = True
        mask = rng.random((Hq, L, S)) < 0.7
    if variant == "float_mask":
        mask = np.where(rng.random((2, 1, L, S)) < 0.7, rng.standard_normal((2, 1, L, S)), -np.inf).astype(dtype)
        mask[0, 0, 2] = -np.inf  # one fully masked row
    if variant.startswith("causal"):
        kw["is_causal"] = True
    if variant == "scale":
        kw["scale"] = 0.37
    ours = sdpa_backward(g, q, k, v, mask, **kw)
    assert isinstance(ours, AttentionGrads)
    truth = _torch_grads(q, k, v, g, mask, **kw)
    oracle = None if dtype == np.float64 else [np.nan_to_num(x) for x in _torch_grads(q, k, v, g, mask, dtype, **kw)]
    for i, (name, mine, t64) in enumerate(zip(("query", "key", "value"), ours, truth)):
        assert mine.dtype == dtype and mine.shape == t64.shape
        assert not np.isnan(mine).any()
        check_result(mine, t64, lambda: oracle[i], dtype, f"{variant} grad_{name}", factor=3.0)


FD_CASES = {
    # GQA over a broadcast key head, a row with a single key, scale 0.7
    "gqa": dict(q=(2, 3, 5), k=(1, 4, 5), v=(1, 4, 2), enable_gqa=True, scale=0.7,
                mask=np.array([[True, True, False, True], [True, False, False, False], [True, True, True, True]])),
    # two batches, a random mask, scale 0.8
    "batched": dict(q=(2, 3, 4), k=(2, 5, 4), v=(2, 5, 3), enable_gqa=False, scale=0.8, mask="random"),
}


@pytest.mark.parametrize("case", list(FD_CASES))
def test_backward_matches_finite_differences(case):
    c = FD_CASES[case]
    rng = np.random.default_rng(5 if case == "gqa" else 12)
    q, k, v = (rng.standard_normal(c[x]) for x in "qkv")
    mask = c["mask"]
    if isinstance(mask, str):
        mask = rng.random((3, 5)) < 0.7
        mask[:, 0] = True
    d_out = rng.standard_normal((*np.broadcast_shapes(c["q"][:-1], c["v"][:-2] + (1,)), c["v"][-1]))
    kw = dict(attn_mask=mask, enable_gqa=c["enable_gqa"], scale=c["scale"])
    grads = sdpa_backward(d_out, q, k, v, **kw)

    def loss(q_, k_, v_):
        return float(np.sum(sdpa(q_, k_, v_, **kw) * d_out))

    # central differences in float64: truncation h^2 |f'''| ~ 1e-12, rounding eps64 |loss| / h ~ 1e-9,
    # against gradients of order 1
    h = 1e-6
    for which, (x, g) in enumerate(zip((q, k, v), grads)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[which][idx] += h
            up = loss(*args)
            args[which][idx] -= 2 * h
            numeric[idx] = (up - loss(*args)) / (2 * h)
        assert max_rel_err(g, numeric) < 1e-7, f"input {which}"


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, gqa",
    [
        ((2, 3, 4, 8), (1, 3, 5, 8), (1, 3, 5, 8), False),  # batch dim of 1 stretches
        ((3, 4, 8), (2, 3, 5, 8), (2, 3, 5, 8), False),  # ranks differ
        ((2, 3, 4, 8), (2, 1, 5, 8), (2, 1, 5, 8), False),  # one key/value head for all
        ((2, 1, 4, 8), (2, 3, 5, 8), (2, 3, 5, 6), False),  # one query head for all
        ((2, 6, 4, 8), (1, 3, 5, 8), (1, 3, 5, 8), True),  # GQA with a broadcast batch
        ((2, 3, 4, 8), (2, 3, 5, 8), (1, 3, 5, 8), False),  # value alone broadcasts
        ((4, 8), (2, 2, 5, 8), (2, 2, 5, 8), False),  # a 2-D query over batched keys
    ],
)
def test_broadcasting_matches_torch_forward_and_backward(torch, q_shape, k_shape, v_shape, gqa):
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal(s) for s in (q_shape, k_shape, v_shape))
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    expected = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=gqa)
    out = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    assert_close(out, expected.detach().numpy(), 1e-12, "output")
    d_out = rng.standard_normal(out.shape)
    expected.backward(torch.tensor(d_out))
    grads = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, is_causal=True, enable_gqa=gqa)
    for name, ours, theirs in zip(("query", "key", "value"), grads, (tq.grad, tk.grad, tv.grad)):
        assert_close(ours, theirs.numpy(), 1e-10, f"grad_{name}")


# ================================================================ any finite magnitude


@st.composite
def wide_case(draw):
    """Shapes, masks, a scale and four magnitudes (query, key, value, grad) from 1e-30 to 1e30."""
    batch = draw(st.sampled_from([(), (2,)]))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2]))
    L = draw(st.integers(1, 7))
    S = draw(st.integers(1, 9))
    E = draw(st.sampled_from([1, 3, 16, 59]))
    Ev = draw(st.sampled_from([E, 5]))
    exponents = draw(st.tuples(EXPONENTS, EXPONENTS, EXPONENTS, EXPONENTS))
    scale = draw(SCALES)
    mask_kind = draw(st.sampled_from(["none", "causal", "bool"]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    Hq = kv_heads * group
    q = wide(rng, (*batch, Hq, L, E), exponents[0])
    k = wide(rng, (*batch, kv_heads, S, E), exponents[1])
    v = wide(rng, (*batch, kv_heads, S, Ev), exponents[2])
    d_out = wide(rng, (*batch, Hq, L, Ev), exponents[3])
    mask = {"none": None, "causal": masks.causal_mask(L, S), "bool": rng.random((L, S)) < 0.7}[mask_kind]
    return q, k, v, d_out, mask, scale, group


@given(case=wide_case())
@example(case=(  # scores near 8e10: flash's fixed shift; lse - shift must not be rebuilt from a float64 lse
    np.array([[[0.12573022]]], dtype=np.float32), np.array([[[-1.3210486e17], [6.4042264e17]]], dtype=np.float32),
    np.array([[[0.10490011], [-0.5356694]]], dtype=np.float32), np.array([[[0.36159506]]], dtype=np.float32),
    None, 1e-06, 1))
@example(case=(  # scores near 1e19 (in float64): the sampled shift rounded 708 above the tiles' s - c, p v underflowed
    np.array([[[1.2573022e25], [-1.3210486e25], [6.4042267e25], [1.0490012e25]]], dtype=np.float32),
    np.array([[[-0.5356694], [0.36159506], [1.304]]], dtype=np.float32),
    np.array([[[9.47080955e-12], [-7.03735247e-12], [-1.26542145e-11]]], dtype=np.float32),
    np.array([[[-0.62327445], [0.04132598], [-2.3250308], [-0.21879166]]], dtype=np.float32),
    None, 1e-06, 1))
def test_any_finite_magnitude_gives_torch_math_float64_answer(torch, case):
    """Finite in, finite out: float32 inputs with magnitudes from 1e-30 to 1e30 and
    scales from 1e-38 to 1e30 give torch's math backend's float64 answer in the plain
    path, its backward, flash and flash's backward (tests/wide_range.py has the rule)."""
    q, k, v, d_out, mask, scale, group = case
    gqa = group > 1
    truth, truth_grads = torch_math(torch, q, k, v, mask, scale, gqa, "float64", d_out)
    oracle, oracle_grads = torch_math(torch, q, k, v, mask, scale, gqa, "float32", d_out)
    sizes = natural_sizes(q, k, v, mask, scale, group, d_out)
    kw = dict(attn_mask=mask, scale=scale, enable_gqa=gqa)
    tiles = dict(block_q=3, block_k=4)
    flash = attnkit.flash_attention(q, k, v, return_lse=True, **kw, **tiles)
    for name, out in (("plain", sdpa(q, k, v, **kw)), ("flash", flash.output)):
        assert out.dtype == np.float32
        assert_like_truth(out, oracle, truth, sizes["out"], f"{name} output")
    backwards = {
        "plain": sdpa_backward(d_out, q, k, v, **kw),
        "flash": attnkit.flash_attention_backward(d_out, q, k, v, flash.output, flash),
    }
    for name, grads in backwards.items():
        for which, ours, theirs, truth_grad in zip(("dq", "dk", "dv"), grads, oracle_grads, truth_grads):
            assert ours.dtype == np.float32
            assert_like_truth(ours, theirs, truth_grad, sizes[which], f"{name} {which}", factor=3.0)


@pytest.mark.parametrize("magnitude, scale", [(4e18, None), (1e20, None), (1e30, None), (1.0, 1e-38),
                                              (1e30, 1e-38), (1e-30, 1e30), (3e38, None)])
def test_large_finite_inputs_are_not_nan(torch, magnitude, scale):
    """The issue's cases: q = k = v at 4e18 gave NaN in the plain path (it multiplied
    q @ k^T before scaling); torch's math backend gives 4e18 (at 1e20 its float32 is
    NaN too, its float64 is 1e20). Every path now gives the float64 answer."""
    q = np.full((1, 1, 2, 64), magnitude, np.float32)
    q[..., 1, :32] *= -1  # two different rows, so the answer is not trivially q
    truth, truth_grads = torch_math(torch, q, q, q, None, scale, d_out=np.ones_like(q))
    plain = sdpa(q, q, q, scale=scale)
    flash = attnkit.flash_attention(q, q, q, scale=scale, return_lse=True)
    for name, out in (("plain", plain), ("flash", flash.output)):
        np.testing.assert_allclose(out, truth, rtol=1e-6, err_msg=name)
    grads = (sdpa_backward(np.ones_like(q), q, q, q, scale=scale),
             attnkit.flash_attention_backward(np.ones_like(q), q, q, q, flash.output, flash))
    for name, g in zip(("plain", "flash"), grads):
        for ours, expected in zip(g, truth_grads):
            assert not np.isnan(ours).any(), name
            # gradients beyond float32's range are inf, as the float64 truth rounded to float32
            expected = expected.astype(np.float32).astype(np.float64)
            np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max(), err_msg=name)


@pytest.mark.parametrize("q_shape, k_shape, v_shape, gqa", [
    ((2, 0, 4, 8), (2, 0, 5, 8), (2, 0, 5, 8), False),  # no head at all
    ((2, 0, 4, 8), (2, 4, 5, 8), (2, 4, 5, 8), True),  # no query head
    ((2, 4, 4, 8), (2, 0, 5, 8), (2, 0, 5, 8), False),  # no key/value head: no key, zeros
    ((2, 1, 4, 8), (2, 0, 5, 8), (2, 0, 5, 8), False),
    ((0, 3, 4, 8), (0, 3, 5, 8), (0, 3, 5, 8), False),  # empty batch
    ((0, 3, 4, 8), (1, 3, 5, 8), (1, 3, 5, 8), False),  # empty batch against a broadcast one
    ((2, 3, 0, 8), (2, 3, 5, 8), (2, 3, 5, 8), False),  # no query
    ((2, 3, 4, 8), (2, 3, 0, 8), (2, 3, 0, 8), False),  # no key
    ((2, 3, 4, 0), (2, 3, 5, 0), (2, 3, 5, 6), False),  # E = 0: every score 0
    ((2, 3, 4, 8), (2, 3, 5, 8), (2, 3, 5, 0), False),  # Ev = 0
    ((0, 8), (5, 8), (5, 8), False),
    ((4, 8), (0, 8), (0, 8), False),
], ids=str)
def test_empty_dimensions_give_torchs_results_and_gradients(torch, q_shape, k_shape, v_shape, gqa):
    """Zero heads, an empty batch or length: empty results (zeros where a query sees
    no key), as torch gives, from SDPA, flash and both backwards; never ZeroDivisionError."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in (q_shape, k_shape, v_shape))
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    expected = F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=gqa)
    d_out = rng.standard_normal(tuple(expected.shape)).astype(np.float32)
    expected.backward(torch.tensor(d_out))
    expected_grads = [x.grad.numpy() for x in (tq, tk, tv)]
    res = sdpa(q, k, v, enable_gqa=gqa, return_weights=True, return_lse=True)
    flash = attnkit.flash_attention(q, k, v, enable_gqa=gqa, return_lse=True)
    for name, out, lse in (("sdpa", res.output, res.lse), ("flash", flash.output, flash.lse)):
        assert out.shape == tuple(expected.shape) and out.dtype == np.float32, name
        np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=name)
        assert lse.shape == out.shape[:-1] and not np.isnan(lse).any(), name
    assert res.weights.shape == (*res.output.shape[:-1], k.shape[-2])
    grads = {
        "sdpa": sdpa_backward(d_out, q, k, v, enable_gqa=gqa),
        "flash": attnkit.flash_attention_backward(d_out, q, k, v, flash.output, flash),
    }
    for name, g in grads.items():
        for ours, theirs in zip(g, expected_grads):
            assert ours.shape == theirs.shape and ours.dtype == np.float32, name
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=name)


# ================================================================ bad input


def _x(*shape, dtype=np.float64):
    return np.zeros(shape, dtype)


QKV = dict(query=_x(2, 4, 8), key=_x(2, 5, 8), value=_x(2, 5, 8))
BAD_SDPA = [
    # (kwargs, exception, message regex); each is checked on the forward and on the backward
    (dict(query=_x(8), key=_x(5, 8), value=_x(5, 8)), ValueError, r"query of rank >= 2.*got shape \(8\)"),
    (dict(query=_x(2, 3, 4, 8), key=_x(2, 5, 8), value=_x(2, 5, 8)), ValueError, "3 heads but key/value have 2"),
    (dict(query=_x(2, 3, 4), key=_x(3, 4, 4), value=_x(3, 4, 4)), ValueError, "2 heads but key/value have 3.*enable_gqa"),
    (dict(query=_x(2, 4, 8), key=_x(3, 5, 8), value=_x(2, 5, 8)), ValueError, "same number of heads"),
    (dict(query=_x(2, 4, 8), key=_x(2, 5, 6), value=_x(2, 5, 8)), ValueError, r"E=8.*got \(2, 5, 6\)"),
    (dict(query=_x(2, 4, 8), key=_x(2, 5, 8), value=_x(2, 6, 8)), ValueError, r"value.*got \(2, 6, 8\)"),
    (dict(query=_x(2, 2, 4, 8), key=_x(3, 2, 5, 8), value=_x(3, 2, 5, 8)), ValueError, "batch dims.*broadcast"),
    (dict(query=_x(6, 4, 8), key=_x(4, 5, 8), value=_x(4, 5, 8), enable_gqa=True), ValueError, "multiple.*6 query heads over 4"),
    (dict(query=_x(6, 4, 8), key=_x(2, 5, 8), value=_x(2, 5, 8)), ValueError, "enable_gqa"),
    (dict(query=_x(2, 4, 8, dtype=np.int64), key=_x(2, 5, 8), value=_x(2, 5, 8)), TypeError, "floating.*int64"),
    (dict(query=_x(2, 4, 8, dtype=bool), key=_x(2, 5, 8), value=_x(2, 5, 8)), TypeError, "floating.*bool"),
    (dict(query=_x(2, 4, 8, dtype=np.float32), key=_x(2, 5, 8), value=_x(2, 5, 8)), TypeError, "one dtype.*float32"),
    (dict(**QKV, attn_mask=np.ones((4, 5), np.int32)), TypeError, "attn_mask to be boolean.*int32"),
    (dict(**QKV, attn_mask=np.ones((5, 4), bool)), ValueError, r"broadcastable.*got \(5, 4\)"),
    (dict(**QKV, attn_mask=np.ones((4, 5), bool), is_causal=True), ValueError, "is_causal"),
    (dict(**QKV, scale=float("nan")), ValueError, "finite scale.*nan"),
    (dict(**QKV, scale=float("-inf")), ValueError, "finite scale.*-inf"),
    (dict(**QKV, scale=float("inf")), ValueError, "finite scale.*inf"),
    (dict(**QKV, scale="0.5"), TypeError, "scale.*str"),
    (dict(**QKV, is_causal="yes"), TypeError, "is_causal.*str"),
]
BAD_DROPOUT = [(1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError), (1.5, ValueError), ("0.1", TypeError), (None, TypeError)]


@pytest.mark.parametrize("kwargs,exc,msg", BAD_SDPA, ids=[m for _, _, m in BAD_SDPA])
def test_sdpa_and_backward_reject_bad_input(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        sdpa(**kwargs)
    grad = np.zeros(kwargs["query"].shape[:-1] + kwargs["value"].shape[-1:])
    with pytest.raises(exc, match=msg):
        sdpa_backward(grad, **kwargs)


@pytest.mark.parametrize("p,exc", BAD_DROPOUT, ids=str)
def test_sdpa_rejects_dropout_outside_0_1(p, exc):
    x = _x(2, 3, 4)
    with pytest.raises(exc, match=r"dropout_p.*\[0, 1\)"):
        sdpa(x, x, x, dropout_p=p)


def test_backward_rejects_a_grad_of_the_wrong_shape_or_kind():
    x = _x(2, 3, 4)
    with pytest.raises(ValueError, match=r"grad_output of the output's shape \(2, 3, 4\), got \(2, 4, 3\)"):
        sdpa_backward(_x(2, 4, 3), x, x, x)
    with pytest.raises(TypeError, match="grad_output.*int64"):
        sdpa_backward(np.zeros((2, 3, 4), np.int64), x, x, x)


def test_backend_lookup():
    assert attnkit.get_attention("naive") is attnkit.scaled_dot_product_attention
    with pytest.raises(ValueError, match="naive"):
        attnkit.get_attention("nope")


# ================================================================ masks


def test_causal_alignments_match_their_definitions():
    for L, S in [(3, 5), (5, 3), (4, 4), (1, 6)]:
        top_left = masks.causal_mask(L, S)
        assert np.array_equal(top_left, np.tril(np.ones((L, S), dtype=bool)))
        bottom_right = masks.causal_mask(L, S, align="bottom_right")
        assert np.array_equal(bottom_right, np.tril(np.ones((L, S), dtype=bool), k=S - L))
    assert masks.causal_mask(1, 6, align="bottom_right").all()  # a decode step sees the whole cache


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("L,S", [(1, 1), (3, 5), (5, 3), (4, 4), (1, 6), (6, 1)])
def test_causal_masks_match_torch_causal_bias(torch, L, S):
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    np.testing.assert_array_equal(masks.causal_mask(L, S), causal_upper_left(L, S)._materialize().numpy())
    with pytest.warns(UserWarning) if L > S else _nothing():
        lower_right = causal_lower_right(L, S)._materialize().numpy()
    np.testing.assert_array_equal(masks.causal_mask(L, S, align="bottom_right"), lower_right)
    assert masks.causal_mask(L).shape == (L, L)


@pytest.mark.parametrize("L,S,left,right,align", [(6, 6, 2, 0, "top_left"), (4, 7, 1, 1, "bottom_right"),
                                                  (3, 5, 1, 1, "bottom_right"), (7, 4, None, 2, "top_left"),
                                                  (5, 5, 0, 0, "top_left")])
def test_sliding_window_by_hand(L, S, left, right, align):
    offset = 0 if align == "top_left" else S - L
    expected = np.array([[(j - (i + offset) <= right) and (left is None or (i + offset) - j <= left)
                          for j in range(S)] for i in range(L)])
    np.testing.assert_array_equal(masks.sliding_window_mask(L, S, left=left, right=right, align=align), expected)
    if S == L:
        np.testing.assert_array_equal(masks.sliding_window_mask(L, left=left, right=right, align=align), expected)


def test_padding_mask_and_combinators():
    np.testing.assert_array_equal(masks.padding_mask([2, 0, 3]), [[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    pad = masks.padding_mask([2, 0, 3], max_len=4)
    assert pad.tolist() == [[True, True, False, False], [False] * 4, [True, True, True, False]]
    assert masks.padding_mask([]).shape == (0, 0)
    combined = masks.and_masks(masks.causal_mask(4), masks.key_mask_to_attn_mask(pad))
    assert combined.shape == (3, 1, 4, 4)
    assert not combined[1].any() and combined[2, 0, 3, :3].all() and not combined[2, 0, 3, 3]
    assert masks.or_masks(masks.causal_mask(3), ~masks.causal_mask(3)).all()
    c = masks.causal_mask(3)
    row = np.array([True, False, True])
    np.testing.assert_array_equal(masks.and_masks(c, row), c & row)
    np.testing.assert_array_equal(masks.or_masks(c, row, np.zeros((2, 1, 1), bool)), np.broadcast_to(c | row, (2, 3, 3)))
    add = masks.to_additive(c, np.float16)
    assert add.dtype == np.float16 and (add[c] == 0).all() and np.isneginf(add[~c]).all()
    add = masks.to_additive(masks.causal_mask(2), np.float32)
    assert add.dtype == np.float32 and add.tolist() == [[0.0, -np.inf], [0.0, 0.0]]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 8)) for _ in range(3))
    np.testing.assert_array_equal(sdpa(q, k, v, c), sdpa(q, k, v, masks.to_additive(c, np.float64)))


def test_from_torch_mask_inverts_bool_and_keeps_float(torch):
    torch_mask = torch.triu(torch.ones(3, 3, dtype=torch.bool), diagonal=1)  # torch: True = masked
    assert np.array_equal(masks.from_torch_mask(torch_mask), masks.causal_mask(3))
    t_bool = torch.tensor([[False, True], [True, False]])
    np.testing.assert_array_equal(masks.from_torch_mask(t_bool), ~t_bool.numpy())
    np.testing.assert_array_equal(masks.from_torch_mask(t_bool.numpy()), ~t_bool.numpy())
    t_float = torch.tensor([[0.0, -math.inf], [0.5, 0.0]])
    np.testing.assert_array_equal(masks.from_torch_mask(t_float), t_float.numpy())
    f = np.array([[0.0, -np.inf]], dtype=np.float32)
    assert masks.from_torch_mask(f) is f
    np.testing.assert_array_equal(masks.padding_mask(torch.tensor([1, 2]), max_len=3), [[1, 0, 0], [1, 1, 0]])


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: masks.causal_mask(-1), ValueError, "L >= 0, got -1"),
    (lambda: masks.causal_mask(2.0), TypeError, "L to be an integer, got float"),
    (lambda: masks.causal_mask(3, align="left"), ValueError, "align.*'left'"),
    (lambda: masks.sliding_window_mask(3, left=-1), ValueError, "left >= 0, got -1"),
    (lambda: masks.padding_mask([[1, 2]]), ValueError, r"1-D.*\(1, 2\)"),
    (lambda: masks.padding_mask([1.5]), TypeError, "integers.*float64"),
    (lambda: masks.padding_mask([-1]), ValueError, "non-negative"),
    (lambda: masks.padding_mask([3], max_len=2), ValueError, "max_len=2, got a length of 3"),
    (lambda: masks.and_masks(), ValueError, "at least one"),
    (lambda: masks.or_masks(np.ones(3)), TypeError, "float64"),
    (lambda: masks.and_masks(np.ones(3, bool), np.ones(4, bool)), ValueError, r"\(3\), \(4\)"),
    (lambda: masks.to_additive(np.ones(3)), TypeError, "boolean.*float64"),
    (lambda: masks.to_additive(np.ones(3, bool), np.int32), TypeError, "floating dtype, got int32"),
    (lambda: masks.from_torch_mask(np.ones(3, np.int64)), TypeError, "int64"),
])
def test_mask_helpers_reject_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()
