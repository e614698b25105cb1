"""transformers decoders as `attnkit.interpret` reads them: attention modules, the residual
stream and the output head, through torch forward hooks (torch is imported here only, when a
transformers model is handed in).

- attention modules: the ones `attnkit.hf.recording` records; their attention function must be
  attnkit's ("attnkit", "attnkit_tiled", "attnkit_flash"), which applies `intervene` edits;
- decoder layers: the module holding each attention module (GPT-2's `transformer.h[i]`,
  Llama-family `model.layers[i]`); the residual stream entering layer l is that layer's
  `hidden_states` input, and after the last layer its output;
- the final norm: an attribute of `model.base_model` named in FINAL_NORMS; the unembedding:
  `model.get_output_embeddings()`;
- for direct logit attribution, each attention module's output projection (OUT_PROJECTIONS)
  and the final norm's parameters, checked against the norm module itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = [
    "attention_layers", "decoder_layers", "forward", "lens", "norm_parameters", "out_projection", "residuals",
    "residual_patched", "unembedding",
]

FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "final_norm")
"""Names of the final norm on `model.base_model`: Llama/Qwen2/Mistral `norm`, GPT-2 `ln_f`,
OPT `final_layer_norm`, Phi `final_layernorm`."""


OUT_PROJECTIONS = ("o_proj", "c_proj", "out_proj", "dense")
"""Names of an attention module's output projection: Llama-family `o_proj`, GPT-2 `c_proj`
(a Conv1D, weight (in, out)), OPT/BART `out_proj`, Phi `dense`."""


def _name(model: Any) -> str:
    return type(model).__name__


def _check_implementation(model: Any) -> None:
    implementation = str(getattr(model.config, "_attn_implementation", "") or "")
    if not implementation.startswith("attnkit"):
        raise ValueError(
            f"head interventions on a transformers model go through attnkit's attention function: load "
            f"{_name(model)} with attn_implementation='attnkit' (after attnkit.hf.register()), got "
            f"attn_implementation={implementation or 'unknown'!r}"
        )


def attention_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of each attention module of a transformers model loaded with attnkit's
    attention, in layer order; ValueError for another attn_implementation."""
    import attnkit.hf  # noqa: F401  (registers the recording adapter)
    from attnkit.hf.recording import attention_modules

    _check_implementation(model)
    found = {id(module) for module in attention_modules(model)}
    named = [(name, module) for name, module in model.named_modules() if id(module) in found]
    if not named:
        raise ValueError(f"{_name(model)} has no attention module attnkit can reach")
    return named


def decoder_layers(model: Any) -> list[Any]:
    """The module that holds each attention module: one decoder layer per layer."""
    layers = []
    for name, _ in attention_layers(model):
        parent = name.rpartition(".")[0]
        layers.append(model.get_submodule(parent))
    return layers


def _hidden(args: tuple, kwargs: dict):
    return args[0] if args else kwargs["hidden_states"]


def _tensor(ids: np.ndarray):
    import torch

    return torch.as_tensor(np.asarray(ids), dtype=torch.long)


def _numpy(tensor) -> np.ndarray:
    import torch

    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return tensor.detach().to(device="cpu", dtype=dtype).numpy()


def forward(model: Any, ids: np.ndarray) -> np.ndarray:
    """Logits of a batch (B, T) of ids (or (T,)): (B, T, vocab) (or (T, vocab)) NumPy, float32
    (float64 for a float64 model)."""
    import torch

    batch = np.asarray(ids)
    with torch.no_grad():
        out = model(input_ids=_tensor(batch if batch.ndim == 2 else batch[None]))
    logits = getattr(out, "logits", None)
    result = _numpy(logits if logits is not None else out.last_hidden_state)
    return result if batch.ndim == 2 else result[0]


