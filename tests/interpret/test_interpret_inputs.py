"""attnkit.interpret refuses what the model refuses, with the model's message.

Every public function that runs a model on ids is tried past the context (GPT-2 with 32
learned positions given 33 tokens: the old code raised a raw IndexError; a Llama with 64
positions given 65 tokens: the old code computed past the context without a word), and
head indices and metrics that are not what they must be are refused by name.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from attnkit.interpret import (
    ablate,
    detect_heads,
    direct_logit_attribution,
    induction_scores,
    logit_lens,
    patch_heads,
    patch_residual,
    query_key_contributions,
    sink_scores,
    value_weighted,
)
from attnkit.models.gpt2 import GPT2Config, GPT2LMHeadModel
from attnkit.models.llama import LlamaConfig, LlamaForCausalLM


def _gpt2():
    config = GPT2Config(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48,
                        max_position_embeddings=32)
    return GPT2LMHeadModel(config, seed=3)


def _llama():
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(config, seed=3)


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _metric(logits):
    return float(logits[-1, 40] - logits[-1, 22])


def _mean_ablation(model, ids):
    with ablate(model, [(0, 1)], "mean", reference=[ids]):
        pass


# every public function of attnkit.interpret that takes a model and ids
CALLS = {
    "detect_heads": lambda model, ids: detect_heads(model, ids, "previous_token"),
    "sink_scores": lambda model, ids: sink_scores(model, ids),
    "ablate(mean, reference)": _mean_ablation,
    "patch_heads": lambda model, ids: patch_heads(model, ids, ids, _metric),
    "patch_residual": lambda model, ids: patch_residual(model, ids, ids, _metric),
    "logit_lens": lambda model, ids: logit_lens(model, ids),
    "direct_logit_attribution": lambda model, ids: direct_logit_attribution(model, ids, 40, 22),
    "value_weighted": lambda model, ids: value_weighted(model, ids),
    "query_key_contributions": lambda model, ids: query_key_contributions(model, ids, 0, 1, len(ids) - 1, 0),
}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("name", CALLS)
def test_every_function_refuses_what_the_model_refuses(kind, name):
    model = MODELS[kind]()
    ids = np.arange(model.context_length + 1) % 61
    with pytest.raises(ValueError) as refused:
        model(ids)
    message = str(refused.value)
    assert "context" in message
    with pytest.raises(ValueError, match=re.escape(message)):
        CALLS[name](model, ids)
    CALLS[name](model, ids[:-1])  # the whole context is accepted


@pytest.mark.parametrize("kind", MODELS)
def test_induction_scores_refuse_a_length_past_the_context(kind):
    model = MODELS[kind]()
    with pytest.raises(ValueError, match="context of"):
        induction_scores(model, length=model.context_length // 2 + 1)


@pytest.mark.parametrize("heads, error, match", [
    ([(0, 1.5)], TypeError, "head .* as an int, got float 1.5"),
    ([(0.0, 1)], TypeError, "layer .* as an int, got float"),
    ([(0, True)], TypeError, "head .* as an int, got bool"),
    ([(np.bool_(False), 1)], TypeError, "layer .* as an int, got bool"),
    ([(0, "1")], TypeError, "head .* as an int, got str"),
    ([(0, 4)], ValueError, "head in \\[0, 4\\) of layer 0, got 4"),
    ([(0, -1)], ValueError, "head in \\[0, 4\\)"),
    ([(2, 0)], ValueError, "layer in \\[0, 2\\)"),
    ([(0, 1, 2)], ValueError, "\\(layer, head\\) pairs"),
    ([3], ValueError, "\\(layer, head\\) pairs"),
])
def test_ablate_refuses_head_indices_that_are_not_in_range_integers(heads, error, match):
    model = _gpt2()
    with pytest.raises(error, match=match):
        with ablate(model, heads):
            pass


def test_ablate_takes_numpy_integers():
    model = _gpt2()
    ids = np.arange(8)
    with ablate(model, [(np.int64(1), np.int32(3))]):
        ablated = model(ids)
    assert not np.array_equal(ablated, model(ids))


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("patch", [patch_heads, patch_residual])
def test_patching_says_the_metric_must_return_a_scalar(kind, patch):
    model = MODELS[kind]()
    ids = np.arange(6)
    with pytest.raises(TypeError, match=r"metric to return a scalar .* got ndarray of shape \(61,\)"):
        patch(model, ids, ids, lambda logits: logits[-1])
    with pytest.raises(TypeError, match=r"metric to return a scalar .* got 'high'"):
        patch(model, ids, ids, lambda logits: "high")
    # a 0-d array or a NumPy scalar is one number
    assert np.isfinite(patch(model, ids, ids, lambda logits: np.asarray(logits[-1, 3]))).all()
