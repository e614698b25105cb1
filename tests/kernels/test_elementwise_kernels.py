"""The encoder's compiled element-wise loops (attnkit.kernels.elementwise) against float64
truth, the NumPy float32 reference they replace, and torch.

The budget (docs/kernels.md, "Flash and encoder kernels"): each kernel's error against the
float64 truth is at most twice the NumPy float32 reference's, and twice torch's, plus a
few float32 ulps at the result's natural size (the result is stored in float32).
Adversarial inputs: huge and tiny values, NaN and inf, rows whose mean dwarfs their spread
(LayerNorm's cancellation), constant rows, fully masked softmax rows, odd sizes.

Without numba, or with ATTNKIT_KERNELS=numpy, the kernel-level tests skip (there is no
kernel to test); the encoder test then checks the NumPy path against the same oracles.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnkit import kernels
from attnkit.kernels import elementwise as compiled
from attnkit.models import bert_model as bert
from attnkit.nn import layers
from conftest import F32_EPS, assert_within_budget, optional

torch = optional("torch")

needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason=f"compiled kernels off: {kernels.reason_disabled()}")


@pytest.fixture(autouse=True, scope="module")
def _started():
    """The loops start at once here (a process otherwise runs NumPy until its work pays for them)."""
    compiled.load()


def _exact_gelu(x):
    """float64 GELU, x Phi(x) = x/2 erfc(-x / sqrt 2) (no cancellation), by the C library's erfc."""
    return np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in np.asarray(x, np.float64).ravel()]).reshape(
        np.shape(x))


def _gelu_inputs(n, seed):
    rng = np.random.default_rng(seed)
    special = [0.0, -0.0, 1e-30, -1e-30, 1e-42, -1e-42, 5.0, -5.0, 8.0, -8.0, 12.0, -12.0, 40.0, -40.0, 1e30, -1e30]
    x = np.concatenate([special, np.linspace(-12, 12, n), rng.standard_normal(n) * 3]).astype(np.float32)
    return x


@needs_kernels
@pytest.mark.parametrize("n", [1, 31, 4001])
def test_gelu_within_twice_numpy_and_torch(torch, n):
    x = _gelu_inputs(n, n)
    ours = x.copy()
    compiled.gelu(ours)
    truth = _exact_gelu(x)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "usable", lambda *a: False)
        numpy_ref = bert.gelu_inplace(x.reshape(1, -1).copy())[0]
    torch_ref = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    assert_within_budget(ours, numpy_ref, truth, f"gelu n={n} vs NumPy", ulps=2)
    assert_within_budget(ours, torch_ref, truth, f"gelu n={n} vs torch", ulps=2)
    # the tails: GELU(x) = x exactly above ~8, and a tiny negative (not 0 - rounding) below
    assert (ours[x >= 8] == x[x >= 8]).all()
    assert (np.abs(ours[(x < 0) & (x > -8)]) <= np.abs(x[(x < 0) & (x > -8)])).all()


@needs_kernels
def test_gelu_propagates_nan_and_infinity():
    x = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    compiled.gelu(x)
    assert np.isnan(x[0]) and x[1] == np.inf and (x[2] == 0 or np.isnan(x[2])) and np.isfinite(x[3])


@needs_kernels
@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 37), (33, 1536)])
def test_gelu_bias_is_gelu_of_the_float32_sum(rows, cols):
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((rows, cols)) * 4).astype(np.float32)
    bias = rng.standard_normal(cols).astype(np.float32)
    ours = x.copy()
    compiled.gelu_bias(ours, bias)
    summed = x + bias  # the float32 sum both paths take GELU of
    truth = _exact_gelu(summed)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "usable", lambda *a: False)
        numpy_ref = bert.gelu_inplace(x.copy(), bias)
    assert_within_budget(ours, numpy_ref, truth, f"gelu(x + bias) {rows}x{cols}", ulps=2)


def _norm_rows(rng, rows, cols):
    """Rows for LayerNorm: plain, a mean 1e4 times the spread, constant, tiny, huge."""
    x = rng.standard_normal((rows, cols))
    x[0] = 1e4 + rng.standard_normal(cols)  # cancellation: the mean dwarfs the spread
    if rows > 1:
        x[1] = 3.0  # constant: var 0, eps alone
    if rows > 2:
        x[2] *= 1e-20
    if rows > 3:
        x[3] *= 1e15
    return x.astype(np.float32)


def _layer_norm64(x, weight, bias, eps):
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight.astype(np.float64) + bias.astype(np.float64)


