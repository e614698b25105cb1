"""attnkit's tiled (flash) attention as a torch autograd Function.

The same algorithm as `attnkit.functional.flash`, written in torch operations so
it runs wherever torch runs (CPU, CUDA) and plugs into autograd:

- forward: the keys are visited block by block with an online softmax (running
  row max `m`, running denominator `l`); only `output` and the row log-sum-exp
  `lse = m + log(l)` are kept, never the (L, S) weights;
- backward (FlashAttention-2): `D = rowsum(dO * O)` (summed in float64), then
  for each key block and each query block the scores are recomputed,
  `P = exp(S - lse)`, `dV += P^T dO`, `dP = dO V^T`, `dS = P * (dP - D)`,
  `dQ += dS (K * scale)`, `dK += dS^T (Q * scale)`; a row's dominant key
  (weight above 3/4) takes `dS = -(the sum of the row's other dS)` instead
  (`_add_dominant_keys`), so peaked and one-key rows cancel as the plain path's do.

The scale multiplies q (and, for dQ, k) before each product. Scores beyond the
accumulator dtype, a scale below 2^-16 or a gradient overflowing on the way
make the work run in float64 (attnkit.functional's rule): finite inputs give
torch's math-backend answer in float64, rounded back, never NaN.

Conventions are attnkit's: layout (..., H, L, E); boolean mask True = may
attend, float mask added to the scores; `is_causal` is top-left aligned
(bottom-right with causal_align="bottom_right") and `window` is a sliding
window aligned the same way, both one `attnkit.functional.band.Band`: tiles
outside it are skipped forward and backward, tiles its edge crosses masked; a row
whose keys are all masked gives output 0, lse -inf and zero gradients; GQA
query head h uses key/value head h // (Hq // Hkv).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from attnkit.functional.precision import TINY_SCALE, scores_bound_exceeds
from attnkit.functional.band import Band, check_integer

__all__ = ["FlashAttentionFunction", "FlashOutput", "default_block", "flash_attention"]

PEAK = 0.75  # a weight above this is its row's dominant key (at most one per row: the weights sum to 1)
CANDIDATE = 0.7  # the forward marks rows whose largest weight exceeds this: the backward looks for PEAK there


class FlashOutput(NamedTuple):
    """`flash_attention(..., return_lse=True)`: output (..., Hq, L, Ev), lse (..., Hq, L)."""

    output: torch.Tensor
    lse: torch.Tensor


def default_block(L: int, S: int) -> int:
    """The tile side `flash_attention` uses when none is given. Each tile costs a
    fixed dozen or so torch calls besides its two products: 128 x 128 tiles keep
    short sequences' last tiles small, and from 2048 on 256 x 256 tiles halve the
    calls per row (fwd+bwd against torch SDPA: docs/benchmarks.md; at L=1024 128 stays
    ahead)."""
    return 256 if max(L, S) >= 2048 else 128


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    # float16/bfloat16 accumulate in float32; float32 and float64 stay as they are.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _max_abs(x: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    low, high = torch.aminmax(x.detach())
    return float(torch.maximum(high, -low))  # NaN if x holds one


def _needs_float64(q_scaled: torch.Tensor, key: torch.Tensor, scale: float) -> bool:
    """Whether the tiled kernel runs in float64 instead (attnkit.functional's rule):
    a scale below TINY_SCALE (q * scale would lose digits to subnormals), scores
    beyond the accumulator dtype, or keys times the scale beyond it (dQ = dS (K * scale))."""
    dtype = _accumulator_dtype(q_scaled.dtype)
    if dtype == torch.float64:
        return False
    if 0 < abs(scale) < TINY_SCALE:
        return True
    max_k, largest = _max_abs(key), torch.finfo(dtype).max
    return max_k * abs(scale) > largest / 16 or scores_bound_exceeds(
        _max_abs(q_scaled), max_k, q_scaled.shape[-1], largest
    )


def scores_may_overflow(q_scaled: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether q_scaled @ key^T could leave the accumulator dtype of q_scaled's
    dtype (float32 for half types): attnkit.functional's bound for tensors,
    one reduction over each input (and a device sync). float64 never does here."""
    dtype = _accumulator_dtype(q_scaled.dtype)
    if dtype == torch.float64:
        return False
    return scores_bound_exceeds(_max_abs(q_scaled), _max_abs(key), q_scaled.shape[-1], torch.finfo(dtype).max)


@lru_cache(maxsize=256)
def _band_outside(lo: int | None, hi: int | None, rows: int, cols: int, device: str) -> torch.Tensor:
    """(rows, cols) booleans, True where a tile's pair (i, j) lies outside lo <= j - i <= hi
    (the band relative to the tile's corner); cached: a band's edge tiles repeat (read only)."""
    return torch.from_numpy(~Band(lo, hi).dense(rows, cols)).to(device)


def _outside(band: Band, i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor | None:
    """The band's (bq, bk) exclusions for tile (queries [i0, i1), keys [j0, j1)), or None
    when the tile lies inside it (every pair allowed)."""
    if band.tile(i0, i1, j0, j1) == "inside":
        return None
    local = band.shifted(i0, j0)
    return _band_outside(local.lo, local.hi, i1 - i0, j1 - j0, str(device))


def _scores(q_tile, k_tile, mask_tile, outside, softcap=None, cap_grad=None):
    """Scores of one (query block, key block) tile, masked: (..., G, bq, bk).

    q_tile is already multiplied by the scale; outside (bq, bk), or None, is
    True where the band excludes a pair (`_outside`). Returns a new tensor
    (the callers overwrite it in place). With `softcap`, the scores are
    softcap * tanh(scores / softcap) before the mask (Gemma 2's logit
    softcapping); `cap_grad`, a list, then receives d(capped)/d(raw) =
    1 - tanh^2 for the backward."""
    s = torch.matmul(q_tile, k_tile.transpose(-1, -2))  # (..., G, bq, bk)
    if softcap is not None:
        s.div_(softcap).tanh_()
        if cap_grad is not None:
            cap_grad.append(1 - s * s)  # in the forward pass this was: s = softcap * tanh(s / softcap)
        s.mul_(softcap)
    if mask_tile is not None:
        if mask_tile.dtype == torch.bool:
            s.masked_fill_(~mask_tile, -math.inf)
        else:
            s.add_(mask_tile)
    if outside is not None:
        s.masked_fill_(outside, -math.inf)  # the band: kv - q outside [lo, hi]
    return s


def _zero_where_neg_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x == -math.inf, torch.zeros_like(x), x)


def _lse_parts(lse: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float64 row lse (..., L) as hi + lo in `dtype`, so that the backward's
    exp((s - hi) - lo) keeps what float32 would round away: rounded to float32, an
    lse near 1e3 is off by up to 3e-5, and so would be the largest weight of its row.
    Rows with no key (lse -inf) give 0 + 0 (their scores are -inf: P = 0)."""
    base = _zero_where_neg_inf(lse)
    hi = base.to(dtype)
    if lse.dtype == dtype:
        return hi, None
    return hi, (base - hi.to(base.dtype)).to(dtype)


def _weights_from_lse(s: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor | None) -> torch.Tensor:
    """P = exp(s - lse) for a tile of scores s (..., bq, bk), in s's memory; hi, lo (..., bq)."""
    s.sub_(hi[..., None])
    if lo is not None:
        s.sub_(lo[..., None])
    return s.exp_()


class _Tiling(NamedTuple):
    """How one call is cut and masked: the band (causal, window), tile sizes, scale."""

    band: Band
    block_q: int
    block_k: int
    scale: float
    softcap: float | None = None
    dropout: float = 0.0  # probability of dropping a weight; the tile's keep mask comes from `seed`
    seed: int = 0


def _kept(tiling: _Tiling, i0: int, j0: int, like: torch.Tensor) -> torch.Tensor:
    """Dropout's scaled keep mask of tile (i0, j0): 0 (dropped) or 1 / (1 - dropout),
    drawn from a generator seeded by (seed, i0, j0), so the backward draws it again."""
    generator = torch.Generator(device=like.device)
    generator.manual_seed(hash((tiling.seed, i0, j0)) & (2**62 - 1))
    keep = torch.rand(like.shape, generator=generator, device=like.device) >= tiling.dropout
    return keep.to(like.dtype).mul_(1.0 / (1.0 - tiling.dropout))


def _all_finite(*tensors) -> bool:
    """Whether no tensor holds an inf or a NaN (None counts as finite)."""
    return all(bool(torch.isfinite(x).all()) for x in tensors if x is not None)


def _forward_tiles(q, k, v, mask, tiling: _Tiling, peaked: torch.Tensor | None = None):
    """The online-softmax forward in q's dtype; q already scaled. Returns output
    (..., Hkv, G, L, Ev) and lse (..., Hkv, G, L). `peaked`, a boolean tensor
    (..., Hkv, G, L) if given, receives which rows may have a dominant key (their
    largest weight, 1 / l, above CANDIDATE): the backward looks for one only there."""
    block_q, block_k, band = tiling.block_q, tiling.block_k, tiling.band
    L, S = q.shape[-2], k.shape[-2]
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))  # (..., Hkv, G, L, Ev)
    # (..., Hkv, G, L) in float64: m + log(l) rounded to float32 would cost the backward's
    # weights up to half an ulp of |lse| (see _lse_parts)
    lse = q.new_full(q.shape[:-1], -math.inf, dtype=torch.float64)

    for i0 in range(0, L, block_q):
        i1 = min(i0 + block_q, L)
        q_tile = q[..., i0:i1, :]  # (..., G, bq, E)
        m = q.new_full(q_tile.shape[:-1], -math.inf)  # running row max (..., G, bq)
        l = q.new_zeros(q_tile.shape[:-1])  # running denominator
        acc = q.new_zeros(q_tile.shape[:-1] + (v.shape[-1],))  # (..., G, bq, Ev)
        k_start, k_end = band.kv_range(i0, i1, S)  # keys outside are masked for every row
        for j0 in range(k_start // block_k * block_k, k_end, block_k):
            # whole tiles of the block_k grid, the backward's: it rebuilds bitwise these
            # scores, so a row with one key gets exp(s - lse) = 1 exactly there
            j1 = min(j0 + block_k, S)
            if band.tile(i0, i1, j0, j1) == "outside":
                continue
            mask_tile = None if mask is None else mask[..., i0:i1, j0:j1]
            s = _scores(q_tile, k[..., j0:j1, :], mask_tile, _outside(band, i0, i1, j0, j1, q.device),
                        tiling.softcap)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_base = _zero_where_neg_inf(m_new)  # rows with no key yet: exp(-inf - 0) = 0
            p = s.sub_(m_base[..., None]).exp_()  # (..., G, bq, bk), in the scores' memory
            alpha = torch.exp(m - m_base)  # rescales what was accumulated so far
            l.mul_(alpha).add_(p.sum(dim=-1))
            if tiling.dropout:
                p.mul_(_kept(tiling, i0, j0, p))  # dropout on the weights: the denominator l is undropped
            acc.mul_(alpha[..., None]).add_(torch.matmul(p, v[..., j0:j1, :]))
            m = m_new
        seen = l > 0
        if peaked is not None:
            peaked[..., i0:i1] = seen & (l < 1 / CANDIDATE)  # the row max's weight exp(m - lse) is 1 / l
        out[..., i0:i1, :] = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
        lse[..., i0:i1] = torch.where(seen, m.double() + torch.log(torch.where(seen, l, 1.0).double()), -math.inf)
    return out, lse


def _backward_tiles(q, k, v, mask, out, lse, do, tiling: _Tiling, want_mask_grad: bool, peaked=None,
                    sink_weight=None):
    """FlashAttention-2's backward in q's dtype; q already scaled. Returns dq, dk
    and dv (key/value summed over the G query heads that share them) and the
    gradient of a float mask (..., Hkv, G, L, S) when asked for, else None.
    `peaked` (..., Hkv, G, L), from the forward, says which rows may have a
    dominant key (None: look in every row); see `_add_dominant_keys`. With sinks,
    lse and out hold them and sink_weight (..., Hkv, G, L) float64 is each row's
    sink weight exp(s_h - lse): a row's dS then sums to sink_weight * D over its
    keys, not 0. Returns also that sum (None without sinks)."""
    block_q, block_k, band = tiling.block_q, tiling.block_k, tiling.band
    L, S = q.shape[-2], k.shape[-2]
    # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: the softmax backward's row term,
    # summed in float64 and rounded once.
    delta64 = (do.double() * out.double()).sum(dim=-1)  # (..., Hkv, G, L)
    delta = delta64.to(q.dtype)
    row_sums = None if sink_weight is None else sink_weight * delta64  # sum_j dS_ij with sinks
    lse_hi, lse_lo = _lse_parts(lse, q.dtype)  # (..., Hkv, G, L); fully masked rows: scores -inf, P = 0
    k_scaled = k * tiling.scale  # dQ = dS (K * scale): no product of two small numbers underflows first
    dq = torch.zeros_like(q)
    dk = torch.zeros(q.shape[:-3] + (q.shape[-3],) + k.shape[-2:], dtype=q.dtype, device=q.device)
    dv = torch.zeros(q.shape[:-3] + (q.shape[-3],) + v.shape[-2:], dtype=q.dtype, device=q.device)
    dmask = q.new_zeros(q.shape[:-1] + (S,)) if want_mask_grad else None  # (..., Hkv, G, L, S)
    # dominant keys: each row's key of weight above PEAK (-1: none), the sum of the
    # row's other dS, and the softcap's derivative at that key
    top = torch.full(q.shape[:-1], -1, dtype=torch.long, device=q.device)  # (..., Hkv, G, L)
    ds_rest = q.new_zeros(q.shape[:-1])
    top_cap = q.new_ones(q.shape[:-1]) if tiling.softcap is not None else None
    if peaked is None:
        candidate = np.ones(L, dtype=bool)
    else:  # which query rows may hold one in some batch or head (one reduction, one sync)
        candidate = peaked.reshape(-1, L).any(dim=0).cpu().numpy() if peaked.numel() else np.zeros(L, dtype=bool)

    for j0 in range(0, S, block_k):
        j1 = min(j0 + block_k, S)
        k_tile = k[..., j0:j1, :]  # (..., 1, bk, E)
        v_tile = v[..., j0:j1, :]  # (..., 1, bk, Ev)
        dk_tile = torch.zeros(dk.shape[:-2] + k_tile.shape[-2:], dtype=q.dtype, device=q.device)
        dv_tile = torch.zeros(dv.shape[:-2] + v_tile.shape[-2:], dtype=q.dtype, device=q.device)
        q_start, q_end = band.q_range(j0, j1, L)  # queries outside see none of these keys
        for i0 in range(q_start // block_q * block_q, q_end, block_q):
            i1 = min(i0 + block_q, L)
            if band.tile(i0, i1, j0, j1) == "outside":  # as the forward skipped it
                continue
            q_tile = q[..., i0:i1, :]
            mask_tile = None if mask is None else mask[..., i0:i1, j0:j1]
            # in the forward pass this was: p = exp(s - m) / l, with lse = m + log(l)
            cap_grad = [] if tiling.softcap is not None else None
            s = _scores(q_tile, k_tile, mask_tile, _outside(band, i0, i1, j0, j1, q.device), tiling.softcap,
                        cap_grad)
            p = _weights_from_lse(s, lse_hi[..., i0:i1], None if lse_lo is None else lse_lo[..., i0:i1])
            do_tile = do[..., i0:i1, :]  # p: (..., G, bq, bk)
            # in the forward pass this was: out = p @ v
            kept = _kept(tiling, i0, j0, p) if tiling.dropout else None
            # in the forward pass this was: out = (p * kept) @ v
            dv_tile += torch.matmul(p.transpose(-1, -2) if kept is None else (p * kept).transpose(-1, -2), do_tile)
            dp = torch.matmul(do_tile, v_tile.transpose(-1, -2))
            if kept is not None:
                dp.mul_(kept)  # the gradient of the undropped weights; D = rowsum(dO * O) matches it
            # softmax backward: ds = p * (dp - rowsum(p * dp)), and rowsum(p * dp) = D
            dp.sub_(delta[..., i0:i1, None])
            ds = dp.mul_(p)
            if candidate[i0:i1].any():
                # A dominant key's dP - D cancels only to the rounding of two dot products
                # (D comes from O, not from this tile): its dS is left out here and made
                # from the rest of its row at the end (_add_dominant_keys).
                j = p.argmax(dim=-1, keepdim=True)  # (..., G, bq, 1)
                peak = p.gather(-1, j) > PEAK  # at most one weight of a row exceeds 3/4
                ds.scatter_(-1, j, ds.gather(-1, j).masked_fill_(peak, 0))
                peak, j = peak[..., 0], j[..., 0]
                top[..., i0:i1] = torch.where(peak, j + j0, top[..., i0:i1])
                if cap_grad:
                    top_cap[..., i0:i1] = torch.where(peak, cap_grad[0].gather(-1, j[..., None])[..., 0],
                                                      top_cap[..., i0:i1])
                ds_rest[..., i0:i1] += ds.sum(dim=-1)
            if dmask is not None:
                dmask[..., i0:i1, j0:j1] = ds
            if cap_grad:
                ds.mul_(cap_grad[0])  # through the softcap (the mask was added after it)
            # in the forward pass this was: s = (q * scale) @ k^T; q here is already scaled
            dq[..., i0:i1, :] += torch.matmul(ds, k_scaled[..., j0:j1, :])  # scaled before the product
            dk_tile += torch.matmul(ds.transpose(-1, -2), q_tile)
        dk[..., j0:j1, :] = dk_tile
        dv[..., j0:j1, :] = dv_tile

    if row_sums is not None:  # the dominant key's dS is the row's sum less the rest
        ds_rest -= row_sums.to(q.dtype)
    _add_dominant_keys(q, k_scaled, top, ds_rest, top_cap, dq, dk, dmask)
    # key/value were broadcast over the G query heads that share them: sum back.
    return dq, dk.sum(dim=-3, keepdim=True), dv.sum(dim=-3, keepdim=True), dmask, row_sums


def _add_dominant_keys(q, k_scaled, top, ds_rest, top_cap, dq, dk, dmask) -> None:
    """The dS of each row's dominant key j, which the tiles left out:

        forward: P = softmax(s)  ->  sum_j dS_ij = 0,  so  dS_ij = -sum_{k != j} dS_ik

    (the other entries are small, P_ik <= 1/4, and do not cancel), then through
    the softcap's derivative at that key, added to dQ_i (dS_ij k_j * scale) and
    dK_j (dS_ij q_i * scale; dk still per query head), and written into the
    mask's gradient. A one-hot row (a single visible key, or scores far apart)
    has its other weights exactly 0, so its dominant key's dS is exactly 0, as
    the plain path and the float64 truth give, not the rounding of dP - D.
    top (..., Hkv, G, L): the key, -1 for none; ds_rest: the sum of the others."""
    rows = torch.nonzero(top >= 0, as_tuple=True)  # (*batch, h, g, i), each (n,)
    if not rows[0].numel():
        return
    j = top[rows]
    ds = -ds_rest[rows]  # (n,)
    if dmask is not None:
        dmask[rows + (j,)] = ds
    if top_cap is not None:
        ds = ds * top_cap[rows]  # forward: s = softcap * tanh(s / softcap)
    kv = rows[:-2] + (torch.zeros_like(j), j)  # (*batch, h, 0, j): k_scaled (..., Hkv, 1, S, E)
    dq.index_put_(rows, ds[:, None] * k_scaled[kv], accumulate=True)
    dk.index_put_(rows[:-1] + (j,), ds[:, None] * q[rows], accumulate=True)


class FlashAttentionFunction(torch.autograd.Function):
    """Tiled attention with a recomputing backward.

    Called through `flash_attention`, which checks the arguments. Inputs here are
    already grouped for GQA: query (..., Hkv, G, L, E), key (..., Hkv, 1, S, E),
    value (..., Hkv, 1, S, Ev), mask None or broadcastable to (..., Hkv, G, L, S),
    band the `Band` (causal, window) on kv - q whose outside tiles are skipped.
    Returns output (..., Hkv, G, L, Ev) and lse (..., Hkv, G, L); lse carries no
    gradient. The scale multiplies the query before the product; where float32
    cannot hold the scores (or a tiny scale would cost q * scale its digits, or a
    gradient overflows on the way) the work runs in float64: torch's math
    backend's float64 answer, rounded to the input dtype.
    """

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, band, scale, block_q, block_k, softcap=None, dropout=0.0, seed=0,
                sinks=None):
        tiling = _Tiling(band, block_q, block_k, scale, softcap, dropout, seed)
        acc_dtype = _accumulator_dtype(query.dtype)
        q = query.to(acc_dtype) * scale  # scaled once, before the product: every tile's scores are q k^T
        wide = _needs_float64(q, key, scale)
        if wide:
            q = query.double() * scale
        k, v, mask = _as_dtype(q.dtype, key, value, attn_mask)
        peaked = torch.zeros(q.shape[:-1], dtype=torch.bool, device=q.device)  # (..., Hkv, G, L)
        out, lse = _forward_tiles(q, k, v, mask, tiling, peaked)
        if not wide and q.dtype != torch.float64 and not _all_finite(out) and _all_finite(query, key, value):
            # a running sum of values near float32's largest: float64 instead
            q = query.double() * scale
            k, v, mask = _as_dtype(q.dtype, key, value, attn_mask)
            out, lse = _forward_tiles(q, k, v, mask, tiling, peaked)
        if sinks is not None:
            out, lse = _with_sinks(out, lse, sinks)

        ctx.save_for_backward(q, k, v, mask, out, lse, peaked, sinks)
        ctx.attn_mask_dtype = None if attn_mask is None else attn_mask.dtype
        ctx.tiling = tiling
        ctx.input_dtypes = (query.dtype, key.dtype, value.dtype)
        ctx.mark_non_differentiable(lse)
        return out.to(query.dtype), lse.to(acc_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output, grad_lse):
        q, k, v, mask, out, lse, peaked, sinks = ctx.saved_tensors
        want_mask_grad = ctx.needs_input_grad[3]
        do = grad_output.to(q.dtype)  # (..., Hkv, G, L, Ev)
        weight = None if sinks is None else torch.exp(sinks.double() - lse)  # the sink's, (..., L)
        dq, dk, dv, dmask, row_sums = _backward_tiles(q, k, v, mask, out, lse, do, ctx.tiling, want_mask_grad,
                                                      peaked, weight)
        if q.dtype != torch.float64 and not _all_finite(dq, dk, dv) and _all_finite(q, k, v, do, out):
            # a gradient beyond float32 on the way (dP = dO V^T, say): float64 from the
            # forward on, so that exp(s - lse) sees the scores lse came from
            q, k, v, mask, do = (None if x is None else x.double() if x.is_floating_point() else x
                                 for x in (q, k, v, mask, do))
            out, lse = _forward_tiles(q, k, v, mask, ctx.tiling, peaked)
            if sinks is not None:
                out, lse = _with_sinks(out, lse, sinks)
                weight = torch.exp(sinks.double() - lse)
            dq, dk, dv, dmask, row_sums = _backward_tiles(q, k, v, mask, out, lse, do, ctx.tiling, want_mask_grad,
                                                          peaked, weight)
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[11]:
            # forward: the sink's weight exp(s_h - lse) -> dL/ds_h = -sum over batch and rows of it times D
            grad_sinks = -row_sums.sum(dim=-1)  # (..., Hkv, G)
            grad_sinks = grad_sinks.reshape(-1, *sinks.shape[:-1]).sum(dim=0).reshape(sinks.shape).to(sinks.dtype)
        q_dtype, k_dtype, v_dtype = ctx.input_dtypes
        grad_mask = None
        if dmask is not None:
            # the mask arrives expanded to (..., Hkv, G, L, S); autograd sums the
            # gradient back to the caller's broadcast shape.
            grad_mask = dmask.to(ctx.attn_mask_dtype)
        return (dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), grad_mask,
                None, None, None, None, None, None, None, grad_sinks)


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse'): the sinks (Hkv, G, 1) joined to each row's denominator, as
    `attnkit.functional.sinks` writes it: lse' = logaddexp(lse, s_h) (float64) and
    out' = out * exp(lse - lse'); a row with no key (lse -inf) keeps output 0."""
    with_sink = torch.logaddexp(lse, sinks.double())  # (..., Hkv, G, L)
    w = torch.exp(lse - with_sink)  # 0 on a row with no key
    return out * w.to(out.dtype)[..., None], with_sink


def _as_dtype(dtype, key, value, mask):
    """key, value and a float mask in the working dtype (a boolean mask as it is)."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    return key.to(dtype), value.to(dtype), mask


