"""Context parallelism on torch.distributed: ring attention and Ulysses attention.

Every rank of a process group holds a shard of the sequence, `(..., H, L_local, E)`:

- `ring_attention`: the key/value shards travel around the ring of ranks with
  point-to-point sends (`dist.batch_isend_irecv`); while shard s + 1 is on the
  wire, the rank attends its queries to shard s with attnkit's tiled kernel
  (`attnkit.torch.flash`), and merges the partial outputs exactly through their
  log-sum-exp. The backward is a second ring: key/value shards travel again,
  with the dK/dV accumulators of each shard, which arrive home after W hops.
- `ulysses_attention`: one all-to-all turns sequence shards into head shards
  (each rank then holds every position for H / W heads), attention runs
  locally, a second all-to-all turns the output back.

Layouts (how `shard_sequence` cuts a sequence of L positions over W ranks):
"contiguous" gives rank r the r-th of W chunks; "zigzag" cuts 2W chunks and
gives rank r the chunks r and 2W - 1 - r, so that under a causal mask every
rank has the same work. A length that does not divide is not padded and not
refused: chunks differ by at most one position (the first `L mod n` chunks are
one longer), and every rank checks that its shard is the one the layout gives.

Masks are attnkit's: `causal` top-left, `window=(left, right)` (query p sees
keys p - left .. p + right, None = unbounded; an int w is (w, 0)), one
`attnkit.functional.band.Band` over global positions, `mask_mod(b, h, q_idx, kv_idx)`
(True = may attend) and `score_mod(score, b, h, q_idx, kv_idx)`, all called with
global positions (and global head indices), so they mean what they mean in one
process. score mods must be additive (an `attnkit.functional.mods.ScoreMod`
with `grad=None`, ALiBi for instance, or any plain function that adds to the
score); a row with no visible key gives output 0 and zero gradients.

Every call first all-gathers a few integers per rank (shapes, dtype, flags), so
a rank whose shapes disagree makes every rank raise the same ValueError instead
of hanging. A rank that dies makes its peers' sends and receives fail; give
`dist.init_process_group` a `timeout` so that any rank left waiting raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from attnkit.torch.context_shards import (  # the layouts and the checks; LAYOUTS and the shard functions re-exported
    _DTYPES,
    LAYOUTS,
    _check_inputs,
    _check_layout,
    _Spec,
    gather_sequence,
    shard_bounds,
    shard_sequence,
)
from attnkit.torch.flash import (
    _accumulator_dtype,
    _forward_tiles,
    _lse_parts,
    _outside,
    _scores,
    _Tiling,
    _weights_from_lse,
    _zero_where_neg_inf,
)
from attnkit.torch.ranks import RankOutcome, run_on_ranks  # re-exported: they lived here until 0.2.0

__all__ = [
    "LAYOUTS",
    "ContextParallel",
    "RankOutcome",
    "gather_sequence",
    "ring_attention",
    "run_on_ranks",
    "shard_bounds",
    "shard_sequence",
    "ulysses_attention",
]

METHODS = ("ring", "ulysses")
_BLOCK = 128  # tile size of the kernel inside each (query chunk, key chunk) pair


@dataclass(frozen=True)
class ContextParallel:
    """How a module runs context-parallel: process group (None = the default
    group), layout of the sequence shards, and method ("ring" or "ulysses")."""

    group: object = None
    layout: str = "zigzag"
    method: str = "ring"

    def __post_init__(self) -> None:
        _check_layout(self.layout)
        if self.method not in METHODS:
            raise ValueError(f"expected method to be one of {METHODS}, got {self.method!r}")

    def attention(self, q, k, v, **kwargs):
        fn = ring_attention if self.method == "ring" else ulysses_attention
        return fn(q, k, v, group=self.group, layout=self.layout, **kwargs)


def as_context_parallel(spec) -> ContextParallel:
    """A ContextParallel from a ContextParallel or a process group."""
    if isinstance(spec, ContextParallel):
        return spec
    if isinstance(spec, dist.ProcessGroup):
        return ContextParallel(group=spec)
    raise TypeError(f"expected context_parallel to be a ProcessGroup or ContextParallel, got {type(spec).__name__}")


# ----------------------------------------------------------------------------- one block pair


def _pair(spec: _Spec, q_seg, k_seg, dtype, device, local_heads: int):
    """How the queries of global segment q_seg see the keys of k_seg: None when
    no pair may attend, else (tiling, mask or None). The mask is bool or float,
    shaped (*batch, Hkv, G, lq, lk), evaluated at global positions."""
    (qs, qe), (ks, ke) = q_seg, k_seg
    if spec.band.tile(qs, qe, ks, ke) == "outside":  # (an empty segment too)
        return None
    # the band on the pair's local positions; the kernel skips or masks its tiles
    tiling = _Tiling(spec.band.shifted(qs, ks), _BLOCK, _BLOCK, spec.scale)
    if spec.mask_mod is None and spec.score_mod is None:
        return tiling, None

    q_pos = np.arange(qs, qe)[:, None]  # (lq, 1) global positions
    k_pos = np.arange(ks, ke)[None, :]  # (1, lk)
    B = int(np.prod(spec.batch)) if spec.batch else 1
    lq, lk = qe - qs, ke - ks
    mask = None
    if spec.mask_mod is not None:
        allowed = np.empty((B, local_heads, lq, lk), dtype=bool)
        for b in range(B):
            for h in range(local_heads):
                allowed[b, h] = np.broadcast_to(spec.mask_mod(b, spec.head_offset + h, q_pos, k_pos), (lq, lk))
        mask = torch.from_numpy(allowed).to(device)
    if spec.score_mod is not None:
        np_dtype = np.float64 if dtype == torch.float64 else np.float32
        bias = np.empty((B, local_heads, lq, lk), dtype=np_dtype)
        for b in range(B):
            for h in range(local_heads):
                zeros = np.zeros((lq, lk), dtype=np_dtype)
                bias[b, h] = np.broadcast_to(spec.score_mod(zeros, b, spec.head_offset + h, q_pos, k_pos), (lq, lk))
        bias = torch.from_numpy(bias).to(device=device, dtype=dtype)
        mask = bias if mask is None else bias.masked_fill(~mask, -math.inf)
    G = spec.Hq // spec.Hkv
    mask = mask.reshape(*spec.batch, local_heads // G, G, lq, lk)  # (..., Hkv, G, lq, lk)
    return tiling, mask


def _pair_backward(q, k, v, mask, lse, delta, do, tiling: _Tiling, dq, dk, dv) -> None:
    """FlashAttention-2's backward of one pair with the merged (global) lse and
    D = rowsum(dO * O): q (..., Hkv, G, lq, E) already scaled, k, v (..., Hkv, 1, lk, .).
    Adds into dq (..., Hkv, G, lq, E) and, summed over G, dk and dv (..., Hkv, 1, lk, .).

    (attnkit.torch.flash's backward takes D from the tile for a row that sees a
    single key; here a row's other keys live in other pairs, so D is always the
    global one.)"""
    block_q, block_k, band = tiling.block_q, tiling.block_k, tiling.band
    L, S = q.shape[-2], k.shape[-2]
    lse_hi, lse_lo = _lse_parts(lse, q.dtype)  # the float64 lse as float32 hi + lo
    for j0 in range(0, S, block_k):
        j1 = min(j0 + block_k, S)
        k_tile, v_tile = k[..., j0:j1, :], v[..., j0:j1, :]
        q_start, q_end = band.q_range(j0, j1, L)  # queries outside see none of these keys
        for i0 in range(q_start // block_q * block_q, q_end, block_q):
            i1 = min(i0 + block_q, L)
            if band.tile(i0, i1, j0, j1) == "outside":
                continue
            q_tile = q[..., i0:i1, :]
            mask_tile = None if mask is None else mask[..., i0:i1, j0:j1]
            # in the forward pass this was: p = exp(s - lse)
            s = _scores(q_tile, k_tile, mask_tile, _outside(band, i0, i1, j0, j1, q.device))
            p = _weights_from_lse(s, lse_hi[..., i0:i1], None if lse_lo is None else lse_lo[..., i0:i1])
            do_tile = do[..., i0:i1, :]
            # in the forward pass this was: out = p @ v
            dv[..., j0:j1, :] += torch.matmul(p.transpose(-1, -2), do_tile).sum(dim=-3, keepdim=True)
            dp = torch.matmul(do_tile, v_tile.transpose(-1, -2))
            ds = dp.sub_(delta[..., i0:i1, None]).mul_(p)  # softmax backward: p * (dp - D)
            # in the forward pass this was: s = (q * scale) @ k^T
            dq[..., i0:i1, :] += torch.matmul(ds, k_tile) * tiling.scale
            dk[..., j0:j1, :] += torch.matmul(ds.transpose(-1, -2), q_tile).sum(dim=-3, keepdim=True)


def _merge(out, lse, part_out, part_lse) -> None:
    """out, lse (the running result of some rows) absorb one more partial result, in place."""
    new_lse = torch.logaddexp(lse, part_lse)
    base = _zero_where_neg_inf(new_lse)
    out.mul_(torch.exp(lse - base)[..., None]).add_(part_out * torch.exp(part_lse - base)[..., None])
    lse.copy_(new_lse)


def _seg_slices(segments) -> list[tuple[int, int, tuple[int, int]]]:
    """(local start, local stop, global segment) of each segment of one shard."""
    out, offset = [], 0
    for start, stop in segments:
        out.append((offset, offset + stop - start, (start, stop)))
        offset += stop - start
    return out


def _forward_blocks(q, k, v, out, lse, spec, q_segments, k_segments, local_heads) -> None:
    """Attend every query segment to every key segment of one key/value shard; merge into out, lse."""
    for qa, qz, q_seg in _seg_slices(q_segments):
        for ka, kz, k_seg in _seg_slices(k_segments):
            plan = _pair(spec, q_seg, k_seg, q.dtype, q.device, local_heads)
            if plan is None:
                continue
            tiling, mask = plan
            part_out, part_lse = _forward_tiles(q[..., qa:qz, :], k[..., ka:kz, :], v[..., ka:kz, :], mask, tiling)
            _merge(out[..., qa:qz, :], lse[..., qa:qz], part_out, part_lse)


def _backward_blocks(q, k, v, lse, delta, do, dq, dk, dv, spec, q_segments, k_segments, local_heads) -> None:
    """The gradients of one key/value shard, added into dq, dk and dv."""
    for qa, qz, q_seg in _seg_slices(q_segments):
        for ka, kz, k_seg in _seg_slices(k_segments):
            plan = _pair(spec, q_seg, k_seg, q.dtype, q.device, local_heads)
            if plan is None:
                continue
            tiling, mask = plan
            _pair_backward(q[..., qa:qz, :], k[..., ka:kz, :], v[..., ka:kz, :], mask, lse[..., qa:qz],
                           delta[..., qa:qz], do[..., qa:qz, :], tiling,
                           dq[..., qa:qz, :], dk[..., ka:kz, :], dv[..., ka:kz, :])


def _grouped(q, k, v, Hkv, dtype):
    """q scaled later; (..., Hkv, G, L, E), k and v (..., Hkv, 1, S, .) in the working dtype."""
    q = q.to(dtype).unflatten(-3, (Hkv, q.shape[-3] // Hkv))
    return q, k.to(dtype).unsqueeze(-3), v.to(dtype).unsqueeze(-3)


# ----------------------------------------------------------------------------- the ring


class _Ring:
    """Point-to-point exchange with the ring neighbours: send to rank + 1, receive from rank - 1."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group = group
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next, self.prev = peer((rank + 1) % world), peer((rank - 1) % world)
        self.sent_bytes = 0

    def start(self, sends, recvs, tag: int):
        """Send each tensor of `sends` to rank + 1 and receive `recvs` from rank - 1
        (message i with tag 4 * tag + i); the requests to wait for."""
        ops = []
        for i, (send, recv) in enumerate(zip(sends, recvs)):
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, 4 * tag + i))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, 4 * tag + i))
            self.sent_bytes += send.numel() * send.element_size()
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests) -> None:
        """Wait for the requests (None: nothing to wait for); returns None. A gloo
        request must be waited for once: a second wait on a send never returns."""
        for request in requests or ():
            request.wait()
        return None


