"""Ready-made score and mask modifications for `flash_attention`, FlexAttention style.

A mask mod says which (query, key) pairs may attend; a score mod rewrites the
scaled scores before the softmax:

    mask_mod(b, h, q_idx, kv_idx) -> bool        True = may attend
    score_mod(score, b, h, q_idx, kv_idx) -> new score

`flash_attention` calls them once per tile, vectorized: `q_idx` is a (rows, 1)
and `kv_idx` a (1, cols) integer array of absolute positions, `h` the query
head, `b` the index into the flattened leading batch dims, and `score` the
(rows, cols) tile. Any function with those signatures works; the ones here also
tell flash which tiles they exclude wholesale (a band lo <= kv - q <= hi), so
those tiles are never computed, and score mods carry their derivative for the
backward.

Mods with an alignment (causal, sliding window, ALiBi) need the lengths for
"bottom_right": `flash_attention` binds them (`mod.bind(L, S)`); to use one
elsewhere, bind it yourself or go through `create_mask` / `score_bias`, which
turn a mod into the dense mask or bias the plain `scaled_dot_product_attention`
takes.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from attnkit.functional.band import Band, alignment_offset, check_align, check_integer

ModBand = tuple  # a mask mod's (lo | None, hi | None, exact: bool) on kv - q


# ----------------------------------------------------------------------------- what flash reads from a mod
# Any callable with the right signature is a mod; these Protocols name the extra
# knowledge a mod may carry, and flash checks them with isinstance.


@runtime_checkable
class BindsLengths(Protocol):
    """A mod that needs the lengths (bottom_right alignment): `bind(L, S)`
    returns the same mod for L queries over S keys."""

    def bind(self, L: int, S: int) -> Any: ...


@runtime_checkable
class BandedMaskMod(Protocol):
    """A mask mod that knows its band: every allowed pair has lo <= kv - q <= hi,
    `band` = (lo, hi, exact) or None, exact when the band is the whole mask, and
    `rest` the mod left to evaluate per tile once the band is applied (None: the
    whole mod). Flash skips tiles outside the band."""

    band: ModBand | None
    rest: Callable | None

    def __call__(self, b, h, q_idx, kv_idx) -> Any: ...


@runtime_checkable
class DifferentiableScoreMod(Protocol):
    """A score mod that carries its derivative for the backward: `grad(score, b,
    h, q_idx, kv_idx)` = d new_score / d score, or None for an additive mod."""

    grad: Callable | None

    def __call__(self, score, b, h, q_idx, kv_idx) -> Any: ...


def bound(mod, L: int, S: int):
    """`mod` for L queries over S keys: bound when it needs the lengths, else itself."""
    return mod.bind(L, S) if isinstance(mod, BindsLengths) else mod


def _offset(align: str, L: int | None, S: int | None) -> int:
    if align != "top_left" and (L is None or S is None):
        raise ValueError(
            "a bottom_right mod needs the lengths: call mod.bind(L, S) first "
            "(flash_attention, create_mask and score_bias do it for you)"
        )
    return alignment_offset(L or 0, S or 0, align)


def _per_batch(values, name: str, ndim_one: str) -> np.ndarray:
    arr = np.asarray(values)
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim not in (0, 1, 2):
        raise TypeError(f"expected {name} as integers shaped {ndim_one}, got dtype {arr.dtype} shape {arr.shape}")
    return arr


# ----------------------------------------------------------------------------- mask mods


class MaskMod:
    """A mask mod: `mod(b, h, q_idx, kv_idx) -> bool` (True = may attend).

    `band` is None or (lo, hi, exact): every allowed pair has lo <= kv - q <= hi
    (None = unbounded), and `exact` says the band is the whole mask. Flash skips
    tiles outside the band and, when exact, never evaluates the mod.
    """

    band: ModBand | None = None
    rest: Callable | None = None  # what remains per tile once the band is applied; None: the whole mod

    def __init__(self, fn: Callable | None = None, name: str = "mask_mod"):
        self._fn = fn
        self.name = name

    def __call__(self, b, h, q_idx, kv_idx):
        return self._fn(b, h, q_idx, kv_idx)

    def bind(self, L: int, S: int) -> "MaskMod":
        """This mod for L queries over S keys (resolves bottom_right alignment)."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class _BandMod(MaskMod):
    """lo <= kv - q - offset <= hi, aligned as `Band.aligned` (bottom_right needs bind(L, S))."""

    def __init__(self, lo: int | None, hi: int | None, align: str, name: str, lengths: tuple | None = None):
        super().__init__(name=name)
        self.lo_rel, self.hi_rel, self.align = lo, hi, check_align(align, "align")
        self._band = None
        if align == "top_left" or lengths is not None:
            L, S = lengths or (0, 0)
            self._band = Band.aligned(lo, hi, align=align, L=L, S=S)
            self.band = (self._band.lo, self._band.hi, True)

    def bind(self, L: int, S: int) -> "_BandMod":
        return _BandMod(self.lo_rel, self.hi_rel, self.align, self.name, lengths=(L, S))

    def __call__(self, b, h, q_idx, kv_idx):
        if self._band is None:
            _offset(self.align, None, None)  # raises: bottom_right needs bind(L, S)
        return self._band.allows(q_idx, kv_idx)


