"""`attnkit serve`'s OpenAI-compatible API, end to end, with the official `openai` client.

A real server (uvicorn in a thread, on a free port) answers the client; every answer is
compared with what attnkit gives without the server: embeddings with
`SentenceEncoder.encode`, greedy completions with `attnkit generate`, streamed text with
the same request not streamed, concurrent requests with the same requests one at a time.
Errors must reach the client as the exception OpenAI's service would make it raise.
"""

from __future__ import annotations

import base64
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import require
from tiny_decoders import tiny_folder  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("minilm_folder", "smollm2_file")

SENTENCES = ["The cat sat on the mat.", "A dog ran in the park.", "Attention is all you need."]


@pytest.fixture(scope="module")
def openai():
    require("fastapi")
    require("uvicorn")
    return require("openai")


@pytest.fixture(scope="module")
def server(openai):
    """A real `attnkit serve` app on a free loopback port; yields (base url, app)."""
    from attnkit.serve.server import BackgroundServer, create_app

    app = create_app(models=["minilm", "smollm2", "random"], max_new_tokens=64)
    with BackgroundServer(app) as running:
        yield running.url, app


@pytest.fixture(scope="module")
def client(openai, server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="not-needed", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def encoder():
    from attnkit.models.bert import SentenceEncoder

    return SentenceEncoder.from_pretrained("minilm")


# ----------------------------------------------------------------------------- complete(), on a scripted model


class _ScriptedModel:
    """A decoder that 'generates' a fixed list of ids; its tokenizer decodes ids to text pieces,
    and ids 90, 91 are the two bytes of "é" (90 alone decodes to U+FFFD, as a byte-level BPE's would)."""

    PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " ST", 7: "OP", 8: " more", 90: "", 91: ""}

    def __init__(self, script):
        from types import SimpleNamespace

        self.script = script
        self.config = SimpleNamespace(eos_token_id=0)
        self.tokenizer = SimpleNamespace(eos_token_id=0, decode=self.decode)

    def decode(self, ids, skip_special_tokens=False):
        text = "".join("é" if (i, j) == (90, 91) else "" if (k, i) == (90, 91) else
                       "\ufffd" if i == 90 else self.PIECES.get(i, "")
                       for k, i, j in zip([None, *ids], ids, [*ids[1:], None]))
        return text

    def stream(self, ids, max_new_tokens, *args):
        for token in self.script[:max_new_tokens]:
            yield np.array([token])
            if token == 0:
                return


def _run(script, **options):
    from attnkit.serve.openai_models import Completion, complete

    items = list(complete(_ScriptedModel(script), [7, 7], **{"max_tokens": 20, **options}))
    pieces, done = items[:-1], items[-1]
    assert isinstance(done, Completion) and all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == done.text  # the stream is the text, piece by piece
    return pieces, done


def test_complete_holds_back_what_a_stop_string_or_half_a_character_could_change():
    pieces, done = _run([1, 2, 3, 4, 0])
    assert (pieces, done.text, done.finish_reason, done.completion_tokens) == (
        ["Hel", "lo", " wor", "ld"], "Hello world", "stop", 5)  # EOS: "stop", counted, not written
    pieces, done = _run([1, 2, 3, 4, 5], max_tokens=3)
    assert (done.text, done.finish_reason, done.completion_tokens, done.prompt_tokens) == ("Hello wor", "length", 3, 2)
    pieces, done = _run([1, 2, 6, 7, 8, 0], stop=[" STOP"])
    assert (done.text, done.finish_reason, done.completion_tokens) == ("Hello", "stop", 4)
    assert all(" S" not in piece for piece in pieces)  # the start of the stop string was never sent
    pieces, done = _run([1, 90, 91, 2, 0])
    assert done.text == "Helélo" and "\ufffd" not in "".join(pieces)
    pieces, done = _run([1, 2], stop=["lo"])
    assert (done.text, done.finish_reason) == ("Hel", "stop")
    pieces, done = _run([1, 2, 3, 4], stop=["xyz"], cancelled=lambda: True)  # the client went away
    assert done.completion_tokens == 1


