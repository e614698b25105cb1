"""Attention modules against torch.nn.MultiheadAttention (after interop.from_torch), a
float64 reference, and each other (per-head vs split-head).

float64 results meet torch in float64 (or the float64 reference) to ~1e-10.
float32 results meet conftest.assert_within_budget's budget: the float64 truth
is the same torch module cast to float64 (float32 weights and inputs are exact
in float64), and torch's own float32 error against it sets the bound."""

from __future__ import annotations

import copy
import importlib
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from attnkit import masks, nn
from conftest import assert_close, assert_within_budget, optional, reference_attention
from wide_range import EXPONENTS, assert_like_truth, mha_natural_size, torch_math, wide

torch = optional("torch")
# torch interop lives on the torch side (attnkit.nn never imports torch)
interop = importlib.import_module("attnkit.torch.interop") if torch else None
F = torch.nn.functional if torch else None

TOL = {np.float64: 1e-10}


def tdtype(dtype):
    return getattr(torch, np.dtype(dtype).name)


def t(a):
    return None if a is None else torch.from_numpy(np.array(a))


def torch_mha(d_model, num_heads, dtype, seed=0, **kwargs):
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(d_model, num_heads, dtype=tdtype(dtype), **kwargs).eval()
    with torch.no_grad():  # non-zero biases so that bias bugs show
        for name, p in module.named_parameters():
            if "bias" in name:
                p.normal_()
    return module


def run_torch(module, q, k, v, **kwargs):
    if not module.batch_first:
        q, k, v = (x.transpose(1, 0, 2) for x in (q, k, v))
    with torch.no_grad():
        out, w = module(t(q), t(k), t(v), **kwargs)
    out = out.numpy()
    if not module.batch_first:
        out = out.transpose(1, 0, 2)
    return out, (None if w is None else w.numpy())


def run_torch64(module, q, k, v, **kwargs):
    """The float64 truth: `module` and every float input cast to float64."""
    kwargs = {n: (a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a)
              for n, a in kwargs.items()}
    return run_torch(copy.deepcopy(module).double(), *(x.astype(np.float64) for x in (q, k, v)), **kwargs)


def check(ours, theirs, truth, dtype, what):
    """float64: torch (in float64) within 1e-10; float32: the budget torch's float32 error sets."""
    if dtype == np.float64:
        assert_close(ours, theirs, TOL[dtype], what)
    else:
        assert_within_budget(ours, theirs, truth, what)


