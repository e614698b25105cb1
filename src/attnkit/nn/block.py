"""The transformer encoder block: self-attention and feed-forward, each with a
residual connection and LayerNorm, in torch's post-LN or pre-LN arrangement.

    post-LN (norm_first=False, the original Transformer and BERT):
        x = norm1(x + dropout(attn(x)))
        x = norm2(x + dropout(ffn(x)))
    pre-LN (norm_first=True, GPT-2 and most modern models):
        x = x + dropout(attn(norm1(x)))
        x = x + dropout(ffn(norm2(x)))

This is torch.nn.TransformerEncoderLayer's computation, batch-first, with the
same three dropouts (attention weights, after the activation, on each residual
branch), active only in training mode.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attnkit.nn.attention import MultiHeadAttention
from attnkit.nn.cache import KVCache
from attnkit.nn.layers import FeedForward, LayerNorm, check_dropout, dropout, layer_norm
from attnkit.nn.module import Module, check_float_input, compute_dtype, make_rng
from attnkit.nn.spec import block_extra_repr


class BlockOutput(NamedTuple):
    """TransformerBlock's result when need_weights=True.

    output: (B, L, d_model)
    attn_weights: (B, L, L) averaged over heads, or (B, num_heads, L, L)
    """

    output: np.ndarray
    attn_weights: np.ndarray


class TransformerBlock(Module):
    """One transformer encoder layer (self-attention + feed-forward).

    Arguments:
        d_model: model width.
        num_heads: attention heads (must divide d_model).
        d_ff: feed-forward hidden size.
        dropout: probability for all three dropouts, only in training mode.
        activation: "relu", "gelu" (exact) or "gelu_tanh".
        norm_first: pre-LN when True, post-LN (torch's default) when False.
        eps: LayerNorm epsilon.
        seed: int, Generator or None; initializes attn then ffn, then drives dropout.
        bias: biases in the projections and LayerNorms (torch's `bias`).

    Parameters: ``attn.{q,k,v,out}_proj.{weight,bias}``, ``norm1.{weight,bias}``,
    ``ffn.fc1.{weight,bias}``, ``ffn.fc2.{weight,bias}``, ``norm2.{weight,bias}``.
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
        seed: int | np.random.Generator | None = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.dropout = check_dropout(dropout)
        self.norm_first = bool(norm_first)
        rng = make_rng(seed)
        self.attn = MultiHeadAttention(d_model, num_heads, bias=bias, dropout=dropout, seed=rng)
        self.norm1 = LayerNorm(d_model, eps, bias)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout, bias, seed=rng)
        self.norm2 = LayerNorm(d_model, eps, bias)
        self.rng = rng
        self.d_model = self.attn.d_model

    def _drop(self, x: np.ndarray) -> np.ndarray:
        if self.training and self.dropout > 0.0:
            return dropout(x, self.dropout, self.rng)
        return x

    def forward(
        self,
        x: np.ndarray,
        *,
        attn_mask: np.ndarray | None = None,
        key_mask: np.ndarray | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        kv_cache: KVCache | None = None,
        layer: int = 0,
    ) -> np.ndarray | BlockOutput:
        """Run the block.

        Arguments:
            x: (B, L, d_model).
            attn_mask: bool (True = may attend) or float, (L, L) or 4-D
                broadcastable to (B, num_heads, L, L).
            key_mask: bool (B, L), True = real token (torch's ~src_key_padding_mask).
            is_causal: top-left causal self-attention.
            need_weights: also return the attention weights, as BlockOutput.
            average_attn_weights: weights averaged over heads (B, L, L), or per
                head (B, num_heads, L, L).
            kv_cache, layer: decode through a KV cache (MultiHeadAttention's; is_causal
                is then bottom-right over the cached keys).

        Returns:
            (B, L, d_model) in x's dtype, or BlockOutput(output, attn_weights)
            when need_weights=True.
        """
        x = check_float_input("x", x)
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"expected x of shape (B, L, d_model={self.d_model}), got {x.shape}")
        dt = compute_dtype(x.dtype, self.norm1.weight.dtype)
        h = x.astype(dt, copy=False)
        n1, n2 = self.norm1, self.norm2
        attn_kwargs = dict(
            attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
            need_weights=need_weights, average_attn_weights=average_attn_weights,
            kv_cache=kv_cache, layer=layer,
        )
        if self.norm_first:
            a, weights = self.attn(layer_norm(h, n1.weight, n1.bias, n1.eps), **attn_kwargs)
            a = self._drop(a)
            a += h  # (B, L, d_model)
            f = self._drop(self.ffn._forward(layer_norm(a, n2.weight, n2.bias, n2.eps)))
            f += a
            out = f
        else:
            a, weights = self.attn(h, **attn_kwargs)
            a = self._drop(a)
            a += h
            a = layer_norm(a, n1.weight, n1.bias, n1.eps)
            f = self._drop(self.ffn._forward(a))
            f += a
            out = layer_norm(f, n2.weight, n2.bias, n2.eps)
        out = out.astype(x.dtype, copy=False)
        if need_weights:
            return BlockOutput(out, weights.astype(x.dtype, copy=False))
        return out

    def extra_repr(self) -> str:
        return block_extra_repr(self)