@needs_kernels
@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 7), (64, 384)])
def test_layer_norm_within_twice_numpy_and_torch(torch, rows, cols):
    rng = np.random.default_rng(rows + cols)
    x = _norm_rows(rng, rows, cols)
    weight, bias = (rng.standard_normal(cols).astype(np.float32) for _ in range(2))
    eps = 1e-12
    ours = x.copy()
    compiled.layer_norm(ours, weight, bias, eps)
    truth = _layer_norm64(x, weight, bias, eps)
    numpy_ref = bert._layer_norm_inplace(x.copy(), weight, bias, eps)
    torch_ref = torch.nn.functional.layer_norm(torch.from_numpy(x), (cols,), torch.from_numpy(weight),
                                               torch.from_numpy(bias), eps).numpy()
    # natural size: |weight| (a normalized value is O(1)) plus |bias|
    size = float(np.abs(weight).max() * math.sqrt(cols) + np.abs(bias).max())
    assert_within_budget(ours, numpy_ref, truth, f"layer norm {rows}x{cols} vs NumPy", ulps=4, scale=size)
    assert_within_budget(ours, torch_ref, truth, f"layer norm {rows}x{cols} vs torch", ulps=4, scale=size)


@needs_kernels
def test_add_layer_norm_is_the_norm_of_the_float32_sums():
    rng = np.random.default_rng(11)
    y, residual = (rng.standard_normal((40, 384)).astype(np.float32) * 5 for _ in range(2))
    add_bias, weight, bias = (rng.standard_normal(384).astype(np.float32) for _ in range(3))
    ours = y.copy()
    compiled.add_layer_norm(ours, add_bias, residual, weight, bias, 1e-12)
    truth = _layer_norm64((y + add_bias) + residual, weight, bias, 1e-12)
    norm = layers.LayerNorm(384, eps=1e-12)
    norm.weight, norm.bias = weight, bias
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "usable", lambda *a: False)
        numpy_ref = bert._add_layer_norm_inplace(y.copy(), add_bias, residual, norm)
    size = float(np.abs(weight).max() * math.sqrt(384) + np.abs(bias).max())
    assert_within_budget(ours, numpy_ref, truth, "bias + residual + layer norm", ulps=4, scale=size)


@needs_kernels
@pytest.mark.parametrize("rows, cols", [(1, 1), (6, 13), (64, 257)])
def test_softmax_within_twice_numpy_with_masked_rows(rows, cols):
    rng = np.random.default_rng(rows * cols)
    s = (rng.standard_normal((rows, cols)) * 8).astype(np.float32)
    s[:, ::3] = -np.inf  # masked keys
    s[0] = -np.inf  # a fully masked row: weights 0, lse -inf, never NaN
    if rows > 1:
        s[1, -1] = 1e30  # one huge score: a one-hot row
    if rows > 2:
        s[2] = -1e30
        s[2, -1] = -1e30 + 1e24
    ours, lse = s.copy(), np.empty(rows, np.float32)
    compiled.softmax(ours, lse)
    s64 = s.astype(np.float64)
    live = ~np.isneginf(s64).all(-1)
    top = np.where(live[:, None], s64.max(-1, keepdims=True), 0)
    e = np.exp(s64 - top)
    total = e.sum(-1, keepdims=True)
    truth = np.where(live[:, None], e / np.where(total > 0, total, 1), 0)
    with np.errstate(divide="ignore"):
        truth_lse = np.log(total[:, 0]) + top[:, 0]
    numpy_ref = s - np.where(live, s.max(-1), 0)[:, None]  # NumPy's lines (functional.attention)
    np.exp(numpy_ref, out=numpy_ref)
    numpy_total = numpy_ref.sum(-1, keepdims=True)
    numpy_ref /= np.maximum(numpy_total, 1)
    assert not np.isnan(ours).any() and (ours[0] == 0).all() and np.isneginf(lse[0])
    assert_within_budget(ours, numpy_ref, truth, f"softmax {rows}x{cols}", ulps=2)
    numpy_lse = (np.log(numpy_total[:, 0].astype(np.float64)) + np.where(live, s.max(-1), 0))
    if live.any():
        assert_within_budget(lse[live], numpy_lse[live].astype(np.float32), truth_lse[live], "lse", ulps=2)


@needs_kernels
def test_softmax_propagates_nan_as_torch_does():
    s = np.array([[1.0, np.nan, 2.0], [1.0, 2.0, 3.0]], np.float32)
    lse = np.empty(2, np.float32)
    compiled.softmax(s, lse)
    assert np.isnan(s[0]).all() and np.isnan(lse[0])
    assert np.isfinite(s[1]).all() and np.isfinite(lse[1])


