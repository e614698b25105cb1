"""A recording belongs to the call that opened it (record_attention is scoped to the
calling thread): threads that record and threads that only compute, all on one model at
once, each get exactly what a sequential run gives, and nothing is left on the model."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import attnkit
from attnkit.models import GPT2Config, GPT2LMHeadModel
from attnkit.nn import active_recorders
from attnkit.nn.interface import attention_modules

THREADS = 8


@pytest.fixture(autouse=True)
def short_switch_interval():
    """Threads switch every 10 µs instead of 5 ms, so that calls really interleave."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def _hammer(jobs):
    """Run every job on THREADS threads, all released at once; results in job order."""
    start = threading.Event()

    def run(job):
        start.wait()
        return job()

    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        start.set()
        return [future.result(timeout=120) for future in futures]


def _decoder():
    config = GPT2Config(vocab_size=50, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64,
                        max_position_embeddings=64, bos_token_id=None, eos_token_id=())
    return GPT2LMHeadModel(config, seed=0)


def test_recording_and_plain_calls_on_one_decoder_from_eight_threads():
    model = _decoder()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50, size=int(n)) for n in rng.integers(3, 20, size=4 * THREADS)]
    # Sequential truth: each prompt's maps, and each prompt's greedy continuation.
    maps = [model.attention(p).weights for p in prompts]
    generated = [model.generate(p, 6) for p in prompts]

    def record(i):
        return lambda: ("maps", i, model.attention(prompts[i]).weights)

    def compute(i):
        return lambda: ("generated", i, model.generate(prompts[i], 6))

    jobs = [record(i) if i % 2 == 0 else compute(i) for i in range(len(prompts))]
    jobs += [compute(i) if i % 2 == 0 else record(i) for i in range(len(prompts))]
    for kind, i, result in _hammer(jobs):
        if kind == "maps":  # generate switches BLAS threads process-wide: rounding may differ, ~1e-7
            np.testing.assert_allclose(result, maps[i], rtol=0, atol=1e-5,
                                       err_msg=f"prompt {i}: maps differ from a sequential run")
        else:
            np.testing.assert_array_equal(result, generated[i], err_msg=f"prompt {i}: generation differs")
    assert all(active_recorders(module) == () for module in attention_modules(model))


def test_open_and_close_recordings_from_many_threads_leaves_nothing_behind():
    """Four threads each entering and leaving record_attention 200 times: afterwards no
    module is recorded anywhere, and a plain forward forms no weights."""
    model = _decoder()
    ids = np.arange(5)

    def churn():
        for _ in range(200):
            with attnkit.record_attention(model) as recording:
                pass
            assert len(recording) == 0  # no other thread's calls reach it
        return True

    assert all(_hammer([churn] * 4))
    for module in attention_modules(model):
        assert active_recorders(module) == ()
    with attnkit.record_attention(model) as recording:
        model.forward(ids)
    assert len(recording) == model.config.num_layers


def test_nested_recordings_in_one_thread_each_see_every_call():
    model = _decoder()
    with attnkit.record_attention(model) as outer:
        model.forward(np.arange(4))
        with attnkit.record_attention(model) as inner:
            model.forward(np.arange(6))
    assert [m.shape[-1] for m in outer] == [4] * 3 + [6] * 3
    assert [m.shape[-1] for m in inner] == [6] * 3


@pytest.mark.slow
def test_sentence_encoder_attention_beside_encode_in_other_threads(minilm_folder):
    """The report: `SentenceEncoder.attention(text)` while `encode(texts)` runs elsewhere."""
    from attnkit.models import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(minilm_folder)
    texts = ["The cat sat on the mat.", "A man is eating food.", "Attention is a soft lookup of keys.",
             "Short.", "A somewhat longer sentence, so that lengths differ between the calls."]
    maps = {t: encoder.attention(t) for t in texts}
    embeddings = encoder.encode(texts)

    def look(t):
        return lambda: ("attention", t, encoder.attention(t))

    def embed():
        return ("encode", None, encoder.encode(texts))

    jobs = [look(t) for t in texts] + [embed] * 3
    for kind, text, result in _hammer(jobs):
        if kind == "attention":
            assert result[0] == maps[text][0]
            # encode sets the process's BLAS thread count while it runs, so a product here may
            # round differently (~1e-7); another text's maps would not even have this shape
            np.testing.assert_allclose(result[1], maps[text][1], rtol=0, atol=1e-5)
        else:
            # encode may pick another thread schedule (float32 rounding, ~1e-7); another
            # text's embedding, which a mixed-up call would give, is off by 0.1 or more.
            np.testing.assert_allclose(result, embeddings, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_attnkit_serve_answers_concurrent_requests_on_one_model(minilm_folder):
    """`attnkit serve` runs each request's model in a worker thread, on one shared model:
    eight requests at once each get the answer a request alone gets."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from attnkit.serve.server import create_app

    client = TestClient(create_app(models=["minilm"], max_chars=400, max_tokens=64))
    texts = [f"Sentence number {i} says {' and '.join(['more'] * i)} about the cat." for i in range(8)]

    def ask(text):
        response = client.post("/api/attention", json={"text": text, "model": "minilm", "layer": 2, "head": 3})
        assert response.status_code == 200, response.text
        return response.json()

    alone = [ask(text) for text in texts]
    together = _hammer([lambda text=text: ask(text) for text in texts] * 2)
    assert together == alone + alone


@pytest.mark.slow
def test_rotary_tables_grow_safely_under_concurrent_readers():
    """RotaryEmbedding grows its cos/sin table on demand: readers in other threads, while
    it grows, always get a matching pair (the report: an IndexError in 12-24 of 2,400
    calls when cos and sin were replaced one after the other; this loop gave 71 of
    16,800 before the fix)."""
    from attnkit.nn.decoder_layers import RotaryEmbedding

    sys.setswitchinterval(1e-6)
    lengths = [65, 129, 257, 513, 1025, 2049, 4097]  # each one past the table: it grows
    reference = RotaryEmbedding(8).cos_sin(np.arange(lengths[-1]))
    for _ in range(300):
        rotary = RotaryEmbedding(8)  # fresh: every thread races to grow it
        jobs = [lambda n=n, rotary=rotary: (n, rotary.cos_sin(np.arange(n))) for n in lengths for _ in range(8)]
        for n, (cos, sin) in _hammer(jobs):
            np.testing.assert_array_equal(cos, reference[0][:n])
            np.testing.assert_array_equal(sin, reference[1][:n])
