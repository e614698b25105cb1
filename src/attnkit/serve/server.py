"""`attnkit serve`: a local page to type a sentence, pick a model and explore its attention,
and an OpenAI-compatible API beside it (`attnkit.serve.openai_api`).

Built on FastAPI (imported only here; `pip install 'attnkit[serve]'`). The page
is the same viewer as the HTML file, in server mode: it posts the text to
`/api/attention` on its own origin and draws the answer. Inputs are capped:
at most `max_chars` characters (longer requests are refused with 413; the page
says so before it sends one) and at most `max_tokens` tokens, or fewer where
the model reads fewer (MiniLM: 256); longer texts are truncated, with a warning.

`/api/attention` reads only requests that say `Content-Type: application/json`
(others get 415): a page of another site can make a browser post a form or
`text/plain` to a local server without asking, but not JSON. A request whose `Origin`
is not this server's (scheme, host and port, as browsers compare origins: another port
of the same host is another origin) is refused with 403, here and in the API.

`/api/attention` draws the attention weights, or a map derived from them (its `kind`:
"rollout", "flow" or "value-weighted", see `attnkit.viz.derived`). Attention flow solves
layers x tokens² maximum-flow problems; a request for more than `max_flow_problems` of them
is refused with 413 (rollout is immediate on any text). Value-weighted maps reuse the model
the page already loaded (`Provider.model`).

The body of `/api/attention` is read as strict JSON: `NaN` and `Infinity`
(which Python's parser would accept) and text that is not valid Unicode get
422, a body larger than any allowed request gets 413, never 500.
"""


from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from attnkit.viz.derived import DESCRIPTIONS, KINDS, derive
from attnkit.viz.html import content_security_policy, payload, render_page
from attnkit.serve.access_log import AccessLog
from attnkit.serve.http_checks import (  # noqa: F401 - host_name, HostCheck, parse_json: public here too
    HostCheck,
    RequestRejected,
    check_json_content_type,
    check_origin,
    host_name,
    parse_json,
    read_body,
)
from attnkit.serve.engine import DEFAULT_KV_TOKENS, DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_STEP_TOKENS
from attnkit.serve.openai_api import add_openai_api
from attnkit.serve.openai_models import ModelPool
from attnkit.viz.providers import (
    DEFAULT_MAX_TOKENS,
    PROVIDERS,
    ModelNotAvailableError,
    availability,
    get_provider,
)
from attnkit.viz.text import utf8_problem

DEFAULT_MAX_CHARS = 2000
DEFAULT_MAX_NEW_TOKENS = 1024
"""The most tokens one completion of the OpenAI API generates, unless `attnkit serve --max-new-tokens` says."""
API_MAX_BODY = 16 * 2**20
"""The largest body of an OpenAI API request (16 MiB: 2,048 embedding inputs of a few thousand characters)."""
FLOW_MAX_PROBLEMS = 2000
"""The most maximum-flow problems (layers x tokens²) one attention-flow request may ask for:
about 5 s for 6 layers x 18 tokens, 25 s for 30 layers x 8 tokens on one core; cost grows faster
than the count."""
EXAMPLE = "The cat sat on the mat because it was tired."
"""The sentence the page opens with (already drawn with the first installed model)."""


@lru_cache(maxsize=64)
def _encoder_limit(name: str) -> int | None:
    """The most tokens an encoder reads (its max_seq_length), read from its config files
    without loading its weights; None when `name` is no encoder attnkit runs."""
    from attnkit.models.checkpoint import read_config
    from attnkit.models.embedded import ENCODER, embedded_path
    from attnkit.models.sentence_head import read_max_seq_length, read_modules, read_transformer_settings
    from attnkit.serve.openai_models import EMBEDDINGS, model_kind

    if model_kind(name) != EMBEDDINGS:
        return None
    try:
        folder = Path(embedded_path(name, ENCODER) or name).expanduser()
        modules = read_modules(folder)
        encoder_folder = folder if modules is None else modules[0].folder
        positions = int(read_config(encoder_folder)["max_position_embeddings"])
        return read_max_seq_length(encoder_folder, read_transformer_settings(encoder_folder), positions)
    except (ImportError, OSError, ValueError, KeyError, TypeError):
        return None


def token_limit(name: str, max_tokens: int) -> int:
    """The most tokens the page draws for model `name`: `max_tokens`, or fewer where the
    model reads fewer (an encoder's max_seq_length: all-MiniLM-L6-v2's is 256)."""
    own = _encoder_limit(name)
    return max_tokens if own is None else min(own, max_tokens)


