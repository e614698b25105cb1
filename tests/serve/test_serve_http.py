"""The server's HTTP layer without a real model: the Origin check (an origin is scheme, host
and port, as browsers say), `stop`'s error message, and the access log's lines."""

from __future__ import annotations

import logging

import pytest

from attnkit.serve.access_log import ACCESS_LOGGER, access_line
from attnkit.serve.http_checks import RequestRejected, check_origin, origin_of


def test_an_origin_is_scheme_host_and_port():
    assert origin_of("http", "127.0.0.1") == origin_of("http", "127.0.0.1:80") == ("http", "127.0.0.1", 80)
    assert origin_of("HTTPS", "LocalHost:443") == ("https", "localhost", 443)
    assert origin_of("http", "[::1]:8000") == ("http", "::1", 8000)
    assert origin_of("http", "[::1]") == ("http", "::1", 80)


@pytest.mark.parametrize("origin", [
    "http://127.0.0.1:8001",  # another port of the same host: another origin
    "https://127.0.0.1:8000",  # another scheme
    "http://localhost:8000",  # another name for the same machine: another origin too
    "http://evil.example",
    "null",  # a sandboxed page or a file
    "127.0.0.1:8000",
])
def test_another_origin_is_refused(origin):
    with pytest.raises(RequestRejected) as caught:
        check_origin(origin, "http", "127.0.0.1:8000")
    assert caught.value.status == 403 and origin in caught.value.message


@pytest.mark.parametrize("origin", [None, "http://127.0.0.1:8000", "http://127.0.0.1:8000/", "HTTP://127.0.0.1:8000"])
def test_this_servers_own_origin_and_no_origin_pass(origin):
    check_origin(origin, "http", "127.0.0.1:8000")
    check_origin(None if origin is None else origin.replace(":8000", ""), "http", "127.0.0.1:80")


@pytest.fixture
def web():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from attnkit.serve.server import create_app

    app = create_app(models=["random"], allowed_hosts=["127.0.0.1"])
    return TestClient(app, base_url="http://127.0.0.1:8000")


def test_both_apis_refuse_another_port_of_the_same_host(web):
    """The docstrings and docs/serve.md say another origin is refused: another port is one."""
    other = {"origin": "http://127.0.0.1:9999"}
    answer = web.get("/v1/models", headers=other)
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "cross_origin"
    assert web.get("/v1/models", headers={"origin": "http://127.0.0.1:8000"}).status_code == 200
    page = web.post("/api/attention", json={"text": "a b c", "model": "random"}, headers=other)
    assert page.status_code == 403 and "another site" in page.json()["detail"]
    own = web.post("/api/attention", json={"text": "a b c", "model": "random"},
                   headers={"origin": "http://127.0.0.1:8000"})
    assert own.status_code == 200, own.text


@pytest.mark.parametrize("stop", [[1], 1, [["a"]], {"a": 1}, ["a", None]])
def test_stop_that_is_not_text_says_what_stop_takes(stop):
    pytest.importorskip("pydantic")
    from attnkit.serve.openai_requests import APIError, parse_request, request_models, sampling_arguments

    _, CompletionRequest, _ = request_models()
    with pytest.raises(APIError) as caught:
        sampling_arguments(parse_request(CompletionRequest, {"model": "m", "prompt": "p", "stop": stop}))
    error = caught.value
    assert (error.status, error.param) == (400, "stop")
    assert "a string or a list of strings" in error.message and repr(stop)[:20] in error.message


def test_stop_as_text_is_read():
    pytest.importorskip("pydantic")
    from attnkit.serve.openai_requests import parse_request, request_models, sampling_arguments

    _, CompletionRequest, _ = request_models()
    read = lambda stop: sampling_arguments(  # noqa: E731
        parse_request(CompletionRequest, {"model": "m", "prompt": "p", "stop": stop}))["stop"]
    assert read("x") == ["x"] and read(["x", "y"]) == ["x", "y"] and read(None) == []


def test_every_request_is_logged_with_method_path_status_and_time(web, caplog):
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        web.get("/v1/models")
        web.get("/nowhere?q=1")
        web.get("/v1/models", headers={"host": "evil.example"})  # refused by the Host check: logged too
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert len(lines) == 3, lines
    assert '"GET /v1/models HTTP/1.1" 200 OK' in lines[0] and lines[0].endswith(" ms")
    assert '"GET /nowhere?q=1 HTTP/1.1" 404 Not Found' in lines[1]
    assert '"GET /v1/models HTTP/1.1" 400 Bad Request' in lines[2]


def test_an_access_line_escapes_what_a_client_sent():
    scope = {"client": ("127.0.0.1", 5), "method": "GET", "path": "/a\x1b[31m b", "query_string": b"x=\n",
             "http_version": "1.1"}
    line = access_line(scope, 200, 1.5)
    assert line == '127.0.0.1:5 - "GET /a%1B%5B31m%20b?x=%0A HTTP/1.1" 200 OK 1.50 s'
    assert "no answer" in access_line(scope, None, 0.01)


def test_serve_shows_the_access_log_on_stderr(monkeypatch):
    """`attnkit serve` puts the request lines on stderr (and `--no-access-log` does not)."""
    pytest.importorskip("fastapi")
    import socket

    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    import attnkit.cli.viz as cli_viz
    from attnkit.cli import app as cli_app

    logger = logging.getLogger(ACCESS_LOGGER)
    saved = (logger.handlers[:], logger.level, logger.propagate)
    seen = {}

    def run(application, sock):
        sock.close()
        TestClient(application, base_url=seen["url"]).get("/v1/models")

    monkeypatch.setattr(cli_viz, "_run_server", run)
    try:
        for flag, expected in (("--access-log", 1), ("--no-access-log", 0)):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            seen["url"] = f"http://127.0.0.1:{port}"
            result = CliRunner().invoke(cli_app, ["serve", "--port", str(port), "-m", "random", flag])
            assert result.exit_code == 0, result.output
            assert result.stderr.count('"GET /v1/models HTTP/1.1" 200 OK') == expected, result.stderr
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
