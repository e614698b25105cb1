"""The plan of one flash attention call, shared by its forward and its backward:
the validated problem (`FlashProblem`, recorded so that the backward refuses
a state of another problem), its band, mask and mods, and the tile grid
(`choose_blocks`: tiles sized from the L2 cache, cut into pieces where a
band's edge crosses them). Forward and backward cut the same tiles from it,
so the backward rebuilds bitwise the scores whose lse the forward saved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, NamedTuple

import numpy as np

from attnkit.functional._checks import AttentionShapes, check_mask, check_mod, check_qkv, check_scale, shape_str
from attnkit.functional.band import Band, check_align, check_integer, check_is_causal, check_window
from attnkit.functional.mods import BandedMaskMod, bound
from attnkit.kernels import flash as compiled
from attnkit.runtime import cpu_count, l2_cache_bytes, useful_threads

MAX_BLOCK = 512  # the key tiles' width (see choose_blocks)
MAX_BLOCK_Q = 2 * MAX_BLOCK  # the most query rows a tile takes (see choose_blocks)
PIECE_ROWS = 128  # rows per piece where a band's edge crosses a tile: smaller products run slower than they save
VALUE_ROWS = 32  # rows per P V product within such a piece (see FlashPlan.value_runs)
ONES_MIN_ROWS = 64  # query rows per kv head from which keys and values are copied with a ones column (see FlashPlan)
FEW_ROWS_KEYS = 8192  # key tile width below ONES_MIN_ROWS rows: amortizes each tile's calls (see _make_plan)


def choose_blocks(L: int, S: int, itemsize: int, banded: bool) -> tuple[int, int]:
    """Tile sizes (block_q, block_k) for L queries over S keys: key blocks of
    MAX_BLOCK and as many query rows (up to MAX_BLOCK_Q) as make a tile of twice
    the L2 cache the OS reports (512 x 512 float32 scores from a 512 KiB L2,
    1024 x 512 from 1 MiB). On the AVX-512 EPYC (1 MiB L2 a core) 1024-row
    tiles were as fast as the earlier cap of 512 or faster, forward and
    forward + backward, on one thread and on two, causal too: fewer tasks, each
    sampling its shifts and streaming its keys once for twice the rows.

    Key blocks are never 256 wide: that is the inner side of the P [V, 1] and
    dS K products, and on a first-generation Zen EPYC (OpenBLAS's Haswell
    kernel) single-thread sgemm with an inner side of 256 ran at a fraction of
    the speed of 384 or 512, so 512 x 256 tiles made both passes much slower
    than 512 x 512. A tile of twice the L2 beat one the L2 holds (256 x 512)
    there: each pass streams it once and the products reuse it by rows.

    Tiles a band's edge crosses (a causal diagonal, a window's edges) are cut
    into pieces of PIECE_ROWS rows (`FlashPlan.pieces`), each as wide as its
    rows see, so a causal self-attention keeps the full tiles (query blocks of
    L / 4 along its diagonal made its forward slower). A
    chunk of rows over a longer cache (`banded`, no left edge, 2L < S) cuts
    its query blocks to L / 8 (at least 64): a tile the band crosses costs its
    full width, (n + 1) / 2n of the full matrix for n query blocks. The forward
    puts several heads side by side in each call when the tiles are small
    (`_heads_per_task`), and on the fused tiles when a band's pieces are: a
    causal forward has several pieces a head, most of them 128 rows high, and
    side by side their calls' fixed costs weigh less than head by head (its
    products alone still take most of the time: a 128-row product runs slower
    than a 512-row one, and each piece computes the triangle it cuts off).
    The figures: docs/benchmarks.md, 'Measurements behind design choices'."""
    budget = max(1, 2 * l2_cache_bytes() // itemsize)  # scores per tile
    block_k = max(1, min(S, MAX_BLOCK))
    block_q = max(32, min(MAX_BLOCK_Q, budget // block_k // 32 * 32))
    if banded and 2 * L < S:  # a chunk of rows over a long cache
        block_q = min(block_q, max(64, -(-L // 8)))
    return max(1, min(block_q, L)), block_k


def _check_block(value, name: str) -> int | None:
    return None if value is None else check_integer(value, name, minimum=1)


@dataclass(frozen=True, eq=False)
class FlashProblem:
    """The problem one `flash_attention` call solved, as its caller stated it:
    recorded in the plan (and so in the state) so that `flash_attention_backward`
    refuses a state of another problem instead of differentiating it.

    shapes holds the inputs' shapes and dtype; the rest are the call's keywords
    after validation (window as (left, right) or None; scale resolved). The
    mask and the mods are compared by identity."""

    shapes: AttentionShapes
    is_causal: bool
    causal_align: str
    window: tuple[int | None, int | None] | None
    scale: float
    attn_mask: object = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None

    def describe(self) -> str:
        """The settings, as `flash_attention` takes them."""
        window = None if self.window is None else self.window
        return (f"is_causal={self.is_causal}, causal_align={self.causal_align!r}, window={window}, "
                f"scale={self.scale!r}, attn_mask={'None' if self.attn_mask is None else 'given'}, "
                f"score_mod={_name(self.score_mod)}, mask_mod={_name(self.mask_mod)}")

    def differences(self, stated: dict) -> list[str]:
        """'name: the forward's value, stated value' for each stated setting
        (a key of `stated`, None values left out) that differs from this one."""
        found = []
        for name, value in stated.items():
            if value is None:
                continue
            if name == "is_causal":
                value = check_is_causal(value)
            elif name == "causal_align":
                value = check_align(value)
            elif name == "window":
                value = check_window(value)
                value = None if value == (None, None) else value
            elif name == "scale":
                value = check_scale(value, self.shapes.E)
            mine = getattr(self, name)
            same = (value is mine) if name in ("attn_mask", "score_mod", "mask_mod") else (value == mine)
            if not same:
                show = (lambda x: _name(x)) if name in ("score_mod", "mask_mod") else (
                    (lambda x: "given" if x is not None else "None") if name == "attn_mask" else repr)
                found.append(f"{name}: the forward's {show(mine)}, got {show(value)}")
        return found


def _name(fn) -> str:
    if fn is None:
        return "None"
    return getattr(fn, "__qualname__", None) or type(fn).__name__


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
    problem: FlashProblem  # what the caller asked for (checked by the backward)
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
    # The compiled fused tiles (attnkit.kernels.flash: band_exp_tile, grad_scores_tile)
    # do each float32 tile's element-wise work in one pass: the shift, the band's mask
    # and the row sums, so keys and values need no ones column and the products run at
    # the head's own width (a product by E + 1 columns runs slower than by E; docs/benchmarks.md,
    # 'Measurements behind design choices'). Chosen once per call, so that the forward and the
    # backward form the same scores; float64 runs (`fused_in`) keep the reference path.
    fused: bool = False
    _band_cache: dict = field(default_factory=dict, repr=False)

    def fused_in(self, dtype) -> bool:
        """Whether a run in `dtype` takes the fused tiles (float32 only)."""
        return self.fused and np.dtype(dtype) == np.float32

    def ones_in(self, dtype) -> bool:
        """Whether a run in `dtype` gives keys and values a ones column."""
        return self.key_ones and not self.fused_in(dtype)

    def local_band(self, q0: int, k0: int) -> tuple[int, int]:
        """(lo, hi) of the band on the positions of a tile starting at query q0 and
        key k0 (pair (i, j) allowed when lo <= j - i <= hi), ±NO_BAND where a side
        is open: what the fused tiles take instead of a bias."""
        lo, hi, d = self.band.lo, self.band.hi, k0 - q0  # as Band.shifted(q0, k0)
        return (-compiled.NO_BAND if lo is None else lo - d), (compiled.NO_BAND if hi is None else hi - d)

    @property
    def lo(self) -> int | None:
        return self.band.lo

    @property
    def hi(self) -> int | None:
        return self.band.hi

    def rows_within(self, q0: int, q1: int, c0: int, c1: int) -> tuple[int, int] | None:
        """(a, b): the rows q0 + a .. q0 + b - 1 of [q0, q1) whose every key the band
        allows lies in [c0, c1), so that a piece over those columns holds their whole
        row (the backward takes their D from it); None when there is none. The
        band's first and last keys grow with the row, so such rows are one run."""
        lo, hi, S, start = self.band.lo, self.band.hi, self.shapes.S, q0
        if c0 > 0:  # the row's first key, max(0, i + lo), must be >= c0
            if lo is None:
                return None
            q0 = max(q0, c0 - lo)
        if c1 < S:  # its last, min(S, i + hi + 1) - 1, must be < c1
            if hi is None:
                return None
            q1 = min(q1, c1 - hi)
        return (q0 - start, q1 - start) if q1 > q0 else None

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

    def value_runs(self, r0: int, r1: int, k0: int, k1: int) -> tuple[tuple[int, int, int, int], ...]:
        """How the forward's P V product of piece (r0:r1, k0:k1) runs: as (a, b,
        c0, c1) runs of VALUE_ROWS rows [a, b) with the columns [c0, c1) they see,
        both as offsets in the piece; one run, the whole piece, when the band's
        edge does not cross it. Its weights outside the band are 0, so a run
        leaves out only zero terms. A causal diagonal piece of 128 rows then
        multiplies about (1 + 32 / 128) / 2 of its weights by V instead of all,
        which made a diagonal tile cheaper than with 128-row products (the score
        product stays at 128 rows: with 32 its q kᵀ ran much slower, an inner
        side of 64 over so few rows). Cached per piece. The figures:
        docs/benchmarks.md, 'Measurements behind design choices'."""
        key = ("values", r0, r1, k0, k1)
        found = self._band_cache.get(key)
        if found is None:
            runs = []
            step = VALUE_ROWS if self.band.bounded else r1 - r0
            for a in range(r0, r1, step):
                b = min(a + step, r1)
                c0, c1 = self.tile_cols(a, b, k0, k1)
                if runs and runs[-1][2:] == (c0 - k0, c1 - k0):  # the rows below see the same keys: joined
                    runs[-1] = (runs[-1][0], b - r0, c0 - k0, c1 - k0)
                else:
                    runs.append((a - r0, b - r0, c0 - k0, c1 - k0))
            found = self._band_cache[key] = tuple(runs)
        return found

    def row_pieces(self, q0: int, q1: int, k_start: int, k_end: int) -> tuple[tuple[int, ...], ...]:
        """The pieces (`pieces`) of every key tile of [k_start, k_end) (on the
        block_k grid) over query rows [q0, q1), in the order a forward task takes
        them, as (r0, r1, c0, c1, lo, hi): a piece and its band on its own
        positions (`local_band`, within ±NO_BAND), what the fused tiles take.
        Cached per task."""
        key = ("rows", q0, q1, k_start, k_end)
        found = self._band_cache.get(key)
        if found is None:
            edge = compiled.NO_BAND  # (a window's side past it excludes nothing either: int64 for the loop)
            found = self._band_cache[key] = tuple(
                (r0, r1, c0, c1, *(max(-edge, min(side, edge)) for side in self.local_band(r0, c0)))
                for k_tile in range(k_start, k_end, self.block_k)
                for r0, r1, c0, c1 in self.pieces(q0, q1, k_tile, min(k_tile + self.block_k, k_end)))
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

    def batch_index(self, b: int) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(b, self.shapes.batch)) if self.shapes.batch else ()

    def band_bias(self, q0: int, q1: int, k0: int, k1: int, dtype) -> tuple[_Columns | None, bool]:
        """(bias, empty): the band's additive (rows, cols) tile, 0 where it allows
        a pair and -inf where it does not, as the span of columns that hold a
        -inf (None when it allows all), and whether it allows none. Adding is
        faster than np.copyto(where=) (docs/benchmarks.md, 'Measurements behind
        design choices'); the tile depends only on the band
        relative to the tile and its shape, so it is cached across calls (a
        causal mask's diagonal tiles repeat for every head and every call)."""
        local = self.band.shifted(q0, k0)  # on the tile's own positions: j - i
        rows, cols = q1 - q0, k1 - k0
        lo = None if local.lo is None or local.lo <= -(rows - 1) else max(local.lo, -rows)
        hi = None if local.hi is None or local.hi >= cols - 1 else min(local.hi, cols)
        if lo is None and hi is None:
            return None, False
        return _band_tile(lo, hi, rows, cols, np.dtype(dtype).str)

    def tile_masks(self, tile: _Tile, dtype, band: bool = True):
        """(skip, blocked, adds) for one tile: skip when no pair is allowed;
        blocked a bool array broadcastable to the tile's (heads, rows, cols),
        True where a boolean mask or mask_mod excludes a pair, or None; adds the
        float arrays to add to the scores (the band's 0/-inf bias unless `band`
        is False: the fused tiles mask the band themselves; the float attn_mask),
        broadcastable to it too."""
        b, h0, h1, q0, q1, k0, k1 = tile
        bias, empty = self.band_bias(q0, q1, k0, k1, dtype)
        if empty:
            return True, None, ()
        adds = () if bias is None or not band else (bias,)
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
    offset = np.arange(cols)[None, :] - np.arange(rows)[:, None]  # kv - q
    blocked = np.zeros((rows, cols), dtype=bool)
    if lo is not None:
        blocked |= offset < lo
    if hi is not None:
        blocked |= offset > hi
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


