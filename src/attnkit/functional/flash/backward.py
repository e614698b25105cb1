"""The tiled backward, FlashAttention-2's: `flash_attention_backward` rebuilds
each tile's weights from the forward's state and accumulates dV, dK and dQ
tile by tile; a row's dominant key gets its dS from the rest of its row
(`_add_dominant_keys`), so peaked rows cancel as the plain path's do.
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace
from functools import lru_cache
from typing import Callable, NamedTuple

import numpy as np

from attnkit.functional._checks import output_ndim, require_float_tensor, shape_str, sum_to_shape
from attnkit.functional.attention import AttentionGrads
from attnkit.functional.flash.forward import _flash_forward, _shifted_exp_tile, _tile_scores, with_sinks
from attnkit.functional.flash.plan import FlashPlan, _check_block, _check_inputs, _flat, _Tile, _with_ones
from attnkit.functional.flash.state import AttentionState
from attnkit.functional.mods import DifferentiableScoreMod
from attnkit.functional.precision import all_finite, matmul_in_chunks, scores_may_overflow, start_dtype
from attnkit.functional.sinks import AttentionSinkGrads
from attnkit.kernels import flash as compiled
from attnkit.runtime import run_tasks, scratch_arrays, scratch_buffer, scratch_tile, useful_threads

PEAK = 0.75  # a weight above this is its row's dominant key (at most one per row: the weights sum to 1)


class _BackwardInputs(NamedTuple):
    """What every backward task reads (compute-dtype arrays with the batch dims
    flattened), and the per-row record of dominant keys the tasks write."""

    qs: np.ndarray  # (B, Hq, L, E) query * scale
    qa: np.ndarray  # (B, Hq, L, E+1) [query * scale, -shift]: the forward's scores, less its shift
    qs_f: np.ndarray  # (B, Hq, L, E) query * scale * f: dK = dS^T (q * scale)
    k: np.ndarray  # (B, Hkv, S, E)
    ka: np.ndarray  # (B, Hkv, S, E+1) keys with a ones column, as the forward's (or k: FlashPlan.key_ones)
    ks: np.ndarray  # (B, Hkv, S, E+1) [key * scale, 1]: dQ = dS (K * scale), and dS's row sums
    va: np.ndarray  # (B, Hkv, S, Ev+1) values with a ones column
    do_a: np.ndarray  # (B, Hq, L, Ev+1) [dO, -D]
    do_f: np.ndarray  # (B, Hq, L, Ev) dO * f
    lse_hi: np.ndarray  # (B, Hq, L) lse - shift = lse_hi + lse_lo, lse_hi in the compute dtype
    row_f: np.ndarray  # (B, Hq, L) f = exp(-lse_lo), within a few ulps of 1 (-inf rows: 1)
    top: np.ndarray  # (B, Hq, L) intp: each row's dominant key (weight > PEAK), -1 for none
    top_grad: np.ndarray | None  # (B, Hq, L) score_mod's derivative at that key (None: no such mod)
    # The fused tiles (FlashPlan.fused; else None): no ones columns anywhere (qa is qs,
    # ka is k, ks is key * scale, va is v, do_a is dO; f goes into P, so qs_f is qs
    # and do_f is dO), and per row:
    shift: np.ndarray | None = None  # (B, Hq, L) the forward's shift c, as its tiles subtracted it
    d: np.ndarray | None = None  # (B, Hq, L) D = rowsum(dO * O)
    # With sinks: (B, Hq, L) the sum of each row's dS over its keys, exp(s_h - lse) D
    # (0 without: the dominant key's dS is minus the rest of its row)
    row_sums: np.ndarray | None = None


@lru_cache(maxsize=64)
def _ones(n: int, dtype: str) -> np.ndarray:
    """A read-only vector of n ones (shared: row sums as matrix-vector products)."""
    ones = np.ones(n, dtype=dtype)
    ones.flags.writeable = False
    return ones


class _KeyBlock(NamedTuple):
    """A backward task: keys [k0, k1) of kv head h_kv in flattened batch b."""

    b: int
    h_kv: int
    k0: int
    k1: int


def _task_pieces(plan: FlashPlan, k0: int, k1: int) -> tuple[int, int, list]:
    """(q_start, q_end, pieces) of the key block k0..k1: the query rows that can see it and
    the forward's tiles over them (same grid, same cut), as `plan.pieces` gives them."""
    q_start, q_end = plan.grid_q_range(k0, k1)
    bq = plan.block_q
    return q_start, q_end, [piece for qb in range(q_start, q_end, bq)
                            for piece in plan.pieces(qb, min(qb + bq, q_end), k0, k1)]


