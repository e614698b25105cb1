"""A Llama decode step in one compiled call: a model's frame, and the call on its threads.

`prepare` builds a model's `Frame` once (a `FRAME` record: the addresses of the matrices'
blocks, the norms and the row orders, the model's sizes; the barrier and the shared
scratch the parts meet in), and `decode_step` runs one token through it: the per-step
fields (token, slot, the cache, the rotary tables) are written into the record, then the
native entry (`step_kernels._step_entry`, built as `attnkit.kernels.native` builds
entries) runs once per part, the calling thread running part 0.

Threads: the parts of a step spin at barriers until every part arrives, so they must all
run at once. Each frame therefore has its own worker threads (`parts - 1` of them, made on
its first threaded step), and one step at a time runs on a frame (its lock): two models
decoding at once never wait for each other's workers (a shared pool could hand its last
free worker to one step while another step's parts spin for it).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from attnkit.kernels import native
from attnkit.quant.products import half_table
from attnkit.models.llama.step_kernels import COLUMNS, FRAME, MATRICES_PER_LAYER, ROWS, TABLE_COLUMNS, build, \
    shared_size, source_digest

__all__ = ["FRAME", "Frame", "decode_step", "prepare", "shared_size"]


def _entry_sources() -> dict:
    return {"step": build().entry}


def _entries() -> native.Entries:
    """The step's native entry ("step"; `attnkit.kernels.native`), from a library named by
    the digest of the compiled code's file."""
    return native.entries(f"llama_step_{source_digest()}", _entry_sources)


class Frame:
    """One model's frame for `decode_step`: the `FRAME` record (`record`), the arrays whose
    addresses it holds (kept alive here), the parts' barrier and shared scratch, the worker
    threads, and the lock that lets one step at a time use them."""

    def __init__(self, table: np.ndarray, orders: np.ndarray, norms: tuple, floats: np.ndarray, heads: int,
                 kv_heads: int, E: int, vocab: int, windows: np.ndarray | None = None) -> None:
        layers = orders.shape[0]
        windows = np.zeros(layers, np.int64) if windows is None else windows
        embed = MATRICES_PER_LAYER * layers  # the embedding's row; the gate's is 4
        d, ff = int(table[embed, COLUMNS]), int(table[4, ROWS])
        self.addresses = np.array([n.ctypes.data for n in norms], np.int64)
        self.keep = (table, orders, floats, norms, windows)
        self.barrier = np.zeros(2, np.int64)
        self.shared = np.empty(shared_size(heads, kv_heads, E, d, ff), np.float32)
        self.lock = threading.Lock()
        self.vocab = vocab
        self.embed_rows = int(table[embed, ROWS])
        self._workers: ThreadPoolExecutor | None = None
        self._worker_count = 0
        record = self.record = np.zeros(1, FRAME)
        for name, value in dict(table=table.ctypes.data, matrices=table.shape[0], orders=orders.ctypes.data,
                                norms=self.addresses.ctypes.data, floats=floats.ctypes.data, layers=layers,
                                heads=heads, kv_heads=kv_heads, head_dim=E, vocab=vocab,
                                half=half_table().ctypes.data, barrier=self.barrier.ctypes.data,
                                shared=self.shared.ctypes.data, windows=windows.ctypes.data).items():
            record[name] = value

    def field(self, name: str) -> int:
        """The record's field `name` (a key of `FRAME`)."""
        return int(self.record[name][0])

    def workers(self, count: int) -> ThreadPoolExecutor:
        """This frame's `count` worker threads (call with the lock held)."""
        if self._workers is None or self._worker_count != count:
            if self._workers is not None:
                self._workers.shutdown(wait=False)
            self._workers = ThreadPoolExecutor(count, thread_name_prefix="attnkit-decode")
            self._worker_count = count
        return self._workers


