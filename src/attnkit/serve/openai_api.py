"""`attnkit serve`'s OpenAI-compatible API: /v1/models, /v1/embeddings, /v1/completions,
/v1/chat/completions, answered by attnkit's own models (see `attnkit.serve.openai_models`).

Any OpenAI client works against it (`OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key="...")`). Completions run on each decoder's `Engine` (`attnkit.serve.engine`:
requests batched together as they come and go, a prefix cache), with `n`, `logprobs` /
`top_logprobs` and `usage.prompt_tokens_details.cached_tokens` as OpenAI gives them; a
request with an `attnkit` object (attention rows, the logit lens per token) runs alone on
the model's modules (`attnkit.serve.solo`). What differs from OpenAI's service is refused by
name, never ignored: penalties other than 0, tools, token arrays as input, `dimensions`
other than the model's own. Errors have OpenAI's shape and status codes (`{"error":
{"message", "type", "param", "code"}}`; 400 for a bad request, 401 for a wrong key, 403 for
another site's page, 404 for an unknown model or path, 413 for a body too large, 415 for
one that is not JSON, 429 with Retry-After when the engine's queue is full, 500 for a model
that cannot load, 503 when its engine has stopped), so a client raises the exception it
would raise against OpenAI (`openai.BadRequestError`, `openai.RateLimitError`, ...).

Requests pass the same checks as the page's API (`attnkit.serve.http_checks`): the Host
header, the Origin, JSON only, a bounded body, strict JSON. A request from a browser page
of another origin is refused with 403: an `Origin` header whose scheme, host or port is
not this server's (another port of the same host is another origin, as browsers say).
"""

import asyncio
import base64
import hmac
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from attnkit.serve.http_checks import RequestRejected, check_json_content_type, check_origin, parse_json, read_body
from attnkit.serve.openai_generation import start_generation
from attnkit.serve.openai_logprobs import attnkit_entries, chat_entries, completion_logprobs
from attnkit.serve.openai_models import (
    EMBEDDINGS,
    GENERATION,
    Completion,
    ModelLoadError,
    ModelPool,
    token_count,
)
from attnkit.serve.openai_requests import (
    MAX_INPUTS,
    APIError,
    chat_logprobs,
    chat_messages,
    choice_count,
    invalid,
    parse_request,
    refuse_unsupported,
    request_models,
    sampling_arguments,
    texts_of,
)
from attnkit.serve.openai_requests import completion_logprobs as completion_logprobs_asked
from attnkit.serve.solo import check_extension
from attnkit.viz.providers import availability

__all__ = ["add_openai_api"]

# ----------------------------------------------------------------------------- responses


