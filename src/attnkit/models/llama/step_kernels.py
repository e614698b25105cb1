"""The compiled code of a Llama decode step: one call computes the logits of N token rows.

A decode step (one new token of one sequence) is 211 small products and about 400 small
element-wise operations between them; run one by one from Python, the operations cost as
much as the products. `_step` runs the whole step inside one compiled function, for N token
rows at once (the tokens of many sequences, or a chunk of one prompt: a batched step): the
embedding rows, and in every layer RMSNorm, the query/key/value products, rotary embedding,
each row's new key and value written into the paged cache at its slot (through its
sequence's block table), attention of each row's query over its sequence's cached keys
(grouped-query heads; a sliding layer's last `window` keys), the output product and
residual, RMSNorm, gate and up products, SiLU(gate) * up, the down product and residual;
then the final norm and the output head, for the rows whose logits are asked only. It
computes what `LlamaBlock.forward` computes on a `KVCache` (the residual stream in float64,
the sublayers in float32), so its logits agree with the module path's to float32 rounding.
A contiguous `KVCache` of B sequences is the paged cache whose blocks are max_length long
(its (L, B, Hkv, max, E) stores are already layer-major): one sequence's step is the N = 1
case (`step.decode_step`).

Gemma 3's step is the same code with the frame's flags set (`Gemma3Block.forward`'s
arithmetic): `qk_norm` (each head's query and key RMS-normalized over E, float32, before
the rotation), `post_norms` (each sublayer's output RMS-normalized, float32, before the
float64 residual sum), `gelu_tanh` (tanh-GELU instead of SiLU), the embedding's multiplier
and the logits' soft cap (the frame's floats), and `ropes` (each layer's rotary table: cos
and sin are (kinds, N, E)).

Products are the loops of `attnkit.quant` on row ranges, X (N, K) against W's rows, with
float32 activations (the default: `_matmat_*`, each block decoded once for four rows of X)
or, with `quant.activations("int8")`, on 8-bit activations as llama.cpp runs them.

Batch invariance: every (row, output) dot product is computed by the same code in the
same order whatever N is and whichever part computes it (the loops' 4-, 2- and 1-row forms
give the same bits; products split over parts by W's rows, attention by (row, head) pairs;
nothing is summed across rows or parts), and a row attends over its keys in position
order: a row's logits do not depend on the other rows of the step, on how its sequence's
earlier keys were computed, or on the thread count.

Threads: the step is one native entry, `_step_entry(frame, part)`, called once per thread
with `part` 0 .. parts - 1. Every product's rows are split in `parts` ranges and each part
computes its range; the (row, head) pairs of attention are split the same way, and each
part writes the keys and values of its share of the rows. The parts meet at a barrier (a
counter and a generation number, spun on with `pause`, then yielding) after each product
group, after the keys and values are written and after attention: six a layer. What is
cheap and read whole (the residual stream, the norms, SiLU, the rotary embedding) each part
computes for itself, in the same order, so every part holds the same bits without waiting
for another.

What crosses into compiled code is named: the frame is one record of the structured dtype
`FRAME` (sizes, per-step values and the addresses of the arrays), which `_step_entry` turns
into a `StepArrays` tuple of arrays; the matrices' table has the columns `TABLE_COLUMNS`
names. The compiled functions are built by `build()` into a `CompiledStep`, each bound to
an explicit namespace (the loops it calls, numba's helpers): no module's globals change.
"""

from __future__ import annotations

import hashlib
import types
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from attnkit.models.llama.step_pieces import _attend, _barrier, _exp_shifted, _gated, _residual, _rms_norm, \
    _rms_norm32, _rotate, _score, _share

__all__ = ["FLOATS_BEFORE_EPS", "FRAME", "LAYER_NORMS", "MATRICES_PER_LAYER", "TABLE_COLUMNS", "CompiledStep",
           "Scratch", "StepArrays", "build", "shared_size", "source_digest"]

