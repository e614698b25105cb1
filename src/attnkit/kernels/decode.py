"""A Llama-family decode step in one compiled call, on the GGUF's blocks.

A decode step (one new token, one sequence) is 211 small products and about 400 small
element-wise operations between them; run one by one from Python, the operations cost as
much as the products (about 8 ms of a 28 ms SmolLM2 step). `decode_step` runs the whole
step inside one compiled function: the embedding row, and in every layer RMSNorm, the
query/key/value products, rotary embedding, the new key and value written into the cache,
attention of the one query over every cached key (grouped-query heads), the output
product and residual, RMSNorm, gate and up products, SiLU(gate) * up, the down product and
residual; then the final norm and the output head. It computes what `LlamaBlock.forward`
computes on a `KVCache` (the residual stream in float64, the sublayers in float32), so its
logits agree with the module path's to float32 rounding; `attnkit.models.llama` runs it for
a quantized model's decode steps when nothing watches the layers (no recording, no
intervention), and the tests hold the two together.

Products are the loops of `attnkit.kernels.quant` on row ranges: with float32 activations
(the default) or, with `quant.activations("int8")`, on 8-bit activations as llama.cpp runs
them. With `parts` > 1 every product's rows are split into `parts` ranges run side by side
(numba's `prange`); the three products that read one input (query, key, value; gate, up)
share one parallel region.

The model's arrays come as numba typed lists (built once per model by the caller):
`matrices` the (rows, bytes per row) uint8 blocks of each product, 7 a layer (query, key,
value, output, gate, up, down), then the embedding and the output head; `table` one row
per matrix: (type code, K, output offset in its group's buffer); `orders` the output
order of each layer's query and key rows (llama.cpp's permuted rows); `norms` the 2L + 1
RMSNorm weights (attention, feed-forward per layer, then the final one).
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from attnkit import kernels
from attnkit.kernels import quant

__all__ = ["compiled", "decode_step"]

MATRICES_PER_LAYER = 7  # query, key, value, output, gate, up, down


def _prepare(x, int8, half_split, xl, xh, xs, q, dx, xsq, qsum):  # pragma: no cover - compiled
    """x (K,) float32 prepared for the products: its halves and block sums (float32 Q4
    loops), or its 8-bit blocks (int8 loops). The scratch arrays are 1-D, long enough."""
    K = x.shape[0]
    blocks = K // 32
    if int8:
        _quantize_x(x.reshape(1, K), x.view(np.uint32).reshape(1, K), q[:K].reshape(1, K),  # noqa: F821
                    dx[:blocks].reshape(1, blocks), xsq[:blocks].reshape(1, blocks), qsum[:blocks].reshape(1, blocks))
    elif half_split:
        for b in range(blocks):
            total = 0.0
            for j in range(16):
                lo = x[32 * b + j]
                hi = x[32 * b + 16 + j]
                xl[16 * b + j] = lo
                xh[16 * b + j] = hi
                total += np.float64(lo) + np.float64(hi)
            xs[b] = np.float32(total)


def _product(raw, values, code, x, first, stop, int8, half, xl, xh, xs, q, dx, xsq, qsum, out):  # pragma: no cover
    """Rows first .. stop - 1 of x @ W.T into out (R,), W given as blocks of type `code`;
    x (K,) and the prepared scratch 1-D (each viewed as one row, C-contiguous, so the loops
    keep their unit strides)."""
    K = x.shape[0]
    blocks = K // 32
    R = out.shape[0]
    out2 = out.reshape(1, R)
    if int8 and (code == 3 or code == 4 or code == 7):
        q2, dx2 = q[:K].reshape(1, K), dx[:blocks].reshape(1, blocks)
        xs2, qs2 = xsq[:blocks].reshape(1, blocks), qsum[:blocks].reshape(1, blocks)
        _int8(raw, code, q2, dx2, xs2, qs2, out2, first, stop)  # noqa: F821
    elif code == 4 or code == 3:
        xl2, xh2, xs2 = xl[: K // 2].reshape(1, K // 2), xh[: K // 2].reshape(1, K // 2), xs[:blocks].reshape(1, blocks)
        if code == 4:
            _q4_1(raw, xl2, xh2, xs2, out2, first, stop)  # noqa: F821
        else:
            _q4_0(raw, xl2, xh2, xs2, out2, first, stop)  # noqa: F821
    elif code == 7:
        _q8_0(raw, values, x.reshape(1, K), out2, first, stop)  # noqa: F821
    else:
        _rows(raw, values, code, half, x.reshape(1, K), out2, first, stop)  # noqa: F821


def _group(matrices, values, table, start, count, x, parts, int8, half, xl, xh, xs, q, dx, xsq, qsum,
           out):  # pragma: no cover - compiled
    """x (K,) @ W.T for matrices start .. start + count - 1 (one input), each written at its
    offset in `out` (1-D); every matrix's rows split in `parts` ranges run side by side."""
    code0 = table[start, 0]
    int8_here = int8 and (code0 == 3 or code0 == 4 or code0 == 7) and x.shape[0] % 32 == 0
    _prepare(x, int8_here, x.shape[0] % 32 == 0, xl, xh, xs, q, dx, xsq, qsum)
    for p in prange(parts):  # noqa: F821 - numba's prange
        for m in range(start, start + count):
            raw = matrices[m]
            rows = raw.shape[0]
            step = ((rows + parts - 1) // parts + 3) // 4 * 4
            first = p * step
            stop = min(rows, first + step)
            if first < stop:
                at = table[m, 2]
                code = table[m, 0]
                _product(raw, values[m], code, x, first, stop, int8_here and (code == 3 or code == 4 or code == 7),
                         half, xl, xh, xs, q, dx, xsq, qsum, out[at: at + rows])


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


def _decode_step(token, slot, matrices, values, table, orders, norms, eps, cos, sin, keys, vals, heads, kv_heads,
                 E, scale, int8, parts, half, logits):  # pragma: no cover - compiled
    """One token through every layer (see the module docstring); logits (V,) float32.

    token: the id; slot: its index in the cache (the cached length before it); cos, sin (E,)
    its rotary tables; keys, vals (L, Hkv, max, E) float32, this sequence's cache, written at
    `slot`; scale: the score scale."""
    layers = keys.shape[0]
    embed = MATRICES_PER_LAYER * layers
    d = table[embed, 1]
    ff = matrices[4].shape[0]
    widest = max(d, ff, heads * E)
    xl = np.empty(widest // 2 + 16, np.float32)
    xh = np.empty(widest // 2 + 16, np.float32)
    xs = np.empty(widest // 32 + 1, np.float32)
    q8 = np.empty(widest + 32, np.int8)
    dx = np.empty(widest // 32 + 1, np.float32)
    xsq = np.empty(widest // 32 + 1, np.float32)
    qsum = np.empty(widest // 32 + 1, np.int32)
    row = np.empty(d, np.float32)
    _dequantize_row(matrices[embed], values[embed], token, table[embed, 0], half, row)  # noqa: F821
    x = row.astype(np.float64)  # the residual stream
    normed = np.empty(d, np.float32)
    qkv_rows = (heads + 2 * kv_heads) * E
    qkv = np.empty(qkv_rows, np.float32)
    rotated = np.empty(qkv_rows, np.float32)
    attended = np.empty(heads * E, np.float32)
    scores = np.empty(slot + 1, np.float64)
    mixed = np.empty(E, np.float64)
    projected = np.empty(d, np.float32)
    gate_up = np.empty(2 * ff, np.float32)
    hidden = np.empty(ff, np.float32)
    group = heads // kv_heads
    for layer in range(layers):
        base = MATRICES_PER_LAYER * layer
        # attention
        _rms_norm(x, norms[2 * layer], eps[2 * layer], normed)
        _group(matrices, values, table, base, 3, normed, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum, qkv)
        order = orders[layer]  # (Hq E + Hkv E,): the query and key rows in output order
        for i in range(order.shape[0]):
            rotated[i] = qkv[order[i]]
        for i in range(order.shape[0], qkv_rows):
            rotated[i] = qkv[i]
        _rotate(rotated[: heads * E], heads, E, cos, sin)
        _rotate(rotated[heads * E: (heads + kv_heads) * E], kv_heads, E, cos, sin)
        for g in range(kv_heads):
            for e in range(E):
                keys[layer, g, slot, e] = rotated[(heads + g) * E + e]
                vals[layer, g, slot, e] = rotated[(heads + kv_heads + g) * E + e]
        for h in range(heads):  # one query over the cached keys, its sums in float64
            g = h // group
            top = -np.inf
            for t in range(slot + 1):
                s = 0.0
                for e in range(E):
                    s += np.float64(rotated[h * E + e]) * np.float64(keys[layer, g, t, e])
                s *= scale
                scores[t] = s
                top = max(top, s)
            total = 0.0
            for t in range(slot + 1):
                w = np.exp(scores[t] - top)
                scores[t] = w
                total += w
            for e in range(E):
                mixed[e] = 0.0
            for t in range(slot + 1):
                w = scores[t] / total
                for e in range(E):
                    mixed[e] += w * np.float64(vals[layer, g, t, e])
            for e in range(E):
                attended[h * E + e] = np.float32(mixed[e])
        _group(matrices, values, table, base + 3, 1, attended, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum,
               projected)
        for i in range(d):
            x[i] += projected[i]
        # feed-forward
        _rms_norm(x, norms[2 * layer + 1], eps[2 * layer + 1], normed)
        _group(matrices, values, table, base + 4, 2, normed, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum,
               gate_up)
        for i in range(ff):
            gate = gate_up[i]
            hidden[i] = gate / (np.float32(1.0) + np.exp(min(-gate, np.float32(80.0)))) * gate_up[ff + i]
        _group(matrices, values, table, base + 6, 1, hidden, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum,
               projected)
        for i in range(d):
            x[i] += projected[i]
    _rms_norm(x, norms[2 * layers], eps[2 * layers], normed)
    _group(matrices, values, table, embed + 1, 1, normed, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum,
           logits)


_SOURCES = {f.__name__: f for f in (_prepare, _product, _group, _rms_norm, _rotate, _decode_step)}


@lru_cache(maxsize=1)
def compiled():
    """The step compiled by numba (cached on disk). Its products' regions are parallel
    (`_group`); the caller sets numba's thread count to `parts`."""
    nb = kernels.numba()
    loops = quant._compiled()
    g = globals()
    g.update({
        "prange": nb.prange,
        "_quantize_x": loops["quantize_x"], "_dequantize_row": quant._dequantize_row,
        "_q4_1": loops["q4_1"], "_q4_0": loops["q4_0"], "_q8_0": loops["q8_0"], "_rows": loops["rows"],
        "_int8": loops["int8"],
    })
    options = dict(cache=True, fastmath=quant._FASTMATH, nogil=True)
    for name in ("_prepare", "_product", "_rms_norm", "_rotate"):
        g[name] = nb.njit(**options)(_SOURCES[name])
    g["_group"] = nb.njit(parallel=True, **options)(_SOURCES["_group"])
    return nb.njit(**options)(_SOURCES["_decode_step"])


def decode_step(token: int, slot: int, arrays: tuple, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                values: np.ndarray, scale: float, *, int8: bool = False, parts: int = 1) -> np.ndarray:
    """Logits (V,) float32 of token `token` at cache index `slot`.

    Arguments:
        arrays: (matrices, values, table, orders, norms, eps, heads, kv_heads, E, V) as the
            module docstring describes them (numba typed lists, built once per model; V the
            vocabulary, the head's rows).
        cos, sin: (E,) float32, the token's rotary tables.
        keys, values: (L, Hkv, max, E) float32, the sequence's cache (the new key and value
            are written at `slot`).
        scale: the score scale.
        int8: the products of Q4_0, Q4_1 and Q8_0 on 8-bit activations.
        parts: threads for the products (numba's thread count in this thread is set to it).
    """
    matrices, blocks, table, orders, norms, eps, heads, kv_heads, E, vocab = arrays
    step = compiled()
    logits = np.empty(vocab, np.float32)
    if getattr(_threads, "parts", None) != parts:  # numba's setting is per thread; set it when it changes
        kernels.numba().set_num_threads(parts)
        _threads.parts = parts
    step(int(token), int(slot), matrices, blocks, table, orders, norms, eps, cos, sin, keys, values, heads,
         kv_heads, E, float(scale), bool(int8), int(parts), quant._half_table(), logits)
    return logits


_threads = threading.local()  # the numba thread count this thread last set for the step
