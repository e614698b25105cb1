"""The compiled loops: plain Python that numba compiles (`attnkit.quant.compiled`).

Each loop is the NumPy reference's computation (`attnkit.quant.reference`) for a range of
W's rows, written element by element so that numba compiles it to machine code:

- `_matvec_q4`, `_matvec_q8_0`: float32 x against Q4_0, Q4_1 or Q8_0 blocks, four rows
  at a time through the LLVM IR loops of `attnkit.quant.ir` (`_rows4f_*`);
- `_matmat_q4`, `_matmat_q8_0`: the same for many rows of x (a batched decode step), each
  block decoded once for four rows of x (`_rows4f4_*`), each sum the one-row loop's bits;
- `_quantize_x`, `_matvec_int8`: x quantized to 8 bits per block of 32, then exact
  integer block dot products (`_rows4_*`), as llama.cpp computes them;
- `_matvec_q5_0`, `_matvec_k`: float32 x against Q5_0, Q4_K or Q6_K blocks, four rows at
  a time through the IR loops `_rows4f_q5_0`, `_rows4f_q4_k`, `_rows4f_q6_k`
  (`_matvec_rows` sends those types there);
- `_dequantize_row`, `_dequantize_rows`, `_matvec_rows`: every type, a row into float32
  (what a prefill tile and the other types' products use);
- `product_entry`, `dequantize_entry`: the native entries (`attnkit.kernels.native`),
  `entry(frame address, part)`, the frame one record of `PRODUCT_FRAME` /
  `DEQUANTIZE_FRAME` (named fields, a NumPy structured dtype).

The names a loop calls but this file does not define (`_rows4f_q4_1`, `carray`, `_u8`,
the frames' pointers) are bound in the namespace `attnkit.quant.compiled` builds for
them; type codes are `GGMLType`'s, read into the module constants below (numba folds
them), never spelled as numbers.
"""

from __future__ import annotations

import numpy as np

from attnkit.quant.types import GGMLType

__all__ = ["DEQUANTIZE_FRAME", "LOOPS", "PRODUCT_FRAME", "frame"]

F32, F16, BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q5_0), int(GGMLType.Q5_1),
                                int(GGMLType.Q8_0))
Q4_K, Q5_K, Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q5_K), int(GGMLType.Q6_K)
Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_0_BYTES = (GGMLType.Q4_0.type_size, GGMLType.Q4_1.type_size,
                                                              GGMLType.Q5_0.type_size, GGMLType.Q5_1.type_size,
                                                              GGMLType.Q8_0.type_size)
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = GGMLType.Q4_K.type_size, GGMLType.Q5_K.type_size, GGMLType.Q6_K.type_size

PRODUCT_FRAME = np.dtype([
    ("raw", np.int64),          # address of W's blocks, (rows, row_bytes) uint8, C-contiguous
    ("rows", np.int64),         # R
    ("row_bytes", np.int64),    # bytes of one row of blocks
    ("type", np.int64),         # W's GGMLType
    ("columns", np.int64),      # K
    ("x", np.int64),            # address of x, (n, K) float32, C-contiguous
    ("n", np.int64),            # rows of x
    ("out", np.int64),          # address of out's first element, (n, R) float32 ...
    ("out_stride", np.int64),   # ... its rows this many elements apart
    ("parts", np.int64),        # how many parts split W's rows
    ("int8", np.int64),         # 1: x quantized to 8 bits (the `INT8_TYPES`)
    ("half", np.int64),         # address of the float16 -> float32 table (65,536 float32)
])
"""The product entry's frame: x (n, K) @ W.T into out, as one record (`frame`)."""

DEQUANTIZE_FRAME = np.dtype([
    ("raw", np.int64),          # address of W's blocks, (rows, row_bytes) uint8, C-contiguous
    ("rows", np.int64),
    ("row_bytes", np.int64),
    ("type", np.int64),         # W's GGMLType
    ("columns", np.int64),      # K
    ("start", np.int64),        # the first row dequantized ...
    ("count", np.int64),        # ... and how many
    ("out", np.int64),          # address of out, (count, K) float32, C-contiguous
    ("half", np.int64),         # address of the float16 -> float32 table
    ("parts", np.int64),
])
"""The dequantize entry's frame: rows start .. start + count of W into out."""


