"""Attention rollout and attention flow (Abnar & Zuidema, "Quantifying Attention Flow
in Transformers", ACL 2020): one map across all layers, from output tokens to input tokens.

A layer's attention W_l (T, T) says how much each query position reads from each key
position, but a token's representation also carries itself through the residual
connection, and layers stack. Both methods first fold the residual in and average the
heads, as the paper does:

    A_l = residual * I + (1 - residual) * mean_h W_l[h]        then each row / its sum

- Rollout multiplies these maps from the first layer up:

      R_0 = A_0,   R_l = A_l R_{l-1}        (T, T) each; R_l[i, j]: the share of input
                                            token j in token i's vector after layer l

- Flow reads the stack as a network: a node per position per level (level 0: the input
  tokens, level l + 1: the output of layer l), an edge from (l + 1, i) down to (l, j) of
  capacity A_l[i, j]. F_l[i, j] is the maximum flow from node (l + 1, i) to input node
  (0, j), each row then divided by its sum (the paper's code does the same).

Both return (layers, T, T): index l is the map after layer l, so `[-1]` is the whole
model. Rows of a fully masked query (all weights 0) keep only the residual: the token is
its own source.

The flow is computed here with Edmonds–Karp (shortest augmenting paths) in NumPy, run
side by side for all (output token, input token) pairs of one level; it costs far more
than rollout (T² max-flow problems per layer, each on a graph of layers x T² edges), so
keep it for short texts.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["rollout", "attention_flow", "residual_attention"]

_FLOW_CHUNK_BYTES = 64 << 20
"""The most memory the flows of one batch of max-flow problems take (float64)."""


# ----------------------------------------------------------------------------- inputs


def _as_array(value: Any) -> np.ndarray:
    """A NumPy array of an array or a torch tensor (half types become float32)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype in (torch.float16, torch.bfloat16):
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _stack(weights: Any) -> np.ndarray:
    """(layers, heads, T, T) from a stacked array, or from one (H, T, T) or (1, H, T, T)
    map per layer (transformers' `outputs.attentions`, attnkit's recordings)."""
    if isinstance(weights, (list, tuple)):
        if not weights:
            raise ValueError("expected one attention map per layer, got an empty sequence")
        layers = [_as_array(w) for w in weights]
        shapes = sorted({w.shape for w in layers})
        if len(shapes) != 1 or len(shapes[0]) not in (3, 4) or (len(shapes[0]) == 4 and shapes[0][0] != 1):
            raise ValueError(
                f"expected every layer's map of one shape, (H, T, T) or (1, H, T, T), got {shapes}"
            )
        layers = [w.reshape(w.shape[-3:]) for w in layers]  # (H, T, T) each
        stacked = np.stack(layers)  # (layers, H, T, T)
    else:
        stacked = _as_array(weights)
    if stacked.ndim == 0 and stacked.dtype == object:
        raise TypeError(f"expected attention weights (layers, heads, T, T), got a {type(weights).__name__}; "
                        "for a model's attention over a text, pass both: rollout(model, text)")
    if stacked.ndim != 4 or stacked.shape[-1] != stacked.shape[-2]:
        raise ValueError(f"expected weights of shape (layers, heads, T, T), got {stacked.shape}")
    if 0 in stacked.shape:
        raise ValueError(f"expected at least one layer, head and token, got weights of shape {stacked.shape}")
    if not np.issubdtype(stacked.dtype, np.floating):
        raise TypeError(f"expected floating-point attention weights, got {stacked.dtype}")
    return stacked


def _weights_and_residual(what: str, weights: Any, rest: tuple, residual: Any) -> tuple[Any, Any]:
    """`what(weights[, residual])` or `what(model, text_or_ids[, residual])`: the weights
    (the model's attention over the text, `attention_maps`, in that case) and the residual."""
    from attnkit.interpret._model import attention_maps, is_model

    if is_model(weights):
        if not rest:
            raise TypeError(f"{what}(model, ...) needs the text or token ids to run: {what}(model, text)")
        if len(rest) > 2:
            raise TypeError(f"expected {what}(model, text[, residual]), got {2 + len(rest) - 1} arguments")
        if len(rest) == 2:
            residual = rest[1]
        return attention_maps(weights, rest[0]), residual
    if len(rest) > 1:
        raise TypeError(f"expected {what}(weights[, residual]) or {what}(model, text[, residual]), "
                        f"got {1 + len(rest)} arguments")
    if rest:
        if isinstance(rest[0], str):
            raise TypeError(f"{what} takes attention weights, or a model and a text ({what}(model, text)); "
                            f"got a text after {type(weights).__name__}")
        residual = rest[0]
    return weights, residual