# ----------------------------------------------------------------------------- models and embeddings


def test_models_are_listed_and_retrieved(client, openai):
    assert [m.id for m in client.models.list()] == ["minilm", "smollm2"]  # "random" draws attention only
    card = client.models.retrieve("minilm")
    assert (card.id, card.object, card.owned_by) == ("minilm", "model", "attnkit")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found"


def test_embeddings_are_sentence_encoder_embeddings(client, encoder):
    """Short texts run on one thread in both (fewer than 64 tokens a thread), so the same
    float32 operations run in the same order: equal bit for bit. The client asks for base64
    unless told; float and base64 must carry the same numbers."""
    want = encoder.encode(SENTENCES)  # (3, 384)
    default = client.embeddings.create(model="minilm", input=SENTENCES)
    floats = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    for answer in (default, floats):
        got = np.array([d.embedding for d in sorted(answer.data, key=lambda d: d.index)], dtype=np.float32)
        np.testing.assert_array_equal(got, want)
    assert default.model == "minilm"
    counts = [len(e.ids) for e in encoder.tokenizer.encode(SENTENCES)]
    assert default.usage.prompt_tokens == default.usage.total_tokens == sum(counts)
    one = client.embeddings.create(model="minilm", input=SENTENCES[0], encoding_format="float",
                                   dimensions=encoder.dim)
    np.testing.assert_array_equal(np.array(one.data[0].embedding, dtype=np.float32), encoder.encode(SENTENCES[0]))


def test_embeddings_raw_base64_is_little_endian_float32(server, encoder):
    import httpx

    response = httpx.post(server[0] + "/v1/embeddings", json={"model": "minilm", "input": SENTENCES[1],
                                                               "encoding_format": "base64"})
    assert response.status_code == 200
    raw = base64.b64decode(response.json()["data"][0]["embedding"])
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4"), encoder.encode(SENTENCES[1]))


def test_embedding_errors_reach_the_client_as_openai_exceptions(client, openai, encoder):
    cases = [
        (dict(model="gpt-4o", input="hi"), openai.NotFoundError, "model_not_found", "model"),
        (dict(model="random", input="hi"), openai.NotFoundError, "model_not_found", "model"),
        (dict(model="smollm2", input="hi"), openai.BadRequestError, "wrong_model_kind", "model"),
        (dict(model="minilm", input="hi", dimensions=64), openai.BadRequestError, "invalid_value", "dimensions"),
        (dict(model="minilm", input=[[101, 102]]), openai.BadRequestError, "invalid_value", "input"),
        (dict(model="minilm", input=[]), openai.BadRequestError, "invalid_value", "input"),
        (dict(model="minilm", input="word " * 300), openai.BadRequestError, "context_length_exceeded", "input"),
        (dict(model="minilm", input="hi", extra_body={"truncate": True}), openai.BadRequestError,
         "unknown_parameter", "truncate"),
    ]
    for arguments, exception, code, param in cases:
        with pytest.raises(exception) as caught:
            client.embeddings.create(**arguments)
        assert (caught.value.body["code"], caught.value.body["param"]) == (code, param), arguments
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="minilm", input="word " * 300)
    assert f"at most {encoder.max_seq_length}" in caught.value.message  # the limit is stated


# ----------------------------------------------------------------------------- the HTTP layer


