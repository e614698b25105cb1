"""Turning heads off: `ablate(model, heads)`.

Zero ablation sets a head's output (its (L, E) result before the output projection) to 0;
mean ablation sets it to the head's mean output over reference inputs, one E-vector for
every position (the mean over every token of every reference sequence). Inside the context,
every forward, generation, attention view and interpret function of that model, made by the
thread (or asyncio task) that opened it, runs ablated; other threads are untouched. A
transformers model loaded with attn_implementation="attnkit" is ablated the same way, in
its attention function (`attnkit.hf.attention`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from attnkit.interpret._capture import capturing, check_heads, edit_heads
from attnkit.interpret._model import head_modules, run, token_ids
from attnkit.nn.interface import AttentionCall

__all__ = ["ablate", "mean_head_outputs"]

ABLATIONS = ("zero", "mean")


def mean_head_outputs(model: Any, reference: Any) -> list[np.ndarray]:
    """Each layer's mean per-head output over `reference` (a text, a 1-D id sequence, or a
    list of them): a list of (heads, E) float64 arrays, one per layer."""
    if isinstance(reference, (str, np.ndarray)) or (
        isinstance(reference, (list, tuple)) and reference and all(isinstance(r, (int, np.integer)) for r in reference)
    ):
        items = [reference]  # one text or one id sequence
    else:
        items = list(reference)
    if not items:
        raise ValueError("expected at least one reference text or id sequence for mean ablation, got none")
    modules = head_modules(model)
    count = 0
    with capturing(modules, keep=lambda call: call.output[0].sum(axis=-2, dtype=np.float64)) as found:
        for item in items:
            ids = token_ids(model, item)
            run(model, ids)
            count += len(ids)
    return [np.sum(calls, axis=0) / count for calls in found]  # each (H, E)


@contextmanager
def ablate(model: Any, heads: Any, how: str = "zero", reference: Any = None) -> Iterator[Any]:
    """Turn heads off while the context is open.

    Arguments:
        model: an attnkit model (decoder or encoder), or a transformers model loaded with
            attn_implementation="attnkit" (its forwards and `generate` run ablated).
        heads: (layer, head) pairs, e.g. ``[(17, 3), (18, 6)]``.
        how: "zero" (the head outputs 0) or "mean" (its mean output over `reference`).
        reference: for "mean": a text, a 1-D sequence of ids, or a list of them.

    Yields:
        The model.

    Example:
        with ablate(model, [(0, 1)]):
            logits = model(ids)
    """
    if how not in ABLATIONS:
        raise ValueError(f"expected how to be one of {', '.join(ABLATIONS)}, got {how!r}")
    modules = head_modules(model)
    pairs = check_heads(heads, modules)
    if how == "mean":
        if reference is None:
            raise ValueError("mean ablation needs reference inputs (reference=text, ids, or a list of them)")
        means = mean_head_outputs(model, reference)
    elif reference is not None:
        raise ValueError("reference is used by how='mean' only; zero ablation takes none")
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        by_layer.setdefault(layer, []).append(head)

    def edit_for(layer: int, off: list[int]):
        def edit(call: AttentionCall) -> np.ndarray:
            out = call.output.copy()  # (B, H, L, E)
            out[:, off] = 0.0 if how == "zero" else means[layer][off][:, None, :]
            return out
        return edit

    with edit_heads({modules[layer]: edit_for(layer, off) for layer, off in by_layer.items()}):
        yield model
