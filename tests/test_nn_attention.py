"""Attention modules against torch.nn.MultiheadAttention (after from_torch), a
float64 reference, and each other (per-head vs split-head)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from attnkit import masks, nn
from conftest import assert_close, reference_attention

TOL = {np.float64: 1e-10, np.float32: 1e-5}
TORCH_DTYPE = {np.float64: torch.float64, np.float32: torch.float32}


def t(a):
    return None if a is None else torch.from_numpy(np.array(a))


def torch_mha(d_model, num_heads, dtype, seed=0, **kwargs):
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(d_model, num_heads, dtype=TORCH_DTYPE[dtype], **kwargs).eval()
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
def test_self_attention_matches_torch_with_masks_and_weights(dtype, average):
    rng = np.random.default_rng(0)
    B, L, D, H = 3, 9, 24, 4
    theirs = torch_mha(D, H, dtype, batch_first=True)
    ours = nn.MultiHeadAttention.from_torch(theirs)
    assert ours.dtype == dtype
    x = rng.standard_normal((B, L, D)).astype(dtype)
    attn_mask, key_mask = random_masks(rng, B, L, L)

    out, w = ours(x, attn_mask=attn_mask, key_mask=key_mask, need_weights=True, average_attn_weights=average)
    t_out, t_w = run_torch(
        theirs, x, x, x, attn_mask=t(masks.from_torch_mask(attn_mask)), key_padding_mask=t(~key_mask),
        need_weights=True, average_attn_weights=average,
    )
    assert out.dtype == dtype and w.dtype == dtype
    assert w.shape == ((B, L, L) if average else (B, H, L, L))
    assert_close(out, t_out, TOL[dtype], "output")
    assert_close(w, t_w, TOL[dtype], "weights")
    # masked keys get exactly zero weight
    assert not w[np.broadcast_to(~(attn_mask & key_mask[:, None, :]), (B, L, L))].any() if average else True

    # without weights torch takes its SDPA fast path; ours gives the same output
    out2, none = ours(x, attn_mask=attn_mask, key_mask=key_mask)
    assert none is None
    assert_close(out2, out, TOL[dtype], "output without weights")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_mask_and_causal_match_torch(dtype):
    rng = np.random.default_rng(1)
    B, L, D, H = 2, 7, 16, 2
    theirs = torch_mha(D, H, dtype, batch_first=True)
    ours = nn.MultiHeadAttention.from_torch(theirs)
    x = rng.standard_normal((B, L, D)).astype(dtype)
    float_mask = rng.standard_normal((L, L)).astype(dtype)
    out, w = ours(x, attn_mask=float_mask, need_weights=True)
    t_out, t_w = run_torch(theirs, x, x, x, attn_mask=t(float_mask))
    assert_close(out, t_out, TOL[dtype], "float mask output")
    assert_close(w, t_w, TOL[dtype], "float mask weights")

    causal = masks.causal_mask(L)
    out, w = ours(x, is_causal=True, need_weights=True, average_attn_weights=False)
    t_out, t_w = run_torch(
        theirs, x, x, x, attn_mask=t(~causal), is_causal=True, need_weights=True, average_attn_weights=False
    )
    assert_close(out, t_out, TOL[dtype], "causal output")
    assert_close(w, t_w, TOL[dtype], "causal weights")
    assert not w[..., ~causal].any()

    # is_causal combines with key_mask and with a float attn_mask
    _, key_mask = random_masks(rng, B, L, L)
    key_mask[:, :] = True
    key_mask[0, 3] = False
    out, w = ours(x, attn_mask=float_mask, key_mask=key_mask, is_causal=True, need_weights=True)
    additive = np.where(causal, float_mask, -np.inf).astype(dtype)
    t_out, t_w = run_torch(
        theirs, x, x, x, attn_mask=t(additive),
        key_padding_mask=t(np.where(key_mask, 0.0, -np.inf).astype(dtype)),
    )
    assert_close(out, t_out, TOL[dtype], "causal + float + key mask")
    assert_close(w, t_w, TOL[dtype], "causal + float + key mask weights")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_cross_attention_with_kdim_vdim_matches_torch(dtype, bias):
    rng = np.random.default_rng(2)
    B, L, S, D, H, kdim, vdim = 2, 5, 11, 12, 3, 7, 9
    theirs = torch_mha(D, H, dtype, batch_first=True, kdim=kdim, vdim=vdim, bias=bias)
    assert theirs.in_proj_weight is None  # the separate q/k/v_proj_weight layout
    ours = nn.MultiHeadAttention.from_torch(theirs)
    assert (ours.k_proj.weight.shape, ours.v_proj.weight.shape) == ((D, kdim), (D, vdim))
    assert (ours.q_proj.bias is not None) == bias
    q = rng.standard_normal((B, L, D)).astype(dtype)
    k = rng.standard_normal((B, S, kdim)).astype(dtype)
    v = rng.standard_normal((B, S, vdim)).astype(dtype)
    _, key_mask = random_masks(rng, B, L, S)
    out, w = ours(q, k, v, key_mask=key_mask, need_weights=True)
    t_out, t_w = run_torch(theirs, q, k, v, key_padding_mask=t(~key_mask))
    assert out.shape == (B, L, D) and w.shape == (B, L, S)
    assert_close(out, t_out, TOL[dtype], "cross output")
    assert_close(w, t_w, TOL[dtype], "cross weights")


@pytest.mark.parametrize("bias", [True, False])
def test_batch_first_false_module_and_packed_cross_attention(bias):
    rng = np.random.default_rng(3)
    B, L, S, D, H = 2, 6, 4, 20, 5
    theirs = torch_mha(D, H, np.float64, batch_first=False, bias=bias)
    ours = nn.MultiHeadAttention.from_torch(theirs)
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
    again = ours.to_torch(batch_first=False)
    t_out2, _ = run_torch(again, q, kv, kv, attn_mask=t(~bool_mask.reshape(B * H, L, S)))
    assert_close(t_out2, t_out, 1e-12, "to_torch round trip")


def test_to_torch_with_kdim_vdim_and_errors():
    ours = nn.MultiHeadAttention(8, 2, kdim=3, vdim=5, seed=0).astype(np.float64)
    theirs = ours.to_torch()
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((1, 4, 8)), rng.standard_normal((1, 6, 3)), rng.standard_normal((1, 6, 5))
    assert_close(ours(q, k, v).output, run_torch(theirs, q, k, v)[0], 1e-12, "to_torch kdim/vdim")
    with pytest.raises(ValueError, match="grouped-query"):
        nn.MultiHeadAttention(8, 4, num_kv_heads=2, seed=0).to_torch()
    with pytest.raises(TypeError, match="MultiheadAttention"):
        nn.MultiHeadAttention.from_torch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="add_bias_kv"):
        nn.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grouped_query_attention_against_reference(dtype):
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
    assert_close(out, ref, 3 * TOL[dtype], "GQA output")
    assert_close(w, ref_w, 3 * TOL[dtype], "GQA weights")

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
    fused = mha(x).output  # key is value is query: one fused matmul
    separate = mha(x, x.copy(), x.copy()).output  # distinct arrays: three matmuls
    kv_fused = mha(x, x.copy()).output  # key is value: fused KV
    assert_close(fused, separate, 1e-6, "fused vs separate")
    assert_close(kv_fused, separate, 1e-6, "fused kv vs separate")

    # replacing a projection's weight (assignment or load_state_dict) refreshes the cache
    mha.v_proj.weight = np.zeros((16, 16))
    zero_v = mha(x).output
    assert np.allclose(zero_v, mha.out_proj.bias)  # v = bias = 0, so output = out_proj's bias
    assert_close(zero_v, mha(x, x.copy()).output, 1e-6, "after assignment")
    state = dict(mha.state_dict())
    state["v_proj.bias"] = np.ones(16)
    mha.load_state_dict(state)
    assert_close(mha(x).output, mha(x, x.copy(), x.copy()).output, 1e-6, "after load_state_dict")
    assert_close(mha(x).output, np.broadcast_to(mha.out_proj.weight.sum(1) + mha.out_proj.bias, (2, 5, 16)),
                 1e-6, "v = ones")
    # a float64 input through a float32 module computes in float64, cached per dtype
    assert mha(x.astype(np.float64)).output.dtype == np.float64


def test_fully_masked_rows_give_zeros_not_nan():
    mha = nn.MultiHeadAttention(8, 2, seed=0)
    x = np.random.default_rng(7).standard_normal((2, 4, 8)).astype(np.float32)
    key_mask = np.ones((2, 4), bool)
    key_mask[1] = False  # sequence 1 has no real token
    out, w = mha(x, key_mask=key_mask, need_weights=True)
    assert np.isfinite(out).all() and not w[1].any()
    assert np.allclose(out[1], mha.out_proj.bias)
    float_mask = np.zeros((4, 4), np.float32)
    float_mask[2] = -np.inf
    out, w = mha(x, attn_mask=float_mask, need_weights=True)
    assert np.isfinite(out).all() and not w[:, 2].any()


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
    with pytest.raises(ValueError, match="num_kv_heads to divide num_heads"):
        nn.MultiHeadAttention(12, 4, num_kv_heads=3)
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
    with pytest.raises(TypeError, match="key_mask to be boolean.*~key_padding_mask"):
        mha(x, key_mask=np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"key_mask of shape \(B, S\) = \(2, 4\), got \(4,\)"):
        mha(x, key_mask=np.ones(4, bool))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(L, S\) = \(4, 4\).*got \(4, 5\)"):
        mha(x, attn_mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match=r"\(B\*H, L, S\) masks must be reshaped"):
        mha(x, attn_mask=np.ones((4, 4, 4), bool))
    with pytest.raises(TypeError, match="attn_mask to be boolean.*int64"):
        mha(x, attn_mask=np.ones((4, 4), np.int64))
    with pytest.raises(ValueError, match="kdim=3"):
        nn.MultiHeadAttention(8, 2, kdim=3)(x)
    with pytest.raises(ValueError, match=r"dropout.*\[0, 1\)"):
        nn.MultiHeadAttention(8, 2, dropout=-0.1)


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
    assert out.shape == (5, 8) and np.allclose(w.sum(-1), 1)
    out_c, w_c = head(x, masks.causal_mask(5))
    assert not w_c[np.triu_indices(5, 1)].any()
    assert np.allclose(head(x, is_causal=True).weights, w_c)
    batched = head(np.stack([x, x]))
    assert batched.output.shape == (2, 5, 8) and np.allclose(batched.output[1], out)
    with pytest.raises(ValueError, match=r"\(L, 16\)"):
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
        ((x, mem), {"attn_mask": attn_mask, "key_mask": key_mask}),
        ((x, mem, mem[:, :, ::-1].copy()), {"attn_mask": attn_mask[0, 0]}),
    ]:
        a, wa = split(*args, need_weights=True, average_attn_weights=False, **kwargs)
        b, wb = per_head(*args, need_weights=True, average_attn_weights=False, **kwargs)
        assert_close(b, a, 1e-12, f"per-head output {kwargs.keys()}")
        assert_close(wb, wa, 1e-12, "per-head weights")
    # and back: to_split recovers the split-head module's parameters exactly
    back = per_head.to_split(num_kv_heads)
    for k, v in split.state_dict().items():
        assert np.array_equal(back.state_dict()[k], v), k


def test_per_head_seeded_module_to_split_and_errors():
    per_head = nn.PerHeadMultiHeadAttention(12, 3, seed=4)
    x = np.random.default_rng(11).standard_normal((1, 6, 12)).astype(np.float32)
    a = per_head(x, need_weights=True)
    b = per_head.to_split()(x, need_weights=True)
    assert_close(b.output, a.output, 1e-5, "to_split output")
    assert_close(b.weights, a.weights, 1e-5, "to_split weights")
    with pytest.raises(ValueError, match="head 1's k_proj differs from head 0's"):
        per_head.to_split(num_kv_heads=1)
    with pytest.raises(ValueError, match="kdim = vdim = d_model"):
        nn.PerHeadMultiHeadAttention.from_split(nn.MultiHeadAttention(12, 3, kdim=4))


@given(
    B=st.integers(1, 3),
    L=st.integers(1, 8),
    S=st.integers(1, 8),
    H=st.sampled_from([1, 2, 3]),
    E=st.sampled_from([1, 4, 7]),
    self_attention=st.booleans(),
    average=st.booleans(),
)
def test_random_shapes_match_torch(B, L, S, H, E, self_attention, average):
    rng = np.random.default_rng(B * 1000 + L * 100 + S * 10 + H + E)
    D = H * E
    theirs = torch_mha(D, H, np.float64, batch_first=True)
    ours = nn.MultiHeadAttention.from_torch(theirs)
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