def test_the_api_passes_the_page_checks_and_answers_in_openai_shape(openai):
    """Host check, JSON only, a bounded body, strict JSON, no other site's page, the key."""
    from fastapi.testclient import TestClient

    from attnkit.serve.server import create_app

    app = create_app(models=["minilm"], allowed_hosts=["127.0.0.1", "localhost"], api_key="sesame",
                     api_max_body=1000)
    web = TestClient(app, base_url="http://127.0.0.1:8000")
    key = {"authorization": "Bearer sesame"}

    def error(response, status):
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["message"]
        return body

    assert error(web.get("/v1/models"), 401)["code"] == "invalid_api_key"
    assert web.get("/v1/models", headers=key).status_code == 200
    assert web.get("/v1/models", headers={**key, "host": "evil.example"}).status_code == 400
    assert error(web.get("/v1/models", headers={**key, "origin": "http://evil.example"}), 403)["type"] \
        == "permission_error"
    assert web.get("/v1/models", headers={**key, "origin": "http://127.0.0.1:8000"}).status_code == 200
    post = lambda content, content_type="application/json": web.post(  # noqa: E731
        "/v1/embeddings", content=content, headers={**key, "content-type": content_type})
    assert error(post('{"model": "minilm", "input": "a"}', "text/plain"), 415)["code"] == "unsupported_media_type"
    assert error(post('{"model": "minilm", "input": "' + "a" * 30000 + '"}'), 413)["code"] == "request_too_large"
    assert "finite" in error(post('{"model": "minilm", "input": NaN}'), 400)["message"]
    assert error(post('{"model": "minilm"}'), 400)["param"] == "input"
    assert error(web.get("/v1/nowhere", headers=key), 404)["code"] == "unknown_url"
    # the page's own API keeps its shape
    assert web.post("/api/attention", content="{}", headers={"content-type": "text/plain"}).json()["detail"]


def test_the_page_api_states_each_models_token_limit(openai, encoder):
    from fastapi.testclient import TestClient

    from attnkit.serve.server import create_app

    web = TestClient(create_app(models=["minilm", "random"], max_chars=50, max_tokens=300))
    limits = {m["name"]: m["max_tokens"] for m in web.get("/api/models").json()}
    assert limits == {"minilm": min(300, encoder.max_seq_length), "random": 300}
    too_long = web.post("/api/attention", json={"text": "x" * 51, "model": "random"})
    assert too_long.status_code == 413 and "at most 50" in too_long.json()["detail"]


def test_a_wrong_key_raises_authentication_error_in_the_client(openai):
    """The same app over a real socket: the client maps 401 to its AuthenticationError."""
    from attnkit.serve.server import BackgroundServer, create_app

    with BackgroundServer(create_app(models=["minilm"], api_key="sesame")) as running:
        url = running.url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in openai.OpenAI(base_url=url, api_key="sesame", max_retries=0).models.list()] == ["minilm"]


# ----------------------------------------------------------------------------- completions and chat

PROMPT = "The three primary colours are"
QUESTION = [{"role": "user", "content": "Name three colours."}]


def _stream_text(stream) -> tuple[str, str | None, list]:
    """The text of a streamed answer, its finish_reason, and its chunks."""
    chunks = list(stream)
    pieces, finish = [], None
    for chunk in chunks:
        for choice in chunk.choices:
            piece = getattr(choice, "delta", None)
            pieces.append((piece.content or "") if piece is not None else choice.text)
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, chunks


@pytest.mark.slow
def test_chat_streamed_equals_not_streamed_and_limits_say_length(client):
    answer = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=12)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 12
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12
    text, finish, chunks = _stream_text(client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_completion_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert (text, finish) == (choice.message.content, "length")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # sampling with a seed: the same seed, the same text, streamed or not
    sampled = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0.9, top_p=0.95,
                                             seed=11, max_tokens=12)
    text, _, _ = _stream_text(client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0.9, top_p=0.95, seed=11, max_tokens=12, stream=True))
    assert text == sampled.choices[0].message.content


