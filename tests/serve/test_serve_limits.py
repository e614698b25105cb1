"""The server's limits and cancellation, end to end with the openai client, on a decoder whose
engine runs on the stand-in cache and step (tests/serve/paged_double.py), so that a step can
be held while the test fills the queue: 429 with Retry-After when the queue is full, 400 naming
the numbers for a request that can never fit, 503 once the engine has stopped, and a client
that goes away mid-stream frees its blocks."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import require
from paged_double import DoubleCache, DoubleStep
from tiny_decoders import flat_folder  # noqa: F401 - a fixture

QUESTION = [{"role": "user", "content": "the cat"}]


@pytest.fixture
def held(flat_folder):  # noqa: F811
    """(client, base url, engine, gate): a server of one decoder, max_batch 1, max_queue 1, a
    cache of 24 blocks of 4 tokens; its steps wait for `gate` while it is clear."""
    openai = require("openai")
    require("fastapi")
    from attnkit.serve.server import BackgroundServer, create_app

    name = str(flat_folder)
    app = create_app(models=[name], max_new_tokens=64, max_batch=1, max_queue=1)
    pool = app.state.models
    model = pool.get(name)
    cache = DoubleCache(24, 4)
    step = DoubleStep(model, cache)
    gate = threading.Event()
    gate.set()
    run = step.run
    step.run = lambda rows: (gate.wait(60), run(rows))[1]
    pool.engine_options = dict(max_batch=1, max_queue=1, block_size=4, cache=cache, step=step)
    with BackgroundServer(app) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield client, running.url, pool.engine(name), gate, name
    pool.close()


def test_a_full_queue_is_429_with_retry_after_and_a_request_too_large_is_400(held):
    client, url, engine, gate, name = held
    openai = require("openai")
    with pytest.raises(openai.BadRequestError) as caught:  # 60 + 50 tokens > 24 blocks of 4
        client.completions.create(model=name, prompt="the " * 60, max_tokens=50)
    body = caught.value.body
    assert (body["code"], body["param"]) == ("kv_cache_exceeded", "max_tokens")
    assert "96" in caught.value.message and "--kv-tokens" in caught.value.message
    gate.clear()
    answers = []
    first = threading.Thread(target=lambda: answers.append(
        client.chat.completions.create(model=name, messages=QUESTION, max_tokens=3, temperature=0)))
    first.start()
    while engine.stats()["running"] == 0:
        time.sleep(0.01)
    second = threading.Thread(target=lambda: answers.append(
        client.chat.completions.create(model=name, messages=QUESTION, max_tokens=3, temperature=0)))
    second.start()
    while engine.stats()["waiting"] == 0:
        time.sleep(0.01)
    refused = httpx.post(url + "/v1/chat/completions", json={"model": name, "messages": QUESTION, "max_tokens": 3})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "server_busy" and "--max-batch 1" in error["message"]
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=name, messages=QUESTION, max_tokens=3)
    gate.set()
    first.join(60), second.join(60)
    assert [a.choices[0].finish_reason for a in answers] == ["length", "length"]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_a_client_that_goes_away_frees_its_blocks_and_a_stopped_engine_is_503(held):
    client, url, engine, gate, name = held
    openai = require("openai")
    gate.clear()  # its first step waits
    stream = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=60, temperature=0,
                                            stream=True)
    next(iter(stream))  # the role chunk: the answer has started
    while engine.stats()["running"] == 0:
        time.sleep(0.01)
    assert engine.stats()["used_blocks"] > 0
    stream.close()  # the client goes away
    gate.set()
    deadline = time.time() + 30
    while engine.stats()["cancelled"] == 0 and time.time() < deadline:
        time.sleep(0.02)
    stats = engine.stats()
    assert stats["cancelled"] == 1 and stats["used_blocks"] == 0 and stats["running"] == 0
    engine.close()
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=name, messages=QUESTION, max_tokens=3)
    assert caught.value.status_code == 503 and caught.value.body["code"] == "engine_stopped"
