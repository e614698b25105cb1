"""attnkit.interpret on transformers models loaded with attn_implementation="attnkit".

The random GPT-2 and Llama (grouped-query attention) folders of test_interpret_tl.py, and a
random Qwen2 built the same way, are loaded three ways: by transformers in float32 with
attnkit's attention (what is tested), by transformers in float64 (the truth), and by
attnkit itself in float32 (NumPy: the outside implementation whose float32 error sets the
budget, already checked against TransformerLens).
The transformers model's results must be as close to the float64 truth as twice attnkit
NumPy's, plus a few float32 ulps (conftest.assert_within_budget).

(transformers' Llama RMSNorm computes in float32 even in a float64 model: the truth carries
that rounding, ~1e-8 relative, far below the float32 errors compared.)

Zero ablation also has a truth that shares no code with the edits: the same float64 model,
loaded with transformers' eager attention, with the ablated heads' columns of the output
projection set to 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_within_budget, require
from test_interpret_tl import CORRUPT, TEXT, VOCAB, _logit_diff, _spread, folders  # noqa: F401  (a fixture)

HEADS = [(0, 1), (1, 3), (2, 0)]


def _load(folder, dtype, implementation="attnkit"):
    torch = require("torch")
    transformers = require("transformers")
    import attnkit.hf

    attnkit.hf.register()
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=implementation, dtype=getattr(torch, dtype)).eval()


def _ids(text):
    return np.array([VOCAB - 1] + [int(word[1:]) for word in text.split()], np.int64)  # BOS first


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    """A random Qwen2 (query/key/value biases, grouped-query attention), as the other two."""
    torch = require("torch")
    transformers = require("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)).eval()
    _spread(model, torch)
    folder = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2"])
def case(request, folders, qwen2_folder):  # noqa: F811
    """(name, folder, transformers float32 with attnkit's attention, float64 truth, attnkit's own model)."""
    from attnkit.models import AutoCausalLM

    folder = qwen2_folder if request.param == "qwen2" else folders[request.param]
    return (request.param, folder, _load(folder, "float32"), _load(folder, "float64"),
            AutoCausalLM.from_pretrained(folder))


def _logits(model, ids):
    torch = require("torch")
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids)[None]).logits[0].double().numpy()


def _zeroed_output_projection(model, name, heads):
    """The float64 eager model with each ablated head's output-projection columns set to 0."""
    torch = require("torch")
    with torch.no_grad():
        for layer, head in heads:
            if name == "gpt2":
                attn = model.transformer.h[layer].attn
                E = attn.head_dim
                attn.c_proj.weight[head * E:(head + 1) * E, :] = 0  # Conv1D: (in, out)
            else:
                attn = model.model.layers[layer].self_attn
                E = attn.head_dim
                attn.o_proj.weight[:, head * E:(head + 1) * E] = 0  # Linear: (out, in)
    return model


def test_zero_ablation_matches_zeroed_output_projection(case):
    from attnkit.interpret import ablate

    name, folder, hf32, hf64, ours = case
    ids = _ids(TEXT)
    truth = _logits(_zeroed_output_projection(_load(folder, "float64", "eager"), name, HEADS), ids)
    with ablate(hf32, HEADS):
        ablated = _logits(hf32, ids)
    with ablate(ours, HEADS):
        reference = ours(ids)
    assert np.abs(truth - _logits(hf64, ids)).max() > 1e-3  # the ablation changes the logits
    assert_within_budget(ablated, reference, truth, f"{name} zero ablation")
    np.testing.assert_array_equal(_logits(hf32, ids), _logits(hf32, ids))  # closed: nothing left behind


@pytest.mark.parametrize("implementation", ["attnkit_tiled", "attnkit_flash"])
def test_ablation_in_the_tiled_implementations(case, implementation):
    from attnkit.interpret import ablate

    name, folder, _, hf64, ours = case
    ids = _ids(TEXT)
    model = _load(folder, "float32", implementation)
    with ablate(hf64, HEADS, how="mean", reference=[_ids(CORRUPT), _ids(TEXT)]):
        truth = _logits(hf64, ids)
    with ablate(model, HEADS, how="mean", reference=[_ids(CORRUPT), _ids(TEXT)]):
        ablated = _logits(model, ids)
    with ablate(ours, HEADS, how="mean", reference=[_ids(CORRUPT), _ids(TEXT)]):
        reference = ours(ids)
    assert np.abs(truth - _logits(hf64, ids)).max() > 1e-3  # the ablation changes the logits
    assert_within_budget(ablated, reference, truth, f"{name} mean ablation through {implementation}")


