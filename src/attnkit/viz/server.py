"""`attnkit serve`: a local page to type a sentence, pick a model and explore its attention.

Built on FastAPI (imported only here; `pip install 'attnkit[serve]'`). The page
is the same viewer as the HTML file, in server mode: it posts the text to
`/api/attention` on its own origin and draws the answer. Inputs are capped:
at most `max_chars` characters (longer requests are refused with 413) and at
most `max_tokens` tokens (longer texts are truncated, with a warning).
"""

from typing import Any, Sequence

from attnkit.viz.html import content_security_policy, payload, render_page
from attnkit.viz.providers import (
    DEFAULT_MAX_TOKENS,
    PROVIDERS,
    ModelNotAvailableError,
    availability,
    get_provider,
)

DEFAULT_MAX_CHARS = 2000


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
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import HTMLResponse, Response
    from pydantic import BaseModel

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
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
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
            "docs": [],
        }
        return HTMLResponse(render_page(config, server=True), headers=headers)

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/api/models")
    def api_models() -> list[dict[str, Any]]:
        return model_list()

    @app.post("/api/attention")
    def api_attention(request: AttentionRequest) -> dict[str, Any]:
        if request.model not in models:
            raise HTTPException(400, f"unknown model {request.model!r}; this server offers: {', '.join(models)}")
        if not request.text.strip():
            raise HTTPException(422, "expected a non-empty text, got an empty one")
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

    return app