def _backward_key_block(plan: FlashPlan, inputs: _BackwardInputs, task: _KeyBlock, dq_acc, dk_out, dv_out) -> None:
    """One backward task (see _KeyBlock): accumulate its dK, dV over every query
    head of the group and every query tile that can see the keys, into dk_out
    (k1 - k0, E) and dv_out (k1 - k0, Ev), and add the dQ contributions, with
    the rows' sums of dS in a last column, into this thread's dq_acc
    (B, Hq, L, E + 1). A row's dominant key (weight > PEAK) gets no dS here: it
    is recorded in inputs.top, and `_flash_backward` gives it minus the rest of
    its row's dS once every task has run (see there)."""
    b, h_kv, k0, k1 = task
    do_a, lse_hi, row_f = inputs.do_a, inputs.lse_hi, inputs.row_f
    k, ks, va = inputs.k[b, h_kv], inputs.ks[b, h_kv], inputs.va[b, h_kv]  # (S, E), (S, E+1), (S, Ev+1)
    k3 = inputs.ka[b, h_kv:h_kv + 1]  # (1, S, E+1) or (1, S, E): _tile_scores takes heads
    cd = k.dtype
    E, Ev = k.shape[-1], do_a.shape[-1] - 1
    g = plan.shapes.group
    dk = np.zeros((k1 - k0, E), dtype=cd)
    dv = np.zeros((k1 - k0, Ev), dtype=cd)
    _, _, pieces = _task_pieces(plan, k0, k1)
    for h in range(h_kv * g, (h_kv + 1) * g):
        for q0, q1, c0, c1 in pieces:
            r, n = q1 - q0, c1 - c0
            tile = _Tile(b, h, h + 1, q0, q1, c0, c1)
            skip, blocked, adds = plan.tile_masks(tile, cd)
            if skip:
                continue
            rows, cols_k, mine = slice(q0, q1), slice(c0, c1), slice(c0 - k0, c1 - k0)
            f = row_f[b, h, rows, None]  # (r, 1)
            p3 = scratch_buffer("p", r * n, cd)[: r * n].reshape(1, r, n)  # one head of the forward's tile
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
            _shifted_exp_tile(p, lse_hi[b, h, rows])
            # forward: out = P @ V   ->  dV += P^T dO,  dP = dO V^T
            dv_part = scratch_tile("dv_part", n, Ev, cd)
            np.matmul(p.T, inputs.do_f[b, h, rows], out=dv_part)
            dv[mine] += dv_part
            ds = scratch_tile("ds", r, n, cd)
            np.matmul(do_a[b, h, rows], va[cols_k].T, out=ds)  # dP - D via the [dO, -D] . [V, 1] column
            whole = plan.rows_within(q0, q1, c0, c1)
            if whole is not None:
                # rows held whole by this piece: D = rowsum(P dP) of these very products
                # (see flash_attention_backward); P = p * f here, and ds holds dP - D_O
                a, z = whole
                d_o = -do_a[b, h, q0 + a:q0 + z, Ev].astype(np.float64)  # (w,) D_O, the forward's
                # D - D_O = f sum_j p (dP - D_O) + D_O (f sum_j p - 1) per row, the row
                # terms in float64 (f sum_j p - 1 is a few ulps: float32 would lose it)
                moved = np.add.reduce(p[a:z] * ds[a:z], axis=1, dtype=np.float64)  # pairwise
                moved += d_o * np.add.reduce(p[a:z], axis=1, dtype=np.float64)
                moved *= f[a:z, 0]
                moved -= d_o
                ds[a:z] -= moved.astype(cd)[:, None]  # dP - D with the rows' own D
            # forward: P = softmax(s)  ->  dS = P * (dP - D)   (times f, applied to the rows below)
            # A dominant key's dP - D cancels to the rounding of two dot products (D
            # comes from O, not from this tile): its dS is left out here and made
            # from the rest of its row at the end (see _flash_backward).
            # (Candidates first: a row whose weights in this tile sum to more than PEAK;
            # a product with ones costs a third of a max-reduction over the tile.)
            if compiled.usable(ds, p):
                weight = scratch_buffer("weight", r, cd)[:r]
                compiled._weighted_grad_tile(ds, p, weight)  # dS and the rows' weights in one pass
            else:
                np.multiply(ds, p, out=ds)
                weight = np.matmul(p, _ones(n, cd.str))
            maybe = np.flatnonzero(weight > PEAK)  # f is 1 to a few ulps here
            if maybe.size:
                top = np.argmax(p[maybe], axis=1)
                peak = p[maybe, top] * f[maybe, 0] > PEAK
                maybe, top = maybe[peak], top[peak]
                ds[maybe, top] = 0
                inputs.top[b, h, q0 + maybe] = c0 + top
                if mod_grad is not None:
                    inputs.top_grad[b, h, q0 + maybe] = mod_grad[maybe, top]
            if mod_grad is not None:
                # forward: s = score_mod(q k^T * scale)  ->  chain rule through the mod
                # (the row sums are the softmax's dS, before the mod's derivative)
                sums = np.matmul(ds, _ones(n, cd.str))
                ds *= mod_grad
            # forward: s = (q * scale) k^T  ->  dQ += dS (K * scale), dK += dS^T (q * scale)
            dk_part = scratch_tile("dk_part", n, E, cd)
            np.matmul(ds.T, inputs.qs_f[b, h, rows], out=dk_part)
            dk[mine] += dk_part
            dq_part = scratch_tile("dq_part", r, E + 1, cd)
            if plan.key_ones:
                np.matmul(ds, ks[cols_k], out=dq_part)  # [dS (K * scale), dS 1]: dQ and the row sums of dS
            else:  # a few rows over a wide tile: the long sum in chunks, as the forward's P V
                dq_part[...] = matmul_in_chunks(ds, ks[cols_k])
            if mod_grad is not None:
                dq_part[:, E] = sums
            dq_part *= f
            dq_acc[b, h, rows] += dq_part
    dk_out[...] = dk
    dv_out[...] = dv


