"""TransformerBlock against torch.nn.TransformerEncoderLayer (after interop.from_torch),
its own formulas, and its training/eval and state_dict behaviour.

float64 results meet torch in float64 to ~1e-10. float32 results meet
conftest.assert_within_budget's budget: the float64 truth is the same torch
layer cast to float64 (float32 weights and inputs are exact in float64), and
torch's own float32 error against it sets the bound."""

from __future__ import annotations

import copy
import importlib

import numpy as np
import pytest
from hypothesis import given, strategies as st

from attnkit import masks, nn
from conftest import F32_EPS, assert_close, assert_within_budget, optional

torch = optional("torch")
# torch interop lives on the torch side (attnkit.nn never imports torch)
interop = importlib.import_module("attnkit.torch.interop") if torch else None
F = torch.nn.functional if torch else None


def tdtype(dtype):
    return getattr(torch, np.dtype(dtype).name)


def t(a):
    return None if a is None else torch.from_numpy(np.array(a))


def torch_layer(d_model, nhead, d_ff, dtype, seed=0, **kwargs):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        d_model, nhead, d_ff, dtype=tdtype(dtype), **kwargs
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


def run_torch64(layer, x, **kwargs):
    """The float64 truth: `layer`, the input and float masks cast to float64."""
    kwargs = {n: (a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a)
              for n, a in kwargs.items()}
    return run_torch(copy.deepcopy(layer).double(), x.astype(np.float64), **kwargs)


def check(ours, layer, x, dtype, what, **kwargs):
    """float64: torch (in float64) within 1e-10; float32: the budget torch's float32 error sets."""
    theirs = run_torch(layer, x, **kwargs)
    if dtype == np.float64:
        assert_close(ours, theirs, 1e-10, what)
    else:
        assert_within_budget(ours, theirs, run_torch64(layer, x, **kwargs), what)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_matches_torch_encoder_layer(torch, dtype, norm_first, activation):
    rng = np.random.default_rng(0)
    B, L, D, H, d_ff = 3, 8, 32, 4, 48
    theirs = torch_layer(D, H, d_ff, dtype, activation=activation, norm_first=norm_first, batch_first=True,
                         layer_norm_eps=1e-6)
    ours = interop.from_torch(theirs)
    assert ours.dtype == dtype and ours.norm_first == norm_first and ours.ffn.activation == activation
    assert ours.norm1.eps == 1e-6
    x = rng.standard_normal((B, L, D)).astype(dtype)

    out = ours(x)
    assert out.dtype == dtype and out.shape == (B, L, D)
    check(out, theirs, x, dtype, "no mask")

    lengths = np.array([8, 5, 1])
    key_mask = masks.padding_mask(lengths, L)
    check(ours(x, key_mask=key_mask), theirs, x, dtype, "key padding", src_key_padding_mask=t(~key_mask))

    causal = masks.causal_mask(L)
    check(ours(x, is_causal=True), theirs, x, dtype, "causal", src_mask=t(~causal), is_causal=True)

    float_mask = rng.standard_normal((L, L)).astype(dtype)
    check(ours(x, attn_mask=float_mask), theirs, x, dtype, "float mask", src_mask=t(float_mask))


@pytest.mark.parametrize("norm_first", [False, True])
def test_batch_first_false_gelu_tanh_no_bias_and_round_trip(torch, norm_first):
    rng = np.random.default_rng(1)
    B, L, D, H, d_ff = 2, 6, 20, 5, 30
    theirs = torch_layer(D, H, d_ff, np.float64, activation=torch.nn.GELU(approximate="tanh"),
                         norm_first=norm_first, batch_first=False, bias=False)
    ours = interop.from_torch(theirs)
    assert ours.ffn.activation == "gelu_tanh" and ours.norm1.bias is None and ours.attn.q_proj.bias is None
    x = rng.standard_normal((B, L, D))
    key_mask = masks.padding_mask(np.array([6, 4]), L)
    out = ours(x, key_mask=key_mask)
    expected = run_torch(theirs, x, src_key_padding_mask=t(~key_mask))
    assert_close(out, expected, 1e-10, "batch_first=False")

    back = interop.to_torch(ours)
    assert_close(run_torch(back, x), ours(x), 1e-10, "to_torch round trip")
    again = interop.from_torch(back)
    for k, v in ours.state_dict().items():
        assert np.array_equal(again.state_dict()[k], v), k