MATRICES_PER_LAYER = 7  # query, key, value, output, gate, up, down
LAYER_NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")
"""A layer's norms in the frame's order: the first two always, the post-sublayer pair with
`post_norms`, the query/key pair with `qk_norm` (those two over the head dimension)."""
FLOATS_BEFORE_EPS = 3  # the score scale, the embedding's scale, the logits' soft cap
TABLE_COLUMNS = ("address", "rows", "row_bytes", "code", "columns", "offset")
"""The columns of the matrices' table (int64, one row a matrix): the blocks' address, rows,
bytes per row, ggml's type number (`attnkit.quant.GGMLType`), K, and the offset of
its rows in its group's output."""
(ADDRESS, ROWS, ROW_BYTES, CODE, COLUMNS, OFFSET) = range(len(TABLE_COLUMNS))

FRAME = np.dtype([
    # set once per model (`prepare`)
    ("table", np.int64),  # (matrices, 6) int64: 7 a layer (query, key, value, output, gate, up, down),
    #                       then the embedding and the output head
    ("matrices", np.int64),  # rows of the table
    ("orders", np.int64),  # (L, Hq E + Hkv E) int64: the output order of each layer's query and key rows
    ("norms", np.int64),  # (S L + 1,) int64: addresses of the RMSNorm weights, S (`norm_stride`) a layer in
    #                       `LAYER_NORMS` order (attention, feed-forward[, post-attention, post-feed-forward]
    #                       [, query, key]), then the final norm
    ("floats", np.int64),  # (FLOATS_BEFORE_EPS + S L + 1,) float64: the score scale, the embedding's scale, the
    #                        logits' soft cap (0: none), then each norm's eps
    ("layers", np.int64),
    ("heads", np.int64),  # query heads
    ("kv_heads", np.int64),
    ("head_dim", np.int64),
    ("vocab", np.int64),
    ("half", np.int64),  # (65536,) float32: every float16 bit pattern's value
    ("barrier", np.int64),  # (2,) int64: the parts' counter and generation
    ("windows", np.int64),  # (L,) int64: each layer's sliding window (a query sees its last `window` keys,
    #                         itself included), 0: none
    ("ropes", np.int64),  # (L,) int64: each layer's rotary table (an index into cos and sin's first axis)
    ("rope_kinds", np.int64),  # how many rotary tables (Llama 1; Gemma 3 2: global, local)
    ("post_norms", np.int64),  # 1: a norm after each sublayer too (Gemma 3), applied before the residual sum
    ("qk_norm", np.int64),  # 1: queries and keys RMS-normalized per head before the rotation (Gemma 3)
    ("gelu_tanh", np.int64),  # 1: the gate through tanh-GELU (Gemma 3), 0: SiLU (Llama)
    # set by each step (`batch_step`)
    ("rows", np.int64),  # N, the step's token rows
    ("tokens", np.int64),  # (N,) int64: each row's token
    ("slots", np.int64),  # (N,) int64: each row's index in its sequence's cache
    ("starts", np.int64),  # (N,) int64: the first cached key each row attends to (after left padding)
    ("tables", np.int64),  # (N, width) int32: each row's sequence's block table
    ("width", np.int64),
    ("outputs", np.int64),  # (N,) int64: the row of `logits` a row's logits go in, -1: none
    ("outputs_count", np.int64),
    ("parts", np.int64),
    ("int8", np.int64),  # 1: the products of Q4_0, Q4_1 and Q8_0 on 8-bit activations
    ("cos", np.int64),  # (rope_kinds, N, E) float32: the rows' rotary tables, one per kind of layer
    ("sin", np.int64),
    ("keys", np.int64),  # (L, blocks, Hkv, block_size, E) float32: the paged cache
    ("values", np.int64),
    ("blocks", np.int64),
    ("block_size", np.int64),
    ("logits", np.int64),  # (outputs_count, vocab) float32: the output
    ("shared", np.int64),  # float32 scratch the parts write their shares into (`shared_size`)
])
"""The frame of one model's step: one record, every field int64 (an address, a size or a
flag), read by `_step_entry` by name."""
_FRAME_WORDS = FRAME.itemsize // 8