def _backward_key_block_fused(plan: FlashPlan, inputs: _BackwardInputs, task: _KeyBlock, dq_acc, dk_out,
                              dv_out) -> None:
    """`_backward_key_block` on the compiled fused tiles (FlashPlan.fused: float32,
    no score_mod): the same tiles, products and dominant keys, every product at the
    head's width, and a tile's element-wise work in two passes: the weights with
    the band's mask and their row sums (`band_exp_tile`, the forward's pass with
    lse - shift as the extra shift), then dS with the dominant key left out and
    dS's row sums (`grad_scores_tile`)."""
    b, h_kv, k0, k1 = task
    dq, dq_sums = dq_acc  # this thread's (B, Hq, L, E) dQ and (B, Hq, L) rows' sums of dS
    k, ks, v = inputs.k[b, h_kv], inputs.ks[b, h_kv], inputs.va[b, h_kv]  # (S, E), (S, E), (S, Ev)
    k3 = inputs.ka[b, h_kv:h_kv + 1]  # (1, S, E): _tile_scores takes heads
    cd = k.dtype
    E, Ev = k.shape[-1], v.shape[-1]
    g, bq = plan.shapes.group, plan.block_q
    dk = np.zeros((k1 - k0, E), dtype=cd)
    dv = np.zeros((k1 - k0, Ev), dtype=cd)
    q_start, q_end, pieces = _task_pieces(plan, k0, k1)
    # every tile's buffers, taken once for the task (a piece is at most bq x (k1 - k0))
    most_r, most_n = min(bq, max(q_end - q_start, 1)), k1 - k0
    p_buf, ds_buf = (scratch_buffer(name, most_r * most_n, cd) for name in ("p", "ds"))
    dv_buf, dk_buf = scratch_buffer("dv_part", most_n * Ev, cd), scratch_buffer("dk_part", most_n * E, cd)
    dq_buf = scratch_buffer("dq_part", most_r * E, cd)
    weight_buf, sums_buf = scratch_buffer("weight", most_r, cd), scratch_buffer("ds_sums", most_r, cd)
    top_buf = scratch_buffer("top", most_r, np.int64)
    for h in range(h_kv * g, (h_kv + 1) * g):
        for q0, q1, c0, c1 in pieces:
            r, n = q1 - q0, c1 - c0
            tile = _Tile(b, h, h + 1, q0, q1, c0, c1)
            skip, blocked, adds = plan.tile_masks(tile, cd, band=False)
            if skip:
                continue
            rows, cols_k, mine = slice(q0, q1), slice(c0, c1), slice(c0 - k0, c1 - k0)
            p3 = p_buf[: r * n].reshape(1, r, n)  # one head of the forward's tile
            _tile_scores(plan, inputs.qa[b, h:h + 1, rows], k3, p3, tile, adds)
            if blocked is not None:
                np.copyto(p3, cd.type(-np.inf), where=blocked)
            p = p3[0]
            # forward: P = exp(s - lse) = exp((s - shift) - hi) * f, f = exp(-lo) per row
            weight = weight_buf[:r]
            compiled._band_exp_tile(p, inputs.shift[b, h, rows], inputs.lse_hi[b, h, rows], inputs.row_f[b, h, rows],
                                   weight, *plan.local_band(q0, c0))
            # forward: out = P @ V   ->  dV += P^T dO,  dP = dO V^T
            dv_part = dv_buf[: n * Ev].reshape(n, Ev)
            np.matmul(p.T, inputs.do_a[b, h, rows], out=dv_part)
            dv[mine] += dv_part
            ds = ds_buf[: r * n].reshape(r, n)
            np.matmul(inputs.do_a[b, h, rows], v[cols_k].T, out=ds)  # dP
            # forward: P = softmax(s)  ->  dS = P * (dP - D); a dominant key's dS left
            # out (see _backward_key_block) and recorded
            top, ds_sums = top_buf[:r], sums_buf[:r]
            d = inputs.d[b, h, rows]
            whole = plan.rows_within(q0, q1, c0, c1)
            if whole is not None:  # rows held whole by this piece: D = rowsum(P dP) of these products
                a, z = whole
                d = d.copy()
                d[a:z] = np.einsum("ij,ij->i", p[a:z], ds[a:z])
            if compiled._grad_scores_tile(ds, p, d, weight, PEAK, top, ds_sums):
                found = np.flatnonzero(top >= 0)
                inputs.top[b, h, q0 + found] = c0 + top[found]
            # forward: s = (q * scale) k^T  ->  dQ += dS (K * scale), dK += dS^T (q * scale)
            dk_part = dk_buf[: n * E].reshape(n, E)
            np.matmul(ds.T, inputs.qs[b, h, rows], out=dk_part)
            dk[mine] += dk_part
            dq_part = dq_buf[: r * E].reshape(r, E)
            np.matmul(ds, ks[cols_k], out=dq_part)
            dq[b, h, rows] += dq_part
            dq_sums[b, h, rows] += ds_sums
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
    is_causal: bool | None = None,
    causal_align: str | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    attn_mask: np.ndarray | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
) -> AttentionGrads | AttentionSinkGrads:
    """Gradients of `flash_attention`, FlashAttention-2 style, tile by tile.

    Takes the forward's inputs, its `output`, the `state` that
    `flash_attention(..., return_lse=True)` returned (its lse and its plan: the
    mask, band, mods, scale and tile grid of the forward, which the backward
    reuses, so the two always cut the same tiles) and grad_output = dLoss/dO of
    shape (..., Hq, L, Ev). With D = rowsum(dO * O) each tile's weights are
    recomputed as P = exp(s - lse) and

        dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D),
        dQ += dS K * scale,   dK += dS^T Q * scale.

    A state of another problem is refused (ValueError naming what differs):
    inputs of other shapes or dtype, an `output` that is not the state's, or
    any of is_causal, causal_align, window, scale, attn_mask, score_mod,
    mask_mod that the caller states (None: not stated) and that differs from
    what the forward was given (the mask and mods by identity).

    Work is spread over (batch, kv head, key block) on num_threads threads
    (default: the forward's); each thread adds its dQ contributions into its own
    (B, Hq, L, E) buffer, summed at the end: extra memory O(threads * L + S),
    never (L, S).

    Rows that one piece of the tile grid holds whole (every key the band allows
    them lies in it: a window, the first rows of a causal mask) take D =
    rowsum(P dP) from that piece's own products instead, as the plain path
    does: their dS errors then cancel over the row as the plain path's, where
    D from O left dK at twice its error on narrow windows (docs/flash.md).

    Peaked rows: D is summed in float64, but dP - D for a row's dominant key
    (weight above 3/4) cancels to the rounding of two different dot products,
    which dQ and dK then multiply by the scaled keys and queries. So that key's
    dS is taken as minus the sum of the row's other dS (a softmax's dS sums to
    0), as accurate as they are: a one-hot row (a single visible key, or scores
    far apart) gets exactly 0, as the plain path and the float64 truth do. The
    backward runs in the dtype the forward ran in (float64 where float32
    could not hold the scores, or the scale is below 2^-16), on the same
    scores; a gradient that overflows float32 on the way makes it run in
    float64 from the forward on: torch's math-backend answer, never NaN.

    A score_mod needs its derivative d score_mod / d score for the chain rule:
    ready-made mods carry it (`.grad`); wrap your own function with
    `mods.ScoreMod(fn, grad)`, where grad=None declares it additive
    (derivative 1, as for ALiBi or any bias that ignores the score).

    Sinks: a state made with `sinks` holds them in its lse, so exp(s - lse)
    rebuilds the sink-scaled weights and D = rowsum(dO * O) is the sink-scaled
    row term; a row's dS then sums to exp(s_h - lse) D over its keys (not 0),
    which the dominant key's dS takes into account, and the sinks get
    dL/ds_h = -sum over batch and rows of exp(s_h - lse) D.

    Returns:
        AttentionGrads(grad_query, grad_key, grad_value) in the inputs' shapes
        and dtype; for a state with sinks, AttentionSinkGrads(grad_query,
        grad_key, grad_value, grad_sinks (Hq,)). Rows with no key allowed give
        zero gradients.
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
    differ = plan.problem.differences(dict(
        is_causal=is_causal, causal_align=causal_align, window=window, scale=scale, attn_mask=attn_mask,
        score_mod=score_mod, mask_mod=mask_mod))
    if differ:
        raise ValueError("expected a state of the problem stated, got the state of a forward with other settings ("
                         + "; ".join(differ) + ")")
    cd, Hq, Hkv = shapes.compute_dtype, shapes.q_heads, shapes.kv_heads
    L, S, E, Ev = shapes.L, shapes.S, shapes.E, shapes.Ev
    out_shape = (*shapes.batch, Hq, L, Ev)
    lse_shape = (*shapes.batch, Hq, L)
    if state.shift is None or state.shifted_lse is None:
        shift, shifted_lse = np.zeros(lse_shape[drop:]), state.lse
    else:
        shift, shifted_lse = state.shift, state.shifted_lse
    for arr, name, want in ((grad_output, "grad_output", out_shape), (output, "output", out_shape),
                            (state.lse, "state.lse", lse_shape), (shift, "state.shift", lse_shape),
                            (shifted_lse, "state.shifted_lse", lse_shape)):
        arr = require_float_tensor(arr, name, 1)
        if arr.shape != want[drop:]:
            raise ValueError(f"expected {name} of shape {shape_str(want[drop:])}, got {shape_str(arr.shape)}")
    if output is not state.output and not np.array_equal(output, state.output, equal_nan=True):
        raise ValueError(
            "expected output to be the output of the forward that made this state "
            f"({plan.problem.describe()}), got a different array: a state of another problem?"
        )

    if plan.score_mod is not None and not isinstance(plan.score_mod, DifferentiableScoreMod):
        raise TypeError(
            "flash_attention_backward needs the derivative of score_mod: wrap it as "
            "attnkit.functional.mods.ScoreMod(fn, grad) (grad=None if the mod only adds a bias)"
        )
    sinks = state.sinks
    if shapes.nothing_to_do:  # an empty result, or no key at all: zero gradients
        zeros = [np.zeros(np.shape(x), dtype=shapes.dtype) for x in (query, key, value)]
        if sinks is None:
            return AttentionGrads(*zeros)
        return AttentionSinkGrads(*zeros, np.zeros(Hq, dtype=shapes.dtype))
    # the sinks' weight in each row, exp(s_h - lse) (lse holds the sink), float64 (B, Hq, L)
    sink_weight = None if sinks is None else np.exp(
        sinks[:, None] - np.asarray(state.lse, dtype=np.float64).reshape(-1, Hq, L))
    wide = np.dtype(np.float64)
    ran_in = state.run_dtype
    if ran_in is None:  # a state that does not say (made by hand): float64 wherever the scores may not fit
        ran_in = start_dtype(cd, plan.scale)
        ran_in = wide if scores_may_overflow(q, k, plan.scale, ran_in) else ran_in
        reuse = ran_in == cd
    else:
        ran_in, reuse = np.dtype(ran_in), True
    grads = None
    if reuse:  # the forward's own scores, in the dtype it ran in
        with np.errstate(over="ignore", invalid="ignore"):
            grads = _flash_backward(plan, q, k, v, grad_output, output, shift, shifted_lse, ran_in, sink_weight)
        if ran_in != wide and not all_finite(*grads[:3]) and all_finite(q, k, v, grad_output, output):
            grads = None
    if grads is None:
        # a gradient beyond float32 on the way: float64 from the forward on (torch's
        # float64 answer). The weights exp(s - lse) are rebuilt from an lse of the
        # same float64 scores, never from float32 ones.
        out64, lse64, shift64, shifted64 = _flash_forward(plan, q, k, v, wide)
        if sinks is not None:
            out64, lse64, shifted64 = with_sinks(out64.reshape(-1, Hq, L, Ev), lse64.reshape(-1, Hq, L),
                                                 shifted64.reshape(-1, Hq, L), sinks)
            sink_weight = np.exp(sinks[:, None] - lse64)
        grads = _flash_backward(plan, q, k, v, grad_output, out64, shift64, shifted64, wide, sink_weight)
    grads, sink_rows = grads[:3], grads[3]
    grads = (
        grads[0].reshape(*shapes.batch, Hq, L, E),
        grads[1].reshape(*shapes.batch, Hkv, S, E),
        grads[2].reshape(*shapes.batch, Hkv, S, Ev),
    )
    # Inputs that were broadcast (smaller rank, a dim of 1) sum their gradient back.
    grads = [sum_to_shape(grad, np.shape(x)).astype(shapes.dtype, copy=False)
             for grad, x in zip(grads, (query, key, value))]
    if sinks is None:
        return AttentionGrads(*grads)
    # forward: the sink's weight exp(s_h - lse)  ->  dL/ds_h = -sum over batch and rows of exp(s_h - lse) D
    return AttentionSinkGrads(*grads, -sink_rows.sum(axis=(0, 2)).astype(shapes.dtype))


def _flash_backward(plan: FlashPlan, q, k, v, grad_output, output, shift, shifted_lse, cd: np.dtype,
                    sink_weight: np.ndarray | None = None):
    """The tiled backward in dtype `cd`: (dQ (B, Hq, L, E), dK (B, Hkv, S, E),
    dV (B, Hkv, S, Ev), sink_rows) in cd, B the flattened batch dims; sink_rows
    (B, Hq, L) float64 is exp(s_h - lse) D, each row's share of the sinks'
    gradient, given sink_weight (B, Hq, L) exp(s_h - lse), else None."""
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
    tasks = [_KeyBlock(b, h, k0, k1) for k0, k1, _ in blocks for b in range(B) for h in range(Hkv)]
    threads = useful_threads(plan.num_threads, 3 * B * Hq * L * S)
    n_dq = max(1, min(threads, len(tasks)))  # at most one dQ buffer per thread that runs tasks

    # the temporaries, from one block (see runtime.scratch_arrays); dQ sums into grad_q itself and n_dq - 1 more buffers
    fused = plan.fused_in(cd)  # the compiled tiles shift, sum and take D: no ones columns
    one = 0 if fused else 1
    ones = E + 1 if plan.ones_in(cd) else 0  # the forward's keys: with a ones column or as they are
    # (fused: per thread a dQ and a dS-sums buffer, contiguous, instead of the E + 1 columns;
    # the first thread's dQ is the result itself, fresh below)
    more = [(B, Hq, L, E), (B, Hq, L)] * (n_dq - 1) + [(B, Hq, L)] if fused else [(B, Hq, L, E + 1)] * (n_dq - 1)
    ks, ka, va, do_a, qa, qs_f, do_f, *dq_more = scratch_arrays(
        [(B, Hkv, S, E + one), (B, Hkv, S, ones), (B, Hkv, S, (Ev + 1) * one), (B, Hq, L, (Ev + 1) * one),
         (B, Hq, L, E + one), (B, Hq, L, E * one), (B, Hq, L, Ev * one)] + more, cd)
    q = _flat(q, shapes, Hq, cd)  # (B, Hq, L, E)
    k = _flat(k, shapes, Hkv, cd)  # (B, Hkv, S, E)
    np.multiply(k, cd.type(plan.scale), out=ks[..., :E])  # (B, Hkv, S, E+1) [key * scale, 1]
    ka = _with_ones(k, out=ka) if plan.ones_in(cd) else k
    d_out = np.ascontiguousarray(grad_output, dtype=cd).reshape(B, Hq, L, Ev)
    o = np.asarray(output, dtype=cd).reshape(B, Hq, L, Ev)
    # D = rowsum(dO * O), summed in float64: rounded once, to the compute dtype
    d = np.einsum("bhle,bhle->bhl", d_out, o, dtype=np.float64)
    sink_rows = None if sink_weight is None else sink_weight * d  # (B, Hq, L): sum_j dS_ij over the keys
    if fused:
        va, do_a, d = _flat(v, shapes, Hkv, cd), d_out, d.astype(cd)  # (B, Hkv, S, Ev), (B, Hq, L, Ev), (B, Hq, L)
    else:
        ks[..., E] = 1
        _with_ones(_flat(v, shapes, Hkv, cd), out=va)  # (B, Hkv, S, Ev+1)
        do_a[..., :Ev] = d_out  # [dO, -D]
        do_a[..., Ev] = -d
        d = None
    # The tiles hold s - shift (the forward's products, bitwise); lse - shift is
    # split into two compute-dtype parts so that the subtraction is
    # float64-accurate (a float32 lse of 40 is off by up to 2e-6):
    # P = exp(s - shift - hi) * f with f = exp(-lo) per row.
    given = np.asarray(shift, dtype=np.float64).reshape(B, Hq, L)
    shift = given.astype(cd).astype(np.float64)  # as qa holds it (a float64 forward's shift, rounded)
    lse64 = np.array(shifted_lse, dtype=np.float64).reshape(B, Hq, L)  # lse - shift, as the forward summed it
    lse64 += given - shift  # 0 unless a float64 forward's shift was rounded to cd
    lse64[np.isneginf(lse64)] = 0  # rows with no key: their tiles are all masked anyway
    lse_hi = lse64.astype(cd)
    row_f = np.exp(-(lse64 - lse_hi).astype(cd))
    qs = qa[..., :E]
    np.multiply(q, cd.type(plan.scale), out=qs)  # (B, Hq, L, E) query * scale
    if fused:  # the kernel subtracts the shift, as the forward's tiles did, and multiplies P by f
        shift = shift.astype(cd)
        qs_f, do_f = qs, d_out
    else:
        qa[..., E] = -shift
        shift = None
        np.multiply(qs, row_f[..., None], out=qs_f)
        np.multiply(d_out, row_f[..., None], out=do_f)
    top = np.full((B, Hq, L), -1, dtype=np.intp)
    with_grad = plan.score_mod is not None and plan.score_mod.grad is not None
    top_grad = np.ones((B, Hq, L), dtype=cd) if with_grad else None
    inputs = _BackwardInputs(qs, qa, qs_f, k, ka, ks, va, do_a, do_f, lse_hi, row_f, top, top_grad, shift, d,
                             None if sink_rows is None else sink_rows.astype(cd))
    block = _backward_key_block_fused if fused else _backward_key_block

    # [dQ, the rows' sums of dS]: one (B, Hq, L, E + 1) array, or on the fused tiles dQ
    # (B, Hq, L, E) and the sums (B, Hq, L) apart
    grad_q = np.zeros((B, Hq, L, E if fused else E + 1), dtype=cd)
    grad_k = np.zeros((B, Hkv, S, E), dtype=cd)
    grad_v = np.zeros((B, Hkv, S, Ev), dtype=cd)
    for buf in dq_more:
        buf.fill(0)
    if fused:
        ds_sums = dq_more[-1]
        free = [*zip(dq_more[:-1:2], dq_more[1:-1:2]), (grad_q, ds_sums)]
    else:
        ds_sums = grad_q[..., E]
        free = [*dq_more, grad_q]  # popped from the end: the first thread sums into grad_q itself
    dq_buffers: dict[int, np.ndarray] = {}
    lock = threading.Lock()

    def run(task: _KeyBlock) -> None:
        ident = threading.get_ident()
        with lock:
            if ident not in dq_buffers:
                dq_buffers[ident] = free.pop()
            dq_acc = dq_buffers[ident]
        b, h_kv, k0, k1 = task
        block(plan, inputs, task, dq_acc, grad_k[b, h_kv, k0:k1], grad_v[b, h_kv, k0:k1])

    run_tasks(tasks, run, threads)
    for buf in dq_buffers.values():
        if fused and buf[0] is not grad_q:
            grad_q += buf[0]
            ds_sums += buf[1]
        elif not fused and buf is not grad_q:
            grad_q += buf
    _add_dominant_keys(inputs, grad_q[..., :E], ds_sums, grad_k, shapes.group)
    return grad_q[..., :E], grad_k, grad_v, sink_rows


def _add_dominant_keys(inputs: _BackwardInputs, grad_q, ds_sums, grad_k, group: int) -> None:
    """The dS of each row's dominant key j, which the tasks left out:

        forward: P = softmax(s)  ->  sum_j dS_ij = 0,  so  dS_ij = -sum_{k != j} dS_ik

    (with sinks the row's keys' dS sum to inputs.row_sums, not 0: dS_ij is that
    less the rest)
    (then times score_mod's derivative there), added to dQ_i (dS_ij k_j * scale)
    and dK_j (dS_ij q_i * scale). grad_q is (B, Hq, L, E); ds_sums (B, Hq, L)
    holds the sum of every other dS of each row. A one-hot row's other weights
    are 0, so its dominant key's dS is exactly 0, not the rounding of dP - D."""
    rows = np.flatnonzero(inputs.top.reshape(-1) >= 0)
    if not rows.size:
        return
    E = grad_k.shape[-1]
    b, h, i = np.unravel_index(rows, inputs.top.shape)
    j = inputs.top.reshape(-1)[rows]
    ds = -ds_sums[b, h, i]  # (n,)
    if inputs.row_sums is not None:
        ds += inputs.row_sums[b, h, i]
    if inputs.top_grad is not None:
        ds *= inputs.top_grad[b, h, i]
    h_kv = h // group
    grad_q[b, h, i] += ds[:, None] * inputs.ks[b, h_kv, j, :E]
    np.add.at(grad_k, (b, h_kv, j), ds[:, None] * inputs.qs[b, h, i])
