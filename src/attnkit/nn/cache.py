"""The key/value cache that makes generation O(T) per token.

A decoder generating token T+1 needs the keys and values of tokens 0..T in
every layer. Recomputing them is O(T) matrix products per layer per token
(O(T^2) for a whole generation); keeping them is the KV cache: each step
projects only the new token, appends its key and value, and attends with one
query over the T+1 stored keys.

`KVCache` preallocates, per layer, key and value buffers of shape
(B, Hkv, max_length, E) and fills them left to right, so a decode step does no
allocation proportional to T and never copies the past. New queries sit at the
end of the sequence, so the causal mask is aligned bottom-right: with L new
queries over S = past + L keys, query i sees keys 0..past+i. With L = 1 (a
decode step) that is every key; with L > 1 (a prompt, or a chunk of a long
prompt) it is `causal_mask(L, S, align="bottom_right")`.

Left-padded batches: `key_padding` records, per sequence, which cached
positions hold real tokens; padded keys are never attended to.

`attend` never builds that mask: it hands the backend `is_causal=True,
causal_align="bottom_right"` and the (B, S) `key_padding_mask`, the one
backend signature's keywords, so "flash" skips the tiles above the diagonal
(its band) instead of testing a dense mask tile by tile. `mask(L, S)` still
gives the dense mask, for callers that want it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from attnkit.functional import AttentionOutput, get_attention
from attnkit.functional.masks import causal_mask
from attnkit.runtime import renamed_keyword

__all__ = ["KVCache"]


class KVCache:
    """Preallocated keys and values for every layer of a decoder.

    Arguments:
        num_layers: decoder layers.
        batch_size: B, sequences decoded together.
        num_kv_heads: Hkv, key/value heads per layer (fewer than query heads with GQA).
        head_dim: E of keys; `value_dim` defaults to it.
        max_length: positions to reserve; appending beyond raises ValueError.
        dtype: float32 (default) or float64.

    The buffers are allocated with `np.zeros`, which the OS backs lazily: reserving a long
    context costs memory only as it fills.

    Usage (inside a model's layer `i`, after projecting the new tokens):

        out = cache.attend(i, query, key, value)   # query (B, Hq, L, E), key/value (B, Hkv, L, E)

    and, once per forward pass before the layers, `cache.add_padding(mask)` for the new tokens
    when the batch is left-padded.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        *,
        value_dim: int | None = None,
        dtype: np.dtype | type = np.float32,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_length", max_length),
        ):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"expected dtype float32 or float64, got {dtype}")
        value_dim = head_dim if value_dim is None else value_dim
        self.num_layers = int(num_layers)
        self.batch_size = int(batch_size)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.value_dim = int(value_dim)
        self.max_length = int(max_length)
        self.dtype = dtype
        shape_k = (batch_size, num_kv_heads, max_length, head_dim)
        shape_v = (batch_size, num_kv_heads, max_length, value_dim)
        # every layer's buffer is a view of one array (L, B, Hkv, max, E): a compiled decode
        # step (attnkit.models.llama.step) reads and writes all layers through it (`stores`)
        self._key_store = np.zeros((num_layers, *shape_k), dtype)
        self._value_store = np.zeros((num_layers, *shape_v), dtype)
        self.keys = list(self._key_store)  # each (B, Hkv, max, E)
        self.values = list(self._value_store)  # each (B, Hkv, max, Ev)
        self.key_padding = np.ones((batch_size, max_length), dtype=bool)  # True = real token
        self._lengths = [0] * num_layers
        self._padded = False

    # -- bookkeeping ---------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Positions stored by every layer (the last layer is updated last)."""
        return self._lengths[-1]

    def __len__(self) -> int:
        return self.length

    @property
    def has_padding(self) -> bool:
        """Whether any stored position is padding (then attention needs a per-sequence mask)."""
        return self._padded

    def reset(self) -> None:
        """Forget everything (the buffers are reused)."""
        self._lengths = [0] * self.num_layers
        self.key_padding[:] = True
        self._padded = False

    def crop(self, length: int) -> None:
        """Keep only the first `length` positions (e.g. to drop a rejected continuation)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"expected a length in [0, {self.length}], got {length}")
        self._lengths = [length] * self.num_layers
        self.key_padding[:, length:] = True
        self._padded = not bool(self.key_padding[:, :length].all())

    def add_padding(self, mask: np.ndarray) -> None:
        """Mark which of the next L positions are real tokens (True) or padding (False).

        Arguments:
            mask: (B, L) bool, for the tokens the next forward pass appends.
        """
        mask = np.asarray(mask, dtype=bool)
        start = self.length
        if mask.ndim != 2 or mask.shape[0] != self.batch_size:
            raise ValueError(f"expected a padding mask of shape ({self.batch_size}, L), got {mask.shape}")
        if start + mask.shape[1] > self.max_length:
            raise ValueError(
                f"cache holds at most {self.max_length} positions; {start} are used and {mask.shape[1]} more came"
            )
        self.key_padding[:, start : start + mask.shape[1]] = mask
        if not mask.all():
            self._padded = True

    @property
    def stores(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The (L, B, Hkv, max_length, E) key and value arrays behind `keys` and `values`
        (every layer's buffer is a view of them), or None when a layer's buffer was replaced
        by another array. A compiled step reads and writes every layer through them, then
        counts what it wrote with `advance`."""
        intact = all(k.base is self._key_store for k in self.keys) and all(
            v.base is self._value_store for v in self.values)
        return (self._key_store, self._value_store) if intact else None

    def advance(self, count: int) -> None:
        """Count `count` more positions as stored in every layer: the ones written into
        `stores` directly (by a compiled decode step) rather than through `update`.

        Raises:
            ValueError: beyond `max_length`, or a count that is not a non-negative int.
        """
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"expected a count of positions >= 0, got {count!r}")
        stop = self.length + int(count)
        if stop > self.max_length:
            raise ValueError(
                f"cache holds at most {self.max_length} positions; {self.length} are used and {count} more came")
        self._lengths = [stop] * self.num_layers

    # -- append and attend ---------------------------------------------------------------
    def update(self, layer: int, key: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append L new keys/values to `layer`; return views of all S stored so far.

        Arguments:
            key: (B, Hkv, L, E); value: (B, Hkv, L, Ev).

        Returns:
            (keys (B, Hkv, S, E), values (B, Hkv, S, Ev)), views into the buffers (no copy).
        """
        start = self._lengths[layer]
        L = key.shape[-2]
        expected_k = (self.batch_size, self.num_kv_heads, L, self.head_dim)
        expected_v = (self.batch_size, self.num_kv_heads, L, self.value_dim)
        if key.shape != expected_k or value.shape != expected_v:
            raise ValueError(
                f"expected key {expected_k} and value {expected_v} (B, Hkv, L, E), got {key.shape} and {value.shape}"
            )
        stop = start + L
        if stop > self.max_length:
            raise ValueError(f"cache holds at most {self.max_length} positions; {start} are used and {L} more came")
        self.keys[layer][:, :, start:stop] = key
        self.values[layer][:, :, start:stop] = value
        self._lengths[layer] = stop
        return self.keys[layer][:, :, :stop], self.values[layer][:, :, :stop]

    def mask(self, L: int, S: int, *, causal: bool = True) -> np.ndarray | None:
        """The boolean mask for L new queries over S cached keys, or None when all may attend.

        Bottom-right causal (query i sees keys 0..S-L+i; causal=False leaves it out),
        combined with the padding of each sequence: shape (L, S) or (B, 1, L, S).
        """
        causal = causal_mask(L, S, align="bottom_right") if causal and L > 1 else None
        if not self._padded:
            return causal
        padding = self.key_padding[:, None, None, :S]  # (B, 1, 1, S)
        return padding if causal is None else (padding & causal)

    def attend(
        self,
        layer: int,
        query: np.ndarray,
        key: np.ndarray,
        value: np.ndarray,
        *,
        scale: float | None = None,
        backend: str | Callable = "naive",
        return_weights: bool = False,
        attention: str | Callable | None = None,
    ) -> np.ndarray | AttentionOutput:
        """Append `key`/`value` to `layer`, then attend from `query` over everything stored.

        Arguments:
            query: (B, Hq, L, E) for the L new positions; Hq a multiple of Hkv (GQA).
            key, value: (B, Hkv, L, E) / (B, Hkv, L, Ev) of the same positions.
            scale: score scale, default 1/sqrt(E).
            backend: a name in `attnkit.functional.ATTENTION_BACKENDS`, or a function with
                the one backend signature (`attnkit.functional`); attention modules pass
                their `attend`, which dispatches on their `backend` and records maps. It is
                called with is_causal=True, causal_align="bottom_right" and, when the batch
                is padded, key_padding_mask (B, S): never a dense mask.
            return_weights: also return the (B, Hq, L, S) attention weights.
            attention: the old spelling of `backend` (deprecated; goes in 0.3.0).

        Returns:
            (B, Hq, L, Ev), or AttentionOutput when return_weights.
        """
        backend = renamed_keyword("KVCache.attend", "attention", attention, "backend", backend, "naive")
        attend = get_attention(backend) if isinstance(backend, str) else backend
        keys, values = self.update(layer, key, value)  # (B, Hkv, S, E)
        S = keys.shape[-2]
        return attend(
            query,
            keys,
            values,
            is_causal=True,
            scale=scale,
            enable_gqa=query.shape[-3] != self.num_kv_heads,
            causal_align="bottom_right",  # the L new queries are the last L of the S keys
            key_padding_mask=self.key_padding[:, :S] if self._padded else None,  # (B, S)
            return_weights=return_weights,
        )

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, length={self.length}/{self.max_length}, dtype={self.dtype})"
        )
