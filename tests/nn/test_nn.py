"""attnkit.nn building blocks: the Module base, Linear, LayerNorm, activations,
FeedForward, positional encoding; checked against torch and float64 math.

float64 results meet the float64 truth to ~1e-10; float32 and float16 results
meet conftest.assert_within_budget's budget, set by torch's own error in the
same dtype against the float64 truth on the same weights and inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, strategies as st

from attnkit import nn
from conftest import F32_EPS, assert_close, assert_within_budget, optional

torch = optional("torch")
F = torch.nn.functional if torch else None

# float16 results are stored in float16: half a float16 ulp is lost there alone, so
# the budget's epsilon is 2 float16 ulps at max|truth| (in assert_within_budget's float32 ulps)
F16_ULPS = 2 * float(np.finfo(np.float16).eps) / F32_EPS


def t(a):
    return torch.from_numpy(np.array(a))


# ----------------------------------------------------------------- Module base


def test_state_dict_keys_shapes_and_torch_layout():
    mha = nn.MultiHeadAttention(12, 3, num_kv_heads=1, kdim=5, vdim=7, seed=0)
    shapes = {k: v.shape for k, v in mha.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (12, 12), "q_proj.bias": (12,),
        "k_proj.weight": (4, 5), "k_proj.bias": (4,),
        "v_proj.weight": (4, 7), "v_proj.bias": (4,),
        "out_proj.weight": (12, 12), "out_proj.bias": (12,),
    }
    assert all(v.dtype == np.float32 for v in mha.state_dict().values())
    assert mha.num_parameters() == sum(int(np.prod(s)) for s in shapes.values())
    assert [k for k, _ in mha.named_parameters()] == list(shapes)


def test_linear_is_x_times_weight_transposed_plus_bias(torch):
    lin = nn.Linear(5, 3, seed=1).astype(np.float64)
    x = np.random.default_rng(0).standard_normal((2, 4, 5))
    expected = np.einsum("bli,oi->blo", x, lin.weight) + lin.bias
    assert_close(lin(x), expected, 1e-12)
    torch_out = F.linear(t(x), t(lin.weight), t(lin.bias)).numpy()
    assert_close(lin(x), torch_out, 1e-12)


def test_seeded_init_is_reproducible_and_torch_like():
    a = nn.TransformerBlock(32, 4, 64, seed=7).state_dict()
    b = nn.TransformerBlock(32, 4, 64, seed=7).state_dict()
    c = nn.TransformerBlock(32, 4, 64, seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["attn.q_proj.weight"], c["attn.q_proj.weight"])
    # A Generator is accepted and consumed.
    g1, g2 = np.random.default_rng(3), np.random.default_rng(3)
    assert np.array_equal(nn.Linear(4, 4, seed=g1).weight, nn.Linear(4, 4, seed=g2).weight)
    # torch-like scales: weight in +-1/sqrt(fan_in), bias zero, LayerNorm ones/zeros.
    lin = nn.Linear(400, 300, seed=0)
    bound = 1 / math.sqrt(400)
    assert np.abs(lin.weight).max() <= bound
    assert np.abs(lin.weight).max() > 0.95 * bound
    # the sample std of 120000 uniform draws is off by sqrt(0.8 / n) / 2 * bound / sqrt(3) = 0.0007 * bound
    # (standard deviation); 0.01 * bound is 13 of them
    assert abs(lin.weight.std() - bound / math.sqrt(3)) < 0.01 * bound
    assert not lin.bias.any()
    assert (a["norm1.weight"] == 1).all() and not a["norm1.bias"].any()
    # float64 module from the same seed: same draws, unrounded.
    lin64 = nn.Linear(400, 300, seed=0).astype(np.float64)
    assert np.array_equal(lin64.weight.astype(np.float32), lin.weight)


def test_load_state_dict_round_trip_and_copy():
    src = nn.TransformerBlock(16, 2, 32, seed=1)
    dst = nn.TransformerBlock(16, 2, 32, seed=2)
    state = {k: np.array(v, dtype=np.float64) for k, v in src.state_dict().items()}
    result = dst.load_state_dict(state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in src.state_dict().items():
        assert np.array_equal(dst.state_dict()[k], v)
        assert dst.state_dict()[k].dtype == np.float32  # cast to the module's dtype
    state["norm1.weight"][:] = 5  # the module holds its own copy
    assert (dst.norm1.weight == 1).all()


def test_load_state_dict_errors_name_key_and_shapes():
    mha = nn.MultiHeadAttention(8, 2, seed=0)
    good = dict(mha.state_dict())
    bad = dict(good, **{"k_proj.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(8, 8\).*\(8, 4\)"):
        mha.load_state_dict(bad)
    missing = {k: v for k, v in good.items() if k != "out_proj.bias"}
    with pytest.raises(ValueError, match=r"missing keys \['out_proj.bias'\]"):
        mha.load_state_dict(missing)
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]"):
        mha.load_state_dict(dict(good, extra=np.zeros(3)))
    with pytest.raises(TypeError, match=r"q_proj\.weight.*floating"):
        mha.load_state_dict(dict(good, **{"q_proj.weight": np.zeros((8, 8), np.int64)}))
    # strict=False reports, still checks shapes, and loads what matches.
    partial = {"q_proj.weight": np.ones((8, 8)), "extra": np.zeros(1)}
    result = mha.load_state_dict(partial, strict=False)
    assert result.unexpected_keys == ["extra"] and "out_proj.weight" in result.missing_keys
    assert (mha.q_proj.weight == 1).all()
    # A failed load changes nothing.
    before = mha.state_dict()["v_proj.weight"].copy()
    with pytest.raises(ValueError):
        mha.load_state_dict(dict(good, **{"v_proj.weight": np.zeros(8), "q_proj.weight": np.zeros((8, 8))}))
    assert np.array_equal(mha.v_proj.weight, before) and (mha.q_proj.weight == 1).all()


def test_parameters_are_read_only_and_assignment_checks_shape():
    lin = nn.Linear(3, 2, seed=0)
    with pytest.raises(ValueError, match="read-only"):
        lin.weight[0, 0] = 1.0
    with pytest.raises(ValueError, match=r"expected parameter 'weight' of shape \(2, 3\), got \(3, 2\)"):
        lin.weight = np.zeros((3, 2))
    lin.weight = np.ones((2, 3))
    assert lin.weight.dtype == np.float32 and (lin.weight == 1).all()
    user = np.zeros((2, 3), np.float32)
    lin.weight = user
    user[0, 0] = 9  # assignment copies nothing, but the module never writes to it
    assert user.flags.writeable


def test_copy_and_pickle_keep_read_only_parameters():
    import copy
    import pickle

    block = nn.TransformerBlock(8, 2, 16, seed=0)
    x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)
    for clone in (copy.deepcopy(block), pickle.loads(pickle.dumps(block))):
        assert np.array_equal(clone(x), block(x))
        assert not clone.attn.q_proj.weight.flags.writeable
        clone.attn.v_proj.weight = np.zeros((8, 8))  # independent of the original
        assert not np.array_equal(clone(x), block(x))


def test_structure_version_moves_with_every_change_through_the_module_api():
    """`structure_version()` (what the compiled decode step's frame is checked against)
    moves on every way the Module API changes a module, and stays put while modules only
    run."""
    import copy
    import pickle

    from attnkit.nn.module import structure_version

    block = nn.TransformerBlock(8, 2, 16, seed=0)
    x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)

    def moves(change) -> bool:
        before = structure_version()
        change()
        return structure_version() != before

    assert not moves(lambda: block(x))
    assert not moves(lambda: block.state_dict())
    weight = block.attn.q_proj.weight
    changes = {
        "parameter assigned": lambda: setattr(block.attn.q_proj, "weight", weight * 2),
        "parameter written in _parameters": lambda: block.attn.q_proj._parameters.__setitem__("weight", weight),
        "_parameters updated": lambda: block.attn.q_proj._parameters.update(weight=weight),
        "child module replaced": lambda: setattr(block, "ffn", copy.deepcopy(block.ffn)),
        "child written in _modules": lambda: block._modules.__setitem__("ffn", copy.deepcopy(block.ffn)),
        "child popped from _modules": lambda: block.attn._modules.pop("q_proj"),
        "plain attribute set": lambda: setattr(block.attn, "note", 1),
        "plain attribute deleted": lambda: delattr(block.attn, "note"),
        "backend set": lambda: block.set_attention_backend("naive"),
        "load_state_dict": lambda: block.load_state_dict(block.state_dict(), strict=False),
        "astype": lambda: block.astype(np.float64),
        "unpickled": lambda: pickle.loads(pickle.dumps(block)),
        "register_parameter": lambda: block.register_parameter("extra", None),
    }
    for name, change in changes.items():
        assert moves(change), name
    clone = pickle.loads(pickle.dumps(nn.Linear(2, 2, seed=0)))
    assert moves(lambda: clone._parameters.__setitem__("weight", np.ones((2, 2), np.float32)))


def test_astype_dtype_and_modes():
    block = nn.TransformerBlock(8, 2, 16, dropout=0.1, seed=0)
    assert block.dtype == np.float32 and not block.training and not block.attn.training
    block.astype(np.float64)
    assert block.dtype == np.float64 and all(p.dtype == np.float64 for p in block.parameters())
    block.train()
    assert block.training and block.ffn.training and block.attn.q_proj.training
    block.eval()
    assert not block.ffn.training
    with pytest.raises(TypeError, match="float32 or float64"):
        block.astype(np.int32)
    with pytest.raises(TypeError, match="seed.*got str"):
        nn.Linear(2, 2, seed="x")


def test_module_list_naming():
    heads = nn.PerHeadMultiHeadAttention(8, 2, seed=0)
    keys = list(heads.state_dict())
    assert keys[:2] == ["heads.0.q_proj.weight", "heads.0.q_proj.bias"]
    assert "heads.1.v_proj.bias" in keys and keys[-1] == "out_proj.bias"
    assert len(heads.heads) == 2 and heads.heads[-1] is heads.heads[1]


# ------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("eps", [1e-5, 1e-12, 0.5])
def test_layer_norm_matches_torch(torch, dtype, eps):
    rng = np.random.default_rng(0)
    d = 37
    ln = nn.LayerNorm(d, eps=eps).astype(dtype)
    ln.weight = rng.standard_normal(d)
    ln.bias = rng.standard_normal(d)
    x = (rng.standard_normal((3, 5, d)) * 4 + 3).astype(dtype)
    out = ln(x)
    assert out.dtype == dtype
    # torch's formula: biased variance, eps inside the square root, on the same rounded numbers.
    x64, w64, b64 = (a.astype(np.float64) for a in (x, ln.weight, ln.bias))
    plain = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + eps) * w64 + b64
    truth = F.layer_norm(t(x64), (d,), t(w64), t(b64), eps).numpy()
    assert_close(plain, truth, 1e-12, "the formula is torch's")
    if dtype == np.float64:
        assert_close(out, truth, 1e-12, "layer_norm")
    else:
        oracle = F.layer_norm(t(x), (d,), t(ln.weight), t(ln.bias), eps).numpy()
        assert_within_budget(out, oracle, truth, "float32 layer_norm")


def test_layer_norm_float16_computes_in_float32(torch):
    x = (np.random.default_rng(1).standard_normal((4, 64)) * 30).astype(np.float16)
    ln = nn.LayerNorm(64)
    out = ln(x)
    assert out.dtype == np.float16
    truth = F.layer_norm(t(x).double(), (64,)).numpy()
    oracle = F.layer_norm(t(x), (64,)).float().numpy()  # torch in float16
    assert_within_budget(out, oracle, truth, "float16 layer_norm", ulps=F16_ULPS)


def test_layer_norm_constant_row_is_finite_and_no_bias():
    ln = nn.LayerNorm(4, bias=False)
    assert "bias" not in ln.state_dict()
    out = ln(np.full((2, 4), 3.0, np.float32))
    assert np.isfinite(out).all() and not out.any()


# -------------------------------------------------------- activations, FFN


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_activations_match_torch(torch, dtype):
    x = np.linspace(-8, 8, 1001).astype(dtype)
    x64 = x.astype(np.float64)
    for name, ours, theirs in [("relu", nn.relu, F.relu), ("gelu", nn.gelu, F.gelu),
                               ("gelu_tanh", nn.gelu_tanh, lambda z: F.gelu(z, approximate="tanh"))]:
        out = ours(x)
        assert out.dtype == dtype
        truth = theirs(t(x64)).numpy()
        if dtype == np.float64:
            assert_close(out, truth, 1e-12, name)
        else:
            assert_within_budget(out, theirs(t(x)).numpy(), truth, f"float32 {name}")
    # exact and tanh GELU do differ (so the test above can tell them apart).
    assert np.max(np.abs(nn.gelu(x.astype(np.float64)) - nn.gelu_tanh(x.astype(np.float64)))) > 1e-4


def _erf(x: np.ndarray) -> np.ndarray:
    """float64 erf, element by element (the C library's, through math.erf)."""
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def test_gelu_float32_error_is_within_twice_torchs(torch):
    x = np.linspace(-10, 10, 200_001, dtype=np.float32)  # > one internal chunk, odd size
    x64 = x.astype(np.float64)
    exact = 0.5 * x64 * (1 + _erf(x64 / math.sqrt(2)))
    assert_within_budget(nn.gelu(x), F.gelu(t(x)).numpy(), exact, "float32 GELU")
    # float64 is exact: a few float64 ulps of the largest value (10)
    assert np.abs(nn.gelu(x64) - exact).max() <= 1e-14
    # far tails are exact: 0 on the left, x on the right, never a huge residue
    tails = np.array([-1e30, -1e4, -20.0, 20.0, 1e4, 1e30], np.float32)
    assert np.array_equal(nn.gelu(tails), np.array([0, 0, 0, 20, 1e4, 1e30], np.float32))
    # shape, strides and float16 are handled
    strided = np.linspace(-3, 3, 60, dtype=np.float32).reshape(3, 20)[:, ::2]
    s64 = strided.astype(np.float64)
    assert_within_budget(nn.gelu(strided), F.gelu(t(strided)).numpy(), 0.5 * s64 * (1 + _erf(s64 / math.sqrt(2))),
                         "strided float32 GELU")
    assert nn.gelu(strided.astype(np.float16)).dtype == np.float16


def test_gelu_float64_is_exact_to_rounding():
    """float64 GELU against a 40-digit GELU (mpmath): within 2 ulps of max(|x|, 1) (the
    rounding of 1 + erf bounds it: where erf is near -1 that sum cancels, in torch too), and
    NaN, the infinities and the far tails as torch gives them."""
    from conftest import require

    mpmath = require("mpmath")
    mpmath.mp.dps = 40
    rng = np.random.default_rng(7)
    x = np.concatenate([np.linspace(-12, 12, 4001), rng.standard_normal(3000) * 4, [0.0, -0.0, 1e-300, -1e-300]])
    truth = np.array([float(mpmath.mpf(v) / 2 * (1 + mpmath.erf(mpmath.mpf(v) / mpmath.sqrt(2)))) for v in x])
    err = np.abs(nn.gelu(x) - truth) / np.maximum(np.abs(x), 1.0)
    print(f"float64 GELU: max error {err.max():.2e} of max(|x|, 1) (eps {np.finfo(np.float64).eps:.2e})")
    assert err.max() <= 2 * np.finfo(np.float64).eps
    with np.errstate(invalid="ignore"):  # -inf * 0
        special = nn.gelu(np.array([np.nan, np.inf, -np.inf, 1e300, -1e300, 40.0, -40.0]))
    assert np.isnan(special[0]) and special[1] == np.inf and np.isnan(special[2])  # -inf * 0, as torch
    np.testing.assert_array_equal(special[3:], [1e300, -0.0, 40.0, -0.0])


def _torch_feed_forward(ffn, x, activation, dtype):
    """torch's Linear, activation, Linear computing in `dtype` on the module's weights."""
    p = {k: t(v.astype(dtype)) for k, v in ffn.state_dict().items()}
    h = F.linear(t(x.astype(dtype)), p["fc1.weight"], p["fc1.bias"])
    h = F.relu(h) if activation == "relu" else F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")
    return F.linear(h, p["fc2.weight"], p["fc2.bias"]).double().numpy()


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_feed_forward_matches_torch(torch, activation, dtype):
    ffn = nn.FeedForward(16, 40, activation, seed=3).astype(dtype)
    x = (np.random.default_rng(2).standard_normal((2, 7, 16)) * 3).astype(dtype)
    out = ffn(x)
    assert out.dtype == dtype
    truth = _torch_feed_forward(ffn, x, activation, np.float64)  # float64 on the same rounded weights
    if dtype == np.float64:
        assert_close(out, truth, 1e-12, activation)
    else:
        assert_within_budget(out, _torch_feed_forward(ffn, x, activation, np.float32), truth, f"float32 {activation}")
    assert ffn(x.astype(np.float32)).dtype == np.float32


def test_feed_forward_dropout_only_in_training_and_seeded():
    x = np.ones((2, 3, 8), np.float32)
    ffn = nn.FeedForward(8, 64, dropout=0.5, seed=0)
    assert np.array_equal(ffn(x), ffn(x))  # eval: deterministic
    ffn.train()
    a = ffn(x)
    assert not np.array_equal(a, ffn(x))
    ffn.set_rng(5)
    a = ffn(x)
    ffn.set_rng(5)
    assert np.array_equal(a, ffn(x))
    with pytest.raises(ValueError, match="activation"):
        nn.FeedForward(8, 16, "swish")
    with pytest.raises(ValueError, match=r"dropout.*\[0, 1\)"):
        nn.FeedForward(8, 16, dropout=1.0)


def test_dropout_scales_kept_values():
    x = np.ones(100_000, np.float32)
    out = nn.dropout(x, 0.25, np.random.default_rng(0))
    kept = out != 0
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[kept], 1 / 0.75, rtol=F32_EPS)  # x / (1 - p) rounded once to float32
    assert abs(kept.mean() - 0.75) < 0.01  # standard deviation sqrt(0.25 * 0.75 / 1e5) = 0.0014: 0.01 is 7 of them


# ---------------------------------------------------------- positional


def test_sinusoidal_positional_encoding():
    pe = nn.sinusoidal_positional_encoding(50, 16, dtype=np.float64)
    assert pe.shape == (50, 16)
    pos, i = 7, 3
    assert math.isclose(pe[pos, 2 * i], math.sin(pos / 10000 ** (2 * i / 16)), rel_tol=1e-12)
    assert math.isclose(pe[pos, 2 * i + 1], math.cos(pos / 10000 ** (2 * i / 16)), rel_tol=1e-12)
    assert np.array_equal(pe[0, 0::2], np.zeros(8)) and np.array_equal(pe[0, 1::2], np.ones(8))
    # continuing from an offset gives the rows of the longer table, bit for bit (same float64 positions)
    np.testing.assert_array_equal(nn.sinusoidal_positional_encoding(10, 16, start=40, dtype=np.float64), pe[40:])
    np.testing.assert_array_equal(nn.sinusoidal_positional_encoding(3, 5, start=3, dtype=np.float64),
                                  nn.sinusoidal_positional_encoding(6, 5, dtype=np.float64)[3:])
    # an odd d_model, the whole table by the formula (it ends with a sine column)
    pe5 = nn.sinusoidal_positional_encoding(6, 5, dtype=np.float64)
    pos, i = np.arange(6)[:, None], np.arange(5)[None, :]
    angle = pos / 10000.0 ** ((i - i % 2) / 5)
    np.testing.assert_allclose(pe5, np.where(i % 2 == 0, np.sin(angle), np.cos(angle)), rtol=1e-14, atol=1e-15)
    # float32: computed in float64 and rounded once, so within one float32 ulp of the formula
    odd = nn.sinusoidal_positional_encoding(4, 7)
    assert odd.shape == (4, 7) and odd.dtype == np.float32
    assert math.isclose(odd[3, 6], math.sin(3 / 10000 ** (6 / 7)), rel_tol=F32_EPS)
    assert math.isclose(odd[3, 5], math.cos(3 / 10000 ** (4 / 7)), rel_tol=F32_EPS)
    with pytest.raises(ValueError, match="d_model >= 1, got 0"):
        nn.sinusoidal_positional_encoding(4, 0)


# ----------------------------------------------------- dtype and bad input


def test_float32_stays_float32_everywhere():
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    block = nn.TransformerBlock(16, 4, 32, activation="gelu", seed=0)
    out = block(x, key_mask=np.ones((2, 5), bool), attn_mask=np.zeros((5, 5), np.float64))
    assert out.dtype == np.float32
    out, w = block.attn(x, need_weights=True)
    assert out.dtype == np.float32 and w.dtype == np.float32
    assert nn.LayerNorm(16)(x).dtype == np.float32
    # float16 input computes in float32 and comes back as float16
    assert block(x.astype(np.float16)).dtype == np.float16


def test_bad_input_errors():
    lin = nn.Linear(4, 3, seed=0)
    with pytest.raises(ValueError, match=r"expected x of shape \(\.\.\., 4\), got \(2, 5\)"):
        lin(np.zeros((2, 5), np.float32))
    with pytest.raises(TypeError, match="floating-point.*int64"):
        lin(np.zeros((2, 4), np.int64))
    with pytest.raises(TypeError, match="floating-point.*int32"):
        nn.Linear(3, 4)(np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="in_features"):
        nn.Linear(0, 3)
    with pytest.raises(ValueError, match=r"normalized_shape"):
        nn.LayerNorm(-1)
    for d in (1, 7, 8, 64):
        with pytest.raises(ValueError, match=rf"expected x of shape \(\.\.\., {d}\), got \(2, {d + 1}\)"):
            nn.LayerNorm(d)(np.zeros((2, d + 1)))
    with pytest.raises(ValueError, match=r"expected x of shape \(\.\.\., 8\), got \(2, 7\)"):
        nn.FeedForward(8, 16)(np.zeros((2, 7)))


def test_torch_tensors_are_refused_with_a_hint(torch):
    with pytest.raises(TypeError, match="torch tensor"):
        nn.Linear(4, 3, seed=0)(torch.zeros(2, 4))


@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    d_in=st.integers(1, 9),
    d_out=st.integers(1, 9),
    bias=st.booleans(),
)
def test_linear_random_shapes_match_torch(torch, lead, d_in, d_out, bias):
    lin = nn.Linear(d_in, d_out, bias, seed=0).astype(np.float64)
    x = np.random.default_rng(1).standard_normal((*lead, d_in))
    out = lin(x)
    assert out.shape == (*lead, d_out)
    expected = F.linear(t(x), t(lin.weight), t(lin.bias) if bias else None).numpy()
    assert_close(out, expected, 1e-12)


