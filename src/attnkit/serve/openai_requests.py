"""The requests of `attnkit serve`'s OpenAI-compatible API: their bodies, checked as OpenAI
checks them, and its errors in OpenAI's shape (`APIError`).

Unknown arguments are refused ("Unrecognized request argument supplied: x"), types are
not coerced (pydantic's strict mode), and arguments attnkit does not implement (penalties,
tools, `echo`, `best_of`) are refused by name unless they ask for the default. One argument
OpenAI's API does not have is read: `attnkit` (the openai client's `extra_body={"attnkit":
{...}}`), attention and the logit lens per generated token (`attnkit.serve.solo`).
"""

from typing import Any, Literal, Optional

__all__ = ["APIError", "CHAT_ROLES", "MAX_INPUTS", "MAX_LOGPROBS", "MAX_STOPS", "chat_logprobs", "chat_messages",
           "choice_count", "completion_logprobs", "invalid", "parse_request", "refuse_unsupported", "request_models",
           "sampling_arguments", "stop_strings", "texts_of"]

MAX_INPUTS = 2048
"""The most texts one /v1/embeddings request may hold (OpenAI's limit)."""
MAX_STOPS = 4
"""The most stop strings (OpenAI's limit)."""
MAX_LOGPROBS = 20
"""The most alternatives per token: chat's top_logprobs (OpenAI's limit), completions' logprobs
(OpenAI's is 5; attnkit gives up to 20 there too)."""


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or {401: "authentication_error", 403: "permission_error"}.get(
            status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ----------------------------------------------------------------------------- request bodies


def request_models():
    """The pydantic models of the three request bodies (pydantic loads with FastAPI only)."""
    from pydantic import BaseModel, ConfigDict

    class Strict(BaseModel):
        # Unknown arguments are refused as OpenAI refuses them; types are not coerced.
        model_config = ConfigDict(extra="forbid", strict=True)

    class Sampling(Strict):
        model: str
        max_tokens: Optional[int] = None
        temperature: Optional[float] = None
        top_p: Optional[float] = None
        n: Optional[int] = None
        stop: Any = None  # a string or a list of strings: checked by `stop_strings`, which says so
        seed: Optional[int] = None
        stream: Optional[bool] = None
        stream_options: Optional[dict[str, Any]] = None
        presence_penalty: Optional[float] = None
        frequency_penalty: Optional[float] = None
        logit_bias: Optional[dict[str, Any]] = None
        user: Optional[str] = None
        attnkit: Optional[dict[str, Any]] = None  # attention / logit lens per token (attnkit.serve.solo)

    class ChatRequest(Sampling):
        messages: list[dict[str, Any]]
        max_completion_tokens: Optional[int] = None
        logprobs: Optional[bool] = None
        top_logprobs: Optional[int] = None
        response_format: Optional[dict[str, Any]] = None
        tools: Optional[list[Any]] = None
        tool_choice: Any = None
        parallel_tool_calls: Optional[bool] = None
        store: Optional[bool] = None
        metadata: Optional[dict[str, Any]] = None

    class CompletionRequest(Sampling):
        prompt: Any
        echo: Optional[bool] = None
        logprobs: Optional[int] = None
        suffix: Optional[str] = None
        best_of: Optional[int] = None

    class EmbeddingsRequest(Strict):
        model: str
        input: Any
        encoding_format: Literal["float", "base64"] = "float"
        dimensions: Optional[int] = None
        user: Optional[str] = None

    return ChatRequest, CompletionRequest, EmbeddingsRequest


def _param(location: tuple) -> str:
    """pydantic's ('messages', 0, 'role') as OpenAI writes it: 'messages[0].role'."""
    out = ""
    for part in location:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_request(model_class: Any, data: Any) -> Any:
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise APIError(400, f"expected a JSON object as the request body, got {type(data).__name__}")
    try:
        return model_class.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = _param(first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise invalid(param, f"Unrecognized request argument supplied: {param}", "unknown_parameter") from None
        if first["type"] == "missing":
            raise invalid(param, f"Missing required parameter: '{param}'.", "missing_required_parameter") from None
        raise invalid(param, f"Invalid value for '{param}': {first['msg']}") from None


def refuse_unsupported(request: Any, defaults: dict[str, Any]) -> None:
    """Arguments this server does not implement are refused unless they ask for the default."""
    for name, allowed in defaults.items():
        value = getattr(request, name, None)
        if value is not None and value != allowed and not (allowed == "empty" and not value):
            wanted = "" if allowed == "empty" else f" (only {allowed!r})"
            raise invalid(name, f"attnkit serve does not support '{name}'{wanted}; got {value!r}", "unsupported_value")


def sampling_arguments(request: Any) -> dict[str, Any]:
    """temperature, top_p, seed and stop of a completion request, checked as OpenAI checks them."""
    temperature = 1.0 if request.temperature is None else float(request.temperature)
    if not 0.0 <= temperature <= 2.0:
        raise invalid("temperature", f"expected temperature between 0 and 2, got {temperature}")
    top_p = None if request.top_p is None else float(request.top_p)
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise invalid("top_p", f"expected top_p between 0 and 1, got {top_p}")
    if top_p == 0.0:  # only the most likely token is left: greedy
        temperature, top_p = 0.0, None
    if request.seed is not None and request.seed < 0:
        raise invalid("seed", f"expected seed >= 0, got {request.seed}")
    stop = stop_strings(request.stop)
    refuse_unsupported(request, {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": "empty"})
    return {"temperature": temperature, "top_p": top_p, "seed": request.seed, "stop": stop}


def choice_count(request: Any, most: int) -> int:
    """`n`: how many choices per prompt, 1 .. `most` (the server's --max-batch)."""
    n = 1 if request.n is None else request.n
    if not 1 <= n <= most:
        raise invalid("n", f"expected n between 1 and {most} (the most choices this server decodes together, "
                           f"attnkit serve --max-batch), got n={n}")
    return n


def chat_logprobs(request: Any) -> int | None:
    """Chat's `logprobs` / `top_logprobs`: None when no log-probabilities are asked, else how
    many alternatives each token carries (0 .. MAX_LOGPROBS)."""
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise invalid("top_logprobs", f"expected top_logprobs between 0 and {MAX_LOGPROBS}, got {top}")
    if not request.logprobs:
        if top:
            raise invalid("top_logprobs", f"top_logprobs needs logprobs: true; got top_logprobs={top} and "
                                          f"logprobs={request.logprobs}")
        return None
    return top or 0


def completion_logprobs(request: Any) -> int | None:
    """Completions' `logprobs` (an int: how many alternatives per token), or None."""
    k = request.logprobs
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise invalid("logprobs", f"expected logprobs between 0 and {MAX_LOGPROBS}, got {k}")
    return k


def stop_strings(value: Any) -> list[str]:
    """`stop`: None, a string, or a list of at most MAX_STOPS non-empty strings, as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop", f"expected stop as a string or a list of strings, got {value!r:.80}")
    if len(value) > MAX_STOPS or any(not s for s in value):
        raise invalid("stop", f"expected at most {MAX_STOPS} non-empty stop strings, got {value!r:.200}")
    return value


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""OpenAI's message roles and the role the chat template gets ("developer" is the newer "system")."""


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """OpenAI's messages as {"role", "content"} text messages for the chat template."""
    if not messages:
        raise invalid("messages", "expected at least one message, got none")
    out = []
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{index}].role",
                           f"expected role 'system', 'developer', 'user' or 'assistant', got {role!r}")
        if isinstance(content, list):  # content parts: text only
            texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise invalid(f"messages[{index}].content", "attnkit serve reads text content parts only")
            content = "".join(texts)
        if not isinstance(content, str):
            raise invalid(f"messages[{index}].content", f"expected the content as a string, got {content!r}")
        out.append({"role": CHAT_ROLES[role], "content": content})
    return out


def texts_of(value: Any, param: str) -> list[str]:
    """`input` / `prompt`: a string or a list of strings (token arrays are refused by name)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid(param, f"expected {param} as a string or a non-empty list of strings, got {value!r:.80}")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise invalid(param, f"expected {param}[{index}] to be a string (attnkit serve reads text, "
                                  f"not token arrays), got {item!r:.80}")
        if not item:
            raise invalid(param, f"expected {param}[{index}] to be a non-empty string, got ''")
    return value
