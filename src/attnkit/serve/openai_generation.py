"""The work of a completion request, for both completion endpoints: each choice's tokens
(from its decoder's `Engine`, or run alone by `attnkit.serve.solo`) turned into final text
pieces with their `TokenEvent`s (`Piece`), then a `Completion` per choice.

Without the attnkit extension, on a decoder its engine runs, the prompts are submitted when
the work starts, so a full queue or a request that can never fit is refused before any answer
begins (429, 400); a stop string ends its choice in the engine at once.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from attnkit.serve.engine import EngineBusy, EngineStopped, RequestTooLarge, Sampling
from attnkit.serve.openai_models import Completion, ModelPool, TextStream, end_of_sequence_ids
from attnkit.serve.openai_requests import APIError
from attnkit.serve.solo import solo_events

__all__ = ["Piece", "start_generation"]


@dataclass(frozen=True)
class Piece:
    """A final piece of a choice's text, with the `TokenEvent`s of the tokens it completes
    (their log-probabilities and attnkit data go out with it)."""

    text: str
    events: list


def start_generation(pool: ModelPool, name: str, model: Any, prompts: list[list[int]], limits: list[int],
                     sampling: dict[str, Any], *, n: int, logprobs: int | None, extension: Any
                     ) -> Callable[[Callable[[], bool]], Iterator[tuple[int, Any]]]:
    """Start the work of one completion request; returns `work(cancelled)`, which yields
    (choice index, Piece or Completion), choice index = prompt index * n + choice.

    Arguments:
        pool: the server's models; name, model: the decoder and its name.
        prompts, limits: each prompt's token ids and max_tokens.
        sampling: `sampling_arguments`' dict (temperature, top_p, seed, stop strings).
        n: choices per prompt; logprobs: alternatives per token (None: none asked);
        extension: `check_extension`'s result, or None.

    Without the attnkit extension, on a decoder its engine runs, the prompts are submitted
    now (so a full queue or a request that can never fit is refused before any answer
    starts: 429 or 400); otherwise the request runs alone under the model's lock."""
    eos = end_of_sequence_ids(model)
    rule = Sampling(sampling["temperature"], sampling["top_p"], sampling["seed"], frozenset(eos))
    k = logprobs or 0
    engine = None if extension is not None else pool.engine(name)
    handles: list[Any] = []
    if engine is not None:
        try:
            for ids, limit in zip(prompts, limits):
                handles.append(engine.submit(ids, limit, rule, logprobs=k, n=n))
        except (EngineBusy, RequestTooLarge, EngineStopped) as error:
            for handle in handles:
                handle.cancel()
            if isinstance(error, EngineBusy):
                raise APIError(429, str(error), code="server_busy", kind="rate_limit_error",
                               headers={"Retry-After": str(error.retry_after)}) from None
            if isinstance(error, RequestTooLarge):
                raise APIError(400, str(error), param="max_tokens", code="kv_cache_exceeded") from None
            raise APIError(503, str(error), code="engine_stopped") from None

    def events_of(index: int, cancelled: Callable[[], bool], stopped: set[int]) -> tuple[Iterator[Any], Any]:
        """The prompt's TokenEvents, and how to stop one choice of it."""
        if handles:
            handle = handles[index]

            def polled() -> Iterator[Any]:
                while True:
                    if cancelled():
                        handle.cancel()
                        return
                    try:
                        event = handle.get(timeout=0.1)
                    except queue.Empty:
                        continue
                    if event is None:
                        return
                    yield event

            return polled(), handle
        events = solo_events(model, prompts[index], limits[index], rule, logprobs=k, n=n, extension=extension,
                             cancelled=lambda choice: cancelled() or choice in stopped)
        return events, None

    def work(cancelled: Callable[[], bool]) -> Iterator[tuple[int, Any]]:
        lock = pool.lock(name) if not handles else contextlib.nullcontext()
        try:
            with lock:
                for index, ids in enumerate(prompts):
                    stopped: set[int] = set()
                    events, handle = events_of(index, cancelled, stopped)
                    texts = [TextStream(model.tokenizer, eos, sampling["stop"]) for _ in range(n)]
                    seen: list[list[Any]] = [[] for _ in range(n)]
                    sent = [0] * n
                    for event in events:
                        j = event.choice
                        if j in stopped:
                            continue
                        text = texts[j]
                        seen[j].append(event)
                        piece, ended = text.add(event.token)
                        ended = ended or event.finish is not None
                        if piece:
                            yield index * n + j, Piece(piece, seen[j][sent[j]:len(text.tokens)])
                            sent[j] = len(text.tokens)
                        if not ended:
                            continue
                        stopped.add(j)
                        if handle is not None and event.finish is None:  # a stop string: the engine stops it
                            handle.cancel(j)
                        rest, last = text.close(), seen[j][sent[j]:text.kept]
                        if rest or last:
                            yield index * n + j, Piece(rest, last)
                        cached = handle.cached_tokens if handle is not None else 0
                        yield index * n + j, Completion(text.text, text.finish_reason,
                                                        len(ids) if j == 0 else 0, len(text.tokens),
                                                        cached if j == 0 else 0)
                    if cancelled():
                        return
        finally:
            for handle in handles:
                handle.cancel()

    return work
