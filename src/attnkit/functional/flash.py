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

The forward and the backward share one plan (`FlashPlan`): the validated
problem, its band, mask and mods, and the tile grid. `flash_attention(...,
return_lse=True)` returns it inside its `AttentionState`, and
`flash_attention_backward(grad_output, q, k, v, output, state)` takes it from
there, so the backward cannot run on another grid than the forward's (a state
of another problem is refused).

The scale multiplies q (and, for dQ, k) before each product. Scores beyond the
compute dtype (float32 inputs near 1e19 and up), a scale below 2^-16, or a
gradient overflowing on the way make a call run in float64 instead, so that
finite inputs give torch's math-backend answer in float64, never NaN.

Speed on a CPU comes from NumPy doing the heavy lifting in BLAS matmuls and
SIMD ufuncs that release the GIL: tiles are sized from the L2 cache the OS
reports (and cut finer along a causal diagonal), everything stays in the
compute dtype, buffers are reused (out=), blocks the masks exclude entirely are
skipped, and (batch, head, query block) tasks run on a pool of threads while
BLAS itself is held to one thread (threadpoolctl). Value rows carry an extra
column of ones, so P @ [V, 1] yields the row sums l with the output; the
backward folds -D into its dP matmul the same way. (Not exp2 with log2(e)
folded into the scale: NumPy's exp2 is twice as fast as exp on arguments in
[-126, 0] but 3-40x slower on -inf and on results that underflow, which masked
and causal tiles are full of.)

Exactness between the two passes: tiles sit on one (block_q, block_k) grid in
the forward and the backward and their scores come from one function
(`_tile_scores`), so the backward rebuilds bitwise the scores whose lse the
forward saved; lse is kept in float64 and subtracted as a float32 part plus a
per-row factor. A near-one-hot row then gets weights exp(s - lse) that sum to
1 to rounding, as the plain path's normalized softmax does.

See docs/flash.md for the algorithm and the mods.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable, NamedTuple, Sequence

import numpy as np

