"""Flash attention on the CPU: exact attention computed tile by tile.

The plain path (`scaled_dot_product_attention`) materializes the (L, S) score
matrix. This one never does: for a block of queries it walks over blocks of
keys keeping, per query row, a running reference m (the max so far), a running
sum l = sum exp(s - m) and an accumulator acc = sum exp(s - m) v, rescaling both
by exp(m_old - m_new) whenever the reference moves (the online softmax). At the
end output = acc / l and lse = m + log(l). Extra memory is O(block_q * block_k)
per thread plus O(L + S) per head; results equal the plain path to rounding.

The backward is FlashAttention-2's: with D = rowsum(dO * O) (summed in float64)
it recomputes each tile's weights P = exp(s - lse) from the saved lse and
accumulates dV, dK and dQ tile by tile, never holding an (L, S) array either.
A row that the band lets see a single key takes D from its tile instead,
sum_j P_ij dP_ij as the plain path does, and so gets exactly the plain path's
zero dQ (FlashAttention-2's D leaves the rounding of dO . v there).

The scale multiplies q (and, for dQ, k) before each product. Scores beyond the
compute dtype (float32 inputs near 1e19 and up), a scale below 2^-16, or a
gradient overflowing on the way make a call run in float64 instead, so that
finite inputs give torch's math-backend answer in float64, never NaN.

Speed on a CPU comes from NumPy doing the heavy lifting in BLAS matmuls and
SIMD ufuncs that release the GIL: tiles are large (they fit the L2 cache),
everything stays in the compute dtype, buffers are reused (out=), blocks the
masks exclude entirely are skipped, and (batch, head, query block) tasks run on
a pool of threads while BLAS itself is held to one thread (threadpoolctl).
Value rows carry an extra column of ones, so P @ [V, 1] yields the row sums l
with the output; the backward folds -D into its dP matmul the same way.

Exactness between the two passes: tiles sit on one (block_q, block_k) grid in
the forward and the backward and their scores come from one function
(`_tile_scores`), so the backward rebuilds bitwise the scores whose lse the
forward saved; lse is kept in float64 and subtracted as a float32 part plus a
per-row factor. A near-one-hot row then gets weights exp(s - lse) that sum to
1 to rounding, as the plain path's normalized softmax does.

See docs/flash.md for the algorithm and the mods.
"""

from __future__ import annotations

import inspect
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from attnkit.functional._checks import (
    AttentionShapes,
    check_mask,
    check_qkv,
    all_finite,
    check_scale,
    needs_float64,
    output_ndim,
    require_float_tensor,
    scores_may_overflow,
    shape_str,
    start_dtype,
    sum_to_shape,
)
from attnkit.functional.attention import AttentionGrads, AttentionOutput
from attnkit.functional.masks import ALIGNMENTS
from attnkit.runtime import cpu_count, one_blas_thread

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


class AttentionState(NamedTuple):
    """Attention over some set of keys, in a form that can be merged.

    output: (..., H, L, Ev) the attention output over those keys.
    lse:    (..., H, L) natural-log logsumexp of each query row's masked,
            scaled scores (-inf for a row with no key allowed), in float64:
            rounding lse to float32 would scale a whole row of the weights the
            backward rebuilds from it by up to |lse| * 6e-8.
    """

    output: np.ndarray
    lse: np.ndarray


# ----------------------------------------------------------------------------- threads


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}
_scratch = threading.local()


def _pool(num_threads: int) -> ThreadPoolExecutor:
    with _pool_lock:
        if num_threads not in _pools:
            _pools[num_threads] = ThreadPoolExecutor(num_threads, thread_name_prefix="attnkit-flash")
        return _pools[num_threads]


