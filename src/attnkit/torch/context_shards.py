"""How context parallelism cuts a sequence over ranks, and the checks every call starts with.

- Layouts: `shard_bounds(L, W, layout)` gives each rank its segments of the global
  sequence ("contiguous": the r-th of W chunks; "zigzag": chunks r and 2W - 1 - r of 2W,
  equal causal work); `shard_sequence` / `gather_sequence` cut and join a tensor so.
- `_check_inputs`: local checks, then one all-gather of every rank's shapes and settings,
  so that a disagreement raises the same ValueError on every rank instead of hanging.

`attnkit.torch.distributed` (ring and Ulysses attention) uses these and re-exports the
public names: import them from there.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from attnkit.functional.band import Band, check_window

LAYOUTS = ("zigzag", "contiguous")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------- layouts


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"expected layout to be one of {LAYOUTS}, got {layout!r}")
    return layout


def _chunks(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` chunks covering 0..total, lengths differing by at most 1."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_bounds(total: int, world_size: int, layout: str = "zigzag") -> list[list[tuple[int, int]]]:
    """The global [start, stop) segments each rank holds, in the order it holds them.

    contiguous: rank r holds chunk r of W; zigzag: chunks r and 2W - 1 - r of 2W."""
    _check_layout(layout)
    if layout == "contiguous":
        return [[segment] for segment in _chunks(total, world_size)]
    chunks = _chunks(total, 2 * world_size)
    return [[chunks[r], chunks[2 * world_size - 1 - r]] for r in range(world_size)]


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialized (dist.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", *, dim: int = -2) -> torch.Tensor:
    """This rank's shard of the full sequence `x` along `dim` (default -2, the L of (..., H, L, E)).

    Every rank passes the same full tensor; rank r keeps its segments (see
    `shard_bounds`), concatenated in order. Returns a new tensor (differentiable)."""
    rank, world = _group_info(group)
    segments = shard_bounds(x.shape[dim], world, layout)[rank]
    return torch.cat([x.narrow(dim, start, stop - start) for start, stop in segments], dim=dim)


def gather_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", *, dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard along `dim` (the inverse of
    shard_sequence), on every rank. Not differentiable: for outputs and checks."""
    rank, world = _group_info(group)
    dim = dim % x.dim()
    lengths = _all_gather_ints([x.shape[dim]], group, world)
    total = sum(row[0] for row in lengths)
    bounds = shard_bounds(total, world, layout)
    for r in range(world):
        expected = sum(stop - start for start, stop in bounds[r])
        if lengths[r][0] != expected:
            raise ValueError(
                f"gather_sequence: rank {r} holds {lengths[r][0]} positions along dim {dim}, but the {layout} "
                f"layout of {total} positions over {world} ranks gives it {expected}"
            )
    longest = max(row[0] for row in lengths)
    padded = torch.zeros(x.shape[:dim] + (longest,) + x.shape[dim + 1 :], dtype=x.dtype, device=x.device)
    padded.narrow(dim, 0, x.shape[dim]).copy_(x.detach())
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=group)
    out = torch.empty(x.shape[:dim] + (total,) + x.shape[dim + 1 :], dtype=x.dtype, device=x.device)
    for r in range(world):
        offset = 0
        for start, stop in bounds[r]:
            out.narrow(dim, start, stop - start).copy_(pieces[r].narrow(dim, offset, stop - start))
            offset += stop - start
    return out