def residuals(model: Any, ids: np.ndarray) -> list[np.ndarray]:
    """The residual stream of one sequence (T,) before each layer and after the last:
    layers + 1 arrays (1, T, d) NumPy."""
    import torch

    layers = decoder_layers(model)
    found: list[Any] = [None] * (len(layers) + 1)

    def before(index: int):
        def hook(module, args, kwargs):
            found[index] = _hidden(args, kwargs).detach().clone()
        return hook

    def after(module, args, kwargs, output):
        found[-1] = (output[0] if isinstance(output, tuple) else output).detach().clone()

    handles = [layer.register_forward_pre_hook(before(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(after, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=_tensor(ids)[None])
    finally:
        for handle in handles:
            handle.remove()
    return [_numpy(x) for x in found]


@contextmanager
def residual_patched(model: Any, layer: int, stream: np.ndarray) -> Iterator[None]:
    """While open, the residual stream entering `layer` is replaced by `stream` (B, T, d)."""
    import torch

    target = decoder_layers(model)[layer]

    def hook(module, args, kwargs):
        hidden = _hidden(args, kwargs)
        new = torch.from_numpy(np.ascontiguousarray(stream)).to(device=hidden.device, dtype=hidden.dtype)
        if args:
            return (new,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": new}

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def final_norm(model: Any) -> Any:
    """The norm before the unembedding (FINAL_NORMS on `model.base_model`)."""
    base = getattr(model, "base_model", model)
    for name in FINAL_NORMS:
        norm = getattr(base, name, None)
        if norm is not None:
            return norm
    raise TypeError(
        f"cannot find the final norm of {_name(model)} (looked for {', '.join(FINAL_NORMS)} on its base model)"
    )


def lens(model: Any, stream: np.ndarray) -> np.ndarray:
    """Residual streams (..., T, d) through the final norm and the unembedding: (..., T, vocab)."""
    import torch

    head = _head(model)
    norm = final_norm(model)
    weight = next(head.parameters())
    with torch.no_grad():
        x = torch.from_numpy(np.ascontiguousarray(stream)).to(device=weight.device, dtype=weight.dtype)
        return _numpy(head(norm(x)))


def _head(model: Any) -> Any:
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None:
        raise TypeError(f"{_name(model)} has no output head (get_output_embeddings() is None)")
    return head


def _float64(tensor) -> np.ndarray:
    import torch

    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()


def unembedding(model: Any, columns: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The unembedding columns of token ids `columns` (d, k) and its bias at them (k,), float64."""
    head = _head(model)
    weight = _float64(head.weight)  # (vocab, d)
    bias = np.zeros(len(columns)) if getattr(head, "bias", None) is None else _float64(head.bias)[columns]
    return weight[columns].T, bias


def out_projection(module: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """An attention module's output projection as (d, H*E) float64 and its bias (d,) or None."""
    for name in OUT_PROJECTIONS:
        projection = getattr(module, name, None)
        if projection is not None and getattr(projection, "weight", None) is not None:
            weight = _float64(projection.weight)
            if type(projection).__name__ == "Conv1D":  # GPT-2: x @ weight, (in, out)
                weight = weight.T
            bias = getattr(projection, "bias", None)
            return weight, None if bias is None else _float64(bias)
    raise TypeError(
        f"cannot find the output projection of {type(module).__name__} (looked for {', '.join(OUT_PROJECTIONS)})"
    )


def norm_parameters(model: Any) -> tuple[bool, np.ndarray, np.ndarray | None, float]:
    """The final norm as (centred, weight (d,), bias (d,) or None, eps), float64: a LayerNorm
    ((x - mean) / s * weight + bias) or an RMSNorm (x / s * weight), checked by running the
    module on a random vector; TypeError for any other norm (Gemma's 1 + weight, ...)."""
    import torch

    norm = final_norm(model)
    weight = getattr(norm, "weight", None)
    eps = next((getattr(norm, name) for name in ("eps", "variance_epsilon", "epsilon") if hasattr(norm, name)), None)
    if weight is None or eps is None:
        raise TypeError(f"direct_logit_attribution knows LayerNorm and RMSNorm final norms, got {type(norm).__name__}")
    centred = isinstance(norm, torch.nn.LayerNorm)
    bias = getattr(norm, "bias", None) if centred else None
    weight, bias, eps = _float64(weight), None if bias is None else _float64(bias), float(eps)
    x = np.random.default_rng(0).standard_normal(weight.shape[0])
    c = x - x.mean() if centred else x
    expected = c / np.sqrt(np.mean(c**2) + eps) * weight + (0.0 if bias is None else bias)
    parameter = next(norm.parameters())
    with torch.no_grad():
        got = _float64(norm(torch.from_numpy(x).to(device=parameter.device, dtype=parameter.dtype)))
    if not np.allclose(got, expected, rtol=1e-3, atol=1e-3 * float(np.abs(expected).max())):
        raise TypeError(
            f"direct_logit_attribution knows LayerNorm ((x - mean) / s * weight + bias) and RMSNorm "
            f"(x / s * weight) final norms; {type(norm).__name__} computes something else"
        )
    return centred, weight, bias, eps
