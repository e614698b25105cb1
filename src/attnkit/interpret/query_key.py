"""The query/key view: each dimension's part of one attention score (bertviz's neuron view).

    score(i, j) = scale * q_i . k_j = sum_e scale * q_i[e] * k_j[e]

with q and k as the head attends with them: after the projections and their biases, and
after the rotary embedding for Llama-family models (so the products show the position
dependence RoPE puts in them). With grouped-query attention, query head h reads key head
h // (Hq / Hkv).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attnkit.interpret._capture import capturing
from attnkit.interpret._model import layer_modules, run, token_ids

__all__ = ["QueryKeyContributions", "query_key_contributions"]


class QueryKeyContributions(NamedTuple):
    """What `query_key_contributions` returns (float64).

    query: (E,) the query vector of the query token, as attended with.
    key: (E,) the key vector of the key token, as attended with.
    products: (E,) scale * query * key, each dimension's part of the score.
    score: their sum, the pre-softmax score (before any mask).
    """

    query: np.ndarray
    key: np.ndarray
    products: np.ndarray
    score: float


def _index(value: Any, bound: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected {what} as an int, got {type(value).__name__}")
    if not -bound <= value < bound:
        raise ValueError(f"expected {what} in [0, {bound}), got {value}")
    return int(value) % bound


def query_key_contributions(model: Any, ids: Any, layer: int, head: int, query: int, key: int) -> QueryKeyContributions:
    """Each dimension's contribution to the score of `query` on `key` in one head.

    Arguments:
        model: an attnkit model (decoder or encoder).
        ids: text or a 1-D sequence of token ids (T,).
        layer, head: the head (negative indices count from the end).
        query, key: token positions (a decoder's query sees keys 0..query only; a later key
            gets its score here all the same).

    Returns:
        QueryKeyContributions(query (E,), key (E,), products (E,), score).
    """
    modules = layer_modules(model)
    ids = token_ids(model, ids)
    layer = _index(layer, len(modules), "layer")
    module = modules[layer]
    head = _index(head, module.num_heads, "head")
    T = len(ids)
    query, key = _index(query, T, "query"), _index(key, T, "key")
    with capturing([module], keep=lambda call: (call.query[0], call.key[0], call.scale)) as found:
        run(model, ids)
    queries, keys, scale = found[0][0]  # (Hq, T, E), (Hkv, T, E)
    group = queries.shape[0] // keys.shape[0]
    q = queries[head, query].astype(np.float64)
    k = keys[head // group, key].astype(np.float64)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    products = scale * q * k
    return QueryKeyContributions(query=q, key=k, products=products, score=float(products.sum()))
