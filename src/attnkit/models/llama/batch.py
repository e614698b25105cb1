"""A Llama's batched step: rows of many sequences over one `PagedKVCache`, in one call.

A server decodes many requests at once (continuous batching): each step holds one token of
every running sequence and chunks of the prompts that arrived (chunked prefill). A
`BatchStep` runs such a step:

    cache = new_cache(model, tokens=4096)
    step = BatchStep(model, cache)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 3); cache.reserve(b, 1)
    logits = step.run([StepRow(a, 5, False), StepRow(a, 9, False), StepRow(a, 2, True),
                       StepRow(b, 7, True)])        # (2, V): a's last row, then b's

Row i's token goes at its sequence's end: position = the sequence's length before the step
plus the rows of that sequence before i. Every row's key and value are written into the
cache; logits are computed for the rows that ask (the output head is the largest product).

Two ways run it, chosen once per `BatchStep` (`compiled`, `reason`):

- the compiled batched step (`attnkit.models.llama.step.batch_step`), when the model is one
  the compiled decode step runs (`compiled_step_reason`): every product reads each
  quantized block once for all rows; a row's logits are the same bits whatever else is in
  the step, however its sequence's earlier tokens were fed, on any thread count;
- the modules otherwise (kernels off, a model of float weights, a watched layer): each
  sequence's blocks gathered into a contiguous `KVCache`, the model's own `forward` on its
  rows, the new keys and values scattered back. Its logits do not depend on the other
  sequences in the step either (each sequence runs alone), but a prefill chunk's size may
  change their last bits (the modules' products are BLAS's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnkit.nn.paged import PagedKVCache

__all__ = ["BatchStep", "StepRow", "new_cache"]


@dataclass(frozen=True)
class StepRow:
    """One token row of a batched step.

    sequence: a `PagedKVCache` sequence id.
    token: the token appended at the sequence's end (its position: the length then).
    logits: whether this row's logits are returned (the last row of a prefill chunk, every
        decode row).
    """

    sequence: int
    token: int
    logits: bool


def new_cache(model: Any, *, tokens: int, block_size: int = 16) -> PagedKVCache:
    """A `PagedKVCache` for `model` holding `tokens` tokens in all (ceil(tokens / block_size)
    blocks), float64 for a float64 model, else float32."""
    for name, value in (("tokens", tokens), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    c = model.config
    dtype = np.float64 if model.dtype == np.float64 else np.float32
    return PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, blocks=-(-int(tokens) // int(block_size)),
                        block_size=int(block_size), dtype=dtype)


def _runs(rows: Sequence[StepRow]) -> list[tuple[int, int, int]]:
    """(sequence, first row, stop row) of each run of consecutive rows of one sequence."""
    runs: list[tuple[int, int, int]] = []
    for i, row in enumerate(rows):
        if runs and runs[-1][0] == row.sequence:
            runs[-1] = (row.sequence, runs[-1][1], i + 1)
        else:
            runs.append((row.sequence, i, i + 1))
    return runs


class BatchStep:
    """One model's batched step over a PagedKVCache: rows of many sequences (decode tokens and
    prefill chunks, a sequence's rows consecutive and in order) in one call.

    Arguments:
        model: a `LlamaForCausalLM` (`attnkit.models.AutoCausalLM` loads one).
        cache: the `PagedKVCache` the rows' sequences live in (`new_cache(model, ...)`).
        threads: threads a compiled step runs on (None: the BLAS thread limit in force, at
            most the CPUs this process may use); the module fallback runs under that BLAS limit.

    Attributes:
        compiled: True when the compiled kernel runs the steps, False when the modules do.
        reason: why not compiled (`compiled_step_reason`'s words), None when compiled.
    """

    def __init__(self, model: Any, cache: PagedKVCache, *, threads: int | None = None) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"expected a PagedKVCache, got {type(cache).__name__}")
        c = model.config
        expected = (c.num_layers, c.num_kv_heads, c.head_dim)
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != expected:
            raise ValueError(f"expected a cache of (layers, kv_heads, head_dim) {expected} for this model, got "
                             f"{(cache.num_layers, cache.num_kv_heads, cache.head_dim)}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, (int, np.integer))
                                    or threads < 1):
            raise ValueError(f"expected threads to be a positive int or None, got {threads!r}")
        self.model, self.cache, self.threads = model, cache, threads
        from attnkit.models.llama.fused import batch_step_reason

        self.reason = batch_step_reason(model, cache)
        self.compiled = self.reason is None

    def _check(self, rows: Sequence[StepRow]) -> list[tuple[int, int, int]]:
        """The rows' runs, after checking every row (ValueError naming the first bad one)."""
        vocab, cache = self.model.config.vocab_size, self.cache
        for i, row in enumerate(rows):
            if not isinstance(row, StepRow):
                raise TypeError(f"expected StepRow rows, got {type(row).__name__} at row {i}")
            token = row.token
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab:
                raise ValueError(f"expected row {i}'s token to be an id in [0, {vocab}), got {row.token!r}")
        runs, seen = _runs(rows), set()
        for seq, first, stop in runs:
            if seq in seen:
                raise ValueError(f"expected a sequence's rows consecutive, sequence {seq} comes again at row {first}")
            seen.add(seq)
        for seq, first, stop in runs:
            length = cache.length(seq)  # ValueError for an unknown id
            if length + stop - first > cache.capacity(seq) or not cache.writable(seq):
                raise ValueError(f"row {first}: sequence {seq} has room for {cache.capacity(seq) - length} more "
                                 f"tokens, got {stop - first}: call cache.reserve({seq}, {stop - first}) first")
            if length + stop - first > self.model.context_length:
                raise ValueError(f"row {first}: sequence {seq} would pass the model's context of "
                                 f"{self.model.context_length} tokens")
        return runs

    def run(self, rows: Sequence[StepRow]) -> np.ndarray:
        """Logits (number of rows with logits=True, V) float32, in row order; every row's key
        and value appended to its sequence (call `cache.reserve` first: a row without room
        is a ValueError naming it)."""
        rows = list(rows)
        runs = self._check(rows)
        if not rows:
            return np.empty((0, self.model.config.vocab_size), np.float32)
        if self.compiled:
            from attnkit.models.llama.fused import batch_logits

            logits = batch_logits(self.model, self.cache, rows, runs, self.threads)
            if logits is not None:
                for seq, first, stop in runs:
                    self.cache.append(seq, [row.token for row in rows[first:stop]])
                return logits
        return self._modules(rows, runs)

    def _modules(self, rows: list[StepRow], runs: list[tuple[int, int, int]]) -> np.ndarray:
        """The module fallback: each sequence alone through the model's `forward` on a
        contiguous `KVCache` gathered from its blocks, the new keys and values scattered back."""
        from attnkit.runtime import blas_threads

        model, cache, size = self.model, self.cache, self.cache.block_size
        found = []
        for seq, first, stop in runs:
            length, count = cache.length(seq), stop - first
            table = cache.block_table(seq)
            held = -(-length // size)
            contiguous = model.new_cache(1, length + count)
            if contiguous.dtype != cache.dtype:
                raise TypeError(f"expected a {contiguous.dtype} cache for this model, got {cache.dtype}")
            for layer in range(cache.num_layers):  # (blocks, Hkv, size, E) -> (Hkv, length, E)
                for store, into in ((cache.keys, contiguous.keys), (cache.values, contiguous.values)):
                    gathered = store[layer, table[:held]].transpose(1, 0, 2, 3).reshape(cache.num_kv_heads, -1,
                                                                                        cache.head_dim)
                    into[layer][0, :, :length] = gathered[:, :length]
            contiguous.advance(length)
            ids = np.array([[row.token for row in rows[first:stop]]], np.int64)
            if self.threads is None:
                logits = model(ids, cache=contiguous)[0]  # (count, V)
            else:
                with blas_threads(self.threads):
                    logits = model(ids, cache=contiguous)[0]
            for p in range(length, length + count):
                block, at = table[p // size], p % size
                for layer in range(cache.num_layers):
                    cache.keys[layer, block, :, at] = contiguous.keys[layer][0, :, p]
                    cache.values[layer, block, :, at] = contiguous.values[layer][0, :, p]
            cache.append(seq, ids[0].tolist())
            found.extend(logits[i - first] for i in range(first, stop) if rows[i].logits)
        vocab = model.config.vocab_size
        return np.array(found, np.float32).reshape(len(found), vocab)
