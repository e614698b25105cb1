"""The transformer block: attnkit.nn.TransformerBlock in torch."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.nn.spec import block_extra_repr
from attnkit.torch.attention import MultiHeadAttention
from attnkit.torch.cache import KVCache
from attnkit.torch.layers import FeedForward, LayerNorm, _check_dropout, _init_from_numpy, _NumpyStateDict

__all__ = ["BlockOutput", "TransformerBlock"]


class BlockOutput(NamedTuple):
    """TransformerBlock's result when need_weights=True: output (B, L, d_model),
    attn_weights (B, L, L) averaged over heads or (B, num_heads, L, L)."""

    output: torch.Tensor
    attn_weights: torch.Tensor


class TransformerBlock(_NumpyStateDict, nn.Module):
    """Self-attention and feed-forward, each with a residual and LayerNorm: attnkit.nn's block in torch.

    norm_first=False (post-LN, the original Transformer, torch's default):
        x = norm1(x + dropout(attn(x))); x = norm2(x + dropout(ffn(x)))
    norm_first=True (pre-LN, GPT-2 and most decoders):
        x = x + dropout(attn(norm1(x))); x = x + dropout(ffn(norm2(x)))

    torch.nn.TransformerEncoderLayer's computation (batch-first), with its three
    dropouts (attention weights, after the activation, each residual branch).

    Arguments (as attnkit.nn): d_model, num_heads, d_ff, dropout, activation
    ("relu", "gelu", "gelu_tanh"), norm_first, eps, seed (attnkit.nn's weights
    for that seed), bias; plus device, dtype; context_parallel (a process group or
    `attnkit.torch.distributed.ContextParallel`: the attention runs over a sequence
    sharded across its ranks, see MultiHeadAttention).

    State-dict keys: attn.{q,k,v,out}_proj.{weight,bias}, norm1.*, ffn.fc1.*, ffn.fc2.*, norm2.*.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = False,
        eps: float = 1e-5,
        seed: int | None = None,
        *,
        bias: bool = True,
        device=None,
        dtype=None,
        context_parallel=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.dropout = _check_dropout(dropout)
        self.norm_first = bool(norm_first)
        self.attn = MultiHeadAttention(d_model, num_heads, bias=bias, dropout=dropout, **factory,
                                       context_parallel=context_parallel)
        self.norm1 = LayerNorm(d_model, eps, bias, **factory)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout, bias, **factory)
        self.norm2 = LayerNorm(d_model, eps, bias, **factory)
        self.d_model = self.attn.d_model
        _init_from_numpy(
            self, seed,
            lambda nn_: nn_.TransformerBlock(d_model, num_heads, d_ff, dropout, activation, norm_first, eps,
                                             seed=seed, bias=bias),
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        kv_cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor | BlockOutput:
        """x: (B, L, d_model) -> (B, L, d_model), or BlockOutput when need_weights.

        Masks as MultiHeadAttention (attn_mask (L, L) or 4-D; key_mask (B, L) True =
        real token; is_causal top-left, or bottom-right over kv_cache at `layer`).
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected x to be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"expected x of shape (B, L, d_model={self.d_model}), got {tuple(x.shape)}")
        attn_kwargs = dict(
            attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, need_weights=need_weights,
            average_attn_weights=average_attn_weights, kv_cache=kv_cache, layer=layer,
        )
        p, training = self.dropout, self.training
        if self.norm_first:
            a, weights = self.attn(self.norm1(x), **attn_kwargs)
            x = x + F.dropout(a, p, training)
            x = x + F.dropout(self.ffn(self.norm2(x)), p, training)
        else:
            a, weights = self.attn(x, **attn_kwargs)
            x = self.norm1(x + F.dropout(a, p, training))
            x = self.norm2(x + F.dropout(self.ffn(x), p, training))
        if need_weights:
            return BlockOutput(x, weights)
        return x

    def extra_repr(self) -> str:
        return block_extra_repr(self)