def random_masks(rng, B, L, S):
    """A boolean (L, S) attn_mask and a (B, S) key mask, both in attnkit polarity,
    with key 0 always allowed so that no row is fully masked (torch gives NaN there)."""
    attn = rng.random((L, S)) < 0.7
    attn[:, 0] = True
    key = rng.random((B, S)) < 0.7
    key[:, 0] = True
    return attn, key


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("average", [True, False])
def test_self_attention_matches_torch_with_masks_and_weights(torch, dtype, average):
    rng = np.random.default_rng(0)
    B, L, D, H = 3, 9, 24, 4
    theirs = torch_mha(D, H, dtype, batch_first=True)
    ours = interop.from_torch(theirs)
    assert ours.dtype == dtype
    x = rng.standard_normal((B, L, D)).astype(dtype)
    attn_mask, key_mask = random_masks(rng, B, L, L)

    out, w = ours(x, attn_mask=attn_mask, key_mask=key_mask, need_weights=True, average_attn_weights=average)
    kw = dict(attn_mask=t(masks.from_torch_mask(attn_mask)), key_padding_mask=t(~key_mask))
    t_out, t_w = run_torch(theirs, x, x, x, **kw, need_weights=True, average_attn_weights=average)
    truth, truth_w = run_torch64(theirs, x, x, x, **kw, need_weights=True, average_attn_weights=average)
    assert out.dtype == dtype and w.dtype == dtype
    assert w.shape == ((B, L, L) if average else (B, H, L, L))
    check(out, t_out, truth, dtype, "output")
    check(w, t_w, truth_w, dtype, "weights")
    # masked keys get exactly zero weight
    assert not w[np.broadcast_to(~(attn_mask & key_mask[:, None, :]), (B, L, L))].any() if average else True

    # without weights torch takes its SDPA fast path; ours gives the same output
    out2, none = ours(x, attn_mask=attn_mask, key_mask=key_mask)
    assert none is None
    t_out2, _ = run_torch(theirs, x, x, x, **kw, need_weights=False)
    check(out2, t_out2, truth, dtype, "output without weights")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_mask_and_causal_match_torch(torch, dtype):
    rng = np.random.default_rng(1)
    B, L, D, H = 2, 7, 16, 2
    theirs = torch_mha(D, H, dtype, batch_first=True)
    ours = interop.from_torch(theirs)
    assert ours.dtype == dtype
    x = rng.standard_normal((B, L, D)).astype(dtype)
    float_mask = rng.standard_normal((L, L)).astype(dtype)
    out, w = ours(x, attn_mask=float_mask, need_weights=True)
    t_out, t_w = run_torch(theirs, x, x, x, attn_mask=t(float_mask))
    truth, truth_w = run_torch64(theirs, x, x, x, attn_mask=t(float_mask))
    check(out, t_out, truth, dtype, "float mask output")
    check(w, t_w, truth_w, dtype, "float mask weights")

    causal = masks.causal_mask(L)
    out, w = ours(x, is_causal=True, need_weights=True, average_attn_weights=False)
    kw = dict(attn_mask=t(~causal), is_causal=True, need_weights=True, average_attn_weights=False)
    t_out, t_w = run_torch(theirs, x, x, x, **kw)
    truth, truth_w = run_torch64(theirs, x, x, x, **kw)
    assert out.dtype == dtype
    check(out, t_out, truth, dtype, "causal output")
    check(w, t_w, truth_w, dtype, "causal weights")
    assert not w[..., ~causal].any()
    # torch's own float causal mask (generate_square_subsequent_mask) says the same, averaged weights too
    out, w = ours(x, is_causal=True, need_weights=True)
    kw = dict(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=tdtype(dtype)), is_causal=True)
    t_out, t_w = run_torch(theirs, x, x, x, **kw)
    truth, truth_w = run_torch64(theirs, x, x, x, **kw)
    check(out, t_out, truth, dtype, "causal output, float mask in torch")
    check(w, t_w, truth_w, dtype, "causal averaged weights")

    # is_causal combines with key_mask and with a float attn_mask
    _, key_mask = random_masks(rng, B, L, L)
    key_mask[:, :] = True
    key_mask[0, 3] = False
    out, w = ours(x, attn_mask=float_mask, key_mask=key_mask, is_causal=True, need_weights=True)
    additive = np.where(causal, float_mask, -np.inf).astype(dtype)
    kw = dict(attn_mask=t(additive), key_padding_mask=t(np.where(key_mask, 0.0, -np.inf).astype(dtype)))
    t_out, t_w = run_torch(theirs, x, x, x, **kw)
    truth, truth_w = run_torch64(theirs, x, x, x, **kw)
    check(out, t_out, truth, dtype, "causal + float + key mask")
    check(w, t_w, truth_w, dtype, "causal + float + key mask weights")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_cross_attention_with_kdim_vdim_matches_torch(torch, dtype, bias):
    rng = np.random.default_rng(2)
    B, L, S, D, H, kdim, vdim = 2, 5, 11, 12, 3, 7, 9
    theirs = torch_mha(D, H, dtype, batch_first=True, kdim=kdim, vdim=vdim, bias=bias)
    assert theirs.in_proj_weight is None  # the separate q/k/v_proj_weight layout
    ours = interop.from_torch(theirs)
    assert (ours.k_proj.weight.shape, ours.v_proj.weight.shape) == ((D, kdim), (D, vdim))
    assert (ours.q_proj.bias is not None) == bias
    q = rng.standard_normal((B, L, D)).astype(dtype)
    k = rng.standard_normal((B, S, kdim)).astype(dtype)
    v = rng.standard_normal((B, S, vdim)).astype(dtype)
    _, key_mask = random_masks(rng, B, L, S)
    out, w = ours(q, k, v, key_mask=key_mask, need_weights=True)
    t_out, t_w = run_torch(theirs, q, k, v, key_padding_mask=t(~key_mask))
    truth, truth_w = run_torch64(theirs, q, k, v, key_padding_mask=t(~key_mask))
    assert out.shape == (B, L, D) and w.shape == (B, L, S)
    check(out, t_out, truth, dtype, "cross output")
    check(w, t_w, truth_w, dtype, "cross weights")


@pytest.mark.parametrize("bias", [True, False])
def test_batch_first_false_module_and_packed_cross_attention(torch, bias):
    rng = np.random.default_rng(3)
    B, L, S, D, H = 2, 6, 4, 20, 5
    theirs = torch_mha(D, H, np.float64, batch_first=False, bias=bias)
    ours = interop.from_torch(theirs)
    q = rng.standard_normal((B, L, D))
    kv = rng.standard_normal((B, S, D))
    bool_mask = rng.random((B, H, L, S)) < 0.6
    bool_mask[..., 0] = True
    out, w = ours(q, kv, attn_mask=bool_mask, need_weights=True, average_attn_weights=False)
    # torch takes (L, B, E) here and a (B*H, L, S) mask in its polarity
    t_out, t_w = run_torch(
        theirs, q, kv, kv, attn_mask=t(~bool_mask.reshape(B * H, L, S)), need_weights=True,
        average_attn_weights=False,
    )
    assert_close(out, t_out, 1e-10, "batch_first=False output")
    assert_close(w, t_w, 1e-10, "batch_first=False weights")
    # the round trip through to_torch gives back an equivalent module
    again = interop.to_torch(ours, batch_first=False)
    t_out2, _ = run_torch(again, q, kv, kv, attn_mask=t(~bool_mask.reshape(B * H, L, S)))
    assert_close(t_out2, t_out, 1e-12, "to_torch round trip")


