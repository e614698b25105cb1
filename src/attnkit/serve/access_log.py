"""One line per request, in uvicorn's access-log style plus the time it took:

    127.0.0.1:53412 - "POST /v1/chat/completions HTTP/1.1" 200 OK 1.84 s

`AccessLog` is ASGI middleware that writes these lines to the logger `attnkit.serve.access`
(at INFO) when a response has been sent, streamed ones included (their time is the whole
stream's). The library only logs; `attnkit serve` shows the logger on stderr.
"""

from __future__ import annotations

import logging
import time
from http import HTTPStatus
from typing import Any
from urllib.parse import quote

__all__ = ["ACCESS_LOGGER", "AccessLog", "access_line"]

ACCESS_LOGGER = "attnkit.serve.access"
"""The logger the request lines go to (`logging.getLogger(ACCESS_LOGGER)`)."""


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def access_line(scope: dict, status: int | None, seconds: float) -> str:
    """The log line of one request: client, method, path (and query, control characters
    escaped), HTTP version, status and its phrase, time taken. `status` None: the client
    went away before an answer started."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    path = quote(scope.get("root_path", "") + scope.get("path", ""), safe="/:@!$&'()*+,;=-._~%")
    query = scope.get("query_string", b"")
    if query:
        path += "?" + quote(query.decode("latin-1"), safe="/:@!$&'()*+,;=-._~%?")
    if status is None:
        answer = "- (no answer: the client went away)"
    else:
        try:
            answer = f"{status} {HTTPStatus(status).phrase}"
        except ValueError:
            answer = str(status)
    version = scope.get("http_version", "1.1")
    return f'{who} - "{scope.get("method", "GET")} {path} HTTP/{version}" {answer} {_duration(seconds)}'


class AccessLog:
    """ASGI middleware: log one `access_line` per HTTP request once its response is sent."""

    def __init__(self, app: Any, logger: logging.Logger | None = None) -> None:
        self.app = app
        self.logger = logger or logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: list[int] = []

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if self.logger.isEnabledFor(logging.INFO):
                self.logger.info(access_line(scope, status[0] if status else None, time.perf_counter() - start))
