"""The result of attention over some keys in a form that can be merged:
`AttentionState` (what `flash_attention(..., return_lse=True)` returns, and
what its backward takes) and `merge_attention_states`, the online-softmax
update applied to whole partial results (split-KV decoding, chunked prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from attnkit.functional._checks import require_float_tensor, shape_str

if TYPE_CHECKING:
    from attnkit.functional.flash.plan import FlashPlan


@dataclass(frozen=True, eq=False)
class AttentionState:
    """Attention over some set of keys, in a form that can be merged, and, from
    `flash_attention(..., return_lse=True)`, what its backward needs.

    output: (..., H, L, Ev) the attention output over those keys.
    lse:    (..., H, L) natural-log logsumexp of each query row's masked,
            scaled scores (-inf for a row with no key allowed), in float64:
            rounding lse to float32 would scale a whole row of the weights the
            backward rebuilds from it by up to |lse| * 6e-8.
    plan:   the forward's `FlashPlan` (problem, band, mask, mods, tile grid),
            for `flash_attention_backward`; None for a merged state.
    shift:  (..., H, L) float64, the constant the forward subtracted inside
            each row's score products (see `_forward_rows`), so that the
            backward rebuilds bitwise the same scores; None for a merged state.
    shifted_lse: (..., H, L) float64, lse - shift as the forward summed it
            (lse itself, in float64, drops the low bits of a shift near 1e10).
    sinks:  (H,) float64, the forward's attention sinks, or None; lse and
            shifted_lse then hold them (`attnkit.functional.sinks`).
    run_dtype: the dtype the forward ran in: the compute dtype, or float64
            where that could not hold the scores (see `flash_attention`). The
            backward runs in it too, on the same scores.

    `output, lse = state` unpacks it as before.
    """

    output: np.ndarray
    lse: np.ndarray
    plan: FlashPlan | None = field(default=None, repr=False)
    shift: np.ndarray | None = field(default=None, repr=False)
    shifted_lse: np.ndarray | None = field(default=None, repr=False)
    run_dtype: np.dtype | None = field(default=None, repr=False)
    sinks: np.ndarray | None = field(default=None, repr=False)

    def __iter__(self):
        return iter((self.output, self.lse))


def merge_attention_states(outputs: Sequence[np.ndarray], lses: Sequence[np.ndarray]) -> AttentionState:
    """Combine attention computed over disjoint sets of keys into attention over their union.

    With per-part outputs o_i and logsumexps lse_i of the same queries,
        lse = log(sum_i exp(lse_i)),   output = sum_i exp(lse_i - lse) * o_i,
    exactly what attention over all the keys at once gives (split-KV decoding,
    chunked prefill). A part where a row saw no key weighs 0, whatever its
    output holds there; both markers of such a row are accepted: lse -inf
    (attnkit, FlexAttention: the log of an empty sum) and lse +inf
    (FlashAttention-2, vLLM). A row no part saw comes out output 0, lse -inf,
    never NaN. NaN in a part that counts propagates.

    Arguments:
        outputs: n arrays (..., L, Ev), or one stacked array (n, ..., L, Ev).
        lses: n arrays (..., L), or one stacked array (n, ..., L).

    Returns:
        AttentionState(output (..., L, Ev), lse (..., L)) in the outputs' dtype
        (float16 computes in float32).
    """
    outs = [require_float_tensor(o, f"outputs[{i}]", 1) for i, o in enumerate(outputs)]
    ls = [require_float_tensor(x, f"lses[{i}]", 1) for i, x in enumerate(lses)]
    if not outs:
        raise ValueError("merge_attention_states needs at least one state, got none")
    if len(outs) != len(ls):
        raise ValueError(f"expected as many lses as outputs, got {len(ls)} lses for {len(outs)} outputs")
    for i, (o, x) in enumerate(zip(outs, ls)):
        if o.shape != outs[0].shape:
            raise ValueError(f"expected every output of shape {shape_str(outs[0].shape)}, got {shape_str(o.shape)} at {i}")
        if o.ndim < 1 or x.shape != o.shape[:-1]:
            raise ValueError(
                f"expected lses[{i}] of shape {shape_str(o.shape[:-1])} (the output without its last axis), "
                f"got {shape_str(x.shape)}"
            )
    dtype = outs[0].dtype
    cd = np.dtype(np.float32) if dtype == np.float16 else np.result_type(dtype, ls[0].dtype)
    lse_stack = np.stack([x.astype(cd, copy=False) for x in ls])  # (n, ..., L)
    empty = np.isinf(lse_stack)  # -inf (ours, FlexAttention's) or +inf (FlashAttention-2's): no key
    lse_stack[empty] = -np.inf
    top = np.max(lse_stack, axis=0)
    top = np.where(np.isneginf(top), cd.type(0), top)
    weights = np.exp(lse_stack - top)  # (n, ..., L); 0 for parts that saw nothing
    total = weights.sum(axis=0)  # 0 where no part saw a key; NaN propagates
    with np.errstate(divide="ignore"):
        lse = np.where(total == 0, cd.type(-np.inf), top + np.log(np.where(total == 0, 1, total)))
    out = np.zeros(outs[0].shape, dtype=cd)
    for w, o, nothing in zip(weights, outs, empty):
        part = w[..., None] * o.astype(cd, copy=False)
        out += np.where(nothing[..., None], cd.type(0), part)  # an empty part's output is never read
    out /= np.where(total == 0, 1, total)[..., None]
    return AttentionState(out.astype(dtype, copy=False), lse.astype(cd, copy=False))
