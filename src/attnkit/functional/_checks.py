"""Input checks shared by every attention implementation.

Each public function validates at its boundary with these helpers, so every
kernel (plain, tiled) reports the same error for the same mistake. Messages say
what was expected and what arrived.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import numpy as np

# the alignment and window checks live with the band they describe (re-exported for old imports)
from attnkit.functional.band import ALIGNMENTS, check_align, check_window  # noqa: F401
# the range of the scores (which dtype a kernel runs in) has its public module (re-exported for old imports)
from attnkit.functional.precision import (  # noqa: F401
    TINY_SCALE,
    all_finite,
    needs_float64,
    scores_bound_exceeds,
    scores_may_overflow,
    start_dtype,
)


def shape_str(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def compute_dtype_of(dtype: np.dtype) -> np.dtype:
    """float16 computes in float32; float32 and float64 compute as themselves."""
    return np.dtype(np.float32) if dtype == np.float16 else np.dtype(dtype)


def as_float_array(x, name: str) -> np.ndarray:
    """Array-like of real numbers -> floating ndarray (integers become float64)."""
    arr = np.asarray(x)
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
        raise TypeError(f"expected {name} to hold real numbers, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.integer):
        arr = arr.astype(np.float64)
    return arr


def require_float_tensor(x, name: str, min_ndim: int) -> np.ndarray:
    """A floating ndarray of at least `min_ndim` dims, as attention inputs must be."""
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__array__") or isinstance(x, (list, tuple)):
            x = np.asarray(x)
        else:
            raise TypeError(f"expected {name} to be a numpy array, got {type(x).__name__}")
    if x.dtype.kind != "f":  # np.issubdtype(x.dtype, np.floating), without its cost on every call
        raise TypeError(
            f"expected {name} to be a floating array (float16, float32 or float64), got dtype {x.dtype}"
        )
    if x.ndim < min_ndim:
        raise ValueError(
            f"expected {name} of rank >= {min_ndim} laid out as (..., H, L, E), "
            f"got shape {shape_str(x.shape)}"
        )
    return x


@dataclass(frozen=True)
class AttentionShapes:
    """Sizes of one attention call, read off validated inputs."""

    batch: tuple[int, ...]  # leading batch dims
    q_heads: int
    kv_heads: int
    L: int  # query length
    S: int  # key length
    E: int  # query/key head dim
    Ev: int  # value head dim
    dtype: np.dtype  # input and output dtype
    compute_dtype: np.dtype

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 without GQA; 0 when there are none)."""
        return self.q_heads // self.kv_heads if self.kv_heads else 0

    @property
    def nothing_to_do(self) -> bool:
        """No query (an empty batch, no query head, L = 0) or no key at all (S = 0,
        no key/value head): the result is known without computing, empty or zeros
        as for fully masked rows."""
        return 0 in (*self.batch, self.q_heads, self.L, self.S, self.kv_heads)

    @property
    def scores_shape(self) -> tuple[int, ...]:
        return (*self.batch, self.q_heads, self.L, self.S)


def _broadcast_or_fail(shapes: list[tuple[int, ...]], what: str, arrays: tuple) -> tuple[int, ...]:
    if all(shape == shapes[0] for shape in shapes):  # the usual case, without np.broadcast_shapes' cost
        return tuple(shapes[0])
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        got = ", ".join(shape_str(a.shape) for a in arrays)
        raise ValueError(f"expected {what} of query, key and value to broadcast together, got shapes {got}") from None


def check_qkv(query, key, value, enable_gqa: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, AttentionShapes]:
    """Validate query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev).

    Leading dims broadcast as in torch (ranks may differ; a dim of 1 stretches),
    and a head count of 1 on either side broadcasts too. The arrays come back as
    broadcast views of rank >= 3 shaped (*batch, Hq, L, E) and (*batch, Hkv, S, ·),
    so every kernel sees one layout; `shapes` describes them.
    """
    query = require_float_tensor(query, "query", 2)
    key = require_float_tensor(key, "key", 2)
    value = require_float_tensor(value, "value", 2)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "expected query, key and value of one dtype, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}"
        )
    originals = (query, key, value)
    L, E = query.shape[-2:]
    S, Ek = key.shape[-2:]
    Sv, Ev = value.shape[-2:]
    if Ek != E:
        raise ValueError(
            f"expected key of shape (..., H, S, E) with E={E} like query, got {shape_str(key.shape)}"
        )
    if Sv != S:
        raise ValueError(
            f"expected value of shape (..., H, S={S}, Ev) with S like key {shape_str(key.shape)}, "
            f"got {shape_str(value.shape)}"
        )
    # Pad every input to one rank >= 3 with leading 1s: (L, E) becomes (1, L, E).
    ndim = max(query.ndim, key.ndim, value.ndim, 3)
    query, key, value = (x.reshape((1,) * (ndim - x.ndim) + x.shape) for x in originals)
    q_heads, k_heads, v_heads = query.shape[-3], key.shape[-3], value.shape[-3]
    if k_heads != v_heads and 1 not in (k_heads, v_heads):
        raise ValueError(
            f"expected key and value with the same number of heads, got shapes "
            f"{shape_str(key.shape)} and {shape_str(value.shape)}"
        )
    kv_heads = v_heads if k_heads == 1 else k_heads  # a single head stretches, to 0 heads too
    # No key/value head means no key: every query attends to nothing (output 0), as in torch.
    if q_heads != kv_heads and kv_heads not in (0, 1):
        if q_heads == 1:  # one query head broadcasts over every key/value head
            q_heads = kv_heads
        elif not enable_gqa:
            raise ValueError(
                f"query has {q_heads} heads but key/value have {kv_heads}; "
                "pass enable_gqa=True for grouped-query attention"
            )
        elif q_heads % kv_heads != 0:
            raise ValueError(
                f"expected the query head count to be a multiple of the key/value head count "
                f"for grouped-query attention, got {q_heads} query heads over {kv_heads}"
            )
    batch = _broadcast_or_fail([x.shape[:-3] for x in (query, key, value)], "the leading batch dims", originals)
    query = np.broadcast_to(query, (*batch, q_heads, L, E)) if query.shape != (*batch, q_heads, L, E) else query
    key = np.broadcast_to(key, (*batch, kv_heads, S, E)) if key.shape != (*batch, kv_heads, S, E) else key
    value = np.broadcast_to(value, (*batch, kv_heads, S, Ev)) if value.shape != (*batch, kv_heads, S, Ev) else value
    shapes = AttentionShapes(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, L=L, S=S, E=E, Ev=Ev,
        dtype=query.dtype, compute_dtype=compute_dtype_of(query.dtype),
    )
    return query, key, value, shapes