def causal(align: str = "top_left") -> MaskMod:
    """Query i sees keys up to its own position (aligned "top_left" like torch's
    is_causal, or "bottom_right" for a KV cache). Tiles above the diagonal are skipped."""
    return _BandMod(None, 0, align, f"causal, {align}")


def sliding_window(left: int | None, right: int = 0, align: str = "top_left") -> MaskMod:
    """Query i sees keys i - left .. i + right (None = unbounded), as
    `masks.sliding_window_mask`. Costs O(L * (left + right)) in flash."""
    left = None if left is None else check_integer(left, "left")
    right = check_integer(right, "right")
    return _BandMod(None if left is None else -left, right, align, f"window -{left}..+{right}, {align}")


def prefix_lm(prefix_length) -> MaskMod:
    """Prefix-LM (T5/PaLM style): every query sees the first `prefix_length`
    keys bidirectionally, and the rest causally (top-left). `prefix_length` is
    an int or a (B,) array, one per flattened batch index."""
    prefix = _per_batch(prefix_length, "prefix_length", "() or (B,)")
    if prefix.ndim > 1 or (prefix < 0).any():
        raise ValueError(f"expected prefix_length >= 0 as an int or a (B,) array, got {prefix_length!r}")

    def fn(b, h, q_idx, kv_idx):
        p = prefix if prefix.ndim == 0 else prefix[b]
        return (kv_idx < p) | (kv_idx <= q_idx)

    mod = MaskMod(fn, name=f"prefix_lm {prefix.tolist()}")
    # Nothing beyond max(prefix, q) is seen: a one-sided band only when there is no prefix.
    return mod


def document(q_ids, kv_ids=None) -> MaskMod:
    """Packed sequences: a query sees only keys of the same document (segment).

    q_ids: (L,) or (B, L) integer document id of each query position;
    kv_ids: the same for the keys (defaults to q_ids, self-attention).
    Combine with `causal()` through `and_mods` for packed causal LM training.
    """
    q_arr = _per_batch(q_ids, "q_ids", "(L,) or (B, L)")
    kv_arr = q_arr if kv_ids is None else _per_batch(kv_ids, "kv_ids", "(S,) or (B, S)")
    if q_arr.ndim == 0 or kv_arr.ndim == 0:
        raise ValueError("expected document ids shaped (L,) or (B, L), got a scalar")

    def fn(b, h, q_idx, kv_idx):
        qd = q_arr if q_arr.ndim == 1 else q_arr[b]
        kd = kv_arr if kv_arr.ndim == 1 else kv_arr[b]
        return qd[q_idx] == kd[kv_idx]

    return MaskMod(fn, name="document")


