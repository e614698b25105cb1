"""The engine on the real paged cache and batched step (`attnkit.nn.paged`,
`attnkit.models.llama.batch`): answers equal to the same request alone whatever runs beside
it, whether the cache is large or small enough to preempt; blocks freed by cancellation and
kept for the prefix cache; a repeated system prompt read from the cache through the server."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tiny_decoders import flat_folder, flat_gguf  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def model(flat_gguf):  # noqa: F811
    """A tiny quantized Llama with flat logits (seeds sample apart): the compiled batched step
    runs it, unless the kernels are off."""
    from attnkit.models.auto import AutoCausalLM

    return AutoCausalLM.from_pretrained(str(flat_gguf))


def _answer(handle):
    out = {}
    for event in handle.events(timeout=120):
        tokens, logprobs, finish = out.get(event.choice, ([], [], None))
        out[event.choice] = (tokens + [event.token], logprobs + [event.logprob], event.finish)
    return out


def _same(got, want, exact):
    """Tokens and finish reasons equal; log-probabilities equal bit for bit on the compiled step,
    within float32 rounding on the modules (whose prefill products may round by chunk size)."""
    assert got.keys() == want.keys()
    for choice in want:
        assert got[choice][0] == want[choice][0] and got[choice][2] == want[choice][2]
        if exact:
            assert got[choice][1] == want[choice][1]
        else:
            np.testing.assert_allclose(got[choice][1], want[choice][1], rtol=0, atol=1e-5)


SYSTEM = list(range(40, 90))  # 50 tokens shared by most prompts
REQUESTS = [  # (prompt, max_tokens, temperature, seed, n)
    (SYSTEM + [5, 6, 7], 12, 0.0, None, 1),
    (SYSTEM + [9], 10, 0.9, 1, 1),
    (list(range(100, 230)), 6, 0.0, None, 1),  # a long prompt, read in chunks
    ([7, 8], 9, 1.0, 4, 2),
    (SYSTEM + [5, 6, 7], 8, 0.8, 2, 3),
    ([60, 61, 62], 14, 0.0, None, 1),
]


def _submit(engine, request):
    from attnkit.serve.engine import Sampling

    prompt, max_tokens, temperature, seed, n = request
    return engine.submit(prompt, max_tokens, Sampling(temperature, None, seed, frozenset({2})), logprobs=3, n=n)


def test_answers_on_the_batched_step_equal_each_request_alone(model):
    from attnkit.serve.engine import Engine

    alone = []
    for request in REQUESTS:
        engine = Engine(model, max_batch=4, kv_tokens=2048, step_tokens=16)
        alone.append(_answer(_submit(engine, request)))
        exact = engine.step.compiled
        engine.close()
    rng = np.random.default_rng(1)
    for kv_tokens in (2048, 160):  # 160 (10 blocks): too small for all at once, the youngest are preempted
        engine = Engine(model, max_batch=4, kv_tokens=kv_tokens, step_tokens=16)
        order = rng.permutation(len(REQUESTS))
        handles = {int(i): _submit(engine, REQUESTS[i]) for i in order}
        for i, handle in handles.items():
            _same(_answer(handle), alone[i], exact)
        stats = engine.stats()
        assert stats["used_blocks"] == 0
        if kv_tokens == 160:
            assert stats["preempted"] > 0
        engine.close()


def test_cancelled_blocks_are_freed_and_full_blocks_stay_cached(model):
    from attnkit.serve.engine import Engine, Sampling

    engine = Engine(model, max_batch=2, kv_tokens=1024, step_tokens=16)
    handle = engine.submit(SYSTEM, 200, Sampling(0.0, None, None, frozenset()), n=2)
    events = handle.events(timeout=60)
    for _ in range(6):
        next(events)
    assert engine.stats()["used_blocks"] >= 4
    handle.cancel()
    list(events)
    stats = engine.stats()
    assert (stats["used_blocks"], stats["running"], stats["cancelled"]) == (0, 0, 2)
    assert stats["cached_blocks"] >= len(SYSTEM) // engine.block_size  # the prompt's full blocks, for the next
    again = engine.submit(SYSTEM + [3], 2, Sampling())
    _answer(again)
    assert again.cached_tokens == len(SYSTEM) // engine.block_size * engine.block_size
    engine.close()


@pytest.fixture(scope="module")
def served(flat_folder):  # noqa: F811
    from conftest import require

    openai = require("openai")
    require("fastapi")
    from attnkit.serve.server import BackgroundServer, create_app

    name = str(flat_folder)
    app = create_app(models=[name], max_new_tokens=32, max_batch=4, kv_tokens=4096, step_tokens=16)
    with BackgroundServer(app) as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120), app, name
    app.state.models.close()


def test_a_repeated_system_prompt_is_read_from_the_prefix_cache(served):
    client, app, name = served
    pool = app.state.models
    engine = pool.engine(name)
    assert engine is not None, pool.engine_reasons.get(name)
    system = "You are a helpful assistant who answers in short sentences about cats and their mats. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "prefix one"}]
    first = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=2)
    messages[1]["content"] = "prefix two"
    second = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=2)
    shared = len(pool.get(name).tokenizer.encode_chat(messages[:1], add_generation_prompt=False))
    block = engine.block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % block == 0 and shared - block < cached <= shared + block
    deadline = time.time() + 10
    while not engine.idle() and time.time() < deadline:
        time.sleep(0.01)
    assert engine.stats()["used_blocks"] == 0