def frame(layout: np.dtype, **fields: int) -> np.ndarray:
    """One record of `layout` (a (1,) structured array), every field given by name."""
    try:
        values = [fields[name] for name in layout.names]
    except KeyError:
        values = None
    if values is None or len(fields) != len(layout.names):
        missing = sorted(set(layout.names) - set(fields))
        raise ValueError(f"expected the fields {', '.join(layout.names)}; missing {missing}, "
                         f"unknown {sorted(set(fields) - set(layout.names))}")
    return np.array(values, np.int64).view(layout)  # every field an int64, in order


# ----------------------------------------------------------------------------- products
def _matvec_q4(raw, code, xlo, xhi, xsum, out, first, stop):  # pragma: no cover - compiled
    """Q4_1 or Q4_0 (`code`, a GGMLType) on float32 x, four rows of W at a time through the IR
    loops `_rows4f_<kind>` (they share the loads of x; see `_rows4f_codegen`):

    Q4_1: W[r, 32b + j] = d (qs[j] & 15) + m,  W[r, 32b + 16 + j] = d (qs[j] >> 4) + m
    so  sum_k W[r, k] x[k] = sum_b d_b sum_j (lo_j xlo[16b + j] + hi_j xhi[16b + j]) + m_b xsum[b];
    Q4_0: W = d (q - 8), so the block's offset term is -8 d_b xsum[b].
    """
    n = xsum.shape[0]
    for i in range(n):
        xl, xh, xs = xlo[i], xhi[i], xsum[i]
        for r0 in range(first, stop, 4):
            r1 = min(r0 + 1, stop - 1)  # a short last group computes its last row again
            r2 = min(r0 + 2, stop - 1)
            r3 = min(r0 + 3, stop - 1)
            if code == Q4_1:
                s0, s1, s2, s3 = _rows4f_q4_1(raw, r0, r1, r2, r3, xl, xh, xs)  # noqa: F821 - bound when compiled
            else:
                s0, s1, s2, s3 = _rows4f_q4_0(raw, r0, r1, r2, r3, xl, xh, xs)  # noqa: F821
            out[i, r0] = s0
            out[i, r1] = s1
            out[i, r2] = s2
            out[i, r3] = s3


def _matvec_q4_1(raw, xlo, xhi, xsum, out, first, stop):  # pragma: no cover - compiled
    """Q4_1 on float32 x (`_matvec_q4`)."""
    _matvec_q4(raw, Q4_1, xlo, xhi, xsum, out, first, stop)


def _matvec_q4_0(raw, xlo, xhi, xsum, out, first, stop):  # pragma: no cover - compiled
    """Q4_0 on float32 x (`_matvec_q4`)."""
    _matvec_q4(raw, Q4_0, xlo, xhi, xsum, out, first, stop)


def _matvec_q8_0(raw, values, x, out, first, stop):  # pragma: no cover - compiled
    """Q8_0 on float32 x, four rows at a time through the IR loop `_rows4f_q8_0`:
    W[r, 32b + j] = d * qs[j] (int8; `values`, raw viewed as int8, is not read here)."""
    n = x.shape[0]
    for i in range(n):
        xi = x[i]
        for r0 in range(first, stop, 4):
            r1 = min(r0 + 1, stop - 1)  # a short last group computes its last row again
            r2 = min(r0 + 2, stop - 1)
            r3 = min(r0 + 3, stop - 1)
            s0, s1, s2, s3 = _rows4f_q8_0(raw, r0, r1, r2, r3, xi, xi, xi)  # noqa: F821 - bound when compiled
            out[i, r0] = s0
            out[i, r1] = s1
            out[i, r2] = s2
            out[i, r3] = s3