def _buffer(name: str, size: int, dtype: np.dtype) -> np.ndarray:
    """A per-thread flat scratch buffer of at least `size` elements, reused across tiles."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    key = (name, np.dtype(dtype).str)
    buf = bufs.get(key)
    if buf is None or buf.size < size:
        buf = bufs[key] = np.empty(max(size, 1), dtype=dtype)
    return buf


def _tile(name: str, rows: int, cols: int, dtype: np.dtype) -> np.ndarray:
    """A C-contiguous (rows, cols) view of a scratch buffer (BLAS writes it directly)."""
    return _buffer(name, rows * cols, dtype)[: rows * cols].reshape(rows, cols)


_SERIAL_BELOW = 1 << 20  # score elements: below this, waking threads costs more than they save


def _run(tasks: list, fn: Callable, num_threads: int, work: int) -> list:
    """fn(*task) for every task, on the pool unless there is little work."""
    with one_blas_thread():  # our threads do the spreading
        if num_threads == 1 or len(tasks) <= 1 or work < _SERIAL_BELOW:
            return [fn(*t) for t in tasks]
        return list(_pool(num_threads).map(lambda t: fn(*t), tasks))


# ----------------------------------------------------------------------------- the plan


def _check_mod(fn, name: str, arity: int, args: str):
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


def _check_block(value, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected {name} to be a positive integer or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"expected {name} >= 1, got {value}")
    return int(value)


def _check_window(window) -> tuple[int | None, int | None]:
    """window=w (left=w, right=0) or (left, right), as in masks.sliding_window_mask."""
    if window is None:
        return None, None
    if isinstance(window, (int, np.integer)) and not isinstance(window, (bool, np.bool_)):
        window = (int(window), 0)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"expected window as an int (left) or a (left, right) pair, got {window!r}")
    sides = []
    for side, name in zip(window, ("left", "right")):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"expected window {name} to be an integer or None, got {type(side).__name__}")
        if side < 0:
            raise ValueError(f"expected window {name} >= 0, got {side}")
        sides.append(int(side))
    return sides[0], sides[1]


@dataclass
class _Plan:
    """Everything a tile needs, fixed once per call. Bands are on kv - q:
    a key kv is allowed for query q only if lo <= kv - q <= hi."""

    shapes: AttentionShapes
    scale: float
    lo: int | None
    hi: int | None
    mask: np.ndarray | None  # broadcast view (*batch, Hq, L, S) or None
    mask_mod: Callable | None  # evaluated per tile (a band-only mod is folded into lo/hi)
    score_mod: Callable | None
    block_q: int
    block_k: int
    num_threads: int
    _band_cache: dict = field(default_factory=dict)

    def kv_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys any query in [q0, q1) may see: the band's reach, clipped to [0, S)."""
        start = 0 if self.lo is None else max(0, q0 + self.lo)
        end = self.shapes.S if self.hi is None else min(self.shapes.S, q1 - 1 + self.hi + 1)
        return start, max(start, end)

    def grid_kv_range(self, q0: int, q1: int) -> tuple[int, int]:
        """kv_range widened to whole tiles of the block_k grid."""
        start, end = self.kv_range(q0, q1)
        if end <= start:
            return start, start
        bk = self.block_k
        return start // bk * bk, min(self.shapes.S, -(-end // bk) * bk)

    def tile_cols(self, q0: int, q1: int, k0: int, k1: int) -> tuple[int, int]:
        """The columns of grid tile (q0:q1, k0:k1) the band lets any of its rows
        see: a causal diagonal tile narrower than block_k is cut to its triangle's
        width. A function of the tile alone, so forward and backward cut alike."""
        c0 = k0 if self.lo is None else max(k0, q0 + self.lo)
        c1 = k1 if self.hi is None else min(k1, q1 + self.hi)
        return c0, max(c0, c1)

    def grid_q_range(self, k0: int, k1: int) -> tuple[int, int]:
        """q_range widened to whole tiles of the block_q grid."""
        start, end = self.q_range(k0, k1)
        if end <= start:
            return start, start
        bq = self.block_q
        return start // bq * bq, min(self.shapes.L, -(-end // bq) * bq)

    def q_range(self, k0: int, k1: int) -> tuple[int, int]:
        """Queries that may see any key in [k0, k1)."""
        start = 0 if self.hi is None else max(0, k0 - self.hi)
        end = self.shapes.L if self.lo is None else min(self.shapes.L, k1 - 1 - self.lo + 1)
        return start, max(start, end)

    def one_key_rows(self, q0: int, q1: int) -> slice | np.ndarray | None:
        """The rows of [q0, q1), as offsets (a slice when contiguous, as they are for
        every band), that the band lets see at most one key: row 0 of a causal mask,
        every row of a (0, 0) window, all rows when S = 1. None when there are none."""
        if self.shapes.S > 1 and self.lo is None and self.hi is None:
            return None
        key = ("one key", q0, q1)
        if key not in self._band_cache:
            S, rows = self.shapes.S, np.arange(q0, q1)
            first = np.zeros_like(rows) if self.lo is None else np.maximum(0, rows + self.lo)
            last = np.full_like(rows, S - 1) if self.hi is None else np.minimum(S - 1, rows + self.hi)
            found = np.flatnonzero(last - first <= 0)
            if found.size and found[-1] - found[0] + 1 == found.size:
                found = slice(int(found[0]), int(found[-1]) + 1)
            self._band_cache[key] = found if isinstance(found, slice) or found.size else None
        return self._band_cache[key]

    def batch_index(self, b: int) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(b, self.shapes.batch)) if self.shapes.batch else ()

    def band_bias(self, q0: int, q1: int, k0: int, k1: int, dtype) -> tuple[np.ndarray | None, bool]:
        """(bias, empty): a (rows, cols) additive tile, 0 where the band allows a
        pair and -inf where it does not (None when it allows all), and whether it
        allows none. Adding is ~3x faster than np.copyto(where=); the tile
        depends only on k0 - q0 and its shape, so it is cached (a causal mask's
        diagonal tiles repeat for every head)."""
        if not ((self.lo is not None and k0 - (q1 - 1) < self.lo) or (self.hi is not None and (k1 - 1) - q0 > self.hi)):
            return None, False
        key = (k0 - q0, q1 - q0, k1 - k0, np.dtype(dtype).str)
        hit = self._band_cache.get(key)
        if hit is None:
            rel = np.arange(k0, k1)[None, :] - np.arange(q0, q1)[:, None]  # kv - q
            blocked = np.zeros(rel.shape, dtype=bool)
            if self.lo is not None:
                blocked |= rel < self.lo
            if self.hi is not None:
                blocked |= rel > self.hi
            hit = (np.where(blocked, np.dtype(dtype).type(-np.inf), np.dtype(dtype).type(0)), bool(blocked.all()))
            if len(self._band_cache) < 4096:
                self._band_cache[key] = hit
        return hit

    def tile_masks(self, b: int, h: int, q0: int, q1: int, k0: int, k1: int, dtype):
        """(skip, blocked, adds) for one tile: skip when no pair is allowed;
        blocked a bool (rows, cols) array, True where a boolean mask or mask_mod
        excludes a pair, or None; adds the float tiles to add to the scores
        (the band's 0/-inf bias, the float attn_mask)."""
        bias, empty = self.band_bias(q0, q1, k0, k1, dtype)
        if empty:
            return True, None, ()
        adds = () if bias is None else (bias,)
        blocked = None
        if self.mask is not None:
            tile = self.mask[self.batch_index(b) + (h, slice(q0, q1), slice(k0, k1))]
            if tile.dtype == np.bool_:
                if not tile.all():
                    blocked = ~tile
            else:
                adds = adds + (tile,)
        if self.mask_mod is not None:
            allowed = np.asarray(
                self.mask_mod(b, h, np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :])
            )
            if allowed.dtype != np.bool_:
                raise TypeError(f"expected mask_mod to return booleans, got dtype {allowed.dtype}")
            allowed = np.broadcast_to(allowed, (q1 - q0, k1 - k0))
            if not allowed.all():
                blocked = ~allowed if blocked is None else blocked | ~allowed
        if blocked is not None:
            if bias is not None:
                blocked = blocked | np.isneginf(bias)
            if blocked.all():
                return True, None, ()
        return False, blocked, adds

    def modded(self, s: np.ndarray, b: int, h: int, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
        """score_mod applied to a tile of scaled scores (same shape, compute dtype)."""
        out = self.score_mod(s, b, h, np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :])
        out = np.asarray(out)
        if out.shape != s.shape:
            try:
                out = np.broadcast_to(out, s.shape)
            except ValueError:
                raise ValueError(
                    f"expected score_mod to return scores of shape {shape_str(s.shape)}, "
                    f"got {shape_str(out.shape)}"
                ) from None
        if out is not s:
            np.copyto(s, out, casting="same_kind")
        return s