def key_padding(lengths) -> MaskMod:
    """Only the first lengths[b] keys of batch element b are real tokens."""
    arr = _per_batch(lengths, "lengths", "(B,)")
    if arr.ndim != 1 or (arr < 0).any():
        raise ValueError(f"expected lengths as a (B,) array of non-negative integers, got {lengths!r}")
    return MaskMod(lambda b, h, q_idx, kv_idx: np.broadcast_to(kv_idx < arr[b], np.broadcast_shapes(
        np.shape(q_idx), np.shape(kv_idx))), name="key_padding")


class _Combined(MaskMod):
    def __init__(self, mods, op):
        super().__init__(name=f"{op.__name__}({', '.join(repr(m) for m in mods)})")
        self.mods, self.op = list(mods), op
        if op is np.logical_and:
            banded = [m for m in self.mods if isinstance(m, BandedMaskMod) and m.band is not None]
            if banded:
                los = [m.band[0] for m in banded if m.band[0] is not None]
                his = [m.band[1] for m in banded if m.band[1] is not None]
                rest = [m for m in self.mods if not any(m is x and x.band[2] for x in banded)]
                self.band = (max(los) if los else None, min(his) if his else None, not rest)
                # what remains to evaluate per tile once the band is applied
                self.rest = None if not rest else (rest[0] if len(rest) == 1 else _Combined(rest, op))

    def bind(self, L: int, S: int) -> "_Combined":
        return _Combined([bound(m, L, S) for m in self.mods], self.op)

    def __call__(self, b, h, q_idx, kv_idx):
        shape = np.broadcast_shapes(np.shape(q_idx), np.shape(kv_idx))
        result = np.broadcast_to(np.asarray(self.mods[0](b, h, q_idx, kv_idx), dtype=bool), shape)
        for m in self.mods[1:]:
            result = self.op(result, m(b, h, q_idx, kv_idx))
        return result


def and_mods(*mods) -> MaskMod:
    """A pair is allowed when every mod allows it (bands intersect: tiles are still skipped)."""
    if not mods:
        raise ValueError("and_mods needs at least one mask mod")
    return _Combined(mods, np.logical_and)


def or_mods(*mods) -> MaskMod:
    """A pair is allowed when any mod allows it."""
    if not mods:
        raise ValueError("or_mods needs at least one mask mod")
    return _Combined(mods, np.logical_or)


# ----------------------------------------------------------------------------- score mods


class ScoreMod:
    """A score mod `mod(score, b, h, q_idx, kv_idx) -> new score` with its derivative.

    grad: `grad(score, b, h, q_idx, kv_idx) -> d new_score / d score` (elementwise),
    or None for an additive mod (derivative 1). `flash_attention_backward`
    needs it for the chain rule.
    """

    def __init__(self, fn: Callable, grad: Callable | None = None, name: str = "score_mod"):
        self._fn, self.grad, self.name = fn, grad, name

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self._fn(score, b, h, q_idx, kv_idx)

    def bind(self, L: int, S: int) -> "ScoreMod":
        return self

    def __repr__(self) -> str:
        return f"ScoreMod({self.name})"


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes (Press et al.): 2^(-8 i / n) for a power of two n,
    with the paper's interleaving rule otherwise. float64 (num_heads,)."""
    num_heads = check_integer(num_heads, "num_heads", minimum=1)
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < num_heads:
        extra = 2.0 ** (-4.0 / closest)
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return np.array(slopes, dtype=np.float64)


class _Alibi(ScoreMod):
    def __init__(self, slopes: np.ndarray, align: str, offset: int | None = None):
        super().__init__(self._apply, grad=None, name=f"alibi, {align}")
        self.slopes, self.align = slopes, check_align(align, "align")
        self.offset = 0 if align == "top_left" else offset

    def bind(self, L: int, S: int) -> "_Alibi":
        return _Alibi(self.slopes, self.align, offset=_offset(self.align, L, S))

    def _apply(self, score, b, h, q_idx, kv_idx):
        if self.offset is None:
            _offset(self.align, None, None)
        if not 0 <= h < len(self.slopes):
            raise ValueError(f"alibi has {len(self.slopes)} slopes but was called for head {h}")
        score = np.asarray(score)
        slope = score.dtype.type(self.slopes[h])
        rel = (np.asarray(kv_idx) - np.asarray(q_idx) - self.offset).astype(score.dtype)
        return score + slope * rel