@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    d=st.integers(1, 70),
    shift=st.floats(-100, 100),
    spread=st.floats(1e-3, 1e3),
    eps=st.sampled_from([1e-5, 1e-6, 1e-12]),
)
@example(lead=[3, 4], d=1, shift=5.0, spread=100.0, eps=1e-6)
@example(lead=[3, 4], d=7, shift=5.0, spread=100.0, eps=1e-6)
@example(lead=[3, 4], d=64, shift=5.0, spread=100.0, eps=1e-6)
def test_layer_norm_random_shapes_match_torch(torch, lead, d, shift, spread, eps):
    rng = np.random.default_rng(d)
    ln = nn.LayerNorm(d, eps=eps).astype(np.float64)
    ln.weight = rng.standard_normal(d)
    ln.bias = rng.standard_normal(d)
    x = rng.standard_normal((*lead, d)) * spread + shift
    expected = F.layer_norm(t(x), (d,), t(ln.weight), t(ln.bias), eps).numpy()
    assert ln(x.astype(np.float16)).dtype == np.float16
    # x - mean cancels the shift: both sides lose log10(1 + |shift| / spread) digits of float64,
    # then a few ulps per reduction over d entries
    assert_close(ln(x), expected, 1e-13 * (1 + abs(shift) / spread) * math.sqrt(d), "layer_norm")
