"""Rollout, flow and value-weighted maps on the served page's API (`/api/attention` with
`kind`): the served maps are the ones `attnkit.viz.derived.derive` gives on the same text,
rollout also checked against a float64 transcription of Abnar & Zuidema's equations, flow
refused above the server's size limit, value-weighted maps computed on the model the page
already loaded."""

from __future__ import annotations

import numpy as np
import pytest

from attnkit.viz.derived import DESCRIPTIONS, KINDS, derive
from attnkit.viz.html import decode_weights, encode_weights
from attnkit.viz.providers import get_provider

TEXT = "the cat sat on the mat because it was tired"
CODE_STEP = 1 / 510 + 1e-6
"""The page's weights are 8-bit codes of sqrt(w): sqrt(w) comes back within half a code step."""


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from attnkit.serve.server import create_app

    return TestClient(create_app(models=["random", "minilm"], max_chars=400, max_tokens=64, max_flow_problems=500))


def served(client, text: str, model: str, kind: str, **fields) -> dict:
    r = client.post("/api/attention", json={"text": text, "model": model, "kind": kind, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def weights_of(answer: dict) -> np.ndarray:
    doc = answer["docs"][0]
    T = len(doc["tokens"])
    return decode_weights(doc["weights"], (doc["layers"], doc["heads"], T, T))


def assert_same_map(answer: dict, expected) -> None:
    """The served map is `expected` (AttentionMaps) up to the page's 8-bit encoding."""
    doc = answer["docs"][0]
    assert doc["tokens"] == list(expected.tokens) and doc["model"] == expected.model
    shown = weights_of(answer)
    assert shown.shape == expected.weights.shape
    # the server encodes the very array derive() gives: the codes are equal
    np.testing.assert_array_equal(shown, decode_weights(encode_weights(expected.weights), expected.weights.shape))
    err = np.max(np.abs(np.sqrt(shown) - np.sqrt(expected.weights.astype(np.float64))))
    assert err <= CODE_STEP, f"sqrt of the served map off by {err:.2e} > half a code step {CODE_STEP:.2e}"


def rollout_float64(weights: np.ndarray, residual: float = 0.5) -> np.ndarray:
    """Abnar & Zuidema's rollout, as plainly as the paper writes it: A_l = r I + (1 - r) mean_h W_l,
    rows renormalised, R_0 = A_0, R_l = A_l R_(l-1)."""
    w = np.asarray(weights, dtype=np.float64)
    T = w.shape[-1]
    out, product = [], np.eye(T)
    for layer in w:
        a = residual * np.eye(T) + (1 - residual) * layer.mean(axis=0)
        a = a / a.sum(axis=-1, keepdims=True)
        product = a @ product
        out.append(product)
    return np.stack(out)


def test_the_page_offers_every_kind_with_its_description(client):
    page = client.get("/").text
    for kind in KINDS:
        assert f'"name":"{kind}"' in page
    for description in DESCRIPTIONS.values():
        assert description in page
    assert "kind: map.value" in page  # the page posts the chosen map


@pytest.mark.parametrize("kind", ["rollout", "flow"])
def test_rollout_and_flow_served_as_derive_gives_them(client, kind):
    answer = served(client, TEXT, "random", kind, head=3, layer=1)
    attention = get_provider("random", max_tokens=64).attention(TEXT)
    expected = derive(attention, kind)
    assert_same_map(answer, expected)
    assert answer["kind"] == kind and answer["description"] == DESCRIPTIONS[kind]
    assert answer["docs"][0]["heads"] == 1 and answer["head"] == 0 and answer["layer"] == 1  # one map per layer
    if kind == "rollout":  # and against the paper's equations in float64, from the same attention
        truth = rollout_float64(attention.weights)
        shown = weights_of(answer)[:, 0]
        err = np.max(np.abs(np.sqrt(shown) - np.sqrt(truth)))
        assert err <= CODE_STEP + 1e-6, f"rollout off the float64 equations by {err:.2e}"


def test_attention_is_the_default_kind_and_unchanged(client):
    plain = client.post("/api/attention", json={"text": TEXT, "model": "random"}).json()
    named = served(client, TEXT, "random", "attention")
    assert plain == named and plain["kind"] == "attention" and plain["description"] == ""
    assert_same_map(plain, get_provider("random", max_tokens=64).attention(TEXT))


def test_an_unknown_kind_is_refused_with_the_kinds_there_are(client):
    for kind in ("Rollout", "", "heads"):
        r = client.post("/api/attention", json={"text": TEXT, "model": "random", "kind": kind})
        assert r.status_code == 422, r.text
        assert r.json()["detail"] == f"expected kind to be one of {', '.join(KINDS)}, got {kind!r}"
    r = client.post("/api/attention", json={"text": TEXT, "model": "random", "kind": 3})
    assert r.status_code == 422 and "kind: Input should be a valid string" in r.json()["detail"]


def test_flow_above_the_size_limit_is_refused_and_rollout_still_answers(client):
    # random: 2 layers; 16 tokens make 2 x 16^2 = 512 max-flow problems, over this server's 500
    text = " ".join(f"w{i}" for i in range(16))
    r = client.post("/api/attention", json={"text": text, "model": "random", "kind": "flow"})
    assert r.status_code == 413, r.text
    detail = r.json()["detail"]
    assert "16 tokens and 2 layers solves 512 maximum-flow problems" in detail
    assert "at most 500" in detail and "rollout" in detail and "shorter text" in detail
    assert served(client, text, "random", "rollout")["kind"] == "rollout"
    fits = " ".join(f"w{i}" for i in range(15))  # 2 x 15^2 = 450
    assert served(client, fits, "random", "flow")["docs"][0]["heads"] == 1


def test_value_weighted_needs_a_model_with_weights_to_read(client):
    r = client.post("/api/attention", json={"text": TEXT, "model": "random", "kind": "value-weighted"})
    assert r.status_code == 422
    assert "random is not one: choose another map or model" in r.json()["detail"]


def test_the_server_refuses_a_flow_limit_below_one():
    from attnkit.serve.server import create_app

    with pytest.raises(ValueError, match="max_flow_problems >= 1, got 64, 512, 1024 and 0"):
        create_app(models=["random"], max_chars=64, max_flow_problems=0)


def test_value_weighted_served_on_the_loaded_minilm(client, minilm_folder, monkeypatch):
    from attnkit.models.bert import SentenceEncoder
    from attnkit.viz import derived

    provider = get_provider("minilm", max_tokens=64)
    assert isinstance(provider.model, SentenceEncoder)
    assert get_provider("minilm", max_tokens=8).model is provider.model  # one copy per process

    def no_second_copy(name):
        raise AssertionError(f"the server loaded a second copy of {name}")

    monkeypatch.setattr(derived, "load_model", no_second_copy)
    answer = served(client, TEXT, "minilm", "value-weighted", head=5, layer=2)
    monkeypatch.undo()
    expected = derive(provider.attention(TEXT), "value-weighted", model=provider.model)
    assert_same_map(answer, expected)
    assert answer["docs"][0]["tokens"][0] == "[CLS]" and answer["docs"][0]["heads"] == 12
    assert (answer["layer"], answer["head"]) == (2, 5)
    # the model's name (as the command line and notebooks pass it) gives the same map, on the same copy
    by_name = derive(provider.attention(TEXT), "value-weighted", model="minilm")
    np.testing.assert_array_equal(by_name.weights, expected.weights)
    assert derived.load_model("minilm") is provider.model


def test_value_weighted_of_a_truncated_text_keeps_the_tokens_shown(minilm_folder):
    from fastapi.testclient import TestClient

    from attnkit.serve.server import create_app

    client = TestClient(create_app(models=["minilm"], max_chars=400, max_tokens=7))
    answer = served(client, TEXT, "minilm", "value-weighted")
    doc = answer["docs"][0]
    assert len(doc["tokens"]) == 7 and doc["tokens"][-1] == "[SEP]"
    assert answer["warnings"] and "truncated to 7 tokens" in answer["warnings"][0]
    provider = get_provider("minilm", max_tokens=7)
    assert_same_map(answer, derive(provider.attention(TEXT), "value-weighted", model=provider.model))
    rows = weights_of(answer).astype(np.float64).sum(axis=-1)
    np.testing.assert_allclose(rows, 1.0, atol=0.05)  # each row divided by its sum (8-bit codes)


@pytest.mark.slow
def test_value_weighted_served_on_the_loaded_smollm2(smollm2_file, monkeypatch):
    from fastapi.testclient import TestClient

    from attnkit.models.causal_lm import CausalLM
    from attnkit.viz import derived
    from attnkit.serve.server import create_app

    client = TestClient(create_app(models=["smollm2"], max_chars=400, max_tokens=12))
    provider = get_provider("smollm2", max_tokens=12)
    assert isinstance(provider.model, CausalLM)
    monkeypatch.setattr(derived, "load_model", lambda name: pytest.fail(f"loaded a second copy of {name}"))
    answer = served(client, TEXT, "smollm2", "value-weighted")
    monkeypatch.undo()
    expected = derive(provider.attention(TEXT), "value-weighted", model=provider.model)
    assert_same_map(answer, expected)
    shown = weights_of(answer)
    assert shown.shape[:2] == (30, 9) and np.all(np.triu(shown, k=1) == 0)  # causal: no weight on later keys
