"""One backend table: what each attention backend can do is asked (`supports`,
`backend_capabilities`), never read from its name; `backend=` on every model loader,
decoders included, and `attnkit show --backend`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from attnkit.functional import register_attention, scaled_dot_product_attention, varlen_attention
from attnkit.functional.backends import BACKEND_CAPABILITIES
from attnkit.nn import BackendCapabilities, backend_capabilities, supports

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers
from tiny_checkpoints import tiny_llama, write_tiny_llama_folder  # noqa: E402


def test_the_builtin_backends_capabilities():
    assert backend_capabilities("naive") == BackendCapabilities(reference=True, exact=True, varlen=True, dropout=True,
                                                                        sinks=True)
    assert backend_capabilities("flash") == BackendCapabilities(exact=True, weightless=True, varlen=True, sinks=True)
    assert supports("flash", "weightless") and not supports("naive", "weightless")


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown attention backend 'fast'.*flash.*naive"):
        backend_capabilities("fast")
    with pytest.raises(ValueError, match="unknown backend capability 'quick'.*weightless"):
        supports("naive", "quick")
    with pytest.raises(TypeError, match="got int"):
        backend_capabilities(3)


@pytest.fixture
def registered():
    """A registered backend (naive underneath), removed afterwards."""
    from attnkit.functional import ATTENTION_BACKENDS, WEIGHTLESS_BACKENDS

    def mine(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
             **options):
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                            **options)

    names = []

    def register(name, **kwargs):
        register_attention(name, mine, **kwargs)
        names.append(name)
        return name

    yield register
    for name in names:
        ATTENTION_BACKENDS.pop(name, None)
        BACKEND_CAPABILITIES.pop(name, None)
        WEIGHTLESS_BACKENDS.discard(name)


def test_a_registered_backend_has_what_it_registered_and_nothing_more(registered):
    name = registered("test-table-weightless", weightless=True)
    assert backend_capabilities(name) == BackendCapabilities(weightless=True)
    name = registered("test-table-plain")
    assert backend_capabilities(name) == BackendCapabilities()
    assert not supports(name, "exact") and not supports(name, "varlen")


def test_varlen_asks_the_table(registered):
    """varlen_attention runs the backends with capability varlen, and refuses dropout by capability."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((7, 2, 8)) for _ in range(3))
    cu = np.array([0, 3, 7])
    assert np.allclose(varlen_attention(q, k, v, cu, cu, backend="flash"), varlen_attention(q, k, v, cu, cu))
    name = registered("test-table-novarlen")
    with pytest.raises(ValueError, match="unknown varlen attention backend 'test-table-novarlen'"):
        varlen_attention(q, k, v, cu, cu, backend=name)
    with pytest.raises(ValueError, match="the flash backend has no dropout"):
        varlen_attention(q, k, v, cu, cu, backend="flash", dropout_p=0.1, rng=0)


def test_recording_a_weightless_backend_runs_naive(registered):
    """Recording asks `supports(backend, "weightless")`: a backend registered as weightless is
    recorded through naive, one that is not is asked for its own weights."""
    import attnkit
    from attnkit.nn import MultiHeadAttention

    x = np.random.default_rng(1).standard_normal((1, 5, 8)).astype(np.float32)
    for weightless in (True, False):
        calls = []

        def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                return_weights=False, **options):
            calls.append(return_weights)
            return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                enable_gqa, return_weights=return_weights, **options)

        name = registered(f"test-table-spy-{weightless}", weightless=weightless)
        register_attention(name, spy, weightless=weightless)
        module = MultiHeadAttention(8, 2, seed=0)
        module.backend = name
        with attnkit.record_attention(module) as recording:
            module(x, x, x)
        assert len(recording.maps) == 1
        assert calls == ([] if weightless else [True])


def test_the_decoder_loader_takes_backend(tmp_path):
    from attnkit.models import AutoCausalLM

    write_tiny_llama_folder(tmp_path / "tiny", tiny_llama())
    naive = AutoCausalLM.from_pretrained(tmp_path / "tiny")
    flash = AutoCausalLM.from_pretrained(tmp_path / "tiny", backend="flash")
    backends = {m.backend for _, m in flash.named_modules() if hasattr(m, "backend")}
    assert backends == {"flash"}
    assert {m.backend for _, m in naive.named_modules() if hasattr(m, "backend")} == {"naive"}
    ids = np.array([[1, 5, 9, 3, 7]])
    truth = naive.astype(np.float64)(ids)
    for model in (naive, flash):  # both within float32's reach of the float64 truth
        assert np.max(np.abs(model(ids) - truth)) < 1e-4 * max(1.0, np.max(np.abs(truth)))
    with pytest.raises(ValueError, match="unknown attention backend 'fast'; expected one of flash, naive"):
        AutoCausalLM.from_pretrained(tmp_path / "nowhere", backend="fast")  # checked before the path
    with pytest.raises(TypeError, match="expected backend as a str"):
        AutoCausalLM.from_pretrained(tmp_path / "tiny", backend=None)


@pytest.mark.slow  # measured > 2 s in the quick loop
def test_show_takes_backend():
    from typer.testing import CliRunner

    from attnkit.cli import app

    runner = CliRunner()
    naive = runner.invoke(app, ["show", "The cat sat on the mat", "-m", "minilm", "--no-summary", "--values"])
    if naive.exit_code == 1 and "not installed" in naive.output:
        pytest.skip("the minilm package is not installed")
    flash = runner.invoke(app, ["show", "The cat sat on the mat", "-m", "minilm", "--no-summary", "--values",
                                "--backend", "flash"])
    assert naive.exit_code == flash.exit_code == 0, flash.output
    assert flash.stdout == naive.stdout  # flash forms no weights: its maps are recorded through naive
    bad = runner.invoke(app, ["show", "The cat", "--backend", "fast"])
    assert bad.exit_code == 2 and "expected --backend to be one of flash, naive, got 'fast'" in bad.output


def test_every_backend_with_sinks_takes_them_as_the_float64_reference_does():
    """A backend with the `sinks` capability computes gpt-oss's softmax: each head's sink
    logit joins every row's denominator and takes no value (float64, causal, GQA, L > 1
    for flash's tiles and L = 1 for its decode-step route)."""
    import numpy as np

    from attnkit.functional import ATTENTION_BACKENDS

    rng = np.random.default_rng(7)
    for L, S in ((9, 9), (1, 13)):
        q = rng.standard_normal((2, 4, L, 16))
        k, v = rng.standard_normal((2, 2, S, 16)), rng.standard_normal((2, 2, S, 16))
        sinks = rng.standard_normal(4) * 2
        scores = np.einsum("bhle,bhse->bhls", q, np.repeat(k, 2, axis=1)) / 4.0
        allowed = np.tril(np.ones((L, S), bool), S - L)  # bottom-right when L < S
        scores = np.where(allowed, scores, -np.inf)
        m = np.maximum(scores.max(-1, keepdims=True), sinks[:, None, None])
        e = np.exp(scores - m)
        weights = e / (e.sum(-1, keepdims=True) + np.exp(sinks[:, None, None] - m))
        expected = weights @ np.repeat(v, 2, axis=1)
        for name in ATTENTION_BACKENDS:
            if supports(name, "sinks"):
                out = ATTENTION_BACKENDS[name](q, k, v, np.broadcast_to(allowed, (L, S)) if L == S else allowed,
                                               enable_gqa=True, sinks=sinks)
                np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12, err_msg=name)
