"""A model and a text wherever a text makes sense: `rollout(model, text)`,
`attention_flow(model, text)`, `head_view("A", "B", model=...)`; and, where it does not,
an error that says what to pass (never "expected weights of shape ..., got ()")."""

from __future__ import annotations

import numpy as np
import pytest

from attnkit.interpret import attention_flow, rollout
from attnkit.models.gpt2 import GPT2Config, GPT2LMHeadModel
from attnkit.nn.interface import record_attention

IDS = np.array([5, 17, 3, 40, 8, 5, 17])


@pytest.fixture(scope="module")
def model():
    config = GPT2Config(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48,
                        max_position_embeddings=64)
    return GPT2LMHeadModel(config, seed=3).astype(np.float64)


def _weights(model, ids):
    with record_attention(model) as recording:
        model(ids)
    return np.stack([w[0] for w in recording.maps])  # (layers, heads, T, T)


@pytest.mark.parametrize("function", [rollout, attention_flow])
def test_a_model_and_ids_give_the_map_of_its_attention(model, function):
    weights = _weights(model, IDS)
    np.testing.assert_array_equal(function(model, IDS), function(weights))
    np.testing.assert_array_equal(function(model, IDS, 0.3), function(weights, 0.3))
    np.testing.assert_array_equal(function(model, IDS, residual=0.3), function(weights, residual=0.3))
    np.testing.assert_array_equal(function(weights, 0.3), function(weights, residual=0.3))  # the old call


def test_a_model_and_a_text_use_its_tokenizer(minilm_folder):
    from attnkit.models.sentence import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(minilm_folder)
    _, maps = encoder.attention("the cat sat")  # the model's own tokens, its maps (layers, heads, T, T)
    np.testing.assert_allclose(rollout(encoder, "the cat sat"), rollout(maps), rtol=1e-6)


@pytest.mark.parametrize("function", [rollout, attention_flow])
def test_what_to_pass_when_the_arguments_do_not_fit(model, function):
    name = function.__name__
    with pytest.raises(TypeError, match=rf"{name}\(model, \.\.\.\) needs the text or token ids"):
        function(model)
    with pytest.raises(TypeError, match=r"a model and a text"):
        function(_weights(model, IDS), "the cat")
    with pytest.raises(TypeError, match=r"pass both: rollout\(model, text\)"):
        function(object())


def test_head_view_takes_two_sentences_as_two_arguments():
    from attnkit.viz.notebook import head_view

    pair = head_view("the cat sat", "the dog sat", model="random")
    listed = head_view(["the cat sat", "the dog sat"], model="random")
    assert pair.html == listed.html
    with pytest.raises(TypeError, match=r"a text goes first, alone"):
        head_view(np.zeros((1, 1, 2, 2)), "the cat")