def test_to_torch_with_kdim_vdim_and_errors(torch):
    ours = nn.MultiHeadAttention(8, 2, kdim=3, vdim=5, seed=0).astype(np.float64)
    theirs = interop.to_torch(ours)
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((1, 4, 8)), rng.standard_normal((1, 6, 3)), rng.standard_normal((1, 6, 5))
    assert_close(ours(q, k, v).output, run_torch(theirs, q, k, v)[0], 1e-12, "to_torch kdim/vdim")
    # a seeded float32 module through torch (sequence-first) and back: the same parameters, the same outputs
    mha = nn.MultiHeadAttention(12, 3, kdim=5, vdim=7, seed=1)
    again = interop.from_torch(interop.to_torch(mha, batch_first=False))
    for key, value in mha.state_dict().items():
        assert np.array_equal(again.state_dict()[key], value), key
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    y, z = np.ones((2, 3, 5), np.float32), np.ones((2, 3, 7), np.float32)
    np.testing.assert_array_equal(again(x, y, z)[0], mha(x, y, z)[0])
    with pytest.raises(ValueError, match="grouped-query"):
        interop.to_torch(nn.MultiHeadAttention(8, 4, num_kv_heads=2, seed=0))
    with pytest.raises(TypeError, match="MultiheadAttention or torch.nn.TransformerEncoderLayer, got Linear"):
        interop.from_torch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="add_bias_kv"):
        interop.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grouped_query_attention_against_reference(torch, dtype):
    rng = np.random.default_rng(5)
    B, L, D, H, Hkv = 2, 6, 24, 6, 2
    ours = nn.MultiHeadAttention(D, H, num_kv_heads=Hkv, seed=1).astype(dtype)
    ours.load_state_dict({k: rng.standard_normal(v.shape) * 0.3 for k, v in ours.state_dict().items()})
    E = D // H
    x = rng.standard_normal((B, L, D)).astype(dtype)
    _, key_mask = random_masks(rng, B, L, L)
    out, w = ours(x, key_mask=key_mask, need_weights=True, average_attn_weights=False)

    x64 = x.astype(np.float64)
    sd = {k: v.astype(np.float64) for k, v in ours.state_dict().items()}
    q = (x64 @ sd["q_proj.weight"].T + sd["q_proj.bias"]).reshape(B, L, H, E).transpose(0, 2, 1, 3)
    k = (x64 @ sd["k_proj.weight"].T + sd["k_proj.bias"]).reshape(B, L, Hkv, E).transpose(0, 2, 1, 3)
    v = (x64 @ sd["v_proj.weight"].T + sd["v_proj.bias"]).reshape(B, L, Hkv, E).transpose(0, 2, 1, 3)
    ref, ref_w, _ = reference_attention(q, k, v, mask=key_mask[:, None, None, :], gqa_group=H // Hkv)
    ref = ref.transpose(0, 2, 1, 3).reshape(B, L, D) @ sd["out_proj.weight"].T + sd["out_proj.bias"]
    if dtype == np.float64:
        assert_close(out, ref, 1e-10, "GQA output")
        assert_close(w, ref_w, 1e-10, "GQA weights")
    else:
        # torch computing the same module in float32: projections, SDPA with enable_gqa, out_proj
        p = {name: t(a) for name, a in ours.state_dict().items()}
        tx = t(x)
        tq, tk, tv = (F.linear(tx, p[f"{n}_proj.weight"], p[f"{n}_proj.bias"]).reshape(B, L, -1, E).transpose(1, 2)
                      for n in "qkv")
        heads = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=t(key_mask[:, None, None, :]), enable_gqa=True)
        t_out = F.linear(heads.transpose(1, 2).reshape(B, L, D), p["out_proj.weight"], p["out_proj.bias"]).numpy()
        scores = tq @ tk.repeat_interleave(H // Hkv, 1).transpose(-1, -2) / math.sqrt(E)
        t_w = torch.softmax(scores.masked_fill(~t(key_mask[:, None, None, :]), -math.inf), -1).numpy()
        assert_within_budget(out, t_out, ref, "GQA output")
        assert_within_budget(w, t_w, ref_w, "GQA weights")

    # torch's SDPA with enable_gqa on the same projections agrees too
    t_heads = F.scaled_dot_product_attention(
        t(q), t(k), t(v), attn_mask=t(key_mask[:, None, None, :]), enable_gqa=True
    ).numpy()
    assert_close(t_heads.transpose(0, 2, 1, 3).reshape(B, L, D) @ sd["out_proj.weight"].T + sd["out_proj.bias"],
                 ref, 1e-10, "torch GQA")


def test_fused_qkv_path_equals_separate_path_and_cache_invalidation():
    rng = np.random.default_rng(6)
    mha = nn.MultiHeadAttention(16, 4, seed=0)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)

    def truth():  # the same module in float64 (a copy; float32 weights are exact in float64)
        return copy.deepcopy(mha).astype(np.float64)(x.astype(np.float64)).output

    # the three-matmul path is the plain one: the fused paths must stay within its float32 budget
    fused = mha(x).output  # key is value is query: one fused matmul
    separate = mha(x, x.copy(), x.copy()).output  # distinct arrays: three matmuls
    kv_fused = mha(x, x.copy()).output  # key is value: fused KV
    assert_within_budget(fused, separate, truth(), "fused vs separate")
    assert_within_budget(kv_fused, separate, truth(), "fused kv vs separate")

    # replacing a projection's weight (assignment or load_state_dict) refreshes the cache
    mha.v_proj.weight = np.zeros((16, 16))
    zero_v = mha(x).output
    # v = 0 exactly (zero weight, zero bias), so the output is out_proj's bias exactly
    np.testing.assert_array_equal(zero_v, np.broadcast_to(mha.out_proj.bias, zero_v.shape))
    np.testing.assert_array_equal(mha(x, x.copy()).output, zero_v)
    state = dict(mha.state_dict())
    state["v_proj.bias"] = np.ones(16)
    mha.load_state_dict(state)
    assert_within_budget(mha(x).output, mha(x, x.copy(), x.copy()).output, truth(), "after load_state_dict")
    # v = ones: the weights sum to 1, so the output is out_proj's row sums plus its bias
    w64 = mha.out_proj.weight.astype(np.float64)
    exact = np.broadcast_to(w64.sum(1) + mha.out_proj.bias, (2, 5, 16))
    assert_within_budget(mha(x).output, mha(x, x.copy(), x.copy()).output, exact, "v = ones")
    # a float64 input through a float32 module computes in float64, cached per dtype
    assert mha(x.astype(np.float64)).output.dtype == np.float64