def _usage(prompt: int, completion: int | None = None) -> dict[str, int]:
    if completion is None:  # embeddings
        return {"prompt_tokens": prompt, "total_tokens": prompt}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(data: Any) -> str:
    import json

    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _in_thread(work: Callable[[Callable[[], bool]], Iterator[Any]]) -> AsyncIterator[Any]:
    """Run the generator `work(cancelled)` in a thread of its own and yield what it yields.

    When the consumer stops early (a client that went away), `cancelled()` turns True so
    the work ends at its next check and releases its model's lock."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def put(kind: str, item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, item))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            stop.set()

    def run() -> None:
        try:
            for item in work(stop.is_set):
                put("item", item)
                if stop.is_set():
                    return
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which reports it
            put("error", error)
        else:
            put("done", None)

    threading.Thread(target=run, name="attnkit-serve-stream", daemon=True).start()  # one streamed answer
    try:
        while True:
            kind, item = await queue.get()
            if kind == "done":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()


# ----------------------------------------------------------------------------- the routes


def add_openai_api(
    app: Any,
    pool: ModelPool,
    *,
    max_body: int,
    max_new_tokens: int,
    api_key: str | None = None,
    max_choices: int = 8,
) -> None:
    """Add the OpenAI-compatible routes under /v1 to a FastAPI `app`.

    Arguments:
        app: the FastAPI application (`attnkit.serve.server.create_app` makes it).
        pool: the models the API answers for.
        max_body: the largest request body in bytes (413 beyond).
        max_new_tokens: the most tokens one completion generates; the default when a
            request gives no max_tokens (a larger max_tokens is refused).
        api_key: when given, every /v1 request must carry `Authorization: Bearer <api_key>`.
        max_choices: the most choices (`n`) per prompt (the engines' max_batch).
    """
    from fastapi import Request
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    ChatRequest, CompletionRequest, EmbeddingsRequest = request_models()
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        # a model that cannot load fails the same way again: the client should not retry
        headers = {"x-should-retry": "false"} if error.status >= 500 and error.status != 503 else None
        if error.headers:
            headers = {**(headers or {}), **error.headers}
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Any:
        if not request.url.path.startswith("/v1/"):
            return await http_exception_handler(request, error)
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(error.status_code)
        message = (f"Unknown request URL: {request.method} {request.url.path}" if error.status_code in (404, 405)
                   else str(error.detail))
        return JSONResponse(APIError(error.status_code, message, code=code).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Any:
        """A bug answers 500 in the shape the client reads (the traceback goes to the log)."""
        if not request.url.path.startswith("/v1/"):
            return PlainTextResponse("Internal Server Error", status_code=500)
        return JSONResponse(APIError(500, f"the server failed: {type(error).__name__}: {error}").body(),
                            status_code=500)

    def guard(request: Request) -> None:
        """The API key, and no requests from another site's page."""
        if api_key is not None:
            given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {api_key}".encode("utf-8", "surrogateescape")):
                raise APIError(401, "Incorrect API key provided; this server's key is the one given to "
                                    "attnkit serve --api-key", code="invalid_api_key")
        try:
            check_origin(request.headers.get("origin"), request.url.scheme, request.headers.get("host", ""))
        except RequestRejected as error:
            raise APIError(error.status, error.message, code="cross_origin") from None

    async def read(request: Request, model_class: Any) -> Any:
        guard(request)
        try:
            check_json_content_type(request.headers.get("content-type"))
            body = await read_body(request, max_body)
        except RequestRejected as error:
            code = {413: "request_too_large", 415: "unsupported_media_type"}.get(error.status)
            raise APIError(error.status, error.message, code=code) from None
        try:
            data = parse_json(body)
        except ValueError as error:
            raise APIError(400, f"We could not parse the JSON body of your request: {error}") from None
        return parse_request(model_class, data)

    def served(name: str, kind: str) -> str:
        if name not in pool.kinds:
            offered = ", ".join(pool.kinds) or "none"
            raise APIError(404, f"The model '{name}' does not exist on this server; its models are: {offered}",
                           param="model", code="model_not_found")
        if pool.kinds[name] != kind:
            what = ("an embeddings model (POST /v1/embeddings)" if pool.kinds[name] == EMBEDDINGS
                    else "a text generation model (POST /v1/completions, /v1/chat/completions)")
            raise invalid("model", f"The model '{name}' is {what}", "wrong_model_kind")
        ok, reason = availability(name)
        if not ok:
            raise APIError(404, f"The model '{name}' is not installed: {reason}", param="model",
                           code="model_not_found")
        return name

    async def load(name: str) -> Any:
        try:
            return await run_in_threadpool(pool.get, name)
        except ModelLoadError as error:
            raise APIError(500, str(error), code="model_load_failed") from None

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "attnkit"}

    def listed() -> list[str]:
        return [name for name in pool.kinds if availability(name)[0]]

    @app.get("/v1/models")
    def models(request: Request) -> dict[str, Any]:
        guard(request)
        return {"object": "list", "data": [model_card(name) for name in listed()]}

    @app.get("/v1/models/{name:path}")
    def model(name: str, request: Request) -> dict[str, Any]:
        guard(request)
        if name not in listed():
            raise APIError(404, f"The model '{name}' does not exist on this server", param="model",
                           code="model_not_found")
        return model_card(name)

    # -- embeddings -----------------------------------------------------------------------
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body = await read(request, EmbeddingsRequest)
        texts = texts_of(body.input, "input")
        if len(texts) > MAX_INPUTS:
            raise invalid("input", f"expected at most {MAX_INPUTS} inputs, got {len(texts)}")
        name = served(body.model, EMBEDDINGS)
        encoder = await load(name)
        if body.dimensions is not None and body.dimensions != encoder.dim:
            raise invalid("dimensions", f"The model '{name}' gives {encoder.dim}-dimensional embeddings and does "
                                         f"not shorten them; omit dimensions or pass {encoder.dim}, got "
                                         f"{body.dimensions}")

        def count() -> list[int]:
            counts = token_count(encoder, texts)
            for index, tokens in enumerate(counts):
                if tokens > encoder.max_seq_length:
                    raise APIError(400, f"input[{index}] has {tokens} tokens; the model '{name}' reads at "
                                        f"most {encoder.max_seq_length} (its max_seq_length): shorten it",
                                   param="input", code="context_length_exceeded")
            return counts

        counts = await run_in_threadpool(count)
        batcher = await run_in_threadpool(pool.embedder, name)
        vectors = await asyncio.wrap_future(batcher.submit(texts))  # (n, D) float32, encoded with its neighbours
        little = vectors.astype("<f4", copy=False)
        data = [
            {"object": "embedding", "index": i,
             "embedding": base64.b64encode(little[i].tobytes()).decode("ascii")
             if body.encoding_format == "base64" else little[i].tolist()}
            for i in range(len(texts))
        ]
        return {"object": "list", "data": data, "model": name, "usage": _usage(sum(counts))}

    # -- completions and chat ---------------------------------------------------------------
    def budget(model: Any, prompt_tokens: int, asked: int | None, param: str) -> int:
        """How many tokens a completion may generate: `asked` (or this server's default),
        refused when it passes this server's limit or the model's context."""
        context = model.context_length
        if asked is not None and asked < 1:
            raise invalid("max_tokens", f"expected max_tokens >= 1, got {asked}")
        if asked is not None and asked > max_new_tokens:
            raise invalid("max_tokens", f"max_tokens is {asked}; this server generates at most {max_new_tokens} "
                                         "tokens per completion (attnkit serve --max-new-tokens)")
        if prompt_tokens == 0:
            raise invalid(param, "expected a prompt of at least one token, got none")
        room = context - prompt_tokens
        if room < 1 or (asked is not None and asked > room):
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, you "
                                f"requested {prompt_tokens + (asked or 1)} tokens ({prompt_tokens} in the "
                                f"prompt, {asked or 1} for the completion). Please reduce the length.",
                           param=param, code="context_length_exceeded")
        return min(max_new_tokens, room) if asked is None else asked

    async def respond(body: Any, name: str, model: Any, work: Callable, chat: bool, count: int, *,
                      logprobs: int | None, extension: Any, prompt_texts: list[str] | None = None) -> Any:
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": name, "system_fingerprint": None}
        tokenizer = model.tokenizer
        offsets = [len(prompt_texts[i // (count // len(prompt_texts))]) if prompt_texts else 0 for i in range(count)]

        def token_data(index: int, events: list[Any]) -> dict[str, Any]:
            """The choice's "logprobs" (and "attnkit") for these events."""
            out: dict[str, Any] = {"logprobs": None}
            if logprobs is not None:
                if chat:
                    out["logprobs"] = {"content": chat_entries(tokenizer, events), "refusal": None}
                else:
                    out["logprobs"], offsets[index] = completion_logprobs(tokenizer, events, offsets[index])
            if extension is not None:
                out["attnkit"] = {"tokens": attnkit_entries(tokenizer, events)}
            return out

        def choice(index: int, text: str | None, finish: str | None, events: list[Any], *,
                   delta: bool) -> dict[str, Any]:
            data = token_data(index, events) if events or not delta else {"logprobs": None}
            if not chat:
                return {"index": index, "text": text or "", **data, "finish_reason": finish}
            if delta:
                return {"index": index, "delta": {} if text is None else {"content": text}, **data,
                        "finish_reason": finish}
            return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None}, **data,
                    "finish_reason": finish}

        def usage(done: list[Completion]) -> dict[str, Any]:
            out: dict[str, Any] = _usage(sum(c.prompt_tokens for c in done), sum(c.completion_tokens for c in done))
            out["prompt_tokens_details"] = {"cached_tokens": sum(c.cached_tokens for c in done)}
            return out

        if not body.stream:
            def collect() -> tuple[list[Completion], list[list[Any]]]:
                done: dict[int, Completion] = {}
                events: list[list[Any]] = [[] for _ in range(count)]
                for index, item in work(lambda: False):
                    if isinstance(item, Completion):
                        done[index] = item
                    else:
                        events[index].extend(item.events)
                return [done[i] for i in range(count)], events

            done, events = await run_in_threadpool(collect)
            return {**head, "choices": [choice(i, c.text, c.finish_reason, events[i], delta=False)
                                        for i, c in enumerate(done)],
                    "usage": usage(done)}

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            usage = {"usage": None} if include_usage else {}
            return _sse({**chunk_head, "choices": choices, **usage, **extra})

        async def events() -> AsyncIterator[str]:
            done: list[Completion] = []
            if chat:
                for index in range(count):
                    yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            try:
                async for index, item in _in_thread(work):
                    if isinstance(item, Completion):
                        done.append(item)
                        yield chunk([choice(index, None if chat else "", item.finish_reason, [], delta=True)])
                    else:
                        yield chunk([choice(index, item.text, None, item.events, delta=True)])
            except Exception as error:  # noqa: BLE001 - the status is sent: the error goes in the stream
                yield _sse(APIError(500, f"generation failed: {error}").body())
                return
            if include_usage:
                yield _sse({**chunk_head, "choices": [], "usage": usage(done)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def extension_of(body: Any, model: Any) -> Any:
        if body.attnkit is None:
            return None
        try:
            return check_extension(body.attnkit, model)
        except ValueError as error:
            raise invalid("attnkit", str(error)) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await read(request, ChatRequest)
        sampling = sampling_arguments(body)
        refuse_unsupported(body, {"tools": "empty", "tool_choice": "none", "parallel_tool_calls": False})
        logprobs = chat_logprobs(body)
        n = choice_count(body, max_choices)
        if body.response_format not in (None, {"type": "text"}):
            raise invalid("response_format", f"attnkit serve writes text only ({{'type': 'text'}}), got "
                                              f"{body.response_format!r}", "unsupported_value")
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise invalid("max_completion_tokens", "expected max_tokens and max_completion_tokens to agree, got "
                                                    f"{body.max_tokens} and {body.max_completion_tokens}")
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        messages = chat_messages(body.messages)
        name = served(body.model, GENERATION)
        model = await load(name)
        extension = extension_of(body, model)
        if not model.tokenizer.chat_template:
            raise invalid("model", f"The model '{name}' has no chat template; use POST /v1/completions",
                           "no_chat_template")

        def encode() -> list[int]:
            try:
                return model.tokenizer.encode_chat(messages)
            except Exception as error:  # noqa: BLE001 - a template raises what its author chose
                raise invalid("messages", f"the model's chat template refused the messages: {error}") from None

        ids = await run_in_threadpool(encode)
        limit = budget(model, len(ids), asked, "messages")
        work = await run_in_threadpool(start_generation, pool, name, model, [ids], [limit], sampling, n=n,
                                       logprobs=logprobs, extension=extension)
        return await respond(body, name, model, work, True, n, logprobs=logprobs, extension=extension)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await read(request, CompletionRequest)
        sampling = sampling_arguments(body)
        refuse_unsupported(body, {"echo": False, "suffix": "empty", "best_of": 1})
        logprobs = completion_logprobs_asked(body)
        n = choice_count(body, max_choices)
        prompts = texts_of(body.prompt, "prompt")
        name = served(body.model, GENERATION)
        model = await load(name)
        extension = extension_of(body, model)
        ids = [model.tokenizer.encode(prompt) for prompt in prompts]
        asked = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        limits = [budget(model, len(one), asked, "prompt") for one in ids]
        work = await run_in_threadpool(start_generation, pool, name, model, ids, limits, sampling, n=n,
                                       logprobs=logprobs, extension=extension)
        return await respond(body, name, model, work, False, len(prompts) * n, logprobs=logprobs,
                             extension=extension, prompt_texts=prompts)