def prepare(table: np.ndarray, orders: np.ndarray, norms: list, eps: list, scale: float, heads: int, kv_heads: int,
            E: int, vocab: int, windows: Any = None) -> Frame:
    """A model's frame for `decode_step`.

    Arguments:
        table: (M, 6) int64, one row a matrix, columns `TABLE_COLUMNS` (the addresses of the
            blocks, which the caller keeps alive with the model): 7 a layer (query, key,
            value, output, gate, up, down), then the embedding and the output head.
        orders: (L, Hq E + Hkv E) int64, the output order of each layer's query and key rows.
        norms: the 2L + 1 RMSNorm weights, float32 C-contiguous (read where they are: an
            edit in place reaches the step).
        eps: their epsilons; scale: the score scale.
        heads, kv_heads, E, vocab: the model's sizes.
        windows: (L,) each layer's sliding window (a query sees its last `window` keys,
            itself included), 0 for none; None (default): no layer has one.
    """
    table = np.ascontiguousarray(table, np.int64)
    orders = np.ascontiguousarray(orders, np.int64)
    layers = orders.shape[0]
    if table.shape != (MATRICES_PER_LAYER * layers + 2, len(TABLE_COLUMNS)):
        raise ValueError(f"expected a table of shape ({MATRICES_PER_LAYER * layers + 2}, {len(TABLE_COLUMNS)}) for "
                         f"{layers} layers, got {table.shape}")
    if orders.shape[1] != (heads + kv_heads) * E or len(norms) != 2 * layers + 1 or len(eps) != 2 * layers + 1:
        raise ValueError(f"expected orders (L, {(heads + kv_heads) * E}) and {2 * layers + 1} norms and eps, got "
                         f"{orders.shape}, {len(norms)} and {len(eps)}")
    if any(n.dtype != np.float32 or not n.flags.c_contiguous or n.shape != norms[0].shape for n in norms):
        raise ValueError("expected the norms' weights float32, C-contiguous, of one shape")
    floats = np.array([scale, *eps], np.float64)
    windows = np.zeros(layers, np.int64) if windows is None else np.array(windows, np.int64).reshape(-1)
    if windows.shape != (layers,) or (windows < 0).any():
        raise ValueError(f"expected {layers} windows >= 0 (0: none), got {windows.tolist()}")
    return Frame(table, orders, tuple(norms), floats, heads, kv_heads, E, vocab, windows)


def decode_step(token: int, slot: int, frame: Frame, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                values: np.ndarray, *, int8: bool = False, parts: int = 1) -> np.ndarray:
    """Logits (V,) float32 of token `token` at cache index `slot`.

    Arguments:
        frame: the model's, from `prepare`.
        cos, sin: (E,) float32 C-contiguous, the token's rotary tables.
        keys, values: (L, Hkv, max, E) float32 C-contiguous, the sequence's cache (the new key
            and value are written at `slot`).
        int8: the products of Q4_0, Q4_1 and Q8_0 on 8-bit activations.
        parts: threads (the calling thread runs part 0, the frame's workers the others).
    """
    if not (keys.flags.c_contiguous and values.flags.c_contiguous and keys.dtype == np.float32
            and values.dtype == np.float32 and keys.shape == values.shape and keys.ndim == 4):
        raise ValueError(f"expected two C-contiguous float32 caches of one shape (L, Hkv, max, E), got {keys.shape} "
                         f"{keys.dtype} and {values.shape} {values.dtype}")
    E, rows = frame.field("head_dim"), frame.embed_rows
    if not (0 <= token < rows and 0 <= slot < keys.shape[2]):
        raise ValueError(f"expected a token in [0, {rows}) at a slot in [0, {keys.shape[2]}), got {token} at {slot}")
    layers, kv_heads = frame.field("layers"), frame.field("kv_heads")
    if keys.shape[:2] != (layers, kv_heads) or keys.shape[3] != E:
        raise ValueError(f"expected caches of shape ({layers}, {kv_heads}, max, {E}), got {keys.shape}")
    if any(t.shape != (E,) or t.dtype != np.float32 or not t.flags.c_contiguous for t in (cos, sin)):
        raise ValueError(f"expected cos and sin of shape ({E},), float32 and C-contiguous, got {cos.shape} "
                         f"{cos.dtype} and {sin.shape} {sin.dtype}")
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise ValueError(f"expected parts to be a positive int, got {parts!r}")
    entry = _entries()["step"]
    logits = np.empty(frame.vocab, np.float32)
    with frame.lock:  # one step at a time on a frame (two threads may generate with one model)
        record = frame.record
        for name, value in (("token", token), ("slot", slot), ("parts", parts), ("int8", int(bool(int8))),
                            ("cos", cos.ctypes.data), ("sin", sin.ctypes.data), ("keys", keys.ctypes.data),
                            ("values", values.ctypes.data), ("max_length", keys.shape[2]),
                            ("logits", logits.ctypes.data)):
            record[name] = value
        frame.barrier[0] = 0
        address = record.ctypes.data
        if parts == 1:
            entry(address, 0)
        else:
            workers = frame.workers(parts - 1)
            others = [workers.submit(entry, address, p) for p in range(1, parts)]
            entry(address, 0)
            for other in others:
                other.result()
    return logits
