"""Learned attention sinks (gpt-oss) on every path: the NumPy plain and flash
paths, the torch flash Function, and the transformers routes, against a float64
transcription of gpt-oss's formula

    p_ij = exp(x_ij - m) / (exp(s_h - m) + sum_j exp(x_ij - m)),  m = max(s_h, max_j x_ij),
    output = p @ V  (the sink takes no value)

and against transformers' eager gpt-oss attention in float32 (FlashAttention's rule:
attnkit's float32 error at most 2x the oracle's, 3x for gradients).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import attnkit
from attnkit import masks
from conftest import assert_close, assert_within_budget, optional, score_conditioning

torch = optional("torch")

CASES = {  # name: (Hq, Hkv, L, S, flash keywords, the same mask as booleans (L, S) or None)
    "full, GQA": (4, 2, 19, 23, {}, None),
    "causal bottom-right, L > S (fully masked rows)": (
        4, 4, 21, 13, dict(is_causal=True, causal_align="bottom_right"), masks.causal_mask(21, 13, align="bottom_right")),
    "window (5, 0), GQA": (
        6, 2, 30, 30, dict(window=(5, 0)), masks.sliding_window_mask(30, 30, left=5, right=0)),
    "window (3, 2), L != S": (
        2, 1, 17, 29, dict(window=(3, 2), causal_align="bottom_right"),
        masks.sliding_window_mask(17, 29, left=3, right=2, align="bottom_right")),
}


def _inputs(case: str, dtype=np.float64, seed: int = 0):
    Hq, Hkv, L, S, kw, allowed = CASES[case]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, Hq, L, 16))
    k = rng.standard_normal((2, Hkv, S, 16))
    v = rng.standard_normal((2, Hkv, S, 8))
    sinks = rng.standard_normal(Hq) * 2.0
    d_out = rng.standard_normal((2, Hq, L, 8))
    return [x.astype(dtype) for x in (q, k, v, sinks, d_out)], kw, allowed


def _gpt_oss(q, k, v, sinks, allowed, dtype, eager: bool = False):
    """gpt-oss's attention in torch, differentiable: (output, leaves q, k, v, sinks).
    eager=False: the formula above in float64; eager=True: transformers' eager lines
    (scores, + mask, cat the sink, minus the max, softmax, drop the sink) in `dtype`."""
    leaves = [torch.tensor(np.asarray(x), dtype=dtype, requires_grad=True) for x in (q, k, v, sinks)]
    tq, tk, tv, ts = leaves
    g = tq.shape[1] // tk.shape[1]
    kk, vv = tk.repeat_interleave(g, 1), tv.repeat_interleave(g, 1)
    x = tq @ kk.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))  # (B, Hq, L, S)
    if allowed is not None:
        x = x + torch.where(torch.tensor(allowed), 0.0, -math.inf).to(dtype)
    sink = ts.reshape(1, -1, 1, 1).expand(*x.shape[:-1], 1)
    if eager:
        logits = torch.cat([x, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        p = torch.softmax(logits, dim=-1)[..., :-1]
    else:
        m = torch.maximum(x.amax(-1, keepdim=True), sink).detach()
        e, es = torch.exp(x - m), torch.exp(sink - m)
        p = e / (es + e.sum(-1, keepdim=True))
    return p @ vv, leaves


def _truth_and_oracle(q, k, v, sinks, d_out, allowed):
    """float64 truth and transformers-eager float32: (output, grads) of each."""
    results = []
    for dtype, eager in ((torch.float64, False), (torch.float32, True)):
        out, leaves = _gpt_oss(q, k, v, sinks, allowed, dtype, eager)
        out.backward(torch.tensor(np.asarray(d_out), dtype=dtype))
        results.append((out.detach().double().numpy(), [x.grad.double().numpy() for x in leaves]))
    return results


def _natural_sizes(q, k, v, d_out):
    """The problem's sizes at which the budgets count their ulps (see tests/functional/test_flash.py)."""
    group = q.shape[1] // k.shape[1]
    cond = score_conditioning(q, k, None, group)
    vv = np.repeat(np.abs(v).astype(np.float64), group, axis=1)
    dp = float((np.abs(d_out.astype(np.float64)) @ np.swapaxes(vv, -1, -2)).max())
    return (np.abs(v).max() * cond, dp * np.abs(k).max() * cond, dp * np.abs(q).max() * cond,
            np.abs(d_out).max() * cond, dp * cond * q.shape[-2] * q.shape[0])


