"""The scheduler's decisions (`attnkit.serve.engine.Engine`) on a stand-in cache and step
(tests/serve/paged_double.py: logits that depend on a sequence's tokens only): what a step
holds, who is admitted, preempted and cancelled, what a request can never get, and that an
answer does not depend on its neighbours. The real batched step is in test_engine.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from paged_double import DoubleCache, DoubleStep
from tiny_checkpoints import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, tie_word_embeddings=False)  # untied: logits flat enough to sample apart


def engine_of(model, *, blocks=64, block_size=4, **options):
    from attnkit.serve.engine import Engine

    cache = DoubleCache(blocks, block_size)
    return Engine(model, cache=cache, step=DoubleStep(model, cache), block_size=block_size, **options)


def answer(handle):
    """{choice: (tokens, logprobs, tops, finish)} of a finished handle."""
    out = {}
    for event in handle.events(timeout=60):
        tokens, logprobs, tops, _ = out.get(event.choice, ([], [], [], None))
        out[event.choice] = (tokens + [event.token], logprobs + [event.logprob], tops + [event.top], event.finish)
    return out


REQUESTS = [  # (prompt, max_tokens, temperature, top_p, seed, n)
    ([5, 6, 7, 8, 9, 10, 11, 12, 13], 7, 0.0, None, None, 1),
    ([5, 6, 7, 8, 9, 10, 11, 12, 40, 41], 5, 0.9, None, 3, 1),
    (list(range(20, 50)), 6, 0.0, None, None, 1),  # long: read in chunks
    ([7], 4, 1.0, 0.9, 11, 2),
    ([5, 6, 7, 8, 9, 10, 11, 12, 13], 7, 0.7, None, 5, 3),
    ([60, 61, 62], 8, 1.2, None, 8, 1),
]


def submit(engine, request, logprobs=2):
    from attnkit.serve.engine import Sampling

    prompt, max_tokens, temperature, top_p, seed, n = request
    return engine.submit(prompt, max_tokens, Sampling(temperature, top_p, seed, frozenset({2})), logprobs=logprobs,
                         n=n)


def test_answers_do_not_depend_on_neighbours_arrival_order_or_preemption(model):
    alone = []
    for request in REQUESTS:
        engine = engine_of(model, max_batch=4)
        alone.append(answer(submit(engine, request)))
        engine.close()
    rng = np.random.default_rng(0)
    for blocks in (64, 14):  # 14 blocks of 4: too few for all at once, the youngest are preempted
        order = rng.permutation(len(REQUESTS))
        engine = engine_of(model, max_batch=4, step_tokens=8, blocks=blocks)
        handles = {int(i): submit(engine, REQUESTS[i]) for i in order}
        got = {i: answer(h) for i, h in handles.items()}
        for i, want in enumerate(alone):
            assert got[i] == want, (blocks, i)
        stats = engine.stats()
        assert stats["used_blocks"] == 0 and stats["running"] == stats["waiting"] == 0
        if blocks == 14:
            assert stats["preempted"] > 0
        assert all(len(rows) <= 8 for rows in engine.step.batches)
        engine.close()
    # n > 1: the choices sample apart, choice 0 is the request's n = 1 answer
    three = alone[4]
    assert sorted(three) == [0, 1, 2] and len({tuple(three[c][0]) for c in three}) > 1
    engine = engine_of(model)
    assert answer(submit(engine, REQUESTS[4][:5] + (1,)))[0] == three[0]
    engine.close()


def test_logprobs_are_the_float64_log_softmax_of_the_models_logits(model):
    engine = engine_of(model)
    prompt = [5, 6, 7, 8, 9]
    events = list(submit(engine, (prompt, 5, 0.8, None, 1, 1), logprobs=5).events(timeout=60))
    engine.close()
    tokens = list(prompt)
    for event in events:
        logits = model.forward(np.asarray(tokens))[-1].astype(np.float64)  # (V,)
        want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        assert event.logprob == want[event.token]
        order = np.argsort(-want, kind="stable")[:5]
        assert event.top == tuple((int(i), float(want[i])) for i in order)
        tokens.append(event.token)


def test_a_step_takes_decode_rows_first_then_prefill_chunks(model):
    engine = engine_of(model, max_batch=4, step_tokens=6)
    first = submit(engine, ([5, 6, 7], 30, 0.0, None, None, 1))
    events = first.events(timeout=60)
    next(events), next(events)  # it is decoding
    long = submit(engine, (list(range(10, 60)), 2, 0.0, None, None, 1))
    answer(long)
    list(events)
    engine.close()
    for rows in engine.step.batches:
        assert len(rows) <= 6
    mixed = [rows for rows in engine.step.batches if len({r.sequence for r in rows}) == 2]
    for rows in mixed:  # the running stream's decode row first, then a chunk of the long prompt
        assert rows[0].logits and all(r.sequence != rows[0].sequence for r in rows[1:])
        assert all(not r.logits for r in rows[1:-1])
    assert len(mixed) >= 50 // 5  # the prompt was read in chunks while the first stream went on


def test_cancellation_frees_the_blocks_at_the_next_step(model):
    engine = engine_of(model, max_batch=2)
    handle = submit(engine, ([5, 6, 7, 8, 9], 100, 0.0, None, None, 2))
    events = handle.events(timeout=60)
    next(events)
    assert engine.stats()["used_blocks"] > 0
    handle.cancel()
    list(events)  # the stream ends
    stats = engine.stats()
    assert stats["used_blocks"] == 0 and stats["cancelled"] == 2 and stats["running"] == 0
    waiting = submit(engine, ([5, 6], 3, 0.0, None, None, 1))
    assert len(answer(waiting)[0][0]) == 3  # the engine goes on
    engine.close()


def test_limits_are_refused_with_the_numbers(model):
    from attnkit.serve.engine import EngineBusy, RequestTooLarge

    engine = engine_of(model, blocks=8, block_size=4, max_batch=1, max_queue=1)
    with pytest.raises(RequestTooLarge, match=r"30 tokens.*holds 32") as caught:
        submit(engine, (list(range(10, 40)), 3, 0.0, None, None, 1))  # 30 + 3 > 32
    assert "30" in str(caught.value)
    with pytest.raises(ValueError, match="n between 1 and 1"):
        submit(engine, ([5], 3, 0.0, None, None, 2))
    gate = threading.Event()
    slow = engine.step.run
    engine.step.run = lambda rows: (gate.wait(30), slow(rows))[1]
    running = submit(engine, ([5, 6], 20, 0.0, None, None, 1))
    while engine.stats()["running"] == 0:  # admitted, held in its first step
        time.sleep(0.01)
    queued = submit(engine, ([5, 7], 2, 0.0, None, None, 1))
    with pytest.raises(EngineBusy, match="busy"):
        submit(engine, ([5, 8], 2, 0.0, None, None, 1))
    gate.set()
    assert len(answer(running)[0][0]) == 20 and len(answer(queued)[0][0]) == 2
    engine.close()


def test_prefix_hits_are_counted_as_cached_prompt_tokens(model):
    engine = engine_of(model, block_size=4)
    system = list(range(10, 30))  # 20 tokens: 5 blocks
    first = submit(engine, (system + [40, 41], 2, 0.0, None, None, 1))
    answer(first)
    second = submit(engine, (system + [42], 2, 0.0, None, None, 1))
    answer(second)
    engine.close()
    assert first.cached_tokens == 0 and second.cached_tokens == 20
