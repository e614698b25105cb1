"""The key/value cache for decoding: attnkit.nn.KVCache in torch."""

from __future__ import annotations

import torch

from attnkit.functional.band import Band

__all__ = ["KVCache"]


class KVCache:
    """Preallocated keys and values for every layer of a decoder: attnkit.nn.KVCache in torch.

    Arguments:
        num_layers, batch_size, num_kv_heads, head_dim, max_length: buffers of shape
            (B, Hkv, max_length, E) per layer; appending beyond max_length raises ValueError.
        value_dim: Ev (defaults to head_dim).
        dtype, device: of the buffers.

    `update(layer, key, value)` writes (B, Hkv, L, E) new entries after the ones
    already stored and returns views of everything so far, (B, Hkv, S, E): a
    decode step costs O(S), never a copy of the past. New queries sit at the end
    of the keys, so causal attention over the cache is aligned bottom-right:
    `mask(L, S)` is `None` for a single new query and
    `causal_mask(L, S, align="bottom_right")` otherwise, combined with the
    padding recorded by `add_padding` for left-padded batches.
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
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        for name, v in (("num_layers", num_layers), ("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("max_length", max_length), ("value_dim", value_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"expected {name} to be a positive int, got {v!r}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"expected a floating torch dtype, got {dtype!r}")
        self.num_layers, self.batch_size, self.num_kv_heads = num_layers, batch_size, num_kv_heads
        self.head_dim, self.value_dim, self.max_length = head_dim, value_dim, max_length
        self.dtype = dtype
        shape_k = (batch_size, num_kv_heads, max_length, head_dim)
        shape_v = (batch_size, num_kv_heads, max_length, value_dim)
        self.keys = [torch.zeros(shape_k, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape_v, dtype=dtype, device=device) for _ in range(num_layers)]
        self.key_padding = torch.ones(batch_size, max_length, dtype=torch.bool, device=device)  # True = real
        self._lengths = [0] * num_layers
        self._padded = False

    @property
    def length(self) -> int:
        """Positions stored by every layer (the last layer is updated last)."""
        return self._lengths[-1]

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget every stored position (the buffers are reused)."""
        self._lengths = [0] * self.num_layers
        self.key_padding.fill_(True)
        self._padded = False

    def crop(self, length: int) -> None:
        """Keep only the first `length` positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"expected a length in [0, {self.length}], got {length}")
        self._lengths = [length] * self.num_layers
        self.key_padding[:, length:] = True
        self._padded = not bool(self.key_padding[:, :length].all())

    def add_padding(self, mask: torch.Tensor) -> None:
        """Mark which of the next L positions are real tokens (True) or padding (False): (B, L) bool."""
        mask = torch.as_tensor(mask, dtype=torch.bool, device=self.key_padding.device)
        start = self.length
        if mask.dim() != 2 or mask.shape[0] != self.batch_size:
            raise ValueError(f"expected a padding mask of shape ({self.batch_size}, L), got {tuple(mask.shape)}")
        if start + mask.shape[1] > self.max_length:
            raise ValueError(
                f"cache holds at most {self.max_length} positions; {start} are used and {mask.shape[1]} more came"
            )
        self.key_padding[:, start : start + mask.shape[1]] = mask
        if not bool(mask.all()):
            self._padded = True

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key (B, Hkv, L, E) and value (B, Hkv, L, Ev) to `layer`; return views of all S stored."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"expected a layer in [0, {self.num_layers}), got {layer}")
        start = self._lengths[layer]
        L = key.shape[-2] if key.dim() >= 2 else 0
        expected_k = (self.batch_size, self.num_kv_heads, L, self.head_dim)
        expected_v = (self.batch_size, self.num_kv_heads, L, self.value_dim)
        if tuple(key.shape) != expected_k or tuple(value.shape) != expected_v:
            raise ValueError(
                f"expected key {expected_k} and value {expected_v} (B, Hkv, L, E), "
                f"got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        stop = start + L
        if stop > self.max_length:
            raise ValueError(f"cache holds at most {self.max_length} positions; {start} are used and {L} more came")
        self.keys[layer][:, :, start:stop] = key
        self.values[layer][:, :, start:stop] = value
        self._lengths[layer] = stop
        return self.keys[layer][:, :, :stop], self.values[layer][:, :, :stop]

    def mask(self, L: int, S: int, *, causal: bool = True) -> torch.Tensor | None:
        """Bool mask for L new queries over S cached keys, or None when every key may be seen:
        bottom-right causal (query i sees keys 0..S-L+i) and the recorded padding,
        shape (L, S) or (B, 1, L, S)."""
        device = self.key_padding.device
        allowed = None
        if causal and L > 1:
            band = Band.from_options(is_causal=True, causal_align="bottom_right", L=L, S=S)
            allowed = torch.from_numpy(band.dense(L, S)).to(device)  # (L, S)
        if not self._padded:
            return allowed
        padding = self.key_padding[:, None, None, :S]  # (B, 1, 1, S)
        return padding if allowed is None else padding & allowed

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, length={self.length}/{self.max_length}, dtype={self.dtype})"
        )
