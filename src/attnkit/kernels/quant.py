"""Products with GGUF's quantized weights, straight from their blocks.

A weight matrix W (R, K) stays as the file stores it: `raw` (R, bytes per row), uint8, each
row a run of blocks of the GGML type (docs/kernels.md draws them). `matmul(x, raw, kind, K)`
computes x @ W.T without ever building W in float32:

- decode (a few rows of x): one compiled loop per output row reads the row's blocks once,
  expands each 4-, 5- or 8-bit value and its block scale in registers, and accumulates in
  float32 (`_matvec_*`; Q4_0, Q4_1 and Q8_0 four rows at a time in LLVM IR); with more
  than one thread allowed (the BLAS thread limit in force), the output rows are split into
  contiguous ranges run side by side, each by one call of the native entry (`_product_entry`,
  `attnkit.kernels.native`);
- prefill (many rows of x): a tile of W's rows is dequantized into a float32 scratch tile
  (`_dequantize_rows`), then one BLAS product per tile, as llama.cpp does for batches.

Every decode loop prefetches the blocks of the rows 16 ahead (the file's pages stop the
hardware prefetcher at each 4 KB boundary). With `activations("int8")` (opt-in), the Q4_0,
Q4_1 and Q8_0 decode loops run as llama.cpp's do:
x quantized to 8 bits per block of 32 (`quantize_activations`), each block's dot product an
exact int32 sum (`_rows4_*`: loops in LLVM IR on `vpdpbusd` with AVX-512 VNNI, `vpmaddubsw` with AVX2);
`matmul_int8_reference` is what they compute, in float64 (budget: docs/kernels.md).

The NumPy reference beside them, `dequantize(raw, kind, K)`, writes out the block formats
as ggml-quants.c's `dequantize_row_*` do (the gguf package's `gguf.quants.dequantize` is its
oracle in the tests); `matmul_reference` is its float32 BLAS product. What runs: the
compiled loops when `attnkit.kernels.enabled()`, else the reference, tile by tile.

Error budget (tests/test_quant_kernels.py): against the float64 product of the dequantized
weights, the kernel's error is at most twice the float32 reference product's plus one
float32 rounding of |W| @ |x|: both sum K float32 products, in different orders, and the
kernel applies each block's scale once per block instead of once per weight.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from attnkit import kernels
from attnkit.kernels import native
from attnkit.runtime import scratch_tile

__all__ = [
    "INT8_TYPES", "QUANT_TYPES", "BlockType", "activations", "compiled_available", "current_activations", "dequantize", "dequantize_compiled",
    "matmul", "matmul_int8_reference", "matmul_reference", "matmul_stack", "quantize_activations", "row_bytes",
]


class BlockType(NamedTuple):
    """A GGML block type the products run on: values per block, bytes per block, its code here."""

    block_size: int
    type_size: int
    code: int


QUANT_TYPES: dict[str, BlockType] = {
    "F32": BlockType(1, 4, 0), "F16": BlockType(1, 2, 1), "BF16": BlockType(1, 2, 2),
    "Q4_0": BlockType(32, 18, 3), "Q4_1": BlockType(32, 20, 4), "Q5_0": BlockType(32, 22, 5),
    "Q5_1": BlockType(32, 24, 6), "Q8_0": BlockType(32, 34, 7),
    "Q4_K": BlockType(256, 144, 8), "Q5_K": BlockType(256, 176, 9), "Q6_K": BlockType(256, 210, 10),
}

DECODE_ROWS = 8
"""x with at most this many rows runs the fused matrix-vector loop; more run dequantized tiles
through BLAS."""
PREFETCH_ROWS = 16
"""How far ahead (in rows) the decode loops prefetch W's blocks."""
_TILE_VALUES = 1 << 18  # a prefill tile: 1 MB of float32 weights, kept per thread (runtime.scratch_buffer)

INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")
"""The types whose decode products can run on 8-bit activations (`activations("int8")`):
x is quantized per block of 32 (`quantize_activations`) and each block's dot product is an
exact integer sum, as llama.cpp computes them. Not the default: a SmolLM2 step runs 1.6x
faster, with llama.cpp's size of logit error (RMS 0.29 against llama.cpp's 0.24) instead of
float32's (9e-6); docs/kernels.md."""

_ACTIVATIONS = ["float32"]


@contextmanager
def activations(kind: str) -> Iterator[None]:
    """Within the block, the compiled decode products of `INT8_TYPES` run on `kind`
    activations: "float32" (the default: within two float32 BLAS errors of the exact
    product) or "int8" (8-bit blocks, llama.cpp's way, within the budget derived in
    docs/kernels.md).

        with quant.activations("int8"):
            logits = model(ids)
    """
    if kind not in ("int8", "float32"):
        raise ValueError(f'expected activations "int8" or "float32", got {kind!r}')
    previous = _ACTIVATIONS[0]
    _ACTIVATIONS[0] = kind
    try:
        yield
    finally:
        _ACTIVATIONS[0] = previous


def current_activations() -> str:
    """The activations the decode products run on here: "float32" or "int8" (`activations`)."""
    return _ACTIVATIONS[0]


def compiled_available() -> bool:
    """Whether the compiled loops will run, answered without importing numba (a model can
    decide at load time and pay numba's import at its first product): numba is installed and
    `ATTNKIT_KERNELS` is not "numpy". Once numba is imported, `attnkit.kernels.enabled()`."""
    import importlib.util
    import os
    import sys

    if "numba" in sys.modules:
        return kernels.enabled()
    if os.environ.get("ATTNKIT_KERNELS", "").strip().lower() == "numpy":
        return False
    return importlib.util.find_spec("numba") is not None


def row_bytes(kind: str, columns: int) -> int:
    """Bytes of one row of `columns` values of GGML type `kind`."""
    block = _block(kind)
    if columns % block.block_size:
        raise ValueError(f"expected a row length that is a multiple of {block.block_size} for {kind}, got {columns}")
    return columns // block.block_size * block.type_size