def _shard_length(bounds, rank: int) -> int:
    return sum(b - a for a, b in bounds[rank])


def _like(x: torch.Tensor, length: int) -> torch.Tensor:
    """An empty tensor shaped as x with `length` positions (dim -2)."""
    return x.new_empty(x.shape[:-2] + (length, x.shape[-1]))


class _RingAttention(torch.autograd.Function):
    """Ring attention over grouped inputs: q (..., Hkv, G, L, E), k (..., Hkv, 1, L, E),
    v (..., Hkv, 1, L, Ev), all this rank's shard in the working dtype (q not yet scaled).
    Returns out (..., Hkv, G, L, Ev) and lse (..., Hkv, G, L) (no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, group, rank, world, bounds, overlap, stats):
        q = q * spec.scale  # scaled once, before every product (dQ = dS (K * scale) in the backward)
        k, v = k.contiguous(), v.contiguous()  # they travel as they are
        ring = _Ring(group, rank, world)
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_full(q.shape[:-1], -math.inf, dtype=torch.float64)  # float64: see flash._lse_parts
        kv = (k, v)  # the shard in hand: this rank's own first, no copy
        for step in range(world):
            source = (rank - step) % world
            requests = incoming = None
            if step < world - 1:
                length = _shard_length(bounds, (source - 1) % world)
                incoming = (_like(k, length), _like(v, length))
                requests = ring.start(kv, incoming, tag=0)
                if not overlap:
                    requests = ring.wait(requests)  # None: a gloo request is waited for once only
            _forward_blocks(q, kv[0], kv[1], out, lse, spec, bounds[rank], bounds[source], spec.Hq)
            ring.wait(requests)
            kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (spec, group, rank, world, bounds, overlap, stats)
        if stats is not None:
            stats["forward_bytes"] = ring.sent_bytes
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        spec, group, rank, world, bounds, overlap, stats = ctx.args
        ring = _Ring(group, rank, world)
        do = grad_out.to(q.dtype)
        delta = (do.double() * out.double()).sum(dim=-1).to(q.dtype)  # D = rowsum(dO * O), (..., Hkv, G, L)
        dq = torch.zeros_like(q)
        kv = (k, v)
        dkv_requests = dkv_in = None
        for step in range(world):
            source = (rank - step) % world
            kv_requests = incoming = None
            if step < world - 1:
                length = _shard_length(bounds, (source - 1) % world)
                incoming = (_like(k, length), _like(v, length))
                kv_requests = ring.start(kv, incoming, tag=1)
                if not overlap:
                    kv_requests = ring.wait(kv_requests)
            # this rank's share of the shard's dK, dV, while the accumulator is on the wire
            dkv = (torch.zeros_like(kv[0]), torch.zeros_like(kv[1]))
            _backward_blocks(q, kv[0], kv[1], lse, delta, do, dq, dkv[0], dkv[1], spec, bounds[rank],
                             bounds[source], spec.Hq)
            if step > 0:
                dkv_requests = ring.wait(dkv_requests)  # the accumulator, from the ranks before
                dkv[0].add_(dkv_in[0])
                dkv[1].add_(dkv_in[1])
                dkv_in = None  # freed before the next one is allocated
            if world > 1:
                # the accumulator moves on with its shard; rank - 1 hands over the next one
                length = _shard_length(bounds, (source - 1) % world)
                dkv_in = (_like(k, length), _like(v, length))
                dkv_requests = ring.start(dkv, dkv_in, tag=2)
                if not overlap:
                    dkv_requests = ring.wait(dkv_requests)
            else:
                dkv_in = dkv
            ring.wait(kv_requests)
            kv = incoming
        ring.wait(dkv_requests)  # after W hops: this rank's own dK, dV
        if stats is not None:
            stats["backward_bytes"] = ring.sent_bytes
        return dq, dkv_in[0], dkv_in[1], None, None, None, None, None, None, None


def _pack(*tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    layout: str = "zigzag",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: int | tuple | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    overlap: bool = True,
    stats: dict | None = None,
) -> torch.Tensor:
    """Self-attention over a sequence sharded across the ranks of `group`, by ring.

    Arguments:
        q: (..., Hq, L_local, E), this rank's shard of the queries (`shard_sequence`).
        k: (..., Hkv, L_local, E), v: (..., Hkv, L_local, Ev): the same positions' keys and values.
        group: the process group (None: the default group).
        causal: top-left causal over global positions.
        layout: "zigzag" (rank r holds chunks r and 2W-1-r of 2W) or "contiguous".
        scale: score scale, default 1/sqrt(E).
        enable_gqa: allow Hkv dividing Hq; query head h uses key/value head h // (Hq // Hkv).
        window: (left, right): query p sees keys p - left .. p + right (None = unbounded);
            an int w is (w, 0). Checked as attnkit.functional checks it (same errors).
        score_mod: additive score mod `(score, b, h, q_idx, kv_idx) -> score` at global positions.
        mask_mod: `(b, h, q_idx, kv_idx) -> bool` (True = may attend) at global positions.
        overlap: send the next key/value shard while computing on this one (the default);
            False completes each transfer before computing (what the distributed benchmark
            compares against). Same result either way.
        stats: None, or a dict that receives "forward_bytes" (and, after the backward,
            "backward_bytes"): the bytes this rank sent.

    Returns:
        (..., Hq, L_local, Ev) in q's dtype: this rank's rows of the attention output,
        differentiable in q, k and v (the backward is a second ring). Every rank
        must call it with the same arguments; a row with no visible key gives 0.
    """
    rank, world, bounds, _, spec = _check_inputs("ring_attention", q, k, v, group, causal, layout, scale,
                                                 enable_gqa, window, score_mod, mask_mod)
    dtype = _accumulator_dtype(q.dtype)
    qg, kg, vg = _grouped(q, k, v, spec.Hkv, dtype)
    out, _ = _RingAttention.apply(qg, kg, vg, spec, group, rank, world, bounds, overlap, stats)
    return out.flatten(-4, -3).to(q.dtype)  # (..., Hq, L, Ev)


_ring_attention = ring_attention  # the name the benchmark used before overlap= and stats= were public


# ----------------------------------------------------------------------------- Ulysses


class _LocalAttention(torch.autograd.Function):
    """Attention of one rank over whole sequences (Ulysses' middle step): the ring's
    blocks with a single shard, whose segments may come in any order."""

    @staticmethod
    def forward(ctx, q, k, v, spec, segments, local_heads):
        q = q * spec.scale
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_full(q.shape[:-1], -math.inf, dtype=torch.float64)  # float64: see flash._lse_parts
        _forward_blocks(q, k, v, out, lse, spec, segments, segments, local_heads)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (spec, segments, local_heads)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        spec, segments, local_heads = ctx.args
        do = grad_out.to(q.dtype)
        delta = (do.double() * out.double()).sum(dim=-1).to(q.dtype)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        _backward_blocks(q, k, v, lse, delta, do, dq, dk, dv, spec, segments, segments, local_heads)
        return dq, dk, dv, None, None, None


def _all_to_all(x: torch.Tensor, group, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    out = x.new_empty(sum(recv_splits))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def _seq_to_heads(x, group, world, lengths, rank):
    """(..., H, L_rank, E) on each rank -> (..., H / W, sum(lengths), E): rank j gets heads j*H/W.."""
    *batch, H, L, E = x.shape
    heads = H // world
    send = x.unflatten(-3, (world, heads)).movedim(-4, 0)  # (W, ..., H/W, L, E)
    per = math.prod(batch) * heads * E
    flat = _all_to_all(send.reshape(-1), group, [per * L] * world, [per * n for n in lengths])
    pieces = [p.view(*batch, heads, n, E) for p, n in zip(flat.split([per * n for n in lengths]), lengths)]
    return torch.cat(pieces, dim=-2)


def _heads_to_seq(x, group, world, lengths, rank):
    """(..., H / W, sum(lengths), E) -> (..., H, L_rank, E): the inverse of _seq_to_heads."""
    *batch, heads, _, E = x.shape
    per = math.prod(batch) * heads * E
    send = _pack(*x.split(lengths, dim=-2))
    L = lengths[rank]
    flat = _all_to_all(send, group, [per * n for n in lengths], [per * L] * world)
    return flat.view(world, *batch, heads, L, E).movedim(0, -4).flatten(-4, -3)


class _AllToAll(torch.autograd.Function):
    """Sequence shards <-> head shards; the backward is the other direction."""

    @staticmethod
    def forward(ctx, x, to_heads, group, world, lengths, rank):
        ctx.args = (to_heads, group, world, lengths, rank)
        fn = _seq_to_heads if to_heads else _heads_to_seq
        return fn(x, group, world, lengths, rank)

    @staticmethod
    def backward(ctx, grad):
        to_heads, group, world, lengths, rank = ctx.args
        fn = _heads_to_seq if to_heads else _seq_to_heads
        return fn(grad.contiguous(), group, world, lengths, rank), None, None, None, None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    layout: str = "zigzag",
    scale: float | None = None,
    enable_gqa: bool = False,
    window: int | tuple | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
) -> torch.Tensor:
    """Self-attention over a sequence sharded across `group`, by all-to-all over heads
    (DeepSpeed-Ulysses). Arguments and result as `ring_attention`.

    The query heads must divide by the world size (ValueError otherwise); key/value
    heads that do not are repeated to the query heads first (GQA)."""
    rank, world, bounds, total, spec = _check_inputs("ulysses_attention", q, k, v, group, causal, layout, scale,
                                                     enable_gqa, window, score_mod, mask_mod)
    Hq, Hkv = spec.Hq, spec.Hkv
    if Hq % world:
        raise ValueError(f"ulysses_attention splits the heads over the ranks: expected query heads divisible by "
                         f"the world size {world}, got {Hq} heads (use ring_attention)")
    if Hkv % world:
        k = k.repeat_interleave(Hq // Hkv, dim=-3)  # (..., Hq, L, E): every query head its own key head
        v = v.repeat_interleave(Hq // Hkv, dim=-3)
        Hkv = Hq
    lengths = [sum(b - a for a, b in segments) for segments in bounds]
    segments = [segment for r in range(world) for segment in bounds[r]]  # the order of the gathered sequence
    qh, kh, vh = (_AllToAll.apply(x, True, group, world, lengths, rank) for x in (q, k, v))
    local_heads = Hq // world
    local = _Spec(spec.band, spec.mask_mod, spec.score_mod, spec.batch, local_heads,
                  Hkv // world, rank * local_heads, spec.scale)
    dtype = _accumulator_dtype(q.dtype)
    qg, kg, vg = _grouped(qh, kh, vh, local.Hkv, dtype)
    out = _LocalAttention.apply(qg, kg, vg, local, segments, local_heads)
    out = out.flatten(-4, -3).to(q.dtype)  # (..., H / W, L_total, Ev)
    return _AllToAll.apply(out, False, group, world, lengths, rank)