class StepArrays(NamedTuple):
    """The arrays a step reads and writes (viewed from the frame's addresses)."""

    table: Any  # (matrices, 6) int64
    orders: Any  # (L, Hq E + Hkv E) int64
    norms: Any  # (S L + 1,) int64 addresses
    floats: Any  # (FLOATS_BEFORE_EPS + S L + 1,) float64
    tokens: Any  # (N,) int64
    slots: Any  # (N,) int64
    starts: Any  # (N,) int64
    tables: Any  # (N, width) int32
    outputs: Any  # (N,) int64
    cos: Any  # (rope_kinds, N, E) float32
    sin: Any  # (rope_kinds, N, E) float32
    keys: Any  # (L, blocks, Hkv, block_size, E) float32
    values: Any  # (L, blocks, Hkv, block_size, E) float32
    half: Any  # (65536,) float32
    shared: Any  # float32 scratch
    logits: Any  # (outputs_count, V) float32
    windows: Any  # (L,) int64, 0: no window
    ropes: Any  # (L,) int64, each layer's rotary table


class Scratch(NamedTuple):
    """One part's scratch for preparing a product's input: x's halves and block sums (the
    float32 Q4 loops), or its 8-bit blocks, scales, sums (the int8 loops), for N rows of x.
    1-D, long enough; viewed as (N, ...) C-contiguous arrays."""

    xl: Any
    xh: Any
    xs: Any
    q8: Any
    dx: Any
    xsq: Any
    qsum: Any


def shared_size(heads: int, kv_heads: int, E: int, d: int, ff: int, rows: int = 1) -> int:
    """float32 elements of the step's shared scratch for `rows` token rows: per row the
    query/key/value rows, the attended heads, the projected row, gate and up."""
    return rows * ((heads + 2 * kv_heads) * E + heads * E + d + 2 * ff)


# ----------------------------------------------------------------------------- compiled pieces
# Names marked F821 are bound in the namespace `build()` gives these functions.


