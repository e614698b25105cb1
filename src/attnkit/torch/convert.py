"""Move modules between attnkit.nn (NumPy) and attnkit.torch.

The two sides share class names, constructor arguments and state-dict keys,
so a conversion is: build the twin with the same configuration, then copy the
state dict (no renames, no transposes; both store Linear weights as
(out_features, in_features)). float64 stays float64; anything else is float32.

    torch_mha = attnkit.torch.from_numpy(numpy_mha)      # a new torch module
    numpy_mha = attnkit.torch.to_numpy(torch_mha)        # a new NumPy module
    torch_mha.load_state_dict(numpy_mha.state_dict())    # into an existing one (arrays accepted)
    numpy_mha.load_state_dict(torch_mha.state_dict())    # the other way (tensors accepted)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from attnkit.torch.attention import MultiHeadAttention
from attnkit.torch.block import TransformerBlock
from attnkit.torch.layers import FeedForward, LayerNorm, Linear

__all__ = ["from_numpy", "numpy_state_dict", "to_numpy"]

_TORCH_CLASSES = {
    "Linear": Linear,
    "LayerNorm": LayerNorm,
    "FeedForward": FeedForward,
    "MultiHeadAttention": MultiHeadAttention,
    "TransformerBlock": TransformerBlock,
}


def numpy_state_dict(module: nn.Module) -> dict[str, np.ndarray]:
    """The module's parameters as NumPy arrays (copies, on the CPU; half precision as float32), keyed like state_dict()."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    out = {}
    for key, value in module.state_dict().items():
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype not in (torch.float32, torch.float64):
            value = value.float()  # float16 / bfloat16: NumPy modules hold float32
        out[key] = value.numpy().copy()
    return out


def _config(module: Any) -> tuple[str, dict[str, Any]]:
    """(class name, constructor arguments) shared by both sides, read from either side's module."""
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm):
        name = "LayerNorm"
    elif isinstance(module, nn.Linear):
        name = "Linear"
    if name == "Linear":
        return name, {"in_features": module.in_features, "out_features": module.out_features,
                      "bias": module.bias is not None}
    if name == "LayerNorm":
        shape = module.normalized_shape
        size = shape[0] if isinstance(shape, tuple) else shape
        if isinstance(shape, tuple) and len(shape) != 1:
            raise ValueError(f"expected a LayerNorm over one axis, got normalized_shape={shape}")
        if isinstance(module, nn.LayerNorm) and module.weight is None:
            raise ValueError("expected an affine LayerNorm (elementwise_affine=True)")
        return name, {"normalized_shape": size, "eps": module.eps, "bias": module.bias is not None}
    if name == "FeedForward":
        return name, {"d_model": module.d_model, "d_ff": module.d_ff, "activation": module.activation,
                      "dropout": module.dropout, "bias": module.fc1.bias is not None}
    if name == "MultiHeadAttention":
        return name, {"d_model": module.d_model, "num_heads": module.num_heads, "num_kv_heads": module.num_kv_heads,
                      "bias": module.q_proj.bias is not None, "dropout": module.dropout,
                      "kdim": module.kdim, "vdim": module.vdim}
    if name == "TransformerBlock":
        if module.attn.num_kv_heads != module.attn.num_heads:
            raise ValueError("TransformerBlock has no grouped-query attention on the NumPy side")
        return name, {"d_model": module.d_model, "num_heads": module.attn.num_heads, "d_ff": module.ffn.d_ff,
                      "dropout": module.dropout, "activation": module.ffn.activation,
                      "norm_first": module.norm_first, "eps": module.norm1.eps,
                      "bias": module.ffn.fc1.bias is not None}
    raise TypeError(f"expected one of {', '.join(_TORCH_CLASSES)}, got {type(module).__name__}")


def from_numpy(module: Any, *, device=None) -> nn.Module:
    """The attnkit.torch twin of an attnkit.nn module, with a copy of its weights.

    Arguments:
        module: attnkit.nn Linear, LayerNorm, FeedForward, MultiHeadAttention or TransformerBlock.
        device: where the new module's parameters live (default CPU).
    Returns:
        The torch module, in eval mode unless `module` was training. float64 weights
        give a float64 module, float32 a float32 one.
    """
    import attnkit.nn

    if not isinstance(module, attnkit.nn.Module):
        raise TypeError(f"expected an attnkit.nn module, got {type(module).__name__}")
    name, config = _config(module)
    dtype = torch.float64 if module.dtype == np.float64 else torch.float32
    twin = _TORCH_CLASSES[name](**config, device=device, dtype=dtype)
    twin.load_state_dict(module.state_dict())
    return twin.train(module.training)


def to_numpy(module: nn.Module) -> Any:
    """The attnkit.nn twin of an attnkit.torch module (or torch.nn.Linear / LayerNorm), weights copied.

    float64 parameters give a float64 NumPy module; any other dtype float32.
    """
    import attnkit.nn

    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    name, config = _config(module)
    twin = getattr(attnkit.nn, name)(**config)
    dtypes = {p.dtype for p in module.parameters()}
    twin.astype(np.float64 if dtypes == {torch.float64} else np.float32)
    twin.load_state_dict(numpy_state_dict(module))
    return twin.train(module.training)