def _make_plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align, window,
               score_mod, mask_mod, block_q, block_k, num_threads):
    query, key, value, shapes = check_qkv(query, key, value, enable_gqa)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"expected is_causal to be a bool, got {type(is_causal).__name__}")
    if causal_align not in ALIGNMENTS:
        raise ValueError(f"expected causal_align to be one of {ALIGNMENTS}, got {causal_align!r}")
    scale = check_scale(scale, shapes.E)
    q, k, v = (x[None] if x.ndim == 2 else x for x in (query, key, value))
    if q is not query:  # (L, E) inputs: a head axis of 1
        q, k, v, shapes = check_qkv(q, k, v, enable_gqa)
    mask = check_mask(attn_mask, shapes, bool(is_causal))
    if mask is not None:
        mask = np.broadcast_to(mask, shapes.scores_shape)
    score_mod = _check_mod(score_mod, "score_mod", 5, "(score, b, h, q_idx, kv_idx)")
    mask_mod = _check_mod(mask_mod, "mask_mod", 4, "(b, h, q_idx, kv_idx)")
    block_q, block_k = _check_block(block_q, "block_q"), _check_block(block_k, "block_k")
    if num_threads is None:
        num_threads = cpu_count()
    num_threads = _check_block(num_threads, "num_threads")

    L, S = shapes.L, shapes.S
    offset = 0 if causal_align == "top_left" else S - L
    lo = hi = None
    if is_causal:
        hi = offset
    left, right = _check_window(window)
    if right is not None:
        hi = offset + right if hi is None else min(hi, offset + right)
    if left is not None:
        lo = offset - left
    if mask_mod is not None and hasattr(mask_mod, "bind"):
        mask_mod = mask_mod.bind(L, S)
    if score_mod is not None and hasattr(score_mod, "bind"):
        score_mod = score_mod.bind(L, S)
    band = getattr(mask_mod, "band", None)
    if band is not None:  # a ready-made mod that implies lo <= kv - q <= hi
        mlo, mhi, exact = band
        if mlo is not None:
            lo = mlo if lo is None else max(lo, mlo)
        if mhi is not None:
            hi = mhi if hi is None else min(hi, mhi)
        if exact:
            mask_mod = None
        elif hasattr(mask_mod, "rest"):
            mask_mod = mask_mod.rest
    plan = _Plan(
        shapes=shapes, scale=scale, lo=lo, hi=hi, mask=mask, mask_mod=mask_mod, score_mod=score_mod,
        block_q=min(block_q or DEFAULT_BLOCK_Q, max(L, 1)), block_k=min(block_k or DEFAULT_BLOCK_K, max(S, 1)),
        num_threads=num_threads,
    )
    return q, k, v, plan


def _flat(x: np.ndarray, shapes: AttentionShapes, heads: int, dtype) -> np.ndarray:
    """(..., H, N, D) -> C-contiguous (B, H, N, D) in the compute dtype, B = prod(batch)."""
    B = math.prod(shapes.batch)
    return np.ascontiguousarray(x, dtype=dtype).reshape(B, heads, x.shape[-2], x.shape[-1])


def _with_ones(x: np.ndarray, n: int = 1) -> np.ndarray:
    """(B, H, N, D) -> (B, H, N, D + n) with n last columns of ones."""
    D = x.shape[-1]
    out = np.empty((*x.shape[:-1], D + n), dtype=x.dtype)
    out[..., :D] = x
    out[..., D:] = 1
    return out


# ----------------------------------------------------------------------------- forward


