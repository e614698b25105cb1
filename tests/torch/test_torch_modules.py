"""attnkit.torch modules: parity with torch.nn, with attnkit.nn (weights moved either
way), the fused QKV buffer, the KV cache, and clear errors."""

from __future__ import annotations

import copy
import importlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import attnkit.nn as ann
from attnkit.functional.masks import causal_mask
from conftest import assert_within_budget, optional
from wide_range import EXPONENTS, assert_like_truth, mha_natural_size, wide

torch = optional("torch")
nn = torch.nn if torch else None
# attnkit.torch needs torch; without it every test here skips (or fails under
# ATTNKIT_REQUIRE_ORACLES=1) through the fixture below, and the file still collects
at = importlib.import_module("attnkit.torch") if torch else None

pytestmark = pytest.mark.usefixtures("torch")  # every test here runs attnkit.torch


def _x(*shape, seed=0, dtype=None):
    dtype = torch.float32 if dtype is None else dtype
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _f64(module):
    """A float64 copy of a module (torch or attnkit.nn): the same weights exactly, so
    it computes the float64 truth of what the float32 module approximates."""
    module = copy.deepcopy(module)
    return module.double() if isinstance(module, torch.nn.Module) else module.astype("float64")


def _arr(x) -> np.ndarray:
    return x.detach().double().numpy() if torch.is_tensor(x) else np.asarray(x, dtype=np.float64)


def _budget(actual, oracle, truth, what: str, factor: float = 2.0):
    """FlashAttention's rule (conftest.assert_within_budget) on tensors or arrays."""
    return assert_within_budget(_arr(actual), _arr(oracle), _arr(truth), what, factor=factor)


def _exact64(actual, truth, what: str):
    """float64 against float64: the same math in another order agrees to ~1e-10."""
    err = np.max(np.abs(_arr(actual) - _arr(truth)))
    assert err <= 1e-10 * max(1.0, np.max(np.abs(_arr(truth)))), f"{what}: float64 differs by {err:.2e}"


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
    """float32 against torch.nn.MultiheadAttention: error against the float64 truth (torch's
    module in float64, same weights) at most twice torch's float32 error."""
    mha = at.MultiHeadAttention(48, 6, bias=bias).eval()
    ref = _torch_mha_like(mha)
    mha64, ref64 = _f64(mha), _f64(ref)
    keep = torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[:, 0] = True
    pattern = torch.rand(11, 11, generator=torch.Generator().manual_seed(2)) > 0.5
    pattern.fill_diagonal_(True)
    causal = torch.from_numpy(causal_mask(11))

    def cases(mha, ref, x):
        return {
            "plain": (mha(x), ref(x, x, x)),
            "causal": (mha(x, is_causal=True, need_weights=True), ref(x, x, x, attn_mask=~causal)),
            "key padding": (mha(x, key_mask=keep, need_weights=True), ref(x, x, x, key_padding_mask=~keep)),
            "mask per head": (mha(x, attn_mask=pattern, need_weights=True, average_attn_weights=False),
                              ref(x, x, x, attn_mask=~pattern, average_attn_weights=False)),
        }

    x = _x(3, 11, 48)
    with torch.no_grad():
        got, truth = cases(mha, ref, x), cases(mha64, ref64, x.double())
    for name, ((out, w), (ref_out, ref_w)) in got.items():
        (out64, w64), (truth_out, truth_w) = truth[name]
        _exact64(out64, truth_out, f"{name}: float64 output")
        _budget(out, ref_out, truth_out, f"{name}: output vs nn.MultiheadAttention float32")
        if w is not None:
            _exact64(w64, truth_w, f"{name}: float64 weights")
            _budget(w, ref_w, truth_w, f"{name}: weights vs nn.MultiheadAttention float32")


def test_cross_attention_matches_torch():
    mha = at.MultiHeadAttention(32, 4).eval()
    ref = _torch_mha_like(mha)
    mha64, ref64 = _f64(mha), _f64(ref)
    q, kv, v = _x(2, 5, 32, seed=1), _x(2, 9, 32, seed=2), _x(2, 9, 32, seed=3)
    with torch.no_grad():
        for what, ours_args, ref_args in (("key = value", (q, kv), (q, kv, kv)),
                                          ("separate value", (q, kv, v), (q, kv, v))):
            truth = ref64(*(t.double() for t in ref_args))[0]
            _exact64(mha64(*(t.double() for t in ours_args)).output, truth, f"{what}: float64")
            _budget(mha(*ours_args).output, ref(*ref_args)[0], truth, f"{what}: vs nn float32")


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
    block64, ref64 = _f64(block), _f64(ref)
    x = _x(2, 13, 32)
    keep = torch.ones(2, 13, dtype=torch.bool)
    keep[1, 9:] = False

    def cases(block, ref, x):
        causal = nn.Transformer.generate_square_subsequent_mask(13, dtype=x.dtype)
        # torch's fast path returns zeros at padded positions; compare the real tokens
        return {
            "plain": (block(x), ref(x)),
            "causal": (block(x, is_causal=True), ref(x, src_mask=causal, is_causal=True)),
            "key padding": (block(x, key_mask=keep)[keep], ref(x, src_key_padding_mask=~keep)[keep]),
        }

    with torch.no_grad():
        got, truth = cases(block, ref, x), cases(block64, ref64, x.double())
    for name, (ours, theirs) in got.items():
        ours64, truth_out = truth[name]
        _exact64(ours64, truth_out, f"{name}: float64")
        _budget(ours, theirs, truth_out, f"{name}: vs nn.TransformerEncoderLayer float32")