def _block(kind: str) -> BlockType:
    if kind not in QUANT_TYPES:
        raise ValueError(f"expected a GGML type of {', '.join(QUANT_TYPES)}, got {kind!r}")
    return QUANT_TYPES[kind]


def _check(raw: np.ndarray, kind: str, columns: int) -> None:
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise TypeError(f"expected raw blocks as a 2-D uint8 array (rows, bytes per row), got {getattr(raw, 'dtype', type(raw))}"
                        f" {getattr(raw, 'shape', '')}")
    if raw.shape[1] != row_bytes(kind, columns):
        raise ValueError(
            f"expected {row_bytes(kind, columns)} bytes per row for {columns} {kind} values, got {raw.shape[1]}"
        )


# ----------------------------------------------------------------------------- NumPy reference

def _half(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block: (rows, blocks) float32."""
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 8 six-bit scales and minimums from 12 bytes (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def dequantize(raw: np.ndarray, kind: str, columns: int) -> np.ndarray:
    """The reference: blocks (rows, bytes per row) -> float32 (rows, columns), with NumPy.

    Arguments:
        raw: uint8 (rows, bytes per row), rows of blocks of type `kind`.
        kind: a name of `QUANT_TYPES` ("Q4_1", ...).
        columns: values per row (K).
    Returns:
        (rows, columns) float32, value for value what ggml's `dequantize_row_*` gives.
    """
    _check(raw, kind, columns)
    rows = raw.shape[0]
    if kind == "F32":
        return np.ascontiguousarray(raw).view(np.float32).reshape(rows, columns).copy()
    if kind == "F16":
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(rows, columns)
    if kind == "BF16":
        return (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, columns)
    block = QUANT_TYPES[kind]
    b = raw.reshape(rows, -1, block.type_size)  # (R, blocks, bytes)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _half(b, 0)[..., None]  # (R, blocks, 1)
        offset = 4 if kind in ("Q4_1", "Q5_1") else 2
        qh_at = offset
        if kind in ("Q5_0", "Q5_1"):
            offset += 4
        qs = b[..., offset:offset + 16]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)  # (R, blocks, 32)
        if kind in ("Q5_0", "Q5_1"):
            qh = np.ascontiguousarray(b[..., qh_at:qh_at + 4]).view("<u4")  # (R, blocks, 1)
            q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int32)
        if kind in ("Q4_1", "Q5_1"):
            values = d * q.astype(np.float32) + _half(b, 2)[..., None]
        else:
            values = d * (q - (8 if kind == "Q4_0" else 16)).astype(np.float32)
    elif kind == "Q8_0":
        values = _half(b, 0)[..., None] * b[..., 2:].view(np.int8).astype(np.float32)
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin = _half(b, 0)[..., None], _half(b, 2)[..., None]
        sc, mn = _k_scales(b[..., 4:16])  # (R, blocks, 8)
        qs = b[..., -128:].reshape(rows, -1, 4, 32)  # 4 groups of 32 bytes: sub-blocks 2g (low), 2g+1 (high)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 8, 32).astype(np.float32)
        if kind == "Q5_K":
            qh = b[..., 16:48]  # (R, blocks, 32): bit j of byte l is value l of sub-block j
            q += (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4).astype(np.float32)
        values = (d * sc)[..., None] * q - (dmin * mn)[..., None]
    else:  # Q6_K: ql[128], qh[64], scales int8[16], d
        ql, qh = b[..., :128].reshape(rows, -1, 2, 64), b[..., 128:192].reshape(rows, -1, 2, 32)
        scales = b[..., 192:208].view(np.int8).astype(np.float32)  # (R, blocks, 16)
        d = _half(b, 208)[..., None]
        low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)  # (R, blocks, 2, 4, 32)
        q = ((low | (high << 4)).astype(np.int32) - 32).astype(np.float32).reshape(rows, -1, 16, 16)
        values = (d * scales)[..., None] * q
    return np.ascontiguousarray(values, dtype=np.float32).reshape(rows, columns)


def matmul_reference(x: np.ndarray, raw: np.ndarray, kind: str, columns: int) -> np.ndarray:
    """x @ W.T with W dequantized by `dequantize` a tile of rows at a time, in BLAS.

    Arguments:
        x: (N, K), float32 (float16 is converted), or float64 (then computed in float64).
        raw, kind, columns: W (R, K) as blocks (see `dequantize`).
    Returns:
        (N, R) in x's dtype (float32 or float64).
    """
    _check(raw, kind, columns)
    dtype = np.float64 if x.dtype == np.float64 else np.float32
    x = np.ascontiguousarray(x, dtype=dtype)
    out = np.empty((x.shape[0], raw.shape[0]), dtype)
    step = max(1, _TILE_VALUES // columns)
    for start in range(0, raw.shape[0], step):
        tile = dequantize(raw[start:start + step], kind, columns)  # (rows, K)
        out[:, start:start + step] = x @ tile.T.astype(dtype, copy=False)
    return out


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x quantized to 8 bits per block of 32, as the int8 products use it (llama.cpp's Q8_1).

    Each block b of 32 values gets dx_b = max|x_b| / 127 (rounded to float32) and
    q = rint(x / dx_b) in [-127, 127], computed in float64, so |x - dx_b q| <= dx_b / 2 +
    max(0, max|x_b| - 127 dx_b) (the second term: dx_b's rounding, or a dx_b that underflows
    to zero). A block with a NaN or an infinity gets dx_b = NaN and q = 0 (its products are NaN).

    Arguments:
        x: (N, K) float32, K a multiple of 32.
    Returns:
        q (N, K) int8, dx (N, K/32) float32, xs (N, K/32) float32: the blocks' exact sums
        rounded once (the Q4_1 minimum's term uses them, not the 8-bit values).
    """
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"expected x of shape (N, K) with K a multiple of 32, got {x.shape}")
    b = x.reshape(x.shape[0], -1, 32).astype(np.float64)  # (N, K/32, 32)
    with np.errstate(all="ignore"):
        total = b.sum(axis=2)
        finite = np.isfinite(total)
        dx = np.where(finite, np.abs(b).max(axis=2) / 127.0, np.nan).astype(np.float32)  # (N, K/32)
        d = dx.astype(np.float64)[..., None]
        usable = np.isfinite(d) & (d > 0)
        q = np.clip(np.where(usable, np.rint(b / np.where(usable, d, 1.0)), 0.0), -127, 127)
        xs = (d[..., 0] * q.sum(axis=2)).astype(np.float32)  # dx_b sum(q_b): NaN where dx_b is
    return q.astype(np.int8).reshape(x.shape), dx, xs