def create_app(
    *,
    models: Sequence[str] = ("minilm", "smollm2", "random"),
    max_chars: int = DEFAULT_MAX_CHARS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    allowed_hosts: Sequence[str] | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    api_key: str | None = None,
    api_max_body: int = API_MAX_BODY,
    max_flow_problems: int = FLOW_MAX_PROBLEMS,
    max_batch: int = DEFAULT_MAX_BATCH,
    kv_tokens: int = DEFAULT_KV_TOKENS,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    max_queue: int = DEFAULT_MAX_QUEUE,
) -> Any:
    """The FastAPI application behind `attnkit serve`: the page, its `/api/attention`, and
    the OpenAI-compatible API under `/v1` (`attnkit.serve.openai_api`).

    Arguments:
        models: the provider names the page offers (minilm, smollm2, random, or paths); the
            encoders and decoders among them are the API's models (`app.state.models`, a
            `ModelPool`; they load on the first request that names them).
        max_chars: longer texts are refused by the page's API (HTTP 413).
        max_tokens: longer tokenizations are truncated, with a warning in the answer.
        allowed_hosts: Host headers to answer (others get 400), which stops DNS-rebinding
            pages from reading a local server; None answers any host.
        max_new_tokens: the most tokens one completion of the API generates (its default
            when a request gives no max_tokens).
        api_key: when given, the API answers only requests with `Authorization: Bearer <api_key>`.
        api_max_body: the largest body of an API request, in bytes (HTTP 413 beyond).
        max_flow_problems: the most maximum-flow problems (layers x tokens²) an attention-flow
            request may ask for (HTTP 413 beyond, with a message that suggests rollout).
        max_batch, kv_tokens, step_tokens, max_queue: each decoder's `Engine`
            (`attnkit.serve.engine`): choices decoded together (also the most `n`), tokens its
            paged KV cache holds, the most rows of one step, requests that may wait (429 beyond).
    """
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import HTMLResponse, Response
    from pydantic import BaseModel, ValidationError
    from starlette.concurrency import run_in_threadpool

    if max_chars < 1 or max_tokens < 1 or max_new_tokens < 1 or max_flow_problems < 1:
        raise ValueError(f"expected max_chars, max_tokens, max_new_tokens and max_flow_problems >= 1, got "
                         f"{max_chars}, {max_tokens}, {max_new_tokens} and {max_flow_problems}")
    if max_batch < 1 or step_tokens < 1 or kv_tokens < 16 or max_queue < 0:
        raise ValueError(f"expected max_batch >= 1, step_tokens >= 1, kv_tokens >= 16 and max_queue >= 0, got "
                         f"{max_batch}, {step_tokens}, {kv_tokens} and {max_queue}")
    models = list(models)
    if not models:
        raise ValueError("expected at least one model name, got none")

    class AttentionRequest(BaseModel):
        text: str
        model: str = models[0]
        layer: int = 0
        head: int = 0
        kind: str = "attention"  # one of attnkit.viz.derived.KINDS
        # layer and head: the first selection; out of range is clamped, a negative layer counts from the end

    app = FastAPI(title="attnkit", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=list(allowed_hosts))
    app.add_middleware(AccessLog)  # outermost: refused requests are logged too (at INFO, `attnkit.serve.access`)
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
                "max_tokens": token_limit(name, max_tokens) if ok else max_tokens,
            })
        return out

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        config = {
            "mode": "server",
            "title": "attnkit: explore attention",
            "subtitle": "Type a sentence, pick a model, and see where every head attends.",
            "models": model_list(),
            "max_chars": max_chars,
            "kinds": [{"name": kind, "description": DESCRIPTIONS.get(kind, "the attention weights of each head")}
                      for kind in KINDS],
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

    def parse_request(body: bytes) -> AttentionRequest:
        try:
            data = parse_json(body)
            return AttentionRequest.model_validate(data)
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in e['loc']) or 'body'}: {e['msg']}" for e in error.errors()
            )
            raise HTTPException(422, f"expected {{text, model, layer, head, kind}}: {problems}") from None
        except ValueError as error:
            raise HTTPException(422, str(error)) from None

    def attention(request: AttentionRequest) -> dict[str, Any]:
        if request.kind not in KINDS:
            raise HTTPException(422, f"expected kind to be one of {', '.join(KINDS)}, got {request.kind!r}")
        if request.model not in models:
            raise HTTPException(400, f"unknown model {request.model!r}; this server offers: {', '.join(models)}")
        if not request.text.strip():
            raise HTTPException(422, "expected a non-empty text, got an empty one")
        problem = utf8_problem(request.text)
        if problem:
            raise HTTPException(422, f"expected Unicode text, got a {problem}")
        if len(request.text) > max_chars:
            raise HTTPException(
                413, f"the text has {len(request.text)} characters; this server accepts at most {max_chars} "
                "(attnkit serve --max-chars)"
            )
        try:
            provider = get_provider(request.model, max_tokens=max_tokens)
            maps = derived(provider, provider.attention(request.text), request.kind)
            layer = request.layer + maps.num_layers if request.layer < 0 else request.layer  # -1: the last
            answer = payload(
                maps,
                layer=min(max(layer, 0), maps.num_layers - 1),
                head=min(max(request.head, 0), maps.num_heads - 1),
                level=1,  # fast rather than small: the answer only crosses this machine
            )
        except ModelNotAvailableError as error:
            raise HTTPException(503, str(error)) from error
        except (ValueError, TypeError) as error:
            raise HTTPException(422, str(error)) from error
        answer["kind"] = request.kind
        answer["description"] = DESCRIPTIONS.get(request.kind, "")
        answer["warnings"] = (
            [f"The text was truncated to {maps.num_tokens} tokens (it had {maps.truncated_from})."]
            if maps.truncated_from
            else []
        )
        return answer

    def derived(provider: Any, maps: Any, kind: str) -> Any:
        """`maps`, or the map `kind` derived from them; flow only up to max_flow_problems."""
        problems = maps.num_layers * maps.num_tokens ** 2  # one max-flow problem per (layer, token, input)
        if kind == "flow" and problems > max_flow_problems:
            raise HTTPException(
                413, f"attention flow on {maps.num_tokens} tokens and {maps.num_layers} layers solves {problems} "
                f"maximum-flow problems; this server solves at most {max_flow_problems}: choose rollout "
                "(immediate on any text) or a shorter text"
            )
        if kind != "value-weighted":
            return derive(maps, kind)
        if provider.model is None:
            raise HTTPException(
                422, f"value-weighted maps read the value and output projections of a model attnkit runs itself "
                f"(minilm, smollm2, or a BERT, Llama or GPT-2 folder or GGUF file); {provider.name} is not one: "
                "choose another map or model"
            )
        with provider.lock:  # the model runs again: one run at a time
            return derive(maps, kind, model=provider.model)

    @app.post("/api/attention")
    async def api_attention(request: Request) -> dict[str, Any]:
        try:
            check_origin(request.headers.get("origin"), request.url.scheme, request.headers.get("host", ""))
            check_json_content_type(request.headers.get("content-type"))
            body = await read_body(request, max_body)
        except RequestRejected as error:
            raise HTTPException(error.status, error.message) from None
        parsed = parse_request(body)
        return await run_in_threadpool(attention, parsed)  # the model runs off the event loop

    app.state.models = ModelPool(models, engine_options=dict(max_batch=max_batch, kv_tokens=kv_tokens,
                                                             step_tokens=step_tokens, max_queue=max_queue))
    add_openai_api(app, app.state.models, max_body=max(api_max_body, max_body), max_new_tokens=max_new_tokens,
                   api_key=api_key, max_choices=max_batch)
    return app