def output_ndim(*arrays) -> int:
    """The rank of attention's output for these inputs: the largest input rank."""
    return max(a.ndim if isinstance(a, np.ndarray) else np.ndim(a) for a in arrays)


def sum_to_shape(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reduce a gradient computed for a broadcast input back to the input's shape."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad


def check_scale(scale, E: int) -> float:
    """The softmax temperature: 1/sqrt(E) by default, else a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(E) if E > 0 else 1.0
    if isinstance(scale, np.ndarray) and scale.ndim == 0:
        scale = scale[()]  # a 0-d array counts as the number it holds
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"expected scale to be a real number or None, got {type(scale).__name__}")
    scale = float(scale)  # a Python float never promotes float32 arrays to float64
    if not math.isfinite(scale):
        raise ValueError(f"expected a finite scale, got {scale}")
    return scale


def check_rng(rng) -> np.random.Generator:
    """A Generator for dropout: a Generator (used as is), an integer seed, or None (fresh entropy)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or (isinstance(rng, (int, np.integer)) and not isinstance(rng, (bool, np.bool_))):
        if rng is not None and rng < 0:
            raise ValueError(f"expected rng to be a non-negative integer seed, got {rng}")
        return np.random.default_rng(rng)
    raise TypeError(f"expected rng to be a numpy.random.Generator, an integer seed or None, got {type(rng).__name__}")


def check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(f"expected dropout_p to be a number in [0, 1), got {type(dropout_p).__name__}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"expected dropout_p in [0, 1), got {dropout_p}")
    return dropout_p


def check_mask(attn_mask, shapes: AttentionShapes, is_causal: bool) -> np.ndarray | None:
    """A boolean (True = may attend) or additive float mask that broadcasts to (..., Hq, L, S).

    Float masks are returned in the compute dtype; boolean masks as they are.
    """
    if attn_mask is None:
        return None
    if is_causal:
        raise ValueError(
            "got both attn_mask and is_causal=True; pass one: build a causal mask with "
            "attnkit.masks.causal_mask and combine it with yours using attnkit.masks.and_masks"
        )
    mask = np.asarray(attn_mask)
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.floating):
        raise TypeError(
            "expected attn_mask to be boolean (True = may attend) or floating (added to the scores), "
            f"got dtype {mask.dtype}"
        )
    target = shapes.scores_shape
    try:
        broadcast = np.broadcast_shapes(mask.shape, target)
    except ValueError:
        broadcast = None
    if broadcast != target:
        raise ValueError(
            f"expected attn_mask broadcastable to (..., H, L, S) = {shape_str(target)}, "
            f"got {shape_str(mask.shape)}"
        )
    if mask.dtype != np.bool_:
        mask = mask.astype(shapes.compute_dtype, copy=False)
    return mask


def check_mod(fn, name: str, arity: int, args: str):
    """A score or mask mod: None, or a callable taking `arity` positional arguments."""
    if fn is None:
        return None
    if not callable(fn):
        raise TypeError(f"expected {name} to be callable {name}{args}, got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(*([None] * arity))
    except TypeError:
        raise TypeError(
            f"expected {name} to take {arity} positional arguments {args}, "
            f"got a callable with signature {inspect.signature(fn)}"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def check_key_padding_mask(key_padding_mask, shapes: AttentionShapes) -> np.ndarray | None:
    """A boolean (..., S) key mask, True = a real key that may be attended, whose
    leading dims broadcast to the batch dims; returned as (*batch, S) (a view)."""
    if key_padding_mask is None:
        return None
    mask = np.asarray(key_padding_mask)
    expected = f"(..., S) with S={shapes.S} and leading dims broadcastable to the batch {shape_str(shapes.batch)}"
    if mask.dtype != np.bool_:
        raise TypeError(
            f"expected key_padding_mask to be boolean {expected}, True = real key, got dtype {mask.dtype}"
        )
    try:
        ok = mask.ndim >= 1 and mask.shape[-1] == shapes.S and (
            np.broadcast_shapes(mask.shape[:-1], shapes.batch) == tuple(shapes.batch)
        )
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"expected key_padding_mask of shape {expected}, got {shape_str(mask.shape)}")
    return np.broadcast_to(mask, (*shapes.batch, shapes.S))
