"""Every crossing between attnkit and torch: the NumPy modules, their attnkit.torch
twins, and torch's own `nn.MultiheadAttention` / `nn.TransformerEncoderLayer`.

attnkit.nn never imports torch; this module, on the torch side, does all the work.

    torch_mha = from_numpy(numpy_mha)        # attnkit.nn -> its attnkit.torch twin (weights copied)
    numpy_mha = to_numpy(torch_mha)          # attnkit.torch (or torch.nn.Linear/LayerNorm) -> attnkit.nn
    numpy_mha = from_torch(nn_mha)           # torch.nn.MultiheadAttention -> attnkit.nn.MultiHeadAttention
    nn_mha = to_torch(numpy_mha)             # attnkit.nn or attnkit.torch -> torch.nn.MultiheadAttention
    torch_mha.load_state_dict(numpy_mha.state_dict())    # into an existing one (arrays accepted)
    numpy_mha.load_state_dict(torch_mha.state_dict())    # the other way (tensors accepted)

Twins share class names, constructor arguments and state-dict keys, so moving
between them is: build the twin with the same configuration, then copy the
state dict (no renames, no transposes; both store Linear weights as
(out_features, in_features)). torch's own modules pack the query, key and value
projections into one `in_proj_weight` (3E, E) (separate `q/k/v_proj_weight`
when kdim or vdim differ), which `from_torch` splits and `to_torch` packs.
float64 stays float64; anything else is float32.

Masks: torch's `nn.MultiheadAttention` and `nn.TransformerEncoderLayer` read a
boolean True as *masked*; attnkit as *may attend*. Modules converted with
`from_torch` take attnkit's masks: pass `~key_padding_mask` as `key_mask` and
`~attn_mask` for a boolean `attn_mask` (`attnkit.masks.from_torch_mask`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import attnkit.nn
from attnkit.torch.attention import MultiHeadAttention
from attnkit.torch.block import TransformerBlock
from attnkit.torch.layers import FeedForward, LayerNorm, Linear

__all__ = ["from_numpy", "from_torch", "numpy_state_dict", "to_numpy", "to_torch"]

_TORCH_CLASSES = {
    "Linear": Linear,
    "LayerNorm": LayerNorm,
    "FeedForward": FeedForward,
    "MultiHeadAttention": MultiHeadAttention,
    "TransformerBlock": TransformerBlock,
}


# ----------------------------------------------------------------------------- attnkit.nn <-> attnkit.torch


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
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    name, config = _config(module)
    twin = getattr(attnkit.nn, name)(**config)
    dtypes = {p.dtype for p in module.parameters()}
    twin.astype(np.float64 if dtypes == {torch.float64} else np.float32)
    twin.load_state_dict(numpy_state_dict(module))
    return twin.train(module.training)


# ----------------------------------------------------------------------------- torch.nn's own modules


def from_torch(module: nn.Module) -> attnkit.nn.Module:
    """A copy of one of torch's own layers as the attnkit.nn module computing the same function.

    - `torch.nn.MultiheadAttention` -> `attnkit.nn.MultiHeadAttention`: the packed
      `in_proj_weight` (3E, E) or the separate `q/k/v_proj_weight` used when kdim or vdim
      differ from embed_dim, with or without biases (add_bias_kv and add_zero_attn are
      refused).
    - `torch.nn.TransformerEncoderLayer` -> `attnkit.nn.TransformerBlock`: norm_first True
      and False, activation relu / gelu (string, F.relu / F.gelu, nn.ReLU / nn.GELU
      including approximate="tanh"), any layer_norm_eps, bias True or False.

    batch_first is not recorded: attnkit's modules are batch-first, so feed a
    batch_first=False module's (L, B, E) inputs as `x.transpose(1, 0, 2)`. Masks keep
    torch's polarity there: negate `key_padding_mask` / `src_key_padding_mask` (pass it as
    `key_mask`) and a boolean `attn_mask` / `src_mask`. float64 modules become float64
    modules; anything else float32. For the attnkit.torch twin, `from_numpy(from_torch(m))`.
    """
    if isinstance(module, nn.MultiheadAttention):
        return _mha_from_torch(module)
    if isinstance(module, nn.TransformerEncoderLayer):
        return _block_from_torch(module)
    raise TypeError(
        f"expected a torch.nn.MultiheadAttention or torch.nn.TransformerEncoderLayer, got {type(module).__name__}"
    )


def to_torch(module: Any, *, batch_first: bool = True) -> nn.Module:
    """torch's own layer computing the same function as an attnkit module (eval mode).

    - `MultiHeadAttention` (attnkit.nn or attnkit.torch) -> `torch.nn.MultiheadAttention`,
      packed in_proj when kdim == vdim == d_model; not possible with grouped-query attention,
      which torch's module lacks.
    - `TransformerBlock` (attnkit.nn or attnkit.torch) -> `torch.nn.TransformerEncoderLayer`.

    Arguments:
        batch_first: the torch module's `batch_first` (its inputs' layout only).
    """
    if isinstance(module, nn.Module):
        module = to_numpy(module)
    if isinstance(module, attnkit.nn.MultiHeadAttention):
        return _mha_to_torch(module, batch_first)
    if isinstance(module, attnkit.nn.TransformerBlock):
        return _block_to_torch(module, batch_first)
    raise TypeError(f"expected a MultiHeadAttention or TransformerBlock, got {type(module).__name__}")


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


def _mha_from_torch(module: nn.MultiheadAttention) -> attnkit.nn.MultiHeadAttention:
    if module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
        raise ValueError("add_bias_kv and add_zero_attn are not supported by attnkit's MultiHeadAttention")
    E = module.embed_dim
    has_bias = module.in_proj_bias is not None
    ours = attnkit.nn.MultiHeadAttention(E, module.num_heads, bias=has_bias, dropout=float(module.dropout),
                                         kdim=module.kdim, vdim=module.vdim, seed=0)
    if module.in_proj_weight is not None:
        w = _array(module.in_proj_weight)  # (3E, E), rows q | k | v
        wq, wk, wv = w[:E], w[E : 2 * E], w[2 * E :]
    else:
        wq, wk, wv = _array(module.q_proj_weight), _array(module.k_proj_weight), _array(module.v_proj_weight)
    state = {"q_proj.weight": wq, "k_proj.weight": wk, "v_proj.weight": wv,
             "out_proj.weight": _array(module.out_proj.weight)}
    if has_bias:
        b = _array(module.in_proj_bias)  # (3E,)
        state.update({"q_proj.bias": b[:E], "k_proj.bias": b[E : 2 * E], "v_proj.bias": b[2 * E :],
                      "out_proj.bias": _array(module.out_proj.bias)})
    ours.astype(np.float64 if wq.dtype == np.float64 else np.float32)
    ours.load_state_dict(state)
    return ours


def _mha_to_torch(ours: attnkit.nn.MultiHeadAttention, batch_first: bool) -> nn.MultiheadAttention:
    if ours.num_kv_heads != ours.num_heads:
        raise ValueError(
            f"torch.nn.MultiheadAttention has no grouped-query attention; this module has "
            f"num_kv_heads={ours.num_kv_heads} != num_heads={ours.num_heads}"
        )
    has_bias = ours.q_proj.bias is not None
    dtype = torch.float64 if ours.dtype == np.float64 else torch.float32
    module = nn.MultiheadAttention(
        ours.d_model, ours.num_heads, dropout=ours.dropout, bias=has_bias,
        kdim=ours.kdim, vdim=ours.vdim, batch_first=batch_first, dtype=dtype,
    )
    with torch.no_grad():
        if module.in_proj_weight is not None:
            module.in_proj_weight.copy_(_tensor(np.concatenate([ours.q_proj.weight, ours.k_proj.weight,
                                                                ours.v_proj.weight])))  # (3E, E)
        else:
            module.q_proj_weight.copy_(_tensor(ours.q_proj.weight))
            module.k_proj_weight.copy_(_tensor(ours.k_proj.weight))
            module.v_proj_weight.copy_(_tensor(ours.v_proj.weight))
        module.out_proj.weight.copy_(_tensor(ours.out_proj.weight))
        if has_bias:
            module.in_proj_bias.copy_(_tensor(np.concatenate([ours.q_proj.bias, ours.k_proj.bias,
                                                              ours.v_proj.bias])))  # (3E,)
            module.out_proj.bias.copy_(_tensor(ours.out_proj.bias))
    return module.eval()


def _activation_name(activation: Any) -> str:
    """attnkit's name for a TransformerEncoderLayer's activation (a function or a module)."""
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu or (isinstance(activation, nn.GELU) and activation.approximate == "none"):
        return "gelu"
    if isinstance(activation, nn.GELU) and activation.approximate == "tanh":
        return "gelu_tanh"
    raise ValueError(f"expected a relu or gelu activation, got {activation!r}")


def _block_from_torch(layer: nn.TransformerEncoderLayer) -> attnkit.nn.TransformerBlock:
    activation = _activation_name(layer.activation)
    if layer.norm1.eps != layer.norm2.eps:
        raise ValueError(f"expected one LayerNorm eps, got {layer.norm1.eps} and {layer.norm2.eps}")
    bias = layer.linear1.bias is not None
    attn = _mha_from_torch(layer.self_attn)
    if (attn.q_proj.bias is not None) != bias:
        raise ValueError("expected bias on all linear layers or on none")
    ours = attnkit.nn.TransformerBlock(
        attn.d_model, attn.num_heads, layer.linear1.out_features, dropout=float(layer.dropout.p),
        activation=activation, norm_first=layer.norm_first, eps=layer.norm1.eps, seed=0, bias=bias,
    )
    state = {f"attn.{k}": v for k, v in attn.state_dict().items()}
    for ours_name, theirs in (("ffn.fc1", layer.linear1), ("ffn.fc2", layer.linear2)):
        state[f"{ours_name}.weight"] = _array(theirs.weight)
        if bias:
            state[f"{ours_name}.bias"] = _array(theirs.bias)
    for name in ("norm1", "norm2"):
        norm = getattr(layer, name)
        d = norm.normalized_shape[0]
        state[f"{name}.weight"] = _array(norm.weight) if norm.weight is not None else np.ones(d)
        if bias:
            state[f"{name}.bias"] = _array(norm.bias) if norm.bias is not None else np.zeros(d)
    ours.astype(attn.dtype)
    ours.load_state_dict(state)
    return ours


def _block_to_torch(block: attnkit.nn.TransformerBlock, batch_first: bool) -> nn.TransformerEncoderLayer:
    activation: Any = block.ffn.activation
    if activation == "gelu_tanh":
        activation = nn.GELU(approximate="tanh")
    bias = block.ffn.fc1.bias is not None
    dtype = torch.float64 if block.dtype == np.float64 else torch.float32
    layer = nn.TransformerEncoderLayer(
        block.d_model, block.attn.num_heads, dim_feedforward=block.ffn.d_ff, dropout=block.dropout,
        activation=activation, layer_norm_eps=block.norm1.eps, batch_first=batch_first,
        norm_first=block.norm_first, bias=bias, dtype=dtype,
    )
    layer.self_attn = _mha_to_torch(block.attn, batch_first)
    with torch.no_grad():
        for ours, theirs in ((block.ffn.fc1, layer.linear1), (block.ffn.fc2, layer.linear2),
                             (block.norm1, layer.norm1), (block.norm2, layer.norm2)):
            theirs.weight.copy_(_tensor(ours.weight))
            if bias:
                theirs.bias.copy_(_tensor(ours.bias))
    return layer.eval()
