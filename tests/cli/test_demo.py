"""`attnkit demo` and `attnkit walkthrough` run, and the walkthrough's numbers
equal a computation done by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from typer.testing import CliRunner

from attnkit.cli import app
from attnkit.walkthrough import walkthrough

runner = CliRunner()


def test_walkthrough_matches_hand_computation():
    trace = walkthrough()
    # Head 0 reads columns 0-1 of X: rows (1,0), (0,1), (1,1).
    # Dot products: t0.t0=1, t0.t1=0, t0.t2=1, t1.t1=1, t1.t2=1, t2.t2=2.
    expected_scores = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 2]], dtype=float)
    np.testing.assert_array_equal(trace.heads[0].scores, expected_scores)
    np.testing.assert_allclose(trace.heads[0].scaled_scores, expected_scores / math.sqrt(2), rtol=1e-15)
    # Row 0 scaled: (a, 0, a) with a = 1/sqrt(2); softmax = (e^a, 1, e^a) / (2 e^a + 1).
    a = 1 / math.sqrt(2)
    row0 = np.array([math.exp(a), 1.0, math.exp(a)]) / (2 * math.exp(a) + 1)
    np.testing.assert_allclose(trace.heads[0].weights[0], row0, rtol=1e-14)
    # Row 1 scaled: (0, a, a); softmax = (1, e^a, e^a) / (1 + 2 e^a).
    e = math.exp(a)
    np.testing.assert_allclose(trace.heads[0].weights[1], np.array([1, e, e]) / (1 + 2 * e), rtol=1e-14)
    # Row 2 scaled: (a, a, 2a); output = w0*(1,0) + w1*(0,1) + w2*(1,1).
    z = 2 * math.exp(a) + math.exp(2 * a)
    w = np.array([math.exp(a), math.exp(a), math.exp(2 * a)]) / z
    np.testing.assert_allclose(trace.heads[0].output[2], [w[0] + w[2], w[1] + w[2]], rtol=1e-14)
    # Head 1 reads columns 2-3: rows (1,0), (0,1), (0,0). Token 2 has a zero query,
    # so its scores are all 0 and its weights uniform 1/3.
    np.testing.assert_allclose(trace.heads[1].weights[2], [1 / 3] * 3, rtol=1e-15)
    # Head 1, row 0: query (1,0) against keys (1,0), (0,1), (0,0): scaled (a, 0, 0).
    np.testing.assert_allclose(trace.heads[1].weights[0], np.array([e, 1, 1]) / (e + 2), rtol=1e-14)
    np.testing.assert_allclose(trace.heads[1].output[2], [1 / 3, 1 / 3], rtol=1e-15)
    np.testing.assert_array_equal(trace.concatenated[:, :2], trace.heads[0].output)
    np.testing.assert_array_equal(trace.concatenated[:, 2:], trace.heads[1].output)


def test_walkthrough_command_prints_every_step():
    result = runner.invoke(app, ["walkthrough"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    for step in ("scores", "scaled scores", "softmax", "head 0 output", "concatenation", "0.7071", "0.4011"):
        assert step in result.output
    # head 1, row 0, output column 0: weights (e^a, 1, 1) / (e^a + 2) over values (1, 0, 0)
    e = math.exp(1 / math.sqrt(2))
    assert f"{e / (e + 2):.4f}" in result.output


def test_demo_runs_with_and_without_causal_mask():
    plain = runner.invoke(app, ["demo", "--no-color", "--seed", "3"], env={"COLUMNS": "100"})
    assert plain.exit_code == 0, plain.output
    for word in ("The", "cat", "mat", "head 3"):
        assert word in plain.output
    causal = runner.invoke(app, ["demo", "--causal", "--no-color", "--seed", "3"], env={"COLUMNS": "100"})
    assert causal.exit_code == 0, causal.output
    assert "largest weight above the diagonal (on a future word): 0\n" in causal.output
    assert causal.output != plain.output
    again = runner.invoke(app, ["demo", "--causal", "--no-color", "--seed", "3"], env={"COLUMNS": "100"})
    assert again.output == causal.output  # seeded: reproducible


def test_demo_smallest_model_runs_causal():
    result = runner.invoke(app, ["demo", "--d-model", "2", "--heads", "2", "--no-color", "--causal", "--text", "a b c"])
    assert result.exit_code == 0, result.output
    assert "largest weight above the diagonal (on a future word): 0\n" in result.output


@pytest.mark.parametrize("args,msg", [(["--d-model", "0"], "--d-model >= 2"), (["--d-model", "1", "--heads", "1"], "--d-model >= 2"),
                                      (["--seed", "-1"], "non-negative --seed"), (["--heads", "0"], "divide"),
                                      (["--heads", "5"], "divide")])
def test_demo_rejects_bad_options_without_a_traceback(args, msg):
    result = runner.invoke(app, ["demo", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert msg in result.output and "Traceback" not in result.output
