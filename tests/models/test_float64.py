"""A float64 model is float64 throughout: the oracle behind the project's float32 tolerances.

- After `astype(np.float64)` (and a forward, so that lazily built tables exist), every array
  reachable from the model is float64 (rotary inv_freq and cos/sin tables stayed float32).
- Every family's float64 logits at 300 tokens equal a float64-throughout transcription of
  transformers' model on the same weights to 1e-11 relative. transformers' float64
  Llama-family models still round RMSNorm (`hidden_states.to(torch.float32)`) and the rotary
  angles (`position_ids.float() * inv_freq.float()`) to float32, so the transcription
  replaces those two forwards with the same formulas in float64 (and attends with "sdpa":
  the eager attention takes its softmax in float32).
- SmolLM2-135M's configuration (random weights) in float32 at 240 tokens is within 2x
  transformers' float32 error of that truth (the rotary tables rounded the angle to float32
  first: 2.3e-4 against a budget of 2.0e-4).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import assert_within_budget
from float64_oracle import float64_transcription

from attnkit.models import AutoCausalLM

VOCAB = 96
T = 300


def _settings(kind: str) -> dict:
    if kind == "gpt2":
        return dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=96, n_positions=320)
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=320, rope_theta=10000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=False)


def _hf_model(transformers, torch, kind: str, **settings):
    classes = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}
    config_name, model_name = classes[kind]
    config = getattr(transformers, config_name)(**settings)
    # sdpa: float64 stays float64 (the eager Llama attention takes its softmax in float32)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


def _logits(torch, model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)[None]).logits[0].numpy()


def _float_arrays(root):
    """(path, dtype) of every floating-point NumPy array reachable from `root`'s attributes."""
    seen, found, stack = set(), [], [("model", root)]
    while stack:
        path, value = stack.pop()
        if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(value))
        if isinstance(value, np.ndarray):
            if np.issubdtype(value.dtype, np.floating):
                found.append((path, value.dtype))
            continue
        if isinstance(value, dict):
            stack += [(f"{path}[{key!r}]", item) for key, item in value.items()]
        elif isinstance(value, (list, tuple)):
            stack += [(f"{path}[{i}]", item) for i, item in enumerate(value)]
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("attnkit"):
            stack += [(f"{path}.{key}", item) for key, item in vars(value).items()]
    return found


FAMILIES = ["gpt2", "llama", "qwen2", "mistral"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_float64_model_holds_no_float32_array(tmp_path, torch, transformers, kind):
    hf = _hf_model(transformers, torch, kind, **_settings(kind))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = AutoCausalLM.from_pretrained(tmp_path).astype(np.float64)
    ours(np.arange(T) % VOCAB)  # tables built on demand are built
    arrays = _float_arrays(ours)
    assert any("rotary" in path for path, _ in arrays) == (kind != "gpt2")
    stray = [(path, str(dtype)) for path, dtype in arrays if dtype != np.float64]
    assert not stray, f"float32 arrays in a float64 {kind} model: {stray}"
    if kind != "gpt2":  # and back: the tables follow
        ours.astype(np.float32)(np.arange(8))
        assert ours.rotary.cos_sin(np.arange(3))[0].dtype == np.float32


@pytest.mark.parametrize("kind", FAMILIES)
def test_float64_logits_equal_a_float64_transcription_of_transformers(tmp_path, torch, transformers, kind):
    hf = _hf_model(transformers, torch, kind, **_settings(kind))
    with torch.no_grad():  # weights and norms away from their init, so every term counts
        for p in hf.parameters():
            p.mul_(3.0)
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = AutoCausalLM.from_pretrained(tmp_path).astype(np.float64)
    ids = np.random.default_rng(1).integers(0, VOCAB, T)
    truth = _logits(torch, float64_transcription(hf), ids)
    mine = ours(ids)
    assert mine.dtype == np.float64
    error = float(np.max(np.abs(mine - truth)) / np.max(np.abs(truth)))
    print(f"{kind} float64 logits at {T} tokens: relative error {error:.2e}")
    assert error <= 1e-11
    # the transcription is what it claims: transformers' own float64 model is farther off
    # wherever it rounds in float32 (not GPT-2, which never does)
    theirs = _logits(torch, copy.deepcopy(hf).double(), ids)
    if kind != "gpt2":
        assert float(np.max(np.abs(theirs - truth)) / np.max(np.abs(truth))) > 1e-9


SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, initializer_range=0.041666666666666664,
)


@pytest.mark.slow
def test_smollm2_configuration_float32_is_within_budget_at_240_tokens(tmp_path, torch, transformers):
    hf = _hf_model(transformers, torch, "llama", **SMOLLM2_135M)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = AutoCausalLM.from_pretrained(tmp_path)
    ids = np.random.default_rng(2).integers(0, SMOLLM2_135M["vocab_size"], 240)
    truth = _logits(torch, float64_transcription(hf), ids)
    theirs = _logits(torch, hf, ids)
    mine = ours(ids)
    assert mine.dtype == np.float32
    assert_within_budget(mine, theirs, truth, what="SmolLM2-135M configuration, float32 logits at 240 tokens")


def test_float32_rotary_tables_are_the_exact_angles_rounded_once():
    """cos and sin of position * theta_i computed in float64, rounded once to float32: within
    half a float32 ulp at every position (the angle rounded to float32 first is off by up to
    half an ulp of 8191 rad, 2.4e-4)."""
    from attnkit.nn import RotaryEmbedding

    rotary = RotaryEmbedding(64, base=100000.0)
    positions = np.arange(8192)
    cos, sin = rotary.cos_sin(positions)
    assert cos.dtype == sin.dtype == np.float32
    angles = positions[:, None] * 100000.0 ** (-np.arange(0, 64, 2) / 64)  # (P, E/2) float64
    for got, exact in ((cos, np.cos(angles)), (sin, np.sin(angles))):
        half_ulp = 0.5 * np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(got[:, :32] - exact) <= half_ulp * (1 + 1e-6) + 1e-15)
        np.testing.assert_array_equal(got[:, :32], got[:, 32:])
    assert rotary.at(8191)[0].dtype == np.float32
    np.testing.assert_array_equal(rotary.at(8191)[0], cos[8191])