def test_fused_weights_are_the_projections_stacked_cached_and_read_only():
    """`fused_weights(role, dtype)`: the public form of the fused projection (models/bert.py
    projects its token rows with it); x @ weight.T + bias holds each projection's output."""
    mha = nn.MultiHeadAttention(16, 4, num_kv_heads=2, seed=0)
    x = np.random.default_rng(8).standard_normal((3, 16))
    weight, bias = mha.fused_weights("qkv", np.float64)
    assert weight.shape == (16 + 8 + 8, 16) and bias.shape == (32,) and weight.dtype == np.float64
    expected = [x @ p.weight.T + p.bias for p in (mha.q_proj, mha.k_proj, mha.v_proj)]
    np.testing.assert_allclose(x @ weight.T + bias, np.concatenate(expected, axis=-1), rtol=1e-12)
    kv_weight, kv_bias = mha.fused_weights("kv", np.dtype(np.float32))
    assert kv_weight.shape == (16, 16) and kv_weight.dtype == np.float32
    assert mha.fused_weights("qkv", np.dtype(np.float64))[0] is weight  # cached per dtype
    assert not weight.flags.writeable and not bias.flags.writeable  # shared by every call
    # the 0.1.0 spelling (private, called by models/bert.py) reads the same cache
    assert mha._fused_weights("qkv", (mha.q_proj, mha.k_proj, mha.v_proj), np.dtype(np.float64))[0] is weight
    with pytest.raises(ValueError, match=r"expected role to be one of \['kv', 'qkv'\], got 'qk'"):
        mha.fused_weights("qk", np.float32)
    cross = nn.MultiHeadAttention(8, 2, kdim=4, vdim=6, seed=0)
    with pytest.raises(ValueError, match="one input width, got k_proj 4, v_proj 6"):
        cross.fused_weights("kv", np.float32)
    assert nn.MultiHeadAttention(8, 2, bias=False, seed=0).fused_weights("qkv", np.float32)[1] is None


def test_fully_masked_rows_give_zeros_not_nan():
    mha = nn.MultiHeadAttention(8, 2, seed=0)
    mha.load_state_dict({**mha.state_dict(), "out_proj.bias": np.linspace(-1, 1, 8)})  # a bias that shows
    x = np.random.default_rng(7).standard_normal((2, 4, 8)).astype(np.float32)
    key_mask = np.ones((2, 4), bool)
    key_mask[1] = False  # sequence 1 has no real token (torch gives NaN here)
    out, w = mha(x, key_mask=key_mask, need_weights=True)
    assert np.isfinite(out).all() and not w[1].any() and w[0].any()
    # no key: the heads give exactly 0, so the output is out_proj's bias exactly
    np.testing.assert_array_equal(out[1], np.broadcast_to(mha.out_proj.bias, out[1].shape))
    out, w = mha(x, key_mask=np.zeros((2, 4), bool), need_weights=True)  # no sequence has a token
    assert not np.isnan(out).any() and not w.any()
    np.testing.assert_array_equal(out, np.broadcast_to(mha.out_proj.bias, out.shape))
    float_mask = np.zeros((4, 4), np.float32)
    float_mask[2] = -np.inf
    out, w = mha(x, attn_mask=float_mask, need_weights=True)
    assert np.isfinite(out).all() and not w[:, 2].any()
    # float16 in, float16 out
    assert mha(x.astype(np.float16))[0].dtype == np.float16


