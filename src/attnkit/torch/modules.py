"""PyTorch modules with attnkit.nn's class names, arguments and state-dict keys.

MultiHeadAttention and TransformerBlock run on `F.scaled_dot_product_attention`,
which dispatches to a fused kernel where one exists. Weights move between these
modules and attnkit.nn's in either direction with `load_state_dict` (NumPy
arrays are accepted here, torch tensors there) or `attnkit.torch.from_numpy` /
`to_numpy`.

Conventions are attnkit's: masks are boolean True = may attend (float masks are
added to the scores); `key_mask` (B, S) is True for a real token; `is_causal` is
top-left aligned, except when decoding with a KVCache, where the new queries
are the last positions of the keys (bottom-right); a query whose keys are all
masked outputs 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ACTIVATIONS",
    "AttentionResult",
    "BlockOutput",
    "FeedForward",
    "KVCache",
    "LayerNorm",
    "Linear",
    "MultiHeadAttention",
    "TransformerBlock",
]


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


# ----- state dicts that take NumPy arrays ----------------------------------------------


def _to_tensor_state_dict(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> dict[str, Any]:
    """Check keys and shapes against `module` and turn arrays into tensors of the
    module's dtype and device. Errors name the key and both shapes."""
    if hasattr(state_dict, "state_dict") and callable(state_dict.state_dict):
        state_dict = state_dict.state_dict()  # an attnkit.nn module passed directly
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"expected state_dict to be a mapping of names to arrays, got {type(state_dict).__name__}")
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        raise ValueError(f"state_dict does not match {type(module).__name__}: " + "; ".join(parts))
    converted: dict[str, Any] = {}
    for key, value in state_dict.items():
        if key not in own:
            converted[key] = value
            continue
        target = own[key]
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
        else:
            array = np.asarray(value)
            if not (np.issubdtype(array.dtype, np.floating) or array.dtype == np.bool_):
                raise TypeError(f"state_dict[{key!r}]: expected a floating-point array, got dtype {array.dtype}")
            tensor = torch.from_numpy(np.array(array, order="C"))  # a writable copy
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"state_dict[{key!r}]: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        converted[key] = tensor.to(dtype=target.dtype, device=target.device)
    return converted


class _NumpyStateDict:
    """Mixin: `load_state_dict` also takes NumPy arrays (or an attnkit.nn module)
    and reports mismatches as ValueError naming the key and the shapes."""

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        converted = _to_tensor_state_dict(self, state_dict, strict)  # type: ignore[arg-type]
        return super().load_state_dict(converted, strict=strict, assign=assign)  # type: ignore[misc]


def _init_from_numpy(module: nn.Module, seed: int | None, build) -> None:
    """With a seed, take the weights attnkit.nn draws for that seed, so that
    `attnkit.torch.X(..., seed=s)` and `attnkit.nn.X(..., seed=s)` start equal.
    `build(attnkit.nn)` makes the NumPy twin. Without a seed, torch's own init stays."""
    if seed is None:
        return
    import attnkit.nn

    with torch.no_grad():
        for key, value in build(attnkit.nn).state_dict().items():
            target = module.get_parameter(key)
            target.copy_(torch.from_numpy(np.array(value)))


class Linear(_NumpyStateDict, nn.Linear):
    """torch.nn.Linear with attnkit.nn.Linear's signature: (in_features, out_features, bias, *, seed)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, seed: int | None = None,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        _init_from_numpy(self, seed, lambda nn_: nn_.Linear(in_features, out_features, bias, seed=seed))


class LayerNorm(_NumpyStateDict, nn.LayerNorm):
    """torch.nn.LayerNorm with attnkit.nn.LayerNorm's signature: (normalized_shape, eps, bias).

    Always affine (weight ones, bias zeros unless bias=False), over the last axis.
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, bias: bool = True, *, device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine=True, bias=bias, device=device, dtype=dtype)


# ----- FeedForward -------------------------------------------------------------------------


