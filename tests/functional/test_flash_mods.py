"""Every ready-made mod through flash equals its dense mask or bias through the plain path,
forward and backward, and tiles the mods exclude are never computed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import attnkit
from attnkit import masks
from attnkit.functional import mods
from conftest import assert_close, assert_within_budget, optional, reference_attention

torch = optional("torch")  # the softcap test asks for the `torch` fixture

B, H, E = 2, 4, 8


def _inputs(L, S, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, E)).astype(dtype)
    k = rng.standard_normal((B, H, S, E)).astype(dtype)
    v = rng.standard_normal((B, H, S, 5)).astype(dtype)
    d_out = rng.standard_normal((B, H, L, 5)).astype(dtype)
    return q, k, v, d_out


def _check_both_ways(q, k, v, d_out, flash_kw, plain_mask, tol=1e-10):
    """flash with mods == plain SDPA with the dense mask, output and gradients."""
    res = attnkit.flash_attention(q, k, v, return_lse=True, block_q=3, block_k=5, **flash_kw)
    plain = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=plain_mask, return_lse=True)
    assert_close(res.output, plain.output, tol, "output")
    finite = np.isfinite(plain.lse)
    assert np.array_equal(np.isfinite(res.lse), finite)
    np.testing.assert_allclose(res.lse[finite], plain.lse[finite], rtol=tol, atol=tol)
    grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
    expected = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, attn_mask=plain_mask)
    for name, ours, theirs in zip(("query", "key", "value"), grads, expected):
        assert_close(ours, theirs, tol, f"grad_{name}")


def _mask_mod_cases(L, S, rng):
    doc_q = np.sort(rng.integers(0, 3, size=(B, L)), axis=1)
    doc_k = np.sort(rng.integers(0, 3, size=(B, S)), axis=1)
    doc_self = np.sort(rng.integers(0, 4, size=L))
    lengths = rng.integers(0, S + 1, size=B)
    prefix = rng.integers(0, S + 1, size=B)
    left, right = int(rng.integers(0, 5)), int(rng.integers(0, 3))
    return {
        "causal top_left": mods.causal(),
        "causal bottom_right": mods.causal("bottom_right"),
        "sliding_window": mods.sliding_window(left, right),
        "sliding_window bottom_right": mods.sliding_window(left, right, align="bottom_right"),
        "sliding_window unbounded left": mods.sliding_window(None, right),
        "prefix_lm int": mods.prefix_lm(int(prefix[0])),
        "prefix_lm per batch": mods.prefix_lm(prefix),
        "document q/kv per batch": mods.document(doc_q, doc_k),
        "document self": mods.document(doc_self) if L == S else mods.document(doc_self, doc_self[:1].repeat(S)),
        "key_padding": mods.key_padding(lengths),
        "and(document, causal)": mods.and_mods(mods.document(doc_q, doc_k), mods.causal("bottom_right")),
        "and(window, causal)": mods.and_mods(mods.sliding_window(left, 0), mods.causal()),
        "or(causal, key_padding)": mods.or_mods(mods.causal(), mods.key_padding(lengths)),
    }


@given(st.sampled_from([1, 4, 11, 16]), st.sampled_from([1, 6, 11, 19]), st.integers(0, 2**16))
@pytest.mark.slow  # measured > 2 s in the quick loop
def test_every_mask_mod_equals_its_dense_mask_through_the_plain_path(L, S, seed):
    rng = np.random.default_rng(seed)
    q, k, v, d_out = _inputs(L, S, seed)
    for name, mod in _mask_mod_cases(L, S, rng).items():
        dense = mods.create_mask(mod, B, H, L, S)
        try:
            _check_both_ways(q, k, v, d_out, dict(mask_mod=mod), dense)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_band_mods_match_the_masks_module():
    for L, S in [(5, 9), (9, 5), (7, 7)]:
        for align in ("top_left", "bottom_right"):
            assert np.array_equal(
                mods.create_mask(mods.causal(align), 1, 1, L, S)[0, 0], masks.causal_mask(L, S, align=align)
            )
            assert np.array_equal(
                mods.create_mask(mods.sliding_window(2, 1, align=align), 1, 1, L, S)[0, 0],
                masks.sliding_window_mask(L, S, left=2, right=1, align=align),
            )
    # flash's own arguments mean the same thing
    q, k, v, d_out = _inputs(9, 13, 1)
    for align in ("top_left", "bottom_right"):
        a = attnkit.flash_attention(q, k, v, is_causal=True, causal_align=align, window=3, block_q=2, block_k=3)
        b = attnkit.flash_attention(q, k, v, mask_mod=mods.sliding_window(3, 0, align=align), block_q=2, block_k=3)
        np.testing.assert_allclose(a, b, rtol=1e-12)


@given(st.sampled_from([1, 7, 16]), st.sampled_from([1, 9, 16]), st.integers(0, 2**16), st.booleans())
def test_alibi_equals_its_dense_bias(L, S, seed, causal):
    q, k, v, d_out = _inputs(L, S, seed)
    for align in ("top_left", "bottom_right"):
        mod = mods.alibi(H, align=align)
        bias = mods.score_bias(mod, B, H, L, S)
        kw = dict(score_mod=mod)
        if causal:
            kw.update(is_causal=True, causal_align=align)
            bias = np.where(masks.causal_mask(L, S, align=align), bias, -np.inf)
        _check_both_ways(q, k, v, d_out, kw, bias)
    # the bias is slope_h * (kv - q) with the paper's slopes
    bias = mods.score_bias(mods.alibi(H), 1, H, 3, 3)
    np.testing.assert_allclose(bias[0, :, 2, 0], -2 * mods.alibi_slopes(H))
    np.testing.assert_allclose(mods.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    assert len(mods.alibi_slopes(12)) == 12 and np.all(np.diff(mods.alibi_slopes(12)[:8]) < 0)


def _softcap_reference(q, k, v, d_out, cap, mask):
    """Softcapped attention and its gradients through torch autograd, in the inputs'
    dtype: float64 is the truth, float32 the outside oracle."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = tq @ tk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~torch.tensor(mask), float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True)
    out = (torch.softmax(torch.where(dead, 0.0, s), -1) * ~dead) @ tv
    out.backward(torch.tensor(d_out))
    return out.detach().numpy(), (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softcap_matches_dense_reference_forward_and_backward(torch, dtype):
    L, S = 13, 17
    q, k, v, d_out = _inputs(L, S, 3, dtype)
    q *= 3  # scores well past the cap
    cap = 1.5
    mask = masks.causal_mask(L, S, align="bottom_right")
    kw = dict(score_mod=mods.softcap(cap), is_causal=True, causal_align="bottom_right", block_q=4, block_k=5)
    res = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_grads = _softcap_reference(*(x.astype(np.float64) for x in (q, k, v, d_out)), cap, mask)
    grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
    # the plain path on pre-capped scores: scores -> capped scores -> softmax, in float64
    scores = np.einsum("bhle,bhse->bhls", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(E)
    capped = mods.apply_score_mod(mods.softcap(cap), scores)
    assert np.abs(capped).max() < cap
    dense_out = attnkit.softmax(np.where(mask, capped, -np.inf)) @ v.astype(np.float64)
    if dtype == np.float64:
        assert_close(res.output, ref_out, 1e-10, "softcap output")
        for name, ours, theirs in zip(("query", "key", "value"), grads, ref_grads):
            assert_close(ours, theirs, 5e-10, f"softcap grad_{name}")
        assert_close(res.output, dense_out, 1e-10, "softcap vs dense softmax")
        return
    # float32: FlashAttention's rule against torch autograd run in float32 on the same inputs
    out32, grads32 = _softcap_reference(q, k, v, d_out, cap, mask)
    assert_within_budget(res.output, out32, ref_out, "softcap output vs torch float32")
    for name, ours, theirs, truth in zip(("query", "key", "value"), grads, grads32, ref_grads):
        assert_within_budget(ours, theirs, truth, f"softcap grad_{name} vs torch float32", factor=3.0)
    assert_within_budget(res.output, out32, dense_out, "softcap vs dense softmax (float64)")


def test_custom_mods_in_flex_style():
    L = S = 12
    q, k, v, d_out = _inputs(L, S, 4)

    def checkerboard(b, h, q_idx, kv_idx):
        return ((q_idx + kv_idx + h) % 2 == 0) | (kv_idx == 0)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (q_idx - kv_idx) * (b + 1)

    dense_mask = mods.create_mask(checkerboard, B, H, L, S)
    bias = mods.score_bias(relative_bias, B, H, L, S)
    expected = reference_attention(q, k, v, np.where(dense_mask, bias, -np.inf))[0]
    out = attnkit.flash_attention(q, k, v, mask_mod=checkerboard, score_mod=relative_bias, block_q=5, block_k=5)
    assert_close(out, expected, 1e-10, "custom mods")
    # backward needs the derivative: an additive mod says so with ScoreMod(fn, grad=None)
    res = attnkit.flash_attention(q, k, v, mask_mod=checkerboard, return_lse=True,
                                  score_mod=mods.ScoreMod(relative_bias))
    grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
    plain = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, attn_mask=np.where(dense_mask, bias, -np.inf))
    for ours, theirs in zip(grads, plain):
        assert_close(ours, theirs, 1e-10, "custom mod grads")


def test_excluded_tiles_are_never_computed(monkeypatch):
    """Count the tiles a mask_mod is asked about: a band mod is never called (flash
    derives its tiles), and a custom mod over a causal band sees only the
    lower-triangle tiles."""
    L = S = 64
    q, k, v, _ = _inputs(L, S, 5)
    calls = []

    def spy(b, h, q_idx, kv_idx):
        calls.append((int(q_idx.min()), int(q_idx.max()), int(kv_idx.min()), int(kv_idx.max())))
        return np.ones(np.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=bool)

    attnkit.flash_attention(q[:1, :1], k[:1, :1], v[:1, :1], is_causal=True, mask_mod=spy, block_q=8, block_k=8)
    assert len(calls) == 8 * 9 // 2  # lower triangle of an 8 x 8 tile grid, diagonal included
    assert all(k0 <= q1 for q0, q1, k0, k1 in calls)
    calls.clear()
    attnkit.flash_attention(q[:1, :1], k[:1, :1], v[:1, :1], window=(8, 0), mask_mod=spy, block_q=8, block_k=8)
    assert len(calls) <= 8 * 3  # O(L * window): at most a few tiles per query block

    def never(*args):
        raise AssertionError("a band mod was evaluated per tile")

    monkeypatch.setattr(type(mods.causal()), "__call__", never)
    out = attnkit.flash_attention(q, k, v, mask_mod=mods.causal(), block_q=8, block_k=8)
    np.testing.assert_allclose(out, attnkit.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-12)


def test_mods_reject_bad_arguments():
    with pytest.raises(ValueError, match="align"):
        mods.causal("diagonal")
    with pytest.raises(ValueError, match="left >= 0"):
        mods.sliding_window(-1)
    with pytest.raises(ValueError, match="cap > 0"):
        mods.softcap(0)
    with pytest.raises(TypeError, match="cap"):
        mods.softcap("big")
    with pytest.raises(ValueError, match="num_heads or slopes"):
        mods.alibi()
    with pytest.raises(ValueError, match="bind"):
        mods.causal("bottom_right")(0, 0, np.arange(3)[:, None], np.arange(3)[None, :])
    with pytest.raises(TypeError, match="q_ids"):
        mods.document(np.array([0.5, 1.5]))
    with pytest.raises(ValueError, match="lengths"):
        mods.key_padding([-1, 2])
    with pytest.raises(ValueError, match="at least one"):
        mods.and_mods()
    q = np.ones((1, 3, 4, 2))
    with pytest.raises(ValueError, match="3 slopes|slopes but was called for head"):
        attnkit.flash_attention(q, q, q, score_mod=mods.alibi(slopes=[0.5, 0.25]))


def test_softcap_rounds_a_float32_tile_once():
    """mods.softcap on float32 scores is cap * tanh(score / cap) rounded once to
    float32 (within half an ulp of the float64 value, and a hair for tanh's own
    float64 rounding): NumPy's float32 tanh and the two float32 roundings around
    it were off by more than an ulp, which put dQ at 3.2x torch's error on
    FlashAttention's softcap grid case (test_flash_grid)."""
    cap = mods.softcap(50.0)
    score = (np.random.default_rng(0).standard_normal((256, 512)) * 80).astype(np.float32)
    q_idx, kv_idx = np.arange(256)[:, None], np.arange(512)[None, :]
    got = np.asarray(cap(score, 0, 0, q_idx, kv_idx)).astype(np.float32)  # as a kernel stores it
    truth = np.tanh(score.astype(np.float64) / 50.0) * 50.0
    ulp = np.spacing(np.abs(truth).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - truth) / ulp) <= 0.5 + 1e-6
    assert cap(score.astype(np.float64), 0, 0, q_idx, kv_idx).dtype == np.float64
