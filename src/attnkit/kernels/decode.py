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
them.

Threads: the step is one entry of the native kernels (`attnkit.kernels.native`),
`_step_entry(frame, part)`, called once per thread with `part` 0 .. parts - 1 (the calling
thread runs part 0). Every product's rows are split in `parts` ranges and each part
computes its range; the attention heads are split the same way. The parts meet at a
barrier (a counter and a generation number, spun on with `pause`, then yielding) after
each product group and after attention: five a layer. What is cheap and read whole (the
residual stream, the norms, SiLU, the rotary embedding) each part computes for itself, in
the same order, so every part holds the same bits without waiting for another.

The frame (int64, `FRAME` entries, named below) holds the step's sizes and the addresses
of its arrays: `TABLE` one row per matrix, (address, rows, bytes per row, type code, K,
output offset in its group's buffer), 7 a layer (query, key, value, output, gate, up,
down), then the embedding and the output head; `ORDERS` (L, Hq E + Hkv E) int64, the output
order of each layer's query and key rows (llama.cpp's permuted rows); `NORMS` the
addresses of the 2L + 1 RMSNorm weights (attention and feed-forward per layer, then the
final one), `FLOATS` float64 (scale, eps of each norm); `SHARED` float32 scratch the
parts write their shares into.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from attnkit import kernels
from attnkit.kernels import native, quant

__all__ = ["FRAME", "compiled", "decode_step"]

MATRICES_PER_LAYER = 7  # query, key, value, output, gate, up, down
TABLE_COLUMNS = 6  # address, rows, bytes per row, type code, K, output offset

(TOKEN, SLOT, PARTS, BARRIER, TABLE, MATRICES, ORDERS, NORMS, FLOATS, COS, SIN, KEYS, VALUES, MAX_LENGTH,
 LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, INT8, HALF, LOGITS, SHARED) = range(23)
FRAME = 23


def _prepare(x, int8, half_split, xl, xh, xs, q, dx, xsq, qsum):  # pragma: no cover - compiled
    """x (K,) float32 prepared for the products: its halves and block sums (float32 Q4
    loops), or its 8-bit blocks (int8 loops). The scratch arrays are 1-D, long enough."""
    K = x.shape[0]
    blocks = K // 32
    if int8:
        _quantize_x(x.reshape(1, K), x.view(np.uint32).reshape(1, K), q[:K].reshape(1, K),  # noqa: F821
                    dx[:blocks].reshape(1, blocks), xsq[:blocks].reshape(1, blocks), qsum[:blocks].reshape(1, blocks))
    elif half_split:
        _split_x(x, xl, xh, xs)  # noqa: F821 - bound when compiled


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


def _group(table, start, count, x, part, parts, int8, half, xl, xh, xs, q, dx, xsq, qsum,
           out):  # pragma: no cover - compiled
    """This part's share of x (K,) @ W.T for matrices start .. start + count - 1 (one input):
    rows part * step .. of each matrix, written at the matrix's offset in `out` (1-D). x is
    prepared (split, or quantized) into this part's scratch."""
    code0 = table[start, 3]
    int8_here = int8 and (code0 == 3 or code0 == 4 or code0 == 7) and x.shape[0] % 32 == 0
    _prepare(x, int8_here, x.shape[0] % 32 == 0, xl, xh, xs, q, dx, xsq, qsum)
    for m in range(start, start + count):
        rows = table[m, 1]
        first, stop = _part_rows(rows, parts, part)  # noqa: F821 - bound when compiled
        if first < stop:
            raw = carray(_u8(table[m, 0]), (rows, table[m, 2]))  # noqa: F821 - bound when compiled
            values = carray(_i8(table[m, 0]), (rows, table[m, 2]))  # noqa: F821
            at = table[m, 5]
            code = table[m, 3]
            _product(raw, values, code, x, first, stop, int8_here and (code == 3 or code == 4 or code == 7),
                     half, xl, xh, xs, q, dx, xsq, qsum, out[at: at + rows])


