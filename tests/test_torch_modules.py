"""attnkit.torch modules: parity with torch.nn, with attnkit.nn (weights moved either
way), the fused QKV buffer, the KV cache, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import attnkit.nn as ann
import attnkit.torch as at
from attnkit.functional.masks import causal_mask


def _x(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _torch_mha_like(mha: at.MultiHeadAttention) -> nn.MultiheadAttention:
    """torch.nn.MultiheadAttention holding the same weights (packed in_proj)."""
    ref = nn.MultiheadAttention(mha.d_model, mha.num_heads, bias=mha.q_proj.bias is not None, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight]))
        ref.out_proj.weight.copy_(mha.out_proj.weight)
        if ref.in_proj_bias is not None:
            ref.in_proj_bias.copy_(torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]))
            ref.out_proj.bias.copy_(mha.out_proj.bias)
    return ref.eval()


# ----- torch.nn oracles ---------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_mha_matches_torch_multihead_attention(bias):
    mha = at.MultiHeadAttention(48, 6, bias=bias).eval()
    ref = _torch_mha_like(mha)
    x = _x(3, 11, 48)
    keep = torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[:, 0] = True
    pattern = torch.rand(11, 11, generator=torch.Generator().manual_seed(2)) > 0.5
    pattern.fill_diagonal_(True)
    causal = torch.from_numpy(causal_mask(11))
    with torch.no_grad():
        cases = [
            (mha(x), ref(x, x, x)),
            (mha(x, is_causal=True, need_weights=True), ref(x, x, x, attn_mask=~causal)),
            (mha(x, key_mask=keep, need_weights=True), ref(x, x, x, key_padding_mask=~keep)),
            (mha(x, attn_mask=pattern, need_weights=True, average_attn_weights=False),
             ref(x, x, x, attn_mask=~pattern, average_attn_weights=False)),
        ]
    for (out, w), (ref_out, ref_w) in cases:
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        if w is not None:
            torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def test_cross_attention_matches_torch():
    mha = at.MultiHeadAttention(32, 4).eval()
    ref = _torch_mha_like(mha)
    q, kv = _x(2, 5, 32, seed=1), _x(2, 9, 32, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(mha(q, kv).output, ref(q, kv, kv)[0], rtol=1e-5, atol=1e-6)
        v = _x(2, 9, 32, seed=3)
        torch.testing.assert_close(mha(q, kv, v).output, ref(q, kv, v)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_block_matches_transformer_encoder_layer(norm_first, activation):
    ref = nn.TransformerEncoderLayer(32, 4, 80, dropout=0.0, activation=activation, batch_first=True,
                                     norm_first=norm_first).eval()
    block = at.TransformerBlock(32, 4, 80, activation=activation, norm_first=norm_first).eval()
    sd = ref.state_dict()
    w, b = sd["self_attn.in_proj_weight"], sd["self_attn.in_proj_bias"]
    block.load_state_dict({
        "attn.q_proj.weight": w[:32], "attn.k_proj.weight": w[32:64], "attn.v_proj.weight": w[64:],
        "attn.q_proj.bias": b[:32], "attn.k_proj.bias": b[32:64], "attn.v_proj.bias": b[64:],
        "attn.out_proj.weight": sd["self_attn.out_proj.weight"], "attn.out_proj.bias": sd["self_attn.out_proj.bias"],
        "ffn.fc1.weight": sd["linear1.weight"], "ffn.fc1.bias": sd["linear1.bias"],
        "ffn.fc2.weight": sd["linear2.weight"], "ffn.fc2.bias": sd["linear2.bias"],
        "norm1.weight": sd["norm1.weight"], "norm1.bias": sd["norm1.bias"],
        "norm2.weight": sd["norm2.weight"], "norm2.bias": sd["norm2.bias"],
    })
    x = _x(2, 13, 32)
    keep = torch.ones(2, 13, dtype=torch.bool)
    keep[1, 9:] = False
    with torch.no_grad():
        torch.testing.assert_close(block(x), ref(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block(x, is_causal=True),
                                   ref(x, src_mask=nn.Transformer.generate_square_subsequent_mask(13), is_causal=True),
                                   rtol=1e-5, atol=1e-5)
        ours = block(x, key_mask=keep)
        # torch's fast path returns zeros at padded positions; compare the real tokens
        theirs = ref(x, src_key_padding_mask=~keep)
        torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-5, atol=1e-5)


def test_round_trip_through_torch_nn_modules():
    ref = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    mha = at.MultiHeadAttention.from_torch(ref).eval()
    x = _x(2, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(mha(x).output, ref(x, x, x)[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mha.to_torch()(x, x, x)[0], ref(x, x, x)[0], rtol=1e-5, atol=1e-6)
    layer = nn.TransformerEncoderLayer(32, 4, 48, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True).eval()
    block = at.TransformerBlock.from_torch(layer).eval()
    with torch.no_grad():
        torch.testing.assert_close(block(x), layer(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block.to_torch()(x), layer(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="grouped-query"):
        at.MultiHeadAttention(32, 4, num_kv_heads=2).to_torch()


# ----- NumPy <-> torch -----------------------------------------------------------------------


def _numpy_call(module, x, **kw):
    out = module(x, **kw)
    return out[0] if isinstance(out, tuple) else out


NUMPY_MODULES = [
    ("mha", lambda: ann.MultiHeadAttention(48, 6, seed=1), 48),
    ("mha_gqa", lambda: ann.MultiHeadAttention(48, 6, num_kv_heads=2, seed=2), 48),
    ("mha_nobias", lambda: ann.MultiHeadAttention(24, 3, bias=False, seed=3), 24),
    ("mha_head59_mqa", lambda: ann.MultiHeadAttention(118, 2, num_kv_heads=1, seed=8), 118),
    ("block_post_relu", lambda: ann.TransformerBlock(32, 4, 64, seed=4), 32),
    ("block_pre_gelu", lambda: ann.TransformerBlock(32, 4, 64, activation="gelu", norm_first=True, seed=5), 32),
    ("ffn_gelu_tanh", lambda: ann.FeedForward(16, 40, "gelu_tanh", seed=6), 16),
    ("layernorm", lambda: ann.LayerNorm(16, eps=1e-6), 16),
    ("linear", lambda: ann.Linear(16, 7, seed=7), 16),
]


@pytest.mark.parametrize("name,make,d", NUMPY_MODULES, ids=[m[0] for m in NUMPY_MODULES])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_and_torch_agree_after_moving_weights_both_ways(name, make, d, dtype):
    np_module = make().astype(dtype)
    x = np.random.default_rng(0).standard_normal((2, 9, d)).astype(dtype)
    torch_module = at.from_numpy(np_module)
    assert type(torch_module).__name__ == type(np_module).__name__
    assert list(torch_module.state_dict()) == list(np_module.state_dict())
    assert next(torch_module.parameters()).dtype == getattr(torch, dtype)
    kwargs = {"is_causal": True} if name.startswith(("mha", "block")) else {}
    expected = _numpy_call(np_module, x, **kwargs)
    with torch.no_grad():
        got = _numpy_call(torch_module, torch.from_numpy(x), **kwargs).numpy()
    tol = 1e-10 if dtype == "float64" else 2e-5
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    # back to NumPy: a fresh module, and load_state_dict into an existing one from tensors
    back = at.to_numpy(torch_module)
    np.testing.assert_allclose(_numpy_call(back, x, **kwargs), expected, rtol=tol, atol=tol)
    other = make().astype(dtype)
    other.load_state_dict(torch_module.state_dict())
    np.testing.assert_allclose(_numpy_call(other, x, **kwargs), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("L,S", [(97, 97), (1, 97), (97, 33)])
def test_odd_sizes_agree_with_numpy_in_float64(L, S):
    """Head dim 111, lengths 1 and 97, L != S, cross attention with padding, causal."""
    np_mha = ann.MultiHeadAttention(222, 2, seed=9).astype("float64")
    t_mha = at.from_numpy(np_mha)
    rng = np.random.default_rng(L + S)
    q, kv = rng.standard_normal((2, L, 222)), rng.standard_normal((2, S, 222))
    keep = rng.random((2, S)) > 0.2
    keep[:, 0] = True
    expected = np_mha(q, kv, key_mask=keep, is_causal=True, need_weights=True)
    with torch.no_grad():
        got = t_mha(torch.from_numpy(q), torch.from_numpy(kv), key_mask=torch.from_numpy(keep), is_causal=True,
                    need_weights=True)
        sdpa = t_mha(torch.from_numpy(q), torch.from_numpy(kv), key_mask=torch.from_numpy(keep), is_causal=True)
    np.testing.assert_allclose(got.output.numpy(), expected.output, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got.weights.numpy(), expected.weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sdpa.output.numpy(), expected.output, rtol=1e-10, atol=1e-10)


def test_torch_trained_weights_run_in_numpy():
    """Weights changed by a torch optimizer step move to NumPy and give torch's outputs."""
    torch_mha = at.MultiHeadAttention(32, 4, num_kv_heads=2)
    opt = torch.optim.SGD(torch_mha.parameters(), lr=0.5)
    x = _x(2, 7, 32)
    torch_mha(x, is_causal=True).output.square().mean().backward()
    opt.step()
    np_mha = at.to_numpy(torch_mha)
    keep = np.ones((2, 7), dtype=bool)
    keep[0, 5:] = False
    with torch.no_grad():
        expected = torch_mha(x, key_mask=torch.from_numpy(keep)).output.numpy()
    got = np_mha(x.numpy(), key_mask=keep).output
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_same_seed_gives_the_same_weights_on_both_sides():
    for np_mod, t_mod in (
        (ann.MultiHeadAttention(16, 2, seed=11), at.MultiHeadAttention(16, 2, seed=11)),
        (ann.TransformerBlock(16, 2, 32, seed=12), at.TransformerBlock(16, 2, 32, seed=12)),
    ):
        for key, value in np_mod.state_dict().items():
            np.testing.assert_array_equal(t_mod.state_dict()[key].numpy(), value)


