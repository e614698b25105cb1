"""Attention rollout and flow (Abnar & Zuidema 2020) against the paper's equations in
float64, written as plainly as they read, and against networkx's maximum flow on the same
graph; the inputs users pass (transformers' tuples, recordings), the edge cases, the errors."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_within_budget, require
from attnkit.interpret.flow import attention_flow, residual_attention, rollout


def random_maps(rng, layers, heads, T, causal=False, sharp=3.0, dtype=np.float64):
    """Attention-like maps: rows of a softmax over random scores (peaked by `sharp`)."""
    scores = rng.normal(size=(layers, heads, T, T)) * sharp
    if causal:
        scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)).astype(dtype)


def paper_rollout(weights, residual=0.5):
    """The paper's equations, one layer and one entry at a time, in float64:
    A = residual I + (1 - residual) mean_h W, rows renormalised; R_0 = A_0, R_l = A_l R_{l-1}."""
    W = np.asarray(weights, dtype=np.float64)
    L, H, T, _ = W.shape
    out = np.zeros((L, T, T))
    previous = None
    for layer in range(L):
        A = np.zeros((T, T))
        for i in range(T):
            for j in range(T):
                mean = sum(W[layer, h, i, j] for h in range(H)) / H
                A[i, j] = residual * (i == j) + (1 - residual) * mean
            A[i] /= A[i].sum()
        if previous is None:
            current = A
        else:
            current = np.zeros((T, T))
            for i in range(T):
                for j in range(T):
                    current[i, j] = sum(A[i, k] * previous[k, j] for k in range(T))
        out[layer] = previous = current
    return out


def networkx_flow(weights, residual=0.5):
    """The paper's flow with networkx's maximum_flow_value: nodes (level, position), edges
    from (l + 1, i) down to (l, j) with the capacities of the residual-augmented maps."""
    nx = require("networkx")
    A = paper_rollout_layers(weights, residual)
    L, T, _ = A.shape
    out = np.zeros((L, T, T))
    for layer in range(L):
        graph = nx.DiGraph()
        graph.add_nodes_from((level, p) for level in range(layer + 2) for p in range(T))
        for k in range(layer + 1):
            for i in range(T):
                for j in range(T):
                    if A[k, i, j] > 0:
                        graph.add_edge((k + 1, i), (k, j), capacity=float(A[k, i, j]))
        for i in range(T):
            for j in range(T):
                out[layer, i, j] = nx.maximum_flow_value(graph, (layer + 1, i), (0, j))
            if out[layer, i].sum() > 0:
                out[layer, i] /= out[layer, i].sum()
    return out


def paper_rollout_layers(weights, residual):
    W = np.asarray(weights, dtype=np.float64)
    T = W.shape[-1]
    A = residual * np.eye(T) + (1 - residual) * W.mean(axis=1)
    return A / A.sum(axis=-1, keepdims=True)


# ----------------------------------------------------------------------------- rollout


@pytest.mark.parametrize("layers, heads, T, causal, residual", [
    (1, 1, 1, False, 0.5), (1, 3, 4, False, 0.5), (3, 2, 5, True, 0.5), (4, 4, 7, False, 0.25),
    (6, 2, 3, True, 0.9), (2, 2, 4, False, 1.0),
])
def test_rollout_matches_the_papers_equations_in_float64(layers, heads, T, causal, residual):
    weights = random_maps(np.random.default_rng(T * 10 + layers), layers, heads, T, causal)
    result = rollout(weights, residual=residual)
    truth = paper_rollout(weights, residual)
    assert result.shape == (layers, T, T) and result.dtype == np.float64
    err = float(np.max(np.abs(result - truth)))
    print(f"rollout float64: max error {err:.2e}")
    assert err <= 1e-13
    np.testing.assert_allclose(result.sum(axis=-1), 1.0, atol=1e-13)  # rows stay distributions


def test_rollout_float32_within_twice_a_plain_float32_transcription():
    rng = np.random.default_rng(7)
    weights = random_maps(rng, 12, 6, 24, causal=True, dtype=np.float32)
    truth = paper_rollout_layers(weights.astype(np.float64), 0.5)
    ours = rollout(weights)
    assert ours.dtype == np.float32
    # the outside reference: the same equations with NumPy in float32, nothing else
    A = paper_rollout_layers(weights, 0.5).astype(np.float32)
    current, plain = A[0], [A[0]]
    for layer in range(1, len(A)):
        current = A[layer] @ current
        plain.append(current)
    exact, running = [truth[0]], truth[0]
    for layer in range(1, len(truth)):
        running = truth[layer] @ running
        exact.append(running)
    assert_within_budget(ours, np.stack(plain), np.stack(exact), "rollout float32")


def test_rollout_residual_one_is_the_identity_and_zero_is_the_plain_product():
    weights = random_maps(np.random.default_rng(3), 3, 2, 5)
    np.testing.assert_array_equal(rollout(weights, residual=1.0), np.broadcast_to(np.eye(5), (3, 5, 5)))
    mean = weights.mean(axis=1)
    np.testing.assert_allclose(rollout(weights, residual=0.0)[-1], mean[2] @ mean[1] @ mean[0], atol=1e-14)


def test_rollout_takes_what_models_return(torch):
    """transformers' tuple of (1, H, T, T) tensors, a list of (H, T, T) arrays, a stacked array: one answer."""
    weights = random_maps(np.random.default_rng(5), 3, 2, 4)
    expected = rollout(weights)
    np.testing.assert_array_equal(rollout([w for w in weights]), expected)
    np.testing.assert_array_equal(rollout(tuple(torch.from_numpy(w[None]) for w in weights)), expected)
    half = tuple(torch.from_numpy(w[None]).to(torch.bfloat16) for w in weights)
    assert rollout(half).dtype == np.float32  # half types compute in float32


