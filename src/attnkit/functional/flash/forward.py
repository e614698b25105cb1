"""The tiled forward: `flash_attention`, softmax over key tiles with a fixed
per-row shift (or the online softmax's running max), tasks spread over the
runtime's worker threads.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

from attnkit.functional._checks import output_ndim
from attnkit.functional.flash.plan import FlashPlan, _Columns, _Tile, _flat, _make_plan, _with_ones
from attnkit.functional.flash.state import AttentionState, merge_attention_states
from attnkit.functional.precision import all_finite, matmul_in_chunks, needs_float64, start_dtype
from attnkit.functional.sinks import check_sinks, sink_factors
from attnkit.kernels import flash as compiled
from attnkit.runtime import l2_cache_bytes, run_tasks, scratch_arrays, scratch_buffer, scratch_tile, useful_threads


def _exp_tile(s: np.ndarray) -> None:
    """s <- exp(s) in place: the compiled loop when it takes s (float32), else NumPy."""
    if compiled.usable(s):
        compiled._exp_tile(s)
    else:
        np.exp(s, out=s)


def _shifted_exp_tile(s: np.ndarray, shift: np.ndarray) -> None:
    """s <- exp(s - shift[..., None]) in place, s (heads, rows, cols), shift (heads, rows):
    one compiled pass when it takes s (float32), else NumPy's two."""
    if compiled.usable(s):
        compiled._shifted_exp_tile(s, shift)
    else:
        s -= shift[..., None]
        np.exp(s, out=s)


