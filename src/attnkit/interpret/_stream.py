"""The residual stream of an attnkit decoder, layer by layer (through `CausalLM`'s seams:
`embed_inputs`, `run_layers`, `final_norm`, `unembed`), and the sweep that patching runs.

The sweep runs many variants of one sequence, each of which leaves the plain run at its
own layer (a head or a position patched there). Below that layer a variant is the plain
run, whose residual stream is kept; so the variants of layer l join the batch at layer l,
and every layer runs once over all the variants that have joined so far. That is half the
layer evaluations of running each variant from the start, in as few and as large matrix
products as memory allows: rows go in chunks of ACTIVATION_BUDGET bytes of activations and
of LOGITS_BUDGET bytes of logits; when the residual streams of every variant would pass
STREAM_BUDGET bytes, consecutive layers' variants go in separate sweeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from attnkit.models.causal_lm import CausalLM
from attnkit.nn.interface import intervene

__all__ = ["positions", "residuals", "sweep"]

ACTIVATION_BUDGET = 256 * 2**20  # bytes of activations one layer call may hold, about
LOGITS_BUDGET = 256 * 2**20  # bytes of logits held at once
STREAM_BUDGET = 512 * 2**20  # bytes of residual streams (and their next values) held at once


def positions(batch: int, length: int) -> np.ndarray:
    return np.broadcast_to(np.arange(length), (batch, length))  # (B, T)


def residuals(model: CausalLM, ids: np.ndarray) -> list[np.ndarray]:
    """The residual stream of one sequence (T,) before each layer and after the last:
    layers + 1 arrays (1, T, d), in the dtype the model carries it in."""
    T = len(ids)
    where = positions(1, T)
    cache = model.new_cache(1, T)
    x = model.embed_inputs(ids[None], where)  # (1, T, d)
    out = [x]
    for layer in range(len(model.layers)):
        x = model.run_layers(x, where, cache, layer, layer + 1)
        out.append(x)
    return out


def metric_value(metric: Callable[[np.ndarray], Any], logits: np.ndarray) -> float:
    """metric(logits) as a float; TypeError unless the metric returned one number."""
    value = metric(logits)
    shape = np.shape(value) if isinstance(value, (np.ndarray, np.generic)) else None
    if not shape:
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    got = f"{type(value).__name__} of shape {shape}" if shape else repr(value)
    raise TypeError(f"expected the metric to return a scalar (one number from the logits (T, vocab)), got {got}")


def _chunks(total: int, size: int) -> list[slice]:
    return [slice(start, min(total, start + size)) for start in range(0, total, size)]


def _groups(counts: list[int], row_bytes: int) -> list[range]:
    """Consecutive layers whose variants' residual streams fit STREAM_BUDGET together."""
    groups, first, held = [], 0, 0
    for layer, count in enumerate(counts):
        if held and (held + count) * row_bytes > STREAM_BUDGET:
            groups.append(range(first, layer))
            first, held = layer, 0
        held += count
    groups.append(range(first, len(counts)))
    return groups


def sweep(
    model: CausalLM,
    length: int,
    counts: list[int],
    variants: Callable[[int], np.ndarray],
    edits: Callable[[int, np.ndarray], dict] | None,
    metric: Callable[[np.ndarray], Any],
) -> list[np.ndarray]:
    """Run the variants of every layer to the logits and score them.

    Arguments:
        length: T, the tokens of the sequence.
        counts: how many variants leave the plain run at each layer.
        variants(layer): (counts[layer], T, d) the residual streams entering `layer` of those
            variants.
        edits(layer, index): the `intervene` edits for one call of `layer` on a chunk of rows;
            index[r] is row r's variant number among those of `layer`, or -1 for a variant
            of an earlier layer. None: no edits.
        metric: logits (T, vocab) -> a number.

    Returns:
        One (counts[layer],) float64 array per layer: metric of each of its variants.
    """
    c = model.config
    scores = [np.empty(count) for count in counts]
    for group in _groups(counts, 16 * int(c.hidden_size) * length):
        x, index, owner = None, np.zeros(0, np.int64), np.zeros(0, np.int64)
        for layer in range(group.start, len(model.layers)):
            if layer in group and counts[layer]:
                new = variants(layer)
                x = new if x is None else np.concatenate([x, new])
                index = np.concatenate([np.full(len(index), -1), np.arange(len(new))])
                owner = np.concatenate([owner, np.full(len(new), layer)])
            elif x is not None:
                index = np.full(len(index), -1)
            if x is None:
                continue
            B, T, _ = x.shape
            per_row = 4 * T * (3 * c.num_heads * T + 3 * c.intermediate_size + 8 * c.hidden_size)
            out = np.empty_like(x)
            for rows in _chunks(B, max(1, ACTIVATION_BUDGET // per_row)):
                n = rows.stop - rows.start
                with intervene(edits(layer, index[rows]) if edits is not None else {}):
                    out[rows] = model.run_layers(x[rows], positions(n, T), model.new_cache(n, T), layer, layer + 1)
            x = out
        if x is None:
            continue
        B, T, _ = x.shape
        within = np.zeros(B, np.int64)
        for layer in group:  # each row's number among its layer's variants
            within[owner == layer] = np.arange(int((owner == layer).sum()))
        for rows in _chunks(B, max(1, LOGITS_BUDGET // max(1, T * int(c.vocab_size) * 4))):
            logits = model.unembed(model.final_norm(x[rows]))  # (n, T, vocab)
            for offset, row in enumerate(range(rows.start, rows.stop)):
                scores[owner[row]][within[row]] = metric_value(metric, logits[offset])
    return scores