def test_dropout_only_in_training_and_reproducible():
    x = np.random.default_rng(8).standard_normal((2, 6, 8)).astype(np.float32)
    mha = nn.MultiHeadAttention(8, 2, dropout=0.5, seed=0)
    assert np.array_equal(mha(x).output, mha(x).output)
    mha.train()
    mha.set_rng(1)
    a, wa = mha(x, need_weights=True, average_attn_weights=False)
    mha.set_rng(1)
    b = mha(x).output
    assert np.array_equal(a, b)
    assert (wa == 0).mean() > 0.3  # dropped weights
    assert not np.array_equal(a, mha.eval()(x).output)


def test_bad_input_errors():
    mha = nn.MultiHeadAttention(8, 2, seed=0)
    x = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"num_heads to divide d_model.*d_model=8 and num_heads=3"):
        nn.MultiHeadAttention(8, 3)
    with pytest.raises(ValueError, match="num_kv_heads to divide num_heads.*num_kv_heads=3"):
        nn.MultiHeadAttention(12, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_heads.*positive.*0"):
        nn.MultiHeadAttention(12, 0)
    with pytest.raises(ValueError, match=r"query of shape \(B, L, d_model=8\), got \(4, 8\).*batch axis"):
        mha(x[0])
    with pytest.raises(ValueError, match=r"query of shape \(B, L, d_model=8\), got \(2, 4, 6\)"):
        mha(np.zeros((2, 4, 6), np.float32))
    with pytest.raises(TypeError, match="query to be a floating-point array.*int"):
        mha(np.zeros((2, 4, 8), np.int32))
    with pytest.raises(ValueError, match=r"key of shape \(B=2, S, kdim=8\), got \(3, 5, 8\)"):
        mha(x, np.zeros((3, 5, 8), np.float32))
    with pytest.raises(ValueError, match=r"value of shape \(B=2, S=5, vdim=8\), got \(2, 6, 8\)"):
        mha(x, np.zeros((2, 5, 8)), np.zeros((2, 6, 8)))
    with pytest.raises(TypeError, match="key_mask to be boolean.*float64.*~key_padding_mask"):
        mha(x, key_mask=np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"key_mask of shape \(B, S\) = \(2, 4\), got \(4,\)"):
        mha(x, key_mask=np.ones(4, bool))
    with pytest.raises(ValueError, match=r"key_mask of shape \(B, S\) = \(2, 4\), got \(2, 3\)"):
        mha(x, key_mask=np.ones((2, 3), bool))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(L, S\) = \(4, 4\).*got \(4, 5\)"):
        mha(x, attn_mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match=r"\(B\*H, L, S\) masks must be reshaped"):
        mha(x, attn_mask=np.ones((4, 4, 4), bool))
    with pytest.raises(TypeError, match="attn_mask to be boolean.*int64"):
        mha(x, attn_mask=np.ones((4, 4), np.int64))
    with pytest.raises(ValueError, match="kdim=3"):
        nn.MultiHeadAttention(8, 2, kdim=3)(x)
    for dropout in (-0.1, 1.0):
        with pytest.raises(ValueError, match=rf"dropout.*\[0, 1\).*{dropout}"):
            nn.MultiHeadAttention(8, 2, dropout=dropout)


# ----------------------------------------------------------- single head


def test_single_head_self_attention_is_the_seed_formula():
    rng = np.random.default_rng(9)
    head = nn.SingleHeadSelfAttention(16, 8, seed=0).astype(np.float64)
    x = rng.standard_normal((5, 16))
    out, w = head(x)
    q, k, v = x @ head.q_proj.weight.T, x @ head.k_proj.weight.T, x @ head.v_proj.weight.T
    scores = q @ k.T / np.sqrt(8)
    expected_w = np.exp(scores - scores.max(-1, keepdims=True))
    expected_w /= expected_w.sum(-1, keepdims=True)
    assert_close(w, expected_w, 1e-12, "weights")
    assert_close(out, expected_w @ v, 1e-12, "output")
    assert out.shape == (5, 8)
    np.testing.assert_allclose(w.sum(-1), 1, rtol=0, atol=10 * np.finfo(np.float64).eps)  # 5 terms, 2 roundings each
    out_c, w_c = head(x, masks.causal_mask(5))
    assert not w_c[np.triu_indices(5, 1)].any()
    # causal: the same formula with the scores above the diagonal at -inf
    causal_scores = np.where(masks.causal_mask(5), scores, -np.inf)
    causal_w = np.exp(causal_scores - causal_scores.max(-1, keepdims=True))
    causal_w /= causal_w.sum(-1, keepdims=True)
    assert_close(w_c, causal_w, 1e-12, "causal weights")
    assert_close(out_c, causal_w @ v, 1e-12, "causal output")
    np.testing.assert_allclose(head(x, is_causal=True).weights, w_c, rtol=1e-15)
    np.testing.assert_allclose(head(x, is_causal=True).output, out_c, rtol=1e-15)
    batched = head(np.stack([x, x]))
    assert batched.output.shape == (2, 5, 8) and np.allclose(batched.output[1], out)
    with pytest.raises(ValueError, match=r"\(L, 16\).*got \(16,\)"):
        head(np.zeros(16))


# ------------------------------------------------------ per-head vs split-head


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_per_head_equals_split_head(num_kv_heads, bias):
    rng = np.random.default_rng(10)
    B, L, S, D, H = 2, 5, 7, 24, 4
    split = nn.MultiHeadAttention(D, H, num_kv_heads=num_kv_heads, bias=bias, seed=3).astype(np.float64)
    if bias:  # non-zero biases
        state = dict(split.state_dict())
        for key in state:
            if key.endswith("bias"):
                state[key] = rng.standard_normal(state[key].shape)
        split.load_state_dict(state)
    per_head = nn.PerHeadMultiHeadAttention.from_split(split)
    assert len(per_head.heads) == H and per_head.heads[0].q_proj.weight.shape == (D // H, D)
    x = rng.standard_normal((B, L, D))
    mem = rng.standard_normal((B, S, D))
    attn_mask = rng.random((B, H, L, S)) < 0.7
    _, key_mask = random_masks(rng, B, L, S)
    for args, kwargs in [
        ((x,), {}),
        ((x,), {"is_causal": True}),
        ((x, mem), {"key_mask": key_mask}),
        ((x, mem), {"attn_mask": attn_mask, "key_mask": key_mask}),
        ((x, mem, mem[:, :, ::-1].copy()), {"attn_mask": attn_mask[0, 0]}),
        ((x, mem), {"attn_mask": np.where(attn_mask[0, 0], 0.3, -np.inf)}),  # an additive (L, S) mask
    ]:
        a, wa = split(*args, need_weights=True, average_attn_weights=False, **kwargs)
        b, wb = per_head(*args, need_weights=True, average_attn_weights=False, **kwargs)
        assert_close(b, a, 1e-12, f"per-head output {kwargs.keys()}")
        assert_close(wb, wa, 1e-12, "per-head weights")
    # and back: to_split recovers the split-head module's parameters exactly
    back = per_head.to_split(num_kv_heads)
    for k, v in split.state_dict().items():
        assert np.array_equal(back.state_dict()[k], v), k
    np.testing.assert_array_equal(back(x)[0], split(x)[0])
    if num_kv_heads != 1:  # distinct key/value heads cannot be shared by all query heads
        with pytest.raises(ValueError, match="cannot share key/value heads with num_kv_heads=1"):
            per_head.to_split(1)


def test_per_head_seeded_module_to_split_and_errors():
    per_head = nn.PerHeadMultiHeadAttention(12, 3, seed=4)
    x = np.random.default_rng(11).standard_normal((1, 6, 12)).astype(np.float32)
    a = per_head(x, need_weights=True)
    split = per_head.to_split()
    b = split(x, need_weights=True)
    # the split-head module is the plain path: per-head float32 stays within its budget
    truth = copy.deepcopy(split).astype(np.float64)(x.astype(np.float64), need_weights=True)
    assert_within_budget(a.output, b.output, truth.output, "per-head output")
    assert_within_budget(a.weights, b.weights, truth.weights, "per-head weights")
    with pytest.raises(ValueError, match="head 1's k_proj differs from head 0's"):
        per_head.to_split(num_kv_heads=1)
    with pytest.raises(ValueError, match="kdim = vdim = d_model"):
        nn.PerHeadMultiHeadAttention.from_split(nn.MultiHeadAttention(12, 3, kdim=4))
    with pytest.raises(ValueError, match="num_heads to divide d_model.*d_model=10 and num_heads=4"):
        nn.PerHeadMultiHeadAttention(10, 4)


@given(
    B=st.integers(1, 3),
    L=st.integers(1, 8),
    S=st.integers(1, 8),
    H=st.sampled_from([1, 2, 3]),
    E=st.sampled_from([1, 4, 7]),
    self_attention=st.booleans(),
    average=st.booleans(),
)
def test_random_shapes_match_torch(torch, B, L, S, H, E, self_attention, average):
    rng = np.random.default_rng(B * 1000 + L * 100 + S * 10 + H + E)
    D = H * E
    theirs = torch_mha(D, H, np.float64, batch_first=True)
    ours = interop.from_torch(theirs)
    q = rng.standard_normal((B, L, D))
    kv = q if self_attention else rng.standard_normal((B, S, D))
    S = kv.shape[1]
    _, key_mask = random_masks(rng, B, L, S)
    out, w = ours(q, kv, key_mask=key_mask, need_weights=True, average_attn_weights=average)
    t_out, t_w = run_torch(theirs, q, kv, kv, key_padding_mask=t(~key_mask), average_attn_weights=average)
    assert_close(out, t_out, 1e-10, "output")
    assert_close(w, t_w, 1e-10, "weights")


def test_attention_backend_is_chosen_by_name():
    rng = np.random.default_rng(12)
    block = nn.TransformerBlock(32, 4, 64, seed=0).astype(np.float64)
    x = rng.standard_normal((2, 37, 32))
    key_mask = masks.padding_mask(np.array([37, 20]), 37)
    naive = block(x, key_mask=key_mask, is_causal=True)
    assert block.set_attention_backend("flash") is block and block.attn.backend == "flash"
    flash = block(x, key_mask=key_mask, is_causal=True)
    assert_close(flash, naive, 1e-10, "flash backend")
    with pytest.raises(ValueError, match="weights"):
        block(x, need_weights=True)
    with pytest.raises(ValueError, match="unknown attention backend"):
        block.set_attention_backend("nope")
    assert block.attn.backend == "flash"


@given(
    B=st.integers(1, 2),
    L=st.integers(1, 6),
    S=st.integers(1, 6),
    H=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    E=st.sampled_from([1, 3, 8]),
    causal=st.booleans(),
)
def test_random_shapes_per_head_equals_split_head(B, L, S, H, group, E, causal):
    Hkv = max(1, H // group)
    rng = np.random.default_rng(B + 10 * L + 100 * S + 1000 * H + 10000 * E)
    split = nn.MultiHeadAttention(H * E, H, num_kv_heads=Hkv, seed=int(rng.integers(1 << 30))).astype(np.float64)
    per_head = nn.PerHeadMultiHeadAttention.from_split(split)
    x = rng.standard_normal((B, L, H * E))
    mem = rng.standard_normal((B, S, H * E))
    key_mask = rng.random((B, S)) < 0.8  # fully masked rows allowed: both give zeros
    a = split(x, mem, key_mask=key_mask, is_causal=causal, need_weights=True, average_attn_weights=False)
    b = per_head(x, mem, key_mask=key_mask, is_causal=causal, need_weights=True, average_attn_weights=False)
    assert_close(b.output, a.output, 1e-12, "output")
    assert_close(b.weights, a.weights, 1e-12, "weights")


# ------------------------------------------------- from_torch, every mask kind


def _mha_pair(batch_first, kdim, vdim, bias, dtype=np.float64):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(12, 3, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                         dtype=tdtype(dtype)).eval()
    return theirs, interop.from_torch(theirs)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kv", [(None, None), (5, 7)], ids=["self", "kdim_vdim"])
@pytest.mark.parametrize("bias", [True, False])
def test_mha_from_torch_with_every_mask_kind(torch, batch_first, kv, bias):
    theirs, ours = _mha_pair(batch_first, *kv, bias)
    assert ours.dtype == np.float64 and (ours.q_proj.bias is not None) == bias
    rng = np.random.default_rng(1)
    B, L, S = 2, 4, 6
    x = rng.standard_normal((B, L, 12))
    key = rng.standard_normal((B, S, kv[0] or 12))
    value = rng.standard_normal((B, S, kv[1] or 12))
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, -2:] = True
    am2 = torch.from_numpy(rng.random((L, S)) < 0.3)
    am2[:, 0] = False
    am3 = torch.from_numpy(rng.random((B * 3, L, S)) < 0.3)
    am3[..., 1] = False
    fm = torch.from_numpy(rng.standard_normal((L, S)))

    def tin(a):
        a = torch.from_numpy(a)
        return a if batch_first else a.transpose(0, 1)

    for am, kp in [(None, None), (None, kpm), (am2, None), (am2, kpm), (am3, None), (am3, kpm), (fm, kpm)]:
        ours_am = None if am is None else masks.from_torch_mask(am)
        if ours_am is not None and ours_am.ndim == 3:
            ours_am = ours_am.reshape(B, 3, L, S)
        ours_km = None if kp is None else masks.from_torch_mask(kp)
        for avg in (True, False):
            to, tw = theirs(tin(x), tin(key), tin(value), key_padding_mask=kp, attn_mask=am,
                            need_weights=True, average_attn_weights=avg)
            to = to if batch_first else to.transpose(0, 1)
            o, w = ours(x, key, value, attn_mask=ours_am, key_mask=ours_km, need_weights=True, average_attn_weights=avg)
            np.testing.assert_allclose(o, to.detach().numpy(), rtol=1e-12, atol=1e-13)
            np.testing.assert_allclose(w, tw.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert ours(x, key, value)[1] is None


def test_gqa_cross_attention_equals_torch_sdpa_with_repeated_kv_heads(torch):
    mha = nn.MultiHeadAttention(16, 4, num_kv_heads=2, seed=3).astype(np.float64)
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 7, 16))
    km = np.ones((2, 7), bool)
    km[1, 4:] = False
    o, w = mha(x, y, key_mask=km, need_weights=True, average_attn_weights=False)
    q = (x @ mha.q_proj.weight.T + mha.q_proj.bias).reshape(2, 5, 4, 4).transpose(0, 2, 1, 3)
    k = (y @ mha.k_proj.weight.T + mha.k_proj.bias).reshape(2, 7, 2, 4).transpose(0, 2, 1, 3)
    v = (y @ mha.v_proj.weight.T + mha.v_proj.bias).reshape(2, 7, 2, 4).transpose(0, 2, 1, 3)
    heads = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(km[:, None, None, :]), enable_gqa=True).numpy()
    expected = heads.transpose(0, 2, 1, 3).reshape(2, 5, 16) @ mha.out_proj.weight.T + mha.out_proj.bias
    np.testing.assert_allclose(o, expected, rtol=1e-12, atol=1e-13)
    assert w.shape == (2, 4, 5, 7) and not w[1, ..., 4:].any()