def test_short_work_never_loads_numba_and_long_work_starts_the_loops():
    """A process whose element-wise work would save less than loading the loops costs
    (one sentence through `attnkit show`, a small flash call) never imports numba; once
    the savings it missed reach LOAD_SECONDS the loops start and stay."""
    code = (
        "import sys, numpy as np, attnkit\n"
        "from attnkit.models.bert import gelu_inplace\n"
        "from attnkit.kernels import _start, enabled\n"
        "x = np.ones((10, 1536), np.float32)\n"
        "gelu_inplace(x)\n"
        "q = np.ones((1, 4, 64, 32), np.float32)\n"
        "attnkit.flash_attention(q, q, q)\n"
        "assert 'numba' not in sys.modules, 'short work imported numba'\n"
        "_start.LOAD_SECONDS = 1e-4\n"
        "for _ in range(3):\n"
        "    gelu_inplace(x)\n"
        "assert _start.started() == enabled(), (_start.started(), enabled())\n"
    )
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_encoder_block_with_kernels_within_twice_the_numpy_path():
    """A random post-LN encoder (MiniLM's shape, 2 layers) on token rows: the kernels' float32
    hidden states against the float64 model, within 2x the NumPy float32 path's error."""
    from attnkit.models.bert import BertModel
    from attnkit.models.bert_config import BertConfig

    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=64)
    model = BertModel(config)
    rng = np.random.default_rng(0)
    model.load_state_dict({name: rng.standard_normal(param.shape) * 0.2 for name, param in model.named_parameters()})
    ids = rng.integers(0, 100, (3, 20))
    mask = np.ones((3, 20), bool)
    mask[1, 12:] = False
    model32 = model.astype(np.float32)
    ours = model32(ids, mask).last_hidden_state
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "usable", lambda *a: False)
        numpy_ref = model32(ids, mask).last_hidden_state
    truth = model.astype(np.float64)(ids, mask).last_hidden_state  # the same (float32-rounded) weights
    assert ours.dtype == np.float32
    assert_within_budget(ours, numpy_ref, truth, "encoder hidden states", ulps=8)


# ----------------------------------------------------------------------------- attention's softmax