def _barrier(address, parts):  # pragma: no cover - compiled
    """Wait until every part arrived (int64 counter at `address`, generation at + 8): the
    last to arrive resets the counter and moves the generation on; the others spin on it
    (then yield, when it takes long: another process may hold their CPU)."""
    if parts == 1:
        return
    generation = _atomic_load(address + 8)  # noqa: F821 - bound when compiled
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
        s[t] = _exp32(s[t] - top)  # noqa: F821 - bound when compiled


def _score(q, key, scale):  # pragma: no cover - compiled
    """q . key * scale, float32 (summed in any order)."""
    s = np.float32(0.0)
    for e in range(q.shape[0]):
        s += q[e] * key[e]
    return s * scale


def _attend(h, g, layer, slot, E, scale, rotated, heads, kv_heads, keys, vals, scores, mixed,
            attended):  # pragma: no cover - compiled
    """Head h's query (in `rotated`) over the cached keys of group g and its own new key
    (the cache's slot is written by part 0; every part reads the new key and value from its
    own `rotated`), in float32 as the module path's attention: scores, their exps by a
    vectorized polynomial, the weighted values, one division by the exps' sum at the end."""
    q = rotated[h * E: (h + 1) * E]
    new_key = rotated[(heads + g) * E: (heads + g + 1) * E]
    new_value = rotated[(heads + kv_heads + g) * E: (heads + kv_heads + g + 1) * E]
    scale32 = np.float32(scale)
    top = np.float32(-np.inf)
    for t in range(slot):
        scores[t] = _score(q, keys[layer, g, t], scale32)
        top = max(top, scores[t])
    scores[slot] = _score(q, new_key, scale32)
    top = max(top, scores[slot])
    _exp_shifted(scores, slot + 1, top)
    total = np.float32(0.0)
    for t in range(slot + 1):
        total += scores[t]
    for e in range(E):
        mixed[e] = scores[slot] * new_value[e]
    for t in range(slot):
        w = scores[t]
        value = vals[layer, g, t]
        for e in range(E):
            mixed[e] += w * value[e]
    inverse = np.float32(1.0) / total
    for e in range(E):
        attended[h * E + e] = mixed[e] * inverse