@pytest.mark.slow
def test_greedy_answers_are_attnkit_generate_answers(client, server, monkeypatch):
    """`attnkit generate` (and `--chat`) on the same model prints the same greedy text."""
    from typer.testing import CliRunner

    from attnkit.cli import app as cli_app
    from attnkit.models.auto import AutoCausalLM
    from attnkit.viz.text import printable

    served = server[1].state.models.get("smollm2")  # the very weights the server answers with
    monkeypatch.setattr(AutoCausalLM, "from_pretrained", staticmethod(lambda path=None: served))
    runner = CliRunner()

    completion = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=10)
    result = runner.invoke(cli_app, ["generate", PROMPT, "-n", "10"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(PROMPT + printable(completion.choices[0].text, lines=True) + "\n")

    chat = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=10)
    result = runner.invoke(cli_app, ["generate", "--chat", QUESTION[0]["content"], "-n", "10"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(printable(chat.choices[0].message.content, lines=True) + "\n")


@pytest.mark.slow
def test_stop_sequences_end_the_text_before_them(client):
    full = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=16).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]  # a stop string that starts inside the generated text
    want = full[: full.index(stop)]
    for stops in (stop, ["never written", stop]):
        answer = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=16, stop=stops)
        assert (answer.choices[0].text, answer.choices[0].finish_reason) == (want, "stop")
        text, finish, _ = _stream_text(client.completions.create(
            model="smollm2", prompt=PROMPT, temperature=0, max_tokens=16, stop=stops, stream=True))
        assert (text, finish) == (want, "stop")


@pytest.mark.slow
def test_generation_errors_reach_the_client_as_openai_exceptions(client, openai):
    cases = [
        (dict(messages=QUESTION, n=99), "n"),  # more choices than --max-batch
        (dict(messages=QUESTION, n=0), "n"),
        (dict(messages=QUESTION, max_tokens=65), "max_tokens"),  # this server's --max-new-tokens is 64
        (dict(messages=QUESTION, temperature=2.5), "temperature"),
        (dict(messages=QUESTION, presence_penalty=0.5), "presence_penalty"),
        (dict(messages=QUESTION, top_logprobs=3), "top_logprobs"),  # without logprobs: true
        (dict(messages=QUESTION, logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(messages=QUESTION, extra_body={"attnkit": {"attention": {"layers": [99]}}}), "attnkit"),
        (dict(messages=QUESTION, extra_body={"attnkit": {"logit_lens": {"top": 0}}}), "attnkit"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": "word " * 9000}], max_tokens=4), "messages"),
        (dict(messages=QUESTION, stop=["a", "b", "c", "d", "e"]), "stop"),
    ]
    for arguments, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="smollm2", **arguments)
        assert caught.value.body["param"] == param, (arguments, caught.value.body)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="minilm", prompt="hi")
    assert caught.value.body["code"] == "wrong_model_kind"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi")


@pytest.mark.slow
def test_concurrent_clients_get_what_each_gets_alone(client):
    """Eight requests at once (chat, completions, streamed or not, sampled with seeds, and
    embeddings) each get exactly the answer the same request gets alone."""

    def chat(seed, stream):
        arguments = dict(model="smollm2", messages=QUESTION, temperature=0.8, seed=seed, max_tokens=8)
        if stream:
            return _stream_text(client.chat.completions.create(stream=True, **arguments))[:2]
        choice = client.chat.completions.create(**arguments).choices[0]
        return choice.message.content, choice.finish_reason

    def complete(seed):
        choice = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0.8, seed=seed,
                                           max_tokens=8).choices[0]
        return choice.text, choice.finish_reason

    def embed(i):
        return client.embeddings.create(model="minilm", input=SENTENCES[i % 3:], encoding_format="float").model_dump()

    jobs = [lambda s=s: chat(s, s % 2 == 0) for s in range(4)] + [lambda s=s: complete(s) for s in range(2)] \
        + [lambda i=i: embed(i) for i in range(2)]
    alone = [job() for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: job(), jobs))
    assert together == alone
    assert len({text for text, _ in alone[:4]}) > 1  # the seeds made different texts: the check can fail


# ----------------------------------------------------------------------------- a decoder given by its path