class FeedForward(_NumpyStateDict, nn.Module):
    """Position-wise feed-forward network: fc2(dropout(activation(fc1(x)))).

    Arguments as attnkit.nn.FeedForward: d_model, d_ff, activation ("relu",
    "gelu" exact, "gelu_tanh"), dropout (after the activation, training only),
    bias. State-dict keys: fc1.weight (d_ff, d_model), fc1.bias, fc2.weight
    (d_model, d_ff), fc2.bias.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str = "relu",
        dropout: float = 0.0,
        bias: bool = True,
        *,
        seed: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expected activation to be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.dropout = _check_dropout(dropout)
        self.fc1 = Linear(d_model, d_ff, bias, device=device, dtype=dtype)
        self.fc2 = Linear(d_ff, d_model, bias, device=device, dtype=dtype)
        self.d_model, self.d_ff = d_model, d_ff
        _init_from_numpy(self, seed, lambda nn_: nn_.FeedForward(d_model, d_ff, activation, dropout, bias, seed=seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., d_model) -> (..., d_model)."""
        _check_last_dim("x", x, self.d_model)
        h = ACTIVATIONS[self.activation](self.fc1(x))  # (..., d_ff)
        h = F.dropout(h, self.dropout, self.training)
        return self.fc2(h)  # (..., d_model)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}"


def _check_dropout(p: float) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"expected dropout to be a float in [0, 1), got {p!r}")
    return float(p)