def _check_tensor(name: str, x, ndim_min: int = 3) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < ndim_min:
        raise ValueError(f"expected {name} of shape (..., H, L, E) with at least 3 dims, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"expected {name} to be a floating-point tensor, got {x.dtype}")


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: int | tuple[int | None, int | None] | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | FlashOutput:
    """Tiled attention in O(L + S) extra memory, differentiable (recomputing backward).

    Arguments:
        query: (..., Hq, L, E).
        key: (..., Hkv, S, E), same leading dims as query; Hkv == Hq unless enable_gqa.
        value: (..., Hkv, S, Ev).
        attn_mask: None, bool (True = may attend) or float (added to the scores),
            broadcastable to (..., Hq, L, S). A float mask may require grad.
        is_causal: causal mask, combined with attn_mask when both are given.
        causal_align: "top_left" (torch's is_causal: query i sees keys j <= i) or
            "bottom_right" (query i sees keys j <= i + S - L, what a KV cache needs).
            Also aligns `window`.
        window: sliding window, as `attnkit.flash_attention`'s: an int `left` or a pair
            (left, right), None = unbounded; query i sees keys i - left .. i + right
            (aligned), combined with is_causal and attn_mask. Tiles outside are skipped.
        scale: score scale, default 1/sqrt(E).
        enable_gqa: allow Hkv dividing Hq; query head h uses key/value head h // (Hq // Hkv).
        block_q, block_k: tile sizes along L and S (default: `default_block(L, S)`,
            128, or 256 once a side reaches 2048).
        return_lse: also return the row log-sum-exp (..., Hq, L) (natural log, -inf for
            fully masked rows).
        softcap: logit softcapping (Gemma 2): scores -> softcap * tanh(scores / softcap),
            applied before the mask; None (the default) leaves the scores as they are.
        dropout_p: dropout on the attention weights (as SDPA's): each is dropped with this
            probability and the rest scaled by 1 / (1 - dropout_p); the masks are drawn
            from a seed taken from torch's default generator (torch.manual_seed repeats
            them) and drawn again, tile by tile, in the backward. lse stays undropped.
        sinks: (Hq,) floating tensor, learned attention sinks (gpt-oss): head h's
            logit s_h joins every row's softmax denominator and takes no value
            (`attnkit.functional.sinks`); differentiable. lse then includes it, and
            a row with no key gives output 0.

    Returns:
        output (..., Hq, L, Ev) in the input dtype, or FlashOutput(output, lse).
        A row whose keys are all masked gives output 0 and zero gradients.
    """
    _check_tensor("query", query)
    _check_tensor("key", key)
    _check_tensor("value", value)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"expected query, key, value of one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    *batch, num_heads, L, E = query.shape
    if key.shape[:-3] != tuple(batch) or value.shape[:-3] != tuple(batch):
        raise ValueError(
            f"expected key and value with leading dims {tuple(batch)} like query, "
            f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    num_kv_heads, S = key.shape[-3], key.shape[-2]
    if key.shape[-1] != E:
        raise ValueError(f"expected key of shape (..., H, S, E) with E={E} like query, got {tuple(key.shape)}")
    if value.shape[-3:-1] != (num_kv_heads, S):
        raise ValueError(
            f"expected value of shape (..., {num_kv_heads}, {S}, Ev) like key, got {tuple(value.shape)}"
        )
    if num_kv_heads != num_heads and num_kv_heads != 0:  # no key/value head: no key, below
        if not enable_gqa:
            raise ValueError(
                f"query has {num_heads} heads but key/value have {num_kv_heads}; pass enable_gqa=True for GQA"
            )
        if num_heads % num_kv_heads:
            raise ValueError(f"GQA needs key/value heads dividing query heads, got Hq={num_heads}, Hkv={num_kv_heads}")
    band = Band.from_options(is_causal=is_causal, causal_align=causal_align, window=window, L=L, S=S)
    block_q = check_integer(default_block(L, S) if block_q is None else block_q, "block_q", minimum=1)
    block_k = check_integer(default_block(L, S) if block_k is None else block_k, "block_k", minimum=1)
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    if num_kv_heads == 0:
        # No key/value head means no key: as torch does, every query attends to
        # nothing and gets 0. Run it as S = 0 keys shared by every query head.
        key = key.reshape(*batch, num_heads, 0, E)
        value = value.reshape(*batch, num_heads, 0, value.shape[-1])
        num_kv_heads = num_heads
    groups = num_heads // num_kv_heads if num_kv_heads else 1
    if softcap is not None and not (isinstance(softcap, (int, float)) and 0 < softcap < math.inf):
        raise ValueError(f"expected softcap to be None or a positive finite number, got {softcap!r}")
    if not (isinstance(dropout_p, (int, float)) and 0 <= dropout_p < 1):
        raise ValueError(f"expected dropout_p in [0, 1), got {dropout_p!r}")
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
    grouped_sinks = None
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            got = type(sinks).__name__ if not isinstance(sinks, torch.Tensor) else f"a tensor of {sinks.dtype}"
            raise TypeError(f"expected sinks to be a floating-point torch.Tensor of shape ({num_heads},), got {got}")
        if tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"expected sinks of shape ({num_heads},), one logit per query head, "
                             f"got {tuple(sinks.shape)}")
        grouped_sinks = sinks.reshape(num_kv_heads, groups, 1)  # (Hkv, G, 1): broadcasts over (..., Hkv, G, L)

    grouped_mask = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"expected attn_mask to be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"expected attn_mask of dtype bool or floating point, got {attn_mask.dtype}")
        full = (*batch, num_heads, L, S)
        try:
            torch.broadcast_shapes(attn_mask.shape, full)
            expanded = attn_mask.expand(full)
        except RuntimeError:
            raise ValueError(
                f"expected attn_mask broadcastable to (..., Hq, L, S) = {full}, got {tuple(attn_mask.shape)}"
            ) from None
        expanded = expanded[..., : key.shape[-2]]  # no column left when there is no key/value head
        grouped_mask = expanded.unflatten(-3, (num_kv_heads, groups))  # (..., Hkv, G, L, S)

    q = query.unflatten(-3, (num_kv_heads, groups))  # (..., Hkv, G, L, E)
    k = key.unsqueeze(-3)  # (..., Hkv, 1, S, E)
    v = value.unsqueeze(-3)  # (..., Hkv, 1, S, Ev)
    out, lse = FlashAttentionFunction.apply(
        q, k, v, grouped_mask, band, float(scale), block_q, block_k,
        None if softcap is None else float(softcap), float(dropout_p), seed, grouped_sinks,
    )
    out = out.flatten(-4, -3)  # (..., Hq, L, Ev)
    if return_lse:
        return FlashOutput(out, lse.flatten(-3, -2))
    return out