def test_seeded_block_to_torch_matches_and_weights_output(torch):
    block = nn.TransformerBlock(16, 2, 32, activation="gelu", norm_first=True, seed=0)
    x = np.random.default_rng(2).standard_normal((2, 5, 16)).astype(np.float32)
    check(block(x), interop.to_torch(block), x, np.float32, "seeded block vs torch")
    # through torch and back: the same parameters, bit for bit, and so the same outputs
    back = interop.from_torch(interop.to_torch(block))
    for k, v in block.state_dict().items():
        assert np.array_equal(back.state_dict()[k], v), k
    np.testing.assert_array_equal(back(x), block(x))

    result = block(x, is_causal=True, need_weights=True)
    assert isinstance(result, nn.BlockOutput)
    out, weights = result
    assert_close(out, block(x, is_causal=True), 0, "same output with weights")
    assert weights.shape == (2, 5, 5) and weights.dtype == np.float32
    # each row sums to 1 up to one float32 rounding per term and per partial sum (5 keys)
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=0, atol=2 * 5 * F32_EPS)
    assert not weights[:, 0, 1:].any()
    per_head = block(x, need_weights=True, average_attn_weights=False).attn_weights
    assert per_head.shape == (2, 2, 5, 5)
    # the block's weights are the attention sublayer's on the normed input: the same computation
    normed = block.norm1(x)
    np.testing.assert_array_equal(per_head, block.attn(normed, need_weights=True, average_attn_weights=False).weights)


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


def test_dropout_training_flag_seeding_and_state_dict_round_trip():
    x = np.random.default_rng(4).standard_normal((2, 5, 16)).astype(np.float32)
    block = nn.TransformerBlock(16, 2, 32, dropout=0.3, seed=0)
    eval_out = block(x)
    assert np.array_equal(eval_out, block(x))  # eval by default: deterministic
    block.train().set_rng(7)
    assert block.training and block.attn.training and block.ffn.training
    a = block(x)
    assert not np.array_equal(a, block(x))  # each call draws new masks
    block.set_rng(7)
    assert np.array_equal(a, block(x))
    assert not np.allclose(a, eval_out)
    block.eval()
    assert np.array_equal(block(x), eval_out)
    # the constructor's seed also seeds dropout: two fresh blocks draw the same masks
    np.testing.assert_array_equal(nn.TransformerBlock(16, 2, 32, dropout=0.3, seed=0).train()(x),
                                  nn.TransformerBlock(16, 2, 32, dropout=0.3, seed=0).train()(x))
    # back in eval, a block that trained equals an untouched twin
    np.testing.assert_array_equal(block(x), nn.TransformerBlock(16, 2, 32, dropout=0.3, seed=0)(x))
    # load_state_dict gives another seed's block the same outputs; bad state dicts are refused
    other = nn.TransformerBlock(16, 2, 32, seed=99)
    state = block.state_dict()
    other.load_state_dict(state)
    np.testing.assert_array_equal(other(x), block(x))
    with pytest.raises(ValueError, match="missing keys"):
        other.load_state_dict({k: v for k, v in state.items() if k != "norm2.bias"})
    with pytest.raises(ValueError, match=r"expected shape \(16,\)"):
        other.load_state_dict({**state, "norm2.bias": np.zeros(15)})


