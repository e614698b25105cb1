"""attnkit.torch.flash_attention: the tiled algorithm as a torch autograd Function.

Oracles: torch.autograd.gradcheck in float64 (finite differences), torch's
F.scaled_dot_product_attention and its autograd, the float64 reference of
conftest, and attnkit's NumPy flash kernel.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.functional.band import Band
from attnkit.functional.masks import causal_mask
from conftest import assert_within_budget, optional, reference_attention
from wide_range import EXPONENTS, SCALES, assert_like_truth, natural_sizes, torch_math, wide

torch = optional("torch")
F = torch.nn.functional if torch else None
# attnkit.torch needs torch; without it every test here skips (or fails under
# ATTNKIT_REQUIRE_ORACLES=1) through the fixture below, and the file still collects
at = importlib.import_module("attnkit.torch") if torch else None
FlashAttentionFunction = at.FlashAttentionFunction if torch else None
flash_attention = at.flash_attention if torch else None

pytestmark = pytest.mark.usefixtures("torch")  # every test here runs attnkit.torch


def _qkv(B, Hq, Hkv, L, S, E, Ev=None, dtype=None, seed=0, grad=True):
    dtype = torch.float64 if dtype is None else dtype
    g = torch.Generator().manual_seed(seed)
    Ev = E if Ev is None else Ev
    q = torch.randn(B, Hq, L, E, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, S, Ev, generator=g, dtype=torch.float64).to(dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


# ----- gradcheck in float64 ------------------------------------------------------------


GRADCHECK_CASES = [
    # (Hq, Hkv, L, S, E, Ev, mask kind, causal, align, block_q, block_k)
    (2, 2, 7, 9, 4, 3, None, False, "top_left", 3, 4),
    (2, 2, 9, 9, 4, 4, None, True, "top_left", 4, 3),
    (4, 2, 6, 11, 3, 5, "bool", False, "top_left", 4, 4),  # GQA, a fully masked row
    (4, 1, 8, 5, 3, 3, "bool", True, "top_left", 3, 2),  # MQA, L > S
    (2, 2, 5, 10, 4, 4, "float", True, "bottom_right", 2, 3),
    (2, 2, 10, 6, 4, 4, None, True, "bottom_right", 4, 4),  # first rows see no key
]


def _mask(kind, Hq, L, S, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        m = torch.rand(Hq, L, S, generator=g) > 0.4
        m[0, 2] = False  # one query of head 0 may attend to nothing
        return m
    if kind == "float":
        m = torch.randn(1, L, S, generator=g, dtype=torch.float64)
        m[0, 1, ::2] = -torch.inf
        return m
    return None


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=lambda c: f"H{c[0]}-{c[1]}_L{c[2]}_S{c[3]}_{c[6]}_causal{c[7]}_{c[8]}")
def test_gradcheck_float64(case):
    Hq, Hkv, L, S, E, Ev, kind, causal, align, bq, bk = case
    q, k, v = _qkv(1, Hq, Hkv, L, S, E, Ev)
    mask = _mask(kind, Hq, L, S)

    def fn(q, k, v):
        return flash_attention(q, k, v, mask, is_causal=causal, enable_gqa=Hq != Hkv,
                               causal_align=align, block_q=bq, block_k=bk)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8)


def test_gradcheck_through_a_float_mask():
    """A float mask (e.g. a learned position bias) gets its gradient, summed over broadcast dims."""
    q, k, v = _qkv(1, 2, 2, 6, 7, 3)
    bias = torch.randn(1, 2, 6, 7, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v, b: flash_attention(q, k, v, b, is_causal=True, block_q=4, block_k=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-8)


# ----- against torch SDPA and the float64 reference --------------------------------------


def _torch_mask(kind, Hq, L, S, causal, align, window=None):
    """The same masking as one bool/float mask for SDPA (None when plain)."""
    mask = _mask(kind, Hq, L, S)
    if causal or window is not None:
        band = Band.from_options(is_causal=causal, causal_align=align, window=window, L=L, S=S)
        c = torch.from_numpy(band.dense(L, S))
        if mask is None:
            mask = c
        elif mask.dtype == torch.bool:
            mask = mask & c
        else:
            mask = mask.masked_fill(~c, -torch.inf)
    return mask


@pytest.mark.parametrize("Hq,Hkv,L,S,E,kind,causal,align,window", [
    (8, 8, 97, 130, 59, None, False, "top_left", None),
    (8, 2, 130, 97, 16, "bool", True, "top_left", None),
    (4, 4, 64, 200, 32, "float", True, "bottom_right", None),
    (2, 2, 1, 1025, 8, None, True, "bottom_right", None),  # one decoding query over a long cache
    # sliding windows (one band with is_causal): tiles outside are skipped, crossed ones masked
    (4, 4, 97, 97, 16, None, True, "top_left", 20),
    (4, 2, 70, 130, 32, "bool", True, "bottom_right", (33, 0)),
    (2, 2, 130, 60, 8, "float", False, "bottom_right", (10, 7)),
    (2, 1, 50, 50, 8, None, False, "top_left", (None, 3)),
    (2, 2, 40, 90, 8, None, True, "top_left", 1),  # L < S top-left: keys after L never seen
    (2, 2, 64, 64, 8, None, False, "top_left", (0, 0)),  # every row sees one key
    (2, 2, 33, 20, 8, None, True, "bottom_right", 100),  # wider than S; the first rows see no key
], ids=str)
def test_forward_and_backward_match_sdpa(Hq, Hkv, L, S, E, kind, causal, align, window):
    """float32: error against the float64 reference at most 2x torch SDPA's own float32 error
    (forward) and 3x for gradients, FlashAttention's rule; float64 agrees to ~1e-10."""
    q64, k64, v64 = _qkv(2, Hq, Hkv, L, S, E, seed=3)
    mask = _torch_mask(kind, Hq, L, S, causal, align, window)
    gqa = Hq != Hkv
    d_out = torch.randn(2, Hq, L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    def run(fn, dtype):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64))
        out = fn(q, k, v)
        out.backward(d_out.to(dtype))
        return [t.detach().double() for t in (out, q.grad, k.grad, v.grad)]

    def ours(q, k, v):
        m = None if kind is None else _mask(kind, Hq, L, S)
        if m is not None and m.is_floating_point():
            m = m.to(q.dtype)
        return flash_attention(q, k, v, m, is_causal=causal, causal_align=align, window=window, enable_gqa=gqa,
                               block_q=32, block_k=48)

    def sdpa(q, k, v):
        m = mask if mask is None or mask.dtype == torch.bool else mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa)

    exact = run(sdpa, torch.float64)
    ours64 = run(ours, torch.float64)
    for name, a, b in zip(("output", "dq", "dk", "dv"), ours64, exact):
        assert (a - b).abs().max().item() < 1e-10, name
    ours32 = run(ours, torch.float32)
    sdpa32 = run(sdpa, torch.float32)
    for i, name in enumerate(("output", "dq", "dk", "dv")):
        assert_within_budget(ours32[i].numpy(), sdpa32[i].numpy(), exact[i].numpy(), f"{name} vs SDPA float32",
                             factor=2.0 if name == "output" else 3.0)


