"""Shared test helpers: a float64 reference of attention written as plainly as
the math, and tolerance helpers that print how close a result came."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "attnkit",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("attnkit")


def reference_attention(query, key, value, mask=None, scale=None, gqa_group=1):
    """float64 attention, one head and one query row at a time in spirit:
    explicit repeat for GQA, an explicit loop-free softmax with masked entries
    removed. `mask` is boolean (True = may attend) or additive float, already
    broadcastable to the scores. Returns (output, weights, lse)."""
    q = np.asarray(query, dtype=np.float64)
    k = np.repeat(np.asarray(key, dtype=np.float64), gqa_group, axis=-3)
    v = np.repeat(np.asarray(value, dtype=np.float64), gqa_group, axis=-3)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.einsum("...le,...se->...ls", q, k) * scale
    allowed = np.ones(scores.shape, dtype=bool)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            allowed = np.broadcast_to(mask, scores.shape)
        else:
            scores = scores + mask.astype(np.float64)
            allowed = np.broadcast_to(np.isfinite(scores) | (scores > 0), scores.shape)
    safe = np.where(allowed, scores, -np.inf)
    row_max = np.max(safe, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(allowed, np.exp(safe - row_max), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    weights = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + row_max)[..., 0]
    return weights @ v, weights, lse


def max_rel_err(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    denom = max(np.max(np.abs(expected)), 1e-3)  # exact zeros compare absolutely
    return float(np.max(np.abs(actual - expected)) / denom) if expected.size else 0.0


def assert_close(actual, expected, rtol: float, what: str = "result"):
    """Shape first, then values, relative to the largest expected magnitude."""
    assert np.shape(actual) == np.shape(expected), f"{what}: shape {np.shape(actual)} != {np.shape(expected)}"
    assert not np.isnan(np.asarray(actual, dtype=np.float64)).any(), f"{what}: NaN in result"
    err = max_rel_err(actual, expected)
    assert err <= rtol, f"{what}: max relative error {err:.3e} > {rtol:.1e}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
