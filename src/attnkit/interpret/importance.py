"""How much each head matters: `head_importance(model, ids)`, the loss with each head alone
zero-ablated, every head of a decoder in one sweep.

One head's ablation changes nothing below its layer, so the variants of one forward share
every layer under their head. The sweep runs the clean forward once (keeping the residual
stream entering each layer), then carries the ablated variants up through the layers as
rows of one batch: at layer l the H variants that turn off one head of layer l join the
batch (each a copy of the clean residual entering l, row b with head b zeroed at l) and
every row already in the batch runs on. So each layer runs its variants' rows once,
batched, and no row runs a layer below its head. Layers are taken in groups (as many as
keep a batch near `TOKEN_ROWS` token rows), each group's variants finishing with the loss,
so the memory is bounded and `progress` hears of heads as they finish.

The result equals `with ablate(model, [(layer, head)]): loss(model(ids))` for each head
(tests/interpret/test_interpret_importance.py checks it in float64).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from attnkit.interpret._model import decoder, token_ids
from attnkit.nn.interface import AttentionCall, intervene

__all__ = ["HeadImportance", "head_importance", "next_token_losses"]

TOKEN_ROWS = 768
"""About how many token rows (batch x T) one group's batch grows to: wide enough that the
products amortize their per-call cost (SmolLM2's quantized blocks are dequantized per call),
small enough that the KV cache and a chunk of logits stay small."""


class HeadImportance(NamedTuple):
    """loss: the model's mean next-token loss on the text (nats per prediction).
    ablated: (layers, heads) float64, the loss with that head alone zero-ablated (NaN where a
        layer has fewer heads than the widest).
    increase: ablated - loss (how much the loss rises without the head)."""

    loss: float
    ablated: np.ndarray
    increase: np.ndarray


def next_token_losses(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The mean next-token cross-entropy of each row: logits (B, T, vocab) over ids (T,) -> (B,)
    float64 (position t predicts ids[t + 1]; the last position predicts nothing).

    Computed as (max - logit[target]) + log(sum(exp(logits - max))): the exponentials in the
    logits' dtype (float32 for float32 logits: exp(x - max) is in (0, 1], accurate to an ulp),
    summed and logged in float64."""
    T = ids.shape[0]
    z = logits[:, : T - 1]  # (B, T-1, vocab)
    top = z.max(axis=-1, keepdims=True)  # (B, T-1, 1)
    total = np.sum(np.exp(z - top), axis=-1, dtype=np.float64)  # (B, T-1)
    target = np.take_along_axis(z, np.broadcast_to(ids[1:, None], (z.shape[0], T - 1, 1)), axis=-1)[..., 0]
    per_token = (top[..., 0].astype(np.float64) - target.astype(np.float64)) + np.log(total)
    return per_token.mean(axis=-1)


def head_importance(model: Any, ids: Any, *, progress: Callable[[int], None] | None = None) -> HeadImportance:
    """The loss of `model` on `ids`, and the loss with each head alone zero-ablated.

    Arguments:
        model: an attnkit decoder (`CausalLM`: SmolLM2/Llama, GPT-2, ...).
        ids: a text (tokenized with the model's tokenizer) or (T,) token ids, T >= 2.
        progress: called with the number of heads just finished, as groups of them finish
            (the library never prints; `attnkit heads` draws it as a progress bar).

    Returns:
        HeadImportance(loss, ablated (layers, heads), increase (layers, heads)).
    """
    model = decoder(model, "head_importance")
    ids = token_ids(model, ids)
    T = ids.shape[0]
    if T < 2:
        raise ValueError(f"expected at least 2 tokens (a loss needs a next token), got {T}")
    if T > model.context_length:
        raise ValueError(f"expected at most {model.context_length} tokens (the model's context), got {T}")
    modules = [block.attn for block in model.layers]
    layers = len(modules)
    heads = [int(m.num_heads) for m in modules]
    ablated = np.full((layers, max(heads)), np.nan)

    def run(x: np.ndarray, layer: int) -> np.ndarray:  # one layer on a (B, T, d) batch
        B = x.shape[0]
        return model.run_layers(x, np.broadcast_to(np.arange(T), (B, T)), model.new_cache(B, T), layer, layer + 1)

    # the clean forward, keeping the residual stream entering each layer
    clean = [model.embed_inputs(ids[None], np.arange(T)[None])]  # each (1, T, d)
    for layer in range(layers):
        clean.append(run(clean[layer], layer))
    base = float(next_token_losses(model.unembed(model.final_norm(clean[-1])), ids)[0])

    per_group = max(1, TOKEN_ROWS // (max(heads) * T))
    for first in range(0, layers, per_group):
        last = min(first + per_group, layers)  # this group ablates the heads of layers first..last-1
        x = clean[first][:0]  # (0, T, d): the batch grows as variants join
        for layer in range(first, layers):
            edits = {}
            if layer < last:
                H = heads[layer]
                joined = x.shape[0]
                x = np.concatenate([x, np.repeat(clean[layer], H, axis=0)])  # (joined + H, T, d)

                def edit(call: AttentionCall, joined: int = joined, H: int = H) -> np.ndarray:
                    out = call.output.copy()  # (B, H, T, E): row joined + b turns head b off
                    out[joined + np.arange(H), np.arange(H)] = 0.0
                    return out

                edits = {modules[layer]: edit}
            with intervene(edits):
                x = run(x, layer)
        row = 0
        for layer in range(first, last):  # the loss of each variant, one layer's rows at a time
            H = heads[layer]
            hidden = model.final_norm(x[row: row + H, : T - 1])
            ablated[layer, :H] = next_token_losses(model.unembed(hidden), ids[:T])
            row += H
            if progress is not None:
                progress(H)
    return HeadImportance(base, ablated, ablated - base)