def matmul_int8_reference(x: np.ndarray, raw: np.ndarray, kind: str, columns: int) -> np.ndarray:
    """What the int8 products compute, in float64: the dequantized W times x's 8-bit values
    (`quantize_activations`), the Q4_1 minimum's term on their block sums `xs`.

    Arguments:
        x: (N, K); raw, kind, columns: W as blocks, kind one of `INT8_TYPES`.
    Returns:
        (N, R) float64.
    """
    if kind not in INT8_TYPES:
        raise ValueError(f"expected one of {', '.join(INT8_TYPES)}, got {kind!r}")
    _check(raw, kind, columns)
    q, dx, xs = quantize_activations(np.asarray(x, np.float32))
    n, blocks = q.shape[0], columns // 32
    xq = (q.reshape(n, blocks, 32).astype(np.float64) * dx.astype(np.float64)[..., None]).reshape(n, columns)
    w = dequantize(raw, kind, columns).astype(np.float64)  # (R, K)
    if kind != "Q4_1":  # Q4_0, Q8_0: no minimum term
        return xq @ w.T
    m = _half(raw.reshape(raw.shape[0], blocks, 20), 2).astype(np.float64)  # (R, blocks)
    steps = (w.reshape(-1, blocks, 32) - m[..., None]).reshape(w.shape)  # d q, the minimum taken out
    return xq @ steps.T + xs.astype(np.float64) @ m.T


# ----------------------------------------------------------------------------- compiled loops
# Plain Python, compiled by numba in `_compiled()`, around the LLVM IR loops below. The IR
# loops read a block's float16 scale with one `vcvtph2ps` (`_ir_half`); the dequantizing
# loops take `half`, the float16 -> float32 table (65,536 entries), so a scale is one lookup
# of its two bytes.


