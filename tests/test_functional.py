"""The NumPy core against a float64 reference and against torch SDPA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import attnkit
from attnkit import masks
from conftest import assert_close, max_rel_err, reference_attention

TOL = {np.float64: 1e-10, np.float32: 1e-5, np.float16: 2e-3}


# ---------------------------------------------------------------- softmax


def test_softmax_large_logits_and_rows_sum_to_one():
    x = np.array([[1e4, 1e4 + 1, 1e4 + 2], [-1e4, 0.0, 1e4]])
    p = attnkit.softmax(x)
    expected = torch.softmax(torch.tensor(x), dim=-1).numpy()
    np.testing.assert_allclose(p, expected, rtol=1e-12, atol=0)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-15)


def test_softmax_all_masked_row_is_zero_not_nan():
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 1.0]], dtype=np.float32)
    p = attnkit.softmax(x)
    assert p.dtype == np.float32
    assert np.array_equal(p[0], np.zeros(3))
    np.testing.assert_allclose(p[1], torch.softmax(torch.tensor(x[1]), -1).numpy(), rtol=1e-6)
    assert np.isneginf(attnkit.logsumexp(x)[0])
    assert np.isneginf(attnkit.log_softmax(x)[0]).all()


@given(
    st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=1, max_size=20),
    st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_softmax_family_matches_torch(values, dtype):
    x = np.array(values, dtype=dtype).reshape(1, -1)
    t = torch.tensor(x.astype(np.float64))
    tol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}[dtype]
    for ours, theirs in [
        (attnkit.softmax(x), torch.softmax(t, -1)),
        (attnkit.log_softmax(x), torch.log_softmax(t, -1)),
        (attnkit.logsumexp(x), torch.logsumexp(t, -1)),
    ]:
        assert ours.dtype == dtype
        assert np.isfinite(ours).all()
        np.testing.assert_allclose(ours.astype(np.float64), theirs.numpy(), rtol=tol, atol=tol * 10)


def test_softmax_axis_and_integer_input():
    x = np.arange(12).reshape(3, 4)
    p = attnkit.softmax(x, axis=0)
    np.testing.assert_allclose(p.sum(axis=0), 1.0)
    with pytest.raises(TypeError, match="real numbers"):
        attnkit.softmax(np.array(["a", "b"]))


# ---------------------------------------------------------------- SDPA vs torch


@st.composite
def attention_case(draw):
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    L = draw(st.sampled_from([1, 2, 5, 17]))
    S = draw(st.sampled_from([1, 3, 5, 16]))
    E = draw(st.sampled_from([4, 8, 59, 111]))
    Ev = draw(st.sampled_from([E, 7]))
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    mask_kind = draw(st.sampled_from(["none", "causal", "bool", "float", "bool_bcast"]))
    scale = draw(st.sampled_from([None, 0.3, 1.7]))
    seed = draw(st.integers(0, 2**16))
    return batch, kv_heads, group, L, S, E, Ev, dtype, mask_kind, scale, seed


@given(attention_case())
def test_sdpa_matches_torch_and_reference(case):
    batch, kv_heads, group, L, S, E, Ev, dtype, mask_kind, scale, seed = case
    rng = np.random.default_rng(seed)
    Hq = kv_heads * group
    q = rng.standard_normal((*batch, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((*batch, kv_heads, S, E)).astype(dtype)
    v = rng.standard_normal((*batch, kv_heads, S, Ev)).astype(dtype)
    mask, is_causal, ref_mask = None, False, None
    if mask_kind == "causal":
        is_causal, ref_mask = True, masks.causal_mask(L, S)
    elif mask_kind == "bool":
        mask = rng.random((*batch, Hq, L, S)) > 0.3
    elif mask_kind == "bool_bcast":
        mask = rng.random((L, S)) > 0.5  # some rows fully masked now and then
    elif mask_kind == "float":
        mask = (rng.standard_normal((1, L, S)) * 2).astype(dtype)
    ref_mask = mask if ref_mask is None else ref_mask

    res = attnkit.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1,
        return_weights=True, return_lse=True,
    )
    assert res.output.dtype == dtype and res.output.shape == (*batch, Hq, L, Ev)
    ref_out, ref_w, ref_lse = reference_attention(q, k, v, ref_mask, scale, group)
    assert_close(res.output, ref_out, TOL[dtype] * (10 if dtype == np.float32 else 1), "output vs float64")
    assert_close(res.weights, ref_w, TOL[dtype] * (10 if dtype == np.float32 else 1), "weights vs float64")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(res.lse), finite)
    np.testing.assert_allclose(res.lse[finite], ref_lse[finite], rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)

    # torch on the same inputs (float16 goes through float32 on both sides)
    tdtype = torch.float32 if dtype == np.float16 else None
    tq, tk, tv = (torch.tensor(x).to(tdtype) if tdtype else torch.tensor(x) for x in (q, k, v))
    if mask is None or mask.dtype == bool:
        tmask = None if mask is None else torch.tensor(mask)
    else:
        tmask = torch.tensor(mask.astype(np.float32 if dtype == np.float16 else dtype))
    expected = F.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=tmask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
    ).numpy()
    # torch's math path makes fully masked rows zero as well
    expected = np.nan_to_num(expected)
    tol = {np.float64: 1e-10, np.float32: 1e-5, np.float16: 1e-3}[dtype]
    assert_close(res.output.astype(np.float64), expected.astype(dtype).astype(np.float64), tol, "output vs torch")


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 3)) for _ in range(3))
    mask = np.ones((4, 4), dtype=bool)
    mask[2] = False
    res = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_weights=True, return_lse=True)
    assert np.array_equal(res.output[:, 2], np.zeros((2, 3)))
    assert np.array_equal(res.weights[:, 2], np.zeros((2, 4)))
    assert np.isneginf(res.lse[:, 2]).all()
    float_mask = masks.to_additive(mask, np.float64)
    out = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)
    np.testing.assert_array_equal(out, res.output)


def test_is_causal_top_left_with_L_not_S():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 3, 8))
    k = rng.standard_normal((1, 2, 6, 8))
    v = rng.standard_normal((1, 2, 6, 8))
    res = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    assert np.array_equal(res.weights[0, 0] > 0, np.tril(np.ones((3, 6), dtype=bool)))
    expected = F.scaled_dot_product_attention(*(torch.tensor(x) for x in (q, k, v)), is_causal=True).numpy()
    assert_close(res.output, expected, 1e-12)


def test_2d_inputs_and_return_types():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    out = attnkit.scaled_dot_product_attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == (5, 3)
    res = attnkit.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert isinstance(res, attnkit.AttentionOutput) and res.weights is None and res.lse.shape == (5,)
    assert_close(res.output, reference_attention(q[None], k[None], v[None])[0][0], 1e-12)


def test_float32_stays_float32_with_numpy_scalar_scale():
    q = np.ones((1, 2, 4), dtype=np.float32)
    out = attnkit.scaled_dot_product_attention(q, q, q, scale=np.float64(0.5))
    assert out.dtype == np.float32


def test_dropout_is_seeded_and_rescaled():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 8, 16)) for _ in range(3))
    a = attnkit.scaled_dot_product_attention(q, k, v, dropout_p=0.5, rng=np.random.default_rng(7), return_weights=True)
    b = attnkit.scaled_dot_product_attention(q, k, v, dropout_p=0.5, rng=np.random.default_rng(7), return_weights=True)
    np.testing.assert_array_equal(a.output, b.output)
    plain = attnkit.scaled_dot_product_attention(q, k, v, return_weights=True)
    kept = a.weights != 0
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(a.weights[kept], plain.weights[kept] * 2.0, rtol=1e-12)
    np.testing.assert_allclose(a.output, a.weights @ v, rtol=1e-12)
    # The expectation over many draws is the undropped output.
    gen = np.random.default_rng(11)
    mean = np.mean([attnkit.scaled_dot_product_attention(q, k, v, dropout_p=0.3, rng=gen) for _ in range(400)], axis=0)
    assert np.max(np.abs(mean - plain.output)) < 0.15


def test_nan_propagates_like_torch():
    q = np.ones((1, 2, 4))
    k = np.ones((1, 3, 4))
    k[0, 1, 0] = np.nan
    out = attnkit.scaled_dot_product_attention(q, k, k)
    assert np.isnan(out).all()


# ---------------------------------------------------------------- backward


def _torch_grads(q, k, v, d_out, mask, is_causal, scale, gqa):
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tmask = None if mask is None else torch.tensor(mask)
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    out.backward(torch.tensor(d_out))
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@given(attention_case())
def test_backward_matches_torch_autograd(case):
    batch, kv_heads, group, L, S, E, Ev, _, mask_kind, scale, seed = case
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
        mask[..., 0] = True  # torch's gradient is NaN on fully masked rows; ours is 0 (tested below)
    elif mask_kind == "float":
        mask = rng.standard_normal((1, L, S))
    grads = attnkit.scaled_dot_product_attention_backward(
        d_out, q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
    )
    expected = _torch_grads(q, k, v, d_out, mask, is_causal, scale, group > 1)
    for name, ours, theirs in zip(("query", "key", "value"), grads, expected):
        assert_close(ours, theirs, 1e-10, f"grad_{name}")


def test_backward_matches_finite_differences():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 3, 5))
    k = rng.standard_normal((1, 4, 5))
    v = rng.standard_normal((1, 4, 2))
    mask = np.array([[True, True, False, True], [True, False, False, False], [True, True, True, True]])
    d_out = rng.standard_normal((2, 3, 2))
    grads = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, attn_mask=mask, enable_gqa=True, scale=0.7)

    def loss(q_, k_, v_):
        return float(np.sum(attnkit.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=True, scale=0.7) * d_out))

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


def test_backward_fully_masked_rows_give_zero_finite_gradients():
    rng = np.random.default_rng(6)
    q, k, v, d_out = (rng.standard_normal((3, 4)) for _ in range(4))
    mask = np.zeros((3, 3), dtype=bool)
    mask[0, :2] = True
    g = attnkit.scaled_dot_product_attention_backward(d_out[:, :4], q, k[:3], v[:3], attn_mask=mask)
    for grad in g:
        assert np.isfinite(grad).all()
    assert np.array_equal(g.grad_query[1:], np.zeros((2, 4)))


def test_backward_float32_dtype():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    g = attnkit.scaled_dot_product_attention_backward(q, q, q, q)
    assert all(x.dtype == np.float32 for x in g)


# ---------------------------------------------------------------- masks


def test_causal_alignments_match_torch_definitions():
    for L, S in [(3, 5), (5, 3), (4, 4), (1, 6)]:
        top_left = masks.causal_mask(L, S)
        assert np.array_equal(top_left, np.tril(np.ones((L, S), dtype=bool)))
        bottom_right = masks.causal_mask(L, S, align="bottom_right")
        assert np.array_equal(bottom_right, np.tril(np.ones((L, S), dtype=bool), k=S - L))
    assert masks.causal_mask(1, 6, align="bottom_right").all()  # a decode step sees the whole cache


def test_sliding_window_padding_and_combining():
    w = masks.sliding_window_mask(6, left=2, right=0)
    for i in range(6):
        for j in range(6):
            assert w[i, j] == (i - 2 <= j <= i)
    w2 = masks.sliding_window_mask(3, 5, left=1, right=1, align="bottom_right")
    for i in range(3):
        for j in range(5):
            assert w2[i, j] == (abs(j - (i + 2)) <= 1)
    pad = masks.padding_mask([2, 0, 3], max_len=4)
    assert pad.tolist() == [[True, True, False, False], [False] * 4, [True, True, True, False]]
    combined = masks.and_masks(masks.causal_mask(4), masks.key_mask_to_attn_mask(pad))
    assert combined.shape == (3, 1, 4, 4)
    assert not combined[1].any() and combined[2, 0, 3, :3].all() and not combined[2, 0, 3, 3]
    either = masks.or_masks(masks.causal_mask(3), ~masks.causal_mask(3))
    assert either.all()


def test_from_torch_mask_inverts_bool_and_keeps_float():
    torch_mask = torch.triu(torch.ones(3, 3, dtype=torch.bool), diagonal=1)  # torch: True = masked
    assert np.array_equal(masks.from_torch_mask(torch_mask), masks.causal_mask(3))
    f = np.array([[0.0, -np.inf]], dtype=np.float32)
    assert masks.from_torch_mask(f) is f
    add = masks.to_additive(masks.causal_mask(2), np.float32)
    assert add.dtype == np.float32 and add.tolist() == [[0.0, -np.inf], [0.0, 0.0]]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(query=np.ones((2, 3), dtype=int)), TypeError, "floating"),
        (dict(query=np.ones(4)), ValueError, "rank"),
        (dict(key=np.ones((2, 4, 5))), ValueError, "E=4"),
        (dict(value=np.ones((2, 3, 4))), ValueError, "value"),
        (dict(key=np.ones((3, 4, 4)), value=np.ones((3, 4, 4))), ValueError, "enable_gqa"),
        (dict(attn_mask=np.ones((5, 4), dtype=bool)), ValueError, "broadcastable"),
        (dict(attn_mask=np.ones((3, 4), dtype=int)), TypeError, "boolean"),
        (dict(attn_mask=np.ones((3, 4), dtype=bool), is_causal=True), ValueError, "is_causal"),
        (dict(dropout_p=1.0), ValueError, r"\[0, 1\)"),
        (dict(dropout_p=-0.1), ValueError, r"\[0, 1\)"),
        (dict(scale=float("inf")), ValueError, "finite"),
        (dict(scale="x"), TypeError, "scale"),
        (dict(key=np.ones((2, 4, 4), dtype=np.float32)), TypeError, "one dtype"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(kwargs, error, match):
    args = dict(query=np.ones((2, 3, 4)), key=np.ones((2, 4, 4)), value=np.ones((2, 4, 4)))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        attnkit.scaled_dot_product_attention(**args)


def test_gqa_head_count_must_divide():
    with pytest.raises(ValueError, match="multiple"):
        attnkit.scaled_dot_product_attention(
            np.ones((1, 5, 3, 4)), np.ones((1, 2, 3, 4)), np.ones((1, 2, 3, 4)), enable_gqa=True
        )


def test_backend_lookup():
    assert attnkit.get_attention("naive") is attnkit.scaled_dot_product_attention
    with pytest.raises(ValueError, match="naive"):
        attnkit.get_attention("nope")


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
def test_broadcasting_matches_torch_forward_and_backward(q_shape, k_shape, v_shape, gqa):
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


def test_batch_dims_that_do_not_broadcast_are_rejected():
    with pytest.raises(ValueError, match="broadcast"):
        attnkit.scaled_dot_product_attention(np.ones((2, 1, 3, 4)), np.ones((3, 1, 3, 4)), np.ones((3, 1, 3, 4)))