def _tile_scores(plan: _Plan, qs, k, s, b, h, q0, q1, k0, k1, adds) -> None:
    """s <- score_mod(qs[rows] k[k0:k1]^T) + adds, in place: the one way both the
    forward and the backward compute a tile's scores. Tiles sit on the same
    (block_q, block_k) grid in both and BLAS runs single-threaded, so the
    backward rebuilds bitwise the scores whose lse the forward saved: a
    near-one-hot row then gets exp(s - lse) = 1 to rounding, as the plain
    path's normalized softmax does."""
    np.matmul(qs, k[k0:k1].T, out=s)
    if plan.score_mod is not None:
        plan.modded(s, b, h, q0, q1, k0, k1)
    for add in adds:
        s += add


def _forward_rows(plan: _Plan, q_src, k, va, b, h, q0, q1, k_start, k_end, out_rows, lse_rows):
    """Queries [q0, q1) of head (b, h) over keys [k_start, k_end): writes
    out_rows (r, Ev) and lse_rows (r,). q_src (L, E) query rows, k (S, E)
    keys, va (S, Ev+1) values with a ones column. k_start and k_end lie on
    the block_k grid (or at S), so the tiles are the backward's (_tile_scores)."""
    cd = k.dtype
    Ev = va.shape[1] - 1
    r = q1 - q0
    qs = _tile("qs", r, k.shape[1], cd)
    np.multiply(q_src[q0:q1], cd.type(plan.scale), out=qs)
    m = np.full(r, -np.inf, dtype=cd)  # running max per row
    acc = np.zeros((r, Ev + 1), dtype=cd)  # [sum p v, sum p] relative to m
    part = _tile("part", r, Ev + 1, cd)
    for k_tile in range(k_start, k_end, plan.block_k):
        k0, k1 = plan.tile_cols(q0, q1, k_tile, min(k_tile + plan.block_k, k_end))
        if k1 <= k0:
            continue
        skip, blocked, adds = plan.tile_masks(b, h, q0, q1, k0, k1, cd)
        if skip:
            continue
        s = _tile("s", r, k1 - k0, cd)
        _tile_scores(plan, qs, k, s, b, h, q0, q1, k0, k1, adds)
        if blocked is not None:
            np.copyto(s, cd.type(-np.inf), where=blocked)
        new_m = np.maximum(m, s.max(axis=1))
        shift = np.where(np.isneginf(new_m), cd.type(0), new_m)  # an all -inf row stays at 0
        alpha = np.exp(m - shift)  # rescales what was accumulated against the old max
        # Shifting by the true max keeps s - max exact near the max, so that the
        # backward's exp(s - lse) reproduces these weights to rounding.
        s -= shift[:, None]
        np.exp(s, out=s)
        np.matmul(s, va[k0:k1], out=part)  # [P V, P 1]: the row sums come out of BLAS
        acc *= alpha[:, None]
        acc += part
        m = new_m
    total = acc[:, Ev]
    empty = total == 0  # no key allowed: output 0, lse -inf
    np.divide(acc[:, :Ev], np.where(empty, cd.type(1), total)[:, None], out=out_rows)
    with np.errstate(divide="ignore", invalid="ignore"):  # lse in float64: see AttentionState
        lse_rows[:] = np.where(empty, -np.inf, m.astype(np.float64) + np.log(total.astype(np.float64)))


def flash_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: int | tuple[int | None, int | None] | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    num_threads: int | None = None,
) -> np.ndarray | AttentionState:
    """Exact attention computed tile by tile: `scaled_dot_product_attention`'s
    results without ever holding the (L, S) scores.

    Arguments:
        query: (..., Hq, L, E) floating array (or (L, E)).
        key: (..., Hkv, S, E), same dtype and batch dims.
        value: (..., Hkv, S, Ev).
        attn_mask: bool (True = may attend) or float (added to the scores),
            broadcastable to (..., Hq, L, S); not together with is_causal.
        is_causal: causal mask, aligned by `causal_align`.
        scale: multiplies q . k; default 1/sqrt(E).
        enable_gqa: query head h reads key/value head h // (Hq // Hkv).
        causal_align: "top_left" (torch's is_causal; query i sees keys 0..i) or
            "bottom_right" (query i sees keys 0..i + S - L, as with a KV cache).
            Also aligns `window`.
        window: sliding window: an int `left` or a pair (left, right); query i
            sees keys i - left .. i + right (None = unbounded), exactly like
            `masks.sliding_window_mask(left=, right=)`. Tiles outside are skipped.
        score_mod: FlexAttention-style `score_mod(score, b, h, q_idx, kv_idx)`
            returning new scores; `score` is a (rows, cols) tile of scaled
            scores, q_idx (rows, 1) and kv_idx (1, cols) integer positions, h
            the query head and b the index into the flattened batch dims.
            Applied before attn_mask is added. See `attnkit.functional.mods`.
        mask_mod: `mask_mod(b, h, q_idx, kv_idx)` returning booleans (True = may
            attend), evaluated per tile; tiles it excludes entirely are skipped.
        block_q, block_k: tile sizes (default 512 x 512); pass the same to the backward.
        return_lse: also return the logsumexp of each score row.
        num_threads: worker threads (default: the CPUs this process may use).

    Returns:
        The output (..., Hq, L, Ev) in query's dtype, or with return_lse
        AttentionState(output, lse) with lse (..., Hq, L) in float64.
        A query row with no key allowed gets output 0 and lse -inf.
    """
    drop = max(3 - output_ndim(query, key, value), 0)  # (L, E) inputs run with a head axis of 1
    q, k, v, plan = _make_plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align,
                               window, score_mod, mask_mod, block_q, block_k, num_threads)
    shapes = plan.shapes
    out_shape = (*shapes.batch, shapes.q_heads, shapes.L, shapes.Ev)
    if shapes.nothing_to_do:  # an empty result, or no key at all: zeros, as torch gives
        out = np.zeros(out_shape, dtype=shapes.dtype)
        lse = np.full(out_shape[:-1], -np.inf, dtype=np.float64)
    else:
        dtype = start_dtype(shapes.compute_dtype, plan.scale)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is redone below
            out, lse = _flash_forward(plan, q, k, v, dtype)
        if needs_float64(q, k, plan.scale, dtype, lse, value=v, output=out):
            # scores (or a running sum of values) beyond float32: torch's float64 answer
            out, lse = _flash_forward(plan, q, k, v, np.dtype(np.float64))
        out = out.reshape(out_shape).astype(shapes.dtype, copy=False)
        lse = lse.reshape(out_shape[:-1])
    if drop:
        out, lse = out[0], lse[0]
    return AttentionState(out, lse) if return_lse else out