def _matvec_q4(raw, code, xlo, xhi, xsum, out, first, stop):  # pragma: no cover - compiled
    """Q4_1 (code 4) or Q4_0 (code 3) on float32 x, four rows of W at a time through the IR
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
            if code == 4:
                s0, s1, s2, s3 = _rows4f_q4_1(raw, r0, r1, r2, r3, xl, xh, xs)  # noqa: F821 - bound when compiled
            else:
                s0, s1, s2, s3 = _rows4f_q4_0(raw, r0, r1, r2, r3, xl, xh, xs)  # noqa: F821
            out[i, r0] = s0
            out[i, r1] = s1
            out[i, r2] = s2
            out[i, r3] = s3


def _matvec_q4_1(raw, xlo, xhi, xsum, out, first, stop):  # pragma: no cover - compiled
    """Q4_1 on float32 x (`_matvec_q4`)."""
    _matvec_q4(raw, 4, xlo, xhi, xsum, out, first, stop)


def _matvec_q4_0(raw, xlo, xhi, xsum, out, first, stop):  # pragma: no cover - compiled
    """Q4_0 on float32 x (`_matvec_q4`)."""
    _matvec_q4(raw, 3, xlo, xhi, xsum, out, first, stop)


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
            if code == 4:
                s0, s1, s2, s3 = _rows4_q4_1(raw, r0, r1, r2, r3, qi, dxi, xsi, qsi)  # noqa: F821 - bound when compiled
            elif code == 3:
                s0, s1, s2, s3 = _rows4_q4_0(raw, r0, r1, r2, r3, qi, dxi, xsi, qsi)  # noqa: F821
            else:
                s0, s1, s2, s3 = _rows4_q8_0(raw, r0, r1, r2, r3, qi, dxi, xsi, qsi)  # noqa: F821
            out[i, r0] = s0
            out[i, r1] = s1
            out[i, r2] = s2
            out[i, r3] = s3


_BLOCK_BYTES = {"q4_1": 20, "q4_0": 18, "q8_0": 34}


def _dot_instructions() -> str:
    """Which block dot product the IR loops emit: "vnni" (AVX-512 VNNI), "avx2", or
    "generic" (LLVM's own lowering), from the host's features; "generic" when numba
    compiles for another CPU (NUMBA_CPU_NAME)."""
    from llvmlite import binding

    nb = kernels.numba()
    if nb.config.CPU_NAME not in (None, "", "host"):
        return "generic"
    features = binding.get_host_cpu_features()
    if features.get("avx512vnni", False) and features.get("avx512vl", False):
        return "vnni"
    return "avx2" if features.get("avx2", False) else "generic"


def _ir_prefetch(builder, pointer) -> None:  # pragma: no cover - compiled
    """LLVM IR asking for the cache line at `pointer` (i8*): a read, kept in every cache
    level. A decode product streams its weights from the file's pages, whose 4 KB boundaries
    stop the hardware prefetcher: the row loops ask for the rows `PREFETCH_ROWS` ahead
    themselves (the Q8_0 output head ran 5x faster so)."""
    from llvmlite import ir
    from numba.core import cgutils

    i32 = ir.IntType(32)
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")
    builder.call(prefetch, [pointer, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _ir_half(builder, pointer):  # pragma: no cover - compiled
    """LLVM IR of the little-endian float16 at `pointer` (i8*) as float32 (`vcvtph2ps`)."""
    from llvmlite import ir

    return builder.fpext(builder.load(builder.bitcast(pointer, ir.HalfType().as_pointer()), align=1), ir.FloatType())


def _ir_four_rows(context, builder, signature, raw, indices) -> tuple:  # pragma: no cover - compiled
    """(pointers to the rows `indices` of the (rows, bytes) uint8 array `raw`, its row stride)."""
    from numba.core import cgutils

    matrix = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=raw)
    stride = builder.extract_value(matrix.strides, 0)
    return [builder.gep(matrix.data, [builder.mul(r, stride)]) for r in indices], stride


def _ir_prefetch_ahead(builder, rows, stride, offset) -> None:  # pragma: no cover - compiled
    """Prefetch byte `offset` of the rows PREFETCH_ROWS past each of `rows` (never faults: a
    prefetch past the end is dropped)."""
    from llvmlite import ir

    ahead = builder.add(builder.mul(stride, ir.Constant(stride.type, PREFETCH_ROWS)), offset)
    for row in rows:
        _ir_prefetch(builder, builder.gep(row, [ahead]))


def _rows4_codegen(kind, dot=None):  # pragma: no cover - compiled
    """The LLVM IR of `_rows4_<kind>(raw, r0, r1, r2, r3, q, dx, xs, qsum)`: four rows of
    W (blocks of `kind`) against one row of 8-bit x, returning their four sums. Per block:
    the 32 weights as unsigned bytes (nibbles; Q8_0's |w|) against x's 32 signed bytes
    (Q8_0: times sign(w)), summed into eight int32 lanes, converted (exact), scaled by
    d_b dx_b and added to eight float32 lanes per row (allocas that LLVM keeps in
    registers); the minimum's (Q4_1) or the offset's (Q4_0) term in a float32 scalar. The
    rows 16 ahead are prefetched (`_ir_prefetch`'s reason)."""
    from llvmlite import ir
    from numba.core import cgutils

    size = _BLOCK_BYTES[kind]
    dot = dot or _dot_instructions()

    def codegen(context, builder, signature, args):
        raw, r0, r1, r2, r3, q, dx, xs, qsum = args
        i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
        lanes_f, lanes_i = ir.VectorType(f32, 8), ir.VectorType(i32, 8)
        bytes32, bytes16 = ir.VectorType(i8, 32), ir.VectorType(i8, 16)
        proxy = cgutils.create_struct_proxy
        rows, stride = _ir_four_rows(context, builder, signature, raw, (r0, r1, r2, r3))
        q_data = proxy(signature.args[5])(context, builder, value=q).data
        dx_array = proxy(signature.args[6])(context, builder, value=dx)
        xs_data = proxy(signature.args[7])(context, builder, value=xs).data
        qsum_data = proxy(signature.args[8])(context, builder, value=qsum).data
        blocks = builder.extract_value(dx_array.shape, 0)
        sums = [cgutils.alloca_once_value(builder, ir.Constant(lanes_f, [0.0] * 8)) for _ in range(4)]
        terms = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(4)]
        module = builder.module
        if dot == "vnni":
            vpdpbusd = cgutils.get_or_insert_function(
                module, ir.FunctionType(lanes_i, [lanes_i, lanes_i, lanes_i]), "llvm.x86.avx512.vpdpbusd.256")
        elif dot == "avx2":
            words = ir.VectorType(i16, 16)
            maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(words, [bytes32, bytes32]),
                                                     "llvm.x86.avx2.pmadd.ub.sw")
            maddwd = cgutils.get_or_insert_function(module, ir.FunctionType(lanes_i, [words, words]),
                                                    "llvm.x86.avx2.pmadd.wd")

        def block_dot(unsigned, signed):  # <32 x i8> (as unsigned) . <32 x i8> -> <8 x i32>
            if dot == "vnni":
                return builder.call(vpdpbusd, [ir.Constant(lanes_i, [0] * 8), builder.bitcast(unsigned, lanes_i),
                                               builder.bitcast(signed, lanes_i)])
            if dot == "avx2":  # pairs of products fit int16: 2 * 255 * 127 < 32768
                pairs = builder.call(maddubs, [unsigned, signed])
                return builder.call(maddwd, [pairs, ir.Constant(ir.VectorType(i16, 16), [1] * 16)])
            wide = ir.VectorType(i32, 32)
            products = builder.mul(builder.zext(unsigned, wide), builder.sext(signed, wide))
            parts = [builder.shuffle_vector(products, products, ir.Constant(lanes_i, list(range(8 * k, 8 * k + 8))))
                     for k in range(4)]
            return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            offset = builder.mul(b, ir.Constant(b.type, size))
            _ir_prefetch_ahead(builder, rows, stride, offset)
            e = builder.load(builder.gep(dx_array.data, [b]))
            x = builder.load(builder.bitcast(builder.gep(q_data, [builder.mul(b, ir.Constant(b.type, 32))]),
                                             bytes32.as_pointer()), align=1)
            for row, total, term in zip(rows, sums, terms):
                block = builder.gep(row, [offset])
                d = _ir_half(builder, block)
                if kind == "q8_0":
                    w = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, 2)]), bytes32.as_pointer()),
                                     align=1)
                    zero = ir.Constant(bytes32, [0] * 32)
                    negative = builder.icmp_signed("<", w, zero)
                    unsigned = builder.select(negative, builder.sub(zero, w), w)
                    signed = builder.select(negative, builder.sub(zero, x), x)
                else:
                    at = 4 if kind == "q4_1" else 2
                    packed = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, at)]),
                                                          bytes16.as_pointer()), align=1)
                    low = builder.and_(packed, ir.Constant(bytes16, [15] * 16))
                    high = builder.lshr(packed, ir.Constant(bytes16, [4] * 16))
                    unsigned = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, 32), list(range(32))))
                    signed = x
                scale = builder.fmul(d, e)
                lanes = builder.sitofp(block_dot(unsigned, signed), lanes_f)
                spread = builder.insert_element(ir.Constant(lanes_f, ir.Undefined), scale, ir.Constant(i32, 0))
                spread = builder.shuffle_vector(spread, spread, ir.Constant(lanes_i, [0] * 8))
                builder.store(builder.fadd(builder.load(total), builder.fmul(lanes, spread)), total)
                if kind == "q4_1":  # m_b xs_b
                    m = _ir_half(builder, builder.gep(block, [ir.Constant(i32, 2)]))
                    part = builder.fmul(m, builder.load(builder.gep(xs_data, [b])))
                    builder.store(builder.fadd(builder.load(term), part), term)
                elif kind == "q4_0":  # -8 d_b dx_b qsum_b
                    count = builder.sitofp(builder.load(builder.gep(qsum_data, [b])), f32)
                    part = builder.fmul(builder.fmul(scale, ir.Constant(f32, -8.0)), count)
                    builder.store(builder.fadd(builder.load(term), part), term)
        reduce = cgutils.get_or_insert_function(module, ir.FunctionType(f32, [f32, lanes_f]),
                                                "llvm.vector.reduce.fadd.v8f32")
        results = [builder.fadd(builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(total)]), builder.load(term))
                   for total, term in zip(sums, terms)]
        return context.make_tuple(builder, signature.return_type, results)

    return codegen


