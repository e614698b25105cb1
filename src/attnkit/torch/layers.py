"""Layers with attnkit.nn's names and signatures, and NumPy-friendly state dicts.

`Linear`, `LayerNorm` and `FeedForward` are torch modules whose constructor
arguments and state-dict keys are attnkit.nn's. Every attnkit.torch module's
`load_state_dict` also takes NumPy arrays (or an attnkit.nn module) and reports
a key or shape that does not fit as a ValueError naming the key and the shapes,
before anything changes. `seed=s` starts a module from the weights attnkit.nn
draws for the same seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnkit.nn.spec import check_dropout, feed_forward_extra_repr

__all__ = ["ACTIVATIONS", "FeedForward", "LayerNorm", "Linear"]


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
        return feed_forward_extra_repr(self)


_check_dropout = check_dropout  # the one validator, in attnkit.nn.spec


def _check_last_dim(name: str, x: Any, size: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != size:
        raise ValueError(f"expected {name} of shape (..., {size}), got {tuple(x.shape)}")