def test_round_trip_through_torch_nn_modules():
    ref = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    mha = at.from_numpy(at.from_torch(ref)).eval()
    back = at.to_torch(mha)
    for key, value in ref.state_dict().items():  # the weights travel both ways bitwise
        assert torch.equal(back.state_dict()[key], value), key
    x = _x(2, 6, 32)
    with torch.no_grad():
        truth = _f64(ref)(*(x.double(),) * 3)[0]
        _budget(mha(x).output, ref(x, x, x)[0], truth, "from_torch(MultiheadAttention) vs nn float32")
        _budget(back(x, x, x)[0], ref(x, x, x)[0], truth, "to_torch() vs nn float32")
    layer = nn.TransformerEncoderLayer(32, 4, 48, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True).eval()
    block = at.from_numpy(at.from_torch(layer)).eval()
    back = at.to_torch(block)
    for key, value in layer.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    with torch.no_grad():
        truth = _f64(layer)(x.double())
        _budget(block(x), layer(x), truth, "from_torch(TransformerEncoderLayer) vs nn float32")
        _budget(back(x), layer(x), truth, "to_torch() vs nn float32")
    with pytest.raises(ValueError, match="grouped-query"):
        at.to_torch(at.MultiHeadAttention(32, 4, num_kv_heads=2))


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
    for key, value in np_module.state_dict().items():  # the weights travel bitwise
        np.testing.assert_array_equal(torch_module.state_dict()[key].numpy(), value, err_msg=key)
    kwargs = {"is_causal": True} if name.startswith(("mha", "block")) else {}
    expected = _numpy_call(np_module, x, **kwargs)
    with torch.no_grad():
        got = _numpy_call(torch_module, torch.from_numpy(x), **kwargs).numpy()
    # back to NumPy: a fresh module, and load_state_dict into an existing one from tensors
    back = at.to_numpy(torch_module)
    other = make().astype(dtype)
    other.load_state_dict(torch_module.state_dict())
    results = {"torch": got, "to_numpy": _numpy_call(back, x, **kwargs),
               "load_state_dict": _numpy_call(other, x, **kwargs)}
    if dtype == "float64":
        for what, result in results.items():
            _exact64(result, expected, what)
        return
    # float32: no outside oracle here (attnkit.nn and attnkit.torch are both attnkit); the
    # truth is the NumPy module in float64 and the oracle side the NumPy float32 result
    truth = _numpy_call(_f64(np_module), x.astype(np.float64), **kwargs)
    for what, result in results.items():
        _budget(result, expected, truth, f"{name} {what} vs attnkit.nn float32")


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
    # no outside oracle for GQA: the truth is the moved module in float64, the oracle torch's float32
    truth = _f64(np_mha)(x.double().numpy(), key_mask=keep).output
    _budget(got, expected, truth, "attnkit.nn after to_numpy vs attnkit.torch float32")


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
    np_mha64 = _f64(np_mha)
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
        assert np.isfinite(got.output.numpy()).all()
        # the truth: the NumPy module in float64 on the same inputs (the float mask cast exactly)
        truth = np_mha64(x.astype(np.float64), **{k: v.astype(np.float64) if k == "attn_mask" and v.dtype != bool
                                                     else v for k, v in kw.items()})
        what = ", ".join(kw)
        _budget(got.output, expected.output, truth.output, f"{what}: output vs attnkit.nn float32")
        if kw.get("need_weights"):
            _budget(got.weights, expected.weights, truth.weights, f"{what}: weights vs attnkit.nn float32")


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
        truth = _f64(mha)(x.double()).output
    _budget(fused, unfused, truth, "fused QKV vs separate projections, float32")
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
        truth = _f64(block)(x.double(), is_causal=True)
    assert cache.length == 9
    _budget(torch.cat(steps, dim=1), full, truth, "cached decoding vs full causal float32")


def test_kv_cache_with_left_padding():
    mha = at.MultiHeadAttention(16, 2, seed=3).eval()
    x = _x(2, 6, 16)
    real = torch.tensor([[True] * 6, [False, False] + [True] * 4])  # sequence 1 is left-padded
    cache = at.KVCache(1, 2, 2, 8, 10)
    cache.add_padding(real)
    with torch.no_grad():
        full = mha(x, is_causal=True, key_mask=real).output
        cached = mha(x, is_causal=True, kv_cache=cache).output
        truth = _f64(mha)(x.double(), is_causal=True, key_mask=real).output
    _budget(cached[real], full[real], truth[real], "left-padded cache vs key_mask float32")


