"""`attnkit.models.llama.batch.BatchStep` over a `PagedKVCache`: rows of many sequences
(decode tokens and prefill chunks) in one call, against the model's own `forward` on a
contiguous `KVCache`, held to the float64 model by the project's rule."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from attnkit.models.llama.batch import BatchStep, StepRow, new_cache
from attnkit.nn.paged import CacheFull, PagedKVCache

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers

U = float(np.finfo(np.float32).eps) / 2
PROMPTS = [[1, 5, 40, 80, 120, 7, 9], [3, 11, 13], [17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59], [2]]


@pytest.fixture(scope="module")
def tiny():
    from tiny_checkpoints import tiny_llama

    return tiny_llama(seed=3)


def feed(step, prompts, chunk, order=None):
    """Every prompt fed through `step` in chunks of `chunk` rows per sequence per call, the
    sequences' chunks mixed in each call; logits (T, V) per prompt, every row asked."""
    cache = step.cache
    seqs = [cache.add_sequence() for _ in prompts]
    got = [[] for _ in prompts]
    done = [0] * len(prompts)
    order = list(range(len(prompts))) if order is None else order
    while any(d < len(p) for d, p in zip(done, prompts)):
        rows, owners = [], []
        for i in order:
            part = prompts[i][done[i]:done[i] + chunk]
            if part:
                cache.reserve(seqs[i], len(part))
                rows += [StepRow(seqs[i], t, True) for t in part]
                owners += [i] * len(part)
                done[i] += len(part)
        logits = step.run(rows)
        for i, row in zip(owners, logits):
            got[i].append(row)
    return [np.array(g) for g in got], seqs


def forward(model, ids):
    return model(np.array([ids]))[0]


def test_module_fallback_matches_forward_within_the_float64_rule(tiny):
    """A float32 model runs the modules (not quantized): any chunking, sequences mixed in a
    step, gives each sequence's logits of the model's own forward, within 2x its float32
    error of the float64 model (plus a few ulps of the logits' size)."""
    from tiny_checkpoints import tiny_llama

    step = BatchStep(tiny, new_cache(tiny, tokens=256, block_size=4))
    assert not step.compiled and step.reason  # float weights (or the kernels off): the modules
    float64 = tiny_llama(seed=3).astype(np.float64)
    for chunk in (1, 3, 16):
        got, _ = feed(step, PROMPTS, chunk)
        for prompt, logits in zip(PROMPTS, got):
            truth = forward(float64, prompt)
            reference = forward(tiny, prompt)
            assert logits.shape == reference.shape and logits.dtype == np.float32
            error, reference_error = np.abs(logits - truth).max(), np.abs(reference - truth).max()
            assert error <= 2 * reference_error + 4 * U * np.abs(truth).max(), (chunk, error, reference_error)