def test_lse_matches_reference_and_numpy_flash():
    q, k, v = _qkv(1, 4, 2, 33, 50, 8, grad=False)
    mask = _mask("bool", 4, 33, 50).numpy()
    res = flash_attention(q, k, v, torch.from_numpy(mask), enable_gqa=True, return_lse=True, block_q=16, block_k=16)
    out_ref, _, lse_ref = reference_attention(q.numpy(), k.numpy(), v.numpy(), mask, gqa_group=2)
    np.testing.assert_allclose(res.output.numpy(), out_ref, atol=1e-12)
    finite = np.isfinite(lse_ref)
    assert not finite.all()  # the fully masked row is there
    np.testing.assert_allclose(res.lse.numpy()[finite], lse_ref[finite], atol=1e-12)
    assert np.all(res.lse.numpy()[~finite] == -np.inf)
    numpy_flash = attnkit.flash_attention(q.numpy(), k.numpy(), v.numpy(), mask, enable_gqa=True, return_lse=True)
    np.testing.assert_allclose(res.output.numpy(), numpy_flash.output, atol=1e-12)
    np.testing.assert_allclose(res.lse.numpy()[finite], numpy_flash.lse[finite], atol=1e-12)


def test_fully_masked_rows_give_zero_output_and_zero_gradients():
    q, k, v = _qkv(1, 2, 2, 5, 6, 4, dtype=torch.float32)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[3] = False
    out = flash_attention(q, k, v, mask, block_q=2, block_k=4)
    out.sum().backward()
    assert torch.isfinite(out).all() and (out[:, :, 3] == 0).all()
    assert (q.grad[:, :, 3] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_half_precision_accumulates_in_float32():
    q, k, v = _qkv(1, 2, 2, 40, 40, 16, dtype=torch.bfloat16)
    out = flash_attention(q, k, v, is_causal=True, block_q=16, block_k=16)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16
    truth = F.scaled_dot_product_attention(*(t.detach().double() for t in (q, k, v)), is_causal=True)
    oracle = F.scaled_dot_product_attention(*(t.detach() for t in (q, k, v)), is_causal=True)  # torch's bfloat16
    # epsilon: half a bfloat16 ulp (2^-8 = 2^15 float32 ulps) at the largest output, storing the result
    assert_within_budget(out.detach().double().numpy(), oracle.double().numpy(), truth.numpy(),
                         "bfloat16 output vs torch SDPA bfloat16", ulps=2.0**15)


def test_block_sizes_do_not_change_the_result():
    q, k, v = _qkv(2, 2, 2, 37, 41, 8, grad=False)
    results = [flash_attention(q, k, v, is_causal=True, block_q=bq, block_k=bk) for bq, bk in ((1, 1), (5, 7), (64, 64))]
    for r in results[1:]:
        assert (r - results[0]).abs().max().item() < 1e-13


def test_function_is_a_torch_autograd_function():
    assert issubclass(FlashAttentionFunction, torch.autograd.Function)
    q, k, v = _qkv(1, 1, 1, 4, 4, 2)
    out = flash_attention(q, k, v)
    node, names = out.grad_fn, []
    while node is not None:  # walk back through the reshapes to the Function's node
        names.append(type(node).__name__)
        node = node.next_functions[0][0] if node.next_functions else None
    assert any(n.startswith("FlashAttentionFunction") for n in names), names


# ----- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [  # kwargs built in the test: torch may be missing here
    (lambda: {"key": torch.zeros(1, 2, 5, 3)}, ValueError, r"E=4 like query"),
    (lambda: {"value": torch.zeros(1, 2, 6, 4)}, ValueError, r"like key"),
    (lambda: {"key": torch.zeros(1, 1, 5, 4), "value": torch.zeros(1, 1, 5, 4)}, ValueError, "enable_gqa"),
    (lambda: {"attn_mask": torch.ones(3, 5, dtype=torch.bool)}, ValueError, r"broadcastable to .* got \(3, 5\)"),
    (lambda: {"attn_mask": torch.ones(4, 5, dtype=torch.int64)}, TypeError, "bool or floating"),
    (lambda: {"query": torch.zeros(2, 2, 4, 4)}, ValueError, "leading dims"),
    (lambda: {"block_q": 0}, ValueError, "block_q"),
    (lambda: {"causal_align": "middle"}, ValueError, "causal_align"),
    (lambda: {"query": np.zeros((1, 2, 4, 4))}, TypeError, "torch.Tensor"),
], ids=["key_E", "value_S", "heads_without_gqa", "mask_shape", "mask_dtype", "query_batch", "block_q",
        "causal_align", "numpy_query"])
