"""attnkit's tiled (flash) attention as a torch autograd Function.

The same algorithm as `attnkit.functional.flash`, written in torch operations so
it runs wherever torch runs (CPU, CUDA) and plugs into autograd:

- forward: the keys are visited block by block with an online softmax (running
  row max `m`, running denominator `l`); only `output` and the row log-sum-exp
  `lse = m + log(l)` are kept, never the (L, S) weights;
- backward (FlashAttention-2): `D = rowsum(dO * O)`, then for each key block and
  each query block the scores are recomputed, `P = exp(S - lse)`,
  `dV += P^T dO`, `dP = dO V^T`, `dS = P * (dP - D)`, `dQ += dS K * scale`,
  `dK += dS^T Q * scale`.

Conventions are attnkit's: layout (..., H, L, E); boolean mask True = may
attend, float mask added to the scores; `is_causal` is top-left aligned
(bottom-right with causal_align="bottom_right"); a row
whose keys are all masked gives output 0, lse -inf and zero gradients; GQA
query head h uses key/value head h // (Hq // Hkv).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["FlashAttentionFunction", "FlashOutput", "flash_attention"]


class FlashOutput(NamedTuple):
    """`flash_attention(..., return_lse=True)`: output (..., Hq, L, Ev), lse (..., Hq, L)."""

    output: torch.Tensor
    lse: torch.Tensor


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    # float16/bfloat16 accumulate in float32; float32 and float64 stay as they are.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _scores(q_tile, k_tile, mask_tile, causal_rows, causal_cols):
    """Scores of one (query block, key block) tile, masked: (..., G, bq, bk).

    q_tile is already multiplied by the scale; causal_rows are the query
    positions already shifted by the alignment offset. Returns a new tensor
    (the callers overwrite it in place)."""
    s = torch.matmul(q_tile, k_tile.transpose(-1, -2))  # (..., G, bq, bk)
    if mask_tile is not None:
        if mask_tile.dtype == torch.bool:
            s.masked_fill_(~mask_tile, -math.inf)
        else:
            s.add_(mask_tile)
    if causal_rows is not None:
        # causal: query i may attend key j only when j <= i + offset
        above = causal_cols[None, :] > causal_rows[:, None]  # (bq, bk)
        s.masked_fill_(above, -math.inf)
    return s


def _zero_where_neg_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x == -math.inf, torch.zeros_like(x), x)


class FlashAttentionFunction(torch.autograd.Function):
    """Tiled attention with a recomputing backward.

    Called through `flash_attention`, which checks the arguments. Inputs here are
    already grouped for GQA: query (..., Hkv, G, L, E), key (..., Hkv, 1, S, E),
    value (..., Hkv, 1, S, Ev), mask None or broadcastable to (..., Hkv, G, L, S).
    Returns output (..., Hkv, G, L, Ev) and lse (..., Hkv, G, L); lse carries no
    gradient.
    """

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, offset, scale, block_q, block_k):
        acc_dtype = _accumulator_dtype(query.dtype)
        q = query.to(acc_dtype) * scale  # scaled once: every tile's scores are q k^T
        k = key.to(acc_dtype)
        v = value.to(acc_dtype)
        mask = attn_mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(acc_dtype)
        L, S = q.shape[-2], k.shape[-2]
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))  # (..., Hkv, G, L, Ev)
        lse = q.new_full(q.shape[:-1], -math.inf)  # (..., Hkv, G, L)
        rows = torch.arange(L, device=q.device) + offset  # aligned query positions
        cols = torch.arange(S, device=q.device)

        for i0 in range(0, L, block_q):
            i1 = min(i0 + block_q, L)
            q_tile = q[..., i0:i1, :]  # (..., G, bq, E)
            m = q.new_full(q_tile.shape[:-1], -math.inf)  # running row max (..., G, bq)
            l = q.new_zeros(q_tile.shape[:-1])  # running denominator
            acc = q.new_zeros(q_tile.shape[:-1] + (v.shape[-1],))  # (..., G, bq, Ev)
            k_end = max(0, min(S, i1 + offset)) if is_causal else S  # keys after that are masked for every row
            for j0 in range(0, k_end, block_k):
                j1 = min(j0 + block_k, k_end)
                mask_tile = None if mask is None else mask[..., i0:i1, j0:j1]
                on_diagonal = is_causal and j1 - 1 > i0 + offset
                s = _scores(
                    q_tile,
                    k[..., j0:j1, :],
                    mask_tile,
                    rows[i0:i1] if on_diagonal else None,
                    cols[j0:j1] if on_diagonal else None,
                )
                m_new = torch.maximum(m, s.amax(dim=-1))
                m_base = _zero_where_neg_inf(m_new)  # rows with no key yet: exp(-inf - 0) = 0
                p = s.sub_(m_base[..., None]).exp_()  # (..., G, bq, bk), in the scores' memory
                alpha = torch.exp(m - m_base)  # rescales what was accumulated so far
                l.mul_(alpha).add_(p.sum(dim=-1))
                acc.mul_(alpha[..., None]).add_(torch.matmul(p, v[..., j0:j1, :]))
                m = m_new
            seen = l > 0
            out[..., i0:i1, :] = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
            lse[..., i0:i1] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), -math.inf)

        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.attn_mask_dtype = None if attn_mask is None else attn_mask.dtype
        ctx.is_causal = is_causal
        ctx.offset = offset
        ctx.scale = scale
        ctx.blocks = (block_q, block_k)
        ctx.input_dtypes = (query.dtype, key.dtype, value.dtype)
        ctx.mark_non_differentiable(lse)
        return out.to(query.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output, grad_lse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        block_q, block_k = ctx.blocks
        scale, is_causal, offset = ctx.scale, ctx.is_causal, ctx.offset
        L, S = q.shape[-2], k.shape[-2]
        do = grad_output.to(q.dtype)  # (..., Hkv, G, L, Ev)
        # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: the softmax backward's row term.
        delta = (do * out).sum(dim=-1)  # (..., Hkv, G, L)
        lse_base = _zero_where_neg_inf(lse)  # fully masked rows: all scores -inf, P = 0
        dq = torch.zeros_like(q)
        dk = torch.zeros(q.shape[:-3] + (q.shape[-3],) + k.shape[-2:], dtype=q.dtype, device=q.device)
        dv = torch.zeros(q.shape[:-3] + (q.shape[-3],) + v.shape[-2:], dtype=q.dtype, device=q.device)
        want_mask_grad = ctx.needs_input_grad[3]
        dmask = None
        if want_mask_grad:
            dmask = q.new_zeros(q.shape[:-1] + (S,))  # (..., Hkv, G, L, S)
        rows = torch.arange(L, device=q.device) + offset  # aligned query positions
        cols = torch.arange(S, device=q.device)

        for j0 in range(0, S, block_k):
            j1 = min(j0 + block_k, S)
            k_tile = k[..., j0:j1, :]  # (..., 1, bk, E)
            v_tile = v[..., j0:j1, :]  # (..., 1, bk, Ev)
            dk_tile = torch.zeros(dk.shape[:-2] + k_tile.shape[-2:], dtype=q.dtype, device=q.device)
            dv_tile = torch.zeros(dv.shape[:-2] + v_tile.shape[-2:], dtype=q.dtype, device=q.device)
            # queries i with i + offset < j0 see none of these keys
            first_query = (max(0, j0 - offset) // block_q) * block_q if is_causal else 0
            for i0 in range(first_query, L, block_q):
                i1 = min(i0 + block_q, L)
                q_tile = q[..., i0:i1, :]
                mask_tile = None if mask is None else mask[..., i0:i1, j0:j1]
                on_diagonal = is_causal and j1 - 1 > i0 + offset
                # in the forward pass this was: p = exp(s - m) / l, with lse = m + log(l)
                s = _scores(
                    q_tile,
                    k_tile,
                    mask_tile,
                    rows[i0:i1] if on_diagonal else None,
                    cols[j0:j1] if on_diagonal else None,
                )
                p = s.sub_(lse_base[..., i0:i1, None]).exp_()  # (..., G, bq, bk)
                do_tile = do[..., i0:i1, :]
                # in the forward pass this was: out = p @ v
                dv_tile += torch.matmul(p.transpose(-1, -2), do_tile)
                dp = torch.matmul(do_tile, v_tile.transpose(-1, -2))
                # softmax backward: ds = p * (dp - rowsum(p * dp)), and rowsum(p * dp) = D
                ds = dp.sub_(delta[..., i0:i1, None]).mul_(p)
                if dmask is not None:
                    dmask[..., i0:i1, j0:j1] = ds
                # in the forward pass this was: s = (q * scale) @ k^T; q here is already scaled
                dq[..., i0:i1, :] += torch.matmul(ds, k_tile)  # times scale once, at the end
                dk_tile += torch.matmul(ds.transpose(-1, -2), q_tile)
            dk[..., j0:j1, :] = dk_tile
            dv[..., j0:j1, :] = dv_tile

        dq.mul_(scale)
        # key/value were broadcast over the G query heads that share them: sum back.
        dk = dk.sum(dim=-3, keepdim=True)
        dv = dv.sum(dim=-3, keepdim=True)
        q_dtype, k_dtype, v_dtype = ctx.input_dtypes
        grad_mask = None
        if dmask is not None:
            # the mask arrives expanded to (..., Hkv, G, L, S); autograd sums the
            # gradient back to the caller's broadcast shape.
            grad_mask = dmask.to(ctx.attn_mask_dtype)
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), grad_mask, None, None, None, None, None


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
    block_q: int = 128,
    block_k: int = 128,
    return_lse: bool = False,
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
        scale: score scale, default 1/sqrt(E).
        enable_gqa: allow Hkv dividing Hq; query head h uses key/value head h // (Hq // Hkv).
        block_q, block_k: tile sizes along L and S.
        return_lse: also return the row log-sum-exp (..., Hq, L) (natural log, -inf for
            fully masked rows).

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
    if num_kv_heads != num_heads:
        if not enable_gqa:
            raise ValueError(
                f"query has {num_heads} heads but key/value have {num_kv_heads}; pass enable_gqa=True for GQA"
            )
        if num_kv_heads == 0 or num_heads % num_kv_heads:
            raise ValueError(f"GQA needs key/value heads dividing query heads, got Hq={num_heads}, Hkv={num_kv_heads}")
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"expected {name} to be a positive int, got {block!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    groups = num_heads // num_kv_heads
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"expected causal_align to be 'top_left' or 'bottom_right', got {causal_align!r}")
    offset = 0 if causal_align == "top_left" else S - L

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
        grouped_mask = expanded.unflatten(-3, (num_kv_heads, groups))  # (..., Hkv, G, L, S)

    q = query.unflatten(-3, (num_kv_heads, groups))  # (..., Hkv, G, L, E)
    k = key.unsqueeze(-3)  # (..., Hkv, 1, S, E)
    v = value.unsqueeze(-3)  # (..., Hkv, 1, S, Ev)
    out, lse = FlashAttentionFunction.apply(
        q, k, v, grouped_mask, bool(is_causal), offset, float(scale), block_q, block_k
    )
    out = out.flatten(-4, -3)  # (..., Hq, L, Ev)
    if return_lse:
        return FlashOutput(out, lse.flatten(-3, -2))
    return out
