"""Embedding requests that arrive together, answered together, each the same bits as alone.

An `EmbeddingBatcher` holds one thread per encoder. Each request's texts are queued; when
the encoder is free, the thread takes every request waiting at that moment (no waiting
window: a request alone goes at once) and encodes them one request a call, under one hold
of the model's lock. It does not join requests into one call: the encoder's products are
BLAS products whose row sums may round differently with the number of rows (OpenBLAS's
Haswell kernels do: a text's vector moved by a few float32 ulps when another request's
tokens joined its call), and a request's answer must be the same bits alone or among
others (tests/serve/test_serve_batching.py, 8 concurrent clients). A text list inside one
request is one call, as it is alone.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Sequence

import numpy as np

__all__ = ["EmbeddingBatcher"]


class EmbeddingBatcher:
    """Encode the requests that wait together, one `encode` call a request.

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
            with self.lock:
                for request, future in batch:
                    try:
                        vectors = np.asarray(self.encoder.encode(request))  # (len(request), D)
                    except Exception as error:  # noqa: BLE001 - the request raises it
                        future.set_exception(error)
                        continue
                    self.calls += 1
                    future.set_result(vectors)
            self.requests += len(batch)