def _rows4f_codegen(kind):  # pragma: no cover - compiled
    """The LLVM IR of `_rows4f_<kind>(raw, r0, r1, r2, r3, xlo, xhi, xsum)`: four rows of W
    (Q4_0, Q4_1 or Q8_0 blocks) against one row of float32 x, returning their four sums.
    Per block: x's 16 low-nibble and 16 high-nibble values (Q8_0: its 32 values, xlo = xhi
    = the row of x, xsum unused) loaded once for the four rows; each row's nibbles (Q8_0:
    signed bytes) widened to float32 (exact), lo * xlo + hi * xhi scaled by d_b and added
    to 16 float32 lanes per row (allocas LLVM keeps in registers: the accumulators of a
    loop in Python stayed in memory, a store and a reload every block); the minimum's
    (Q4_1) or the offset's (Q4_0) term in a float32 scalar. The rows 16 ahead are
    prefetched (`_ir_prefetch`'s reason)."""
    from llvmlite import ir
    from numba.core import cgutils

    size = _BLOCK_BYTES[kind]
    fast = ("contract", "reassoc", "nsz")

    def codegen(context, builder, signature, args):
        raw, r0, r1, r2, r3, xlo, xhi, xsum = args
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        lanes = ir.VectorType(f32, 16)
        bytes16 = ir.VectorType(i8, 16)
        proxy = cgutils.create_struct_proxy
        rows, stride = _ir_four_rows(context, builder, signature, raw, (r0, r1, r2, r3))
        xl_data = proxy(signature.args[5])(context, builder, value=xlo).data
        xh_data = proxy(signature.args[6])(context, builder, value=xhi).data
        xs_array = proxy(signature.args[7])(context, builder, value=xsum)
        if kind == "q8_0":  # x's length / 32
            x_array = proxy(signature.args[5])(context, builder, value=xlo)
            blocks = builder.udiv(builder.extract_value(x_array.shape, 0), ir.Constant(stride.type, 32))
        else:
            blocks = builder.extract_value(xs_array.shape, 0)
        sums = [cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * 16)) for _ in range(4)]
        terms = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(4)]
        module = builder.module

        def spread(value):
            one = builder.insert_element(ir.Constant(lanes, ir.Undefined), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, 16), [0] * 16))

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            offset = builder.mul(b, ir.Constant(b.type, size))
            _ir_prefetch_ahead(builder, rows, stride, offset)
            if kind == "q8_0":
                at_lo = builder.mul(b, ir.Constant(b.type, 32))
                at_hi = builder.add(at_lo, ir.Constant(b.type, 16))
            else:
                at_lo = at_hi = builder.mul(b, ir.Constant(b.type, 16))
            xl = builder.load(builder.bitcast(builder.gep(xl_data, [at_lo]), lanes.as_pointer()), align=4)
            xh = builder.load(builder.bitcast(builder.gep(xh_data, [at_hi]), lanes.as_pointer()), align=4)
            s = None if kind == "q8_0" else builder.load(builder.gep(xs_array.data, [b]))
            for row, total, term in zip(rows, sums, terms):
                block = builder.gep(row, [offset])
                d = _ir_half(builder, block)
                if kind == "q8_0":
                    def signed(at):
                        values = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, at)]),
                                                              bytes16.as_pointer()), align=1)
                        return builder.sitofp(values, lanes)

                    low, high = signed(2), signed(18)
                else:
                    at = 4 if kind == "q4_1" else 2
                    packed = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, at)]),
                                                          bytes16.as_pointer()), align=1)
                    low = builder.uitofp(builder.and_(packed, ir.Constant(bytes16, [15] * 16)), lanes)
                    high = builder.uitofp(builder.lshr(packed, ir.Constant(bytes16, [4] * 16)), lanes)
                mixed = builder.fadd(builder.fmul(low, xl, flags=fast), builder.fmul(high, xh, flags=fast), flags=fast)
                updated = builder.fadd(builder.load(total), builder.fmul(spread(d), mixed, flags=fast), flags=fast)
                builder.store(updated, total)
                if kind == "q4_1":  # m_b xsum_b
                    part = builder.fmul(_ir_half(builder, builder.gep(block, [ir.Constant(i32, 2)])), s, flags=fast)
                elif kind == "q4_0":  # -8 d_b xsum_b
                    part = builder.fmul(builder.fmul(d, ir.Constant(f32, -8.0), flags=fast), s, flags=fast)
                else:
                    continue
                builder.store(builder.fadd(builder.load(term), part, flags=fast), term)
        reduce = cgutils.get_or_insert_function(module, ir.FunctionType(f32, [f32, lanes]),
                                                "llvm.vector.reduce.fadd.v16f32")
        results = []
        for total, term in zip(sums, terms):
            summed = builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(total)], fastmath=fast)  # a tree
            results.append(builder.fadd(summed, builder.load(term), flags=fast))
        return context.make_tuple(builder, signature.return_type, results)

    return codegen