def _matmat_q4(raw, code, xlo, xhi, xsum, out, first, stop):  # pragma: no cover - compiled
    """`_matvec_q4` for many rows of x (a batched decode step): each group of four rows of W
    against four rows of x at a time (`_rows4f4_<kind>`: each block decoded once for them),
    the rows of x past the last four two (`_rows4f2_<kind>`) or one at a time
    (`_rows4f1_<kind>`, the one-row loop); every out[i, r] is the bits
    the one-row loop gives for row i alone (`attnkit.quant.ir._rows4f_codegen`)."""
    n = xsum.shape[0]
    full = n - n % 4
    pairs = n - n % 2
    for r0 in range(first, stop, 4):
        r1 = min(r0 + 1, stop - 1)  # a short last group computes its last row again
        r2 = min(r0 + 2, stop - 1)
        r3 = min(r0 + 3, stop - 1)
        for i in range(0, full, 4):
            if code == Q4_1:
                s = _rows4f4_q4_1(raw, r0, r1, r2, r3, xlo, xhi, xsum, i)  # noqa: F821 - bound when compiled
            else:
                s = _rows4f4_q4_0(raw, r0, r1, r2, r3, xlo, xhi, xsum, i)  # noqa: F821
            for j in range(4):
                out[i + j, r0] = s[4 * j]
                out[i + j, r1] = s[4 * j + 1]
                out[i + j, r2] = s[4 * j + 2]
                out[i + j, r3] = s[4 * j + 3]
        for i in range(full, pairs, 2):
            if code == Q4_1:
                t = _rows4f2_q4_1(raw, r0, r1, r2, r3, xlo, xhi, xsum, i)  # noqa: F821
            else:
                t = _rows4f2_q4_0(raw, r0, r1, r2, r3, xlo, xhi, xsum, i)  # noqa: F821
            for j in range(2):
                out[i + j, r0] = t[4 * j]
                out[i + j, r1] = t[4 * j + 1]
                out[i + j, r2] = t[4 * j + 2]
                out[i + j, r3] = t[4 * j + 3]
        for i in range(max(full, pairs), n):  # (no views made: the 2-D form of the one-row loop)
            if code == Q4_1:
                s0, s1, s2, s3 = _rows4f1_q4_1(raw, r0, r1, r2, r3, xlo, xhi, xsum, i)  # noqa: F821
            else:
                s0, s1, s2, s3 = _rows4f1_q4_0(raw, r0, r1, r2, r3, xlo, xhi, xsum, i)  # noqa: F821
            out[i, r0] = s0
            out[i, r1] = s1
            out[i, r2] = s2
            out[i, r3] = s3


def _matmat_q8_0(raw, x, out, first, stop):  # pragma: no cover - compiled
    """`_matvec_q8_0` for many rows of x, as `_matmat_q4` (`_rows4f4_q8_0`, then the one-row loop)."""
    n = x.shape[0]
    full = n - n % 4
    pairs = n - n % 2
    for r0 in range(first, stop, 4):
        r1 = min(r0 + 1, stop - 1)
        r2 = min(r0 + 2, stop - 1)
        r3 = min(r0 + 3, stop - 1)
        for i in range(0, full, 4):
            s = _rows4f4_q8_0(raw, r0, r1, r2, r3, x, x, x, i)  # noqa: F821 - bound when compiled
            for j in range(4):
                out[i + j, r0] = s[4 * j]
                out[i + j, r1] = s[4 * j + 1]
                out[i + j, r2] = s[4 * j + 2]
                out[i + j, r3] = s[4 * j + 3]
        for i in range(full, pairs, 2):
            t = _rows4f2_q8_0(raw, r0, r1, r2, r3, x, x, x, i)  # noqa: F821
            for j in range(2):
                out[i + j, r0] = t[4 * j]
                out[i + j, r1] = t[4 * j + 1]
                out[i + j, r2] = t[4 * j + 2]
                out[i + j, r3] = t[4 * j + 3]
        for i in range(max(full, pairs), n):
            s0, s1, s2, s3 = _rows4f1_q8_0(raw, r0, r1, r2, r3, x, x, x, i)  # noqa: F821
            out[i, r0] = s0
            out[i, r1] = s1
            out[i, r2] = s2
            out[i, r3] = s3


