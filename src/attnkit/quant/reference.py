"""The NumPy reference: GGML blocks dequantized, products, activations quantized to 8 bits.

Written as ggml-quants.c's `dequantize_row_*` and `quantize_row_q8_1_ref` are, plain and
whole-array; the gguf package's `gguf.quants.dequantize` is its oracle in the tests, and
the compiled loops (`attnkit.quant.loops`) are held to it. What runs when the compiled
kernels are off (`attnkit.kernels.enabled()`), and for float64 inputs.
"""

from __future__ import annotations

import numpy as np

from attnkit.quant.types import INT8_TYPES, GGMLType, ggml_type, row_bytes

__all__ = ["dequantize", "matmul_int8_reference", "matmul_reference", "quantize_activations"]

TILE_VALUES = 1 << 18
"""A prefill tile: 1 MB of float32 weights (kept per thread, `runtime.scratch_tile`)."""


def check_blocks(raw: np.ndarray, kind: str | GGMLType, columns: int) -> GGMLType:
    """`kind` as a `GGMLType`, after checking that `raw` holds rows of its blocks: a 2-D
    uint8 array of `row_bytes(kind, columns)` bytes a row, its rows contiguous."""
    kind = ggml_type(kind)
    if not isinstance(columns, (int, np.integer)) or isinstance(columns, bool) or columns <= 0:
        raise ValueError(f"expected columns to be a positive integer, got {columns!r}")
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        arrived = f"{getattr(raw, 'dtype', type(raw).__name__)} {getattr(raw, 'shape', '')}"
        raise TypeError(f"expected raw blocks as a 2-D uint8 array (rows, bytes per row), got {arrived}")
    expected = row_bytes(kind, columns)
    if raw.shape[1] != expected:
        raise ValueError(f"expected {expected} bytes per row for {columns} {kind.name} values, got {raw.shape[1]}")
    return kind


def check_x(x: np.ndarray, columns: int) -> np.ndarray:
    """x as an (N, K) array of floats (float16, float32 or float64), K = `columns`."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"expected x as a NumPy array of shape (N, {columns}), got {type(x).__name__}")
    if x.ndim != 2 or x.shape[1] != columns:
        raise ValueError(f"expected x of shape (N, {columns}), got {x.shape}")
    if x.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError(f"expected x of dtype float16, float32 or float64, got {x.dtype}")
    return x


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


_SMALL = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1)
_WITH_MIN = (GGMLType.Q4_1, GGMLType.Q5_1)
_FIVE_BITS = (GGMLType.Q5_0, GGMLType.Q5_1)


def dequantize(raw: np.ndarray, kind: str | GGMLType, columns: int) -> np.ndarray:
    """The reference: blocks (rows, bytes per row) -> float32 (rows, columns), with NumPy.

    Arguments:
        raw: uint8 (rows, bytes per row), rows of blocks of type `kind`.
        kind: a `GGMLType` or its name ("Q4_1", ...).
        columns: values per row (K).
    Returns:
        (rows, columns) float32, value for value what ggml's `dequantize_row_*` gives.
    """
    kind = check_blocks(raw, kind, columns)
    rows = raw.shape[0]
    if kind == GGMLType.F32:
        return np.ascontiguousarray(raw).view(np.float32).reshape(rows, columns).copy()
    if kind == GGMLType.F16:
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(rows, columns)
    if kind == GGMLType.BF16:
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16  # the high half of a float32
        return bits.view(np.float32).reshape(rows, columns)
    b = raw.reshape(rows, -1, kind.type_size)  # (R, blocks, bytes)
    if kind in _SMALL:
        d = _half(b, 0)[..., None]  # (R, blocks, 1)
        offset = 4 if kind in _WITH_MIN else 2
        qh_at = offset
        if kind in _FIVE_BITS:
            offset += 4
        qs = b[..., offset:offset + 16]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)  # (R, blocks, 32)
        if kind in _FIVE_BITS:
            qh = np.ascontiguousarray(b[..., qh_at:qh_at + 4]).view("<u4")  # (R, blocks, 1)
            q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int32)
        if kind in _WITH_MIN:
            values = d * q.astype(np.float32) + _half(b, 2)[..., None]
        else:
            values = d * (q - (8 if kind == GGMLType.Q4_0 else 16)).astype(np.float32)
    elif kind == GGMLType.Q8_0:
        values = _half(b, 0)[..., None] * b[..., 2:].view(np.int8).astype(np.float32)
    elif kind in (GGMLType.Q4_K, GGMLType.Q5_K):
        d, dmin = _half(b, 0)[..., None], _half(b, 2)[..., None]
        sc, mn = _k_scales(b[..., 4:16])  # (R, blocks, 8)
        qs = b[..., -128:].reshape(rows, -1, 4, 32)  # 4 groups of 32 bytes: sub-blocks 2g (low), 2g+1 (high)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 8, 32).astype(np.float32)
        if kind == GGMLType.Q5_K:
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


def matmul_reference(x: np.ndarray, raw: np.ndarray, kind: str | GGMLType, columns: int) -> np.ndarray:
    """x @ W.T with W dequantized by `dequantize` a tile of rows at a time, in BLAS.

    Arguments:
        x: (N, K), float32 (float16 is converted), or float64 (then computed in float64).
        raw, kind, columns: W (R, K) as blocks (see `dequantize`).
    Returns:
        (N, R) in x's dtype (float32 or float64).
    """
    check_blocks(raw, kind, columns)
    check_x(x, columns)
    dtype = np.float64 if x.dtype == np.float64 else np.float32
    x = np.ascontiguousarray(x, dtype=dtype)
    out = np.empty((x.shape[0], raw.shape[0]), dtype)
    step = max(1, TILE_VALUES // columns)
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


def matmul_int8_reference(x: np.ndarray, raw: np.ndarray, kind: str | GGMLType, columns: int) -> np.ndarray:
    """What the int8 products compute, in float64: the dequantized W times x's 8-bit values
    (`quantize_activations`), the Q4_1 minimum's term on their block sums `xs`.

    Arguments:
        x: (N, K); raw, kind, columns: W as blocks, kind one of `INT8_TYPES`.
    Returns:
        (N, R) float64.
    """
    kind = ggml_type(kind)
    if kind.name not in INT8_TYPES:
        raise ValueError(f"expected one of {', '.join(INT8_TYPES)}, got {kind.name!r}")
    check_blocks(raw, kind, columns)
    check_x(np.asarray(x), columns)
    q, dx, xs = quantize_activations(np.asarray(x, np.float32))
    n, blocks = q.shape[0], columns // 32
    xq = (q.reshape(n, blocks, 32).astype(np.float64) * dx.astype(np.float64)[..., None]).reshape(n, columns)
    w = dequantize(raw, kind, columns).astype(np.float64)  # (R, K)
    if kind != GGMLType.Q4_1:  # Q4_0, Q8_0: no minimum term
        return xq @ w.T
    m = _half(raw.reshape(raw.shape[0], blocks, kind.type_size), 2).astype(np.float64)  # (R, blocks)
    steps = (w.reshape(-1, blocks, 32) - m[..., None]).reshape(w.shape)  # d q, the minimum taken out
    return xq @ steps.T + xs.astype(np.float64) @ m.T