from attnkit.functional._checks import (
    AttentionShapes,
    check_key_padding_mask,
    check_mask,
    check_mod,
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
from attnkit.functional.attention import AttentionGrads, AttentionOutput, scaled_dot_product_attention
from attnkit.functional.band import Band, check_integer
from attnkit.functional.mods import BandedMaskMod, DifferentiableScoreMod, and_mods, bound
from attnkit.runtime import cpu_count, one_blas_thread

MAX_BLOCK = 512  # the largest tile side, and the key tiles' width (see choose_blocks)
PIECE_ROWS = 128  # rows per piece where a band's edge crosses a tile: smaller products run slower than they save
ONES_MIN_ROWS = 64  # query rows per kv head from which keys and values are copied with a ones column (see FlashPlan)
FEW_ROWS_KEYS = 8192  # key tile width below ONES_MIN_ROWS rows: amortizes each tile's calls (see _make_plan)


@dataclass(frozen=True, eq=False)
class AttentionState:
    """Attention over some set of keys, in a form that can be merged, and, from
    `flash_attention(..., return_lse=True)`, what its backward needs.

    output: (..., H, L, Ev) the attention output over those keys.
    lse:    (..., H, L) natural-log logsumexp of each query row's masked,
            scaled scores (-inf for a row with no key allowed), in float64:
            rounding lse to float32 would scale a whole row of the weights the
            backward rebuilds from it by up to |lse| * 6e-8.
    plan:   the forward's `FlashPlan` (problem, band, mask, mods, tile grid),
            for `flash_attention_backward`; None for a merged state.
    shift:  (..., H, L) float64, the constant the forward subtracted inside
            each row's score products (see `_forward_rows`), so that the
            backward rebuilds bitwise the same scores; None for a merged state.
    shifted_lse: (..., H, L) float64, lse - shift as the forward summed it
            (lse itself, in float64, drops the low bits of a shift near 1e10).

    `output, lse = state` unpacks it as before.
    """

    output: np.ndarray
    lse: np.ndarray
    plan: FlashPlan | None = field(default=None, repr=False)
    shift: np.ndarray | None = field(default=None, repr=False)
    shifted_lse: np.ndarray | None = field(default=None, repr=False)

    def __iter__(self):
        return iter((self.output, self.lse))


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


_ARENA_BYTES = 64 << 20  # one call's O(L) temporaries a thread keeps for its next call


def _arena(shapes: Sequence[tuple[int, ...]], dtype: np.dtype) -> list[np.ndarray]:
    """Arrays of these shapes for one call's temporaries (uninitialized), carved
    from one block: the calling thread's scratch when they fit _ARENA_BYTES,
    else a fresh block. Fresh arrays are faulted in page by page on first touch,
    and glibc hands large freed blocks back to the OS: a backward at L = 1024,
    H = 8 took ~7,500 page faults, ~16 ms of its ~60, on the 2-core AMD VM."""
    dtype = np.dtype(dtype)
    sizes = [math.prod(shape) for shape in shapes]
    total = sum(sizes)
    block = _buffer("arena", total, dtype) if total * dtype.itemsize <= _ARENA_BYTES else np.empty(total, dtype)
    views, at = [], 0
    for shape, size in zip(shapes, sizes):
        views.append(block[at:at + size].reshape(shape))
        at += size
    return views


def _tile(name: str, rows: int, cols: int, dtype: np.dtype) -> np.ndarray:
    """A C-contiguous (rows, cols) view of a scratch buffer (BLAS writes it directly)."""
    return _buffer(name, rows * cols, dtype)[: rows * cols].reshape(rows, cols)


_SERIAL_BELOW = 1 << 21  # score elements per thread (~10 ms of tiles): below, a second thread costs more than it saves


def _useful_threads(num_threads: int, work: int) -> int:
    """The threads a call of `work` score elements can use: one per _SERIAL_BELOW
    elements, at most num_threads, at least 1. Plans are made for this count, not
    for num_threads: work that runs on one thread anyway keeps one thread's tiles
    and heads per task (cut for threads it would never use, a decode step over a
    4096-key cache ran 1.5x slower at num_threads=2 than at 1)."""
    return max(1, min(num_threads, work // _SERIAL_BELOW))


def _run(tasks: list, fn: Callable, threads: int) -> list:
    """fn(task) for every task, on a pool of `threads` (the count `_useful_threads`
    gives the call's work, so too little work to split stays on the calling
    thread: threads never make a call slower than one thread would)."""
    with one_blas_thread():  # our threads do the spreading
        if threads == 1 or len(tasks) <= 1:
            return [fn(t) for t in tasks]
        return list(_pool(threads).map(fn, tasks))


# ----------------------------------------------------------------------------- tile sizes


@lru_cache(maxsize=1)
def l2_cache_bytes() -> int:
    """The per-core L2 (or, lacking one, the largest data) cache the OS reports
    for CPU 0: Linux sysfs, then sysconf; 1 MiB when neither says."""
    sizes = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            path = os.path.join(base, entry)
            try:
                with open(os.path.join(path, "level")) as f:
                    level = int(f.read())
                with open(os.path.join(path, "type")) as f:
                    kind = f.read().strip()
                with open(os.path.join(path, "size")) as f:
                    text = f.read().strip().upper()
            except (OSError, ValueError):
                continue
            if kind == "Instruction":
                continue
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            digits = text.rstrip("KMGB")
            if digits.isdigit():
                sizes[level] = int(digits) * unit
    except OSError:
        pass
    if 2 not in sizes:
        try:
            size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
            if size > 0:
                sizes[2] = size
        except (AttributeError, ValueError, OSError):
            pass
    return sizes.get(2) or (max(sizes.values()) if sizes else 1 << 20)


def choose_blocks(L: int, S: int, itemsize: int, banded: bool) -> tuple[int, int]:
    """Tile sizes (block_q, block_k) for L queries over S keys: key blocks of
    MAX_BLOCK and as many query rows (up to MAX_BLOCK) as make a tile of twice
    the L2 cache the OS reports (512 x 512 float32 scores from a 512 KiB L2).

    Key blocks are never 256 wide: that is the inner side of the P [V, 1] and
    dS K products, and on a first-generation Zen EPYC (OpenBLAS's Haswell
    kernel) single-thread sgemm with an inner side of 256 ran at 9-11 GFLOP/s
    against 33-35 for 384 or 512, so 512 x 256 tiles made the forward 1.6-1.7x
    and the backward 2.0-2.3x slower than 512 x 512 (L = 1024 ... 4096, fresh
    processes). A tile of twice the L2 beat one the L2 holds (256 x 512) by
    about 5% there: each pass streams it once and the products reuse it by rows.

    Tiles a band's edge crosses (a causal diagonal, a window's edges) are cut
    into pieces of PIECE_ROWS rows (`FlashPlan.pieces`), each as wide as its
    rows see, so a causal self-attention keeps the full tiles (query blocks of
    L / 4 along its diagonal made its L = 1024 forward ~10% slower). A
    chunk of rows over a longer cache (`banded`, no left edge, 2L < S) cuts
    its query blocks to L / 8 (at least 64): a tile the band crosses costs its
    full width, (n + 1) / 2n of the full matrix for n query blocks. The forward
    puts several heads side by side in each call when the tiles are small
    (`_heads_per_task`)."""
    budget = max(1, 2 * l2_cache_bytes() // itemsize)  # scores per tile
    block_k = max(1, min(S, MAX_BLOCK))
    block_q = max(32, min(MAX_BLOCK, budget // block_k // 32 * 32))
    if banded and 2 * L < S:  # a chunk of rows over a long cache
        block_q = min(block_q, max(64, -(-L // 8)))
    return max(1, min(block_q, L)), block_k


# ----------------------------------------------------------------------------- the plan


def _check_block(value, name: str) -> int | None:
    return None if value is None else check_integer(value, name, minimum=1)


@dataclass(frozen=True)
class FlashOptions:
    """The arguments of one `flash_attention` call beside query, key and value,
    as the caller gave them (see `flash_attention` for each)."""

    attn_mask: np.ndarray | None = None
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    causal_align: str = "top_left"
    window: int | tuple[int | None, int | None] | None = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    block_q: int | None = None
    block_k: int | None = None
    num_threads: int | None = None


class _Columns(NamedTuple):
    """values (rows, stop - start) to add to columns [start, stop) of a tile: a
    causal diagonal tile trimmed to its triangle's width has -inf only in its
    last `rows` columns, and adding zeros to the rest would cost a pass."""

    start: int
    stop: int
    values: np.ndarray

    def full(self, cols: int) -> np.ndarray:
        """(rows, cols) booleans of the whole tile, True where the bias is -inf."""
        out = np.zeros((self.values.shape[0], cols), dtype=bool)
        out[:, self.start:self.stop] = np.isneginf(self.values)
        return out


@dataclass
class FlashPlan:
    """Everything a tile needs, fixed once per forward call and reused by its
    backward. `band` is on kv - q: a key kv is allowed for query q only if
    band.lo <= kv - q <= band.hi."""

    shapes: AttentionShapes
    enable_gqa: bool
    scale: float
    band: Band
    mask: np.ndarray | None  # broadcast view (*batch, Hq, L, S) or None
    mask_mod: Callable | None  # evaluated per tile (a band-only mod is folded into band)
    score_mod: Callable | None
    block_q: int
    block_k: int
    num_threads: int
    piece_q: int  # rows per piece where a band's edge crosses a tile (see pieces)
    # Keys and values carry a ones column ([K, 1], [V, 1]: BLAS subtracts the row's
    # shift and sums its weights inside the two products) when each kv head meets
    # at least ONES_MIN_ROWS query rows (L x group). With fewer (a decode step) the
    # copy of the whole cache with the column cost more than the passes it saves
    # (1 query over 32768 keys: 2.5x naive attention's time): the shift and the row
    # sums are then separate passes over the few scores, in the forward and in the
    # backward's rebuild alike (`_tile_scores`), so both still form the same bits.
    key_ones: bool = True
    _band_cache: dict = field(default_factory=dict, repr=False)

    @property
    def lo(self) -> int | None:
        return self.band.lo

    @property
    def hi(self) -> int | None:
        return self.band.hi

    def kv_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys any query in [q0, q1) may see: the band's reach, clipped to [0, S)."""
        return self.band.kv_range(q0, q1, self.shapes.S)

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
        return self.band.tile_cols(q0, q1, k0, k1)

    def pieces(self, q0: int, q1: int, k0: int, k1: int) -> tuple[tuple[int, int, int, int], ...]:
        """How grid tile (q0:q1, k0:k1) is computed: as (q0, q1, c0, c1) pieces,
        each a run of rows with the columns the band lets them see. A tile the
        band's edge does not cross is one piece (tile_cols); one it crosses (a
        causal diagonal, a window's edges) is cut into runs of piece_q rows, each
        cut to its own columns, and neighbouring runs that see the same columns
        are joined again. A diagonal tile then costs about (1 + piece_q /
        block_q) / 2 of its square, while the tiles below the diagonal stay whole
        (their products run faster than small ones). A function of the tile
        alone, so forward and backward cut alike; empty when no row sees a key."""
        key = ("pieces", q0, q1, k0, k1)
        found = self._band_cache.get(key)
        if found is None:
            runs: list[tuple[int, int, int, int]] = []
            step = self.piece_q if self.band.bounded else q1 - q0
            for r0 in range(q0, q1, step):
                r1 = min(r0 + step, q1)
                c0, c1 = self.tile_cols(r0, r1, k0, k1)
                if c1 <= c0:
                    continue
                if runs and runs[-1][1] == r0 and runs[-1][2:] == (c0, c1):
                    runs[-1] = (runs[-1][0], r1, c0, c1)
                else:
                    runs.append((r0, r1, c0, c1))
            found = self._band_cache[key] = tuple(runs)
        return found

    def grid_q_range(self, k0: int, k1: int) -> tuple[int, int]:
        """q_range widened to whole tiles of the block_q grid."""
        start, end = self.q_range(k0, k1)
        if end <= start:
            return start, start
        bq = self.block_q
        return start // bq * bq, min(self.shapes.L, -(-end // bq) * bq)

    def q_range(self, k0: int, k1: int) -> tuple[int, int]:
        """Queries that may see any key in [k0, k1)."""
        return self.band.q_range(k0, k1, self.shapes.L)

    def one_key_rows(self, q0: int, q1: int) -> slice | np.ndarray | None:
        """The rows of [q0, q1), as offsets (a slice when contiguous, as they are for
        every band), that the band lets see at most one key: row 0 of a causal mask,
        every row of a (0, 0) window, all rows when S = 1. None when there are none."""
        if self.shapes.S > 1 and not self.band.bounded:
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

    def band_bias(self, q0: int, q1: int, k0: int, k1: int, dtype) -> tuple[_Columns | None, bool]:
        """(bias, empty): the band's additive (rows, cols) tile, 0 where it allows
        a pair and -inf where it does not, as the span of columns that hold a
        -inf (None when it allows all), and whether it allows none. Adding is
        ~3x faster than np.copyto(where=); the tile depends only on the band
        relative to the tile and its shape, so it is cached across calls (a
        causal mask's diagonal tiles repeat for every head and every call)."""
        local = self.band.shifted(q0, k0)  # on the tile's own positions: j - i
        rows, cols = q1 - q0, k1 - k0
        lo = None if local.lo is None or local.lo <= -(rows - 1) else max(local.lo, -rows)
        hi = None if local.hi is None or local.hi >= cols - 1 else min(local.hi, cols)
        if lo is None and hi is None:
            return None, False
        return _band_tile(lo, hi, rows, cols, np.dtype(dtype).str)

    def tile_masks(self, tile: _Tile, dtype):
        """(skip, blocked, adds) for one tile: skip when no pair is allowed;
        blocked a bool array broadcastable to the tile's (heads, rows, cols),
        True where a boolean mask or mask_mod excludes a pair, or None; adds the
        float arrays to add to the scores (the band's 0/-inf bias, the float
        attn_mask), broadcastable to it too."""
        b, h0, h1, q0, q1, k0, k1 = tile
        bias, empty = self.band_bias(q0, q1, k0, k1, dtype)
        if empty:
            return True, None, ()
        adds = () if bias is None else (bias,)
        blocked = None
        if self.mask is not None:
            part = self.mask[self.batch_index(b) + (slice(h0, h1), slice(q0, q1), slice(k0, k1))]
            if part.dtype == np.bool_:
                if not part.all():
                    blocked = ~part
            else:
                adds = adds + (part,)
        if self.mask_mod is not None:
            q_idx, kv_idx = tile.indices()
            allowed = np.empty((h1 - h0, q1 - q0, k1 - k0), dtype=bool)
            for i, h in enumerate(range(h0, h1)):
                one = np.asarray(self.mask_mod(b, h, q_idx, kv_idx))
                if one.dtype != np.bool_:
                    raise TypeError(f"expected mask_mod to return booleans, got dtype {one.dtype}")
                allowed[i] = one
            if not allowed.all():
                blocked = ~allowed if blocked is None else blocked | ~allowed
        if blocked is not None:
            if bias is not None:
                blocked = blocked | bias.full(k1 - k0)
            if blocked.all():
                return True, None, ()
        return False, blocked, adds

    def modded(self, s: np.ndarray, tile: _Tile) -> np.ndarray:
        """score_mod applied, head by head, to a (heads, rows, cols) tile of
        scaled scores in place (each call sees one (rows, cols) head)."""
        q_idx, kv_idx = tile.indices()
        for i, h in enumerate(range(tile.h0, tile.h1)):
            out = np.asarray(self.score_mod(s[i], tile.b, h, q_idx, kv_idx))
            if out.shape != s[i].shape:
                try:
                    out = np.broadcast_to(out, s[i].shape)
                except ValueError:
                    raise ValueError(
                        f"expected score_mod to return scores of shape {shape_str(s[i].shape)}, "
                        f"got {shape_str(out.shape)}"
                    ) from None
            np.copyto(s[i], out, casting="same_kind")
        return s


@lru_cache(maxsize=512)
def _band_tile(lo: int | None, hi: int | None, rows: int, cols: int, dtype: str) -> tuple[_Columns | None, bool]:
    """(bias, empty) of a (rows, cols) tile whose pair (i, j) is allowed when
    lo <= j - i <= hi: 0 allowed, -inf not, over the columns that hold a -inf
    (read-only: it is shared)."""
    rel = np.arange(cols)[None, :] - np.arange(rows)[:, None]
    blocked = np.zeros((rows, cols), dtype=bool)
    if lo is not None:
        blocked |= rel < lo
    if hi is not None:
        blocked |= rel > hi
    kind = np.dtype(dtype).type
    hit = np.flatnonzero(blocked.any(axis=0))
    if not hit.size:
        return None, False
    start, stop = int(hit[0]), int(hit[-1]) + 1
    bias = np.where(blocked[:, start:stop], kind(-np.inf), kind(0))
    bias.flags.writeable = False
    return _Columns(start, stop, bias), bool(blocked.all())


class _Tile(NamedTuple):
    """One tile of the grid: query rows [q0, q1) of query heads [h0, h1) in
    flattened batch b, against keys [k0, k1)."""

    b: int
    h0: int
    h1: int
    q0: int
    q1: int
    k0: int
    k1: int

    def indices(self) -> tuple[np.ndarray, np.ndarray]:
        """q_idx (rows, 1) and kv_idx (1, cols), as mods take them."""
        return np.arange(self.q0, self.q1)[:, None], np.arange(self.k0, self.k1)[None, :]


def _check_inputs(query, key, value, enable_gqa: bool):
    """check_qkv, with (L, E) inputs given a head axis of 1."""
    query, key, value, shapes = check_qkv(query, key, value, enable_gqa)
    q, k, v = (x[None] if x.ndim == 2 else x for x in (query, key, value))
    if any(x is not y for x, y in zip((q, k, v), (query, key, value))):
        q, k, v, shapes = check_qkv(q, k, v, enable_gqa)
    return q, k, v, shapes


def _make_plan(query, key, value, options: FlashOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray, FlashPlan]:
    """Validate one call: query, key and value as (*batch, H, N, D) views, and its plan."""
    q, k, v, shapes = _check_inputs(query, key, value, options.enable_gqa)
    L, S = shapes.L, shapes.S
    band = Band.from_options(is_causal=options.is_causal, causal_align=options.causal_align,
                             window=options.window, L=L, S=S)
    scale = check_scale(options.scale, shapes.E)
    mask = check_mask(options.attn_mask, shapes, bool(options.is_causal))
    if mask is not None:
        mask = np.broadcast_to(mask, shapes.scores_shape)
    score_mod = check_mod(options.score_mod, "score_mod", 5, "(score, b, h, q_idx, kv_idx)")
    mask_mod = check_mod(options.mask_mod, "mask_mod", 4, "(b, h, q_idx, kv_idx)")
    block_q, block_k = _check_block(options.block_q, "block_q"), _check_block(options.block_k, "block_k")
    num_threads = _check_block(cpu_count() if options.num_threads is None else options.num_threads, "num_threads")

    mask_mod = None if mask_mod is None else bound(mask_mod, L, S)
    score_mod = None if score_mod is None else bound(score_mod, L, S)
    if mask_mod is not None and isinstance(mask_mod, BandedMaskMod) and mask_mod.band is not None:
        mlo, mhi, exact = mask_mod.band  # a ready-made mod that implies lo <= kv - q <= hi
        band = band.intersect(Band(mlo, mhi))
        if exact:
            mask_mod = None
        elif mask_mod.rest is not None:
            mask_mod = mask_mod.rest
    # a causal band (no left edge) also cuts query blocks finer; a window's two
    # edges are followed by the pieces alone (plan.pieces)
    auto_q, auto_k = choose_blocks(L, S, shapes.compute_dtype.itemsize, band.hi is not None and band.lo is None)
    key_ones = L * shapes.group >= ONES_MIN_ROWS
    if not key_ones:
        # A few query rows (a decode step) make a tile of MAX_BLOCK keys too small for
        # its NumPy calls: 1 query, 9 heads over 3 kv heads, S = 32768, one thread,
        # key tiles of 512: 18.2 ms, 2048: 12.5, 8192: 11.0, 32768: 14.6.
        auto_k = min(S, max(auto_k, FEW_ROWS_KEYS))
    heads = math.prod(shapes.batch) * shapes.q_heads
    threads = _useful_threads(num_threads, heads * L * S)  # the forward's work (see _flash_forward)
    while threads > 1 and auto_q > PIECE_ROWS and heads * -(-L // auto_q) < 2 * threads:
        auto_q = max(PIECE_ROWS, auto_q // 2)  # two forward tasks per thread, where blocks can shrink
    plan = FlashPlan(
        shapes=shapes, enable_gqa=bool(options.enable_gqa), scale=scale, band=band, mask=mask,
        mask_mod=mask_mod, score_mod=score_mod,
        block_q=min(block_q or auto_q, max(L, 1)), block_k=min(block_k or auto_k, max(S, 1)),
        num_threads=num_threads, piece_q=PIECE_ROWS, key_ones=key_ones,
    )
    return q, k, v, plan


def _flat(x: np.ndarray, shapes: AttentionShapes, heads: int, dtype) -> np.ndarray:
    """(..., H, N, D) -> C-contiguous (B, H, N, D) in the compute dtype, B = prod(batch)."""
    B = math.prod(shapes.batch)
    return np.ascontiguousarray(x, dtype=dtype).reshape(B, heads, x.shape[-2], x.shape[-1])


def _with_ones(x: np.ndarray, n: int = 1, out: np.ndarray | None = None) -> np.ndarray:
    """(B, H, N, D) -> (B, H, N, D + n) with n last columns of ones (into out if given)."""
    D = x.shape[-1]
    out = np.empty((*x.shape[:-1], D + n), dtype=x.dtype) if out is None else out
    out[..., :D] = x
    out[..., D:] = 1
    return out


def _weights_times_values(p: np.ndarray, v: np.ndarray, out: np.ndarray) -> None:
    """out <- [p v, p 1] (heads, rows, Ev + 1): with values carrying a ones column
    one product gives both; without it (few rows, FlashPlan.key_ones) the row
    sums are a separate reduction."""
    Ev = out.shape[-1] - 1
    if v.shape[-1] > Ev:
        np.matmul(p, v, out=out)  # the row sums come out of BLAS
    else:
        out[..., :Ev] = np.matmul(p, v)
        np.add.reduce(p, axis=-1, out=out[..., Ev])


# ----------------------------------------------------------------------------- forward


def _tile_scores(plan: FlashPlan, q_rows, k, s, tile: _Tile, adds) -> None:
    """s <- score_mod(q_rows k[:, k0:k1]^T) + adds, in place, q_rows (heads, rows,
    E + 1), k (heads, S, E + 1), s (heads, rows, cols), one BLAS product per head
    (NumPy's batched matmul): the one way both the forward and the backward
    compute a tile's scores. q_rows is [q * scale, -shift] and k is [k, 1], so
    the product is the scores less each row's shift, subtracted inside BLAS.
    Tiles sit on the same (block_q, block_k) grid in both and BLAS runs
    single-threaded, so the backward rebuilds bitwise the numbers whose sum the
    forward saved: a near-one-hot row then gets exp(s - lse) = 1 to rounding, as
    the plain path's normalized softmax does. Without the ones column (k
    (heads, S, E), `FlashPlan.key_ones`) the shift is subtracted after the
    product, in both passes alike."""
    E = k.shape[-1]
    if q_rows.shape[-1] == E:  # [q * scale, -c] . [k, 1]
        np.matmul(q_rows, k[:, tile.k0:tile.k1].swapaxes(-1, -2), out=s)  # (heads, rows, cols)
    else:
        np.matmul(q_rows[..., :E], k[:, tile.k0:tile.k1].swapaxes(-1, -2), out=s)
        s += q_rows[..., E:]  # - c, per row
    if plan.score_mod is not None:
        plan.modded(s, tile)
    for add in adds:
        if isinstance(add, _Columns):
            s[..., add.start:add.stop] += add.values
        else:
            s += add


class _ForwardInputs(NamedTuple):
    """What every forward task reads: compute-dtype arrays with the batch dims flattened."""

    q: np.ndarray  # (B, Hq, L, E)
    ka: np.ndarray  # (B, Hkv, S, E+1) keys with a ones column; (B, Hkv, S, E) without (FlashPlan.key_ones)
    va: np.ndarray  # (B, Hkv, S, Ev+1) values with a ones column; (B, Hkv, S, Ev) without


class _Rows(NamedTuple):
    """A forward task: query rows [q0, q1) of heads [h0, h1) in flattened batch b
    over keys [k_start, k_end) (on the block_k grid, or at S), written to out
    (heads, rows, Ev), lse (heads, rows), shift and rel = lse - shift (heads,
    rows); shift None keeps the task on the running-max path (a split row's
    parts are merged, and the backward rebuilds them with shift 0)."""

    b: int
    h0: int
    h1: int
    q0: int
    q1: int
    k_start: int
    k_end: int
    out: np.ndarray
    lse: np.ndarray
    shift: np.ndarray | None
    rel: np.ndarray | None


_SAMPLE_KEYS = 16  # keys whose scores give a row's shift on the fast path


def _forward_rows(plan: FlashPlan, inputs: _ForwardInputs, rows: _Rows) -> None:
    """One forward task (see _Rows): softmax over its key tiles, the heads side
    by side in every call (one NumPy call per tile, not per head).

    Fast path: each row's shift c is fixed before the first tile, the largest
    score over a few keys that every row of the task may see. BLAS subtracts it
    inside the score product ([q * scale, -c] . [k, 1]), so a tile costs its two
    products and one exp, with no running max to rescale by: c is a real score
    of the row, so the true maximum term is exp(max - c) >= 1 and nothing that
    matters underflows. If some score lies so far above c that a sum overflows,
    the task runs again on the running-max path (online softmax, shift 0)."""
    b, h0, h1, q0, q1 = rows.b, rows.h0, rows.h1, rows.q0, rows.q1
    g = plan.shapes.group
    # (heads, S, ·); with GQA a task's heads share one kv head, (1, S, ·), which matmul broadcasts
    kv = slice(h0, h1) if g == 1 else slice(h0 // g, h0 // g + 1)
    ka, va = inputs.ka[b, kv], inputs.va[b, kv]
    cd = ka.dtype
    E, Ev = inputs.q.shape[-1], rows.out.shape[-1]
    nh, r = h1 - h0, q1 - q0
    qa = _buffer("qa", nh * r * (E + 1), cd)[: nh * r * (E + 1)].reshape(nh, r, E + 1)  # [q * scale, -c]
    np.multiply(inputs.q[b, h0:h1, q0:q1], cd.type(plan.scale), out=qa[..., :E])
    acc = np.zeros((nh, r, Ev + 1), dtype=cd)  # [sum p v, sum p]
    part = _buffer("part", nh * r * (Ev + 1), cd)[: nh * r * (Ev + 1)].reshape(nh, r, Ev + 1)
    sample = None if rows.shift is None else _sample_keys(plan, q0, q1, rows.k_start, rows.k_end)
    if sample is not None:
        c = np.max(np.matmul(qa[..., :E], ka[:, sample, :E].swapaxes(-1, -2)), axis=2)
        qa[..., E] = -c
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is detected below (per thread)
            for tile, s, at in _score_tiles(plan, inputs, rows, qa, ka):
                np.exp(s, out=s)
                _weights_times_values(s, va[:, tile.k0:tile.k1], part[:, at])  # [P V, P 1]
                acc[:, at] += part[:, at]
        total = acc[..., Ev]
        # c is a score the row sees, so its sum is >= 1 up to rounding. Far below
        # (scores near 1e19 in float64, 1e8 in float32) the sample's product
        # rounded c above the tiles' fused s - c, every weight is small and p v
        # can underflow: the running max (top weight exactly 1) takes the task.
        if np.isfinite(acc).all() and (total >= 0.5).all():
            np.divide(acc[..., :Ev], total[..., None], out=rows.out)
            rows.rel[...] = np.log(total.astype(np.float64))
            rows.lse[...] = c.astype(np.float64) + rows.rel
            rows.shift[...] = c
            return
        acc[...] = 0
    qa[..., E] = 0
    m = np.full((nh, r), -np.inf, dtype=cd)  # running max per row
    new_m = _tile("new_m", nh, r, cd)
    alpha = _tile("alpha", nh, r, cd)
    for tile, s, at in _score_tiles(plan, inputs, rows, qa, ka):
        m_at, new_at, alpha_at, part_at = m[:, at], new_m[:, at], alpha[:, at], part[:, at]
        np.max(s, axis=2, out=new_at)
        np.maximum(m_at, new_at, out=new_at)
        shift = new_at
        if np.isneginf(new_at).any():
            shift = np.where(np.isneginf(new_at), cd.type(0), new_at)  # an all -inf row stays at 0
        np.subtract(m_at, shift, out=alpha_at)
        np.exp(alpha_at, out=alpha_at)  # rescales what was accumulated against the old max
        # Shifting by the true max keeps s - max exact near the max, so that the
        # backward's exp(s - lse) reproduces these weights to rounding.
        s -= shift[..., None]
        np.exp(s, out=s)
        _weights_times_values(s, va[:, tile.k0:tile.k1], part_at)
        acc[:, at] *= alpha_at[..., None]
        acc[:, at] += part_at
        m_at[...] = new_at
    total = acc[..., Ev]
    empty = total == 0  # no key allowed: output 0, lse -inf
    np.divide(acc[..., :Ev], np.where(empty, cd.type(1), total)[..., None], out=rows.out)
    with np.errstate(divide="ignore", invalid="ignore"):  # lse in float64: see AttentionState
        rows.lse[...] = np.where(empty, -np.inf, m.astype(np.float64) + np.log(total.astype(np.float64)))
    if rows.shift is not None:
        rows.shift[...] = 0
        rows.rel[...] = rows.lse


def _sample_keys(plan: FlashPlan, q0: int, q1: int, k_start: int, k_end: int) -> slice | None:
    """Up to _SAMPLE_KEYS keys of [k_start, k_end) that every query of [q0, q1)
    may see, or None: only a band may exclude keys (no mask, mask_mod or
    score_mod, whose scores the sample could not stand for)."""
    if plan.mask is not None or plan.mask_mod is not None or plan.score_mod is not None:
        return None
    start, end = plan.band.shared_kv_range(q0, q1, k_start, k_end)
    end = min(end, start + _SAMPLE_KEYS)
    return slice(start, end) if end > start else None


def _score_tiles(plan: FlashPlan, inputs: _ForwardInputs, rows: _Rows, qa, ka):
    """(tile, s, part) for each piece (plan.pieces) of each key tile of a
    forward task that has an allowed pair: s (heads, rows, cols) its scores
    less the shift in qa, masked (-inf where not allowed), in a scratch buffer
    reused by the next piece; part the piece's rows as offsets in the task."""
    b, h0, h1, q0 = rows.b, rows.h0, rows.h1, rows.q0
    cd = ka.dtype
    nh = h1 - h0
    for k_tile in range(rows.k_start, rows.k_end, plan.block_k):
        for r0, r1, k0, k1 in plan.pieces(q0, rows.q1, k_tile, min(k_tile + plan.block_k, rows.k_end)):
            tile = _Tile(b, h0, h1, r0, r1, k0, k1)
            skip, blocked, adds = plan.tile_masks(tile, cd)
            if skip:
                continue
            r, n = r1 - r0, k1 - k0
            part = slice(r0 - q0, r1 - q0)
            s = _buffer("s", nh * r * n, cd)[: nh * r * n].reshape(nh, r, n)
            _tile_scores(plan, qa[:, part], ka, s, tile, adds)
            if blocked is not None:
                np.copyto(s, cd.type(-np.inf), where=blocked)
            yield tile, s, part


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
        block_q, block_k: tile sizes; default from the L2 cache size and the
            band (`choose_blocks`). The returned state carries them to the backward.
        return_lse: also return the logsumexp of each score row, in the state
            the backward takes.
        num_threads: worker threads (default: the CPUs this process may use).

    Returns:
        The output (..., Hq, L, Ev) in query's dtype, or with return_lse
        AttentionState(output, lse, plan, shift, shifted_lse) with lse
        (..., Hq, L) in float64, and the plan and per-row shifts that
        `flash_attention_backward` needs.
        A query row with no key allowed gets output 0 and lse -inf.
    """
    options = FlashOptions(attn_mask, is_causal, scale, enable_gqa, causal_align, window, score_mod, mask_mod,
                           block_q, block_k, num_threads)
    drop = max(3 - output_ndim(query, key, value), 0)  # (L, E) inputs run with a head axis of 1
    q, k, v, plan = _make_plan(query, key, value, options)
    shapes = plan.shapes
    out_shape = (*shapes.batch, shapes.q_heads, shapes.L, shapes.Ev)
    if shapes.nothing_to_do:  # an empty result, or no key at all: zeros, as torch gives
        out = np.zeros(out_shape, dtype=shapes.dtype)
        lse = np.full(out_shape[:-1], -np.inf, dtype=np.float64)
        shift, rel = np.zeros(out_shape[:-1], dtype=np.float64), lse
    else:
        dtype = start_dtype(shapes.compute_dtype, plan.scale)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is redone below
            out, lse, shift, rel = _flash_forward(plan, q, k, v, dtype)
        if needs_float64(q, k, plan.scale, dtype, lse, value=v, output=out):
            # scores (or a running sum of values) beyond float32: torch's float64 answer
            out, lse, shift, rel = _flash_forward(plan, q, k, v, np.dtype(np.float64))
        out = out.reshape(out_shape).astype(shapes.dtype, copy=False)
        lse, shift, rel = (x.reshape(out_shape[:-1]) for x in (lse, shift, rel))
    if drop:
        out, lse, shift, rel = out[0], lse[0], shift[0], rel[0]
    return AttentionState(out, lse, plan, shift, rel) if return_lse else out


def _heads_per_task(plan: FlashPlan, n_blocks: int, B: int, itemsize: int, threads: int) -> int:
    """How many heads a forward task takes side by side: as many (block_q,
    block_k) score tiles as fit the L2 cache together (each call then works on
    all of them, so small tiles along a causal diagonal cost fewer calls), but
    never so many that the threads run out of tasks."""
    Hq = plan.shapes.q_heads
    tile = plan.block_q * plan.block_k * itemsize
    heads = max(1, min(Hq, l2_cache_bytes() // max(tile, 1)))
    while threads > 1 and heads > 1 and B * n_blocks * -(-Hq // heads) < 2 * threads:
        heads = -(-heads // 2)
    g = plan.shapes.group
    if g > 1:  # GQA: a task's heads share one kv head (no copy of K and V per query head)
        heads = min(heads, g)
        while g % heads:
            heads -= 1
    return heads


def _flash_forward(plan: FlashPlan, q, k, v, cd: np.dtype) -> tuple[np.ndarray, ...]:
    """The tiled forward in dtype `cd`: output (B, Hq, L, Ev) in cd, lse, shift
    and lse - shift (B, Hq, L) in float64, B the flattened batch dims."""
    shapes = plan.shapes
    B, Hq, L, S = math.prod(shapes.batch), shapes.q_heads, shapes.L, shapes.S
    Hkv = shapes.kv_heads
    k, v = _flat(k, shapes, Hkv, cd), _flat(v, shapes, Hkv, cd)  # (B, Hkv, S, E), (B, Hkv, S, Ev)
    if plan.key_ones:  # with a ones column each (few query rows take them as they are: FlashPlan.key_ones)
        ka, va = _arena([(B, Hkv, S, shapes.E + 1), (B, Hkv, S, shapes.Ev + 1)], cd)
        k, v = _with_ones(k, out=ka), _with_ones(v, out=va)
    inputs = _ForwardInputs(_flat(q, shapes, Hq, cd), k, v)
    out = np.zeros((B, Hq, L, shapes.Ev), dtype=cd)
    lse = np.full((B, Hq, L), -np.inf, dtype=np.float64)
    shift = np.zeros((B, Hq, L), dtype=cd)
    rel = np.full((B, Hq, L), -np.inf, dtype=np.float64)

    # Tasks: (b, heads, query block), the longest first so the pool ends evenly.
    # When there are fewer query blocks than threads (decoding), split the keys
    # too and merge the partial states.
    blocks = []
    for q0 in range(0, L, plan.block_q):
        q1 = min(q0 + plan.block_q, L)
        k_start, k_end = plan.grid_kv_range(q0, q1)
        if k_end > k_start:
            blocks.append((q0, q1, k_start, k_end))
    blocks.sort(key=lambda t: t[3] - t[2] if plan.band.bounded else t[1] - t[0], reverse=True)
    threads = _useful_threads(plan.num_threads, B * Hq * L * S)
    splits = 1
    if B * Hq * len(blocks) < threads and len(blocks) >= 1:
        widest = max(t[3] - t[2] for t in blocks)
        splits = max(1, min(threads, widest // plan.block_k))

    def task(rows: _Rows) -> None:
        _forward_rows(plan, inputs, rows)

    if splits == 1:
        nh = _heads_per_task(plan, len(blocks), B, cd.itemsize, threads)
        tasks = [_Rows(b, h, min(h + nh, Hq), q0, q1, k_start, k_end,
                       out[b, h:h + nh, q0:q1], lse[b, h:h + nh, q0:q1], shift[b, h:h + nh, q0:q1],
                       rel[b, h:h + nh, q0:q1])
                 for q0, q1, k_start, k_end in blocks for b in range(B) for h in range(0, Hq, nh)]
        _run(tasks, task, threads)
        return out, lse, shift.astype(np.float64), rel

    tasks, parts = [], []
    for q0, q1, k_start, k_end in blocks:
        # split edges on the block_k grid, so the tiles are the backward's
        edges = np.linspace(k_start, k_end, splits + 1).astype(int) // plan.block_k * plan.block_k
        edges[0], edges[-1] = k_start, k_end
        for b in range(B):
            for h in range(Hq):
                o_parts = np.zeros((splits, 1, q1 - q0, shapes.Ev), dtype=cd)
                l_parts = np.full((splits, 1, q1 - q0), -np.inf, dtype=np.float64)
                parts.append((b, h, q0, q1, o_parts, l_parts))
                for i in range(splits):
                    if edges[i + 1] > edges[i]:
                        tasks.append(_Rows(b, h, h + 1, q0, q1, int(edges[i]), int(edges[i + 1]),
                                           o_parts[i], l_parts[i], None, None))
    _run(tasks, task, threads)
    for b, h, q0, q1, o_parts, l_parts in parts:
        merged = merge_attention_states(o_parts[:, 0], l_parts[:, 0])
        out[b, h, q0:q1], lse[b, h, q0:q1] = merged.output, merged.lse
    return out, lse, shift.astype(np.float64), lse.copy()  # shift 0: rel is lse


# ----------------------------------------------------------------------------- backward


class _BackwardInputs(NamedTuple):
    """What every backward task reads: compute-dtype arrays with the batch dims flattened."""

    qs: np.ndarray  # (B, Hq, L, E) query * scale
    qa: np.ndarray  # (B, Hq, L, E+1) [query * scale, -shift]: the forward's scores, less its shift
    qs_f: np.ndarray  # (B, Hq, L, E) query * scale * f: dK = dS^T (q * scale)
    k: np.ndarray  # (B, Hkv, S, E)
    ka: np.ndarray  # (B, Hkv, S, E+1) keys with a ones column, as the forward's (or k: FlashPlan.key_ones)
    ks: np.ndarray  # (B, Hkv, S, E) key * scale: dQ = dS (K * scale), the scale before the product
    va: np.ndarray  # (B, Hkv, S, Ev+1) values with a ones column
    do_a: np.ndarray  # (B, Hq, L, Ev+1) [dO, -D]
    do_f: np.ndarray  # (B, Hq, L, Ev) dO * f
    lse_hi: np.ndarray  # (B, Hq, L) lse - shift = lse_hi + lse_lo, lse_hi in the compute dtype
    row_f: np.ndarray  # (B, Hq, L) f = exp(-lse_lo), within a few ulps of 1 (-inf rows: 1)


class _Cols(NamedTuple):
    """A backward task: keys [k0, k1) of kv head h_kv in flattened batch b."""

    b: int
    h_kv: int
    k0: int
    k1: int


def _backward_cols(plan: FlashPlan, inputs: _BackwardInputs, cols: _Cols, dq_acc, dk_out, dv_out) -> None:
    """One backward task (see _Cols): accumulate its dK, dV over every query head
    of the group and every query tile that can see the keys, into dk_out
    (k1 - k0, E) and dv_out (k1 - k0, Ev), and add the dQ contributions into this
    thread's dq_acc (B, Hq, L, E)."""
    b, h_kv, k0, k1 = cols
    do_a, lse_hi, row_f = inputs.do_a, inputs.lse_hi, inputs.row_f
    k, ks, va = inputs.k[b, h_kv], inputs.ks[b, h_kv], inputs.va[b, h_kv]  # (S, E), (S, E), (S, Ev+1)
    k3 = inputs.ka[b, h_kv:h_kv + 1]  # (1, S, E+1) or (1, S, E): _tile_scores takes heads
    cd = k.dtype
    E, Ev = k.shape[-1], do_a.shape[-1] - 1
    g, bq = plan.shapes.group, plan.block_q
    dk = np.zeros((k1 - k0, E), dtype=cd)
    dv = np.zeros((k1 - k0, Ev), dtype=cd)
    q_start, q_end = plan.grid_q_range(k0, k1)
    pieces = [piece for qb in range(q_start, q_end, bq)  # the forward's tiles: same grid, same cut
              for piece in plan.pieces(qb, min(qb + bq, q_end), k0, k1)]
    for h in range(h_kv * g, (h_kv + 1) * g):
        for q0, q1, c0, c1 in pieces:
            r, n = q1 - q0, c1 - c0
            tile = _Tile(b, h, h + 1, q0, q1, c0, c1)
            skip, blocked, adds = plan.tile_masks(tile, cd)
            if skip:
                continue
            rows, cols_k, mine = slice(q0, q1), slice(c0, c1), slice(c0 - k0, c1 - k0)
            f = row_f[b, h, rows, None]  # (r, 1)
            p3 = _buffer("p", r * n, cd)[: r * n].reshape(1, r, n)  # one head of the forward's tile
            _tile_scores(plan, inputs.qa[b, h:h + 1, rows], k3, p3, tile, adds)
            if blocked is not None:
                np.copyto(p3, cd.type(-np.inf), where=blocked)
            p = p3[0]
            mod_grad = None
            if plan.score_mod is not None and plan.score_mod.grad is not None:  # None: additive
                pre = np.matmul(inputs.qs[b, h, rows], k[cols_k].T)  # the scores the mod saw
                mod_grad = plan.score_mod.grad(pre, b, h, *tile.indices())
            # forward: P = exp(s - lse); p holds s - shift, and lse - shift = hi + lo:
            # P = exp(p - hi) * f, f = exp(-lo) per row
            p -= lse_hi[b, h, rows, None]
            np.exp(p, out=p)
            # forward: out = P @ V   ->  dV += P^T dO,  dP = dO V^T
            dv_part = _tile("dv_part", n, Ev, cd)
            np.matmul(p.T, inputs.do_f[b, h, rows], out=dv_part)
            dv[mine] += dv_part
            ds = _tile("ds", r, n, cd)
            np.matmul(do_a[b, h, rows], va[cols_k].T, out=ds)  # dP - D via the [dO, -D] . [V, 1] column
            # forward: P = softmax(s)  ->  dS = P * (dP - D)   (times f, applied to the rows below)
            np.multiply(ds, p, out=ds)
            one = plan.one_key_rows(q0, q1)
            if one is not None:
                # A softmax over a single key is constant: its dS is exactly 0, as the
                # plain path's is. FlashAttention-2's D would leave the rounding of dO . v,
                # and the rebuilt weight of that key is 1 only to rounding.
                ds[one] = 0
            if mod_grad is not None:
                # forward: s = score_mod(q k^T * scale)  ->  chain rule through the mod
                ds *= mod_grad
            # forward: s = (q * scale) k^T  ->  dQ += dS (K * scale), dK += dS^T (q * scale)
            dk_part = _tile("dk_part", n, E, cd)
            np.matmul(ds.T, inputs.qs_f[b, h, rows], out=dk_part)
            dk[mine] += dk_part
            dq_part = _tile("dq_part", r, E, cd)
            np.matmul(ds, ks[cols_k], out=dq_part)
            dq_part *= f
            dq_acc[b, h, rows] += dq_part
    dk_out[...] = dk
    dv_out[...] = dv


def flash_attention_backward(
    grad_output: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    output: np.ndarray,
    state: AttentionState,
    *,
    num_threads: int | None = None,
) -> AttentionGrads:
    """Gradients of `flash_attention`, FlashAttention-2 style, tile by tile.

    Takes the forward's inputs, its `output`, the `state` that
    `flash_attention(..., return_lse=True)` returned (its lse and its plan: the
    mask, band, mods, scale and tile grid of the forward, which the backward
    reuses, so the two always cut the same tiles) and grad_output = dLoss/dO of
    shape (..., Hq, L, Ev). A state computed for other shapes is refused. With
    D = rowsum(dO * O) each tile's weights are recomputed as P = exp(s - lse) and

        dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D),
        dQ += dS K * scale,   dK += dS^T Q * scale.

    Work is spread over (batch, kv head, key block) on num_threads threads
    (default: the forward's); each thread adds its dQ contributions into its own
    (B, Hq, L, E) buffer, summed at the end: extra memory O(threads * L + S),
    never (L, S).

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
    if not isinstance(state, AttentionState) or state.plan is None:
        got = "a merged state without a plan" if isinstance(state, AttentionState) else type(state).__name__
        raise TypeError(
            "expected state to be the AttentionState that flash_attention(..., return_lse=True) returned "
            f"(it carries the forward's tile plan), got {got}"
        )
    plan = state.plan
    if num_threads is not None:
        plan = replace(plan, num_threads=_check_block(num_threads, "num_threads"))
    drop = max(3 - output_ndim(query, key, value), 0)  # (L, E) inputs run with a head axis of 1
    q, k, v, shapes = _check_inputs(query, key, value, plan.enable_gqa)
    if shapes != plan.shapes:
        def problem(s):
            return (f"query {shape_str((*s.batch, s.q_heads, s.L, s.E))}, key {shape_str((*s.batch, s.kv_heads, s.S, s.E))}, "
                    f"value {shape_str((*s.batch, s.kv_heads, s.S, s.Ev))} {s.dtype}")
        raise ValueError(
            f"expected the inputs of the forward that made this state ({problem(plan.shapes)}), "
            f"got {problem(shapes)}"
        )
    cd, Hq, Hkv = shapes.compute_dtype, shapes.q_heads, shapes.kv_heads
    L, S, E, Ev = shapes.L, shapes.S, shapes.E, shapes.Ev
    out_shape = (*shapes.batch, Hq, L, Ev)
    lse_shape = (*shapes.batch, Hq, L)
    if state.shift is None or state.shifted_lse is None:
        shift, rel = np.zeros(lse_shape[drop:]), state.lse
    else:
        shift, rel = state.shift, state.shifted_lse
    for arr, name, want in ((grad_output, "grad_output", out_shape), (output, "output", out_shape),
                            (state.lse, "state.lse", lse_shape), (shift, "state.shift", lse_shape),
                            (rel, "state.shifted_lse", lse_shape)):
        arr = require_float_tensor(arr, name, 1)
        if arr.shape != want[drop:]:
            raise ValueError(f"expected {name} of shape {shape_str(want[drop:])}, got {shape_str(arr.shape)}")

    if plan.score_mod is not None and not isinstance(plan.score_mod, DifferentiableScoreMod):
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
            grads = _flash_backward(plan, q, k, v, grad_output, output, shift, rel, cd)
        if cd != wide and not all_finite(*grads) and all_finite(q, k, v, grad_output, output):
            grads = None  # a gradient beyond the compute dtype on the way
    if grads is None:
        # float64, from the forward on: a tiny scale, or scores or gradients beyond
        # float32 (torch's float64 answer). The weights exp(s - lse) are rebuilt from
        # an lse of the same float64 scores, never from float32 ones.
        out64, _, shift64, rel64 = _flash_forward(plan, q, k, v, wide)
        grads = _flash_backward(plan, q, k, v, grad_output, out64, shift64, rel64, wide)
    grads = (
        grads[0].reshape(*shapes.batch, Hq, L, E),
        grads[1].reshape(*shapes.batch, Hkv, S, E),
        grads[2].reshape(*shapes.batch, Hkv, S, Ev),
    )
    # Inputs that were broadcast (smaller rank, a dim of 1) sum their gradient back.
    grads = (sum_to_shape(grad, np.shape(x)) for grad, x in zip(grads, (query, key, value)))
    return AttentionGrads(*(x.astype(shapes.dtype, copy=False) for x in grads))


def _flash_backward(plan: FlashPlan, q, k, v, grad_output, output, shift, rel, cd: np.dtype):
    """The tiled backward in dtype `cd`: (dQ (B, Hq, L, E), dK (B, Hkv, S, E),
    dV (B, Hkv, S, Ev)) in cd, B the flattened batch dims."""
    shapes = plan.shapes
    B, Hq, Hkv = math.prod(shapes.batch), shapes.q_heads, shapes.kv_heads
    L, S, E, Ev = shapes.L, shapes.S, shapes.E, shapes.Ev
    blocks = []
    for k0 in range(0, S, plan.block_k):
        k1 = min(k0 + plan.block_k, S)
        q_start, q_end = plan.grid_q_range(k0, k1)
        if q_end > q_start:
            blocks.append((k0, k1, q_end - q_start))
    blocks.sort(key=lambda t: t[2], reverse=True)
    tasks = [_Cols(b, h, k0, k1) for k0, k1, _ in blocks for b in range(B) for h in range(Hkv)]
    threads = _useful_threads(plan.num_threads, 3 * B * Hq * L * S)
    n_dq = max(1, min(threads, len(tasks)))  # at most one dQ buffer per thread that runs tasks

    # the temporaries, from one block (see _arena); dQ sums into grad_q itself and n_dq - 1 more buffers
    ones = E + 1 if plan.key_ones else 0  # the forward's keys: with a ones column or as they are
    ks, ka, va, do_a, qa, qs_f, do_f, *dq_more = _arena(
        [(B, Hkv, S, E), (B, Hkv, S, ones), (B, Hkv, S, Ev + 1), (B, Hq, L, Ev + 1), (B, Hq, L, E + 1),
         (B, Hq, L, E), (B, Hq, L, Ev)] + [(B, Hq, L, E)] * (n_dq - 1), cd)
    q = _flat(q, shapes, Hq, cd)  # (B, Hq, L, E)
    k = _flat(k, shapes, Hkv, cd)  # (B, Hkv, S, E)
    np.multiply(k, cd.type(plan.scale), out=ks)  # (B, Hkv, S, E)
    ka = _with_ones(k, out=ka) if plan.key_ones else k
    _with_ones(_flat(v, shapes, Hkv, cd), out=va)  # (B, Hkv, S, Ev+1)
    d_out = np.asarray(grad_output, dtype=cd).reshape(B, Hq, L, Ev)
    o = np.asarray(output, dtype=cd).reshape(B, Hq, L, Ev)
    do_a[..., :Ev] = d_out  # [dO, -D]
    # D = rowsum(dO * O), summed in float64: rounded once, to the compute dtype
    do_a[..., Ev] = -np.einsum("bhle,bhle->bhl", d_out, o, dtype=np.float64)
    # The tiles hold s - shift (the forward's products, bitwise); lse - shift is
    # split into two compute-dtype parts so that the subtraction is
    # float64-accurate (a float32 lse of 40 is off by up to 2e-6):
    # P = exp(s - shift - hi) * f with f = exp(-lo) per row.
    given = np.asarray(shift, dtype=np.float64).reshape(B, Hq, L)
    shift = given.astype(cd).astype(np.float64)  # as qa holds it (a float64 forward's shift, rounded)
    lse64 = np.array(rel, dtype=np.float64).reshape(B, Hq, L)  # lse - shift, as the forward summed it
    lse64 += given - shift  # 0 unless a float64 forward's shift was rounded to cd
    lse64[np.isneginf(lse64)] = 0  # rows with no key: their tiles are all masked anyway
    lse_hi = lse64.astype(cd)
    row_f = np.exp(-(lse64 - lse_hi).astype(cd))
    qs = qa[..., :E]
    np.multiply(q, cd.type(plan.scale), out=qs)  # (B, Hq, L, E) query * scale
    qa[..., E] = -shift
    np.multiply(qs, row_f[..., None], out=qs_f)
    np.multiply(d_out, row_f[..., None], out=do_f)
    inputs = _BackwardInputs(qs, qa, qs_f, k, ka, ks, va, do_a, do_f, lse_hi, row_f)

    grad_q = np.zeros((B, Hq, L, E), dtype=cd)
    grad_k = np.zeros((B, Hkv, S, E), dtype=cd)
    grad_v = np.zeros((B, Hkv, S, Ev), dtype=cd)
    for buf in dq_more:
        buf.fill(0)
    free = [*dq_more, grad_q]  # popped from the end: the first thread sums into grad_q itself
    dq_buffers: dict[int, np.ndarray] = {}
    lock = threading.Lock()

    def task(cols: _Cols) -> None:
        ident = threading.get_ident()
        with lock:
            if ident not in dq_buffers:
                dq_buffers[ident] = free.pop()
            dq_acc = dq_buffers[ident]
        b, h_kv, k0, k1 = cols
        _backward_cols(plan, inputs, cols, dq_acc, grad_k[b, h_kv, k0:k1], grad_v[b, h_kv, k0:k1])

    _run(tasks, task, threads)
    for buf in dq_buffers.values():
        if buf is not grad_q:
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
    causal_align: str = "top_left",
    window: int | tuple[int | None, int | None] | None = None,
    key_padding_mask: np.ndarray | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    rng: np.random.Generator | int | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
) -> np.ndarray | AttentionOutput:
    """`flash_attention` behind the one backend signature (registered as
    ATTENTION_BACKENDS["flash"]; see `attnkit.functional`).

    is_causal with causal_align, and window, become flash's band: tiles outside
    it are never computed (a KV cache's bottom-right causal chunk costs half
    the tiles). key_padding_mask (..., S) becomes a mask mod, evaluated per
    tile, so it combines with the band (an `attn_mask` could not: flash takes
    no attn_mask together with is_causal). score_mod and mask_mod pass through.

    One query row per head (L = 1, a decode step) has no tile to skip and
    scores of O(S) already: it runs the plain kernel (`scaled_dot_product_attention`,
    same arguments), whose one product per head group beats the tile loop.

    The flash backend never forms the weights, so dropout and return_weights
    are refused."""
    if dropout_p:
        raise ValueError(f"the flash backend has no dropout; expected dropout_p=0.0, got {dropout_p}")
    if return_weights:
        raise ValueError("the flash backend never forms the (L, S) weights; use the 'naive' backend for them")
    options = dict(causal_align=causal_align, window=window, score_mod=score_mod, mask_mod=mask_mod)
    if np.shape(query)[-2:-1] == (1,):  # a decode step: the plain kernel (see above)
        return scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa,
            key_padding_mask=key_padding_mask, return_lse=return_lse, **options,
        )
    if key_padding_mask is not None:
        shapes = check_qkv(query, key, value, enable_gqa)[3]
        padding = check_key_padding_mask(key_padding_mask, shapes)  # (*batch, S)
        if not padding.all():
            real = np.ascontiguousarray(padding).reshape(-1, shapes.S)  # (B, S), b = flattened batch index

            def key_padding(b, h, q_idx, kv_idx):
                return real[b, kv_idx]  # (1, cols), True = a real key

            options["mask_mod"] = key_padding if mask_mod is None else and_mods(mask_mod, key_padding)
    res = flash_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse=True, **options)
    if not return_lse:
        return res.output
    return AttentionOutput(output=res.output, weights=None, lse=res.lse.astype(res.output.dtype, copy=False))
