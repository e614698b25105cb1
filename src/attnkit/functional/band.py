"""The causal / sliding-window band: which keys a query may see, written once.

Every structural mask attnkit knows (causal, top-left or bottom-right aligned,
and a sliding window, aligned the same way) allows a pair (query q, key kv)
exactly when the offset kv - q lies in a band:

    lo <= kv - q <= hi          (lo, hi inclusive; None = unbounded on that side)

For L queries over S keys, alignment says where query i's diagonal sits:

- ``top_left`` (torch's ``is_causal=True``): query i stands at key position i.
- ``bottom_right`` (a KV cache): query i stands at key position i + (S - L),
  the L new queries being the last L positions of the S keys.

A causal mask is ``hi = offset``; a window (left, right) adds
``lo = offset - left`` and ``hi = offset + right``. `Band.from_options` turns
attention's keywords (is_causal, causal_align, window) into that value, once,
and everything else (the dense mask, the keys a block of queries may see, the
queries a block of keys may be seen by, whether a tile is inside, outside or
crossed by the band) is read off it. This module is also the one home of the
alignment and window checks, so every entry point raises the same errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "ALIGNMENTS",
    "Band",
    "alignment_offset",
    "check_align",
    "check_integer",
    "check_is_causal",
    "check_window",
]

ALIGNMENTS = ("top_left", "bottom_right")

TileKind = Literal["inside", "outside", "partial"]


# ----------------------------------------------------------------------------- checks


def check_integer(value, name: str, *, minimum: int = 0) -> int:
    """An integer (not a bool) >= minimum, as a Python int.

    Raises TypeError "expected {name} to be an integer, got float" for a
    non-integer and ValueError "expected {name} >= {minimum}, got {value}"."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected {name} to be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"expected {name} >= {minimum}, got {value}")
    return int(value)


def check_is_causal(is_causal) -> bool:
    """A bool (or numpy bool); TypeError otherwise."""
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"expected is_causal to be a bool, got {type(is_causal).__name__}")
    return bool(is_causal)


def check_align(causal_align, name: str = "causal_align") -> str:
    """"top_left" (torch's is_causal: query i sees keys 0..i) or "bottom_right"
    (query i sees keys 0..i + S - L, the L new queries of a KV cache); ValueError otherwise."""
    if not isinstance(causal_align, str) or causal_align not in ALIGNMENTS:
        raise ValueError(f"expected {name} to be one of {ALIGNMENTS}, got {causal_align!r}")
    return causal_align


def check_window(window) -> tuple[int | None, int | None]:
    """(left, right) from window=w (left=w, right=0), a (left, right) pair (None =
    unbounded) or None (no window), as in masks.sliding_window_mask.

    TypeError for anything but an int, a pair or None, and for a side that is not
    an integer or None; ValueError for a negative side."""
    if window is None:
        return None, None
    if isinstance(window, (int, np.integer)) and not isinstance(window, (bool, np.bool_)):
        window = (int(window), 0)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"expected window as an int (left) or a (left, right) pair, got {window!r}")
    left, right = (None if side is None else check_integer(side, f"window {name}")
                   for side, name in zip(window, ("left", "right")))
    return left, right


def alignment_offset(L: int, S: int, align: str) -> int:
    """Where query 0's diagonal sits among the keys: 0 top-left, S - L bottom-right.
    The one place attnkit does this arithmetic."""
    return 0 if check_align(align, "align") == "top_left" else S - L


# ----------------------------------------------------------------------------- the band


