"""Activation patching: which part of the model carries the difference between two inputs.

Both functions run the corrupt input with one piece of activation taken from the clean run,
and score the logits with `metric` (for instance the answer's logit minus a wrong one's):

- `patch_heads`: one head's output (before the output projection, at every position), as
  TransformerLens's `get_act_patch_attn_head_out_all_pos`;
- `patch_residual`: the residual stream entering one layer at one position, as
  `get_act_patch_resid_pre`.

Nothing below the patched layer changes, so those layers run once: the corrupt residual
stream entering each layer is kept, each patched variant joins the batch at its own layer,
and every layer runs once over the variants that have joined (`_stream.sweep`).

A transformers causal LM loaded with attn_implementation="attnkit" is patched through its
attention function (heads) and a forward pre-hook on the decoder layer (residual stream,
`_hf`): each layer's variants run as one batch through the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from attnkit.interpret import _hf
from attnkit.interpret._capture import capturing, edit_heads, num_heads
from attnkit.interpret._model import decoder, head_modules, hf_decoder, layer_modules, token_ids
from attnkit.interpret._stream import metric_value, positions, residuals, sweep
from attnkit.nn.interface import AttentionCall

__all__ = ["patch_heads", "patch_residual"]

Metric = Callable[[np.ndarray], Any]


def _pair(model: Any, clean: Any, corrupt: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    clean_ids, corrupt_ids = token_ids(model, clean), token_ids(model, corrupt)
    if len(clean_ids) != len(corrupt_ids):
        raise ValueError(
            f"{what} compares position by position: expected clean and corrupt inputs of the same length, "
            f"got {len(clean_ids)} and {len(corrupt_ids)} tokens"
        )
    return clean_ids, corrupt_ids


def _check_metric(metric: Any) -> None:
    if not callable(metric):
        raise TypeError(f"expected metric to be a function of the logits (T, vocab), got {type(metric).__name__}")


def patch_heads(model: Any, clean: Any, corrupt: Any, metric: Metric) -> np.ndarray:
    """Patch each head's output from the clean run into the corrupt run.

    Arguments:
        model: an attnkit decoder, or a transformers causal LM loaded with
            attn_implementation="attnkit".
        clean, corrupt: texts or 1-D id sequences of the same length T.
        metric: logits (T, vocab), a NumPy array in the model's dtype -> a number.

    Returns:
        (layers, heads) float64: metric of the corrupt run with that head's output, at every
        position, taken from the clean run.
    """
    if hf_decoder(model, "patch_heads"):
        return _hf_patch_heads(model, clean, corrupt, metric)
    model = decoder(model, "patch_heads")
    _check_metric(metric)
    clean_ids, corrupt_ids = _pair(model, clean, corrupt, "patch_heads")
    modules = layer_modules(model)
    T = len(clean_ids)
    with capturing(modules) as found:
        model.run_layers(model.embed_inputs(clean_ids[None], positions(1, T)), positions(1, T),
                         model.new_cache(1, T))
    clean_heads = [calls[0][0] for calls in found]  # each (H, T, E)
    stream = residuals(model, corrupt_ids)  # layers + 1 of (1, T, d)

    def variants(layer: int) -> np.ndarray:  # one per head: the corrupt stream entering the layer
        return np.repeat(stream[layer], modules[layer].num_heads, axis=0)  # (H, T, d)

    def edits(layer: int, index: np.ndarray) -> dict:
        mine = np.flatnonzero(index >= 0)  # the rows patched at this layer ...
        heads = index[mine]  # ... each patches one head

        def edit(call: AttentionCall) -> np.ndarray:
            out = call.output.copy()  # (n, H, T, E)
            out[mine, heads] = clean_heads[layer][heads]
            return out
        return {modules[layer]: edit} if len(mine) else {}

    scores = sweep(model, T, [m.num_heads for m in modules], variants, edits, metric)
    result = np.full((len(modules), max(m.num_heads for m in modules)), np.nan)
    for layer, values in enumerate(scores):
        result[layer, : len(values)] = values
    return result


def patch_residual(model: Any, clean: Any, corrupt: Any, metric: Metric) -> np.ndarray:
    """Patch the residual stream entering each layer, one position at a time.

    Arguments:
        model: an attnkit decoder, or a transformers causal LM loaded with
            attn_implementation="attnkit".
        clean, corrupt: texts or 1-D id sequences of the same length T.
        metric: logits (T, vocab), a NumPy array in the model's dtype -> a number.

    Returns:
        (layers, T) float64: metric of the corrupt run with the residual stream entering
        that layer at that position taken from the clean run.
    """
    if hf_decoder(model, "patch_residual"):
        return _hf_patch_residual(model, clean, corrupt, metric)
    model = decoder(model, "patch_residual")
    _check_metric(metric)
    clean_ids, corrupt_ids = _pair(model, clean, corrupt, "patch_residual")
    clean_stream = residuals(model, clean_ids)
    corrupt_stream = residuals(model, corrupt_ids)
    T = len(clean_ids)
    every = np.arange(T)

    def variants(layer: int) -> np.ndarray:  # row p: position p from the clean run
        x = np.repeat(corrupt_stream[layer], T, axis=0)  # (T, T, d)
        x[every, every] = clean_stream[layer][0]
        return x

    return np.stack(sweep(model, T, [T] * len(model.layers), variants, None, metric))


def _hf_patch_heads(model: Any, clean: Any, corrupt: Any, metric: Metric) -> np.ndarray:
    """`patch_heads` on a transformers model: per layer, one batch of a row per head."""
    _check_metric(metric)
    clean_ids, corrupt_ids = _pair(model, clean, corrupt, "patch_heads")
    modules = head_modules(model)
    with capturing(modules) as found:
        _hf.forward(model, clean_ids)
    counts = [num_heads(module) for module in modules]
    result = np.full((len(modules), max(counts)), np.nan)
    for layer, module in enumerate(modules):
        H = counts[layer]
        clean_heads = found[layer][0][0]  # (H, T, E)

        def edit(call: AttentionCall) -> np.ndarray:
            out = call.output.copy()  # (H, H, T, E): row r patches head r
            out[np.arange(H), np.arange(H)] = clean_heads
            return out

        with edit_heads({module: edit}):
            logits = _hf.forward(model, np.repeat(corrupt_ids[None], H, axis=0))  # (H, T, vocab)
        result[layer, :H] = [metric_value(metric, row) for row in logits]
    return result


def _hf_patch_residual(model: Any, clean: Any, corrupt: Any, metric: Metric) -> np.ndarray:
    """`patch_residual` on a transformers model: per layer, one batch of a row per position."""
    _check_metric(metric)
    clean_ids, corrupt_ids = _pair(model, clean, corrupt, "patch_residual")
    clean_stream = _hf.residuals(model, clean_ids)
    corrupt_stream = _hf.residuals(model, corrupt_ids)
    T = len(clean_ids)
    every = np.arange(T)
    result = np.empty((len(clean_stream) - 1, T))
    for layer in range(len(result)):
        x = np.repeat(corrupt_stream[layer], T, axis=0)  # (T, T, d): row p takes position p from the clean run
        x[every, every] = clean_stream[layer][0]
        with _hf.residual_patched(model, layer, x):
            logits = _hf.forward(model, np.repeat(corrupt_ids[None], T, axis=0))  # (T, T, vocab)
        result[layer] = [metric_value(metric, row) for row in logits]
    return result