def test_patch_heads_matches(case):
    from attnkit.interpret import patch_heads

    name, _, hf32, hf64, ours = case
    clean, corrupt = _ids(TEXT), _ids(CORRUPT)
    metric, _ = _logit_diff(int(clean[4]), int(clean[6]))
    result = patch_heads(hf32, clean, corrupt, metric)
    truth = patch_heads(hf64, clean, corrupt, metric)
    reference = patch_heads(ours, clean, corrupt, metric)
    assert result.shape == truth.shape == (3, 4)
    assert np.ptp(truth) > 0  # the heads differ: the check has something to see
    scale = float(np.abs(_logits(hf64, corrupt)).max())  # a logit difference rounds at the logits' size
    assert_within_budget(result, reference, truth, f"{name} head patching", scale=scale)


def test_patch_residual_matches(case):
    from attnkit.interpret import patch_residual

    name, _, hf32, hf64, ours = case
    clean, corrupt = _ids(TEXT), _ids(CORRUPT)
    metric, _ = _logit_diff(int(clean[4]), int(clean[6]))
    result = patch_residual(hf32, clean, corrupt, metric)
    truth = patch_residual(hf64, clean, corrupt, metric)
    reference = patch_residual(ours, clean, corrupt, metric)
    assert result.shape == truth.shape == (3, len(clean))
    assert np.ptp(truth) > 0
    scale = float(np.abs(_logits(hf64, corrupt)).max())
    assert_within_budget(result, reference, truth, f"{name} residual patching", scale=scale)


def test_logit_lens_matches(case):
    from attnkit.interpret import logit_lens

    name, _, hf32, hf64, ours = case
    ids = _ids(TEXT)
    result, truth, reference = logit_lens(hf32, ids), logit_lens(hf64, ids), logit_lens(ours, ids)
    assert result.shape == truth.shape == (4, len(ids), VOCAB)
    assert_within_budget(result, reference, truth, f"{name} logit lens")
    np.testing.assert_allclose(truth[-1], _logits(hf64, ids), rtol=0, atol=1e-12)  # the last entry: the logits


def test_other_implementations_are_refused(folders):  # noqa: F811
    from attnkit.interpret import ablate, patch_heads

    model = _load(folders["llama"], "float32", "eager")
    with pytest.raises(ValueError, match="attn_implementation='attnkit'"):
        with ablate(model, [(0, 0)]):
            pass
    with pytest.raises(ValueError, match="attn_implementation='attnkit'"):
        patch_heads(model, _ids(TEXT), _ids(CORRUPT), lambda logits: logits[-1, 0])


def test_heads_are_checked(case):
    from attnkit.interpret import ablate

    _, _, hf32, _, _ = case
    with pytest.raises(ValueError, match=r"expected a head in \[0, 4\)"):
        with ablate(hf32, [(0, 4)]):
            pass


def test_direct_logit_attribution_matches(case):
    from attnkit.interpret import direct_logit_attribution

    name, _, hf32, hf64, ours = case
    ids = _ids(TEXT)
    answer, wrong = int(ids[4]), int(ids[6])
    result = direct_logit_attribution(hf32, ids, answer, wrong)
    truth = direct_logit_attribution(hf64, ids, answer, wrong)
    reference = direct_logit_attribution(ours, ids, answer, wrong)
    assert result.heads.shape == truth.heads.shape == (3, 4)
    assert np.ptp(truth.heads) > 0
    for part in ("heads", "mlps", "embeddings", "biases", "total"):
        assert_within_budget(getattr(result, part), getattr(reference, part), getattr(truth, part),
                             f"{name} direct logit attribution: {part}", scale=float(np.abs(truth.heads).max()))
    logits = _logits(hf64, ids)
    # the parts sum to the model's logit difference; transformers' Llama RMSNorm computes in
    # float32 even in a float64 model, so the model's own logits carry float32 rounding there
    np.testing.assert_allclose(truth.total, logits[-1, answer] - logits[-1, wrong], rtol=1e-6)


def test_generation_runs_ablated(case):
    """`generate` (one query per step against the cache) under `ablate` gives the tokens that
    greedy decoding over ablated full forwards gives."""
    torch = require("torch")
    from attnkit.interpret import ablate

    name, _, hf32, _, _ = case
    ids = _ids(TEXT)
    with ablate(hf32, HEADS):
        with torch.no_grad():
            generated = hf32.generate(torch.as_tensor(ids)[None], max_new_tokens=6, do_sample=False,
                                      pad_token_id=VOCAB - 1)[0, len(ids):].numpy()
        expected = list(ids)
        for _ in range(6):
            expected.append(int(np.argmax(_logits(hf32, np.array(expected))[-1])))
    np.testing.assert_array_equal(generated, expected[len(ids):])
