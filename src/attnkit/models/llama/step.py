"""A Llama decode step in one compiled call: a model's frame, and the call on its threads.

`prepare` builds a model's `Frame` once (a `FRAME` record: the addresses of the matrices'
blocks, the norms and the row orders, the model's sizes; the barrier and the shared
scratch the parts meet in), and `batch_step` runs N token rows over a paged cache through
it (`decode_step`: one token of one contiguous cache, its N = 1 case): the per-step fields
(tokens, slots, block tables, the cache, the rotary tables) are written into the record,
then the native entry (`step_kernels._step_entry`, built as `attnkit.kernels.native` builds
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
from attnkit.models.llama.step_kernels import COLUMNS, FRAME, LAYER_NORMS, MATRICES_PER_LAYER, ROWS, TABLE_COLUMNS, \
    build, shared_size, source_digest

__all__ = ["FRAME", "Frame", "batch_step", "decode_step", "prepare", "shared_size"]


def _entry_sources() -> dict:
    return {"step": build().entry}


def _entries() -> native.Entries:
    """The step's native entry ("step"; `attnkit.kernels.native`), from a library named by
    the digest of the compiled code's file."""
    return native.entries(f"llama_step_{source_digest()}", _entry_sources)


class Frame:
    """One model's frame for `batch_step`: the `FRAME` record (`record`), the arrays whose
    addresses it holds (kept alive here), the parts' barrier and shared scratch (grown to
    the largest step), the worker threads, and the lock that lets one step at a time use them."""

    def __init__(self, table: np.ndarray, orders: np.ndarray, norms: tuple, floats: np.ndarray, heads: int,
                 kv_heads: int, E: int, vocab: int, windows: np.ndarray | None = None, ropes: np.ndarray | None = None,
                 flags: dict | None = None) -> None:
        layers = orders.shape[0]
        windows = np.zeros(layers, np.int64) if windows is None else windows
        ropes = np.zeros(layers, np.int64) if ropes is None else ropes
        flags = {} if flags is None else flags
        embed = MATRICES_PER_LAYER * layers  # the embedding's row; the gate's is 4
        self.d, self.ff = int(table[embed, COLUMNS]), int(table[4, ROWS])
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, E
        self.addresses = np.array([n.ctypes.data for n in norms], np.int64)
        self.keep = (table, orders, floats, norms, windows, ropes)
        self.rope_kinds = int(ropes.max()) + 1 if layers else 1
        self.barrier = np.zeros(2, np.int64)
        self.shared = np.empty(0, np.float32)
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
                                windows=windows.ctypes.data, ropes=ropes.ctypes.data, rope_kinds=self.rope_kinds,
                                **{name: int(bool(value)) for name, value in flags.items()}).items():
            record[name] = value

    def field(self, name: str) -> int:
        """The record's field `name` (a key of `FRAME`)."""
        return int(self.record[name][0])

    def scratch(self, rows: int) -> np.ndarray:
        """The shared scratch for a step of `rows` rows (call with the lock held)."""
        size = shared_size(self.heads, self.kv_heads, self.head_dim, self.d, self.ff, rows)
        if self.shared.shape[0] < size:
            self.shared = np.empty(size, np.float32)
        return self.shared

    def workers(self, count: int) -> ThreadPoolExecutor:
        """This frame's `count` worker threads (call with the lock held)."""
        if self._workers is None or self._worker_count != count:
            if self._workers is not None:
                self._workers.shutdown(wait=False)
            self._workers = ThreadPoolExecutor(count, thread_name_prefix="attnkit-decode")
            self._worker_count = count
        return self._workers