def _flash_forward(plan: _Plan, q, k, v, cd: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The tiled forward in dtype `cd`: output (B, Hq, L, Ev) in cd and lse
    (B, Hq, L) in float64, B the flattened batch dims."""
    shapes = plan.shapes
    B, Hq, g, L, S = math.prod(shapes.batch), shapes.q_heads, shapes.group, shapes.L, shapes.S
    q = _flat(q, shapes, Hq, cd)  # (B, Hq, L, E)
    k = _flat(k, shapes, shapes.kv_heads, cd)  # (B, Hkv, S, E)
    va = _with_ones(_flat(v, shapes, shapes.kv_heads, cd))  # (B, Hkv, S, Ev+1)
    out = np.zeros((B, Hq, L, shapes.Ev), dtype=cd)
    lse = np.full((B, Hq, L), -np.inf, dtype=np.float64)

    # Tasks: (b, h, query block), the longest first so the pool ends evenly. When
    # there are fewer query blocks than threads (decoding), split the keys too and
    # merge the partial states.
    blocks = []
    for q0 in range(0, L, plan.block_q):
        q1 = min(q0 + plan.block_q, L)
        k_start, k_end = plan.grid_kv_range(q0, q1)
        if k_end > k_start:
            blocks.append((q0, q1, k_start, k_end))
    blocks.sort(key=lambda t: t[1] - t[0] if plan.lo is None and plan.hi is None else t[3] - t[2], reverse=True)
    n_heads = B * Hq
    splits = 1
    if n_heads * len(blocks) < plan.num_threads and len(blocks) >= 1:
        widest = max(t[3] - t[2] for t in blocks)
        splits = max(1, min(plan.num_threads, widest // plan.block_k))

    def task(b, h, q0, q1, k_start, k_end):
        _forward_rows(plan, q[b, h], k[b, h // g], va[b, h // g], b, h, q0, q1, k_start, k_end,
                      out[b, h, q0:q1], lse[b, h, q0:q1])

    if splits == 1:
        tasks = [(b, h, *blk) for blk in blocks for b in range(B) for h in range(Hq)]
        _run(tasks, task, plan.num_threads, B * Hq * L * S)
    else:
        def split_task(b, h, q0, q1, k_start, k_end, o_part, l_part):
            _forward_rows(plan, q[b, h], k[b, h // g], va[b, h // g], b, h, q0, q1, k_start, k_end, o_part, l_part)

        tasks, parts = [], []
        for blk in blocks:
            q0, q1, k_start, k_end = blk
            # split edges on the block_k grid, so the tiles are the backward's
            edges = np.linspace(k_start, k_end, splits + 1).astype(int) // plan.block_k * plan.block_k
            edges[0], edges[-1] = k_start, k_end
            for b in range(B):
                for h in range(Hq):
                    o_parts = np.zeros((splits, q1 - q0, shapes.Ev), dtype=cd)
                    l_parts = np.full((splits, q1 - q0), -np.inf, dtype=np.float64)
                    parts.append((b, h, q0, q1, o_parts, l_parts))
                    for i in range(splits):
                        if edges[i + 1] > edges[i]:
                            tasks.append((b, h, q0, q1, int(edges[i]), int(edges[i + 1]), o_parts[i], l_parts[i]))
        _run(tasks, split_task, plan.num_threads, B * Hq * L * S)
        for b, h, q0, q1, o_parts, l_parts in parts:
            merged = merge_attention_states(o_parts, l_parts)
            out[b, h, q0:q1], lse[b, h, q0:q1] = merged.output, merged.lse

    return out, lse




# ----------------------------------------------------------------------------- backward


class _BackwardInputs(NamedTuple):
    """What every backward task reads: compute-dtype arrays with the batch dims flattened."""

    qs: np.ndarray  # (B, Hq, L, E) query * scale
    k: np.ndarray  # (B, Hkv, S, E)
    ks: np.ndarray  # (B, Hkv, S, E) key * scale: dQ = dS (K * scale), the scale before the product
    va: np.ndarray  # (B, Hkv, S, Ev+1) values with a ones column
    do_a: np.ndarray  # (B, Hq, L, Ev+1) [dO, -D]
    lse_hi: np.ndarray  # (B, Hq, L) lse = lse_hi + lse_lo, two compute-dtype parts (-inf rows at 0)
    lse_lo: np.ndarray


def _backward_cols(plan: _Plan, inputs: _BackwardInputs, b, h_kv, k0, k1, dq_acc, dk_out, dv_out):
    """Keys [k0, k1) of kv head (b, h_kv): accumulate their dK, dV over every query
    head of the group and every query tile that can see them, and add the dQ
    contributions into this thread's dq_acc (B, Hq, L, E)."""
    qs, do_a, lse_hi, lse_lo = inputs.qs, inputs.do_a, inputs.lse_hi, inputs.lse_lo
    k, ks, va = inputs.k[b, h_kv], inputs.ks[b, h_kv], inputs.va[b, h_kv]  # (S, E), (S, E), (S, Ev+1)
    cd = qs.dtype
    E, Ev = qs.shape[-1], do_a.shape[-1] - 1
    g, bq = plan.shapes.group, plan.block_q
    dk = np.zeros((k1 - k0, E), dtype=cd)
    dv = np.zeros((k1 - k0, Ev), dtype=cd)
    q_start, q_end = plan.grid_q_range(k0, k1)
    for h in range(h_kv * g, (h_kv + 1) * g):
        for q0 in range(q_start, q_end, bq):
            q1 = min(q0 + bq, q_end)
            r = q1 - q0
            c0, c1 = plan.tile_cols(q0, q1, k0, k1)  # the forward's tile: same grid, same cut
            n = c1 - c0
            if n <= 0:
                continue
            skip, blocked, adds = plan.tile_masks(b, h, q0, q1, c0, c1, cd)
            if skip:
                continue
            rows, cols, mine = slice(q0, q1), slice(c0, c1), slice(c0 - k0, c1 - k0)
            p = _tile("p", r, n, cd)
            _tile_scores(plan, qs[b, h, rows], k, p, b, h, q0, q1, c0, c1, adds)
            mod_grad = None
            if plan.score_mod is not None and plan.score_mod.grad is not None:  # None: additive
                pre = np.matmul(qs[b, h, rows], k[cols].T)  # the scores the mod saw
                mod_grad = plan.score_mod.grad(pre, b, h, np.arange(q0, q1)[:, None], np.arange(c0, c1)[None, :])
            # forward: P = exp(s - lse), with lse = hi + lo: P = exp(s - hi) * f, f = exp(-lo) per row
            p -= lse_hi[b, h, rows, None]
            if blocked is not None:
                np.copyto(p, cd.type(-np.inf), where=blocked)
            np.exp(p, out=p)
            row_f = np.exp(-lse_lo[b, h, rows])  # (r,) within a few ulps of 1
            # forward: out = P @ V   ->  dV += P^T dO,  dP = dO V^T
            dv_part = _tile("dv_part", n, Ev, cd)
            np.matmul(p.T, do_a[b, h, rows, :Ev] * row_f[:, None], out=dv_part)
            dv[mine] += dv_part
            ds = _tile("ds", r, n, cd)
            np.matmul(do_a[b, h, rows], va[cols].T, out=ds)  # dP - D via the [dO, -D] . [V, 1] column
            one = plan.one_key_rows(q0, q1)
            if one is not None:
                # A row that sees a single key takes D from the tile, as the plain path
                # does, D = sum_j P_ij dP_ij: consistent with the dP just rounded, its
                # dS is exactly 0 (FlashAttention-2's D would leave the rounding of dO . v).
                missed = np.einsum("ij,ij->i", ds[one], p[one])  # sum_j P_ij (dP_ij - D_i) / f_i
                missed *= row_f[one]
                ds[one] -= missed[:, None]
            # forward: P = softmax(s)  ->  dS = P * (dP - D)   (times f, applied to the rows below)
            np.multiply(ds, p, out=ds)
            if mod_grad is not None:
                # forward: s = score_mod(q k^T * scale)  ->  chain rule through the mod
                ds *= mod_grad
            # forward: s = (q * scale) k^T  ->  dQ += dS (K * scale), dK += dS^T (q * scale)
            dk_part = _tile("dk_part", n, E, cd)
            np.matmul(ds.T, qs[b, h, rows] * row_f[:, None], out=dk_part)
            dk[mine] += dk_part
            dq_part = _tile("dq_part", r, E, cd)
            np.matmul(ds, ks[cols], out=dq_part)
            dq_part *= row_f[:, None]
            dq_acc[b, h, rows] += dq_part
    dk_out[...] = dk
    dv_out[...] = dv


def flash_attention_backward(
    grad_output: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    output: np.ndarray,
    lse: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: int | tuple[int | None, int | None] | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_threads: int | None = None,
) -> AttentionGrads:
    """Gradients of `flash_attention`, FlashAttention-2 style, tile by tile.

    Takes the forward's inputs and mask arguments, its `output` and `lse`
    (from `flash_attention(..., return_lse=True)`) and grad_output = dLoss/dO
    of shape (..., Hq, L, Ev). With D = rowsum(dO * O) each tile's weights are
    recomputed as P = exp(s - lse) and

        dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D),
        dQ += dS K * scale,   dK += dS^T Q * scale.

    Work is spread over (batch, kv head, key block); each thread adds its dQ
    contributions into its own (B, Hq, L, E) buffer, summed at the end: extra
    memory O(threads * L + S), never (L, S).

    D is summed in float64. A row that the band lets see a single key takes D
    from its tile, sum_j P_ij dP_ij as the plain path does, so its dQ is exactly
    the plain path's 0. Where float32 cannot hold the scores (or a gradient on
    the way), or the scale is below 2^-16, everything runs in float64, the
    forward's lse included: torch's math-backend answer, never NaN.

    A score_mod needs its derivative d score_mod / d score for the chain rule:
    ready-made mods carry it (`.grad`); wrap your own function with
    `mods.ScoreMod(fn, grad)`, where grad=None declares it additive
    (derivative 1, as for ALiBi or any bias that ignores the score).

    Returns:
        AttentionGrads(grad_query, grad_key, grad_value) in the inputs' shapes
        and dtype. Rows with no key allowed give zero gradients.
    """
    drop = max(3 - output_ndim(query, key, value), 0)  # (L, E) inputs run with a head axis of 1
    q, k, v, plan = _make_plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align,
                               window, score_mod, mask_mod, block_q, block_k, num_threads)
    shapes = plan.shapes
    cd, Hq, Hkv = shapes.compute_dtype, shapes.q_heads, shapes.kv_heads
    L, S, E, Ev = shapes.L, shapes.S, shapes.E, shapes.Ev
    out_shape = (*shapes.batch, Hq, L, Ev)
    lse_shape = (*shapes.batch, Hq, L)
    extra = drop
    for arr, name, want in ((grad_output, "grad_output", out_shape), (output, "output", out_shape),
                            (lse, "lse", lse_shape)):
        arr = require_float_tensor(arr, name, 1)
        if arr.shape != want[extra:]:
            raise ValueError(f"expected {name} of shape {shape_str(want[extra:])}, got {shape_str(arr.shape)}")

    if plan.score_mod is not None and not hasattr(plan.score_mod, "grad"):
        raise TypeError(
            "flash_attention_backward needs the derivative of score_mod: wrap it as "
            "attnkit.functional.mods.ScoreMod(fn, grad) (grad=None if the mod only adds a bias)"
        )
    if shapes.nothing_to_do:  # an empty result, or no key at all: zero gradients
        return AttentionGrads(*(np.zeros(np.shape(x), dtype=shapes.dtype) for x in (query, key, value)))
    wide = np.dtype(np.float64)
    grads = None
    if start_dtype(cd, plan.scale) == cd and (cd == wide or not scores_may_overflow(q, k, plan.scale, cd)):
        with np.errstate(over="ignore", invalid="ignore"):
            grads = _flash_backward(plan, q, k, v, grad_output, output, lse, cd)
        if cd != wide and not all_finite(*grads) and all_finite(q, k, v, grad_output, output):
            grads = None  # a gradient beyond the compute dtype on the way
    if grads is None:
        # float64, from the forward on: a tiny scale, or scores or gradients beyond
        # float32 (torch's float64 answer). The weights exp(s - lse) are rebuilt from
        # an lse of the same float64 scores, never from float32 ones.
        out64, lse64 = _flash_forward(plan, q, k, v, wide)
        grads = _flash_backward(plan, q, k, v, grad_output, out64, lse64, wide)
    grads = (
        grads[0].reshape(*shapes.batch, Hq, L, E),
        grads[1].reshape(*shapes.batch, Hkv, S, E),
        grads[2].reshape(*shapes.batch, Hkv, S, Ev),
    )
    # Inputs that were broadcast (smaller rank, a dim of 1) sum their gradient back.
    grads = (sum_to_shape(grad, np.shape(x)) for grad, x in zip(grads, (query, key, value)))
    return AttentionGrads(*(x.astype(shapes.dtype, copy=False) for x in grads))