def test_fully_masked_rows_keep_only_the_residual():
    weights = random_maps(np.random.default_rng(2), 2, 1, 3)
    weights[:, :, 1] = 0.0  # query 1 attends nowhere (a padded row)
    A = residual_attention(weights)
    np.testing.assert_array_equal(A[:, 1], np.tile([0.0, 1.0, 0.0], (2, 1)))
    assert not np.isnan(rollout(weights)).any() and not np.isnan(attention_flow(weights)).any()
    zero = residual_attention(weights, residual=0.0)
    np.testing.assert_array_equal(zero[:, 1], 0.0)  # nothing to renormalise: stays 0, never NaN


@pytest.mark.parametrize("bad, message", [
    (np.zeros((2, 3, 3)), r"expected weights of shape \(layers, heads, T, T\), got \(2, 3, 3\)"),
    (np.zeros((2, 1, 3, 4)), r"expected weights of shape \(layers, heads, T, T\), got \(2, 1, 3, 4\)"),
    ([np.zeros((1, 3, 3)), np.zeros((1, 4, 4))], r"expected every layer's map of one shape"),
    ([np.zeros((2, 1, 3, 3))], r"expected every layer's map of one shape"),
    ([], r"expected one attention map per layer, got an empty sequence"),
    (np.zeros((0, 1, 3, 3)), r"expected at least one layer, head and token"),
])
def test_bad_shapes_say_what_was_expected(bad, message):
    for function in (rollout, attention_flow):
        with pytest.raises(ValueError, match=message):
            function(bad)


def test_bad_residual_and_dtype():
    weights = np.full((1, 1, 2, 2), 0.5)
    with pytest.raises(ValueError, match=r"expected residual in \[0, 1\], got 1.5"):
        rollout(weights, residual=1.5)
    with pytest.raises(TypeError, match="expected residual as a float in"):
        rollout(weights, residual="half")
    with pytest.raises(TypeError, match="expected floating-point attention weights, got int64"):
        rollout(np.ones((1, 1, 2, 2), dtype=np.int64))


# ----------------------------------------------------------------------------- flow


@pytest.mark.parametrize("layers, heads, T, causal, residual", [
    (1, 1, 1, False, 0.5), (1, 2, 4, False, 0.5), (2, 2, 4, True, 0.5), (3, 3, 5, False, 0.5),
    (4, 2, 5, True, 0.3), (3, 1, 4, False, 0.0),
])
def test_flow_matches_networkx_maximum_flow(layers, heads, T, causal, residual):
    weights = random_maps(np.random.default_rng(T + 100 * layers), layers, heads, T, causal)
    ours = attention_flow(weights, residual=residual)
    theirs = networkx_flow(weights, residual)
    assert ours.shape == (layers, T, T) and ours.dtype == np.float64
    err = float(np.max(np.abs(ours - theirs)))
    print(f"flow vs networkx: max difference {err:.2e}")
    assert err <= 1e-12


def test_flow_float32_in_float32_out_and_causal_flow_stays_causal():
    weights = random_maps(np.random.default_rng(11), 3, 2, 5, causal=True, dtype=np.float32)
    flow = attention_flow(weights)
    assert flow.dtype == np.float32
    assert not np.triu(flow, k=1).any()  # no flow from a token to a later one
    np.testing.assert_allclose(flow.sum(axis=-1), 1.0, rtol=1e-6)


def test_one_layer_flow_is_the_augmented_map():
    """With one layer the only paths are the single edges: flow = capacity, row-normalised."""
    weights = random_maps(np.random.default_rng(4), 1, 3, 6)
    np.testing.assert_allclose(attention_flow(weights)[0], residual_attention(weights)[0], atol=1e-15)