def test_masks_agree_with_numpy():
    np_mha = ann.MultiHeadAttention(32, 4, seed=0)
    t_mha = at.from_numpy(np_mha)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    bool_mask = rng.random((2, 4, 6, 6)) > 0.4
    bool_mask[0, 1, 2] = False  # a fully masked row: output is out_proj's bias, not NaN
    float_mask = rng.standard_normal((6, 6)).astype(np.float32)
    for kw in ({"attn_mask": bool_mask}, {"attn_mask": float_mask, "is_causal": True},
               {"key_mask": rng.random((2, 6)) > 0.3, "need_weights": True}):
        expected = np_mha(x, **kw)
        with torch.no_grad():
            got = t_mha(torch.from_numpy(x), **{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                                                for k, v in kw.items()})
        np.testing.assert_allclose(got.output.numpy(), expected.output, rtol=2e-5, atol=2e-5)
        assert np.isfinite(got.output.numpy()).all()
        if kw.get("need_weights"):
            np.testing.assert_allclose(got.weights.numpy(), expected.weights, rtol=2e-5, atol=2e-6)


# ----- fused QKV -----------------------------------------------------------------------------


def test_fused_qkv_buffer_is_shared_and_kept_through_training_and_conversion():
    mha = at.MultiHeadAttention(32, 4, num_kv_heads=2)
    with torch.no_grad():
        assert mha._fused("weight") is mha._qkv_weight  # no copy at inference
    # gradients reach all three projections through the concatenation
    x = _x(2, 5, 32)
    mha(x).output.sum().backward()
    assert all(p.weight.grad is not None and p.weight.grad.abs().sum() > 0
               for p in (mha.q_proj, mha.k_proj, mha.v_proj))
    torch.optim.Adam(mha.parameters(), lr=0.1).step()
    mha.load_state_dict(at.numpy_state_dict(at.MultiHeadAttention(32, 4, num_kv_heads=2)))
    with torch.no_grad():
        assert mha._fused("weight") is mha._qkv_weight  # in-place updates keep the views
        fused = mha(x).output
        unfused = mha(x, x.clone(), x.clone()).output  # separate projections
    torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)
    double = mha.double()
    with torch.no_grad():
        assert double._fused("weight") is double._qkv_weight and double._qkv_weight.dtype == torch.float64
    # a parameter replaced from outside: the fused path notices and concatenates instead
    mha.q_proj.weight = nn.Parameter(torch.zeros(32, 32, dtype=torch.float64))
    with torch.no_grad():
        assert mha._fused("weight") is not mha._qkv_weight
        assert (mha(x.double()).output - mha(x.double(), x.double().clone()).output).abs().max() < 1e-12


