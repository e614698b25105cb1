"""`attnkit serve` with many clients at once, with the openai client: every answer (text,
finish reason, log-probabilities) equals the same request alone, whatever arrives with it and
in whatever order; log-probabilities are the model's float64 log-softmax; `n` choices; the
prefix cache's count in usage; embeddings batched and equal to solo bit for bit; attention and
the logit lens through the API equal `attnkit.record_attention` and `interpret.logit_lens`."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import require
from tiny_decoders import flat_folder, flat_gguf  # noqa: F401 - fixtures

SENTENCES = ["The cat sat on the mat.", "A dog ran in the park.", "Attention is all you need.", "Short.",
             "Another sentence about the weather in Paris.", "the the the", "One more.", "Last one here."]
SYSTEM = "You are a helpful assistant who answers in short sentences about cats and their mats. " * 3


@pytest.fixture(scope="module")
def served(flat_folder):  # noqa: F811
    """(client, app, the decoder's name): a server of the flat tiny decoder and MiniLM."""
    openai = require("openai")
    require("fastapi")
    from attnkit.serve.server import BackgroundServer, create_app

    name = str(flat_folder)
    app = create_app(models=[name, "minilm"], max_new_tokens=32, max_batch=4, kv_tokens=4096, step_tokens=16)
    with BackgroundServer(app) as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120), app, name
    app.state.models.close()


def _chat(client, name, content, *, stream=False, **options):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    if not stream:
        answer = client.chat.completions.create(model=name, messages=messages, **options)
        return [(c.index, c.message.content, c.finish_reason, c.logprobs and c.logprobs.model_dump())
                for c in answer.choices]
    pieces, finish, logprobs = {}, {}, {}
    for chunk in client.chat.completions.create(model=name, messages=messages, stream=True, **options):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
            if c.logprobs is not None:
                logprobs.setdefault(c.index, []).extend(e.model_dump() for e in c.logprobs.content)
    return [(i, pieces[i], finish[i], {"content": logprobs[i], "refusal": None} if i in logprobs else None)
            for i in sorted(pieces)]


def _complete(client, name, prompt, **options):
    answer = client.completions.create(model=name, prompt=prompt, **options)
    return [(c.index, c.text, c.finish_reason, c.logprobs and c.logprobs.model_dump()) for c in answer.choices]


JOBS = [
    lambda c, m: _chat(c, m, "the cat", temperature=0, max_tokens=12),
    lambda c, m: _chat(c, m, "the cat", temperature=0, max_tokens=12, stream=True),
    lambda c, m: _chat(c, m, "a mat", temperature=0.9, seed=1, max_tokens=10, logprobs=True, top_logprobs=3),
    lambda c, m: _chat(c, m, "a mat", temperature=0.9, seed=1, max_tokens=10, logprobs=True, top_logprobs=3,
                       stream=True),
    lambda c, m: _chat(c, m, "in the hat " * 20, temperature=1.0, top_p=0.9, seed=7, max_tokens=9),
    lambda c, m: _chat(c, m, "hi", temperature=1.2, seed=3, max_tokens=8, n=2),
    lambda c, m: _complete(c, m, "the the", temperature=0.7, seed=5, max_tokens=11, logprobs=2),
    lambda c, m: _complete(c, m, ["a", "the cat sat"], temperature=0, max_tokens=6),
]


@pytest.fixture(scope="module")
def served_gguf(flat_gguf):  # noqa: F811
    """(client, app, name): a server of the flat tiny decoder as a quantized GGUF file (the
    compiled batched step runs it, unless the kernels are off)."""
    openai = require("openai")
    require("fastapi")
    from attnkit.serve.server import BackgroundServer, create_app

    name = str(flat_gguf)
    app = create_app(models=[name], max_new_tokens=32, max_batch=4, kv_tokens=4096, step_tokens=16)
    with BackgroundServer(app) as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120), app, name
    app.state.models.close()


def _logprob_values(answer):
    """The numbers in one job's answer's logprobs, in order."""
    values = []
    for _, _, _, logprobs in answer:
        if logprobs is None:
            continue
        for entry in logprobs.get("content") or []:
            values += [entry["logprob"], *(t["logprob"] for t in entry["top_logprobs"])]
        values += [v for v in logprobs.get("token_logprobs") or []]
    return values


def _without_logprob_values(answer):
    return [(i, text, finish) for i, text, finish, _ in answer]


@pytest.mark.slow
def test_eight_concurrent_clients_get_what_each_gets_alone(served_gguf):
    """On the compiled batched step, every answer is the same bits as alone (texts and
    log-probabilities); on the modules (ATTNKIT_KERNELS=numpy), texts are the same and
    log-probabilities agree to float32 rounding of a prefill chunk's products."""
    client, app, name = served_gguf
    compiled = app.state.models.engine(name).step.compiled
    alone = [job(client, name) for job in JOBS]
    rng = random.Random(0)
    for _ in range(2):  # two random arrival orders
        order = list(range(len(JOBS)))
        rng.shuffle(order)
        delays = {i: rng.uniform(0, 0.05) for i in order}

        def run(i):
            time.sleep(delays[i])
            return i, JOBS[i](client, name)

        with ThreadPoolExecutor(len(JOBS)) as pool:
            together = dict(pool.map(run, order))
        for i, want in enumerate(alone):
            if compiled:
                assert together[i] == want, i
            else:
                assert _without_logprob_values(together[i]) == _without_logprob_values(want), i
                np.testing.assert_allclose(_logprob_values(together[i]), _logprob_values(want), rtol=0, atol=1e-5)
    assert alone[0][0][1:3] == alone[1][0][1:3]  # streamed = not streamed
    assert alone[2] == alone[3]
    two = alone[5]
    assert [c[0] for c in two] == [0, 1] and two[0][1] != two[1][1]  # the seeds made different choices