# ----------------------------------------------------------------------------- any finite magnitude


def _torch_weights(module) -> dict:
    """q, k, v, o weights and biases of a torch.nn.MultiheadAttention, as arrays."""
    D = module.embed_dim
    w = module.in_proj_weight.detach().numpy()
    b = None if module.in_proj_bias is None else module.in_proj_bias.detach().numpy()
    parts = {f"{n}_w": w[i * D:(i + 1) * D] for i, n in enumerate("qkv")}
    parts.update({f"{n}_b": None if b is None else b[i * D:(i + 1) * D] for i, n in enumerate("qkv")})
    parts["o_w"] = module.out_proj.weight.detach().numpy()
    parts["o_b"] = None if module.out_proj.bias is None else module.out_proj.bias.detach().numpy()
    return parts


@given(
    B=st.integers(1, 2), L=st.integers(1, 6), S=st.integers(1, 6), H=st.sampled_from([1, 2]),
    E=st.sampled_from([1, 4, 16]), self_attention=st.booleans(), causal=st.booleans(),
    exponents=st.tuples(EXPONENTS, EXPONENTS), backend=st.sampled_from(["naive", "flash"]),
    seed=st.integers(0, 2**16),
)
def test_any_finite_magnitude_gives_torch_float64_answer(torch, B, L, S, H, E, self_attention, causal,
                                                         exponents, backend, seed):
    """Finite in, finite out (tests/wide_range.py): float32 activations from 1e-30 to
    1e30 through MultiHeadAttention give torch.nn.MultiheadAttention's float64 answer
    (same weights), never NaN; torch's float32 module sets the budget where it is finite."""
    rng = np.random.default_rng(seed)
    D = H * E
    theirs = torch_mha(D, H, np.float32, seed=seed, batch_first=True)
    ours = interop.from_torch(theirs)
    ours.set_attention_backend(backend)
    x = wide(rng, (B, L, D), exponents[0])
    kv = x if self_attention else wide(rng, (B, S, D), exponents[1])
    S = kv.shape[1]
    mask = masks.causal_mask(L, S) if causal else None
    tmask = None if mask is None else t(~mask)  # torch's polarity: True = masked
    out = ours(x, kv, kv, attn_mask=mask).output
    assert out.dtype == np.float32
    truth = run_torch64(theirs, x, kv, kv, attn_mask=tmask, need_weights=False)[0]
    oracle = run_torch(theirs, x, kv, kv, attn_mask=tmask, need_weights=False)[0]
    natural = mha_natural_size(x, kv, kv, _torch_weights(theirs), H, mask)
    assert_like_truth(out, oracle, truth, natural, f"output ({backend})")


