"""Attention masks in attnkit's one polarity: True = this query may attend to this key.

That is the polarity of torch's `F.scaled_dot_product_attention`, JAX and MLX.
Masks are boolean arrays of shape (L, S) or anything that broadcasts to the
scores (..., H, L, S); padding masks are (B, S). `to_additive` turns a boolean
mask into the float form (0 where allowed, -inf where not) that can be added to
scores, and `from_torch_mask` converts torch `nn.MultiheadAttention`'s opposite
polarity (True = masked out) at the boundary.

Causal alignment, for L queries over S keys:

- ``top_left`` (torch's ``is_causal=True``): query i sees keys 0..i. When L > S
  the last queries see everything; when L < S the last keys are never seen.
- ``bottom_right``: query i sees keys 0..i + (S - L). This is what decoding with
  a KV cache needs: the L new queries are the last L positions of the S keys.
"""

from __future__ import annotations

import numpy as np

from attnkit.functional._checks import shape_str
from attnkit.functional.band import ALIGNMENTS, Band, check_integer  # noqa: F401  (ALIGNMENTS: re-exported)


def causal_mask(L: int, S: int | None = None, *, align: str = "top_left") -> np.ndarray:
    """Boolean (L, S) mask where query i may attend to keys at or before its position.

    Arguments:
        L: number of queries.
        S: number of keys (defaults to L).
        align: "top_left" (torch's is_causal) or "bottom_right" (KV-cache decoding).

    Returns:
        bool array (L, S), True = may attend.
    """
    L = check_integer(L, "L")
    S = L if S is None else check_integer(S, "S")
    return Band.aligned(None, 0, align=align, L=L, S=S).dense(L, S)


def sliding_window_mask(
    L: int, S: int | None = None, *, left: int | None = None, right: int = 0, align: str = "top_left"
) -> np.ndarray:
    """Boolean (L, S) mask letting query i see keys from i - left to i + right.

    Positions are aligned as in `causal_mask`. `left=None` means no limit to
    the left; `right=0` with any `left` is causal local attention (Mistral's
    sliding window is `left=window - 1, right=0`).
    """
    L = check_integer(L, "L")
    S = L if S is None else check_integer(S, "S")
    right = check_integer(right, "right")
    left = None if left is None else check_integer(left, "left")
    return Band.aligned(None if left is None else -left, right, align=align, L=L, S=S).dense(L, S)


def padding_mask(lengths, max_len: int | None = None) -> np.ndarray:
    """Boolean (B, max_len) key mask from sequence lengths: True = a real token.

    Arguments:
        lengths: (B,) non-negative integers, the real length of each sequence.
        max_len: padded length (defaults to max(lengths)).

    Returns:
        bool (B, max_len). Expand it to the scores with `key_mask_to_attn_mask`.
    """
    if hasattr(lengths, "detach"):  # a torch tensor; torch itself is never imported here
        lengths = lengths.detach().cpu().numpy()
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"expected lengths as a 1-D array (B,), got shape {shape_str(lengths.shape)}")
    if lengths.size == 0 and lengths.dtype == np.float64:  # np.asarray([]) is float64
        lengths = lengths.astype(np.int64)
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"expected lengths to be integers, got dtype {lengths.dtype}")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"expected non-negative lengths, got {lengths.tolist()}")
    longest = int(lengths.max()) if lengths.size else 0
    max_len = longest if max_len is None else check_integer(max_len, "max_len")
    if longest > max_len:
        raise ValueError(f"expected lengths <= max_len={max_len}, got a length of {longest}")
    return np.arange(max_len)[None, :] < lengths[:, None]


def key_mask_to_attn_mask(key_mask) -> np.ndarray:
    """(B, S) key mask (True = real token) -> (B, 1, 1, S), broadcastable to (B, H, L, S)."""
    key_mask = np.asarray(key_mask)
    if key_mask.dtype != np.bool_ or key_mask.ndim != 2:
        raise (TypeError if key_mask.dtype != np.bool_ else ValueError)(
            f"expected key_mask as a boolean (B, S) array with True = real token, got shape "
            f"{shape_str(key_mask.shape)} of dtype {key_mask.dtype}"
        )
    return key_mask[:, None, None, :]


def _require_bool(masks: tuple, what: str) -> list[np.ndarray]:
    if not masks:
        raise ValueError(f"{what} needs at least one mask")
    arrays = [np.asarray(m) for m in masks]
    for i, m in enumerate(arrays):
        if m.dtype != np.bool_:
            raise TypeError(
                f"{what} combines boolean masks; mask {i} has dtype {m.dtype} "
                "(add float masks to each other instead)"
            )
    try:
        np.broadcast_shapes(*(m.shape for m in arrays))
    except ValueError:
        shapes = ", ".join(shape_str(m.shape) for m in arrays)
        raise ValueError(f"{what}: mask shapes do not broadcast together: {shapes}") from None
    return arrays


def and_masks(*masks) -> np.ndarray:
    """A position is allowed when every mask allows it (broadcasting)."""
    arrays = _require_bool(masks, "and_masks")
    return np.logical_and.reduce(np.broadcast_arrays(*arrays)) if len(arrays) > 1 else arrays[0].copy()


def or_masks(*masks) -> np.ndarray:
    """A position is allowed when any mask allows it (broadcasting)."""
    arrays = _require_bool(masks, "or_masks")
    return np.logical_or.reduce(np.broadcast_arrays(*arrays)) if len(arrays) > 1 else arrays[0].copy()


def to_additive(mask, dtype=np.float32) -> np.ndarray:
    """Boolean mask -> float mask with 0 where allowed and -inf where not."""
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"expected a boolean mask, got dtype {mask.dtype}")
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.floating):
        raise TypeError(f"expected a floating dtype, got {dtype}")
    return np.where(mask, dtype.type(0), dtype.type(-np.inf))


def from_torch_mask(mask) -> np.ndarray:
    """Convert a torch `nn.MultiheadAttention` mask to attnkit's polarity.

    torch's `nn.MultiheadAttention` (its `attn_mask` and `key_padding_mask`) and
    `nn.Transformer*` layers read a boolean True as "masked out"; attnkit reads
    True as "may attend". Boolean masks are therefore inverted. Float masks mean
    the same thing in both (added to the scores) and are returned unchanged.
    Accepts numpy arrays and CPU torch tensors.
    """
    if hasattr(mask, "detach"):  # a torch tensor; torch itself is never imported here
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return ~mask
    if np.issubdtype(mask.dtype, np.floating):
        return mask
    raise TypeError(f"expected a boolean or floating mask, got dtype {mask.dtype}")
