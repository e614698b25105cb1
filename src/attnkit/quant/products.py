"""Products with GGUF's quantized weights, straight from their blocks, and their thread split.

A weight matrix W (R, K) stays as the file stores it: `raw` (R, bytes per row), uint8, each
row a run of blocks of a `GGMLType` (docs/quant.md draws them). `matmul(x, raw, kind, K)`
computes x @ W.T without ever building W in float32:

- decode (at most `DECODE_ROWS` rows of x): one compiled loop per output row reads the
  row's blocks once, expands each 4-, 5- or 8-bit value and its block scale in registers,
  and accumulates in float32 (`attnkit.quant.loops`; Q4_0, Q4_1 and Q8_0 four rows at a
  time in LLVM IR, `attnkit.quant.ir`); with more than one thread allowed (the BLAS thread
  limit in force), the output rows are split into contiguous ranges run side by side, each
  by one call of the native entry (`attnkit.kernels.native`);
- prefill (more rows of x): a tile of W's rows is dequantized into a float32 scratch tile,
  then one BLAS product per tile, as llama.cpp does for batches.

With `activations("int8")` (opt-in, scoped to the calling thread or task: a
`contextvars.ContextVar`), the Q4_0, Q4_1 and Q8_0 decode loops run as llama.cpp's do: x
quantized to 8 bits per block of 32 (`quantize_activations`), each block's dot product an
exact int32 sum; `matmul_int8_reference` is what they compute, in float64.

What runs: the compiled loops when `attnkit.kernels.enabled()`, else the NumPy reference
(`attnkit.quant.reference`), tile by tile.

Error budget (tests/quant/test_quant_kernels.py): against the float64 product of the dequantized
weights, the kernel's error is at most twice the float32 reference product's plus one
float32 rounding of |W| @ |x|: both sum K float32 products, in different orders, and the
kernel applies each block's scale once per block instead of once per weight.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache

import numpy as np

from attnkit import kernels
from attnkit.kernels.native import Entries, NativeKernelsWarning, Unavailable
from attnkit.quant import compiled as _compiled
from attnkit.quant.loops import DEQUANTIZE_FRAME, PRODUCT_FRAME, frame
from attnkit.quant.reference import TILE_VALUES, check_blocks, check_x, matmul_reference
from attnkit.quant.types import INT8_TYPES, GGMLType
from attnkit.runtime import scratch_tile

__all__ = ["DECODE_ROWS", "PARALLEL_MACS", "activations", "compiled_available", "current_activations",
           "dequantize_compiled", "matmul", "matmul_stack"]

DECODE_ROWS = 8
"""x with at most this many rows runs the fused matrix-vector loop; more run dequantized tiles
through BLAS."""
PARALLEL_MACS = 1 << 18
"""Products smaller than this many multiply-adds run on one thread (a thread hand-off costs
more than it saves)."""

_ACTIVATIONS: ContextVar[str] = ContextVar("attnkit.quant.activations", default="float32")


@contextmanager
def activations(kind: str) -> Iterator[None]:
    """Within the block, the compiled decode products of `INT8_TYPES` run on `kind`
    activations: "float32" (the default: within two float32 BLAS errors of the exact
    product) or "int8" (8-bit blocks, llama.cpp's way, within the budget derived in
    docs/kernels.md). The choice holds for the calling thread (or asyncio task) only:
    another thread running the same model meanwhile keeps its own.

        with quant.activations("int8"):
            logits = model(ids)
    """
    if kind not in ("int8", "float32"):
        raise ValueError(f'expected activations "int8" or "float32", got {kind!r}')
    token = _ACTIVATIONS.set(kind)
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def current_activations() -> str:
    """The activations the decode products run on here (this thread or task): "float32" or
    "int8" (`activations`)."""
    return _ACTIVATIONS.get()


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


def _threads(macs: int) -> int:
    """Threads for a product: the BLAS thread limit in force (the caller's choice, see
    `attnkit.runtime.blas_threads`), one for small products, at most numba's pool."""
    if macs < PARALLEL_MACS:
        return 1
    from attnkit.runtime import blas_thread_count, cpu_count

    return max(1, min(blas_thread_count(), cpu_count()))


