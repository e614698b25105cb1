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

from typing import Any, NamedTuple

import numpy as np

from attnkit.nn.attention import MultiHeadAttention
from attnkit.nn.layers import FeedForward, LayerNorm, check_dropout, dropout, layer_norm
from attnkit.nn.module import Module, check_float_input, compute_dtype, make_rng


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

    # ----- torch interchange ------------------------------------------------------------

    @classmethod
    def from_torch(cls, layer: Any) -> TransformerBlock:
        """Copy a ``torch.nn.TransformerEncoderLayer`` into a new TransformerBlock.

        Supports norm_first True and False, activation relu / gelu (string,
        F.relu / F.gelu, nn.ReLU / nn.GELU including approximate="tanh"), any
        layer_norm_eps, bias True or False. batch_first is not recorded (this
        block is batch-first). torch's src_key_padding_mask is True = padding:
        pass its negation as key_mask; negate boolean src_mask too.
        """
        import torch
        import torch.nn.functional as F

        if not isinstance(layer, torch.nn.TransformerEncoderLayer):
            raise TypeError(f"expected a torch.nn.TransformerEncoderLayer, got {type(layer).__name__}")
        act = layer.activation
        if act is F.relu or isinstance(act, torch.nn.ReLU):
            activation = "relu"
        elif act is F.gelu or (isinstance(act, torch.nn.GELU) and act.approximate == "none"):
            activation = "gelu"
        elif isinstance(act, torch.nn.GELU) and act.approximate == "tanh":
            activation = "gelu_tanh"
        else:
            raise ValueError(f"expected a relu or gelu activation, got {act!r}")
        if layer.norm1.eps != layer.norm2.eps:
            raise ValueError(f"expected one LayerNorm eps, got {layer.norm1.eps} and {layer.norm2.eps}")
        bias = layer.linear1.bias is not None
        attn = MultiHeadAttention.from_torch(layer.self_attn)
        if (attn.q_proj.bias is not None) != bias:
            raise ValueError("expected bias on all linear layers or on none")
        ours = cls(
            attn.d_model, attn.num_heads, layer.linear1.out_features, dropout=float(layer.dropout.p),
            activation=activation, norm_first=layer.norm_first, eps=layer.norm1.eps, seed=0, bias=bias,
        )

        def arr(t):
            return t.detach().cpu().numpy()

        state = {f"attn.{k}": v for k, v in attn.state_dict().items()}
        for ours_name, theirs in (("ffn.fc1", layer.linear1), ("ffn.fc2", layer.linear2)):
            state[f"{ours_name}.weight"] = arr(theirs.weight)
            if bias:
                state[f"{ours_name}.bias"] = arr(theirs.bias)
        for name in ("norm1", "norm2"):
            norm = getattr(layer, name)
            d = norm.normalized_shape[0]
            state[f"{name}.weight"] = arr(norm.weight) if norm.weight is not None else np.ones(d)
            if bias:
                state[f"{name}.bias"] = arr(norm.bias) if norm.bias is not None else np.zeros(d)
        ours.astype(attn.dtype)
        ours.load_state_dict(state)
        return ours

    def to_torch(self, batch_first: bool = True) -> Any:
        """A ``torch.nn.TransformerEncoderLayer`` (eval mode) computing the same function."""
        import torch

        activation: Any = self.ffn.activation
        if activation == "gelu_tanh":
            activation = torch.nn.GELU(approximate="tanh")
        bias = self.ffn.fc1.bias is not None
        dtype = torch.float64 if self.dtype == np.float64 else torch.float32
        layer = torch.nn.TransformerEncoderLayer(
            self.d_model, self.attn.num_heads, dim_feedforward=self.ffn.d_ff, dropout=self.dropout,
            activation=activation, layer_norm_eps=self.norm1.eps, batch_first=batch_first,
            norm_first=self.norm_first, bias=bias, dtype=dtype,
        )
        layer.self_attn = self.attn.to_torch(batch_first=batch_first)

        def t(a):
            return torch.from_numpy(np.array(a))

        with torch.no_grad():
            for ours, theirs in ((self.ffn.fc1, layer.linear1), (self.ffn.fc2, layer.linear2),
                                 (self.norm1, layer.norm1), (self.norm2, layer.norm2)):
                theirs.weight.copy_(t(ours.weight))
                if bias:
                    theirs.bias.copy_(t(ours.bias))
        return layer.eval()

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, dropout={self.dropout}"