def _quantize_x(x, bits, q, dx, xs, qsum):  # pragma: no cover - compiled
    """`quantize_activations` compiled: x (N, K) -> q (N, K) int8, dx, xs (N, K/32) float32,
    and qsum (N, K/32) int32, the sum of each block's q (the Q4_0 offset's term). `bits` is
    x viewed as uint32: an all-ones exponent marks inf and NaN (float tests for them may be
    folded away under fastmath)."""
    n, blocks = dx.shape[0], dx.shape[1]
    for i in range(n):
        for b in range(blocks):
            amax = 0.0
            special = 0
            for j in range(32):
                v = np.float64(x[i, 32 * b + j])
                amax = max(amax, abs(v))
                special |= np.int32((bits[i, 32 * b + j] & np.uint32(0x7F800000)) == np.uint32(0x7F800000))
            d = np.float32(amax / 127.0) if special == 0 else np.float32(np.nan)
            dx[i, b] = d
            inverse = 1.0 / np.float64(d) if special == 0 and d > 0 else 0.0
            s = 0
            for j in range(32):
                v = np.rint(np.float64(x[i, 32 * b + j]) * inverse) if inverse > 0 else 0.0
                v = min(127.0, max(-127.0, v))
                s += np.int32(v)
                q[i, 32 * b + j] = np.int8(v)
            qsum[i, b] = s
            xs[i, b] = np.float32(np.float64(d) * s)  # the 8-bit values' sum (NaN where d is)


def _matvec_int8(raw, code, q, dx, xs, qsum, out, first, stop):  # pragma: no cover - compiled
    """W (blocks of type `code`: Q4_0, Q4_1 or Q8_0) on 8-bit activations, four rows at a
    time through the IR loops `_rows4_<kind>` (see `_rows4_codegen`):
    sum_k W[r, k] x[k] ~ sum_b d_b dx_b I_b (+ m_b xs_b for Q4_1; - 8 d_b dx_b qsum_b for
    Q4_0), each I_b exact in int32 lanes, kept in vector lanes until the row ends."""
    n = dx.shape[0]
    for i in range(n):
        qi, dxi, xsi, qsi = q[i], dx[i], xs[i], qsum[i]
        for r0 in range(first, stop, 4):
            r1 = min(r0 + 1, stop - 1)  # a short last group computes its last row again
            r2 = min(r0 + 2, stop - 1)
            r3 = min(r0 + 3, stop - 1)
            if code == Q4_1:
                s0, s1, s2, s3 = _rows4_q4_1(raw, r0, r1, r2, r3, qi, dxi, xsi, qsi)  # noqa: F821 - bound when compiled
            elif code == Q4_0:
                s0, s1, s2, s3 = _rows4_q4_0(raw, r0, r1, r2, r3, qi, dxi, xsi, qsi)  # noqa: F821
            else:
                s0, s1, s2, s3 = _rows4_q8_0(raw, r0, r1, r2, r3, qi, dxi, xsi, qsi)  # noqa: F821
            out[i, r0] = s0
            out[i, r1] = s1
            out[i, r2] = s2
            out[i, r3] = s3


# ----------------------------------------------------------------------------- dequantizing

