"""Norm-based attention maps (Kobayashi et al., 2020, "Attention is not only a weight").

A head's output at query i is sum_j alpha_ij f(x_j) + (bias), where f(x_j) = v_j W_O^h is the
key token's value vector sent through the head's slice of the output projection (the
output bias excluded: it is the same for every token). The weight alpha_ij says how much the
head looks at token j; the norm ||alpha_ij f(x_j)|| says how much token j changes the output:

    heads[l, h, i, j]  = ||alpha_lhij f_lh(x_j)|| = alpha_lhij ||f_lh(x_j)||
    layers[l, i, j]    = ||sum_h alpha_lhij f_lh(x_j)||      (the whole layer's attention)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attnkit.interpret._capture import capturing
from attnkit.interpret._model import encoder, layer_modules, run, token_ids
from attnkit.nn.interface import record_attention

__all__ = ["ValueWeighted", "value_weighted"]


class ValueWeighted(NamedTuple):
    """What `value_weighted` returns (float64).

    heads: (layers, heads, T, T), ||alpha f(x_j)|| per head.
    layers: (layers, T, T), the norm of the heads' sum, per layer.
    """

    heads: np.ndarray
    layers: np.ndarray


def value_weighted(model: Any, ids: Any) -> ValueWeighted:
    """Kobayashi et al.'s norm-based attention of every head and layer.

    Arguments:
        model: an attnkit model (decoder or encoder).
        ids: text or a 1-D sequence of token ids (T,).

    Returns:
        ValueWeighted(heads (layers, heads, T, T), layers (layers, T, T)), float64; row i is
        query i, column j key j (see the module docstring).
    """
    modules = layer_modules(model)
    ids = token_ids(model, ids)
    bert = encoder(model)
    with record_attention(model if bert is None else bert) as recording:
        with capturing(modules, keep=lambda call: call.value[0]) as found:  # (Hkv, T, E)
            run(model, ids)
    per_head, per_layer = [], []
    for layer, module in enumerate(modules):
        alpha = recording.maps[layer][0].astype(np.float64)  # (H, T, T)
        value = found[layer][0].astype(np.float64)  # (Hkv, T, E)
        H, Hkv, E = alpha.shape[0], value.shape[0], value.shape[-1]
        value = np.repeat(value, H // Hkv, axis=0)  # (H, T, E): query head h reads kv head h // (H / Hkv)
        W_O = np.asarray(module.out_proj.weight, np.float64).reshape(-1, H, E)  # (d, H, E)
        f = np.einsum("hje,dhe->hjd", value, W_O)  # (H, T, d): f_h(x_j)
        per_head.append(alpha * np.linalg.norm(f, axis=-1)[:, None, :])  # (H, T, T)
        # ||sum_h alpha_hij f_hj||^2 = alpha_.ij^T G_j alpha_.ij with G_j = F_j F_j^T (H, H): never
        # the (T, T, d) sum itself (SmolLM2 at 512 tokens: 1.2 GB a layer)
        gram = np.einsum("hjd,gjd->jhg", f, f)  # (T, H, H)
        squared = np.einsum("hij,jhg,gij->ij", alpha, gram, alpha, optimize=True)  # (T, T)
        per_layer.append(np.sqrt(np.maximum(squared, 0.0)))  # rounding may leave -0.0-ish
    return ValueWeighted(heads=np.stack(per_head), layers=np.stack(per_layer))
