"""`attnkit.interpret.head_importance`: the batched sweep against the plain route (ablate one
head, run the whole model, take the loss), in float64, with one group and with many."""

from __future__ import annotations

import numpy as np
import pytest

from attnkit.interpret import ablate, head_importance
from attnkit.interpret import importance as importance_module
from attnkit.models.gpt2 import GPT2Config, GPT2LMHeadModel
from attnkit.models.llama import LlamaConfig, LlamaForCausalLM

IDS = np.array([5, 17, 3, 40, 8, 5, 17, 3, 40, 22, 9, 1])


def _sharpen(model):
    rng = np.random.default_rng(7)
    state = {}
    for name, value in model.state_dict().items():
        if value.ndim == 1:
            value = (1.0 if name.endswith("norm.weight") else 0.0) + 0.3 * rng.standard_normal(value.shape)
        state[name] = value
    model.load_state_dict(state)
    return model


def _gpt2():
    config = GPT2Config(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48,
                        max_position_embeddings=64)
    return _sharpen(GPT2LMHeadModel(config, seed=3)).astype(np.float64)


def _llama():
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    return _sharpen(LlamaForCausalLM(config, seed=3)).astype(np.float64)


def _loss(model, ids) -> float:
    """The plain float64 mean next-token cross-entropy of one forward."""
    logits = model.forward(ids).astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())


@pytest.mark.parametrize("rows", [10_000, 4 * len(IDS), 1])  # one group; one layer a group; the same, at least 1
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_the_sweep_equals_one_ablated_forward_per_head(build, rows, monkeypatch):
    monkeypatch.setattr(importance_module, "TOKEN_ROWS", rows)
    model = build()
    seen = []
    result = head_importance(model, IDS, progress=seen.append)
    assert result.ablated.shape == (3, 4) and result.ablated.dtype == np.float64
    assert result.loss == pytest.approx(_loss(model, IDS), rel=1e-12)
    for layer in range(3):
        for head in range(4):
            with ablate(model, [(layer, head)]):
                expected = _loss(model, IDS)
            assert result.ablated[layer, head] == pytest.approx(expected, rel=1e-11), (layer, head)
    np.testing.assert_array_equal(result.increase, result.ablated - result.loss)
    assert np.ptp(result.ablated) > 1e-3  # heads differ: the comparison can fail
    assert sum(seen) == 12 and all(n > 0 for n in seen)


def test_float32_losses_stay_within_float32_rounding_of_the_float64_truth():
    """float32 exponentials summed in float64: as close to the float64 truth as the float32
    logits themselves allow."""
    truth = _gpt2()
    model = truth.astype(np.float32)
    got = head_importance(model, IDS).ablated
    expected = head_importance(truth, IDS).ablated
    # the float32 logits' own error, as a loss: one forward's loss in float32 against float64
    own = abs(_loss(model, IDS) - _loss(truth, IDS))
    assert np.max(np.abs(got - expected)) <= 2 * max(own, 1e-6) + 1e-6


def test_text_input_and_what_it_refuses(minilm_folder):
    from attnkit.models.bert import SentenceEncoder

    model = _gpt2()
    with pytest.raises(ValueError, match="at least 2 tokens"):
        head_importance(model, IDS[:1])
    with pytest.raises(TypeError, match="decoder"):
        head_importance(SentenceEncoder.from_pretrained(minilm_folder), "a cat")
