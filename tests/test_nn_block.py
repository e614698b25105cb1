"""TransformerBlock against torch.nn.TransformerEncoderLayer (after from_torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from attnkit import masks, nn
from conftest import assert_close

TOL = {np.float64: 1e-10, np.float32: 1e-5}
TORCH_DTYPE = {np.float64: torch.float64, np.float32: torch.float32}


def t(a):
    return None if a is None else torch.from_numpy(np.array(a))


def torch_layer(d_model, nhead, d_ff, dtype, seed=0, **kwargs):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        d_model, nhead, d_ff, dtype=TORCH_DTYPE[dtype], **kwargs
    ).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorm parameters
        for name, p in layer.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return layer


def run_torch(layer, x, **kwargs):
    batch_first = layer.self_attn.batch_first
    xt = t(x if batch_first else x.transpose(1, 0, 2))
    # Autograd on keeps torch off its eval fast path (torch._transformer_encoder_layer_fwd),
    # which returns NaN for a float src_mask in torch 2.13; we compare with the reference path.
    out = layer(xt, **kwargs).detach().numpy()
    return out if batch_first else out.transpose(1, 0, 2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_matches_torch_encoder_layer(dtype, norm_first, activation):
    rng = np.random.default_rng(0)
    B, L, D, H, d_ff = 3, 8, 32, 4, 48
    theirs = torch_layer(D, H, d_ff, dtype, activation=activation, norm_first=norm_first, batch_first=True,
                         layer_norm_eps=1e-6)
    ours = nn.TransformerBlock.from_torch(theirs)
    assert ours.dtype == dtype and ours.norm_first == norm_first and ours.ffn.activation == activation
    assert ours.norm1.eps == 1e-6
    x = rng.standard_normal((B, L, D)).astype(dtype)
    tol = 2 * TOL[dtype]

    out = ours(x)
    assert out.dtype == dtype and out.shape == (B, L, D)
    assert_close(out, run_torch(theirs, x), tol, "no mask")

    lengths = np.array([8, 5, 1])
    key_mask = masks.padding_mask(lengths, L)
    out = ours(x, key_mask=key_mask)
    expected = run_torch(theirs, x, src_key_padding_mask=t(~key_mask))
    assert_close(out, expected, tol, "key padding")

    causal = masks.causal_mask(L)
    out = ours(x, is_causal=True)
    expected = run_torch(theirs, x, src_mask=t(~causal), is_causal=True)
    assert_close(out, expected, tol, "causal")

    float_mask = rng.standard_normal((L, L)).astype(dtype)
    out = ours(x, attn_mask=float_mask)
    assert_close(out, run_torch(theirs, x, src_mask=t(float_mask)), tol, "float mask")


@pytest.mark.parametrize("norm_first", [False, True])
def test_batch_first_false_gelu_tanh_no_bias_and_round_trip(norm_first):
    rng = np.random.default_rng(1)
    B, L, D, H, d_ff = 2, 6, 20, 5, 30
    theirs = torch_layer(D, H, d_ff, np.float64, activation=torch.nn.GELU(approximate="tanh"),
                         norm_first=norm_first, batch_first=False, bias=False)
    ours = nn.TransformerBlock.from_torch(theirs)
    assert ours.ffn.activation == "gelu_tanh" and ours.norm1.bias is None and ours.attn.q_proj.bias is None
    x = rng.standard_normal((B, L, D))
    key_mask = masks.padding_mask(np.array([6, 4]), L)
    out = ours(x, key_mask=key_mask)
    expected = run_torch(theirs, x, src_key_padding_mask=t(~key_mask))
    assert_close(out, expected, 1e-10, "batch_first=False")

    back = ours.to_torch()
    assert_close(run_torch(back, x), ours(x), 1e-10, "to_torch round trip")
    again = nn.TransformerBlock.from_torch(back)
    for k, v in ours.state_dict().items():
        assert np.array_equal(again.state_dict()[k], v), k


def test_seeded_block_to_torch_matches_and_weights_output():
    block = nn.TransformerBlock(16, 2, 32, activation="gelu", norm_first=True, seed=0)
    x = np.random.default_rng(2).standard_normal((2, 5, 16)).astype(np.float32)
    assert_close(block(x), run_torch(block.to_torch(), x), 2e-5, "seeded block vs torch")

    result = block(x, is_causal=True, need_weights=True)
    assert isinstance(result, nn.BlockOutput)
    out, weights = result
    assert_close(out, block(x, is_causal=True), 0, "same output with weights")
    assert weights.shape == (2, 5, 5) and weights.dtype == np.float32
    assert np.allclose(weights.sum(-1), 1, atol=1e-6) and not weights[:, 0, 1:].any()
    per_head = block(x, need_weights=True, average_attn_weights=False).attn_weights
    assert per_head.shape == (2, 2, 5, 5)
    # the block's weights are the attention sublayer's on the normed input
    normed = block.norm1(x)
    assert_close(per_head, block.attn(normed, need_weights=True, average_attn_weights=False).weights, 1e-6, "w")


def test_pre_and_post_ln_formulas():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 8))
    for norm_first in (False, True):
        block = nn.TransformerBlock(8, 2, 16, norm_first=norm_first, seed=1).astype(np.float64)
        attn = lambda h: block.attn(h).output  # noqa: E731
        if norm_first:
            h = x + attn(block.norm1(x))
            expected = h + block.ffn(block.norm2(h))
        else:
            h = block.norm1(x + attn(x))
            expected = block.norm2(h + block.ffn(h))
        assert_close(block(x), expected, 1e-12, f"norm_first={norm_first}")


def test_dropout_training_flag():
    x = np.random.default_rng(4).standard_normal((2, 5, 16)).astype(np.float32)
    block = nn.TransformerBlock(16, 2, 32, dropout=0.3, seed=0)
    eval_out = block(x)
    assert np.array_equal(eval_out, block(x))
    block.train().set_rng(7)
    a = block(x)
    block.set_rng(7)
    assert np.array_equal(a, block(x))
    assert not np.allclose(a, eval_out)
    block.eval()
    assert np.array_equal(block(x), eval_out)


def test_bad_input_and_unsupported_torch_layers():
    block = nn.TransformerBlock(16, 4, 32, seed=0)
    with pytest.raises(ValueError, match=r"x of shape \(B, L, d_model=16\), got \(5, 16\)"):
        block(np.zeros((5, 16), np.float32))
    with pytest.raises(TypeError, match="floating-point"):
        block(np.zeros((1, 5, 16), np.int64))
    with pytest.raises(ValueError, match="num_heads to divide d_model"):
        nn.TransformerBlock(16, 3, 32)
    with pytest.raises(ValueError, match="activation"):
        nn.TransformerBlock(16, 4, 32, activation="tanh")
    with pytest.raises(TypeError, match="TransformerEncoderLayer"):
        nn.TransformerBlock.from_torch(torch.nn.Linear(3, 3))
    odd = torch.nn.TransformerEncoderLayer(16, 4, 32, activation=torch.nn.SiLU())
    with pytest.raises(ValueError, match="relu or gelu"):
        nn.TransformerBlock.from_torch(odd)


@given(
    B=st.integers(1, 2),
    L=st.integers(1, 7),
    H=st.sampled_from([1, 2, 4]),
    E=st.sampled_from([2, 5]),
    norm_first=st.booleans(),
    activation=st.sampled_from(["relu", "gelu"]),
)
def test_random_shapes_match_torch(B, L, H, E, norm_first, activation):
    D = H * E
    theirs = torch_layer(D, H, 2 * D + 1, np.float64, activation=activation, norm_first=norm_first,
                         batch_first=True)
    ours = nn.TransformerBlock.from_torch(theirs)
    x = np.random.default_rng(L).standard_normal((B, L, D))
    assert_close(ours(x, is_causal=True), run_torch(theirs, x, src_mask=t(~masks.causal_mask(L)), is_causal=True),
                 1e-10, "random shape")
