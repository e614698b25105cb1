"""The compiled step's per-row pieces (`step_kernels._step` calls them): the parts' barrier,
the norms (float64 residual -> float32; float32 -> float32, per head for QK-norm), the gated
activations (SiLU, tanh-GELU), rotary embedding, attention of one (row, head) pair over the
paged cache, the residual sum (through a post-sublayer norm where the model has one).

Plain Python functions: `step_kernels.build()` compiles them with numba into the step's one
namespace (their globals there: numba's helpers, `_exp32`, `carray`), as it compiles
`_step`; this file's digest names the native library too (`step_kernels.source_digest`).
"""

from __future__ import annotations

import numpy as np

__all__: list[str] = []

# Names marked F821 are bound in the namespace `step_kernels.build()` gives these functions.


def _barrier(address, parts):  # pragma: no cover - compiled
    """Wait until every part arrived (int64 counter at `address`, generation at + 8): the
    last to arrive resets the counter and moves the generation on; the others spin on it
    (then yield, when it takes long: another process may hold their CPU)."""
    if parts == 1:
        return
    generation = _atomic_load(address + 8)  # noqa: F821
    if _atomic_add(address, 1) == parts - 1:  # noqa: F821
        _atomic_add(address, -parts)  # noqa: F821
        _atomic_add(address + 8, 1)  # noqa: F821
        return
    spins = 0
    while _atomic_load(address + 8) == generation:  # noqa: F821
        spins += 1
        if spins < 20000:
            _pause()  # noqa: F821
        else:
            _sched_yield()  # noqa: F821


def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    """out (d,) float32 = x / sqrt(mean(x^2) + eps) * weight, x float64 (the residual
    stream), computed in float64 and rounded once (as `RMSNorm.forward`)."""
    d = x.shape[0]
    total = 0.0
    for i in range(d):
        total += x[i] * x[i]
    root = np.sqrt(total / d + eps)
    for i in range(d):
        out[i] = np.float32((x[i] / root) * np.float64(weight[i]))


def _rms_norm32(v, weight, eps, out):  # pragma: no cover - compiled
    """out (n,) float32 = v / sqrt(mean(v^2) + eps) * weight, v float32, computed in float32
    (as `RMSNorm.forward` on a float32 sublayer output or a head's query/key); out may be v."""
    n = v.shape[0]
    total = np.float32(0.0)
    for i in range(n):
        total += v[i] * v[i]
    root = np.float32(np.sqrt(total / np.float32(n) + np.float32(eps)))
    for i in range(n):
        out[i] = (v[i] / root) * weight[i]


def _gated(gate_up, ff, gelu, hidden):  # pragma: no cover - compiled
    """hidden (ff,) float32 = act(gate) * up, gate_up (2 ff,) = [gate, up]: act SiLU (its exp
    by the vectorized polynomial `_loops.exp32`: libm's exp, one call an element, took about a
    sixth of an 8-row step), or tanh-GELU with `gelu` in `attnkit.nn.gelu_tanh`'s float32
    operations and order. Compiled with contraction only (as `_exp_shifted`)."""
    for k in range(ff):
        gate = gate_up[k]
        if gelu:
            t = gate * gate
            t *= np.float32(0.044715)
            t += np.float32(1.0)
            t *= gate
            t *= np.float32(0.7978845608028654)  # sqrt(2 / pi)
            t = np.tanh(t)
            t += np.float32(1.0)
            t *= gate
            t *= np.float32(0.5)
            hidden[k] = t * gate_up[ff + k]
        else:
            hidden[k] = gate / (np.float32(1.0) + _exp32(min(-gate, np.float32(80.0)))) * gate_up[ff + k]  # noqa: F821