def missing_web_package() -> str | None:
    """The first of FastAPI and uvicorn that does not import (its name), or None."""
    for name in ("fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            return name
    return None


def web_server(app: Any, *, log_level: str = "warning") -> Any:
    """A `uvicorn.Server` for `app` (no lifespan work); uvicorn's own access log is off, since
    the app logs each request itself (`attnkit.serve.access_log`) with the time it took."""
    import uvicorn

    # lifespan="off": the app has no startup or shutdown work, and a lifespan task cut short
    # by a second Ctrl+C would log its CancelledError as a traceback.
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False))


class BackgroundServer:
    """An app (`create_app()`) served by uvicorn in a thread of this process, for notebooks,
    scripts and tests; `attnkit serve` is the way to run it on its own.

    Arguments:
        app: the ASGI application.
        host: the address to bind (default: this machine only).
        port: the port; 0 (the default) takes a free one.

    Attributes:
        url: the server's address once started, e.g. "http://127.0.0.1:53127".

    Use it as a context manager (`with BackgroundServer(app) as server: ...`), or call
    `start()` and `stop()`.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self.url = ""
        self._server: Any = None
        self._thread: Any = None

    def start(self) -> "BackgroundServer":
        """Bind, start serving in a daemon thread, and return once requests are answered."""
        import socket
        import threading
        import time

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        port = sock.getsockname()[1]
        self._server = web_server(self.app)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="attnkit-serve-background")
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on {self.host}:{port} stopped while starting")
            time.sleep(0.01)
        self.url = f"http://{'[' + self.host + ']' if ':' in self.host else self.host}:{port}"
        return self

    def stop(self) -> None:
        """Stop serving (open requests finish first) and wait for the thread."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join()
            self._server = None

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