def test_bad_input():
    block = nn.TransformerBlock(16, 4, 32, seed=0)
    with pytest.raises(ValueError, match=r"x of shape \(B, L, d_model=16\), got \(5, 16\)"):
        block(np.zeros((5, 16), np.float32))
    with pytest.raises(ValueError, match=r"x of shape \(B, L, d_model=16\), got \(2, 5, 15\)"):
        block(np.zeros((2, 5, 15)))
    with pytest.raises(TypeError, match="floating-point"):
        block(np.zeros((1, 5, 16), np.int64))
    with pytest.raises(ValueError, match="num_heads to divide d_model"):
        nn.TransformerBlock(16, 3, 32)
    for activation in ("tanh", "silu"):
        with pytest.raises(ValueError, match=f"activation.*'{activation}'"):
            nn.TransformerBlock(16, 4, 32, activation=activation)


def test_unsupported_torch_layers(torch):
    with pytest.raises(TypeError, match="TransformerEncoderLayer, got Linear"):
        interop.from_torch(torch.nn.Linear(3, 3))
    for activation in (torch.nn.SiLU(), F.silu):  # a module and a function
        odd = torch.nn.TransformerEncoderLayer(16, 4, 32, activation=activation)
        with pytest.raises(ValueError, match="(?i)relu or gelu.*silu"):
            interop.from_torch(odd)


@given(
    B=st.integers(1, 2),
    L=st.integers(1, 7),
    H=st.sampled_from([1, 2, 4]),
    E=st.sampled_from([2, 5]),
    norm_first=st.booleans(),
    activation=st.sampled_from(["relu", "gelu"]),
)
def test_random_shapes_match_torch(torch, B, L, H, E, norm_first, activation):
    D = H * E
    theirs = torch_layer(D, H, 2 * D + 1, np.float64, activation=activation, norm_first=norm_first,
                         batch_first=True)
    ours = interop.from_torch(theirs)
    x = np.random.default_rng(L).standard_normal((B, L, D))
    assert_close(ours(x, is_causal=True), run_torch(theirs, x, src_mask=t(~masks.causal_mask(L)), is_causal=True),
                 1e-10, "random shape")


# names, resolved inside the test (torch may be missing at import): torch's
# activation -> attnkit's name for it
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "F.relu": "relu", "F.gelu": "gelu", "GELU_tanh": "gelu_tanh"}


def _torch_activation(name):
    return {"relu": "relu", "gelu": "gelu", "F.relu": F.relu, "F.gelu": F.gelu,
            "GELU_tanh": torch.nn.GELU(approximate="tanh")}[name]


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("bias,batch_first", [(True, True), (False, False)])
def test_transformer_block_from_torch_every_activation_and_mask(torch, act, norm_first, bias, batch_first):
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 24, dropout=0.2, activation=_torch_activation(act),
                                             layer_norm_eps=1e-3, batch_first=batch_first, norm_first=norm_first,
                                             bias=bias, dtype=torch.float64).eval()
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    block = interop.from_torch(layer)
    assert block.ffn.activation == ACTIVATIONS[act] and block.norm1.eps == 1e-3 and block.norm_first == norm_first
    assert block.dropout == 0.2 and not block.training
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 16))
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 3:] = True
    sm = torch.from_numpy(rng.random((5, 5)) < 0.3)
    sm.fill_diagonal_(False)

    def tin(a):
        return t(a) if batch_first else t(a).transpose(0, 1)

    def tout(a):
        return (a if batch_first else a.transpose(0, 1)).detach().numpy()

    for src_mask, pad in [(None, None), (sm, None), (None, kpm), (sm, kpm)]:
        to = tout(layer(tin(x), src_mask=src_mask, src_key_padding_mask=pad))
        o = block(x, attn_mask=None if src_mask is None else masks.from_torch_mask(src_mask),
                  key_mask=None if pad is None else masks.from_torch_mask(pad))
        np.testing.assert_allclose(o, to, rtol=1e-11, atol=1e-12)
    cm = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    to = tout(layer(tin(x), src_mask=cm, is_causal=True))
    np.testing.assert_allclose(block(x, is_causal=True), to, rtol=1e-11, atol=1e-12)
