"""Flash attention on the CPU: exact attention computed tile by tile.

The plain path (`scaled_dot_product_attention`) materializes the (L, S) score
matrix. This one never does: for a block of queries it walks over blocks of
keys keeping, per query row, a running reference m (the max so far), a running
sum l = sum exp(s - m) and an accumulator acc = sum exp(s - m) v, rescaling both
by exp(m_old - m_new) whenever the reference moves (the online softmax). At the
end output = acc / l and lse = m + log(l). Extra memory is O(block_q * block_k)
per thread plus O(L + S) per head; results equal the plain path to rounding.

The backward is FlashAttention-2's: with D = rowsum(dO * O) (summed in float64;
rows a tile holds whole take rowsum(P dP) from it, as the plain path)
it recomputes each tile's weights P = exp(s - lse) from the saved lse and
accumulates dV, dK and dQ tile by tile, never holding an (L, S) array either.
A row's dominant key (weight above 3/4) gets its dS as minus the sum of the
rest of its row (a softmax's dS sums to 0) rather than P (dP - D), which
cancels only to the rounding of two dot products: peaked rows (large scores,
a single visible key) get the plain path's accuracy and its exact zeros.

The forward and the backward share one plan (`FlashPlan`): the validated
problem, its band, mask and mods, and the tile grid. `flash_attention(...,
return_lse=True)` returns it inside its `AttentionState`, and
`flash_attention_backward(grad_output, q, k, v, output, state)` takes it from
there, so the backward cannot run on another grid than the forward's. The plan
records the problem (`FlashProblem`) and the state the dtype the forward ran
in, so the backward refuses a state of another problem and runs where the
forward ran (float64 included).

The scale multiplies q (and, for dQ, k) before each product. Scores beyond the
compute dtype (float32 inputs near 1e19 and up), a scale below 2^-16, or a
gradient overflowing on the way make a call run in float64 instead, so that
finite inputs give torch's math-backend answer in float64, never NaN.

Speed on a CPU comes from NumPy doing the heavy lifting in BLAS matmuls and
SIMD ufuncs that release the GIL: tiles are sized from the L2 cache the OS
reports (and cut finer along a causal diagonal), everything stays in the
compute dtype, buffers are reused (out=), blocks the masks exclude entirely are
skipped, and (batch, head, query block) tasks run on a pool of threads while
BLAS itself is held to one thread (threadpoolctl). Value rows carry an extra
column of ones, so P @ [V, 1] yields the row sums l with the output; the
backward folds -D into its dP matmul the same way. With the compiled kernels
(`attnkit.kernels.flash`, float32) a call takes the fused tiles instead
(`FlashPlan.fused`): one compiled pass per tile shifts, exponentiates, masks the
band's edges and sums the rows in the forward, and the backward makes dS, finds
the dominant keys and sums dS in a second one, so every product runs at the
head's own width and no ones column is copied. (Not exp2 with log2(e)
folded into the scale: NumPy's exp2 is faster than exp on arguments in
[-126, 0] but many times slower on -inf and on results that underflow, which masked
and causal tiles are full of; docs/benchmarks.md, 'Measurements behind design choices'.)

Exactness between the two passes: tiles sit on one (block_q, block_k) grid in
the forward and the backward and their scores come from one function
(`_tile_scores`), so the backward rebuilds bitwise the scores whose lse the
forward saved; lse is kept in float64 and subtracted as a float32 part plus a
per-row factor. A near-one-hot row then gets weights exp(s - lse) that sum to
1 to rounding, as the plain path's normalized softmax does.

The package, one job a module: `plan` (problem, band, tile grid), `forward`,
`backward`, `state` (AttentionState, merge_attention_states); this module
re-exports them and holds `flash_backend`, the adapter behind the one backend
signature. Threads, scratch memory and the L2 probe are `attnkit.runtime`'s.

See docs/flash.md for the algorithm and the mods.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from attnkit.functional._checks import check_key_padding_mask, check_qkv
from attnkit.functional.attention import AttentionOutput, scaled_dot_product_attention
from attnkit.functional.flash.backward import PEAK, flash_attention_backward
from attnkit.functional.flash.forward import flash_attention
from attnkit.functional.flash.plan import (  # the constants and _make_plan for the tests
    FEW_ROWS_KEYS,
    MAX_BLOCK,
    MAX_BLOCK_Q,
    ONES_MIN_ROWS,
    PIECE_ROWS,
    FlashPlan,
    FlashProblem,
    _make_plan,
    choose_blocks,
)
from attnkit.functional.flash.state import AttentionState, merge_attention_states
from attnkit.functional.mods import and_mods
from attnkit.runtime import l2_cache_bytes

__all__ = [
    "AttentionState",
    "FlashPlan",
    "FlashProblem",
    "choose_blocks",
    "flash_attention",
    "flash_attention_backward",
    "flash_backend",
    "l2_cache_bytes",
    "merge_attention_states",
]


def flash_backend(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: int | tuple[int | None, int | None] | None = None,
    key_padding_mask: np.ndarray | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    rng: np.random.Generator | int | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    sinks: np.ndarray | None = None,
) -> np.ndarray | AttentionOutput:
    """`flash_attention` behind the one backend signature (registered as
    ATTENTION_BACKENDS["flash"]; see `attnkit.functional`).

    is_causal with causal_align, and window, become flash's band: tiles outside
    it are never computed (a KV cache's bottom-right causal chunk costs half
    the tiles). key_padding_mask (..., S) becomes a mask mod, evaluated per
    tile, so it combines with the band (an `attn_mask` could not: flash takes
    no attn_mask together with is_causal). score_mod and mask_mod pass through.

    One query row per head (L = 1, a decode step) has no tile to skip and
    scores of O(S) already: it runs the plain kernel (`scaled_dot_product_attention`,
    same arguments), whose one product per head group beats the tile loop.

    `sinks` (Hq,): learned per-head logits that join each row's softmax denominator
    (the backend table's `sinks` capability; `flash_attention` documents them).

    The flash backend never forms the weights, so dropout and return_weights
    are refused."""
    if dropout_p:
        raise ValueError(f"the flash backend has no dropout; expected dropout_p=0.0, got {dropout_p}")
    if return_weights:
        raise ValueError("the flash backend never forms the (L, S) weights; use the 'naive' backend for them")
    if np.shape(query)[-2:-1] == (1,):  # a decode step: the plain kernel (see above)
        return scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa,
            causal_align=causal_align, window=window, key_padding_mask=key_padding_mask,
            score_mod=score_mod, mask_mod=mask_mod, return_lse=return_lse, sinks=sinks,
        )
    if key_padding_mask is not None:
        shapes = check_qkv(query, key, value, enable_gqa)[3]
        padding = check_key_padding_mask(key_padding_mask, shapes)  # (*batch, S)
        if not padding.all():
            real = np.ascontiguousarray(padding).reshape(-1, shapes.S)  # (B, S), b = flattened batch index

            def key_padding(b, h, q_idx, kv_idx):
                return real[b, kv_idx]  # (1, cols), True = a real key

            mask_mod = key_padding if mask_mod is None else and_mods(mask_mod, key_padding)
    # flash_attention looked up here, in the package, at call time (what a test's spy replaces)
    res = flash_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align=causal_align,
                          window=window, score_mod=score_mod, mask_mod=mask_mod, return_lse=True,
                          sinks=sinks)
    if not return_lse:
        return res.output
    return AttentionOutput(output=res.output, weights=None, lse=res.lse.astype(res.output.dtype, copy=False))