def _dequantize_row(raw, values, r, code, half, out):  # pragma: no cover - compiled
    """Row r of W into out (K,) float32, as `dequantize` does (`code`: a GGMLType)."""
    columns = out.shape[0]
    if code == F32 or code == BF16:  # F32, BF16 (the high half of a float32): bits put together, then viewed
        bits = np.empty(columns, np.uint32)
        for k in range(columns):
            if code == F32:
                at = 4 * k
                bits[k] = np.uint32(raw[r, at]) | (np.uint32(raw[r, at + 1]) << np.uint32(8)) \
                    | (np.uint32(raw[r, at + 2]) << np.uint32(16)) | (np.uint32(raw[r, at + 3]) << np.uint32(24))
            else:
                bits[k] = (np.uint32(raw[r, 2 * k]) << np.uint32(16)) | (np.uint32(raw[r, 2 * k + 1]) << np.uint32(24))
        out[:] = bits.view(np.float32)
    elif code == F16:
        for k in range(columns):
            out[k] = half[raw[r, 2 * k] | (np.int32(raw[r, 2 * k + 1]) << 8)]
    elif code == Q4_0 or code == Q4_1:  # a block's 16 bytes of nibbles, two straight loops
        blocks = columns // 32
        size = raw.shape[1] // blocks if blocks else Q4_0_BYTES  # 18 or 20 bytes a block
        has_min = code == Q4_1
        # n is 16, computed from the array: with a literal 16 LLVM unrolled the loops into
        # scalar code; a count it cannot fold keeps them loops, which it vectorizes, much
        # faster (a prefill spends a good part of its time here; docs/benchmarks.md,
        # 'Measurements behind design choices')
        n = size - (4 if has_min else 2)
        row = raw[r]
        for b in range(blocks):
            o = size * b
            d = half[row[o] | (np.int32(row[o + 1]) << 8)]
            q = row[o + size - n:o + size]
            low, high = out[32 * b:32 * b + n], out[32 * b + n:32 * b + 2 * n]
            if has_min:
                m = half[row[o + 2] | (np.int32(row[o + 3]) << 8)]
                for j in range(n):
                    low[j] = d * np.float32(q[j] & 15) + m
                for j in range(n):
                    high[j] = d * np.float32(q[j] >> 4) + m
            else:  # d (q - 8), q - 8 exact in float32 (an infinite d gives the reference's inf and NaN)
                for j in range(n):
                    low[j] = d * (np.float32(q[j] & 15) - np.float32(8.0))
                for j in range(n):
                    high[j] = d * (np.float32(q[j] >> 4) - np.float32(8.0))
    elif code == Q5_0 or code == Q5_1:
        size = Q5_1_BYTES if code == Q5_1 else Q5_0_BYTES
        has_min = code == Q5_1
        for b in range(columns // 32):
            o = size * b
            d = half[raw[r, o] | (np.int32(raw[r, o + 1]) << 8)]
            m = np.float32(0.0)
            at = o + 2
            if has_min:
                m = half[raw[r, at] | (np.int32(raw[r, at + 1]) << 8)]
                at += 2
            qh = raw[r, at] | (np.uint32(raw[r, at + 1]) << 8) | (np.uint32(raw[r, at + 2]) << 16) \
                | (np.uint32(raw[r, at + 3]) << 24)
            at += 4
            shift = 0 if has_min else 16
            for j in range(16):
                q = raw[r, at + j]
                lo = np.int32(q & 15)
                hi = np.int32(q >> 4)
                lo |= np.int32((qh >> j) & 1) << 4
                hi |= np.int32((qh >> (j + 16)) & 1) << 4
                if has_min:
                    out[32 * b + j] = d * np.float32(lo) + m
                    out[32 * b + 16 + j] = d * np.float32(hi) + m
                else:
                    out[32 * b + j] = d * np.float32(lo - shift)
                    out[32 * b + 16 + j] = d * np.float32(hi - shift)
    elif code == Q8_0:  # (a computed count of 32: a loop LLVM vectorizes, as for Q4 above)
        blocks = columns // 32
        size = raw.shape[1] // blocks if blocks else Q8_0_BYTES
        n = size - 2
        signed = values[r]
        for b in range(blocks):
            o = size * b
            d = half[raw[r, o] | (np.int32(raw[r, o + 1]) << 8)]
            q, dest = signed[o + 2:o + 2 + n], out[32 * b:32 * b + n]
            for j in range(n):
                dest[j] = d * np.float32(q[j])
    elif code == Q4_K or code == Q5_K:  # 8 sub-blocks of 32, six-bit scales and minimums
        size = Q4_K_BYTES if code == Q4_K else Q5_K_BYTES
        for b in range(columns // 256):
            o = size * b
            d = half[raw[r, o] | (np.int32(raw[r, o + 1]) << 8)]
            dmin = half[raw[r, o + 2] | (np.int32(raw[r, o + 3]) << 8)]
            qs = o + size - 128
            for sub in range(8):
                if sub < 4:
                    sc = raw[r, o + 4 + sub] & 63
                    mn = raw[r, o + 8 + sub] & 63
                else:
                    sc = (raw[r, o + 8 + sub] & 15) | ((raw[r, o + sub] >> 6) << 4)
                    mn = (raw[r, o + 8 + sub] >> 4) | ((raw[r, o + 4 + sub] >> 6) << 4)
                scale = d * np.float32(sc)
                low = dmin * np.float32(mn)
                group = qs + 32 * (sub // 2)
                if code == Q4_K:  # a straight loop over a count of 32 from the array (vectorized)
                    n = (raw.shape[1] // (columns // 256) - 16) // 4
                    q, dest = raw[r, group:group + n], out[256 * b + 32 * sub:256 * b + 32 * sub + n]
                    nibble = 4 * (sub % 2)  # even sub-blocks: the low nibbles, odd: the high
                    for j in range(n):
                        dest[j] = scale * np.float32((q[j] >> nibble) & 15) - low
                    continue
                for j in range(32):
                    q = raw[r, group + j]
                    v = np.int32(q & 15) if sub % 2 == 0 else np.int32(q >> 4)
                    v |= np.int32((raw[r, o + 16 + j] >> sub) & 1) << 4
                    out[256 * b + 32 * sub + j] = scale * np.float32(v) - low
    else:  # Q6_K: ql[128], qh[64], scales int8[16], d
        blocks = columns // 256
        size = raw.shape[1] // blocks if blocks else Q6_K_BYTES
        n = size - 194  # 16 values a scale, computed (a loop LLVM vectorizes, as for Q4 above)
        for b in range(blocks):
            o = size * b
            d = half[raw[r, o + 208] | (np.int32(raw[r, o + 209]) << 8)]
            for half_block in range(2):
                ql = o + 64 * half_block
                qh = o + 128 + 32 * half_block
                for part in range(4):  # values 32*part .. of this half: ql low/high nibble, qh bits 2*part
                    shift = 2 * part
                    for sixteen in range(2):  # each run of 16 values shares its scale
                        k = 128 * half_block + 32 * part + 16 * sixteen
                        sd = d * np.float32(values[r, o + 192 + k // 16])
                        at = ql + 32 * (part % 2) + 16 * sixteen
                        lows, highs = raw[r, at:at + n], raw[r, qh + 16 * sixteen:qh + 16 * sixteen + n]
                        dest = out[256 * b + k:256 * b + k + n]
                        nibble = 0 if part < 2 else 4  # ql's low nibbles, then its high ones
                        for j in range(n):
                            v = np.int32((lows[j] >> nibble) & 15) | (np.int32((highs[j] >> shift) & 3) << 4)
                            dest[j] = sd * np.float32(v - 32)


def _dequantize_rows(raw, values, start, code, half, out):  # pragma: no cover - compiled
    """Rows start .. start + len(out) of W into out."""
    for t in range(out.shape[0]):
        _dequantize_row(raw, values, start + t, code, half, out[t])


# ----------------------------------------------------------------------------- Q5_0, Q4_K, Q6_K on float32 x
# Four rows at a time through their IR loops, as Q4_0/Q4_1 (`_matvec_q4`): the weights
# widened in vector lanes block by block and multiplied with x at once, never written out as
# a float32 row. (Loops written here in Python ran slower on Gemma 3's matrices: numba's
# integer lanes are 64-bit, and short loops per block paid their set-up each time; the row
# dequantized first, then summed, slower still. docs/benchmarks.md, 'Measurements behind
# design choices'.)

def _matvec_q5_0(raw, x, out, first, stop):  # pragma: no cover - compiled
    """Q5_0 on float32 x, four rows of W at a time through the IR loop `_rows4f_q5_0`
    (`attnkit.quant.ir`), x split as the Q4 loops read it (`_split_x`): per block of 32,
    d (f16), 32 high bits qh, 16 bytes of nibbles, W[32b + j] = d (lo_j + 16 bit_j - 16),
    W[32b + 16 + j] = d (hi_j + 16 bit_{16+j} - 16), so
    sum_k W[r, k] x[k] = sum_b d_b sum_j (v_j xlo[16b + j] + v'_j xhi[16b + j]) - 16 d_b xsum[b].
    """
    n, columns = x.shape[0], x.shape[1]
    xl, xh = np.empty(columns // 2, np.float32), np.empty(columns // 2, np.float32)
    xs = np.empty(columns // 32, np.float32)
    for i in range(n):
        _split_x(x[i], xl, xh, xs)
        for r0 in range(first, stop, 4):
            r1 = min(r0 + 1, stop - 1)  # a short last group computes its last row again
            r2 = min(r0 + 2, stop - 1)
            r3 = min(r0 + 3, stop - 1)
            s0, s1, s2, s3 = _rows4f_q5_0(raw, r0, r1, r2, r3, xl, xh, xs)  # noqa: F821 - bound when compiled
            out[i, r0] = s0
            out[i, r1] = s1
            out[i, r2] = s2
            out[i, r3] = s3


def _matvec_k(raw, code, x, out, first, stop):  # pragma: no cover - compiled
    """Q4_K or Q6_K (`code`) on float32 x, four rows of W at a time through the IR loops
    `_rows4f_q4_k` / `_rows4f_q6_k` (`attnkit.quant.ir`): x whole, and its sums over each
    32 values (Q4_K's minimums' term)."""
    n, columns = x.shape[0], x.shape[1]
    xl, xh = np.empty(columns // 2, np.float32), np.empty(columns // 2, np.float32)
    xs = np.empty(columns // 32, np.float32)
    for i in range(n):
        xi = x[i]
        _split_x(xi, xl, xh, xs)
        for r0 in range(first, stop, 4):
            r1 = min(r0 + 1, stop - 1)  # a short last group computes its last row again
            r2 = min(r0 + 2, stop - 1)
            r3 = min(r0 + 3, stop - 1)
            if code == Q4_K:
                s0, s1, s2, s3 = _rows4f_q4_k(raw, r0, r1, r2, r3, xi, xi, xs)  # noqa: F821 - bound when compiled
            else:
                s0, s1, s2, s3 = _rows4f_q6_k(raw, r0, r1, r2, r3, xi, xi, xs)  # noqa: F821
            out[i, r0] = s0
            out[i, r1] = s1
            out[i, r2] = s2
            out[i, r3] = s3


def _matvec_rows(raw, values, code, half, x, out, first, stop):  # pragma: no cover - compiled
    """x @ W.T for the types the entries do not send to a loop of their own: Q5_0, Q4_K and
    Q6_K through their four-row loops above, the others each row dequantized into a scratch
    row."""
    if code == Q5_0:
        _matvec_q5_0(raw, x, out, first, stop)
        return
    if code == Q4_K or code == Q6_K:
        _matvec_k(raw, code, x, out, first, stop)
        return
    n, columns = x.shape[0], x.shape[1]
    row = np.empty(columns, np.float32)
    for r in range(first, stop):
        _dequantize_row(raw, values, r, code, half, row)
        for i in range(n):
            s = np.float32(0.0)
            for k in range(columns):
                s += row[k] * x[i, k]
            out[i, r] = s


# The native entries (`attnkit.kernels.native`): each `fn(frame, part)`, the frame an int64
# array of addresses and sizes. `part` of `parts` takes a contiguous range of the rows (a

# ----------------------------------------------------------------------------- the native entries
# Each `entry(frame address, part)`: `part` of `frame.parts` takes a contiguous range of the
# rows (a multiple of four, so the two- and four-row loops never straddle two parts).

def _part_rows(count, parts, part):  # pragma: no cover - compiled
    """Rows [first, stop) of `count` that part `part` of `parts` takes (ranges in
    multiples of four; a part past the end gets an empty range)."""
    step = ((count + parts - 1) // parts + 3) // 4 * 4
    return part * step, min(count, (part + 1) * step)


def _split_x(x, xl, xh, xs):  # pragma: no cover - compiled
    """One row of x (K,) as the Q4 loops read it: the values each block's low and high
    nibbles meet (xl, xh: (K/2,)) and the block sums (xs: (K/32,)), summed in float64."""
    for b in range(x.shape[0] // 32):
        total = 0.0
        for j in range(16):
            lo, hi = x[32 * b + j], x[32 * b + 16 + j]
            xl[16 * b + j] = lo
            xh[16 * b + j] = hi
            total += np.float64(lo) + np.float64(hi)
        xs[b] = np.float32(total)


def product_entry(frame_address, part):  # pragma: no cover - compiled
    """Part `part` of x (n, K) @ W.T into out (n, R; rows `out_stride` apart), the frame a
    `PRODUCT_FRAME` record: x prepared for the block type (float32 halves and block sums,
    or 8-bit blocks), then the type's loop on this part's rows."""
    f = carray(_product_frame(frame_address), (1,))[0]  # noqa: F821 - bound when compiled
    rows, width, code, K, n = f.rows, f.row_bytes, f.type, f.columns, f.n
    first, stop = _part_rows(rows, f.parts, part)
    if first >= stop:
        return
    raw = carray(_u8(f.raw), (rows, width))  # noqa: F821
    values = carray(_i8(f.raw), (rows, width))  # noqa: F821
    x = carray(_f32(f.x), (n, K))  # noqa: F821
    out = carray(_f32(f.out), (n, f.out_stride))[:, :rows]  # noqa: F821
    blocks = K // 32
    if f.int8 != 0 and (code == Q4_0 or code == Q4_1 or code == Q8_0):
        q, dx = np.empty((n, K), np.int8), np.empty((n, blocks), np.float32)
        xs, qsum = np.empty((n, blocks), np.float32), np.empty((n, blocks), np.int32)
        _quantize_x(x, x.view(np.uint32), q, dx, xs, qsum)
        _matvec_int8(raw, code, q, dx, xs, qsum, out, first, stop)
    elif code == Q4_0 or code == Q4_1:
        xl, xh = np.empty((n, K // 2), np.float32), np.empty((n, K // 2), np.float32)
        xs = np.empty((n, blocks), np.float32)
        for i in range(n):
            _split_x(x[i], xl[i], xh[i], xs[i])
        if code == Q4_1:
            _matvec_q4_1(raw, xl, xh, xs, out, first, stop)
        else:
            _matvec_q4_0(raw, xl, xh, xs, out, first, stop)
    elif code == Q8_0:
        _matvec_q8_0(raw, values, x, out, first, stop)
    else:
        half = carray(_f32(f.half), (1 << 16,))  # noqa: F821
        _matvec_rows(raw, values, code, half, x, out, first, stop)


def dequantize_entry(frame_address, part):  # pragma: no cover - compiled
    """Part `part` of rows start .. start + count of W into out (count, K) float32, the
    frame a `DEQUANTIZE_FRAME` record."""
    f = carray(_dequantize_frame(frame_address), (1,))[0]  # noqa: F821 - bound when compiled
    rows, width, count = f.rows, f.row_bytes, f.count
    first, stop = _part_rows(count, f.parts, part)
    if first >= stop:
        return
    raw = carray(_u8(f.raw), (rows, width))  # noqa: F821
    values = carray(_i8(f.raw), (rows, width))  # noqa: F821
    out = carray(_f32(f.out), (count, f.columns))  # noqa: F821
    half = carray(_f32(f.half), (1 << 16,))  # noqa: F821
    _dequantize_rows(raw, values, f.start + first, f.type, half, out[first:stop])


LOOPS = (_matvec_q4, _matvec_q4_1, _matvec_q4_0, _matvec_q8_0, _matmat_q4, _matmat_q8_0, _quantize_x, _matvec_int8,
         _dequantize_row, _dequantize_rows, _matvec_q5_0, _matvec_k, _matvec_rows, _part_rows, _split_x)
"""The loops `attnkit.quant.compiled` compiles with numba (by name, into its namespace)."""
ENTRIES = {"product": product_entry, "dequantize": dequantize_entry}
"""The native entries (`attnkit.kernels.native`) by name."""
