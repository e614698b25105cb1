"""The range of the scores: which dtype an attention kernel runs in.

Every kernel computes scores as (query * scale) @ key^T: the scale goes on the
query before the product, one pass over the query, so a product that would
overflow only before scaling (torch's fused CPU kernel, q @ k^T then * scale)
never does. What float32 still cannot hold, the kernels recompute in float64,
where float32 inputs of any magnitude fit: that is the answer of torch's math
backend in float64, rounded to the input dtype.

`matmul_in_chunks` is the other half of precision here: a product whose inner
side is long (a few query rows over thousands of keys) summed in chunks.

Public so that every kernel asks the same questions: attnkit.functional's plain
and tiled kernels, and attnkit.torch's (`attnkit.torch.flash`), which computes
max |q * scale| and max |k| with torch and asks `scores_bound_exceeds`.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "TINY_SCALE",
    "FEW_ROWS",
    "all_finite",
    "matmul_in_chunks",
    "needs_float64",
    "scores_bound_exceeds",
    "scores_may_overflow",
    "start_dtype",
]

TINY_SCALE = 2.0 ** -16  # below this, query * scale may fall under float32's normal range
REDUCTION_CHUNK = 64  # the inner side of each partial product in matmul_in_chunks
FEW_ROWS = 64  # a product over the keys with fewer rows than this takes matmul_in_chunks


def start_dtype(compute_dtype: np.dtype, scale: float) -> np.dtype:
    """The dtype attention runs in: the compute dtype, or float64 when the scale
    is below TINY_SCALE (query * scale could then lose digits to subnormals,
    which no later check would see)."""
    if compute_dtype != np.float64 and 0 < abs(scale) < TINY_SCALE:
        return np.dtype(np.float64)
    return np.dtype(compute_dtype)


def _max_abs(x) -> float:
    """max |x| without a temporary (NaN if x holds one; 0 for an empty array)."""
    x = np.asarray(x)
    if x.size == 0:
        return 0.0
    return float(max(np.max(x), -np.min(x)))


def scores_may_overflow(query, key, scale: float, dtype: np.dtype) -> bool:
    """Whether (query * scale) @ key^T could leave `dtype`'s range.

    Every score, and every partial sum of one, is at most
    |scale| max|q| max|k| E in magnitude (the sum of E terms |q_e| |k_e|); while
    that, and |scale| max|q|, stay under a sixteenth of dtype's largest value,
    nothing overflows, not even after adding a float mask or subtracting a row
    maximum. NaN in the inputs answers False: NaN propagates in any dtype.
    """
    return scores_bound_exceeds(_max_abs(query) * abs(scale), _max_abs(key), query.shape[-1],
                                float(np.finfo(dtype).max))


def scores_bound_exceeds(max_q_scaled: float, max_k: float, E: int, largest: float) -> bool:
    """The bound of `scores_may_overflow` from max |query * scale| and max |key|
    (attnkit.torch computes those with torch and asks this)."""
    big = largest / 16
    return max_q_scaled > big or max_q_scaled * max_k * E > big


def all_finite(*arrays) -> bool:
    """Whether no array holds an inf or a NaN (two reductions each, no temporary)."""
    return all(np.isfinite(_max_abs(x)) for x in arrays)


def needs_float64(query, key, scale: float, dtype: np.dtype, lse, value=None, output=None) -> bool:
    """After a pass in `dtype`: redo it in float64? Yes when a row's lse is not
    finite (a row with no key allowed, NaN, or an overflow) and the bound says the
    scores could have overflowed; or, given the output, when it is not finite
    although every input is (a tiled kernel's unnormalized sum of values near
    dtype's largest value). Costs one look at lse (and the output) when finite."""
    if dtype == np.float64:
        return False
    if not np.isfinite(lse).all() and scores_may_overflow(query, key, scale, dtype):
        return True
    return output is not None and not np.isfinite(output).all() and all_finite(query, key, value)


def matmul_in_chunks(a: np.ndarray, b: np.ndarray, chunk: int = REDUCTION_CHUNK) -> np.ndarray:
    """a @ b, a (..., M, N) and b (..., N, P) broadcasting as np.matmul does, with
    the inner side N cut into chunks of `chunk`: one batched product of the
    chunks (..., N // chunk, M, P), whose partials are then added, and the
    remainder's product added last. Returns (..., M, P) in the result dtype.

    Why: OpenBLAS rounds each output of a product over its whole inner side
    in one float32 run (its small-matrix kernels over all of N, its blocked
    ones over hundreds of terms), so on FlashAttention's 3 rows x 799 keys,
    d = 59, P V's error (against the float64 truth) was 2.2x torch's (MKL sums
    in blocks) and dS K's 2.2x; with chunks of 64 they are 0.73x and 1.04x
    (docs/flash.md: 16 to 256 compared). The few-row products the kernels
    take it for are memory-bound (they read b once either way, and b shared
    over a's batch once instead of once per batch entry), so it costs about
    nothing there (docs/benchmarks.md); large products keep one sgemm, which
    an inner side of 64 would slow down."""
    n = a.shape[-1]
    whole = n // chunk
    if whole < 2:
        return np.matmul(a, b)
    if a.ndim == 3 and b.ndim == 3 and b.shape[0] == 1 < a.shape[0]:
        # b shared by a's batch (GQA's heads over one kv head): their rows in one product
        # per chunk, reading b once (a decode step's heads: one product each, b read by each)
        h, rows = a.shape[:2]
        return matmul_in_chunks(a.reshape(h * rows, n), b[0], chunk).reshape(h, rows, b.shape[-1])
    m = whole * chunk
    parts = np.matmul(
        a[..., :m].reshape(*a.shape[:-1], whole, chunk).swapaxes(-2, -3),  # (..., chunks, M, chunk), a view
        b[..., :m, :].reshape(*b.shape[:-2], whole, chunk, b.shape[-1]),  # (..., chunks, chunk, P)
    )
    out = np.add.reduce(parts, axis=-3)  # (..., M, P)
    if m < n:
        out += np.matmul(a[..., m:], b[..., m:, :])
    return out