def _prepare(x, int8, half_split, scratch):  # pragma: no cover - compiled
    """x (N, K) float32 prepared for the products: each row's halves and block sums
    (float32 Q4 loops), or its 8-bit blocks (int8 loops)."""
    n, K = x.shape
    blocks = K // 32
    s = scratch
    if int8:
        _quantize_x(x, x.view(np.uint32), s.q8[:n * K].reshape(n, K),  # noqa: F821
                    s.dx[:n * blocks].reshape(n, blocks), s.xsq[:n * blocks].reshape(n, blocks),
                    s.qsum[:n * blocks].reshape(n, blocks))
    elif half_split:
        xl = s.xl[:n * (K // 2)].reshape(n, K // 2)
        xh = s.xh[:n * (K // 2)].reshape(n, K // 2)
        xs = s.xs[:n * blocks].reshape(n, blocks)
        for i in range(n):
            _split_x(x[i], xl[i], xh[i], xs[i])  # noqa: F821


def _runs_int8(code):  # pragma: no cover - compiled
    """Whether blocks of type `code` have an 8-bit-activation product (`quant.INT8_TYPES`)."""
    return code == Q4_0 or code == Q4_1 or code == Q8_0  # noqa: F821


def _product(raw, values, code, x, first, stop, int8, half, scratch, out):  # pragma: no cover - compiled
    """Rows first .. stop - 1 of x @ W.T into out (N, R), W given as blocks of type `code`;
    x (N, K) and the prepared scratch C-contiguous (the loops keep their unit strides).
    Every out[i, r] is computed by the same instructions whatever N is (the loops of
    `attnkit.quant.loops`: `_matmat_*` give the bits of the one-row loop)."""
    n, K = x.shape
    blocks = K // 32
    s = scratch
    if int8 and _runs_int8(code):
        _int8(raw, code, s.q8[:n * K].reshape(n, K), s.dx[:n * blocks].reshape(n, blocks),  # noqa: F821
              s.xsq[:n * blocks].reshape(n, blocks), s.qsum[:n * blocks].reshape(n, blocks), out, first, stop)
    elif code == Q4_1 or code == Q4_0:  # noqa: F821
        xl = s.xl[:n * (K // 2)].reshape(n, K // 2)
        xh = s.xh[:n * (K // 2)].reshape(n, K // 2)
        _matmat_q4(raw, code, xl, xh, s.xs[:n * blocks].reshape(n, blocks), out, first, stop)  # noqa: F821
    elif code == Q8_0:  # noqa: F821
        _matmat_q8_0(raw, x, out, first, stop)  # noqa: F821
    else:
        _rows(raw, values, code, half, x, out, first, stop)  # noqa: F821


def _group(table, start, count, x, part, parts, int8, half, scratch, out):  # pragma: no cover - compiled
    """This part's share of x (N, K) @ W.T for matrices start .. start + count - 1 (one
    input): rows part * step .. of each matrix (the split is by W's rows, never by x's: a
    row of x is never summed across parts), written at the matrix's offset in `out` (N, w).
    x is prepared (split, or quantized) into this part's scratch."""
    int8_here = int8 and _runs_int8(table[start, CODE]) and x.shape[1] % 32 == 0  # noqa: F821
    _prepare(x, int8_here, x.shape[1] % 32 == 0, scratch)
    for m in range(start, start + count):
        rows = table[m, ROWS]  # noqa: F821
        first, stop = _part_rows(rows, parts, part)  # noqa: F821
        if first < stop:
            raw = carray(_u8(table[m, ADDRESS]), (rows, table[m, ROW_BYTES]))  # noqa: F821
            values = carray(_i8(table[m, ADDRESS]), (rows, table[m, ROW_BYTES]))  # noqa: F821
            at = table[m, OFFSET]  # noqa: F821
            code = table[m, CODE]  # noqa: F821
            _product(raw, values, code, x, first, stop, int8_here and _runs_int8(code), half, scratch,
                     out[:, at: at + rows])


def _step(part, frame, arrays):  # pragma: no cover - compiled
    """Part `part` of N token rows through every layer (see the module docstring).

    frame: the `FRAME` record (sizes, rows, parts, int8, the barrier's address);
    arrays: the `StepArrays` it points at (each row's key and value written at its slot
    through its block table, by the part whose share of rows holds it)."""
    table, orders, norms, floats = arrays.table, arrays.orders, arrays.norms, arrays.floats
    keys, vals, cos, sin, half, shared = arrays.keys, arrays.values, arrays.cos, arrays.sin, arrays.half, arrays.shared
    tokens, slots, tables, outputs = arrays.tokens, arrays.slots, arrays.tables, arrays.outputs
    heads, kv_heads, E, size = frame.heads, frame.kv_heads, frame.head_dim, frame.block_size
    parts, barrier, int8, n = frame.parts, frame.barrier, frame.int8 != 0, frame.rows
    post_norms, qk_norm, gelu, ropes = frame.post_norms != 0, frame.qk_norm != 0, frame.gelu_tanh != 0, arrays.ropes
    stride = 2 + 2 * frame.post_norms + 2 * frame.qk_norm  # norms a layer (LAYER_NORMS)
    qk_at = 2 + 2 * frame.post_norms  # the query norm's place in a layer's norms
    layers = keys.shape[0]
    embed = MATRICES_PER_LAYER * layers  # noqa: F821
    d = table[embed, COLUMNS]  # noqa: F821
    ff = table[4, ROWS]  # noqa: F821 - the gate's rows
    widest = max(d, ff, heads * E)
    halves = n * (widest // 2) + 16
    scratch = Scratch(np.empty(halves, np.float32), np.empty(halves, np.float32),  # noqa: F821
                      np.empty(n * (widest // 32) + 1, np.float32), np.empty(n * widest + 32, np.int8),
                      np.empty(n * (widest // 32) + 1, np.float32), np.empty(n * (widest // 32) + 1, np.float32),
                      np.empty(n * (widest // 32) + 1, np.int32))
    row = np.empty(d, np.float32)
    raw = carray(_u8(table[embed, ADDRESS]), (table[embed, ROWS], table[embed, ROW_BYTES]))  # noqa: F821
    values = carray(_i8(table[embed, ADDRESS]), (table[embed, ROWS], table[embed, ROW_BYTES]))  # noqa: F821
    x = np.empty((n, d), np.float64)  # the residual stream (each part's own, the same bits)
    for i in range(n):
        _dequantize_row(raw, values, tokens[i], table[embed, CODE], half, row)  # noqa: F821
        for k in range(d):
            x[i, k] = np.float64(row[k]) * floats[1]  # Gemma's sqrt(d) in float64 (1.0: Llama)
    normed = np.empty((n, d), np.float32)
    qkv_rows = (heads + 2 * kv_heads) * E
    rotated = np.empty((n, qkv_rows), np.float32)
    longest = 0
    for i in range(n):
        longest = max(longest, slots[i] + 1)
    scores = np.empty(longest, np.float32)
    mixed = np.empty(E, np.float32)
    hidden = np.empty((n, ff), np.float32)
    at = 0
    qkv = shared[at: at + n * qkv_rows].reshape(n, qkv_rows)  # written by the parts, read whole after a barrier
    at += n * qkv_rows
    attended = shared[at: at + n * heads * E].reshape(n, heads * E)
    at += n * heads * E
    projected = shared[at: at + n * d].reshape(n, d)
    at += n * d
    gate_up = shared[at: at + n * 2 * ff].reshape(n, 2 * ff)
    mine, mine_stop = _share(n, parts, part)  # the rows whose keys and values this part writes
    pairs_first, pairs_stop = _share(n * heads, parts, part)  # the (row, head) pairs it attends
    for layer in range(layers):
        base = MATRICES_PER_LAYER * layer  # noqa: F821
        at_norm = stride * layer
        eps_at = FLOATS_BEFORE_EPS + at_norm  # noqa: F821
        kind = ropes[layer]
        # attention
        weight = carray(_f32(norms[at_norm]), (d,))  # noqa: F821
        for i in range(n):
            _rms_norm(x[i], weight, floats[eps_at], normed[i])
        _group(table, base, 3, normed, part, parts, int8, half, scratch, qkv)
        _barrier(barrier, parts)
        order = orders[layer]  # (Hq E + Hkv E,): the query and key rows in output order
        for i in range(n):  # (row views: 1-D loops, as one row's step runs them)
            source, into = qkv[i], rotated[i]
            for k in range(order.shape[0]):
                into[k] = source[order[k]]
            for k in range(order.shape[0], qkv_rows):
                into[k] = source[k]
            if qk_norm:  # each head's query and key over E, before the rotation
                q_weight = carray(_f32(norms[at_norm + qk_at]), (E,))  # noqa: F821
                k_weight = carray(_f32(norms[at_norm + qk_at + 1]), (E,))  # noqa: F821
                for h in range(heads):
                    _rms_norm32(into[h * E: (h + 1) * E], q_weight, floats[eps_at + qk_at], into[h * E: (h + 1) * E])
                for h in range(heads, heads + kv_heads):
                    _rms_norm32(into[h * E: (h + 1) * E], k_weight, floats[eps_at + qk_at + 1],
                                into[h * E: (h + 1) * E])
            _rotate(into[: heads * E], heads, E, cos[kind, i], sin[kind, i])
            _rotate(into[heads * E: (heads + kv_heads) * E], kv_heads, E, cos[kind, i], sin[kind, i])
        for i in range(mine, mine_stop):
            block, offset = tables[i, slots[i] // size], slots[i] % size
            for g in range(kv_heads):
                for e in range(E):
                    keys[layer, block, g, offset, e] = rotated[i, (heads + g) * E + e]
                    vals[layer, block, g, offset, e] = rotated[i, (heads + kv_heads + g) * E + e]
        _barrier(barrier, parts)
        for pair in range(pairs_first, pairs_stop):
            _attend(pair // heads, pair % heads, layer, frame, arrays, rotated, scores, mixed, attended)
        _barrier(barrier, parts)
        _group(table, base + 3, 1, attended, part, parts, int8, half, scratch, projected)
        _barrier(barrier, parts)
        post = at_norm + 2 if post_norms else 0  # (an index in range when unused)
        _residual(x, projected, post_norms, norms[post], floats[FLOATS_BEFORE_EPS + post], normed)  # noqa: F821
        # feed-forward
        weight = carray(_f32(norms[at_norm + 1]), (d,))  # noqa: F821
        for i in range(n):
            _rms_norm(x[i], weight, floats[eps_at + 1], normed[i])
        _group(table, base + 4, 2, normed, part, parts, int8, half, scratch, gate_up)
        _barrier(barrier, parts)
        for i in range(n):
            _gated(gate_up[i], ff, gelu, hidden[i])
        _group(table, base + 6, 1, hidden, part, parts, int8, half, scratch, projected)
        _barrier(barrier, parts)
        _residual(x, projected, post_norms, norms[post + 1], floats[FLOATS_BEFORE_EPS + post + 1], normed)  # noqa: F821
    # the output head, for the rows that asked only (the largest product)
    wanted = np.empty((frame.outputs_count, d), np.float32)
    weight = carray(_f32(norms[stride * layers]), (d,))  # noqa: F821
    for i in range(n):
        if outputs[i] >= 0:
            _rms_norm(x[i], weight, floats[FLOATS_BEFORE_EPS + stride * layers], wanted[outputs[i]])  # noqa: F821
    if frame.outputs_count > 0:
        _group(table, embed + 1, 1, wanted, part, parts, int8, half, scratch, arrays.logits)
        cap = np.float32(floats[2])
        if cap > 0:  # cap * tanh(logits / cap) on the columns this part computed, in float32
            first, stop = _part_rows(table[embed + 1, ROWS], parts, part)  # noqa: F821
            logits = arrays.logits
            for r in range(frame.outputs_count):
                for v in range(first, stop):
                    logits[r, v] = np.tanh(logits[r, v] / cap) * cap


def _step_entry(frame_address, part):  # pragma: no cover - compiled
    """The native entry: the `FRAME` record at `frame_address` and the arrays it points at,
    then `_step`."""
    frame = carray(_i64(frame_address), (FRAME_WORDS,)).view(FRAME)[0]  # noqa: F821
    layers, heads, kv_heads, E, n = frame.layers, frame.heads, frame.kv_heads, frame.head_dim, frame.rows
    norms = (2 + 2 * frame.post_norms + 2 * frame.qk_norm) * layers + 1
    table = carray(_i64(frame.table), (frame.matrices, 6))  # noqa: F821
    d = table[MATRICES_PER_LAYER * layers, COLUMNS]  # noqa: F821
    cache = (layers, frame.blocks, kv_heads, frame.block_size, E)
    arrays = StepArrays(  # noqa: F821
        table,
        carray(_i64(frame.orders), (layers, (heads + kv_heads) * E)),  # noqa: F821
        carray(_i64(frame.norms), (norms,)),  # noqa: F821
        carray(_f64(frame.floats), (FLOATS_BEFORE_EPS + norms,)),  # noqa: F821
        carray(_i64(frame.tokens), (n,)),  # noqa: F821
        carray(_i64(frame.slots), (n,)),  # noqa: F821
        carray(_i64(frame.starts), (n,)),  # noqa: F821
        carray(_i32(frame.tables), (n, frame.width)),  # noqa: F821
        carray(_i64(frame.outputs), (n,)),  # noqa: F821
        carray(_f32(frame.cos), (frame.rope_kinds, n, E)),  # noqa: F821
        carray(_f32(frame.sin), (frame.rope_kinds, n, E)),  # noqa: F821
        carray(_f32(frame.keys), cache),  # noqa: F821
        carray(_f32(frame.values), cache),  # noqa: F821
        carray(_f32(frame.half), (1 << 16,)),  # noqa: F821
        carray(_f32(frame.shared),  # noqa: F821
               (n * ((heads + 2 * kv_heads) * E + heads * E + d + 2 * table[4, ROWS]),)),
        carray(_f32(frame.logits), (max(frame.outputs_count, 1), frame.vocab)),  # noqa: F821
        carray(_i64(frame.windows), (layers,)),  # noqa: F821
        carray(_i64(frame.ropes), (layers,)),  # noqa: F821
    )
    _step(part, frame, arrays)


# ----------------------------------------------------------------------------- building


class CompiledStep(NamedTuple):
    """The step's compiled functions: `step(part, frame, arrays)` (numba, for other compiled
    code) and `entry`, the Python function numba compiles as the native entry
    (`attnkit.kernels.native`), bound to the same namespace."""

    step: Any
    entry: Any
    namespace: dict


_SERIAL = (_prepare, _runs_int8, _product, _group, _barrier, _rms_norm, _rms_norm32, _rotate, _score, _attend,
           _residual, _share, _step)
_EXACT = dict(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")


def _bound(fn, namespace: dict):
    """`fn` with `namespace` as its globals (the same code, file and name: numba's on-disk
    cache finds it as it finds `fn`)."""
    clone = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__qualname__, clone.__module__, clone.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return clone


@lru_cache(maxsize=1)
def build() -> CompiledStep:
    """The step's functions compiled by numba, in one namespace that holds what they call:
    the products' loops (`attnkit.quant.compiled`), numba's helpers (`attnkit.kernels.native`),
    the type codes by name, the layout's names. Built once; only call when
    `attnkit.kernels.enabled()`."""
    from attnkit import kernels
    from attnkit.kernels import _loops, native  # _loops imports numba: only when compiling
    from attnkit.quant import GGMLType
    from attnkit.quant.compiled import compiled

    nb = kernels.numba()
    loops = compiled().loops
    codes = {kind.name: int(kind) for kind in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0)}  # ggml's numbers
    namespace: dict[str, Any] = {
        "np": np, "carray": nb.carray, **native.helpers(), **codes,
        "_quantize_x": loops["_quantize_x"], "_dequantize_row": loops["_dequantize_row"],
        "_split_x": loops["_split_x"], "_part_rows": loops["_part_rows"],
        "_rows": loops["_matvec_rows"], "_int8": loops["_matvec_int8"], "_exp32": _loops.exp32,
        "_matmat_q4": loops["_matmat_q4"], "_matmat_q8_0": loops["_matmat_q8_0"],
        "FRAME": FRAME, "FRAME_WORDS": _FRAME_WORDS, "MATRICES_PER_LAYER": MATRICES_PER_LAYER,
        "FLOATS_BEFORE_EPS": FLOATS_BEFORE_EPS,
        "ADDRESS": ADDRESS, "ROWS": ROWS, "ROW_BYTES": ROW_BYTES, "CODE": CODE, "COLUMNS": COLUMNS, "OFFSET": OFFSET,
        "StepArrays": StepArrays, "Scratch": Scratch,
    }
    namespace["_exp_shifted"] = nb.njit(**_EXACT)(_bound(_exp_shifted, namespace))
    namespace["_gated"] = nb.njit(**_EXACT)(_bound(_gated, namespace))
    options = dict(cache=True, fastmath=native.FASTMATH, nogil=True)
    for fn in _SERIAL:
        namespace[fn.__name__] = nb.njit(**options)(_bound(fn, namespace))
    return CompiledStep(namespace["_step"], _bound(_step_entry, namespace), namespace)


@lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of this file and `step_pieces`: the native library of the step is named by it
    (its folder is named by `attnkit.kernels`' sources, which do not include these files)."""
    digest = hashlib.sha1(Path(__file__).read_bytes())
    digest.update(Path(__file__).with_name("step_pieces.py").read_bytes())
    return digest.hexdigest()[:12]