def _rotate(v, heads, E, cos, sin):  # pragma: no cover - compiled
    """Rotary embedding in place on v (heads * E,), "rotate half" pairs (i, i + E/2)."""
    half = E // 2
    for h in range(heads):
        o = h * E
        for i in range(half):
            a = v[o + i]
            b = v[o + half + i]
            v[o + i] = a * cos[i] - b * sin[i]
            v[o + half + i] = b * cos[half + i] + a * sin[half + i]


def _exp_shifted(s, n, top):  # pragma: no cover - compiled
    """s[t] <- exp(s[t] - top) for t < n, float32 (`_loops.exp32`, 0.7 ulp; compiled with
    contraction only: reassociation would undo the exp's range reduction)."""
    for t in range(n):
        s[t] = _exp32(s[t] - top)  # noqa: F821


def _score(q, key, scale):  # pragma: no cover - compiled
    """q . key * scale, float32 (summed in any order)."""
    s = np.float32(0.0)
    for e in range(q.shape[0]):
        s += q[e] * key[e]
    return s * scale


def _attend(i, h, layer, frame, arrays, rotated, scores, mixed, attended):  # pragma: no cover - compiled
    """Row i's head h (its query in `rotated[i]`) over its sequence's cached keys
    starts[i] .. slot (its own and those of the step's earlier rows of its sequence were
    written before the barrier), in the paged cache through the row's block table, in
    float32 as the module path's attention: scores, their exps by a vectorized polynomial,
    the weighted values in key order, one division by the exps' sum at the end. The same
    code and order whatever else is in the step. A layer with a sliding window w attends
    over slots max(start, slot - w + 1) .. slot only (the module path's band: key j is seen
    from position i when i - w < j <= i)."""
    heads, kv_heads, E, size = frame.heads, frame.kv_heads, frame.head_dim, frame.block_size
    keys, vals = arrays.keys, arrays.values
    first, count = arrays.starts[i], arrays.slots[i] + 1  # keys first .. count - 1
    window = arrays.windows[layer]
    if window > 0:
        first = max(first, count - window)
    table = arrays.tables[i]
    g = h // (heads // kv_heads)
    q = rotated[i, h * E: (h + 1) * E]
    scale32 = np.float32(arrays.floats[0])
    top = np.float32(-np.inf)
    t = first
    while t < count:  # key t in block table[t // size] at t % size, in order
        b = t // size
        block, stop = table[b], min(count, (b + 1) * size)
        for u in range(t, stop):
            scores[u - first] = _score(q, keys[layer, block, g, u - b * size], scale32)
            top = max(top, scores[u - first])
        t = stop
    _exp_shifted(scores, count - first, top)
    total = np.float32(0.0)
    for u in range(count - first):
        total += scores[u]
    for e in range(E):
        mixed[e] = np.float32(0.0)
    t = first
    while t < count:
        b = t // size
        block, stop = table[b], min(count, (b + 1) * size)
        for u in range(t, stop):
            w = scores[u - first]
            value = vals[layer, block, g, u - b * size]
            for e in range(E):
                mixed[e] += w * value[e]
        t = stop
    inverse = np.float32(1.0) / total
    for e in range(E):
        attended[i, h * E + e] = mixed[e] * inverse


def _residual(x, projected, post_norms, address, eps, normed):  # pragma: no cover - compiled
    """x (N, d) float64 += a sublayer's output `projected` (N, d) float32, through the
    post-sublayer norm at `address` (eps `eps`, float32, into `normed`) when `post_norms`."""
    n, d = projected.shape
    for i in range(n):  # (row views: 1-D loops, as one row's step runs them)
        row, add = x[i], projected[i]
        if post_norms:
            add = normed[i]
            _rms_norm32(projected[i], carray(_f32(address), (d,)), eps, add)  # noqa: F821
        for k in range(d):
            row[k] += add[k]


def _share(count, parts, part):  # pragma: no cover - compiled
    """Items [first, stop) of `count` that part `part` of `parts` takes (contiguous, in order)."""
    step = (count + parts - 1) // parts
    return min(count, part * step), min(count, (part + 1) * step)