def _check_residual(residual: float) -> float:
    if isinstance(residual, bool) or not isinstance(residual, (int, float, np.floating, np.integer)):
        raise TypeError(f"expected residual as a float in [0, 1], got {type(residual).__name__}")
    if not 0.0 <= float(residual) <= 1.0:
        raise ValueError(f"expected residual in [0, 1], got {residual}")
    return float(residual)


def residual_attention(weights: Any, residual: float = 0.5) -> np.ndarray:
    """Each layer's heads averaged, with the residual connection folded in, rows renormalised.

    Arguments:
        weights: per-layer attention: (layers, heads, T, T), or a list or tuple of one
            (H, T, T) or (1, H, T, T) array or torch tensor per layer. Row i of a map
            holds where query i attends (True-to-attend masks give rows that sum to 1).
        residual: the weight of the identity (the residual path), in [0, 1]; 0.5 as in
            the paper.

    Returns:
        (layers, T, T): A_l = residual * I + (1 - residual) * mean_h W_l, each row
        divided by its sum (a row left all 0, possible only with residual 0, stays 0).
        float64 inputs give float64, anything else float32.
    """
    stacked = _stack(weights)  # (layers, H, T, T)
    residual = _check_residual(residual)
    dtype = np.float64 if stacked.dtype == np.float64 else np.float32
    T = stacked.shape[-1]
    mean = stacked.astype(dtype).mean(axis=1)  # (layers, T, T)
    augmented = dtype(residual) * np.eye(T, dtype=dtype) + dtype(1.0 - residual) * mean
    total = augmented.sum(axis=-1, keepdims=True)  # (layers, T, 1)
    return np.divide(augmented, total, out=np.zeros_like(augmented), where=total > 0)


# ----------------------------------------------------------------------------- rollout