def _ids_by_bytes(tokenizer):
    from attnkit.serve.openai_logprobs import token_bytes

    table = {}
    for i in range(tokenizer.vocab_size):
        table.setdefault(bytes(token_bytes(tokenizer, i)), i)
    return table


def test_logprobs_are_the_models_log_softmax(served):
    """Each token's logprob and its alternatives against the model's own forward over the
    tokens before it and a float64 log-softmax; the tolerance is float32 rounding of the
    logits (the batched step and the plain forward add in different orders)."""
    client, app, name = served
    model = app.state.models.get(name)
    answer = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "the cat"}], temperature=0.8, seed=2, max_tokens=8,
        logprobs=True, top_logprobs=5)
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens - (answer.choices[0].finish_reason == "stop")
    by_bytes = _ids_by_bytes(model.tokenizer)
    tokens = model.tokenizer.encode_chat([{"role": "user", "content": "the cat"}])
    for entry in entries:
        logits = model.forward(np.asarray(tokens))[-1]  # (V,) float32
        x = logits.astype(np.float64)
        want = x - x.max() - np.log(np.exp(x - x.max()).sum())
        tolerance = 64 * np.finfo(np.float32).eps * np.abs(x).max()
        token = by_bytes[bytes(entry.bytes)]
        assert abs(entry.logprob - want[token]) <= tolerance, (entry.logprob, want[token])
        assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        for alternative in entry.top_logprobs:
            assert abs(alternative.logprob - want[by_bytes[bytes(alternative.bytes)]]) <= tolerance
        assert np.isclose(sum(np.exp(a.logprob) for a in entry.top_logprobs),
                          np.sort(np.exp(want))[-5:].sum(), atol=5 * tolerance)
        tokens.append(token)
    completion = client.completions.create(model=name, prompt="the cat", temperature=0, max_tokens=4, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert logprobs.text_offset[0] == len("the cat")
    assert all(b - a == len(token) for a, b, token in zip(logprobs.text_offset, logprobs.text_offset[1:],
                                                            logprobs.tokens))
    assert all(max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))


def test_concurrent_embeddings_are_batched_and_equal_solo_bit_for_bit(served):
    client, app, _ = served
    alone = [client.embeddings.create(model="minilm", input=[s], encoding_format="float").data[0].embedding
             for s in SENTENCES]
    pool = app.state.models
    batcher = pool.embedder("minilm")
    calls, requests = batcher.calls, batcher.requests
    submitted = []
    submit = batcher.submit
    batcher.submit = lambda texts: (submitted.append(texts), submit(texts))[1]
    try:
        with ThreadPoolExecutor(8) as threads:
            with pool.lock("minilm"):  # the encoder is busy: the 8 requests wait together
                futures = [threads.submit(lambda s=s: client.embeddings.create(
                    model="minilm", input=[s], encoding_format="float").data[0].embedding) for s in SENTENCES]
                deadline = time.time() + 60
                while len(submitted) < 8 and time.time() < deadline:
                    time.sleep(0.01)
            together = [f.result() for f in futures]
    finally:
        batcher.submit = submit
    for want, got in zip(alone, together):
        assert np.array_equal(np.array(want, dtype=np.float32), np.array(got, dtype=np.float32))
    assert batcher.requests - requests == 8 and batcher.calls - calls == 8  # one call a request: its own bits


def test_attention_and_logit_lens_through_the_api_are_record_attention_and_logit_lens(served):
    from attnkit import interpret, record_attention

    client, app, name = served
    model = app.state.models.get(name)
    question = [{"role": "user", "content": "the cat sat"}]
    extension = {"attnkit": {"attention": {"layers": [0, 1], "heads": [0, 3]}, "logit_lens": {"top": 3}}}
    answer = client.chat.completions.create(model=name, messages=question, temperature=0, max_tokens=5,
                                            extra_body=extension)
    entries = answer.choices[0].model_extra["attnkit"]["tokens"]
    streamed = []
    for chunk in client.chat.completions.create(model=name, messages=question, temperature=0, max_tokens=5,
                                                stream=True, extra_body=extension):
        for c in chunk.choices:
            streamed.extend((c.model_extra.get("attnkit") or {}).get("tokens", []))
    assert streamed == entries and len(entries) >= 1
    prompt = model.tokenizer.encode_chat(question)
    full = prompt + [e["id"] for e in entries]
    with record_attention(model) as recording:
        model.forward(np.asarray(full[:-1]))
    maps = recording.maps  # one (1, H, T, T) per layer
    lens = interpret.logit_lens(model, np.asarray(full[:-1]))  # (layers + 1, T, V)
    eps = np.finfo(np.float32).eps
    for i, entry in enumerate(entries):
        query = len(prompt) + i - 1  # the position whose output chose this token
        got = np.array(entry["attention"])  # (2 layers, 2 heads, query + 1)
        want = np.stack([[maps[layer][0, head, query, :query + 1] for head in (0, 3)] for layer in (0, 1)])
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=64 * eps, rtol=0)
        for layer, row in enumerate(entry["logit_lens"]):
            order = np.argsort(-lens[layer, query].astype(np.float64), kind="stable")[:3]
            assert [t["id"] for t in row] == order.tolist()