def _dequantize_row(raw, values, r, code, half, out):  # pragma: no cover - compiled
    """Row r of W into out (K,) float32, as `dequantize` does (codes: QUANT_TYPES)."""
    columns = out.shape[0]
    if code == 0 or code == 2:  # F32, BF16 (the high half of a float32): bits put together, then viewed
        bits = np.empty(columns, np.uint32)
        for k in range(columns):
            if code == 0:
                at = 4 * k
                bits[k] = np.uint32(raw[r, at]) | (np.uint32(raw[r, at + 1]) << np.uint32(8)) \
                    | (np.uint32(raw[r, at + 2]) << np.uint32(16)) | (np.uint32(raw[r, at + 3]) << np.uint32(24))
            else:
                bits[k] = (np.uint32(raw[r, 2 * k]) << np.uint32(16)) | (np.uint32(raw[r, 2 * k + 1]) << np.uint32(24))
        out[:] = bits.view(np.float32)
    elif code == 1:  # F16
        for k in range(columns):
            out[k] = half[raw[r, 2 * k] | (np.int32(raw[r, 2 * k + 1]) << 8)]
    elif code == 3 or code == 4:  # Q4_0, Q4_1: a block's 16 bytes of nibbles, two straight loops
        blocks = columns // 32
        size = raw.shape[1] // blocks if blocks else 18  # 18 or 20 bytes a block
        has_min = code == 4
        # n is 16, computed from the array: with a literal 16 LLVM unrolled the loops into
        # scalar code (0.54 ns a weight); a count it cannot fold keeps them loops, which it
        # vectorizes (0.29 ns, Zen 4; a 50-token prefill spends a fifth of its time here)
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
    elif code <= 6:  # Q5_0, Q5_1
        size = (18, 20, 22, 24)[code - 3]
        has_min = code == 4 or code == 6
        five = code >= 5
        for b in range(columns // 32):
            o = size * b
            d = half[raw[r, o] | (np.int32(raw[r, o + 1]) << 8)]
            m = np.float32(0.0)
            at = o + 2
            if has_min:
                m = half[raw[r, at] | (np.int32(raw[r, at + 1]) << 8)]
                at += 2
            qh = np.uint32(0)
            if five:
                qh = raw[r, at] | (np.uint32(raw[r, at + 1]) << 8) | (np.uint32(raw[r, at + 2]) << 16) \
                    | (np.uint32(raw[r, at + 3]) << 24)
                at += 4
            shift = 0 if has_min else (16 if five else 8)
            for j in range(16):
                q = raw[r, at + j]
                lo = np.int32(q & 15)
                hi = np.int32(q >> 4)
                if five:
                    lo |= np.int32((qh >> j) & 1) << 4
                    hi |= np.int32((qh >> (j + 16)) & 1) << 4
                if has_min:
                    out[32 * b + j] = d * np.float32(lo) + m
                    out[32 * b + 16 + j] = d * np.float32(hi) + m
                else:
                    out[32 * b + j] = d * np.float32(lo - shift)
                    out[32 * b + 16 + j] = d * np.float32(hi - shift)
    elif code == 7:  # Q8_0 (a computed count of 32: a loop LLVM vectorizes, as for Q4 above)
        blocks = columns // 32
        size = raw.shape[1] // blocks if blocks else 34
        n = size - 2
        signed = values[r]
        for b in range(blocks):
            o = size * b
            d = half[raw[r, o] | (np.int32(raw[r, o + 1]) << 8)]
            q, dest = signed[o + 2:o + 2 + n], out[32 * b:32 * b + n]
            for j in range(n):
                dest[j] = d * np.float32(q[j])
    elif code == 8 or code == 9:  # Q4_K, Q5_K: 8 sub-blocks of 32, six-bit scales and minimums
        size = 144 if code == 8 else 176
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
                if code == 8:  # Q4_K: a straight loop over a count of 32 from the array (vectorized)
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
        size = raw.shape[1] // blocks if blocks else 210
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


def _matvec_rows(raw, values, code, half, x, out, first, stop):  # pragma: no cover - compiled
    """x @ W.T for the types without a fused loop: each row dequantized into a scratch row."""
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
# multiple of four, so the two- and four-row loops never straddle two parts).

(P_RAW, P_ROWS, P_ROW_BYTES, P_CODE, P_K, P_X, P_N, P_OUT, P_OUT_STRIDE, P_PARTS, P_INT8, P_HALF) = range(12)
PRODUCT_FRAME = 12
(D_RAW, D_ROWS, D_ROW_BYTES, D_CODE, D_K, D_START, D_COUNT, D_OUT, D_HALF, D_PARTS) = range(10)
DEQUANTIZE_FRAME = 10


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


def _product_entry(frame_address, part):  # pragma: no cover - compiled
    """Part `part` of x (N, K) @ W.T into out (N, R; rows OUT_STRIDE apart): x prepared for
    the block type (float32 halves and block sums, or 8-bit blocks), then the type's loop
    on this part's rows."""
    f = carray(_i64(frame_address), (PRODUCT_FRAME,))  # noqa: F821 - bound when compiled
    rows, width, code, K, n = f[P_ROWS], f[P_ROW_BYTES], f[P_CODE], f[P_K], f[P_N]
    first, stop = _part_rows(rows, f[P_PARTS], part)
    if first >= stop:
        return
    raw = carray(_u8(f[P_RAW]), (rows, width))  # noqa: F821
    values = carray(_i8(f[P_RAW]), (rows, width))  # noqa: F821
    x = carray(_f32(f[P_X]), (n, K))  # noqa: F821
    out = carray(_f32(f[P_OUT]), (n, f[P_OUT_STRIDE]))[:, :rows]  # noqa: F821
    blocks = K // 32
    if f[P_INT8] != 0 and (code == 3 or code == 4 or code == 7):
        q, dx = np.empty((n, K), np.int8), np.empty((n, blocks), np.float32)
        xs, qsum = np.empty((n, blocks), np.float32), np.empty((n, blocks), np.int32)
        _quantize_x_serial(x, x.view(np.uint32), q, dx, xs, qsum)  # noqa: F821
        _matvec_int8_serial(raw, code, q, dx, xs, qsum, out, first, stop)  # noqa: F821
    elif code == 3 or code == 4:
        xl, xh = np.empty((n, K // 2), np.float32), np.empty((n, K // 2), np.float32)
        xs = np.empty((n, blocks), np.float32)
        for i in range(n):
            _split_x(x[i], xl[i], xh[i], xs[i])
        if code == 4:
            _matvec_q4_1_serial(raw, xl, xh, xs, out, first, stop)  # noqa: F821
        else:
            _matvec_q4_0_serial(raw, xl, xh, xs, out, first, stop)  # noqa: F821
    elif code == 7:
        _matvec_q8_0_serial(raw, values, x, out, first, stop)  # noqa: F821
    else:
        half = carray(_f32(f[P_HALF]), (1 << 16,))  # noqa: F821
        _matvec_rows_serial(raw, values, code, half, x, out, first, stop)  # noqa: F821


def _dequantize_entry(frame_address, part):  # pragma: no cover - compiled
    """Part `part` of rows START .. START + COUNT of W into out (COUNT, K) float32."""
    f = carray(_i64(frame_address), (DEQUANTIZE_FRAME,))  # noqa: F821 - bound when compiled
    rows, width, count = f[D_ROWS], f[D_ROW_BYTES], f[D_COUNT]
    first, stop = _part_rows(count, f[D_PARTS], part)
    if first >= stop:
        return
    raw = carray(_u8(f[D_RAW]), (rows, width))  # noqa: F821
    values = carray(_i8(f[D_RAW]), (rows, width))  # noqa: F821
    out = carray(_f32(f[D_OUT]), (count, f[D_K]))  # noqa: F821
    half = carray(_f32(f[D_HALF]), (1 << 16,))  # noqa: F821
    _dequantize_rows_serial(raw, values, f[D_START] + first, f[D_CODE], half, out[first:stop])  # noqa: F821


def _rows4_intrinsic(kind: str, dot: str | None = None):
    """The numba intrinsic `_rows4_<kind>(raw, r0, r1, r2, r3, q, dx, xs, qsum)` -> four
    float32 sums, its block dots on `dot` ("vnni", "avx2", "generic"; default: the host's)."""
    from numba import types
    from numba.extending import intrinsic

    def _rows4_typing(typingctx, raw, r0, r1, r2, r3, q, dx, xs, qsum):
        return types.UniTuple(types.float32, 4)(raw, r0, r1, r2, r3, q, dx, xs, qsum), _rows4_codegen(kind, dot)

    return intrinsic(_rows4_typing)


def _rows4f_intrinsic(kind: str):
    """The numba intrinsic `_rows4f_<kind>(raw, r0, r1, r2, r3, xlo, xhi, xsum)` -> four float32 sums."""
    from numba import types
    from numba.extending import intrinsic

    def _rows4f_typing(typingctx, raw, r0, r1, r2, r3, xlo, xhi, xsum):
        return types.UniTuple(types.float32, 4)(raw, r0, r1, r2, r3, xlo, xhi, xsum), _rows4f_codegen(kind)

    return intrinsic(_rows4f_typing)


@lru_cache(maxsize=1)
def _compiled() -> dict:
    """The loops above compiled by numba (cached on disk), bound into this module's globals
    under the names the splitters call."""
    nb = kernels.numba()
    g = globals()
    g.update(native.helpers())
    g["carray"] = nb.carray
    serial = dict(cache=True, fastmath=native.FASTMATH, nogil=True)
    g["_dequantize_row"] = nb.njit(**serial)(_dequantize_row)
    g["_split_x"] = nb.njit(**serial)(_split_x)
    g["_part_rows"] = nb.njit(cache=True)(_part_rows)
    for kind in _BLOCK_BYTES:
        g[f"_rows4_{kind}"] = _rows4_intrinsic(kind)
    for kind in ("q4_1", "q4_0", "q8_0"):
        g[f"_rows4f_{kind}"] = _rows4f_intrinsic(kind)
    g["_matvec_q4"] = nb.njit(**serial)(_matvec_q4)
    loops = {
        "q4_1": nb.njit(**serial)(_matvec_q4_1),
        "q4_0": nb.njit(**serial)(_matvec_q4_0),
        "q8_0": nb.njit(**serial)(_matvec_q8_0),
        "rows": nb.njit(**serial)(_matvec_rows),
        "dequantize": nb.njit(**serial)(_dequantize_rows),
        "int8": nb.njit(**serial)(_matvec_int8),
        "quantize_x": nb.njit(**serial)(_quantize_x),
    }
    for name in ("q4_1", "q4_0", "q8_0", "rows", "int8", "quantize_x"):
        g[f"_matvec_{name}_serial" if name != "quantize_x" else "_quantize_x_serial"] = loops[name]
    g["_dequantize_rows_serial"] = loops["dequantize"]
    return loops


def _entry_sources() -> dict:
    _compiled()
    return {"product": _product_entry, "dequantize": _dequantize_entry}


def _entries() -> native.Entries:
    """This module's native entries ("product", "dequantize"; `attnkit.kernels.native`)."""
    return native.entries("quant", _entry_sources)


PARALLEL_MACS = 1 << 18
"""Products smaller than this many multiply-adds run on one thread (a thread hand-off costs
more than it saves)."""


def _threads(macs: int) -> int:
    """Threads for a product: the BLAS thread limit in force (the caller's choice, see
    `attnkit.runtime.blas_threads`), one for small products, at most numba's pool."""
    if macs < PARALLEL_MACS:
        return 1
    from attnkit.runtime import blas_thread_count, cpu_count

    return max(1, min(blas_thread_count(), cpu_count()))


@lru_cache(maxsize=1)
def _half_table() -> np.ndarray:
    """float32 value of every float16 bit pattern (65,536 entries)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def matmul(x: np.ndarray, raw: np.ndarray, kind: str, columns: int, *, compiled: bool | None = None) -> np.ndarray:
    """x @ W.T with W (R, K) given as GGUF blocks, never dequantized whole.

    Arguments:
        x: (N, K) float32 (float16 is converted; float64 runs the reference in float64).
        raw: (R, bytes per row) uint8, rows of blocks of type `kind` (a name of `QUANT_TYPES`).
        kind: the GGML type ("Q4_1", ...).
        columns: K.
        compiled: None (default): the compiled loops when `attnkit.kernels.enabled()`; False:
            the NumPy reference (`matmul_reference`); True: the compiled loops or an error.
    Returns:
        (N, R) float32 (float64 for float64 x).
    """
    return matmul_stack(x, [(raw, kind)], columns, compiled=compiled)


def matmul_stack(x: np.ndarray, parts, columns: int, *, compiled: bool | None = None) -> np.ndarray:
    """x @ concatenate([W_1, W_2, ...]).T, each W_i as blocks: fused projections (query, key
    and value) in one call, x prepared once, the outputs written side by side.

    Arguments:
        x: (N, K).
        parts: a sequence of (raw, kind), each W_i (R_i, K) as `matmul` takes it.
        columns: K.
        compiled: as in `matmul`.
    Returns:
        (N, R_1 + R_2 + ...) float32.
    """
    for raw, kind in parts:
        _check(raw, kind, columns)
    if x.ndim != 2 or x.shape[1] != columns:
        raise ValueError(f"expected x of shape (N, {columns}), got {x.shape}")
    if compiled is None:
        compiled = kernels.enabled()
    if not compiled or x.dtype == np.float64:  # the loops are float32; float64 is the reference's
        return np.concatenate([matmul_reference(x, raw, kind, columns) for raw, kind in parts], axis=1)
    run = _entries()
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    out = np.empty((n, sum(raw.shape[0] for raw, _ in parts)), np.float32)
    if n > DECODE_ROWS:  # prefill: dequantized tiles, BLAS products
        _tiled_products(run, x, parts, columns, out)
        return out
    threads = _threads(out.size * columns)
    int8 = _ACTIVATIONS[0] == "int8"
    start = 0
    for raw, kind in parts:
        rows = raw.shape[0]
        raw = np.ascontiguousarray(raw)
        target = out[:, start:start + rows]  # (N, R_i)
        start += rows
        frame = np.zeros(PRODUCT_FRAME, np.int64)
        frame[:] = (raw.ctypes.data, rows, raw.shape[1], QUANT_TYPES[kind].code, columns, x.ctypes.data, n,
                    target.ctypes.data, out.shape[1], threads, int(int8 and kind in INT8_TYPES),
                    _half_table().ctypes.data)
        _parts(run["product"], frame, threads)
    return out


def _tiled_products(run, x: np.ndarray, parts, columns: int, out: np.ndarray) -> None:
    """out = x @ concatenate(W_i).T a tile of W's rows at a time: each tile dequantized into
    the thread's scratch, then one BLAS product. With BLAS on one thread and
    `runtime.worker_threads(n)` around the call, n threads claim the tiles as they come free
    (`runtime.run_claimed`), each its own BLAS call; otherwise the calling thread runs them in
    turn on the BLAS threads in force."""
    from attnkit.runtime import blas_thread_count, run_claimed, worker_thread_count

    workers = worker_thread_count()
    if workers > 1 and blas_thread_count() > 1:  # BLAS splits each product itself
        workers = 1
    tiles = []  # (blocks, type code, first row, rows, output columns)
    start = 0
    for raw, kind in parts:
        raw, rows = np.ascontiguousarray(raw), raw.shape[0]
        count = -(-rows // max(2, _TILE_VALUES // columns))  # tiles of at most _TILE_VALUES weights
        count = -(-count // workers) * workers  # as many for each thread: 576 rows as 455 + 121 kept one waiting
        step = max(2, -(-rows // count))
        for first in range(0, rows, step):
            size = min(step, rows - first)
            tiles.append((raw, QUANT_TYPES[kind].code, first, size, out[:, start + first:start + first + size]))
        start += rows

    def product(index: int) -> None:
        raw, code, first, size, target = tiles[index]
        tile = scratch_tile("prefill tile", size, columns, np.float32)  # (rows of the tile, K)
        _dequantize_into(run, raw, code, columns, first, tile, 1)
        np.matmul(x, tile.T, out=target)  # (N, rows of the tile)

    run_claimed(len(tiles), product, min(workers, len(tiles)))


def _parts(entry, frame: np.ndarray, threads: int) -> None:
    """entry(frame, part) for every part: part 0 on this thread, the others on the pool's
    (the entries release the GIL)."""
    address = frame.ctypes.data
    if threads == 1:
        entry(address, 0)
        return
    from attnkit.runtime import worker_pool

    others = [worker_pool(threads - 1).submit(entry, address, p) for p in range(1, threads)]
    entry(address, 0)
    for other in others:
        other.result()


def _dequantize_into(run, raw: np.ndarray, code: int, columns: int, start: int, out: np.ndarray, threads: int) -> None:
    """Rows start .. start + len(out) of W (C-contiguous blocks) into out (C-contiguous float32)."""
    frame = np.zeros(DEQUANTIZE_FRAME, np.int64)
    frame[:] = (raw.ctypes.data, raw.shape[0], raw.shape[1], code, columns, start, out.shape[0], out.ctypes.data,
                _half_table().ctypes.data, threads)
    _parts(run["dequantize"], frame, threads)


def dequantize_compiled(raw: np.ndarray, kind: str, columns: int) -> np.ndarray:
    """`dequantize` by the compiled loop (`_dequantize_row`): the tests hold it to the reference."""
    _check(raw, kind, columns)
    out = np.empty((raw.shape[0], columns), np.float32)
    _dequantize_into(_entries(), np.ascontiguousarray(raw), QUANT_TYPES[kind].code, columns, 0, out,
                     _threads(out.size * 8))
    return out
