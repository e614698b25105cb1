"""Embedding requests that arrive together, encoded together.

An `EmbeddingBatcher` holds one thread per encoder. Each request's texts are queued; when
the encoder is free, the thread takes every request waiting at that moment (no waiting
window: a request alone goes at once), encodes all their texts in one
`SentenceEncoder.encode` call, and hands each request its rows. `encode` packs each
length-sorted batch's tokens into one forward without padding, so a text's vector is
computed with the same operations in the same order whoever else is in the call: the
answers are the same bits as the request alone (tests/serve/test_serve_batching.py checks
it with 8 concurrent clients), as long as the encoder runs its products on one thread in
both (a batch of fewer than `MIN_TOKENS_PER_THREAD` tokens a thread does; larger batches
may pick a threaded schedule whose sums round differently).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Sequence

import numpy as np

__all__ = ["EmbeddingBatcher"]


class EmbeddingBatcher:
    """Encode the texts of requests that wait together in one call.

    Arguments:
        encoder: a `SentenceEncoder`.
        lock: held while encoding (the model's lock in `ModelPool`).

    Attributes:
        calls: how many `encode` calls ran; requests: how many requests they answered.
    """

    def __init__(self, encoder: Any, lock: threading.Lock) -> None:
        self.encoder, self.lock = encoder, lock
        self.calls = self.requests = 0
        self._waiting: list[tuple[list[str], Future]] = []
        self._ready = threading.Condition()
        threading.Thread(target=self._loop, name="attnkit-serve-embeddings", daemon=True).start()

    def submit(self, texts: Sequence[str]) -> Future:
        """A Future of the (len(texts), D) float32 embeddings."""
        future: Future = Future()
        with self._ready:
            self._waiting.append((list(texts), future))
            self._ready.notify()
        return future

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._waiting:
                    self._ready.wait()
                batch, self._waiting = self._waiting, []
            texts = [text for request, _ in batch for text in request]
            try:
                with self.lock:
                    vectors = self.encoder.encode(texts)  # (sum of texts, D)
            except Exception as error:  # noqa: BLE001 - each request raises it
                for _, future in batch:
                    future.set_exception(error)
                continue
            self.calls += 1
            self.requests += len(batch)
            start = 0
            for request, future in batch:
                future.set_result(np.asarray(vectors[start:start + len(request)]))
                start += len(request)