def test_bad_input_is_rejected(kwargs, error, match):
    args = {"query": torch.zeros(1, 2, 4, 4), "key": torch.zeros(1, 2, 5, 4), "value": torch.zeros(1, 2, 5, 4)}
    args.update(kwargs())
    with pytest.raises(error, match=match):
        flash_attention(**args)


# ----- random shapes -------------------------------------------------------------------------


@settings(max_examples=25)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 3), group=st.integers(1, 3), L=st.integers(1, 40),
    S=st.integers(1, 40), E=st.integers(1, 17), causal=st.booleans(), align=st.sampled_from(["top_left", "bottom_right"]),
    masked=st.booleans(), block_q=st.integers(1, 20), block_k=st.integers(1, 20), seed=st.integers(0, 2**16),
)
def test_random_shapes_match_sdpa_forward_and_backward(B, Hkv, group, L, S, E, causal, align, masked, block_q,
                                                       block_k, seed):
    Hq = Hkv * group
    q, k, v = _qkv(B, Hq, Hkv, L, S, E, seed=seed)
    mask = (torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(seed)) > 0.3) if masked else None
    full = mask
    if causal:
        c = torch.from_numpy(causal_mask(L, S, align=align))
        full = c if full is None else full & c
    ours = flash_attention(q, k, v, mask, is_causal=causal, causal_align=align, enable_gqa=group > 1,
                           block_q=block_q, block_k=block_k)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=group > 1)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    d_out = torch.randn_like(ref)
    grads = torch.autograd.grad(ours, (q, k, v), d_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), d_out)
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"d{name}")


# ----- any finite magnitude, empty inputs, rows that see one key ------------------------------


