"""What every request to `attnkit serve` goes through, the page's API and the OpenAI API alike.

- `HostCheck`: only requests addressed to this machine's own names are answered (a page
  of another site that rebinds its DNS name to 127.0.0.1 gets 400).
- `check_origin`: a request that a browser sends from a page of another origin (scheme,
  host and port, as browsers define an origin) gets 403; requests without an `Origin`
  header (the openai client, curl) and the page's own requests pass.
- `check_json_content_type`: only `application/json` bodies are read (415 otherwise): a page
  of another site can make a browser post a form or `text/plain` without asking, not JSON.
- `read_body`: at most `max_body` bytes (413 beyond, counted as they arrive).
- `parse_json`: strict JSON (no NaN or Infinity, UTF-8 only, not nested too deep).

The checks raise `RequestRejected(status, message)`; each API turns it into its own error
shape (the page's `{"detail": ...}`, OpenAI's `{"error": {...}}`).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

__all__ = ["HostCheck", "RequestRejected", "check_json_content_type", "check_origin", "host_name", "origin_of",
           "parse_json", "read_body"]

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def host_name(header: str) -> str:
    """The host of a Host header, lower case, without port or brackets: '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal, with or without a port
        end = header.find("]")
        return header[1:end] if end > 0 else ""
    if header.count(":") == 1:  # name:port
        header = header.split(":")[0]
    return header.rstrip(".")


def origin_of(scheme: str, authority: str) -> tuple[str, str, int | None]:
    """An origin as browsers compare it: (scheme, host, port), lower case, the scheme's default
    port filled in: ('http', '127.0.0.1:80') and ('http', '127.0.0.1') are the same origin."""
    scheme, authority = scheme.strip().lower(), authority.strip().lower()
    port: int | None = None
    rest = authority[authority.find("]") + 1:] if authority.startswith("[") else authority
    if rest.count(":") == 1:
        digits = rest.split(":")[1]
        port = int(digits) if digits.isdigit() else -1  # -1: a port no server has
    return scheme, host_name(authority), DEFAULT_PORTS.get(scheme) if port is None else port


def check_origin(origin: str | None, scheme: str, host: str) -> None:
    """Refuse a request from a browser page of another origin than this server's.

    Arguments:
        origin: the request's `Origin` header, or None (no browser page sent it).
        scheme: the scheme the request came in on ("http").
        host: the request's `Host` header ("127.0.0.1:8000").

    Raises:
        RequestRejected: 403 when the Origin's scheme, host or port differ from this
            server's, or the Origin is "null" (a sandboxed page, a file).
    """
    if origin is None:
        return
    scheme_part, separator, authority = origin.partition("://")
    theirs = origin_of(scheme_part, authority.split("/", 1)[0]) if separator else None
    if theirs is None or theirs != origin_of(scheme, host):
        raise RequestRejected(403, f"requests from the page of another site ({origin}) are refused; "
                                   f"this server is {scheme}://{host}")


class HostCheck:
    """ASGI middleware: answer only requests whose Host is one of `allowed` (others get 400).

    Unlike a plain split at the first ':', it reads IPv6 literals ('[::1]:8000').
    """

    def __init__(self, app: Any, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = {host_name(h) if h.startswith("[") else h.lower() for h in allowed}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed:
                from starlette.responses import PlainTextResponse

                await PlainTextResponse("Invalid host header", status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestRejected(Exception):
    """A request refused before it is read: `status` (413, 415, 422) and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_json_content_type(header: str | None) -> None:
    """Only `application/json` (any parameters) is read: a page of another site can make a
    browser send a "simple" request (text/plain, a form) with no preflight, and so make this
    server compute; a JSON request from another origin needs a CORS preflight, never granted.

    Raises:
        RequestRejected: 415, naming the content type that came.
    """
    media_type = (header or "").split(";")[0].strip().lower()
    if media_type != "application/json":
        got = repr(header) if header else "none"
        raise RequestRejected(415, f"expected Content-Type: application/json, got {got}")


async def read_body(request: Any, max_body: int) -> bytes:
    """The body of a Starlette request, at most `max_body` bytes.

    Raises:
        RequestRejected: 413 when the declared length or the bytes that arrive pass `max_body`.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body:
        raise RequestRejected(413, f"the request has {declared} bytes; this server accepts at most {max_body}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise RequestRejected(413, f"the request is larger than {max_body} bytes, the most this server accepts")
        chunks.append(chunk)
    return b"".join(chunks)


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    raise _NonFinite(name)


def parse_json(body: bytes) -> Any:
    """Strict JSON: raises ValueError (with a message for the client) on NaN, Infinity,
    bytes that are not UTF-8, nesting too deep, or anything that is not JSON."""
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except _NonFinite as error:
        raise ValueError(f"expected finite JSON numbers, got {error}") from None
    except RecursionError:
        raise ValueError("expected a JSON object, got one nested too deep") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"expected a UTF-8 body, got byte 0x{body[error.start]:02x} at offset {error.start}") from None
    except ValueError as error:
        raise ValueError(f"expected a JSON object: {error}") from None