def _numpy_paths(q, k, v, sinks, d_out, kw, allowed):
    """(name, output, grads) of the plain and the flash path (small tiles and default)."""
    group = q.shape[1] // k.shape[1]
    plain = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=group > 1, sinks=sinks)
    plain_grads = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, attn_mask=allowed,
                                                                enable_gqa=group > 1, sinks=sinks)
    yield "plain", plain, plain_grads
    for tiles in ((None, None), (4, 5)):
        state = attnkit.flash_attention(q, k, v, enable_gqa=group > 1, sinks=sinks, return_lse=True,
                                        block_q=tiles[0], block_k=tiles[1], **kw)
        yield f"flash {tiles}", state.output, attnkit.flash_attention_backward(d_out, q, k, v, state.output, state)


@pytest.mark.parametrize("case", list(CASES))
def test_numpy_paths_match_the_float64_formula(torch, case):
    (q, k, v, sinks, d_out), kw, allowed = _inputs(case)
    (truth, truth_grads), _ = _truth_and_oracle(q, k, v, sinks, d_out, allowed)
    for name, out, grads in _numpy_paths(q, k, v, sinks, d_out, kw, allowed):
        assert type(grads).__name__ == "AttentionSinkGrads" and grads.grad_sinks.shape == sinks.shape
        assert_close(out, truth, 1e-10, f"{name} output")
        for label, ours, ref in zip(("query", "key", "value", "sinks"), grads, truth_grads):
            assert_close(ours, ref, 1e-10, f"{name} grad_{label}")


@pytest.mark.parametrize("case", list(CASES))
def test_numpy_paths_float32_within_the_eager_budget(torch, case):
    (q, k, v, sinks, d_out), kw, allowed = _inputs(case, np.float32, seed=1)
    (truth, truth_grads), (eager, eager_grads) = _truth_and_oracle(q, k, v, sinks, d_out, allowed)
    sizes = _natural_sizes(q, k, v, d_out)
    for name, out, grads in _numpy_paths(q, k, v, sinks, d_out, kw, allowed):
        assert out.dtype == np.float32 and all(g.dtype == np.float32 for g in grads)
        assert_within_budget(out, eager, truth, f"{name} output", scale=sizes[0])
        for label, ours, theirs, ref, size in zip(("query", "key", "value", "sinks"), grads, eager_grads,
                                                  truth_grads, sizes[1:]):
            assert_within_budget(ours, theirs, ref, f"{name} grad_{label}", factor=3.0, scale=size)


def test_a_row_with_no_key_gives_the_sink_alone():
    """Every key masked: the sink takes all the weight, output 0, lse = s_h, zero gradients."""
    (q, k, v, sinks, d_out), _, _ = _inputs("full, GQA")
    allowed = np.ones((q.shape[-2], k.shape[-2]), bool)
    allowed[3] = False
    res = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True, sinks=sinks,
                                               return_lse=True, return_weights=True)
    assert not res.output[..., 3, :].any() and not res.weights[..., 3, :].any()
    np.testing.assert_array_equal(res.lse[..., 3], np.broadcast_to(sinks, res.lse[..., 3].shape))
    # every other row's weights sum to 1 - the sink's weight exp(s_h - lse)
    np.testing.assert_allclose(res.weights.sum(-1), 1 - np.exp(sinks[:, None] - res.lse), atol=1e-12)
    state = attnkit.flash_attention(q, k, v, mask_mod=lambda b, h, i, j: i != 3, enable_gqa=True, sinks=sinks,
                                    return_lse=True)
    assert not state.output[..., 3, :].any()
    np.testing.assert_allclose(state.lse, res.lse, rtol=1e-12)
    grads = attnkit.flash_attention_backward(d_out, q, k, v, state.output, state)
    assert not grads.grad_query[..., 3, :].any()


def test_sinks_are_checked():
    (q, k, v, sinks, _), _, _ = _inputs("full, GQA")
    for fn in (attnkit.scaled_dot_product_attention, attnkit.flash_attention):
        with pytest.raises(ValueError, match=r"expected sinks of shape \(4,\), one logit per query head, got \(2,\)"):
            fn(q, k, v, enable_gqa=True, sinks=sinks[:2])
        with pytest.raises(TypeError, match="expected sinks as a real"):
            fn(q, k, v, enable_gqa=True, sinks=np.array(["a"] * 4))