def _check_last_dim(name: str, x: Any, size: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != size:
        raise ValueError(f"expected {name} of shape (..., {size}), got {tuple(x.shape)}")


# ----- KV cache -----------------------------------------------------------------------------


class KVCache:
    """Preallocated keys and values for every layer of a decoder: attnkit.nn.KVCache in torch.

    Arguments:
        num_layers, batch_size, num_kv_heads, head_dim, max_length: buffers of shape
            (B, Hkv, max_length, E) per layer; appending beyond max_length raises ValueError.
        value_dim: Ev (defaults to head_dim).
        dtype, device: of the buffers.

    `update(layer, key, value)` writes (B, Hkv, L, E) new entries after the ones
    already stored and returns views of everything so far, (B, Hkv, S, E): a
    decode step costs O(S), never a copy of the past. New queries sit at the end
    of the keys, so causal attention over the cache is aligned bottom-right:
    `mask(L, S)` is `None` for a single new query and
    `causal_mask(L, S, align="bottom_right")` otherwise, combined with the
    padding recorded by `add_padding` for left-padded batches.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        for name, v in (("num_layers", num_layers), ("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("max_length", max_length), ("value_dim", value_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"expected {name} to be a positive int, got {v!r}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"expected a floating torch dtype, got {dtype!r}")
        self.num_layers, self.batch_size, self.num_kv_heads = num_layers, batch_size, num_kv_heads
        self.head_dim, self.value_dim, self.max_length = head_dim, value_dim, max_length
        self.dtype = dtype
        shape_k = (batch_size, num_kv_heads, max_length, head_dim)
        shape_v = (batch_size, num_kv_heads, max_length, value_dim)
        self.keys = [torch.zeros(shape_k, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape_v, dtype=dtype, device=device) for _ in range(num_layers)]
        self.key_padding = torch.ones(batch_size, max_length, dtype=torch.bool, device=device)  # True = real
        self._lengths = [0] * num_layers
        self._padded = False

    @property
    def length(self) -> int:
        """Positions stored by every layer (the last layer is updated last)."""
        return self._lengths[-1]

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget every stored position (the buffers are reused)."""
        self._lengths = [0] * self.num_layers
        self.key_padding.fill_(True)
        self._padded = False

    def crop(self, length: int) -> None:
        """Keep only the first `length` positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"expected a length in [0, {self.length}], got {length}")
        self._lengths = [length] * self.num_layers
        self.key_padding[:, length:] = True
        self._padded = not bool(self.key_padding[:, :length].all())

    def add_padding(self, mask: torch.Tensor) -> None:
        """Mark which of the next L positions are real tokens (True) or padding (False): (B, L) bool."""
        mask = torch.as_tensor(mask, dtype=torch.bool, device=self.key_padding.device)
        start = self.length
        if mask.dim() != 2 or mask.shape[0] != self.batch_size:
            raise ValueError(f"expected a padding mask of shape ({self.batch_size}, L), got {tuple(mask.shape)}")
        if start + mask.shape[1] > self.max_length:
            raise ValueError(
                f"cache holds at most {self.max_length} positions; {start} are used and {mask.shape[1]} more came"
            )
        self.key_padding[:, start : start + mask.shape[1]] = mask
        if not bool(mask.all()):
            self._padded = True

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key (B, Hkv, L, E) and value (B, Hkv, L, Ev) to `layer`; return views of all S stored."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"expected a layer in [0, {self.num_layers}), got {layer}")
        start = self._lengths[layer]
        L = key.shape[-2] if key.dim() >= 2 else 0
        expected_k = (self.batch_size, self.num_kv_heads, L, self.head_dim)
        expected_v = (self.batch_size, self.num_kv_heads, L, self.value_dim)
        if tuple(key.shape) != expected_k or tuple(value.shape) != expected_v:
            raise ValueError(
                f"expected key {expected_k} and value {expected_v} (B, Hkv, L, E), "
                f"got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        stop = start + L
        if stop > self.max_length:
            raise ValueError(f"cache holds at most {self.max_length} positions; {start} are used and {L} more came")
        self.keys[layer][:, :, start:stop] = key
        self.values[layer][:, :, start:stop] = value
        self._lengths[layer] = stop
        return self.keys[layer][:, :, :stop], self.values[layer][:, :, :stop]

    def mask(self, L: int, S: int, *, causal: bool = True) -> torch.Tensor | None:
        """Bool mask for L new queries over S cached keys, or None when every key may be seen:
        bottom-right causal (query i sees keys 0..S-L+i) and the recorded padding,
        shape (L, S) or (B, 1, L, S)."""
        device = self.key_padding.device
        allowed = None
        if causal and L > 1:
            rows = torch.arange(L, device=device)[:, None] + (S - L)
            allowed = torch.arange(S, device=device)[None, :] <= rows  # (L, S)
        if not self._padded:
            return allowed
        padding = self.key_padding[:, None, None, :S]  # (B, 1, 1, S)
        return padding if allowed is None else padding & allowed

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, length={self.length}/{self.max_length}, dtype={self.dtype})"
        )


# ----- MultiHeadAttention -------------------------------------------------------------------


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


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    return int(value)


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

    State-dict keys (torch layout, as attnkit.nn): q_proj.weight (d_model, d_model),
    k_proj.weight (Hkv*E, kdim), v_proj.weight (Hkv*E, vdim), out_proj.weight
    (d_model, d_model), and a .bias for each.

    Fused QKV: when kdim == vdim == d_model the three projection weights (and
    biases) live in one contiguous (d_model + 2*Hkv*E, d_model) buffer that
    q_proj/k_proj/v_proj's parameters are views of. Self-attention then projects
    with one matrix product and no copy; under autograd a small Function computes
    the fused weight gradient with one GEMM and gives each parameter its rows
    (first-order gradients only: double backward through it raises).
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
    ) -> None:
        super().__init__()
        self.d_model = _positive_int("d_model", d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.num_kv_heads = self.num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
        if self.d_model % self.num_heads:
            raise ValueError(f"expected num_heads to divide d_model, got d_model={d_model} and num_heads={num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"expected num_kv_heads to divide num_heads, got num_heads={num_heads} and num_kv_heads={num_kv_heads}"
            )
        self.head_dim = self.d_model // self.num_heads
        self.kdim = self.d_model if kdim is None else _positive_int("kdim", kdim)
        self.vdim = self.d_model if vdim is None else _positive_int("vdim", vdim)
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
        if not isinstance(query, torch.Tensor):
            raise TypeError(f"expected query to be a torch.Tensor, got {type(query).__name__}")
        if query.dim() != 3 or query.shape[-1] != self.d_model:
            raise ValueError(
                f"expected query of shape (B, L, d_model={self.d_model}), got {tuple(query.shape)}"
                + ("; add a batch axis with x[None]" if query.dim() == 2 and query.shape[-1] == self.d_model else "")
            )
        if key is None:
            if value is not None:
                raise ValueError("got value without key; pass key too (or neither, for self-attention)")
            if self.kdim != self.d_model or self.vdim != self.d_model:
                raise ValueError(f"this module has kdim={self.kdim}, vdim={self.vdim}: pass key and value")
            return query, query, query
        value = key if value is None else value
        for name, x in (("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"expected {name} to be a torch.Tensor, got {type(x).__name__}")
        if key.dim() != 3 or key.shape[0] != query.shape[0] or key.shape[-1] != self.kdim:
            raise ValueError(f"expected key of shape (B={query.shape[0]}, S, kdim={self.kdim}), got {tuple(key.shape)}")
        if value.dim() != 3 or value.shape[:2] != key.shape[:2] or value.shape[-1] != self.vdim:
            raise ValueError(
                f"expected value of shape (B={key.shape[0]}, S={key.shape[1]}, vdim={self.vdim}), got {tuple(value.shape)}"
            )
        return query, key, value

    def _mask(self, attn_mask, key_mask, is_causal, B, L, S, kv_cache):
        """Combine the call's masks into one for SDPA: (mask or None, use SDPA's is_causal)."""
        if not isinstance(is_causal, bool):
            raise TypeError(f"expected is_causal to be a bool, got {type(is_causal).__name__}")
        allowed = None  # boolean part, broadcastable to (B, H, L, S)
        if key_mask is not None:
            if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
                what = key_mask.dtype if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
                raise TypeError(
                    f"expected key_mask to be a bool tensor (True = real token), got {what}; "
                    "for torch's key_padding_mask (True = padding) pass ~key_padding_mask"
                )
            if tuple(key_mask.shape) != (B, S):
                raise ValueError(f"expected key_mask of shape (B, S) = ({B}, {S}), got {tuple(key_mask.shape)}")
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
        target = (B, self.num_heads, L, S)
        ok = attn_mask.dim() in (2, 4)
        if ok:
            try:
                ok = tuple(torch.broadcast_shapes(attn_mask.shape, target)) == target
            except RuntimeError:
                ok = False
        if not ok:
            raise ValueError(
                f"expected attn_mask of shape (L, S) = ({L}, {S}) or 4-D broadcastable to (B, H, L, S) = {target}, "
                f"got {tuple(attn_mask.shape)}"
                + ("; torch's 3-D (B*H, L, S) masks must be reshaped to (B, H, L, S)" if attn_mask.dim() == 3 else "")
            )
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
                not through SDPA); averaged over heads -> (B, L, S) unless
                average_attn_weights=False -> (B, num_heads, L, S).
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
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)  # (B, Hkv, past + L, E)
        S = k.shape[2]
        mask, causal = self._mask(attn_mask, key_mask, is_causal, B, L, S, kv_cache)
        dropout_p = self.dropout if self.training else 0.0

        weights = None
        if need_weights:
            heads, weights = _attention_with_weights(q, k, v, mask, causal, dropout_p)  # (B, H, L, E)
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (B, L, S)
        else:
            heads = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, enable_gqa=Hkv != H
            )  # (B, H, L, E)
        merged = heads.transpose(1, 2).flatten(2)  # (B, L, d_model)
        return AttentionResult(self.out_proj(merged), weights)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """A copy of a torch.nn.MultiheadAttention (packed or separate in-projections;
        float64 stays float64, anything else becomes float32). Its boolean masks read
        True = masked: pass ~key_padding_mask as key_mask and ~attn_mask as attn_mask."""
        import attnkit.nn
        from attnkit.torch.convert import from_numpy

        return from_numpy(attnkit.nn.MultiHeadAttention.from_torch(module))

    def to_torch(self, batch_first: bool = True) -> nn.MultiheadAttention:
        """A torch.nn.MultiheadAttention (eval mode) with these weights; not possible with GQA."""
        from attnkit.torch.convert import to_numpy

        return to_numpy(self).to_torch(batch_first=batch_first)

    def new_kv_cache(self, batch_size: int, max_length: int, num_layers: int = 1) -> KVCache:
        """An empty KVCache shaped for this module, on its device and dtype."""
        w = self.k_proj.weight
        return KVCache(num_layers, batch_size, self.num_kv_heads, self.head_dim, max_length,
                       dtype=w.dtype, device=w.device)

    def extra_repr(self) -> str:
        extra = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        if self.kdim != self.d_model or self.vdim != self.d_model:
            extra += f", kdim={self.kdim}, vdim={self.vdim}"
        return f"d_model={self.d_model}, num_heads={self.num_heads}{extra}, dropout={self.dropout}"


def _attention_with_weights(q, k, v, mask, is_causal, dropout_p):
    """Attention written out, for when the weights are wanted.

    Returns (output (B, H, L, E), weights (B, H, L, S)); weights before dropout,
    fully masked rows 0.
    """
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, E)
        v = v.repeat_interleave(H // Hkv, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, L, S)
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
    return torch.matmul(dropped, v), weights


# ----- TransformerBlock ---------------------------------------------------------------------


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
    for that seed), bias; plus device, dtype.

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
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.dropout = _check_dropout(dropout)
        self.norm_first = bool(norm_first)
        self.attn = MultiHeadAttention(d_model, num_heads, bias=bias, dropout=dropout, **factory)
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

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer) -> TransformerBlock:
        """A copy of a torch.nn.TransformerEncoderLayer (relu/gelu, pre- or post-LN)."""
        import attnkit.nn
        from attnkit.torch.convert import from_numpy

        return from_numpy(attnkit.nn.TransformerBlock.from_torch(layer))

    def to_torch(self, batch_first: bool = True) -> nn.TransformerEncoderLayer:
        """A torch.nn.TransformerEncoderLayer (eval mode) computing the same function."""
        from attnkit.torch.convert import to_numpy

        return to_numpy(self).to_torch(batch_first=batch_first)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, dropout={self.dropout}"