def alibi(num_heads: int | None = None, *, slopes=None, align: str = "top_left") -> ScoreMod:
    """ALiBi: score + slope[h] * (kv - q), a linear penalty on distance, meant
    with causal attention (kv <= q). Give num_heads (standard slopes) or slopes."""
    if (num_heads is None) == (slopes is None):
        raise ValueError("give alibi either num_heads or slopes, not both or neither")
    slopes = alibi_slopes(num_heads) if slopes is None else np.asarray(slopes, dtype=np.float64).reshape(-1)
    return _Alibi(slopes, align)


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2, Grok): cap * tanh(score / cap), keeping
    scores in (-cap, cap). Derivative 1 - tanh(score / cap)^2.

    A float32 tile is capped in float64 and rounded once (returned in float64;
    the kernels store it in their float32 tile): NumPy's float32 tanh is off by
    up to 1.4 ulps (torch's 0.6), and with the division and the product the
    capped scores near the cap (ulp 4e-6 at 50) moved the weights enough to
    put dQ at 3.2x torch's error on FlashAttention's softcap grid case (6.4e-7
    -> 3.5e-7 here; docs/flash.md). It costs a float64 tanh per score (45 us
    against 9 on a 128 x 256 tile); the derivative stays in the tile's dtype
    (its rounding did not matter there)."""
    if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, (int, float, np.integer, np.floating)):
        raise TypeError(f"expected cap to be a positive number, got {type(cap).__name__}")
    cap = float(cap)
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"expected a finite cap > 0, got {cap}")

    def fn(score, b, h, q_idx, kv_idx):
        out = np.multiply(score, 1 / cap, dtype=np.promote_types(score.dtype, np.float64))
        np.tanh(out, out=out)
        out *= cap
        return out

    def grad(score, b, h, q_idx, kv_idx):
        t = np.tanh(score / score.dtype.type(cap))
        return 1 - t * t

    return ScoreMod(fn, grad, name=f"softcap {cap}")


# ----------------------------------------------------------------------------- dense forms


def create_mask(mask_mod: Callable, B: int, H: int, L: int, S: int) -> np.ndarray:
    """The dense bool (B, H, L, S) mask a mask mod stands for (for the plain path)."""
    mask_mod = bound(mask_mod, L, S)
    q_idx, kv_idx = np.arange(L)[:, None], np.arange(S)[None, :]
    out = np.empty((B, H, L, S), dtype=bool)
    for b in range(B):
        for h in range(H):
            out[b, h] = mask_mod(b, h, q_idx, kv_idx)
    return out


def apply_score_mod(score_mod: Callable, scores: np.ndarray) -> np.ndarray:
    """score_mod applied to dense scaled scores (B, H, L, S); returns a new array."""
    scores = np.asarray(scores)
    if scores.ndim != 4:
        raise ValueError(f"expected scores shaped (B, H, L, S), got {scores.shape}")
    B, H, L, S = scores.shape
    score_mod = bound(score_mod, L, S)
    q_idx, kv_idx = np.arange(L)[:, None], np.arange(S)[None, :]
    out = np.empty_like(scores)
    for b in range(B):
        for h in range(H):
            out[b, h] = score_mod(scores[b, h].copy(), b, h, q_idx, kv_idx)
    return out


def score_bias(score_mod: Callable, B: int, H: int, L: int, S: int, dtype=np.float64) -> np.ndarray:
    """The float (B, H, L, S) mask an additive score mod (such as ALiBi) equals:
    score_mod applied to zero scores. Pass it as attn_mask to the plain path."""
    return apply_score_mod(score_mod, np.zeros((B, H, L, S), dtype=dtype))