def prepare(table: np.ndarray, orders: np.ndarray, norms: list, eps: list, scale: float, heads: int, kv_heads: int,
            E: int, vocab: int, windows: Any = None, *, ropes: Any = None, post_norms: bool = False,
            qk_norm: bool = False, gelu_tanh: bool = False, embed_scale: float = 1.0,
            softcap: float | None = None) -> Frame:
    """A model's frame for `batch_step`.

    Arguments:
        table: (M, 6) int64, one row a matrix, columns `TABLE_COLUMNS` (the addresses of the
            blocks, which the caller keeps alive with the model): 7 a layer (query, key,
            value, output, gate, up, down), then the embedding and the output head.
        orders: (L, Hq E + Hkv E) int64, the output order of each layer's query and key rows.
        norms: the S L + 1 RMSNorm weights, float32 C-contiguous (read where they are: an
            edit in place reaches the step): each layer's in `LAYER_NORMS` order (attention,
            feed-forward (d,); with `post_norms` post-attention, post-feed-forward (d,); with
            `qk_norm` query, key (E,)), then the final norm (d,).
        eps: their epsilons; scale: the score scale.
        heads, kv_heads, E, vocab: the model's sizes.
        windows: (L,) each layer's sliding window (a query sees its last `window` keys,
            itself included), 0 for none; None (default): no layer has one.
        ropes: (L,) each layer's rotary table, an index into `batch_step`'s cos and sin
            (None: one table for every layer).
        post_norms, qk_norm, gelu_tanh: Gemma 3's block (a norm after each sublayer too;
            per-head query and key norms; tanh-GELU instead of SiLU); all False: Llama's.
        embed_scale: the embedding rows' multiplier (float64; Gemma 3: sqrt(d)).
        softcap: logits become softcap * tanh(logits / softcap) (None: as they are).
    """
    table = np.ascontiguousarray(table, np.int64)
    orders = np.ascontiguousarray(orders, np.int64)
    layers = orders.shape[0]
    if table.shape != (MATRICES_PER_LAYER * layers + 2, len(TABLE_COLUMNS)):
        raise ValueError(f"expected a table of shape ({MATRICES_PER_LAYER * layers + 2}, {len(TABLE_COLUMNS)}) for "
                         f"{layers} layers, got {table.shape}")
    names = [name for name in LAYER_NORMS if not (name.startswith("post") and not post_norms)
             and not (name[0] in "qk" and not qk_norm)]
    count = len(names) * layers + 1
    if orders.shape[1] != (heads + kv_heads) * E or len(norms) != count or len(eps) != count:
        raise ValueError(f"expected orders (L, {(heads + kv_heads) * E}) and {count} norms and eps, got "
                         f"{orders.shape}, {len(norms)} and {len(eps)}")
    d = norms[-1].shape
    sizes = [(E,) if name[0] in "qk" else d for name in names] * layers + [d]
    if any(n.dtype != np.float32 or not n.flags.c_contiguous or n.shape != size for n, size in zip(norms, sizes)):
        raise ValueError(f"expected the norms' weights float32, C-contiguous, of shapes {d} (and ({E},) for the "
                         "query and key norms)")
    floats = np.array([scale, embed_scale, 0.0 if softcap is None else softcap, *eps], np.float64)
    windows = np.zeros(layers, np.int64) if windows is None else np.array(windows, np.int64).reshape(-1)
    if windows.shape != (layers,) or (windows < 0).any():
        raise ValueError(f"expected {layers} windows >= 0 (0: none), got {windows.tolist()}")
    ropes = np.zeros(layers, np.int64) if ropes is None else np.array(ropes, np.int64).reshape(-1)
    if ropes.shape != (layers,) or (ropes < 0).any():
        raise ValueError(f"expected {layers} rotary table indices >= 0, got {ropes.tolist()}")
    return Frame(table, orders, tuple(norms), floats, heads, kv_heads, E, vocab, windows, ropes,
                 dict(post_norms=post_norms, qk_norm=qk_norm, gelu_tanh=gelu_tanh))


def _check_caches(frame: Frame, keys: np.ndarray, values: np.ndarray) -> None:
    if not (keys.flags.c_contiguous and values.flags.c_contiguous and keys.dtype == np.float32
            and values.dtype == np.float32 and keys.shape == values.shape and keys.ndim == 5):
        raise ValueError(f"expected two C-contiguous float32 caches of one shape (L, blocks, Hkv, block_size, E), "
                         f"got {keys.shape} {keys.dtype} and {values.shape} {values.dtype}")
    expected = (frame.field("layers"), frame.field("kv_heads"), frame.field("head_dim"))
    if (keys.shape[0], keys.shape[2], keys.shape[4]) != expected:
        raise ValueError(f"expected caches of shape ({expected[0]}, blocks, {expected[1]}, block_size, "
                         f"{expected[2]}), got {keys.shape}")