def test_logits_only_for_the_rows_that_ask_and_prefix_from_the_cache(tiny):
    cache = new_cache(tiny, tokens=128, block_size=4)
    step = BatchStep(tiny, cache)
    a = cache.add_sequence()
    prompt = PROMPTS[2]
    cache.reserve(a, len(prompt))
    logits = step.run([StepRow(a, t, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    assert logits.shape == (1, tiny.config.vocab_size)
    b = cache.add_sequence()
    cached = cache.match_prefix(b, prompt)
    assert cached == 8 and cache.tokens(b) == prompt[:8]
    cache.reserve(b, len(prompt) - cached)
    again = step.run([StepRow(b, t, True) for t in prompt[cached:]])
    np.testing.assert_allclose(again[-1], logits[0], rtol=0, atol=64 * U * np.abs(logits).max())
    assert step.run([]).shape == (0, tiny.config.vocab_size)


def test_run_refuses_rows_without_room_and_bad_rows(tiny):
    cache = new_cache(tiny, tokens=16, block_size=4)
    step = BatchStep(tiny, cache)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 2)
    with pytest.raises(ValueError, match=r"row 2: sequence 1 has room for 0 .*reserve\(1, 1\)"):
        step.run([StepRow(a, 1, True), StepRow(a, 2, True), StepRow(b, 3, True)])
    with pytest.raises(ValueError, match="consecutive"):
        step.run([StepRow(a, 1, True), StepRow(b, 3, True), StepRow(a, 2, True)])
    with pytest.raises(ValueError, match="token"):
        step.run([StepRow(a, tiny.config.vocab_size, True)])
    with pytest.raises(ValueError, match="live sequence"):
        step.run([StepRow(7, 1, True)])
    with pytest.raises(TypeError, match="StepRow"):
        step.run([(a, 1, True)])
    assert cache.length(a) == 0  # nothing was appended by a refused step
    with pytest.raises(CacheFull):
        cache.reserve(b, 64)
    with pytest.raises(ValueError, match="layers"):
        BatchStep(tiny, PagedKVCache(1, 1, 1, blocks=1))
    with pytest.raises(TypeError, match="PagedKVCache"):
        BatchStep(tiny, tiny.new_cache(1, 4))
    with pytest.raises(ValueError, match="tokens"):
        new_cache(tiny, tokens=0)


# ----------------------------------------------------------------------------- the compiled step

IDS = [1, 5, 40, 80, 120, 160, 200, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, gguf):
    from tiny_checkpoints import write_tiny_llama_gguf

    path = tmp_path_factory.mktemp("batch") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


@pytest.fixture(scope="module")
def quantized(tiny_gguf):
    from attnkit.models.llama import LlamaForCausalLM

    return LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)


def test_compiled_rows_within_the_rule_of_the_float64_model(tiny_gguf, quantized):
    """The compiled batched step (Q8_0, Q4_1, F16 and F32 blocks, permuted query/key rows),
    three sequences mixed in chunks: each row's logits within 2x the float32 reference
    model's error of the float64 model (plus the block kernels' rounding), as the compiled
    one-sequence step is held (tests/models/test_fused_decode.py)."""
    from attnkit.models.llama import LlamaForCausalLM

    step = BatchStep(quantized, new_cache(quantized, tokens=256, block_size=4))
    if not step.compiled:
        pytest.skip(f"the compiled step does not run here: {step.reason}")
    prompts = [IDS, IDS[3:12], IDS[::-1][:7]]
    got, _ = feed(step, prompts, 3)
    truth_model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False).astype(np.float64)
    reference_model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False)
    for prompt, logits in zip(prompts, got):
        truth = forward(truth_model, prompt)
        reference_error = np.abs(forward(reference_model, prompt) - truth).max()
        error = np.abs(logits - truth).max()
        budget = 2 * reference_error + U * np.abs(truth).max() * 64
        print(f"compiled batch: {error:.3g} (float32 reference {reference_error:.3g})")
        assert logits.dtype == np.float32 and error <= budget, (error, reference_error)


def test_generate_on_a_batch_runs_the_compiled_step(quantized, monkeypatch):
    """`generate` on a (B, T) batch (left-padded prompts of different lengths) decodes through
    the compiled batched step, with the module path's tokens (the module path is the
    reference: same logits to float32 rounding)."""
    from attnkit import kernels
    from attnkit.models.llama import step
    from attnkit.nn.interface import intervene

    if not kernels.enabled():
        pytest.skip("the compiled step needs the kernels (numba)")
    count = [0]
    original = step.batch_step

    def counted(*args, **kwargs):
        count[0] += 1
        assert len(args[0]) == 3
        return original(*args, **kwargs)

    monkeypatch.setattr(step, "batch_step", counted)
    prompts = [IDS[:5], IDS[2:11], IDS[7:9]]
    compiled = quantized.generate(prompts, 12, stop=())
    assert count[0] == 11
    with intervene({}):  # an open intervention: the modules run every step
        modules = quantized.generate(prompts, 12, stop=())
    assert count[0] == 11
    np.testing.assert_array_equal(compiled, modules)