def test_kv_cache_without_causal_and_crop():
    mha = at.MultiHeadAttention(16, 4, seed=4).eval()
    x = _x(1, 6, 16)
    mha64 = _f64(mha)
    cache = mha.new_kv_cache(1, 8)
    with torch.no_grad():
        mha(x[:, :4], kv_cache=cache)
        last = mha(x[:, 4:], kv_cache=cache).output  # not causal: the new queries see all 6 keys
        _budget(last, mha(x).output[:, 4:], mha64(x.double()).output[:, 4:], "not causal, cached vs full float32")
        cache.crop(4)  # drop the last two positions and decode them again, causally
        again = mha(x[:, 4:], is_causal=True, kv_cache=cache).output
        _budget(again, mha(x, is_causal=True).output[:, 4:], mha64(x.double(), is_causal=True).output[:, 4:],
                "after crop, cached vs full causal float32")
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
        # in eval mode dropout is the identity: the same operations on the same weights, so bitwise equal
        assert torch.equal(block(x), block(x))
        assert torch.equal(block(x), at.TransformerBlock(16, 2, 32, seed=0)(x))


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
    mha64 = _f64(mha)
    x = _x(2, 10, 32)
    with torch.no_grad():
        for kw in ({}, {"is_causal": True}, {"attn_mask": torch.from_numpy(causal_mask(10, align="top_left"))}):
            # the SDPA path runs torch's F.scaled_dot_product_attention: the oracle side
            truth = mha64(x.double(), **kw).output
            _exact64(mha64(x.double(), need_weights=True, **kw).output, truth, f"{list(kw)}: float64")
            _budget(mha(x, need_weights=True, **kw).output, mha(x, **kw).output, truth,
                    f"{list(kw)}: explicit path vs the SDPA path float32")


# ----- any finite magnitude --------------------------------------------------------------------


def _weights(mha) -> dict:
    """q, k, v, o weights and biases of an attnkit.torch.MultiHeadAttention, as arrays."""
    arrays = {}
    for name, proj in zip("qkvo", (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj)):
        arrays[f"{name}_w"] = _arr(proj.weight)
        arrays[f"{name}_b"] = None if proj.bias is None else _arr(proj.bias)
    return arrays


@settings(max_examples=30)
@given(B=st.integers(1, 2), L=st.integers(1, 6), H=st.sampled_from([1, 2]), E=st.sampled_from([1, 4, 16]),
       causal=st.booleans(), exponent=EXPONENTS, seed=st.integers(0, 2**16))
def test_any_finite_magnitude_gives_torch_float64_answer(B, L, H, E, causal, exponent, seed):
    """Finite in, finite out (tests/wide_range.py): float32 activations from 1e-30 to
    1e30 give torch.nn.MultiheadAttention's float64 answer on the same weights, never
    NaN (F.scaled_dot_product_attention's fused CPU kernel alone gives NaN from about
    4e18: the module scales the queries first and runs scores beyond float32 in float64)."""
    torch.manual_seed(seed)
    mha = at.MultiHeadAttention(H * E, H).eval()
    with torch.no_grad():
        for p in (mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias, mha.out_proj.bias):
            p.normal_()  # non-zero biases, so that small inputs still give scores
    ref = _torch_mha_like(mha)
    x = torch.from_numpy(wide(np.random.default_rng(seed), (B, L, H * E), exponent))
    mask = causal_mask(L) if causal else None
    tmask = None if mask is None else torch.from_numpy(~mask)  # torch's polarity: True = masked
    with torch.no_grad():
        out = mha(x, is_causal=causal).output
        oracle = ref(x, x, x, attn_mask=tmask, need_weights=False)[0]
        x64 = x.double()
        truth = _f64(ref)(x64, x64, x64, attn_mask=tmask, need_weights=False)[0]
    assert out.dtype == torch.float32
    natural = mha_natural_size(_arr(x), _arr(x), _arr(x), _weights(mha), H, mask)
    assert_like_truth(_arr(out), _arr(oracle), _arr(truth), natural, "output")


@pytest.mark.parametrize("magnitude", [4e18, 1e20, 1e30])
def test_huge_activations_give_the_float64_answer_and_gradients(magnitude):
    """The issue's magnitudes through the module, forward and backward (autograd
    through the float64 fallback), against the module run in float64 on torch's
    math backend (whose softmax backward, from the weights, gives the exact zeros
    of one-hot rows; a fused kernel's exp(s - lse) would leave float64 noise of
    |s| * 1e-16 there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mha = at.MultiHeadAttention(16, 2, seed=0).eval()
    x = (_x(2, 5, 16, seed=3) * magnitude).requires_grad_()
    out = mha(x, is_causal=True).output
    x64 = x.detach().double().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        truth = _f64(mha)(x64, is_causal=True).output
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), truth, rtol=1e-5, atol=1e-6 * truth.abs().max().item())
    d_out = _x(2, 5, 16, seed=4)
    (grad,) = torch.autograd.grad(out, x, d_out)
    (grad64,) = torch.autograd.grad(truth, x64, d_out.double())
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-4, atol=1e-5 * grad64.abs().max().item())