def _flash_backward(plan: _Plan, q, k, v, grad_output, output, lse, cd: np.dtype):
    """The tiled backward in dtype `cd`: (dQ (B, Hq, L, E), dK (B, Hkv, S, E),
    dV (B, Hkv, S, Ev)) in cd, B the flattened batch dims."""
    shapes = plan.shapes
    B, Hq, Hkv = math.prod(shapes.batch), shapes.q_heads, shapes.kv_heads
    L, S, E, Ev = shapes.L, shapes.S, shapes.E, shapes.Ev
    qs = _flat(q, shapes, Hq, cd) * cd.type(plan.scale)  # (B, Hq, L, E)
    k = _flat(k, shapes, Hkv, cd)  # (B, Hkv, S, E)
    ks = k * cd.type(plan.scale)  # (B, Hkv, S, E)
    va = _with_ones(_flat(v, shapes, Hkv, cd))  # (B, Hkv, S, Ev+1)
    d_out = np.asarray(grad_output, dtype=cd).reshape(B, Hq, L, Ev)
    o = np.asarray(output, dtype=cd).reshape(B, Hq, L, Ev)
    do_a = np.empty((B, Hq, L, Ev + 1), dtype=cd)  # [dO, -D]
    do_a[..., :Ev] = d_out
    # D = rowsum(dO * O), summed in float64: rounded once, to the compute dtype
    do_a[..., Ev] = -np.einsum("bhle,bhle->bhl", d_out, o, dtype=np.float64)
    # lse split into two compute-dtype parts so that the matmul subtracts it
    # to float64 accuracy (a float32 lse of 40 is off by up to 2e-6).
    lse64 = np.asarray(lse, dtype=np.float64).reshape(B, Hq, L).copy()
    lse64[np.isneginf(lse64)] = 0  # rows with no key: their tiles are all masked anyway
    lse_hi = lse64.astype(cd)
    lse_lo = (lse64 - lse_hi).astype(cd)
    inputs = _BackwardInputs(qs, k, ks, va, do_a, lse_hi, lse_lo)

    grad_k = np.zeros((B, Hkv, S, E), dtype=cd)
    grad_v = np.zeros((B, Hkv, S, Ev), dtype=cd)
    dq_buffers: dict[int, np.ndarray] = {}
    lock = threading.Lock()

    def task(b, h_kv, k0, k1):
        ident = threading.get_ident()
        with lock:
            if ident not in dq_buffers:
                dq_buffers[ident] = np.zeros((B, Hq, L, E), dtype=cd)
            dq_acc = dq_buffers[ident]
        _backward_cols(plan, inputs, b, h_kv, k0, k1, dq_acc, grad_k[b, h_kv, k0:k1], grad_v[b, h_kv, k0:k1])

    blocks = []
    for k0 in range(0, S, plan.block_k):
        k1 = min(k0 + plan.block_k, S)
        q_start, q_end = plan.grid_q_range(k0, k1)
        if q_end > q_start:
            blocks.append((k0, k1, q_end - q_start))
    blocks.sort(key=lambda t: t[2], reverse=True)
    tasks = [(b, h, k0, k1) for k0, k1, _ in blocks for b in range(B) for h in range(Hkv)]
    _run(tasks, task, plan.num_threads, 3 * B * Hq * L * S)

    grad_q = np.zeros((B, Hq, L, E), dtype=cd)
    for buf in dq_buffers.values():
        grad_q += buf
    return grad_q, grad_k, grad_v