@lru_cache(maxsize=1)
def half_table() -> np.ndarray:
    """float32 value of every float16 bit pattern (65,536 entries)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _use_compiled(compiled: bool | None) -> bool:
    if compiled is None:
        return kernels.enabled()
    if compiled and not kernels.enabled():
        raise RuntimeError(f"compiled kernels are off: {kernels.reason_disabled()}")
    return bool(compiled)


def _run(compiled: bool | None) -> Entries | None:
    """The native entries to run, or None for the NumPy reference: `compiled` False, or None
    with the kernels off; None too, with one warning, when they turn out unable to run here
    (numba installed but not importing). `compiled=True` raises then instead."""
    if not _use_compiled(compiled):
        return None
    try:
        return _compiled.entries()
    except Unavailable as error:
        if compiled:
            raise
        if not _warned:
            _warned.append(True)
            warnings.warn(f"attnkit: {error}; the NumPy reference runs the quantized products", NativeKernelsWarning,
                          stacklevel=4)
        return None


_warned: list[bool] = []


def matmul(x: np.ndarray, raw: np.ndarray, kind: str | GGMLType, columns: int, *,
           compiled: bool | None = None) -> np.ndarray:
    """x @ W.T with W (R, K) given as GGUF blocks, never dequantized whole.

    Arguments:
        x: (N, K) float32 (float16 is converted; float64 runs the reference in float64).
        raw: (R, bytes per row) uint8, rows of blocks of type `kind`.
        kind: a `GGMLType` or its name ("Q4_1", ...).
        columns: K.
        compiled: None (default): the compiled loops when `attnkit.kernels.enabled()`; False:
            the NumPy reference (`matmul_reference`); True: the compiled loops or an error.
    Returns:
        (N, R) float32 (float64 for float64 x).
    Raises:
        ValueError, TypeError: x, raw or kind not as described (before any compiled code runs).
    """
    return matmul_stack(x, [(raw, kind)], columns, compiled=compiled)


def _check_parts(parts, columns: int) -> list[tuple[np.ndarray, GGMLType]]:
    if not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError(f"expected parts as a non-empty list of (raw, kind) pairs, got {type(parts).__name__}")
    checked = []
    for part in parts:
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise TypeError(f"expected each part as a (raw, kind) pair, got {part!r:.80}")
        raw, kind = part
        checked.append((raw, check_blocks(raw, kind, columns)))
    return checked


def matmul_stack(x: np.ndarray, parts, columns: int, *, compiled: bool | None = None) -> np.ndarray:
    """x @ concatenate([W_1, W_2, ...]).T, each W_i as blocks: fused projections (query, key
    and value) in one call, x prepared once, the outputs written side by side.

    Arguments:
        x: (N, K) float16, float32 or float64.
        parts: a sequence of (raw, kind), each W_i (R_i, K) as `matmul` takes it.
        columns: K.
        compiled: as in `matmul`.
    Returns:
        (N, R_1 + R_2 + ...) float32 (float64 for float64 x).
    """
    parts = _check_parts(parts, columns)
    check_x(x, columns)
    run = _run(compiled) if x.dtype != np.float64 else None  # the loops are float32; float64 is the reference's
    if run is None:
        return np.concatenate([matmul_reference(x, raw, kind, columns) for raw, kind in parts], axis=1)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    out = np.empty((n, sum(raw.shape[0] for raw, _ in parts)), np.float32)
    if n > DECODE_ROWS:  # prefill: dequantized tiles, BLAS products
        _tiled_products(run, x, parts, columns, out)
        return out
    threads = _threads(out.size * columns)
    int8 = current_activations() == "int8"
    start = 0
    for raw, kind in parts:
        rows = raw.shape[0]
        raw = np.ascontiguousarray(raw)
        target = out[:, start:start + rows]  # (N, R_i)
        start += rows
        record = frame(PRODUCT_FRAME, raw=raw.ctypes.data, rows=rows, row_bytes=raw.shape[1], type=kind,
                       columns=columns, x=x.ctypes.data, n=n, out=target.ctypes.data, out_stride=out.shape[1],
                       parts=threads, int8=int8 and kind.name in INT8_TYPES, half=half_table().ctypes.data)
        _parts(run["product"], record, threads)
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
    tiles = []  # (blocks, type, first row, rows, output columns)
    start = 0
    for raw, kind in parts:
        raw, rows = np.ascontiguousarray(raw), raw.shape[0]
        if rows == 0:  # a part of no rows adds no output columns
            continue
        count = -(-rows // max(2, TILE_VALUES // columns))  # tiles of at most TILE_VALUES weights
        count = -(-count // workers) * workers  # as many for each thread: 576 rows as 455 + 121 kept one waiting
        step = max(2, -(-rows // count))
        for first in range(0, rows, step):
            size = min(step, rows - first)
            tiles.append((raw, kind, first, size, out[:, start + first:start + first + size]))
        start += rows

    def product(index: int) -> None:
        raw, kind, first, size, target = tiles[index]
        tile = scratch_tile("prefill tile", size, columns, np.float32)  # (rows of the tile, K)
        _dequantize_into(run, raw, kind, columns, first, tile, 1)
        np.matmul(x, tile.T, out=target)  # (N, rows of the tile)

    run_claimed(len(tiles), product, min(workers, len(tiles)))


def _parts(entry, record: np.ndarray, threads: int) -> None:
    """entry(record, part) for every part: part 0 on this thread, the others on the pool's
    (the entries release the GIL)."""
    address = record.ctypes.data
    if threads == 1:
        entry(address, 0)
        return
    from attnkit.runtime import worker_pool

    others = [worker_pool(threads - 1).submit(entry, address, p) for p in range(1, threads)]
    entry(address, 0)
    for other in others:
        other.result()


def _dequantize_into(run, raw: np.ndarray, kind: GGMLType, columns: int, start: int, out: np.ndarray,
                     threads: int) -> None:
    """Rows start .. start + len(out) of W (C-contiguous blocks) into out (C-contiguous float32)."""
    assert raw.flags.c_contiguous and out.flags.c_contiguous and out.dtype == np.float32
    assert 0 <= start and start + out.shape[0] <= raw.shape[0] and out.shape[1] == columns
    record = frame(DEQUANTIZE_FRAME, raw=raw.ctypes.data, rows=raw.shape[0], row_bytes=raw.shape[1], type=kind,
                   columns=columns, start=start, count=out.shape[0], out=out.ctypes.data,
                   half=half_table().ctypes.data, parts=threads)
    _parts(run["dequantize"], record, threads)


def dequantize_compiled(raw: np.ndarray, kind: str | GGMLType, columns: int) -> np.ndarray:
    """`dequantize` by the compiled loop (`_dequantize_row`): the tests hold it to the reference.

    Arguments:
        raw: (R, bytes per row) uint8 blocks of `kind`; kind: a `GGMLType` or its name; columns: K.
    Returns:
        (R, K) float32.
    """
    kind = check_blocks(raw, kind, columns)
    _use_compiled(True)
    out = np.empty((raw.shape[0], columns), np.float32)
    _dequantize_into(_compiled.entries(), np.ascontiguousarray(raw), kind, columns, 0, out, _threads(out.size * 8))
    return out