def rollout(weights: Any, *args: Any, residual: float = 0.5) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020): the residual-augmented maps multiplied
    through the layers. `rollout(weights[, residual])`, or `rollout(model, text[, residual])`.

    Arguments:
        weights: per-layer attention, (layers, heads, T, T), or a list or tuple of one
            (H, T, T) or (1, H, T, T) array per layer (transformers' `outputs.attentions`,
            `attnkit.record_attention`'s maps). The heads of a layer are averaged. Or a
            model (attnkit's, or transformers'), followed by a text or (T,) token ids: its
            attention over them.
        residual: the identity's share in each layer's map (`residual_attention`), in [0, 1].

    Returns:
        (layers, T, T): R_0 = A_0 and R_l = A_l @ R_{l-1}; R_l[i, j] is how much input
        token j contributes to token i after layer l. `[-1]` is the whole model. Each row
        sums to 1. float64 in, float64 out; otherwise float32.

    Example:
        >>> import numpy as np
        >>> w = np.full((2, 1, 2, 2), 0.5)           # two layers, one uniform head
        >>> rollout(w)[-1]
        array([[0.625, 0.375],
               [0.375, 0.625]])
    """
    weights, residual = _weights_and_residual("rollout", weights, args, residual)
    layers = residual_attention(weights, residual)  # (layers, T, T)
    result = np.empty_like(layers)
    current = layers[0]
    result[0] = current
    for index in range(1, layers.shape[0]):
        current = layers[index] @ current  # (T, T): this layer reads the tokens below
        result[index] = current
    return result


# ----------------------------------------------------------------------------- flow


def attention_flow(weights: Any, *args: Any, residual: float = 0.5) -> np.ndarray:
    """Attention flow (Abnar & Zuidema 2020): the maximum flow from each output token
    down to each input token through the layer graph. `attention_flow(weights[, residual])`,
    or `attention_flow(model, text[, residual])`.

    Arguments:
        weights: per-layer attention as for `rollout` (or a model, then a text or token
            ids); the heads of a layer are averaged.
        residual: the identity's share in each layer's map, in [0, 1].

    Returns:
        (layers, T, T): F_l[i, j] is the maximum flow from token i after layer l to input
        token j, in the graph whose edges from level k + 1 to level k have capacities
        A_k (`residual_attention`), each row then divided by its sum (rows with no flow
        stay 0). `[-1]` is the whole model. Computed in float64 (augmenting paths compare
        residual capacities with 0); returned in float64 for float64 input, else float32.

    Example:
        >>> import numpy as np
        >>> w = np.array([[[[1.0, 0.0], [0.5, 0.5]]]])  # one layer, one head
        >>> attention_flow(w)[0]
        array([[1.  , 0.  ],
               [0.25, 0.75]])
    """
    weights, residual = _weights_and_residual("attention_flow", weights, args, residual)
    stacked = _stack(weights)
    dtype = np.float64 if stacked.dtype == np.float64 else np.float32
    capacity = residual_attention(stacked.astype(np.float64), residual)  # (layers, T, T)
    num_layers, T, _ = capacity.shape
    flows = np.zeros((num_layers, T, T))
    for layer in range(num_layers):
        flows[layer] = _flows_from_level(capacity[: layer + 1])  # (T, T)
    total = flows.sum(axis=-1, keepdims=True)
    flows = np.divide(flows, total, out=np.zeros_like(flows), where=total > 0)
    return flows.astype(dtype)


def _flows_from_level(capacity: np.ndarray) -> np.ndarray:
    """Maximum flow from every node of the top level to every node of level 0.

    `capacity` (levels, T, T): capacity[k, i, j] is the edge from node i of level k + 1 to
    node j of level k. Returns (T, T): [source, sink]. The T * T problems run as a batch,
    in chunks that fit `_FLOW_CHUNK_BYTES`.
    """
    levels, T, _ = capacity.shape
    sources, sinks = np.divmod(np.arange(T * T), T)  # problem p: top node p // T to input p % T
    out = np.zeros(T * T)
    chunk = max(1, _FLOW_CHUNK_BYTES // (8 * levels * T * T * 3))
    for start in range(0, T * T, chunk):
        part = slice(start, start + chunk)
        out[part] = _max_flow_batch(capacity, sources[part], sinks[part])
    return out.reshape(T, T)


def _max_flow_batch(capacity: np.ndarray, sources: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Edmonds–Karp on a batch of problems sharing one layered graph.

    The graph: levels + 1 levels of T nodes; node (k + 1, i) has an edge down to (k, j) of
    capacity[k, i, j]. Problem b sends flow from (levels, sources[b]) to (0, sinks[b]).
    The residual graph has each down edge with what is left of its capacity, and an up
    edge (k, j) -> (k + 1, i) carrying back the flow sent down it. Each round finds a
    shortest augmenting path for every problem still open (a breadth-first search run
    for all of them at once) and pushes its bottleneck along it; a problem whose sink
    the search cannot reach is done.

    Returns:
        (B,) the maximum flow of each problem.
    """
    levels, T, _ = capacity.shape
    B = sources.shape[0]
    scale = float(capacity.max()) if capacity.size else 0.0
    tolerance = 1e-12 * max(scale, 1.0)  # a residual capacity below this counts as 0
    flow = np.zeros((B, levels, T, T))  # (B, k, i, j): flow down the edge (k + 1, i) -> (k, j)
    value = np.zeros(B)
    open_ = np.arange(B)
    while open_.size:
        f = flow[open_]  # (b, levels, T, T)
        down = (capacity[None] - f) > tolerance  # residual down edges
        up = f > tolerance  # residual up edges, (k, j) -> (k + 1, i)
        parent_level, parent_node, found = _search(down, up, sources[open_], sinks[open_])
        done = ~found
        if done.all():
            break
        active = np.flatnonzero(found)
        f, parent_level, parent_node = f[active], parent_level[active], parent_node[active]
        rows = np.arange(active.size)
        # walk each path back from the sink, first to find its bottleneck, then to push it
        bottleneck = np.full(active.size, np.inf)
        for push in (False, True):
            level = np.zeros(active.size, dtype=np.int64)
            node = sinks[open_][active].copy()
            moving = np.ones(active.size, dtype=bool)
            while moving.any():
                r, lv, nd = rows[moving], level[moving], node[moving]
                plv, pnd = parent_level[r, lv, nd], parent_node[r, lv, nd]
                went_down = plv == lv + 1  # the path came down the edge (lv + 1, pnd) -> (lv, nd)
                # down edge: (k = lv, i = pnd, j = nd); up edge from (plv, pnd) to (lv, nd): (k = plv, i = nd, j = pnd)
                k = np.where(went_down, lv, plv)
                i = np.where(went_down, pnd, nd)
                j = np.where(went_down, nd, pnd)
                if push:
                    f[r, k, i, j] += np.where(went_down, bottleneck[r], -bottleneck[r])
                else:
                    room = np.where(went_down, capacity[k, i, j] - f[r, k, i, j], f[r, k, i, j])
                    bottleneck[r] = np.minimum(bottleneck[r], room)
                level[moving], node[moving] = plv, pnd
                moving[moving] = ~((plv == levels) & (pnd == sources[open_][active][r]))
        flow[open_[active]] = f
        value[open_[active]] += bottleneck
        open_ = open_[active]
    return value


def _search(down: np.ndarray, up: np.ndarray, sources: np.ndarray, sinks: np.ndarray):
    """Breadth-first search from each problem's source in its residual graph.

    Arguments:
        down: (b, levels, T, T) bool, the residual down edges (k + 1, i) -> (k, j).
        up: (b, levels, T, T) bool, the residual up edges (k, j) -> (k + 1, i).

    Returns:
        parent_level, parent_node: (b, levels + 1, T), where the search reached each node
        from; found: (b,) whether the sink (0, sinks[b]) was reached.
    """
    b, levels, T, _ = down.shape
    rows = np.arange(b)
    reached = np.zeros((b, levels + 1, T), dtype=bool)
    reached[rows, levels, sources] = True
    frontier = reached.copy()
    parent_level = np.full((b, levels + 1, T), -1, dtype=np.int64)
    parent_node = np.full((b, levels + 1, T), -1, dtype=np.int64)
    found = np.zeros(b, dtype=bool)
    while frontier.any():
        # only the edges next to the levels the frontier holds: a search moves one level a step
        occupied = np.flatnonzero(frontier.any(axis=(0, 2)))
        low, high = max(int(occupied[0]) - 1, 0), min(int(occupied[-1]), levels - 1)  # edge layers k
        edges = slice(low, high + 1)
        # down: (k + 1, i) in the frontier reaches (k, j)
        by_down = frontier[:, low + 1:high + 2, :, None] & down[:, edges]  # (b, k, i, j)
        new_down = by_down.any(axis=2)  # (b, k, j): nodes of level k
        from_down = by_down.argmax(axis=2)
        # up: (k, j) in the frontier reaches (k + 1, i)
        by_up = frontier[:, low:high + 1, None, :] & up[:, edges]  # (b, k, i, j)
        new_up = by_up.any(axis=3)  # (b, k, i): nodes of level k + 1
        from_up = by_up.argmax(axis=3)
        # a node reached both ways takes the down edge
        fresh_down = new_down & ~reached[:, low:high + 1]
        fresh_up = new_up & ~reached[:, low + 1:high + 2] & ~np.pad(fresh_down, ((0, 0), (0, 1), (0, 0)))[:, 1:]
        where = np.nonzero(fresh_down)
        parent_level[where[0], where[1] + low, where[2]] = where[1] + low + 1
        parent_node[where[0], where[1] + low, where[2]] = from_down[where]
        where_up = np.nonzero(fresh_up)
        parent_level[where_up[0], where_up[1] + low + 1, where_up[2]] = where_up[1] + low
        parent_node[where_up[0], where_up[1] + low + 1, where_up[2]] = from_up[where_up]
        new = np.zeros_like(reached)
        new[:, low:high + 1] |= fresh_down
        new[:, low + 1:high + 2] |= fresh_up
        reached |= new
        found = reached[rows, 0, sinks]
        frontier = new
        frontier[found] = False  # a problem whose sink is reached stops searching
    return parent_level, parent_node, found