@dataclass(frozen=True)
class Band:
    """The pairs lo <= kv - q <= hi (None = unbounded), on absolute positions:
    q in [0, L), kv in [0, S). Band() allows every pair."""

    lo: int | None = None
    hi: int | None = None

    @classmethod
    def from_options(cls, *, is_causal: bool = False, causal_align: str = "top_left", window=None,
                     L: int, S: int) -> "Band":
        """The band of an attention call with L queries over S keys.

        Arguments:
            is_causal: query i sees no key after its own (aligned) position.
            causal_align: "top_left" or "bottom_right"; aligns the window too.
            window: None, an int `left` (as (left, 0)) or a pair (left, right):
                query i sees keys from its position - left to its position + right.
            L, S: query and key lengths.

        Raises the errors every attention entry point raises for these arguments
        (TypeError for a non-bool is_causal or a malformed window, ValueError
        for an unknown alignment or a negative window side)."""
        is_causal = check_is_causal(is_causal)
        causal_align = check_align(causal_align)
        left, right = check_window(window)
        hi = 0 if is_causal else None
        if right is not None:
            hi = right if hi is None else min(hi, right)
        return cls.aligned(None if left is None else -left, hi, align=causal_align, L=L, S=S)

    @classmethod
    def aligned(cls, lo: int | None, hi: int | None, *, align: str, L: int, S: int) -> "Band":
        """The band lo <= kv - (q + offset) <= hi, offset from `alignment_offset`:
        lo and hi measured from each query's aligned position."""
        offset = alignment_offset(L, S, align)
        return cls(None if lo is None else lo + offset, None if hi is None else hi + offset)

    # ---- combining

    @property
    def bounded(self) -> bool:
        """Whether the band limits anything at all (one side or both)."""
        return self.lo is not None or self.hi is not None

    def intersect(self, other: "Band") -> "Band":
        """Pairs both bands allow."""
        lo = self.lo if other.lo is None else other.lo if self.lo is None else max(self.lo, other.lo)
        hi = self.hi if other.hi is None else other.hi if self.hi is None else min(self.hi, other.hi)
        return Band(lo, hi)

    def shifted(self, q0: int, k0: int) -> "Band":
        """This band for a block whose local positions start at query q0 and key
        k0: local kv' - q' = (kv - q) - (k0 - q0)."""
        d = k0 - q0
        return Band(None if self.lo is None else self.lo - d, None if self.hi is None else self.hi - d)

    def excludes_nothing(self, L: int, S: int) -> bool:
        """Whether every pair of L queries over S keys is allowed (kv - q runs
        from -(L - 1) to S - 1; no pair at all when L or S is 0)."""
        if L == 0 or S == 0:
            return True
        return (self.lo is None or self.lo <= -(L - 1)) and (self.hi is None or self.hi >= S - 1)

    # ---- dense forms

    def allows(self, q_idx, kv_idx) -> np.ndarray:
        """Booleans, True = may attend, for integer positions q_idx and kv_idx
        broadcast together (e.g. (rows, 1) and (1, cols))."""
        rel = np.asarray(kv_idx) - np.asarray(q_idx)
        allowed = np.ones(np.shape(rel), dtype=bool)
        if self.lo is not None:
            allowed &= rel >= self.lo
        if self.hi is not None:
            allowed &= rel <= self.hi
        return allowed

    def dense(self, L: int, S: int) -> np.ndarray:
        """The (L, S) boolean mask, True = may attend."""
        return self.allows(np.arange(L)[:, None], np.arange(S)[None, :])

    # ---- ranges and tiles

    def kv_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        """[start, stop): the keys any query of [q0, q1) may see, clipped to [0, S)."""
        start = 0 if self.lo is None else max(0, q0 + self.lo)
        stop = S if self.hi is None else min(S, q1 - 1 + self.hi + 1)
        return start, max(start, stop)

    def shared_kv_range(self, q0: int, q1: int, k0: int, k1: int) -> tuple[int, int]:
        """[start, stop): the keys of [k0, k1) that every query of [q0, q1) may see."""
        start = k0 if self.lo is None else max(k0, q1 - 1 + self.lo)
        stop = k1 if self.hi is None else min(k1, q0 + self.hi + 1)
        return start, max(start, stop)

    def q_range(self, k0: int, k1: int, L: int) -> tuple[int, int]:
        """[start, stop): the queries that may see any key of [k0, k1), clipped to [0, L)."""
        start = 0 if self.hi is None else max(0, k0 - self.hi)
        stop = L if self.lo is None else min(L, k1 - 1 - self.lo + 1)
        return start, max(start, stop)

    def tile_cols(self, q0: int, q1: int, k0: int, k1: int) -> tuple[int, int]:
        """[c0, c1): the columns of tile (queries [q0, q1), keys [k0, k1)) that any
        of its rows may see (empty, c0 == c1, when none)."""
        c0 = k0 if self.lo is None else max(k0, q0 + self.lo)
        c1 = k1 if self.hi is None else min(k1, q1 + self.hi)
        return c0, max(c0, c1)

    def tile(self, q0: int, q1: int, k0: int, k1: int) -> TileKind:
        """Whether tile (queries [q0, q1), keys [k0, k1)) lies "inside" the band
        (every pair allowed: no mask needed), "outside" (none: skip it) or is
        "partial" (the band's edge crosses it). An empty tile is "outside"."""
        if q1 <= q0 or k1 <= k0:
            return "outside"
        least, most = k0 - (q1 - 1), (k1 - 1) - q0  # the range of kv - q over the tile
        if (self.lo is not None and most < self.lo) or (self.hi is not None and least > self.hi):
            return "outside"
        if (self.lo is None or least >= self.lo) and (self.hi is None or most <= self.hi):
            return "inside"
        return "partial"