# ----------------------------------------------------------------------------- merging


def merge_attention_states(outputs: Sequence[np.ndarray], lses: Sequence[np.ndarray]) -> AttentionState:
    """Combine attention computed over disjoint sets of keys into attention over their union.

    With per-part outputs o_i and logsumexps lse_i of the same queries,
        lse = log(sum_i exp(lse_i)),   output = sum_i exp(lse_i - lse) * o_i,
    exactly what attention over all the keys at once gives (split-KV decoding,
    chunked prefill). A part where a row saw no key weighs 0, whatever its
    output holds there; both markers of such a row are accepted: lse -inf
    (attnkit, FlexAttention: the log of an empty sum) and lse +inf
    (FlashAttention-2, vLLM). A row no part saw comes out output 0, lse -inf,
    never NaN. NaN in a part that counts propagates.

    Arguments:
        outputs: n arrays (..., L, Ev), or one stacked array (n, ..., L, Ev).
        lses: n arrays (..., L), or one stacked array (n, ..., L).

    Returns:
        AttentionState(output (..., L, Ev), lse (..., L)) in the outputs' dtype
        (float16 computes in float32).
    """
    outs = [require_float_tensor(o, f"outputs[{i}]", 1) for i, o in enumerate(outputs)]
    ls = [require_float_tensor(x, f"lses[{i}]", 1) for i, x in enumerate(lses)]
    if not outs:
        raise ValueError("merge_attention_states needs at least one state, got none")
    if len(outs) != len(ls):
        raise ValueError(f"expected as many lses as outputs, got {len(ls)} lses for {len(outs)} outputs")
    for i, (o, x) in enumerate(zip(outs, ls)):
        if o.shape != outs[0].shape:
            raise ValueError(f"expected every output of shape {shape_str(outs[0].shape)}, got {shape_str(o.shape)} at {i}")
        if o.ndim < 1 or x.shape != o.shape[:-1]:
            raise ValueError(
                f"expected lses[{i}] of shape {shape_str(o.shape[:-1])} (the output without its last axis), "
                f"got {shape_str(x.shape)}"
            )
    dtype = outs[0].dtype
    cd = np.dtype(np.float32) if dtype == np.float16 else np.result_type(dtype, ls[0].dtype)
    lse_stack = np.stack([x.astype(cd, copy=False) for x in ls])  # (n, ..., L)
    empty = np.isinf(lse_stack)  # -inf (ours, FlexAttention's) or +inf (FlashAttention-2's): no key
    lse_stack[empty] = -np.inf
    top = np.max(lse_stack, axis=0)
    top = np.where(np.isneginf(top), cd.type(0), top)
    weights = np.exp(lse_stack - top)  # (n, ..., L); 0 for parts that saw nothing
    total = weights.sum(axis=0)  # 0 where no part saw a key; NaN propagates
    with np.errstate(divide="ignore"):
        lse = np.where(total == 0, cd.type(-np.inf), top + np.log(np.where(total == 0, 1, total)))
    out = np.zeros(outs[0].shape, dtype=cd)
    for w, o, nothing in zip(weights, outs, empty):
        part = w[..., None] * o.astype(cd, copy=False)
        out += np.where(nothing[..., None], cd.type(0), part)  # an empty part's output is never read
    out /= np.where(total == 0, 1, total)[..., None]
    return AttentionState(out.astype(dtype, copy=False), lse.astype(cd, copy=False))


# ----------------------------------------------------------------------------- backend


def flash_backend(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rng: np.random.Generator | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
) -> np.ndarray | AttentionOutput:
    """`flash_attention` behind `scaled_dot_product_attention`'s signature
    (registered as ATTENTION_BACKENDS["flash"]). It never forms the weights,
    so dropout and return_weights are refused."""
    if dropout_p:
        raise ValueError(f"the flash backend has no dropout; expected dropout_p=0.0, got {dropout_p}")
    if return_weights:
        raise ValueError("the flash backend never forms the (L, S) weights; use the 'naive' backend for them")
    res = flash_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse=True)
    if not return_lse:
        return res.output
    return AttentionOutput(output=res.output, weights=None, lse=res.lse.astype(res.output.dtype, copy=False))