@settings(max_examples=30)
@given(batch=st.sampled_from([(), (2,)]), Hkv=st.integers(1, 2), group=st.sampled_from([1, 2]),
       L=st.integers(1, 7), S=st.integers(1, 9), E=st.sampled_from([1, 3, 16, 59]),
       exponents=st.tuples(EXPONENTS, EXPONENTS, EXPONENTS, EXPONENTS), scale=SCALES,
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_any_finite_magnitude_gives_torch_math_float64_answer(batch, Hkv, group, L, S, E, exponents, scale,
                                                              causal, seed):
    """Finite in, finite out (tests/wide_range.py): float32 inputs from 1e-30 to 1e30
    and scales from 1e-38 to 1e30 give torch's math backend's float64 answer, forward
    and backward, never NaN. Scores beyond float32 run in float64."""
    rng = np.random.default_rng(seed)
    Hq = Hkv * group
    q = wide(rng, (*batch, Hq, L, E), exponents[0])
    k = wide(rng, (*batch, Hkv, S, E), exponents[1])
    v = wide(rng, (*batch, Hkv, S, E), exponents[2])
    d_out = wide(rng, (*batch, Hq, L, E), exponents[3])
    mask = causal_mask(L, S, align="bottom_right") if causal else None
    truth, truth_grads = torch_math(torch, q, k, v, mask, scale, group > 1, "float64", d_out)
    oracle, oracle_grads = torch_math(torch, q, k, v, mask, scale, group > 1, "float32", d_out)
    sizes = natural_sizes(q, k, v, mask, scale, group, d_out)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = flash_attention(tq, tk, tv, is_causal=causal, causal_align="bottom_right", scale=scale,
                          enable_gqa=group > 1, block_q=3, block_k=4)
    assert out.dtype == torch.float32
    assert_like_truth(out.detach().numpy(), oracle, truth, sizes["out"], "output")
    out.backward(torch.tensor(d_out))
    for name, x, theirs, t in zip(("dq", "dk", "dv"), (tq, tk, tv), oracle_grads, truth_grads):
        assert x.grad.dtype == torch.float32
        assert_like_truth(x.grad.numpy(), theirs, t, sizes[name], name, factor=3.0)


@pytest.mark.parametrize("q_shape, k_shape, gqa", [
    ((2, 0, 4, 8), (2, 0, 5, 8), False),  # no head at all
    ((2, 0, 4, 8), (2, 4, 5, 8), True),  # no query head
    ((2, 4, 4, 8), (2, 0, 5, 8), False),  # no key/value head: no key, zeros
    ((0, 3, 4, 8), (0, 3, 5, 8), False),
    ((2, 3, 0, 8), (2, 3, 5, 8), False),
    ((2, 3, 4, 8), (2, 3, 0, 8), False),
    ((2, 3, 4, 0), (2, 3, 5, 0), False),
], ids=str)
def test_empty_dimensions_give_torchs_results_and_gradients(q_shape, k_shape, gqa):
    q, k = torch.randn(q_shape, requires_grad=True), torch.randn(k_shape, requires_grad=True)
    v = torch.randn(k_shape, requires_grad=True)
    out = flash_attention(q, k, v, enable_gqa=gqa)
    try:
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    except RuntimeError:  # torch 2.5 and 2.6 refuse Hq > 0 against Hkv = 0; newer torch returns zeros
        assert k_shape[1] == 0 and q_shape[1] > 0
        ref = q.new_zeros(*q_shape[:-1], k_shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    d_out = torch.randn_like(ref)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), d_out, allow_unused=True),
                          torch.autograd.grad(ref, (q, k, v), d_out, allow_unused=True)):
        b = torch.zeros_like(a) if b is None else b
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=f"d{name}")


@pytest.mark.parametrize("L, S, block_q, block_k", [(1, 1, 128, 128), (7, 3, 128, 128), (12, 5, 4, 2),
                                                    (9, 9, 3, 4)])
def test_rows_that_see_one_key_get_zero_query_gradients(L, S, block_q, block_k):
    """Bottom-right causal with L > S: row L - S sees key 0 alone, its softmax is
    constant and its exact dQ is 0; the plain path gives 0 and so does the tile's D."""
    q, k, v = _qkv(2, 3, 3, L, S, 59, 40, dtype=torch.float32, seed=L)
    out = flash_attention(q, k, v, is_causal=True, causal_align="bottom_right", block_q=block_q, block_k=block_k)
    d_out = torch.randn_like(out)
    dq = torch.autograd.grad(out, q, d_out)[0]
    one = torch.from_numpy(causal_mask(L, S, align="bottom_right").sum(-1) == 1)
    assert one.any()
    print(f"largest dQ of a row that sees one key: {dq[..., one, :].abs().max():.3e}")
    assert not dq[..., one, :].any(), "dQ of a row that sees one key"