@pytest.mark.parametrize("case", list(CASES))
def test_torch_flash_function_matches_the_formula_and_the_eager_budget(torch, case):
    from attnkit.torch import flash_attention

    for dtype, seed in ((torch.float64, 0), (torch.float32, 1)):
        (q, k, v, sinks, d_out), kw, allowed = _inputs(case, np.float32 if dtype == torch.float32 else np.float64, seed)
        (truth, truth_grads), (eager, eager_grads) = _truth_and_oracle(q, k, v, sinks, d_out, allowed)
        leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks)]
        for tiles in ((None, None), (4, 5)):
            for x in leaves:
                x.grad = None
            out = flash_attention(*leaves[:3], enable_gqa=leaves[0].shape[1] != leaves[1].shape[1], sinks=leaves[3],
                                  block_q=tiles[0], block_k=tiles[1], **kw)
            out.backward(torch.tensor(d_out))
            grads = [x.grad.numpy() for x in leaves]
            if dtype == torch.float64:
                assert_close(out.detach().numpy(), truth, 1e-10, f"{tiles} output")
                for label, ours, ref in zip(("query", "key", "value", "sinks"), grads, truth_grads):
                    assert_close(ours, ref, 1e-10, f"{tiles} grad_{label}")
                continue
            sizes = _natural_sizes(q, k, v, d_out)
            assert_within_budget(out.detach().numpy(), eager, truth, f"{tiles} output", scale=sizes[0])
            for label, ours, theirs, ref, size in zip(("query", "key", "value", "sinks"), grads, eager_grads,
                                                      truth_grads, sizes[1:]):
                assert_within_budget(ours, theirs, ref, f"{tiles} grad_{label}", factor=3.0, scale=size)


def _gpt_oss_module(seed: int = 0):
    """A tiny random gpt-oss attention layer (transformers' GptOssAttention)."""
    pytest.importorskip("transformers")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    torch.manual_seed(seed)
    config = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_hidden_layers=2, intermediate_size=32, num_local_experts=2, vocab_size=64)
    module = GptOssAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        module.sinks.normal_(0.0, 2.0)
    return module


@pytest.mark.parametrize("route", ["attnkit_tiled", "attnkit_flash"])
@pytest.mark.parametrize("window", [None, 4])
def test_transformers_routes_match_eager_gpt_oss(torch, route, window):
    """attnkit_tiled (a 4-D mask) and attnkit_flash (None, or its window as the flash
    keyword) against transformers' eager gpt-oss attention on the same module: output
    and the gradients of q, k, v and the module's sinks, in float64 (~1e-12) and within
    2x (3x) eager's float32 error of the float64 truth."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from attnkit.hf import attention as hf_attention

    module = _gpt_oss_module()
    rng = np.random.default_rng(3)
    B, L, E = 2, 11, 8
    base = [rng.standard_normal(s) for s in ((B, 4, L, E), (B, 2, L, E), (B, 2, L, E))]
    d_out = rng.standard_normal((B, L, 4, E))
    allowed = masks.causal_mask(L, L) if window is None else masks.sliding_window_mask(L, L, left=window, right=0)
    results = {}
    for dtype in (torch.float64, torch.float32):
        module.to(dtype)
        for name in ("eager", route):
            module.sinks.grad = None
            q, k, v = (torch.tensor(x, dtype=dtype, requires_grad=True) for x in base)
            if name == "eager":
                mask = torch.where(torch.tensor(allowed), 0.0, -math.inf).to(dtype)[None, None]
                out, _ = eager_attention_forward(module, q, k, v, mask, scaling=E ** -0.5)
            elif route == "attnkit_tiled":
                mask = torch.tensor(allowed)[None, None]
                out, _ = hf_attention.attnkit_tiled_attention(module, q, k, v, mask, E ** -0.5, s_aux=module.sinks)
            else:
                out, _ = hf_attention.attnkit_flash_attention(module, q, k, v, None, E ** -0.5, s_aux=module.sinks,
                                                              sliding_window=None if window is None else window + 1)
            out.backward(torch.tensor(d_out, dtype=dtype))
            results[name, dtype] = [out.detach().double().numpy()] + [
                x.grad.double().numpy() for x in (q, k, v, module.sinks)]
    labels = ("output", "grad_query", "grad_key", "grad_value", "grad_sinks")
    for label, ours, truth in zip(labels, results[route, torch.float64], results["eager", torch.float64]):
        assert_close(ours, truth, 1e-10, f"{route} float64 {label}")
    for label, ours, theirs, truth in zip(labels, results[route, torch.float32], results["eager", torch.float32],
                                          results["eager", torch.float64]):
        assert_within_budget(ours, theirs, truth, f"{route} float32 {label}", factor=2.0 if label == "output" else 3.0)
