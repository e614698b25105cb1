"""The decoder's building blocks against transformers' Llama modules and plain float64 math."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import F32_EPS, assert_within_budget

from attnkit.nn import CausalSelfAttention, Embedding, KVCache, RMSNorm, RotaryEmbedding, SwiGLU
from attnkit.nn.decoder_layers import silu


def test_rms_norm_matches_transformers(torch, transformers):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 7, 40)) * 5).astype(np.float32)
    weight = rng.standard_normal(40).astype(np.float32)
    ref = LlamaRMSNorm(40, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(weight))
        expected = ref(torch.from_numpy(x)).numpy()
    ours = RMSNorm(40, eps=1e-5)
    ours.weight = weight
    x64 = x.astype(np.float64)
    plain = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * weight  # the float64 truth
    assert_within_budget(ours(x), expected, plain, what="RMSNorm float32")
    np.testing.assert_allclose(ours.astype(np.float64)(x64), plain, atol=1e-12)
    # one vector (a decode step's) takes a shorter path: the same budget, row by row, and the
    # float64 residual stream a Llama block feeds it, rounded into float32
    for row in x.reshape(-1, 1, 1, 40)[:6]:
        with torch.no_grad():
            one = ref(torch.from_numpy(row)).numpy()
        truth = row.astype(np.float64) / np.sqrt((row.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * weight
        assert_within_budget(ours(row), one, truth, what="RMSNorm float32, one vector")
        got = ours(row.astype(np.float64), np.float32)
        assert got.dtype == np.float32 and got.shape == (1, 1, 40)
        np.testing.assert_allclose(got, truth, rtol=F32_EPS, atol=F32_EPS * np.abs(truth).max())
    assert ours(np.zeros((1, 40), np.float32)).tolist() == [[0.0] * 40]  # eps keeps zeros finite
    # without eps a zero vector is 0 / 0 on both paths, as in torch: no Python ZeroDivisionError
    no_eps = RMSNorm(40, eps=0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        np.testing.assert_array_equal(no_eps(np.zeros((1, 40))), no_eps(np.zeros((2, 40)))[:1])


def _rotate_float64(x, positions, head_dim, base):
    """Rotary embedding as the math says, in float64: pair (i, i + E/2) turned by p * base^(-2i/E)."""
    angles = positions[..., None] * base ** (-np.arange(0, head_dim, 2) / head_dim)  # (B, T, E/2)
    cos, sin = np.cos(angles), np.sin(angles)
    x = np.asarray(x, np.float64)
    first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    rotated = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated, np.concatenate([cos, cos], axis=-1)


def test_rotary_matches_transformers_and_is_relative(torch, transformers):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=100000.0)
    ref = LlamaRotaryEmbedding(config)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 11, 16)).astype(np.float32)
    k = rng.standard_normal((2, 4, 11, 16)).astype(np.float32)
    positions = np.stack([np.arange(11), np.arange(5, 16)])  # (B, T)
    cos_t, sin_t = ref(torch.from_numpy(q), torch.from_numpy(positions))
    q_ref, k_ref = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos_t, sin_t)
    rotary = RotaryEmbedding(16, base=100000.0)
    cos, sin = rotary.cos_sin(positions)
    q_true, cos_true = _rotate_float64(q, positions[:, None], 16, 100000.0)
    k_true, _ = _rotate_float64(k, positions[:, None], 16, 100000.0)
    assert_within_budget(cos, cos_t.numpy(), cos_true[:, 0], what="rotary cos")
    q_ours = RotaryEmbedding.apply(q, cos[:, None], sin[:, None])
    assert_within_budget(q_ours, q_ref.numpy(), q_true, what="rotated query")
    k_ours = RotaryEmbedding.apply(k, cos[:, None], sin[:, None])
    assert_within_budget(k_ours, k_ref.numpy(), k_true, what="rotated key")
    # the score of a rotated query and key depends only on their distance
    a, b = rng.standard_normal(16), rng.standard_normal(16)

    def score(m, n):
        cm, sm = rotary.cos_sin(np.array([m]))
        cn, sn = rotary.cos_sin(np.array([n]))
        return RotaryEmbedding.apply(a, cm[0], sm[0]) @ RotaryEmbedding.apply(b, cn[0], sn[0])

    # Each of the 4 angles (at most 40 rad) is rounded to float32 (half an ulp of 40 = 1.9e-6)
    # and so are its cos and sin (eps): the score moves by at most |a||b| times their sum.
    bound = np.linalg.norm(a) * np.linalg.norm(b) * 4 * (0.5 * float(np.spacing(np.float32(40))) + F32_EPS)
    assert score(3, 1) == pytest.approx(score(40, 38), abs=bound)
    with pytest.raises(ValueError, match="even head_dim"):
        RotaryEmbedding(15)


def test_swiglu_matches_transformers_mlp(torch, transformers):
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = transformers.LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4)
    torch.manual_seed(0)
    ref = LlamaMLP(config)
    ours = SwiGLU(24, 40)
    ours.load_state_dict({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    x = np.random.default_rng(2).standard_normal((3, 5, 24)).astype(np.float32)
    with torch.no_grad():
        expected = ref(torch.from_numpy(x)).numpy()
        truth = copy.deepcopy(ref).double()(torch.from_numpy(x.astype(np.float64))).numpy()
    assert_within_budget(ours(x), expected, truth, what="SwiGLU float32")
    # replacing a weight rebuilds the fused copy
    ours.up_proj.weight = np.zeros((40, 24), np.float32)
    np.testing.assert_array_equal(ours(x), 0)


def test_silu_is_stable_and_exact():
    x = np.array([-1000.0, -20.0, -1.0, 0.0, 1.0, 20.0, 1000.0])
    expected = x / (1 + np.exp(-np.clip(x, -700, 700)))
    np.testing.assert_allclose(silu(x), expected, rtol=1e-12, atol=1e-30)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        silu(np.array([-1e4, 1e4], np.float32))


def test_embedding_checks_ids():
    table = Embedding(10, 4, seed=0)
    np.testing.assert_array_equal(table(np.array([[1, 2]])), table.weight[[[1, 2]]])
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        table(np.array([10]))
    with pytest.raises(TypeError, match="integer"):
        table(np.array([1.0]))


def test_causal_self_attention_matches_explicit_math():
    rng = np.random.default_rng(3)
    attn = CausalSelfAttention(32, 4, 2, bias=True, seed=0).astype(np.float64)
    x = rng.standard_normal((2, 6, 32))
    out = attn(x, KVCache(1, 2, 2, 8, 6, dtype=np.float64), 0)
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).reshape(2, 6, 4, 8).transpose(0, 2, 1, 3)
    k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).reshape(2, 6, 2, 8).transpose(0, 2, 1, 3)
    v = (x @ attn.v_proj.weight.T + attn.v_proj.bias).reshape(2, 6, 2, 8).transpose(0, 2, 1, 3)
    k, v = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)  # query head h uses kv head h // 2
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(8)
    scores = np.where(np.tril(np.ones((6, 6), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = (weights @ v).transpose(0, 2, 1, 3).reshape(2, 6, 32) @ attn.out_proj.weight.T + attn.out_proj.bias
    np.testing.assert_allclose(out, expected, atol=1e-12)