def batch_step(tokens: np.ndarray, slots: np.ndarray, tables: np.ndarray, wanted: np.ndarray, frame: Frame,
               cos: np.ndarray, sin: np.ndarray, keys: np.ndarray, values: np.ndarray, *, int8: bool = False,
               parts: int = 1, starts: np.ndarray | None = None) -> np.ndarray:
    """Logits (rows wanted, V) float32 of N token rows over a paged cache, in one call.

    Arguments:
        tokens: (N,) the rows' tokens; slots: (N,) their indices in their sequences' caches
            (a row's key and value are written at its slot; it attends to its sequence's
            cached keys starts .. slot, so a sequence's earlier rows in the step come first).
        tables: (N, width) int32, each row's sequence's block table (position p in block
            tables[i, p // block_size], at p % block_size).
        wanted: (N,) bool, the rows whose logits are computed, in row order.
        frame: the model's, from `prepare`.
        cos, sin: (N, E) float32 C-contiguous, the rows' rotary tables, or (kinds, N, E)
            one per kind of layer (`prepare`'s ropes index the first axis).
        keys, values: (L, blocks, Hkv, block_size, E) float32 C-contiguous, the cache.
        int8: the products of Q4_0, Q4_1 and Q8_0 on 8-bit activations.
        parts: threads (the calling thread runs part 0, the frame's workers the others).
        starts: (N,) the first cached key each row attends to (None: 0; a left-padded
            sequence's first real token).

    Every (row, output) sum is computed by the same code in the same order whatever else
    is in the step and whichever part computes it: a row's logits do not depend on the
    other rows, their number or order, or on `parts`.
    """
    _check_caches(frame, keys, values)
    tokens = np.ascontiguousarray(tokens, np.int64)
    slots = np.ascontiguousarray(slots, np.int64)
    tables = np.ascontiguousarray(tables, np.int32)
    wanted = np.asarray(wanted, bool)
    starts = np.zeros_like(slots) if starts is None else np.ascontiguousarray(starts, np.int64)
    n, E, rows = tokens.shape[0], frame.field("head_dim"), frame.embed_rows
    if tokens.ndim != 1 or slots.shape != (n,) or wanted.shape != (n,) or tables.ndim != 2 or tables.shape[0] != n \
            or starts.shape != (n,) or n == 0:
        raise ValueError(f"expected N > 0 tokens, slots, wanted (N,) and tables (N, width), got {tokens.shape}, "
                         f"{slots.shape}, {wanted.shape} and {tables.shape}")
    size, blocks = keys.shape[3], keys.shape[1]
    if tokens.min() < 0 or tokens.max() >= rows:
        raise ValueError(f"expected tokens in [0, {rows}), got {tokens.min()}..{tokens.max()}")
    if starts.min() < 0 or (starts > slots).any():
        raise ValueError(f"expected starts in [0, slot] of each row, got {starts.min()}..{starts.max()}")
    if slots.min() < 0 or (slots // size).max() >= tables.shape[1] or tables.min() < 0 or tables.max() >= blocks:
        raise ValueError(f"expected slots within each row's block table and block ids in [0, {blocks}), got slots "
                         f"{slots.min()}..{slots.max()}, tables of width {tables.shape[1]}, ids "
                         f"{tables.min()}..{tables.max()}")
    kinds = frame.rope_kinds
    cos, sin = (t.reshape(1, *t.shape) if t.ndim == 2 else t for t in (cos, sin))
    if any(t.shape != (kinds, n, E) or t.dtype != np.float32 or not t.flags.c_contiguous for t in (cos, sin)):
        raise ValueError(f"expected cos and sin of shape ({kinds}, {n}, {E}) (or ({n}, {E}) for one table), float32 "
                         f"and C-contiguous, got {cos.shape} {cos.dtype} and {sin.shape} {sin.dtype}")
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise ValueError(f"expected parts to be a positive int, got {parts!r}")
    entry = _entries()["step"]
    outputs = np.where(wanted, np.cumsum(wanted) - 1, -1).astype(np.int64)
    count = int(wanted.sum())
    logits = np.empty((max(count, 1), frame.vocab), np.float32)
    with frame.lock:  # one step at a time on a frame (two threads may generate with one model)
        shared = frame.scratch(n)
        record = frame.record
        for name, value in (("rows", n), ("tokens", tokens.ctypes.data), ("slots", slots.ctypes.data),
                            ("starts", starts.ctypes.data),
                            ("tables", tables.ctypes.data), ("width", tables.shape[1]),
                            ("outputs", outputs.ctypes.data), ("outputs_count", count), ("parts", parts),
                            ("int8", int(bool(int8))), ("cos", cos.ctypes.data), ("sin", sin.ctypes.data),
                            ("keys", keys.ctypes.data), ("values", values.ctypes.data), ("blocks", blocks),
                            ("block_size", size), ("logits", logits.ctypes.data), ("shared", shared.ctypes.data)):
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
    return logits[:count]


def decode_step(token: int, slot: int, frame: Frame, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                values: np.ndarray, *, int8: bool = False, parts: int = 1) -> np.ndarray:
    """Logits (V,) float32 of token `token` at cache index `slot` of one sequence's
    contiguous cache: `batch_step`'s one-row case (the cache one block of max_length).

    Arguments:
        frame: the model's, from `prepare`.
        cos, sin: (E,) float32 C-contiguous, the token's rotary tables, or (kinds, E) one per
            kind of layer.
        keys, values: (L, Hkv, max, E) float32 C-contiguous, the sequence's cache (the new key
            and value are written at `slot`).
        int8: the products of Q4_0, Q4_1 and Q8_0 on 8-bit activations.
        parts: threads (the calling thread runs part 0, the frame's workers the others).
    """
    if keys.ndim != 4 or values.ndim != 4:
        raise ValueError(f"expected caches of shape (L, Hkv, max, E), got {keys.shape} and {values.shape}")
    if not (0 <= token < frame.embed_rows and 0 <= slot < keys.shape[2]):
        raise ValueError(f"expected a token in [0, {frame.embed_rows}) at a slot in [0, {keys.shape[2]}), got {token} "
                         f"at {slot}")
    cos, sin = (t.reshape(-1, 1, t.shape[-1]) for t in (cos, sin))  # (kinds, 1, E)
    logits = batch_step(np.array([token]), np.array([slot]), np.zeros((1, 1), np.int32), np.ones(1, bool), frame,
                        cos, sin, keys[:, None], values[:, None], int8=int8, parts=parts)
    return logits[0]