@pytest.mark.parametrize("backend", ["naive", "flash"])
@pytest.mark.parametrize("magnitude", [4e18, 1e20, 1e30])
def test_kv_cache_decoding_with_huge_activations_gives_torch_float64_answer(torch, backend, magnitude):
    """The decoders' path: KVCache.attend (bottom-right causal over the cache) with
    queries and keys far beyond where q @ k^T fits float32 gives torch's math backend
    in float64, step by step, never NaN."""
    rng = np.random.default_rng(int(math.log10(magnitude)))
    B, Hq, Hkv, E, prompt, steps = 2, 4, 2, 16, 5, 3
    cache = nn.KVCache(1, B, Hkv, E, prompt + steps)
    for L in [prompt] + [1] * steps:
        q = wide(rng, (B, Hq, L, E), 0) * np.float32(magnitude)
        k = wide(rng, (B, Hkv, L, E), 0) * np.float32(magnitude)
        v = wide(rng, (B, Hkv, L, E), 0)
        out = cache.attend(0, q, k, v, backend=backend)
        S = cache.length
        keys, values = cache.keys[0][:, :, :S], cache.values[0][:, :, :S]
        truth = torch_math(torch, q, keys, values, masks.causal_mask(L, S, align="bottom_right"), enable_gqa=True)
        assert not np.isnan(out).any()
        np.testing.assert_allclose(out, truth, rtol=1e-5, atol=1e-6 * np.abs(truth).max())
