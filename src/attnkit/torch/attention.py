"""Multi-head attention on F.scaled_dot_product_attention: attnkit.nn.MultiHeadAttention in torch.

Masks are attnkit's: boolean True = may attend (float masks are added to the
scores); `key_mask` (B, S) is True for a real token; `is_causal` is top-left
aligned, except over a KVCache, where the new queries are the last positions of
the keys (bottom-right); a query whose keys are all masked outputs 0.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.nn.attention import check_attention_dims
from attnkit.nn.spec import (
    KEY_PADDING_HINT,
    attention_extra_repr,
    check_attention_inputs,
    check_attn_mask_shape,
    check_is_causal,
    check_key_mask_shape,
)
from attnkit.torch.cache import KVCache
from attnkit.torch.flash import scores_may_overflow
from attnkit.torch.layers import Linear, _check_dropout, _init_from_numpy, _NumpyStateDict

__all__ = ["AttentionResult", "MultiHeadAttention"]


class AttentionResult(NamedTuple):
    """What MultiHeadAttention returns: output (B, L, d_model) and the attention
    weights (B, L, S), or (B, H, L, S) unaveraged, when need_weights, else None."""

    output: torch.Tensor
    weights: torch.Tensor | None


def _aliases(base: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """Whether `parts`, in order, are the consecutive rows of the contiguous `base`."""
    offset = base.data_ptr()
    for part in parts:
        if part.data_ptr() != offset or not part.is_contiguous() or part.dtype != base.dtype:
            return False
        offset += part.numel() * part.element_size()
    return offset == base.data_ptr() + base.numel() * base.element_size()


class _FusedQKVLinear(torch.autograd.Function):
    """y = x @ W^T + b with W, b the fused q|k|v buffers, whose row blocks are the
    q/k/v projection parameters. The forward multiplies by the buffer (no copy);
    the backward computes the fused weight gradient with one GEMM, as for an
    ordinary linear layer, and hands each parameter its block of rows."""

    @staticmethod
    def forward(ctx, x, weight, bias, *params):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.sizes = [p.shape[0] for p in params[:3]]
        return F.linear(x, weight, bias)  # (..., d_model + 2 kv_width)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None  # (..., d_model)
        rows = grad_out.reshape(-1, grad_out.shape[-1])  # (N, d_model + 2 kv_width)
        grad_w = rows.T @ x.reshape(-1, x.shape[-1])  # (d_model + 2 kv_width, d_model)
        grads = list(grad_w.split(ctx.sizes))
        if ctx.has_bias:
            grads += list(rows.sum(dim=0).split(ctx.sizes))
        return (grad_x, None, None, *grads)


class MultiHeadAttention(_NumpyStateDict, nn.Module):
    """Multi-head attention on F.scaled_dot_product_attention: attnkit.nn.MultiHeadAttention in torch.

    Arguments (as attnkit.nn):
        d_model: model width; num_heads must divide it (head_dim = d_model // num_heads).
        num_heads: query heads.
        num_kv_heads: key/value heads for grouped-query attention (default num_heads;
            must divide it). Query head h reads key/value head h // (num_heads // num_kv_heads).
        bias: biases on the four projections.
        dropout: dropout on the attention weights, training mode only (torch's RNG).
        kdim, vdim: input sizes of key and value (default d_model), for cross attention.
        seed: start from the weights attnkit.nn draws for this seed (default: torch's init).
        device, dtype: of the parameters.
        context_parallel: None, or a process group or `attnkit.torch.distributed.ContextParallel`:
            self-attention over a sequence sharded across the group's ranks (each rank
            passes its shard (B, L_local, d_model), cut by `shard_sequence(x, group, layout, dim=1)`),
            by ring attention (default) or Ulysses; no attn_mask, key_mask, kv_cache,
            weights or attention dropout then (docs/distributed.md).

    State-dict keys (torch layout, as attnkit.nn): q_proj.weight (d_model, d_model),
    k_proj.weight (Hkv*E, kdim), v_proj.weight (Hkv*E, vdim), out_proj.weight
    (d_model, d_model), and a .bias for each.

    Fused QKV: when kdim == vdim == d_model the three projection weights (and
    biases) live in one contiguous (d_model + 2*Hkv*E, d_model) buffer that
    q_proj/k_proj/v_proj's parameters are views of. Self-attention then projects
    with one matrix product and no copy; under autograd a small Function computes
    the fused weight gradient with one GEMM and gives each parameter its rows
    (first-order gradients only: double backward through it raises).

    Any finite magnitude: the queries are scaled before SDPA's product (SDPA's
    fused CPU kernel multiplies q @ k^T first and gives NaN from activations near
    4e18); scores beyond float32 run torch's math backend in float64, forward and
    backward, rounded back to the module's dtype, never NaN.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        kdim: int | None = None,
        vdim: int | None = None,
        seed: int | None = None,
        *,
        device=None,
        dtype=None,
        context_parallel=None,
    ) -> None:
        super().__init__()
        if context_parallel is not None:
            # torch.distributed's machinery loads only for a module that asks for context parallelism
            from attnkit.torch.distributed import as_context_parallel

            context_parallel = as_context_parallel(context_parallel)
        self.context_parallel = context_parallel
        dims = check_attention_dims(d_model, num_heads, num_kv_heads, kdim, vdim)
        self.d_model, self.num_heads, self.num_kv_heads = dims.d_model, dims.num_heads, dims.num_kv_heads
        self.head_dim, self.kdim, self.vdim = dims.head_dim, dims.kdim, dims.vdim
        self.dropout = _check_dropout(dropout)
        kv_width = self.num_kv_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = Linear(self.d_model, self.d_model, bias, **factory)
        self.k_proj = Linear(self.kdim, kv_width, bias, **factory)
        self.v_proj = Linear(self.vdim, kv_width, bias, **factory)
        self.out_proj = Linear(self.d_model, self.d_model, bias, **factory)
        _init_from_numpy(
            self, seed,
            lambda nn_: nn_.MultiHeadAttention(d_model, num_heads, num_kv_heads, bias, dropout, kdim, vdim, seed=seed),
        )
        self._fusable = self.kdim == self.vdim == self.d_model
        self._fuse_qkv()

    # ----- fused projection ----------------------------------------------------------------

    def _qkv_parts(self, what: str) -> list[torch.Tensor] | None:
        parts = [getattr(proj, what) for proj in (self.q_proj, self.k_proj, self.v_proj)]
        return None if any(p is None for p in parts) else parts

    def _fuse_qkv(self) -> None:
        """Put the q/k/v projection weights (and biases) in one contiguous buffer each,
        the parameters becoming views of it (the same Parameter objects)."""
        self._qkv_weight = self._qkv_bias = None
        if not self._fusable:
            return
        with torch.no_grad():
            for what in ("weight", "bias"):
                parts = self._qkv_parts(what)
                if parts is None:
                    continue
                base = torch.cat([p.detach() for p in parts])  # (d_model + 2 kv_width[, d_model])
                start = 0
                for p in parts:
                    p.data = base[start : start + p.shape[0]]
                    start += p.shape[0]
                setattr(self, f"_qkv_{what}", base)

    def _apply(self, fn, recurse=True):
        # .to() / .double() / .cuda() give the parameters new storage: fuse again.
        result = super()._apply(fn, recurse)
        self._fuse_qkv()
        return result

    def _fused(self, what: str) -> torch.Tensor | None:
        """The q|k|v weight (d_model + 2 kv_width, d_model) or bias as one tensor: the
        shared buffer when the parameters are still its views, else a concatenation."""
        parts = self._qkv_parts(what)
        if parts is None:
            return None
        base = getattr(self, f"_qkv_{what}")
        if base is not None and _aliases(base, parts):
            return base
        return torch.cat(parts)

    def _project(self, query, key, value):
        """q (B, L, d_model), k and v (B, S, kv_width), with one GEMM for self-attention."""
        kv_width = self.num_kv_heads * self.head_dim
        if key is query and value is query and self._fusable:
            weight, bias = self._fused("weight"), self._fused("bias")
            params = [*self._qkv_parts("weight"), *(self._qkv_parts("bias") or [])]
            shared = weight is self._qkv_weight and (bias is None or bias is self._qkv_bias)
            if shared and torch.is_grad_enabled() and any(p.requires_grad for p in params):
                # the buffers are no leaves of the graph: route the gradients to the parameters
                qkv = _FusedQKVLinear.apply(query, weight, bias, *params)
            else:
                qkv = F.linear(query, weight, bias)  # (B, L, d_model + 2 kv_width)
            return qkv.split([self.d_model, kv_width, kv_width], dim=-1)
        return self.q_proj(query), self.k_proj(key), self.v_proj(value)

    # ----- checks and masks ------------------------------------------------------------------

    def _check_inputs(self, query, key, value):
        return check_attention_inputs(self, query, key, value, _as_tensor)

    def _mask(self, attn_mask, key_mask, is_causal, B, L, S, kv_cache):
        """Combine the call's masks into one for SDPA: (mask or None, use SDPA's is_causal)."""
        check_is_causal(is_causal)
        allowed = None  # boolean part, broadcastable to (B, H, L, S)
        if key_mask is not None:
            if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
                what = key_mask.dtype if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
                raise TypeError(
                    f"expected key_mask to be a bool tensor (True = real token), got {what}; " + KEY_PADDING_HINT
                )
            check_key_mask_shape(key_mask.shape, B, S)
            allowed = key_mask[:, None, None, :]  # (B, 1, 1, S)
        if kv_cache is not None:
            cached = kv_cache.mask(L, S, causal=is_causal)  # bottom-right causal and padding
            if cached is not None:
                allowed = cached if allowed is None else allowed & cached
        elif is_causal:
            if attn_mask is None and allowed is None:
                return None, True  # SDPA's own top-left causal path
            causal = torch.ones(L, S, dtype=torch.bool, device=self.q_proj.weight.device).tril()  # (L, S)
            allowed = causal if allowed is None else allowed & causal
        if attn_mask is None:
            return allowed, False
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"expected attn_mask to be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(
                "expected attn_mask to be boolean (True = may attend) or floating (added to the scores), "
                f"got dtype {attn_mask.dtype}"
            )
        check_attn_mask_shape(attn_mask.shape, B, self.num_heads, L, S)
        if attn_mask.dtype == torch.bool:
            return (attn_mask if allowed is None else attn_mask & allowed), False
        return (attn_mask if allowed is None else attn_mask.masked_fill(~allowed, -math.inf)), False

    # ----- forward ----------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        attn_mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        kv_cache: KVCache | None = None,
        layer: int = 0,
    ) -> AttentionResult:
        """Attend from query to key/value.

        Arguments:
            query: (B, L, d_model).
            key: (B, S, kdim); omitted for self-attention (key = value = query).
            value: (B, S, vdim); defaults to key.
            attn_mask: bool (True = may attend) or float (added to the scores),
                (L, S) or 4-D broadcastable to (B, num_heads, L, S).
            key_mask: bool (B, S), True = a real token (the opposite of torch's key_padding_mask).
            is_causal: top-left causal mask; with a kv_cache, bottom-right (the L
                new queries are the last L of the S keys).
            need_weights: also return the attention weights (computed explicitly,
                not through SDPA), after dropout in training mode (the weights the
                output is formed with, as attnkit.nn and torch's nn.MultiheadAttention);
                averaged over heads -> (B, L, S) unless average_attn_weights=False
                -> (B, num_heads, L, S).
            kv_cache, layer: self-attention decoding: this call's keys and values are
                appended to `kv_cache` at `layer` and the queries attend to all S cached.

        Returns:
            AttentionResult(output (B, L, d_model), weights or None). A query that may
            attend to no key gets attention output 0 (the layer output is out_proj's bias).
        """
        self_attention = key is None and value is None
        query, key, value = self._check_inputs(query, key, value)
        if kv_cache is not None and not self_attention:
            raise ValueError("kv_cache is for self-attention decoding: pass neither key nor value")
        B, L, _ = query.shape
        H, Hkv, E = self.num_heads, self.num_kv_heads, self.head_dim

        q, k, v = self._project(query, key, value)
        q = q.unflatten(-1, (H, E)).transpose(1, 2)  # (B, H, L, E)
        k = k.unflatten(-1, (Hkv, E)).transpose(1, 2)  # (B, Hkv, S, E)
        v = v.unflatten(-1, (Hkv, E)).transpose(1, 2)  # (B, Hkv, S, E)
        if self.context_parallel is not None:
            heads = self._attend_context_parallel(q, k, v, self_attention, attn_mask, key_mask, is_causal,
                                                  need_weights, kv_cache)  # (B, H, L_local, E)
            return AttentionResult(self.out_proj(heads.transpose(1, 2).flatten(2)), None)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)  # (B, Hkv, past + L, E)
        S = k.shape[2]
        mask, causal = self._mask(attn_mask, key_mask, is_causal, B, L, S, kv_cache)
        dropout_p = self.dropout if self.training else 0.0

        dtype = q.dtype
        q = q * (1.0 / math.sqrt(E))  # scaled before the product, as torch's math backend does
        wide = scores_may_overflow(q, k)
        if wide:
            # scores beyond float32 (activations near 1e19 and up): torch's math backend in
            # float64, rounded back (its gradients too: the backward runs in float64)
            q, k, v = q.double(), k.double(), v.double()
            if mask is not None and mask.is_floating_point():
                mask = mask.double()
        weights = None
        if need_weights:
            heads, weights = _attention_with_weights(q, k, v, mask, causal, dropout_p)  # (B, H, L, E)
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (B, L, S)
            weights = weights.to(dtype)
        else:
            with _math_backend() if wide else contextlib.nullcontext():
                heads = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=1.0, enable_gqa=Hkv != H
                )  # (B, H, L, E)
        merged = heads.to(dtype).transpose(1, 2).flatten(2)  # (B, L, d_model)
        return AttentionResult(self.out_proj(merged), weights)

    def _attend_context_parallel(self, q, k, v, self_attention, attn_mask, key_mask, is_causal, need_weights,
                                 kv_cache):
        """q (B, H, L_local, E), k, v (B, Hkv, L_local, E): this rank's shard, attended over the
        whole sharded sequence by self.context_parallel's method."""
        check_is_causal(is_causal)
        refused = [name for name, given in (
            ("cross-attention (key/value)", not self_attention), ("attn_mask", attn_mask is not None),
            ("key_mask", key_mask is not None), ("kv_cache", kv_cache is not None), ("need_weights", need_weights),
            ("attention dropout in training", self.training and self.dropout > 0),
        ) if given]
        if refused:
            raise ValueError(f"context_parallel attention is sharded self-attention; it does not take {refused[0]} "
                             "(pass is_causal, or use attnkit.torch.distributed.ring_attention with a mask_mod)")
        return self.context_parallel.attention(q, k, v, causal=bool(is_causal),
                                               enable_gqa=self.num_kv_heads != self.num_heads)

    def new_kv_cache(self, batch_size: int, max_length: int, num_layers: int = 1) -> KVCache:
        """An empty KVCache shaped for this module, on its device and dtype."""
        w = self.k_proj.weight
        return KVCache(num_layers, batch_size, self.num_kv_heads, self.head_dim, max_length,
                       dtype=w.dtype, device=w.device)

    def extra_repr(self) -> str:
        return attention_extra_repr(self)


def _as_tensor(name: str, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor, got {type(x).__name__}")
    return x


def _math_backend():
    """A context in which F.scaled_dot_product_attention runs torch's math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _attention_with_weights(q, k, v, mask, is_causal, dropout_p):
    """Attention written out, for when the weights are wanted; q is already scaled.

    Returns (output (B, H, L, E), weights (B, H, L, S)); weights after dropout (the
    ones the output is formed with, as attnkit.nn and torch's nn.MultiheadAttention
    return them), fully masked rows 0.
    """
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, E)
        v = v.repeat_interleave(H // Hkv, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2))  # (B, H, L, S)
    if is_causal:
        L, S = scores.shape[-2:]
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - torch.where(row_max == -math.inf, 0.0, row_max))
    total = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(total > 0, total, 1.0)  # (B, H, L, S); fully masked rows 0
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return torch.matmul(dropped, v), dropped