def test_a_decoder_given_by_its_path_answers_as_attnkit_generate(openai, tiny_folder):
    from typer.testing import CliRunner

    from attnkit.cli import app as cli_app
    from attnkit.serve.server import BackgroundServer, create_app
    from attnkit.viz.text import printable

    name = str(tiny_folder)
    with BackgroundServer(create_app(models=[name, "random"], max_new_tokens=32)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == [name] and client.models.retrieve(name).id == name
        runner = CliRunner()
        completion = client.completions.create(model=name, prompt="the", temperature=0, max_tokens=12).choices[0]
        result = runner.invoke(cli_app, ["generate", "the", "--model", name, "-n", "12"])
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith("the" + printable(completion.text, lines=True) + "\n")
        chat = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=12)
        result = runner.invoke(cli_app, ["generate", "--chat", QUESTION[0]["content"], "--model", name, "-n", "12"])
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(printable(chat.choices[0].message.content, lines=True) + "\n")
        streamed = _stream_text(client.chat.completions.create(model=name, messages=QUESTION, temperature=0,
                                                               max_tokens=12, stream=True))
        assert streamed[:2] == (chat.choices[0].message.content, chat.choices[0].finish_reason)
        with pytest.raises(openai.BadRequestError) as caught:  # its context is 128 tokens
            client.completions.create(model=name, prompt="the " * 120, max_tokens=20)
        assert caught.value.body["code"] == "context_length_exceeded" and "128" in caught.value.message


# ----------------------------------------------------------------------------- the command line


def _serve(monkeypatch, *args):
    """Run `attnkit serve ARGS` up to the point it would serve; returns (result, the app)."""
    from typer.testing import CliRunner

    import attnkit.cli.viz as cli_viz
    from attnkit.cli import app as cli_app

    seen = {}

    def run(application, sock):
        seen.update(app=application)
        sock.close()

    monkeypatch.setattr(cli_viz, "_run_server", run)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return CliRunner().invoke(cli_app, ["serve", "--port", str(port), *args]), seen.get("app"), port


def test_serve_on_every_address_prints_urls_a_browser_opens(monkeypatch, openai):
    result, app, port = _serve(monkeypatch, "--host", "0.0.0.0", "-m", "random")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"attnkit: open http://127.0.0.1:{port}/ (Ctrl+C to stop)"
    assert f"attnkit: from other machines: http://{socket.gethostname()}:{port}/" in lines
    assert "0.0.0.0" not in result.stdout
    assert "other machines can reach this page and its API (--api-key)" in result.stderr


def test_serve_api_key_and_new_token_limit_reach_the_api(monkeypatch, openai):
    from fastapi.testclient import TestClient

    result, app, port = _serve(monkeypatch, "-m", "minilm", "--api-key", "sesame", "--max-new-tokens", "7")
    assert result.exit_code == 0, result.output
    web = TestClient(app, base_url=f"http://127.0.0.1:{port}")
    assert web.get("/v1/models").status_code == 401
    assert [m["id"] for m in web.get("/v1/models", headers={"authorization": "Bearer sesame"}).json()["data"]] \
        == ["minilm"]
    result, _, _ = _serve(monkeypatch, "-m", "minilm", "--max-new-tokens", "0")
    assert result.exit_code == 2 and "--max-new-tokens" in result.output


def test_serve_preload_loads_the_models_before_serving(monkeypatch, openai):
    result, app, _ = _serve(monkeypatch, "-m", "minilm", "-m", "random", "--preload")
    assert result.exit_code == 0, result.output
    pool = app.state.models
    assert list(pool.kinds) == ["minilm"] and pool.is_loaded("minilm")


def test_serve_engine_options_reach_the_engines(monkeypatch, openai):
    result, app, _ = _serve(monkeypatch, "-m", "minilm", "--max-batch", "3", "--kv-tokens", "512",
                            "--step-tokens", "32")
    assert result.exit_code == 0, result.output
    assert app.state.models.engine_options == dict(max_batch=3, kv_tokens=512, step_tokens=32, max_queue=64)
    for option in ("--max-batch", "--kv-tokens", "--step-tokens"):
        result, _, _ = _serve(monkeypatch, "-m", "minilm", option, "0")
        assert result.exit_code == 2 and option in result.output