def _sdpa64(q, k, v, mask, scale):
    """float64 truth of softmax(q k^T * scale + mask) v, weights and lse, a fully masked row
    giving weights 0 and lse -inf (the project's convention)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("...le,...se->...ls", q, k) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask.astype(np.float64)
    live = ~np.isneginf(s).all(-1, keepdims=True)
    top = np.where(live, s.max(-1, keepdims=True), 0)
    e = np.exp(s - top)
    total = e.sum(-1, keepdims=True)
    w = np.where(live, e / np.where(total > 0, total, 1), 0)
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + top)[..., 0]
    return w @ v, w, lse


def _attention_inputs(mask_kind, dtype=np.float32):
    rng = np.random.default_rng(7)
    B, H, L, S, E = 2, 3, 9, 13, 16
    q, k, v = (rng.standard_normal((B, H, n, E)).astype(dtype) for n in (L, S, S))
    q *= 3  # peaked rows
    mask = None
    if mask_kind == "bool":
        mask = rng.random((B, 1, L, S)) < 0.7
        mask[0, 0, 2] = False  # a fully masked row
    elif mask_kind == "float":
        mask = (rng.standard_normal((B, H, L, S)) * 2).astype(dtype)
        mask[..., ::4] = -np.inf
        mask[1, 2, 5] = -np.inf  # a fully masked row
    return q, k, v, mask


@needs_kernels
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_attention_softmax_kernel_within_twice_numpy(mask_kind, scale):
    """scaled_dot_product_attention in float32 takes the compiled softmax (checked with a spy):
    output, weights and lse within twice the NumPy reference's error against float64, a fully
    masked row giving weights 0 and lse -inf, and never NaN."""
    from attnkit.functional import scaled_dot_product_attention as sdpa

    q, k, v, mask = _attention_inputs(mask_kind)
    calls = []
    real = compiled._softmax  # (the unchecked path scaled_dot_product_attention takes)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "_softmax", lambda s, lse: (calls.append(s.shape), real(s, lse)))
        ours = sdpa(q, k, v, attn_mask=mask, scale=scale, return_weights=True, return_lse=True)
    assert calls, "the compiled softmax did not run"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "usable", lambda *a: False)
        ref = sdpa(q, k, v, attn_mask=mask, scale=scale, return_weights=True, return_lse=True)
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out64, w64, lse64 = _sdpa64(q, k, v, mask, s)
    assert ours.output.dtype == ours.weights.dtype == ours.lse.dtype == np.float32
    assert_within_budget(ours.output, ref.output, out64, f"output, mask {mask_kind}", ulps=4)
    assert_within_budget(ours.weights, ref.weights, w64, f"weights, mask {mask_kind}", ulps=4)
    dead = np.isneginf(lse64)
    assert (np.isneginf(ours.lse) == dead).all() and (ours.weights[dead] == 0).all()
    assert_within_budget(ours.lse[~dead], ref.lse[~dead], lse64[~dead], f"lse, mask {mask_kind}", ulps=4)


@needs_kernels
def test_attention_fast_path_with_kernel_matches_the_general_path():
    """The unmasked fast path (a decode step's call) takes the compiled softmax too: the same
    bits as the general path, within twice NumPy's error; an overflowing row still goes to
    the general path (float64), not NaN."""
    from attnkit.functional import scaled_dot_product_attention as sdpa

    q, k, v, _ = _attention_inputs(None)
    fast = sdpa(q, k, v)
    general = sdpa(q, k, v, return_lse=True).output
    np.testing.assert_array_equal(fast, general)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "usable", lambda *a: False)
        ref = sdpa(q, k, v)
    assert_within_budget(fast, ref, _sdpa64(q, k, v, None, 1 / math.sqrt(q.shape[-1]))[0], "fast path", ulps=4)
    big = q.copy()
    big[0, 0, 0] = 1e19  # scores beyond float32's range
    out = sdpa(big, k, v)
    assert np.isfinite(out).all()
    assert_within_budget(out, out, _sdpa64(big, k, v, None, 1 / math.sqrt(q.shape[-1]))[0], "overflow row", ulps=8)


@needs_kernels
def test_attention_softmax_kernel_dtype_rules():
    """float16 computes in float32 (the kernel runs) and returns float16; float64 stays NumPy."""
    from attnkit.functional import scaled_dot_product_attention as sdpa

    q, k, v, mask = _attention_inputs("bool")
    calls = []
    real = compiled._softmax  # (the unchecked path scaled_dot_product_attention takes)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "_softmax", lambda s, lse: (calls.append(s.dtype), real(s, lse)))
        half = sdpa(*(x.astype(np.float16) for x in (q, k, v)), attn_mask=mask)
        assert calls == [np.float32] and half.dtype == np.float16
        calls.clear()
        double = sdpa(*(x.astype(np.float64) for x in (q, k, v)), attn_mask=mask)
        assert calls == [] and double.dtype == np.float64
    out64 = _sdpa64(*(x.astype(np.float16) for x in (q, k, v)), mask, 1 / math.sqrt(q.shape[-1]))[0]
    np.testing.assert_allclose(double, _sdpa64(q, k, v, mask, 1 / math.sqrt(q.shape[-1]))[0], rtol=1e-12, atol=1e-12)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "usable", lambda *a: False)
        half_ref = sdpa(*(x.astype(np.float16) for x in (q, k, v)), attn_mask=mask)
    assert_within_budget(half, half_ref, out64, "float16", ulps=4)


# ----------------------------------------------------------------------------- packed encoder attention


def _softmax64(s):
    """float64 softmax over the last axis; a row of -inf gives weights 0."""
    s = np.asarray(s, np.float64)
    live = ~np.isneginf(s).all(-1, keepdims=True)
    e = np.exp(s - np.where(live, s.max(-1, keepdims=True), 0))
    total = e.sum(-1, keepdims=True)
    return np.where(live, e / np.where(total > 0, total, 1), 0)


@needs_kernels
@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 3), (96, 24), (40, 53)])
@pytest.mark.parametrize("scale", [0.125, 0.37])
def test_attention_softmax_within_twice_numpy(rows, cols, scale):
    """softmax(scale * s) of short rows, the exp over all rows at once: within twice the
    NumPy reference's error (the scores scaled in float32, then its softmax lines) against
    the float64 softmax of the same float32 scores."""
    from attnkit.functional.attention import _softmax_inplace

    rng = np.random.default_rng(rows * cols)
    s = (rng.standard_normal((rows, cols)) * 20).astype(np.float32)
    if rows > 2:
        s[1] = 3.0  # a constant row: uniform weights
        s[2, 0] = 1e4  # one dominant score: a one-hot row
    ours = s.copy()
    compiled.attention_softmax(ours, scale)
    truth = _softmax64(np.float64(scale) * s.astype(np.float64))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "usable", lambda *a: False)
        numpy_ref, _ = _softmax_inplace(s * np.float32(scale), np.dtype(np.float32))
    assert ours.dtype == np.float32
    assert_within_budget(ours, numpy_ref, truth, f"attention softmax {rows}x{cols}, scale {scale}", ulps=2)
    np.testing.assert_allclose(ours.sum(-1, dtype=np.float64), 1.0, rtol=cols * F32_EPS)


@needs_kernels
def test_attention_softmax_rows_of_minus_infinity_and_nan():
    """A row of -inf gives weights 0 (never NaN); NaN in a row makes that row NaN, as torch's
    softmax does; the other rows are untouched by either."""
    s = np.array([[-np.inf] * 4, [1.0, np.nan, 2.0, 0.0], [np.nan, 1.0, 2.0, 0.0], [1.0, 2.0, 3.0, 4.0]], np.float32)
    compiled.attention_softmax(s, 0.5)
    assert (s[0] == 0).all()
    assert np.isnan(s[1]).all() and np.isnan(s[2]).all()
    np.testing.assert_allclose(s[3], _softmax64(0.5 * np.array([1.0, 2.0, 3.0, 4.0])), rtol=4 * F32_EPS)


def _random_bert(seed=0, hidden=64, heads=4):
    from attnkit.models.bert import BertModel
    from attnkit.models.bert_config import BertConfig

    config = BertConfig(vocab_size=100, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                        intermediate_size=4 * hidden, max_position_embeddings=64)
    model = BertModel(config)
    rng = np.random.default_rng(seed)
    model.load_state_dict({name: rng.standard_normal(param.shape) * 0.2 for name, param in model.named_parameters()})
    return model


@needs_kernels
@pytest.mark.parametrize("lengths", [[9, 9, 9, 12, 12, 30], [5, 1, 17, 17, 3, 40, 2], [1]])
def test_packed_encoder_attention_with_kernels_within_twice_the_numpy_path(lengths):
    """A random BERT (2 layers, random biases of the size of the weights) on packed sequences
    (runs of equal lengths, unsorted lengths, one token): the compiled attention on the
    products (query bias only, the value bias through the output projection) against the
    float64 model, within twice the float32 NumPy path's error (`varlen_attention` with
    every bias added); the compiled path is checked to have run."""
    model = _random_bert()
    rng = np.random.default_rng(len(lengths))
    ids = rng.integers(0, 100, sum(lengths))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    model32 = model.astype(np.float32)
    calls = []
    real = compiled._attention_softmax  # (the packed encoder's unchecked path)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "_attention_softmax", lambda s, scale: (calls.append(s.shape), real(s, scale)))
        ours = model32(ids, cu_seqlens=cu).last_hidden_state
    assert len(calls) == 2 * (1 + int(np.count_nonzero(np.diff(lengths)))), calls  # a call per run of one length
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiled, "usable", lambda *a: False)
        numpy_ref = model32(ids, cu_seqlens=cu).last_hidden_state
    truth = model.astype(np.float64)(ids, cu_seqlens=cu).last_hidden_state
    assert ours.dtype == np.float32 and ours.shape == (sum(lengths), 64)
    assert_within_budget(ours, numpy_ref, truth, f"packed hidden states {lengths}", ulps=8)


def test_numpy_switch_keeps_the_packed_encoder_on_the_reference():
    """ATTNKIT_KERNELS=numpy: a packed forward runs the NumPy reference and never loads the
    compiled loops, even when asked to start them."""
    code = (
        "import sys, numpy as np\n"
        "from attnkit.kernels import _start\n"
        "from attnkit.models.bert import BertModel\n"
        "from attnkit.models.bert_config import BertConfig\n"
        "_start.load()\n"
        "config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,\n"
        "                    intermediate_size=64, max_position_embeddings=32)\n"
        "model = BertModel(config).astype(np.float32)\n"
        "out = model(np.arange(20) % 50, cu_seqlens=np.array([0, 7, 20])).last_hidden_state\n"
        "assert np.isfinite(out).all()\n"
        "assert 'attnkit.kernels._encoder_loops' not in sys.modules and 'numba' not in sys.modules\n"
    )
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "ATTNKIT_KERNELS": "numpy"})
    assert run.returncode == 0, run.stderr


@needs_kernels
@pytest.mark.parametrize("rows, cols, width", [(1, 1, 1), (5, 9, 3), (77, 1152, 384)])
def test_add_bias_to_leading_columns_is_numpy_exactly(rows, cols, width):
    """x[:, :F] += bias: one float32 addition per element, so the same bits as NumPy's; the
    other columns untouched."""
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    bias = rng.standard_normal(width).astype(np.float32)
    ours = x.copy()
    compiled.add_bias_to_leading_columns(ours, bias)
    expected = x.copy()
    expected[:, :width] += bias
    np.testing.assert_array_equal(ours, expected)