def _step(part, parts, barrier, token, slot, table, orders, norms, floats, cos, sin, keys, vals, heads, kv_heads, E,
          int8, half, shared, logits):  # pragma: no cover - compiled
    """Part `part` of one token through every layer (see the module docstring).

    token: the id; slot: its index in the cache (the cached length before it); cos, sin (E,)
    its rotary tables; keys, vals (L, Hkv, max, E) float32, this sequence's cache, written at
    `slot` (by part 0); floats: (scale, eps of each norm); shared: float32 scratch for the
    products' outputs and the attention's (every part writes its share)."""
    layers = keys.shape[0]
    embed = MATRICES_PER_LAYER * layers
    d = table[embed, 4]
    ff = table[4, 1]
    scale = floats[0]
    widest = max(d, ff, heads * E)
    xl = np.empty(widest // 2 + 16, np.float32)  # this part's scratch
    xh = np.empty(widest // 2 + 16, np.float32)
    xs = np.empty(widest // 32 + 1, np.float32)
    q8 = np.empty(widest + 32, np.int8)
    dx = np.empty(widest // 32 + 1, np.float32)
    xsq = np.empty(widest // 32 + 1, np.float32)
    qsum = np.empty(widest // 32 + 1, np.int32)
    row = np.empty(d, np.float32)
    raw = carray(_u8(table[embed, 0]), (table[embed, 1], table[embed, 2]))  # noqa: F821 - bound when compiled
    values = carray(_i8(table[embed, 0]), (table[embed, 1], table[embed, 2]))  # noqa: F821
    _dequantize_row(raw, values, token, table[embed, 3], half, row)  # noqa: F821
    x = row.astype(np.float64)  # the residual stream (each part's own, the same bits)
    normed = np.empty(d, np.float32)
    qkv_rows = (heads + 2 * kv_heads) * E
    rotated = np.empty(qkv_rows, np.float32)
    scores = np.empty(slot + 1, np.float32)
    mixed = np.empty(E, np.float32)
    hidden = np.empty(ff, np.float32)
    qkv = shared[:qkv_rows]  # written by the parts, read whole after a barrier
    attended = shared[qkv_rows: qkv_rows + heads * E]
    projected = shared[qkv_rows + heads * E: qkv_rows + heads * E + d]
    gate_up = shared[qkv_rows + heads * E + d: qkv_rows + heads * E + d + 2 * ff]
    group = heads // kv_heads
    per_part = (heads + parts - 1) // parts
    for layer in range(layers):
        base = MATRICES_PER_LAYER * layer
        # attention
        weight = carray(_f32(norms[2 * layer]), (d,))  # noqa: F821
        _rms_norm(x, weight, floats[1 + 2 * layer], normed)
        _group(table, base, 3, normed, part, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum, qkv)
        _barrier(barrier, parts)
        order = orders[layer]  # (Hq E + Hkv E,): the query and key rows in output order
        for i in range(order.shape[0]):
            rotated[i] = qkv[order[i]]
        for i in range(order.shape[0], qkv_rows):
            rotated[i] = qkv[i]
        _rotate(rotated[: heads * E], heads, E, cos, sin)
        _rotate(rotated[heads * E: (heads + kv_heads) * E], kv_heads, E, cos, sin)
        if part == 0:
            for g in range(kv_heads):
                for e in range(E):
                    keys[layer, g, slot, e] = rotated[(heads + g) * E + e]
                    vals[layer, g, slot, e] = rotated[(heads + kv_heads + g) * E + e]
        for h in range(part * per_part, min(heads, (part + 1) * per_part)):
            _attend(h, h // group, layer, slot, E, scale, rotated, heads, kv_heads, keys, vals, scores, mixed, attended)
        _barrier(barrier, parts)
        _group(table, base + 3, 1, attended, part, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum, projected)
        _barrier(barrier, parts)
        for i in range(d):
            x[i] += projected[i]
        # feed-forward
        weight = carray(_f32(norms[2 * layer + 1]), (d,))  # noqa: F821
        _rms_norm(x, weight, floats[2 + 2 * layer], normed)
        _group(table, base + 4, 2, normed, part, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum, gate_up)
        _barrier(barrier, parts)
        for i in range(ff):
            gate = gate_up[i]
            hidden[i] = gate / (np.float32(1.0) + np.exp(min(-gate, np.float32(80.0)))) * gate_up[ff + i]
        _group(table, base + 6, 1, hidden, part, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum, projected)
        _barrier(barrier, parts)
        for i in range(d):
            x[i] += projected[i]
    weight = carray(_f32(norms[2 * layers]), (d,))  # noqa: F821
    _rms_norm(x, weight, floats[1 + 2 * layers], normed)
    _group(table, embed + 1, 1, normed, part, parts, int8, half, xl, xh, xs, q8, dx, xsq, qsum, logits)


def _step_entry(frame_address, part):  # pragma: no cover - compiled
    """The native entry: the frame's arrays (see the module docstring), then `_step`."""
    frame = carray(_i64(frame_address), (FRAME,))  # noqa: F821 - bound when compiled
    layers, heads, kv_heads, E = frame[LAYERS], frame[HEADS], frame[KV_HEADS], frame[HEAD_DIM]
    matrices = frame[MATRICES]
    table = carray(_i64(frame[TABLE]), (matrices, TABLE_COLUMNS))  # noqa: F821
    orders = carray(_i64(frame[ORDERS]), (layers, (heads + kv_heads) * E))  # noqa: F821
    norms = carray(_i64(frame[NORMS]), (2 * layers + 1,))  # noqa: F821
    floats = carray(_f64(frame[FLOATS]), (2 * layers + 2,))  # noqa: F821
    cos = carray(_f32(frame[COS]), (E,))  # noqa: F821
    sin = carray(_f32(frame[SIN]), (E,))  # noqa: F821
    cache = (layers, kv_heads, frame[MAX_LENGTH], E)
    keys = carray(_f32(frame[KEYS]), cache)  # noqa: F821
    vals = carray(_f32(frame[VALUES]), cache)  # noqa: F821
    half = carray(_f32(frame[HALF]), (1 << 16,))  # noqa: F821
    logits = carray(_f32(frame[LOGITS]), (frame[VOCAB],))  # noqa: F821
    ff = table[4, 1]
    d = table[MATRICES_PER_LAYER * layers, 4]
    shared = carray(_f32(frame[SHARED]), ((heads + 2 * kv_heads) * E + heads * E + d + 2 * ff,))  # noqa: F821
    _step(part, frame[PARTS], frame[BARRIER], frame[TOKEN], frame[SLOT], table, orders, norms, floats, cos, sin,
          keys, vals, heads, kv_heads, E, frame[INT8] != 0, half, shared, logits)


def shared_size(heads: int, kv_heads: int, E: int, d: int, ff: int) -> int:
    """float32 elements of the step's SHARED scratch."""
    return (heads + 2 * kv_heads) * E + heads * E + d + 2 * ff


_SOURCES = {f.__name__: f for f in (_prepare, _product, _group, _barrier, _rms_norm, _rotate, _score, _attend,
                                     _step)}
_EXACT = dict(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")


@lru_cache(maxsize=1)
def compiled():
    """Bind the step's compiled pieces into this module's globals (numba compiles
    `_step_entry`, the native entry, from them: `attnkit.kernels.native`)."""
    nb = kernels.numba()
    loops = quant._compiled()
    g = globals()
    g.update(native.helpers())
    g.update({
        "carray": nb.carray,
        "_quantize_x": loops["quantize_x"], "_dequantize_row": quant._dequantize_row, "_split_x": quant._split_x,
        "_part_rows": quant._part_rows,
        "_q4_1": loops["q4_1"], "_q4_0": loops["q4_0"], "_q8_0": loops["q8_0"], "_rows": loops["rows"],
        "_int8": loops["int8"],
    })
    from attnkit.kernels import _loops  # numba's njit functions: imported when compiling only

    g["_exp32"] = _loops.exp32
    g["_exp_shifted"] = nb.njit(**_EXACT)(_exp_shifted)
    options = dict(cache=True, fastmath=native.FASTMATH, nogil=True)
    for name, fn in _SOURCES.items():
        g[name] = nb.njit(**options)(fn)
    return g["_step"]


def _entry_sources() -> dict:
    compiled()
    return {"step": _step_entry}


def _entries() -> native.Entries:
    """This module's native entry ("step"; `attnkit.kernels.native`)."""
    return native.entries("decode", _entry_sources)


class _Frame:
    """One model's frame for the step (addresses of its arrays, which it keeps alive), the
    barrier and the shared scratch; the per-step fields are set by `decode_step`, one step
    at a time (`lock`)."""

    def __init__(self, arrays: tuple) -> None:
        table, orders, norms, floats, heads, kv_heads, E, vocab, keep = arrays
        layers = orders.shape[0]
        d, ff = int(table[MATRICES_PER_LAYER * layers, 4]), int(table[4, 1])
        self.keep = (table, orders, norms, floats, keep)
        self.barrier = np.zeros(2, np.int64)
        self.lock = threading.Lock()
        self.shared = np.empty(shared_size(heads, kv_heads, E, d, ff), np.float32)
        self.vocab = vocab
        self.embed_rows = int(table[MATRICES_PER_LAYER * layers, 1])
        frame = self.frame = np.zeros(FRAME, np.int64)
        frame[[TABLE, MATRICES, ORDERS, NORMS, FLOATS, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, HALF, BARRIER,
               SHARED]] = [table.ctypes.data, table.shape[0], orders.ctypes.data, norms.ctypes.data,
                           floats.ctypes.data, layers, heads, kv_heads, E, vocab, quant._half_table().ctypes.data,
                           self.barrier.ctypes.data, self.shared.ctypes.data]


def prepare(table: np.ndarray, orders: np.ndarray, norms: list, eps: list, scale: float, heads: int, kv_heads: int,
            E: int, vocab: int) -> _Frame:
    """A model's frame for `decode_step`.

    Arguments:
        table: (M, 6) int64 as the module docstring describes (the addresses of the blocks,
            which the caller keeps alive with the model).
        orders: (L, Hq E + Hkv E) int64.
        norms: the 2L + 1 RMSNorm weights, float32 C-contiguous (read where they are: an
            edit in place reaches the step).
        eps: their epsilons; scale: the score scale.
        heads, kv_heads, E, vocab: the model's sizes.
    """
    addresses = np.array([n.ctypes.data for n in norms], np.int64)
    floats = np.array([scale, *eps], np.float64)
    return _Frame((np.ascontiguousarray(table, np.int64), np.ascontiguousarray(orders, np.int64), addresses, floats,
                   heads, kv_heads, E, vocab, tuple(norms)))


def decode_step(token: int, slot: int, frame: _Frame, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                values: np.ndarray, *, int8: bool = False, parts: int = 1) -> np.ndarray:
    """Logits (V,) float32 of token `token` at cache index `slot`.

    Arguments:
        frame: the model's, from `prepare`.
        cos, sin: (E,) float32 C-contiguous, the token's rotary tables.
        keys, values: (L, Hkv, max, E) float32 C-contiguous, the sequence's cache (the new key
            and value are written at `slot`).
        int8: the products of Q4_0, Q4_1 and Q8_0 on 8-bit activations.
        parts: threads (the calling thread runs part 0, the pool's threads the others).
    """
    if not (keys.flags.c_contiguous and values.flags.c_contiguous and keys.dtype == np.float32
            and values.dtype == np.float32 and keys.shape == values.shape):
        raise ValueError(f"expected two C-contiguous float32 caches of one shape, got {keys.shape} {keys.dtype} "
                         f"and {values.shape} {values.dtype}")
    f = frame.frame
    E, rows = int(f[HEAD_DIM]), frame.embed_rows
    if not (0 <= token < rows and 0 <= slot < keys.shape[2]):
        raise ValueError(f"expected a token in [0, {rows}) at a slot in [0, {keys.shape[2]}), got {token} at {slot}")
    if keys.shape[:2] != (f[LAYERS], f[KV_HEADS]) or keys.shape[3] != E:
        raise ValueError(f"expected caches of shape ({f[LAYERS]}, {f[KV_HEADS]}, max, {E}), got {keys.shape}")
    if any(t.shape != (E,) or t.dtype != np.float32 or not t.flags.c_contiguous for t in (cos, sin)):
        raise ValueError(f"expected cos and sin of shape ({E},), float32 and C-contiguous, got {cos.shape} "
                         f"{cos.dtype} and {sin.shape} {sin.dtype}")
    entry = _entries()["step"]
    logits = np.empty(frame.vocab, np.float32)
    with frame.lock:  # one step at a time on a frame (two threads may generate with one model)
        f[TOKEN], f[SLOT], f[PARTS], f[INT8] = token, slot, parts, int(bool(int8))
        f[COS], f[SIN], f[KEYS], f[VALUES], f[MAX_LENGTH] = (cos.ctypes.data, sin.ctypes.data, keys.ctypes.data,
                                                            values.ctypes.data, keys.shape[2])
        f[LOGITS] = logits.ctypes.data
        frame.barrier[0] = 0
        address = f.ctypes.data
        if parts == 1:
            entry(address, 0)
        else:
            from attnkit.runtime import worker_pool

            pool = worker_pool(parts - 1)
            others = [pool.submit(entry, address, p) for p in range(1, parts)]
            entry(address, 0)
            for other in others:
                other.result()
    return logits