def _make_plan(query, key, value, *, attn_mask=None, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False, causal_align: str = "top_left", window=None,
               score_mod: Callable | None = None, mask_mod: Callable | None = None,
               block_q: int | None = None, block_k: int | None = None,
               num_threads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, FlashPlan]:
    """Validate one call (`flash_attention`'s arguments): query, key and value
    as (*batch, H, N, D) views, and its plan."""
    q, k, v, shapes = _check_inputs(query, key, value, enable_gqa)
    L, S = shapes.L, shapes.S
    band = Band.from_options(is_causal=is_causal, causal_align=causal_align, window=window, L=L, S=S)
    window_sides = check_window(window)
    problem = FlashProblem(
        shapes=shapes, is_causal=bool(is_causal), causal_align=causal_align,
        window=None if window_sides == (None, None) else window_sides,
        scale=check_scale(scale, shapes.E), attn_mask=attn_mask, score_mod=score_mod, mask_mod=mask_mod,
    )
    scale = problem.scale
    mask = check_mask(attn_mask, shapes, bool(is_causal))
    if mask is not None:
        mask = np.broadcast_to(mask, shapes.scores_shape)
    score_mod = check_mod(score_mod, "score_mod", 5, "(score, b, h, q_idx, kv_idx)")
    mask_mod = check_mod(mask_mod, "mask_mod", 4, "(b, h, q_idx, kv_idx)")
    block_q, block_k = _check_block(block_q, "block_q"), _check_block(block_k, "block_k")
    num_threads = _check_block(cpu_count() if num_threads is None else num_threads, "num_threads")

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
        # its NumPy calls; wider key tiles win, up to a point where one tile grows too big
        # (docs/benchmarks.md, 'Measurements behind design choices').
        auto_k = min(S, max(auto_k, FEW_ROWS_KEYS))
    heads = math.prod(shapes.batch) * shapes.q_heads
    threads = useful_threads(num_threads, heads * L * S)  # the forward's work (see _flash_forward)
    while threads > 1 and auto_q > PIECE_ROWS and heads * -(-L // auto_q) < 2 * threads:
        auto_q = max(PIECE_ROWS, auto_q // 2)  # two forward tasks per thread, where blocks can shrink
    # the fused tiles: float32 with enough rows for the ones columns they replace, no
    # score_mod (its derivative needs dS before the mod), and the kernels on and worth starting
    fused = (key_ones and score_mod is None and shapes.compute_dtype == np.float32
             and compiled.wants(heads * L * S))
    plan = FlashPlan(
        shapes=shapes, enable_gqa=bool(enable_gqa), scale=scale, band=band, problem=problem, mask=mask,
        mask_mod=mask_mod, score_mod=score_mod,
        block_q=min(block_q or auto_q, max(L, 1)), block_k=min(block_k or auto_k, max(S, 1)),
        num_threads=num_threads, piece_q=PIECE_ROWS, key_ones=key_ones, fused=fused,
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
