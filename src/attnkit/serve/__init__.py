"""`attnkit serve`: the web page that draws a model's attention and the OpenAI-compatible
API beside it, with the models they load (the views they draw live in `attnkit.viz`).

- `server.py`: `create_app` (the FastAPI application: the page, `/api/attention`, `/v1`)
  and `BackgroundServer` (uvicorn in a thread, for notebooks, scripts and tests).
- `openai_api.py`: the `/v1` routes (models, embeddings, completions, chat);
  `openai_generation.py`: a completion request's work (engine or alone -> text pieces).
- `openai_requests.py`: their request bodies, checked with OpenAI's error shapes.
- `openai_models.py`: `ModelPool`, the API's models, each loaded once on first use.
- `engine.py`: `Engine`, a decoder's scheduler: continuous batching on a paged KV cache
  with prefix sharing, limits, preemption, cancellation.
- `solo.py`: one request alone on the model's modules (attention and the logit lens
  through the API); `embeddings.py`: `EmbeddingBatcher`; `openai_logprobs.py`: OpenAI's
  log-probability shapes.
- `http_checks.py`: what every request passes (Host, Origin, JSON only, bounded body).

FastAPI, pydantic and uvicorn load here only, and only when an application is made
(`pip install 'attnkit[serve]'`): `import attnkit.serve` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "create_app": "server",
    "BackgroundServer": "server",
    "add_openai_api": "openai_api",
    "ModelPool": "openai_models",
    "Engine": "engine",
    "Sampling": "engine",
    "EmbeddingBatcher": "embeddings",
    "ModelLoadError": "openai_models",
    "HostCheck": "http_checks",
    "RequestRejected": "http_checks",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnkit.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"attnkit.serve.{module}"), name)
    globals()[name] = value
    return value


__all__ = [*_LAZY]