def _all_gather_ints(values: list[int], group, world: int) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = mine.to(device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return [row.tolist() for row in rows]


# ----------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class _Spec:
    """What every (query chunk, key chunk) pair needs to build its mask."""

    band: Band  # causal and window, on global kv - q
    mask_mod: Callable | None
    score_mod: Callable | None
    batch: tuple  # leading dims
    Hq: int
    Hkv: int
    head_offset: int  # global index of this rank's first query head (Ulysses)
    scale: float


FIXED_DIMS = 6  # batch dims in the first all-gather's row; more go in a second one


def _float_bits(x: float) -> int:
    """A float's exact bits as an int64 (all_gather compares ints exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _side(code: int) -> int | None:
    return None if code == -1 else code


def _describe_rank(i: int, r: list[int], deep: list[int]) -> str:
    """One rank's row of `_check_inputs`' all-gather, in words (deep: its batch dims
    past FIXED_DIMS, when every rank had that many)."""
    n = 1 + FIXED_DIMS
    shown = r[1:1 + min(FIXED_DIMS, r[0])] + [r[n], r[n + 2], r[n + 3]]  # (..., Hq, L_local, E)
    window = None if r[n + 10] else (_side(r[n + 8]), _side(r[n + 9]))
    mods = ", ".join(f"{name} {'None' if r[at] else 'set'}" for name, at in (("score_mod", n + 11),
                                                                            ("mask_mod", n + 12)))
    hidden = " (batch dims past the 6th not shown)" if r[0] > FIXED_DIMS and not deep else ""
    text = (f"rank {i}: query {tuple(shown)}{hidden}, "
            f"key/value heads {r[n + 1]}, dtype {_DTYPES[r[n + 5]]}, causal {bool(r[n + 6])}, "
            f"layout {LAYOUTS[r[n + 7]]}, window {window}, scale {_from_bits(r[n + 13])!r}, {mods}")
    if deep:
        text += f", batch dims past the {FIXED_DIMS}th {tuple(deep)}"
    return text


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 3:
        raise ValueError(f"expected {name} of shape (..., H, L_local, E) with at least 3 dims, got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"expected {name} to be a floating-point tensor, got {x.dtype}")


def _check_inputs(fn: str, q, k, v, group, causal, layout, scale, enable_gqa, window, score_mod, mask_mod):
    """Local checks, then one all-gather of every rank's shapes and settings (dtype,
    causal, layout, window, scale bit for bit, which mods are set; a second one
    for batch dims past FIXED_DIMS): a disagreement raises the same ValueError on
    every rank. Returns (rank, world, segments of every rank, total length, spec)."""
    for name, x in (("query", q), ("key", k), ("value", v)):
        _check_tensor(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"expected query, key, value of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_layout(layout)
    left, right = check_window(window)  # attnkit.functional's check: the same errors
    *batch, Hq, L, E = q.shape
    if k.shape[:-3] != tuple(batch) or v.shape[:-3] != tuple(batch):
        raise ValueError(f"expected key and value with leading dims {tuple(batch)} like query, "
                         f"got key {tuple(k.shape)} and value {tuple(v.shape)}")
    Hkv = k.shape[-3]
    if k.shape[-2:] != (L, E) or v.shape[-3:-1] != (Hkv, L):
        raise ValueError(f"expected key ({Hkv}, {L}, {E}) and value ({Hkv}, {L}, Ev) like query's shard "
                         f"(self-attention over one sequence), got key {tuple(k.shape)} and value {tuple(v.shape)}")
    if Hkv != Hq:
        if not enable_gqa:
            raise ValueError(f"query has {Hq} heads but key/value have {Hkv}; pass enable_gqa=True for GQA")
        if Hkv == 0 or Hq % Hkv:
            raise ValueError(f"GQA needs key/value heads dividing query heads, got Hq={Hq}, Hkv={Hkv}")
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is not None and not callable(mod):
            raise TypeError(f"expected {name} to be callable or None, got {type(mod).__name__}")
    if score_mod is not None and getattr(score_mod, "grad", None) is not None:
        raise ValueError(f"{fn} takes additive score mods only (grad=None, e.g. alibi); "
                         f"got {score_mod!r}, whose derivative is not 1")
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    rank, world = _group_info(group)

    # one all-gather: every rank checks every rank's shapes and settings, so all raise
    # together; a row of fixed length (all_gather needs one): the first batch dims
    # here, any past FIXED_DIMS in a second all-gather below
    dims = list(batch)[:FIXED_DIMS] + [-1] * (FIXED_DIMS - min(FIXED_DIMS, len(batch)))
    code = lambda side: -1 if side is None else side  # noqa: E731
    row = [len(batch), *dims, Hq, Hkv, L, E, v.shape[-1], _DTYPES.index(q.dtype), int(bool(causal)),
           LAYOUTS.index(layout), code(left), code(right), int(window is None),
           int(score_mod is None), int(mask_mod is None), _float_bits(scale)]
    rows = _all_gather_ints(row, group, world)
    n = 1 + FIXED_DIMS  # L_local is rows[i][n + 2]: the one entry that may differ
    shared = [r[:n + 2] + r[n + 3:] for r in rows]
    if all(s == shared[0] for s in shared) and len(batch) > FIXED_DIMS:
        # every rank has the same number of batch dims (rows agree): all take this branch
        extra = _all_gather_ints(list(batch)[FIXED_DIMS:], group, world)
        shared = [s + e for s, e in zip(shared, extra)]
    if any(s != shared[0] for s in shared):
        described = "; ".join(_describe_rank(i, r, s[len(r) - 1:]) for i, (r, s) in enumerate(zip(rows, shared)))
        raise ValueError(f"{fn}: ranks disagree on shapes or arguments (all but L_local must match): {described}")
    total = sum(r[n + 2] for r in rows)
    bounds = shard_bounds(total, world, layout)
    lengths = [r[n + 2] for r in rows]
    expected = [sum(stop - start for start, stop in segments) for segments in bounds]
    if lengths != expected:
        raise ValueError(f"{fn}: shard lengths {lengths} are not the {layout} layout of {total} positions over "
                         f"{world} ranks, which is {expected} (cut the sequence with shard_sequence)")
    mask_mod = mask_mod.bind(total, total) if hasattr(mask_mod, "bind") else mask_mod
    score_mod = score_mod.bind(total, total) if hasattr(score_mod, "bind") else score_mod
    band = Band.from_options(is_causal=bool(causal), window=(left, right), L=total, S=total)
    spec = _Spec(band, mask_mod, score_mod, tuple(batch), Hq, Hkv, 0, float(scale))
    return rank, world, bounds, total, spec