@pytest.mark.parametrize("bias", [True, False])
def test_fused_gradients_equal_the_unfused_ones(bias):
    """The fused projection's backward hands each of q/k/v_proj exactly its gradient."""
    mha = at.MultiHeadAttention(24, 6, num_kv_heads=3, bias=bias).double()
    x = _x(2, 7, 24, dtype=torch.float64).requires_grad_()

    def grads(fused: bool):
        for p in (*mha.parameters(), x):
            p.grad = None
        out = mha(x, is_causal=True) if fused else mha(x, x.clone(), x.clone(), is_causal=True)
        out.output.square().sum().backward()
        return {**{n: p.grad.clone() for n, p in mha.named_parameters()}, "x": x.grad.clone()}

    fused, unfused = grads(True), grads(False)
    assert set(fused) == set(unfused)
    for name in fused:
        torch.testing.assert_close(fused[name], unfused[name], rtol=1e-12, atol=1e-12, msg=name)
    small = x[:1, :3].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: mha(x, is_causal=True).output, (small,), fast_mode=True)


# ----- KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_kv_cache_decoding_equals_full_causal_attention(num_kv_heads):
    block = at.TransformerBlock(32, 4, 64, norm_first=True, seed=0).eval()
    block.attn = at.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, seed=1)
    x = _x(2, 9, 32)
    cache = block.attn.new_kv_cache(batch_size=2, max_length=16)
    with torch.no_grad():
        full = block(x, is_causal=True)
        steps = [block(x[:, :4], is_causal=True, kv_cache=cache)]  # a prompt: bottom-right causal
        steps += [block(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(4, 9)]
    assert cache.length == 9
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_kv_cache_with_left_padding():
    mha = at.MultiHeadAttention(16, 2, seed=3).eval()
    x = _x(2, 6, 16)
    real = torch.tensor([[True] * 6, [False, False] + [True] * 4])  # sequence 1 is left-padded
    cache = at.KVCache(1, 2, 2, 8, 10)
    cache.add_padding(real)
    with torch.no_grad():
        full = mha(x, is_causal=True, key_mask=real).output
        cached = mha(x, is_causal=True, kv_cache=cache).output
    torch.testing.assert_close(cached[real], full[real], rtol=1e-5, atol=1e-6)


def test_kv_cache_without_causal_and_crop():
    mha = at.MultiHeadAttention(16, 4, seed=4).eval()
    x = _x(1, 6, 16)
    cache = mha.new_kv_cache(1, 8)
    with torch.no_grad():
        mha(x[:, :4], kv_cache=cache)
        last = mha(x[:, 4:], kv_cache=cache).output  # not causal: the new queries see all 6 keys
        torch.testing.assert_close(last, mha(x).output[:, 4:], rtol=1e-5, atol=1e-6)
        cache.crop(4)  # drop the last two positions and decode them again, causally
        again = mha(x[:, 4:], is_causal=True, kv_cache=cache).output
        torch.testing.assert_close(again, mha(x, is_causal=True).output[:, 4:], rtol=1e-5, atol=1e-6)
    assert cache.length == 6


def test_kv_cache_errors():
    cache = at.KVCache(1, 1, 2, 4, 3)
    with pytest.raises(ValueError, match=r"expected key \(1, 2, 2, 4\)"):
        cache.update(0, torch.zeros(1, 2, 2, 5), torch.zeros(1, 2, 2, 4))
    cache.update(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="at most 3 positions"):
        cache.update(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    mha = at.MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="self-attention"):
        mha(_x(1, 2, 8), _x(1, 2, 8), kv_cache=mha.new_kv_cache(1, 4))


# ----- dropout -------------------------------------------------------------------------------


def test_dropout_only_in_training_mode():
    block = at.TransformerBlock(16, 2, 32, dropout=0.5, seed=0)
    x = _x(2, 8, 16)
    with torch.no_grad():
        a, b = block(x), block(x)  # torch modules start in training mode (attnkit.nn's in eval)
        assert not torch.equal(a, b)
        block.eval()
        torch.testing.assert_close(block(x), block(x))
        torch.testing.assert_close(block(x), at.TransformerBlock(16, 2, 32, seed=0)(x))


# ----- bad input -----------------------------------------------------------------------------


def test_bad_inputs_name_what_was_expected():
    mha = at.MultiHeadAttention(16, 4)
    x = _x(2, 5, 16)
    cases = [
        (lambda: mha(_x(5, 16)), ValueError, r"\(B, L, d_model=16\).*x\[None\]"),
        (lambda: mha(_x(2, 5, 12)), ValueError, r"d_model=16\), got \(2, 5, 12\)"),
        (lambda: mha(x, _x(3, 5, 16)), ValueError, r"key of shape \(B=2, S, kdim=16\)"),
        (lambda: mha(x, value=x), ValueError, "value without key"),
        (lambda: mha(x, attn_mask=torch.ones(5, 4, dtype=torch.bool)), ValueError, r"\(L, S\) = \(5, 5\)"),
        (lambda: mha(x, attn_mask=torch.ones(8, 5, 5, dtype=torch.bool)), ValueError, r"\(B\*H, L, S\)"),
        (lambda: mha(x, attn_mask=torch.ones(5, 5, dtype=torch.int64)), TypeError, "boolean"),
        (lambda: mha(x, key_mask=torch.ones(2, 5)), TypeError, "key_padding_mask"),
        (lambda: mha(x, key_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, r"\(B, S\) = \(2, 5\)"),
        (lambda: mha(x.numpy()), TypeError, "torch.Tensor"),
        (lambda: at.MultiHeadAttention(16, 3), ValueError, "num_heads to divide d_model"),
        (lambda: at.MultiHeadAttention(16, 4, num_kv_heads=3), ValueError, "num_kv_heads to divide"),
        (lambda: at.FeedForward(8, 16, "swish"), ValueError, "activation"),
        (lambda: at.TransformerBlock(16, 4, 32)(_x(2, 5, 8)), ValueError, r"d_model=16"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_mismatched_state_dicts_name_the_key_and_shapes():
    t_mha = at.MultiHeadAttention(16, 4)
    np_state = ann.MultiHeadAttention(16, 4, num_kv_heads=2, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"state_dict\['k_proj.weight'\]: expected shape \(16, 16\), got \(8, 16\)"):
        t_mha.load_state_dict(np_state)
    with pytest.raises(ValueError, match=r"missing keys \['out_proj.bias'\]"):
        t_mha.load_state_dict({k: v for k, v in ann.MultiHeadAttention(16, 4, seed=0).state_dict().items()
                               if k != "out_proj.bias"})
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]"):
        t_mha.load_state_dict({**ann.MultiHeadAttention(16, 4, seed=0).state_dict(), "extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"k_proj.weight.*\(8, 16\).*\(16, 16\)"):
        ann.MultiHeadAttention(16, 4, num_kv_heads=2, seed=0).load_state_dict(t_mha.state_dict())
    with pytest.raises(TypeError, match="expected one of"):
        at.to_numpy(nn.GRU(4, 4))
    with pytest.raises(TypeError, match="attnkit.nn module"):
        at.from_numpy(nn.Linear(2, 2))
    # nothing was changed by the failed loads
    assert not any(torch.isnan(p).any() for p in t_mha.parameters())


def test_sdpa_used_without_weights_matches_explicit_path():
    """The SDPA path (need_weights=False) and the explicit one agree, GQA included."""
    mha = at.MultiHeadAttention(32, 8, num_kv_heads=2, seed=0)
    x = _x(2, 10, 32)
    with torch.no_grad():
        for kw in ({}, {"is_causal": True}, {"attn_mask": torch.from_numpy(causal_mask(10, align="top_left"))}):
            torch.testing.assert_close(mha(x, **kw).output, mha(x, need_weights=True, **kw).output,
                                       rtol=1e-5, atol=1e-6)
