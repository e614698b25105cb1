"""`attnkit serve`: a local page to type a sentence, pick a model and explore its attention.

Built on FastAPI (imported only here; `pip install 'attnkit[serve]'`). The page
is the same viewer as the HTML file, in server mode: it posts the text to
`/api/attention` on its own origin and draws the answer. Inputs are capped:
at most `max_chars` characters (longer requests are refused with 413) and at
most `max_tokens` tokens (longer texts are truncated, with a warning).

`/api/attention` reads only requests that say `Content-Type: application/json`
(others get 415): a page of another site can make a browser post a form or
`text/plain` to a local server without asking, but not JSON.

The body of `/api/attention` is read as strict JSON: `NaN` and `Infinity`
(which Python's parser would accept) and text that is not valid Unicode get
422, a body larger than any allowed request gets 413, never 500.
"""


import json
from typing import Any, Sequence

from attnkit.viz.html import content_security_policy, payload, render_page
from attnkit.viz.providers import (
    DEFAULT_MAX_TOKENS,
    PROVIDERS,
    ModelNotAvailableError,
    availability,
    get_provider,
)
from attnkit.viz.text import utf8_problem

DEFAULT_MAX_CHARS = 2000
EXAMPLE = "The cat sat on the mat because it was tired."
"""The sentence the page opens with (already drawn with the first installed model)."""


def host_name(header: str) -> str:
    """The host of a Host header, lower case, without port or brackets: '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal, with or without a port
        end = header.find("]")
        return header[1:end] if end > 0 else ""
    if header.count(":") == 1:  # name:port
        header = header.split(":")[0]
    return header.rstrip(".")


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


def create_app(
    *,
    models: Sequence[str] = ("minilm", "smollm2", "random"),
    max_chars: int = DEFAULT_MAX_CHARS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    allowed_hosts: Sequence[str] | None = None,
) -> Any:
    """The FastAPI application behind `attnkit serve`.

    Arguments:
        models: the provider names the page offers (minilm, smollm2, random, or paths).
        max_chars: longer texts are refused (HTTP 413).
        max_tokens: longer tokenizations are truncated, with a warning in the answer.
        allowed_hosts: Host headers to answer (others get 400), which stops DNS-rebinding
            pages from reading a local server; None answers any host.
    """
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import HTMLResponse, Response
    from pydantic import BaseModel, ValidationError
    from starlette.concurrency import run_in_threadpool

    if max_chars < 1 or max_tokens < 1:
        raise ValueError(f"expected max_chars and max_tokens >= 1, got {max_chars} and {max_tokens}")
    models = list(models)
    if not models:
        raise ValueError("expected at least one model name, got none")

    class AttentionRequest(BaseModel):
        text: str
        model: str = models[0]
        layer: int = 0
        head: int = 0

    app = FastAPI(title="attnkit", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=list(allowed_hosts))
    # The largest body a valid request can have: every character escaped as a
    # surrogate pair (12 bytes), plus room for the other fields.
    max_body = 12 * max_chars + 4096
    headers = {
        "Content-Security-Policy": content_security_policy(server=True),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
    }

    def model_list() -> list[dict[str, Any]]:
        out = []
        for name in models:
            ok, reason = availability(name)
            info = PROVIDERS.get(name)
            out.append({
                "name": name,
                "available": ok,
                "description": info.description if info else name,
                "reason": reason,
            })
        return out

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        config = {
            "mode": "server",
            "title": "attnkit: explore attention",
            "subtitle": "Type a sentence, pick a model, and see where every head attends. "
            f"At most {max_chars} characters and {max_tokens} tokens.",
            "models": model_list(),
            "max_chars": max_chars,
            "example": EXAMPLE if len(EXAMPLE) <= max_chars else "",  # drawn as soon as the page opens
            "docs": [],
        }
        return HTMLResponse(render_page(config, server=True), headers=headers)

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/api/models")
    def api_models() -> list[dict[str, Any]]:
        return model_list()

    def check_json_content_type(header: str | None) -> None:
        """Only `application/json` (any parameters) is read: a page of another site can make a
        browser send a "simple" request (text/plain, a form) with no preflight, and so make this
        server compute; a JSON request from another origin needs a CORS preflight, never granted."""
        media_type = (header or "").split(";")[0].strip().lower()
        if media_type != "application/json":
            got = repr(header) if header else "none"
            raise HTTPException(415, f"expected Content-Type: application/json, got {got}")

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body:
            raise HTTPException(413, f"the request has {declared} bytes; this server accepts at most {max_body}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise HTTPException(413, f"the request is larger than {max_body} bytes, the most this server accepts")
            chunks.append(chunk)
        return b"".join(chunks)

    def parse_request(body: bytes) -> AttentionRequest:
        try:
            data = parse_json(body)
            return AttentionRequest.model_validate(data)
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in e['loc']) or 'body'}: {e['msg']}" for e in error.errors()
            )
            raise HTTPException(422, f"expected {{text, model, layer, head}}: {problems}") from None
        except ValueError as error:
            raise HTTPException(422, str(error)) from None

    def attention(request: AttentionRequest) -> dict[str, Any]:
        if request.model not in models:
            raise HTTPException(400, f"unknown model {request.model!r}; this server offers: {', '.join(models)}")
        if not request.text.strip():
            raise HTTPException(422, "expected a non-empty text, got an empty one")
        problem = utf8_problem(request.text)
        if problem:
            raise HTTPException(422, f"expected Unicode text, got a {problem}")
        if len(request.text) > max_chars:
            raise HTTPException(
                413, f"the text has {len(request.text)} characters; this server accepts at most {max_chars}"
            )
        try:
            provider = get_provider(request.model, max_tokens=max_tokens)
            maps = provider.attention(request.text)
            answer = payload(
                maps,
                layer=min(max(request.layer, 0), maps.num_layers - 1),
                head=min(max(request.head, 0), maps.num_heads - 1),
                level=1,  # fast rather than small: the answer only crosses this machine
            )
        except ModelNotAvailableError as error:
            raise HTTPException(503, str(error)) from error
        except (ValueError, TypeError) as error:
            raise HTTPException(422, str(error)) from error
        answer["warnings"] = (
            [f"The text was truncated to {maps.num_tokens} tokens (it had {maps.truncated_from})."]
            if maps.truncated_from
            else []
        )
        return answer

    @app.post("/api/attention")
    async def api_attention(request: Request) -> dict[str, Any]:
        check_json_content_type(request.headers.get("content-type"))
        parsed = parse_request(await read_body(request))
        return await run_in_threadpool(attention, parsed)  # the model runs off the event loop

    return app