def _weights_times_values(p: np.ndarray, v: np.ndarray, out: np.ndarray) -> None:
    """out <- [p v, p 1] (heads, rows, Ev + 1): with values carrying a ones column
    one product gives both; without it (few rows, FlashPlan.key_ones) the row
    sums are a separate reduction (pairwise), and p v is summed in chunks of
    keys (`matmul_in_chunks`): those tiles are up to FEW_ROWS_KEYS wide, and
    OpenBLAS would round each output over all of them in one run."""
    Ev = out.shape[-1] - 1
    if v.shape[-1] > Ev:
        np.matmul(p, v, out=out)  # the row sums come out of BLAS
    else:
        out[..., :Ev] = matmul_in_chunks(p, v)
        np.add.reduce(p, axis=-1, out=out[..., Ev])


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
    (heads, rows, Ev), lse (heads, rows), shift and shifted_lse = lse - shift
    (heads, rows); shift None keeps the task on the running-max path (a split row's
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
    shifted_lse: np.ndarray | None


_SAMPLE_KEYS = 16  # keys whose scores give a row's shift on the fast path


def _forward_rows(plan: FlashPlan, inputs: _ForwardInputs, rows: _Rows) -> None:
    """One forward task (see _Rows): softmax over its key tiles, the heads side
    by side in every call (one NumPy call per tile, not per head).

    Fast path: each row's shift c is fixed before the first tile, the largest
    score over a few keys that every row of the task may see. BLAS subtracts it
    inside the score product ([q * scale, -c] . [k, 1]), or on the fused tiles
    their compiled pass does (`_fused_tiles`), so a tile costs its two
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
    fused = plan.fused_in(cd)  # the compiled tiles shift and sum: q * scale alone, products at width E
    width = E if fused else E + 1
    qa = scratch_buffer("qa", nh * r * width, cd)[: nh * r * width].reshape(nh, r, width)  # [q * scale, -c]
    np.multiply(inputs.q[b, h0:h1, q0:q1], cd.type(plan.scale), out=qa[..., :E])
    sample = None if rows.shift is None else _sample_keys(plan, q0, q1, rows.k_start, rows.k_end)
    acc = scratch_buffer("acc", nh * r * (Ev + 1), cd)[: nh * r * (Ev + 1)].reshape(nh, r, Ev + 1)  # [sum p v, sum p]
    if not fused or sample is None:  # (the fused tiles sum apart; see _fused_tiles)
        acc[...] = 0  # (a scratch buffer: a fresh zeroed one past 128 KiB is new pages, faulted in on every task)
    part = scratch_buffer("part", nh * r * (Ev + 1), cd)[: nh * r * (Ev + 1)].reshape(nh, r, Ev + 1)
    if sample is not None:
        # (the sample's scores as (keys, rows): a 16-wide product ran at half the speed)
        c = np.max(np.matmul(ka[:, sample, :E], qa[..., :E].swapaxes(-1, -2)), axis=1)  # (heads, rows)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is detected below (per thread)
            if fused:
                weighted, total = _fused_tiles(plan, inputs, rows, qa, ka, va, c)
            else:
                qa[..., E] = -c
                for tile, s, at in _score_tiles(plan, inputs, rows, qa, ka):
                    _exp_tile(s)
                    _weights_times_values(s, va[:, tile.k0:tile.k1], part[:, at])  # [P V, P 1]
                    acc[:, at] += part[:, at]
                weighted, total = acc[..., :Ev], acc[..., Ev]
        # c is a score the row sees, so its sum is >= 1 up to rounding. Far below
        # (scores near 1e19 in float64, 1e8 in float32) the sample's product
        # rounded c above the tiles' fused s - c, every weight is small and p v
        # can underflow: the running max (top weight exactly 1) takes the task.
        if all_finite(weighted, total) and (total >= 0.5).all():
            np.divide(weighted, total[..., None], out=rows.out)
            rows.shifted_lse[...] = np.log(total.astype(np.float64))
            rows.lse[...] = c.astype(np.float64) + rows.shifted_lse
            rows.shift[...] = c
            return
        acc[...] = 0
    if not fused:
        qa[..., E] = 0
    m = np.full((nh, r), -np.inf, dtype=cd)  # running max per row
    new_m = scratch_tile("new_m", nh, r, cd)
    alpha = scratch_tile("alpha", nh, r, cd)
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
        _shifted_exp_tile(s, shift)
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
        rows.shifted_lse[...] = rows.lse


def _fused_tiles(plan: FlashPlan, inputs: _ForwardInputs, rows: _Rows, qs, ka, va, c) -> tuple[np.ndarray, ...]:
    """The fast path's tiles on the compiled fused kernel (FlashPlan.fused): per
    piece (`FlashPlan.row_pieces`) the product q kᵀ at the head's width, one pass
    that shifts by c, takes the exp, masks the band and sums the rows (the loop of
    `band_exp_tile`, called as it is), and P V. qs (heads, rows, E) is q * scale,
    ka and va the task's keys and values (heads, S, E) and (heads, S, Ev), or
    (1, S, ·) shared by the heads (GQA), c (heads, rows) the shifts. Only a band
    excludes keys here (the fast path takes no mask: `_sample_keys`). Returns sum
    p v (heads, rows, Ev) and sum p (heads, rows), in this thread's scratch (each
    contiguous: adding a tile into Ev of Ev + 1 columns cost several times a
    contiguous add).

    The heads whose piece fits the L2 cache together go side by side in each
    call (`_heads_per_call`): a causal diagonal is cut into pieces of piece_q
    rows, and each piece's calls carry a fixed cost of Python and dispatch on
    top of its work (docs/benchmarks.md, 'Measurements behind design
    choices'). NumPy's batched product multiplies head by head, so each
    head's scores are the bits `_tile_scores` forms on one head."""
    assert plan.mask is None and plan.mask_mod is None, "the fast path takes no mask"
    cd = ka.dtype
    nh, r, Ev = qs.shape[0], qs.shape[1], va.shape[-1]
    zeros, ones = scratch_buffer("zeros", nh * r, cd)[: nh * r], scratch_buffer("ones", nh * r, cd)[: nh * r]
    zeros[...], ones[...] = 0, 1  # the forward's extra shift and factor: (s - c) - 0 is s - c, x * 1 is x
    weighted = scratch_buffer("weighted", nh * r * Ev, cd)[: nh * r * Ev].reshape(nh, r, Ev)  # sum p v
    total = scratch_tile("total", nh, r, cd)  # sum p
    weighted[...], total[...] = 0, 0
    written = bytearray(r)  # 1: rows a piece has written; a piece over none of them writes its sums, no add
    part = scratch_buffer("pv", nh * r * Ev, cd)[: nh * r * Ev].reshape(nh, r, Ev)
    most = min(nh * r * plan.block_k, max(r * plan.block_k, l2_cache_bytes() // cd.itemsize))  # a call's scores
    s_buf, sums_buf = scratch_buffer("s", most, cd), scratch_buffer("sums", nh * r, cd)
    q0, loop = rows.q0, compiled._band_exp_loop()
    shared = ka.shape[0] == 1  # GQA: one kv head for all the task's heads, (1, S, ·) broadcasts
    for r0, r1, k0, k1, lo, hi in plan.row_pieces(q0, rows.q1, rows.k_start, rows.k_end):
        at, n_rows, n = slice(r0 - q0, r1 - q0), r1 - r0, k1 - k0
        first = written.count(1, at.start, at.stop) == 0  # (else added, onto zeros where not yet written)
        values = plan.value_runs(r0, r1, k0, k1)
        written[at] = b"\x01" * n_rows
        step = _heads_per_call(nh, n_rows * n * cd.itemsize)
        for h0 in range(0, nh, step):
            h1 = min(h0 + step, nh)
            m, heads = h1 - h0, slice(h0, h1)
            kv = slice(None) if shared else heads
            s = s_buf[: m * n_rows * n].reshape(m, n_rows, n)
            np.matmul(qs[heads, at], ka[kv, k0:k1].swapaxes(-1, -2), out=s)  # (heads, rows, cols), as _tile_scores
            sums = sums_buf[: m * n_rows]
            shift = c[h0, at] if m == 1 else np.ascontiguousarray(c[heads, at]).reshape(-1)
            loop(s.reshape(m * n_rows, n), shift, zeros[: m * n_rows], ones[: m * n_rows], sums, n_rows, lo, hi)
            if first:  # the rows' first piece: its products are the sums so far (no add of a copy)
                _banded_values(s, va[kv, k0:k1], weighted[heads, at], values)
                total[heads, at] = sums.reshape(m, n_rows)
                continue
            out = part[:m, :n_rows]  # (heads, rows, Ev): contiguous per head
            _banded_values(s, va[kv, k0:k1], out, values)
            weighted[heads, at] += out
            total[heads, at] += sums.reshape(m, n_rows)
    return weighted, total


def _banded_values(p: np.ndarray, v: np.ndarray, out: np.ndarray, runs) -> None:
    """out <- p v, p (heads, rows, cols) a piece's weights, v (heads or 1, cols, Ev),
    out (heads, rows, Ev), one product per run of `FlashPlan.value_runs` (rows
    [a, b) over the columns [c0, c1) they see: the weights outside are 0)."""
    for a, b, c0, c1 in runs:
        if c1 > c0:
            np.matmul(p[:, a:b, c0:c1], v[:, c0:c1], out=out[:, a:b])
        else:  # no key for these rows (their sums are 0)
            out[:, a:b] = 0


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
    less the shift in qa, masked (-inf where not allowed), in a scratch
    buffer reused by the next piece; part the piece's rows as offsets in the
    task. (The fused tiles take the pieces from `FlashPlan.row_pieces`.)"""
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
            s = scratch_buffer("s", nh * r * n, cd)[: nh * r * n].reshape(nh, r, n)
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
    sinks: np.ndarray | None = None,
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
        sinks: (Hq,) real, learned attention sinks (gpt-oss): head h's logit
            s_h joins each row's softmax denominator and takes no value. The
            tiles run as without it; each row is then scaled by
            exp(lse - logaddexp(lse, s_h)), and the state's lse holds the sink,
            so the backward's exp(s - lse) rebuilds the sink-scaled weights
            (`attnkit.functional.sinks`). A row with no key gives output 0.

    Returns:
        The output (..., Hq, L, Ev) in query's dtype, or with return_lse
        AttentionState(output, lse, plan, shift, shifted_lse) with lse
        (..., Hq, L) in float64, and the plan and per-row shifts that
        `flash_attention_backward` needs.
        A query row with no key allowed gets output 0 and lse -inf.
    """
    drop = max(3 - output_ndim(query, key, value), 0)  # (L, E) inputs run with a head axis of 1
    q, k, v, plan = _make_plan(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        causal_align=causal_align, window=window, score_mod=score_mod, mask_mod=mask_mod,
        block_q=block_q, block_k=block_k, num_threads=num_threads,
    )
    shapes = plan.shapes
    sinks = check_sinks(sinks, shapes.q_heads)
    out_shape = (*shapes.batch, shapes.q_heads, shapes.L, shapes.Ev)
    if shapes.nothing_to_do:  # an empty result, or no key at all: zeros, as torch gives
        out = np.zeros(out_shape, dtype=shapes.dtype)
        lse = np.full(out_shape[:-1], -np.inf, dtype=np.float64)
        shift, shifted_lse = np.zeros(out_shape[:-1], dtype=np.float64), lse
        dtype = shapes.compute_dtype
    else:
        dtype = start_dtype(shapes.compute_dtype, plan.scale)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is redone below
            out, lse, shift, shifted_lse = _flash_forward(plan, q, k, v, dtype)
        if needs_float64(q, k, plan.scale, dtype, lse, value=v, output=out):
            # scores (or a running sum of values) beyond float32: torch's float64 answer
            dtype = np.dtype(np.float64)
            out, lse, shift, shifted_lse = _flash_forward(plan, q, k, v, dtype)
        out = out.reshape(out_shape)
        lse, shift, shifted_lse = (x.reshape(out_shape[:-1]) for x in (lse, shift, shifted_lse))
    if sinks is not None:
        out, lse, shifted_lse = with_sinks(out, lse, shifted_lse, sinks)
    out = out.astype(shapes.dtype, copy=False)
    if drop:
        out, lse, shift, shifted_lse = out[0], lse[0], shift[0], shifted_lse[0]
    return AttentionState(out, lse, plan, shift, shifted_lse, dtype, sinks) if return_lse else out


def with_sinks(out: np.ndarray, lse: np.ndarray, shifted_lse: np.ndarray, sinks: np.ndarray):
    """(out', lse', shifted_lse'): a forward's results with the sinks (float64 (Hq,))
    joined to each row's denominator: out (..., Hq, L, Ev) times w = exp(lse - lse'),
    lse' = logaddexp(lse, s_h), and lse' - shift (shifted_lse, float64) grown by
    log(1 + exp(s_h - lse)), computed as such. A row with no key keeps output 0
    and its shifted lse -inf (its tiles are masked: the backward's weights are 0)."""
    w, lse_with_sink = sink_factors(lse, sinks)  # float64 (..., Hq, L)
    out = out * w[..., None].astype(out.dtype)
    with np.errstate(invalid="ignore"):  # -inf rows: -inf + inf, replaced below
        grown = shifted_lse + np.logaddexp(0.0, sinks[:, None] - np.asarray(lse, dtype=np.float64))
    return out, lse_with_sink, np.where(np.isneginf(lse), shifted_lse, grown)


def _heads_per_task(plan: FlashPlan, n_blocks: int, B: int, itemsize: int, threads: int, fused: bool = False) -> int:
    """How many heads a forward task takes side by side: as many (block_q,
    block_k) score tiles as fit the L2 cache together (each call then works on
    all of them, so small tiles along a causal diagonal cost fewer calls), but
    never so many that the threads run out of tasks: two tasks a thread where
    query blocks differ, one where there is a single query block (its tasks are
    alike: two of 4 heads on two threads ran a causal L = 1024 forward 6% faster
    than four of 2), and as many heads in every task as the count allows (6 as
    3 and 3, not 4 and 2). On the fused tiles a band's
    pieces count instead (at most piece_q rows: a causal diagonal's), as their
    loop puts side by side only the heads whose piece fits the L2 cache
    (`_heads_per_call`): a whole tile below the diagonal still runs head by head."""
    Hq = plan.shapes.q_heads
    pieces = fused and plan.band.bounded and plan.mask is None and plan.mask_mod is None  # _fused_tiles' loop
    rows = min(plan.piece_q, plan.block_q) if pieces else plan.block_q
    tile = rows * plan.block_k * itemsize
    heads = max(1, min(Hq, l2_cache_bytes() // max(tile, 1)))
    least = threads if n_blocks == 1 else 2 * threads  # tasks of one query block are all alike
    while threads > 1 and heads > 1 and B * n_blocks * -(-Hq // heads) < least:
        heads = -(-heads // 2)
    heads = -(-Hq // -(-Hq // heads))  # the same number of heads in every task (8 by 4 and 4, not 6 and 2)
    g = plan.shapes.group
    if g > 1:  # GQA: a task's heads share one kv head (no copy of K and V per query head)
        heads = min(heads, g)
        while g % heads:
            heads -= 1
    return heads


def _heads_per_call(heads: int, tile_bytes: int) -> int:
    """How many of a task's heads one fused piece takes side by side: as many as
    fit the L2 cache together (at least one)."""
    return max(1, min(heads, l2_cache_bytes() // max(tile_bytes, 1)))


def _flash_forward(plan: FlashPlan, q, k, v, cd: np.dtype) -> tuple[np.ndarray, ...]:
    """The tiled forward in dtype `cd`: output (B, Hq, L, Ev) in cd, lse, shift
    and lse - shift (B, Hq, L) in float64, B the flattened batch dims."""
    shapes = plan.shapes
    B, Hq, L, S = math.prod(shapes.batch), shapes.q_heads, shapes.L, shapes.S
    Hkv = shapes.kv_heads
    k, v = _flat(k, shapes, Hkv, cd), _flat(v, shapes, Hkv, cd)  # (B, Hkv, S, E), (B, Hkv, S, Ev)
    if plan.ones_in(cd):  # with a ones column each (few query rows, the fused tiles: as they are; FlashPlan)
        ka, va = scratch_arrays([(B, Hkv, S, shapes.E + 1), (B, Hkv, S, shapes.Ev + 1)], cd)
        k, v = _with_ones(k, out=ka), _with_ones(v, out=va)
    inputs = _ForwardInputs(_flat(q, shapes, Hq, cd), k, v)
    out = np.zeros((B, Hq, L, shapes.Ev), dtype=cd)
    lse = np.full((B, Hq, L), -np.inf, dtype=np.float64)
    shift = np.zeros((B, Hq, L), dtype=cd)
    shifted_lse = np.full((B, Hq, L), -np.inf, dtype=np.float64)

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
    threads = useful_threads(plan.num_threads, B * Hq * L * S)
    splits = 1
    if B * Hq * len(blocks) < threads and len(blocks) >= 1:
        widest = max(t[3] - t[2] for t in blocks)
        splits = max(1, min(threads, widest // plan.block_k))

    def task(rows: _Rows) -> None:
        _forward_rows(plan, inputs, rows)

    if splits == 1:
        nh = _heads_per_task(plan, len(blocks), B, cd.itemsize, threads, plan.fused_in(cd))
        tasks = [_Rows(b, h, min(h + nh, Hq), q0, q1, k_start, k_end,
                       out[b, h:h + nh, q0:q1], lse[b, h:h + nh, q0:q1], shift[b, h:h + nh, q0:q1],
                       shifted_lse[b, h:h + nh, q0:q1])
                 for q0, q1, k_start, k_end in blocks for b in range(B) for h in range(0, Hq, nh)]
        run_tasks(tasks, task, threads)
        return out, lse, shift.astype(np.float64), shifted_lse

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
    run_tasks(tasks, task, threads)
    for b, h, q0, q1, o_parts, l_parts in parts:
        merged = merge_attention_states(o_parts[:, 0], l_parts[:, 0])
        out[b, h, q0:q1], lse[b, h, q0:q1] = merged.output, merged.lse
    return out, lse, shift.astype(np.float64), lse.copy()  # shift 0: shifted_lse is lse
