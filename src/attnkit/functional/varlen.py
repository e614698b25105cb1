"""Packed variable-length attention with FlashAttention's `flash_attn_varlen_func` layout.

A batch of sequences of different lengths is packed along one token axis,
without padding: `q` is (total_q, H, E), `k` and `v` are (total_k, Hkv, ·), and
`cu_seqlens_q` / `cu_seqlens_k` hold the cumulative offsets (batch + 1 entries,
starting at 0), so sequence `b` is rows `cu_seqlens[b] : cu_seqlens[b + 1]`.
Each sequence attends to its own keys only. Sequences of one shape (L, S) go
through the backend together, as one batch: one call per shape rather than per
sequence, the same arithmetic per sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attnkit.functional._checks import (
    check_dropout,
    check_rng,
    check_scale,
    compute_dtype_of,
    require_float_tensor,
    shape_str,
)
from attnkit.functional.attention import scaled_dot_product_attention
from attnkit.functional.backends import BACKEND_CAPABILITIES, BackendCapabilities
from attnkit.functional.flash import flash_attention
from attnkit.functional.masks import causal_mask

VARLEN_BACKENDS = tuple(name for name, can in BACKEND_CAPABILITIES.items() if can.varlen)  # ("naive", "flash")


class VarlenOutput(NamedTuple):
    """varlen_attention's result with return_lse: output (total_q, H, Ev) in q's
    dtype, lse (H, total_q) as FlashAttention lays it out, in float32 (float64
    for float64 inputs); -inf for a query whose sequence has no key."""

    output: np.ndarray
    lse: np.ndarray


def _check_cu_seqlens(cu, name: str, total: int, total_name: str) -> np.ndarray:
    """1-D integer cumulative offsets: starting at 0, never decreasing, ending at `total`."""
    if not isinstance(cu, np.ndarray):
        if hasattr(cu, "__array__") or isinstance(cu, (list, tuple)):
            cu = np.asarray(cu)
        else:
            raise TypeError(f"expected {name} to be a 1-D integer numpy array, got {type(cu).__name__}")
    if cu.dtype == np.bool_ or not np.issubdtype(cu.dtype, np.integer):
        raise TypeError(f"expected {name} to be an integer array (int32 or int64), got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(
            f"expected {name} of shape (batch + 1,) holding cumulative offsets, got shape {shape_str(cu.shape)}"
        )
    cu = cu.astype(np.int64, copy=False)
    if cu[0] != 0:
        raise ValueError(f"expected {name} to start at 0, got {cu[0]}")
    steps = np.diff(cu)
    if (steps < 0).any():
        b = int(np.argmax(steps < 0))
        raise ValueError(
            f"expected {name} to never decrease (each sequence length >= 0), "
            f"got {cu[b + 1]} after {cu[b]} at index {b + 1}"
        )
    if cu[-1] != total:
        raise ValueError(f"expected {name} to end at {total_name}={total}, got {cu[-1]}")
    return cu


def _check_max_seqlen(value, name: str, actual: int) -> None:
    """FlashAttention sizes its kernels by max_seqlen; here it is only checked."""
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected {name} to be an integer or None, got {type(value).__name__}")
    if value < actual:
        raise ValueError(f"expected {name} >= the longest sequence ({actual}), got {value}")


def _shape_groups(lens_q: np.ndarray, lens_k: np.ndarray, separate: bool):
    """(L, S, sequence indices) for every (L, S) shape with a query and a key, the
    sequences of one shape together (in order), or each alone when `separate`
    (dropout: each sequence draws its weights from the Generator in turn)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for b, (L, S) in enumerate(zip(lens_q.tolist(), lens_k.tolist())):
        if L and S:  # no query, or no key: zeros and lse -inf, as the output starts
            if separate:
                yield L, S, [b]
            else:
                groups.setdefault((L, S), []).append(b)
    for (L, S), seqs in groups.items():
        yield L, S, seqs


def _rows(cu: np.ndarray, seqs: list[int], length: int) -> slice | np.ndarray:
    """The packed rows of sequences `seqs` (each `length` long): a slice when they lie
    back to back (length-sorted batches), else an index array."""
    starts = cu[seqs]
    if len(seqs) == 1 or bool((np.diff(starts) == length).all()):
        return slice(int(starts[0]), int(starts[0]) + len(seqs) * length)
    return (starts[:, None] + np.arange(length)).reshape(-1)


def varlen_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    scale: float | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    rng: np.random.Generator | int | None = None,
    backend: str = "naive",
    return_lse: bool = False,
) -> np.ndarray | VarlenOutput:
    """Attention over a packed batch of variable-length sequences, with
    FlashAttention's `flash_attn_varlen_func` interface.

    Arguments:
        q: (total_q, H, E) floating array: the queries of every sequence, packed.
        k: (total_k, Hkv, E), same dtype.
        v: (total_k, Hkv, Ev).
        cu_seqlens_q, cu_seqlens_k: 1-D integer arrays (int32 or int64) of
            batch + 1 cumulative offsets, from 0 to total_q / total_k; sequence
            b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] and it sees
            only its own keys k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]].
        max_seqlen_q, max_seqlen_k: the longest sequence lengths, as
            FlashAttention takes them; optional here, and checked if given.
        scale: multiplies q . k; default 1/sqrt(E).
        causal: causal mask per sequence, aligned to the bottom right as in
            FlashAttention >= 2.1: query i of a sequence with L queries over S
            keys sees keys 0..i + S - L (top-left and bottom-right agree when
            L = S; a query with no key allowed gets output 0).
        dropout_p: dropout on the weights ("naive" backend only), drawn from `rng`.
        rng: numpy Generator or integer seed for dropout.
        backend: "naive" (`scaled_dot_product_attention`) or "flash"
            (`flash_attention`), called once per sequence shape (L, S) with
            the sequences of that shape as one batch (a length-sorted batch
            has few shapes), or once per sequence with dropout.
        return_lse: also return the logsumexp of each score row.

    Grouped-query attention as in the rest of attnkit: query head h reads
    key/value head h // (H // Hkv).

    Returns:
        The output (total_q, H, Ev) in q's dtype, or with return_lse
        VarlenOutput(output, lse) with lse (H, total_q) like FlashAttention's
        softmax_lse, in float32 (float64 for float64 inputs).
    """
    if not BACKEND_CAPABILITIES.get(backend, BackendCapabilities()).varlen:
        raise ValueError(f"unknown varlen attention backend {backend!r}; expected one of {list(VARLEN_BACKENDS)}")
    q = require_float_tensor(q, "q", 0)
    k = require_float_tensor(k, "k", 0)
    v = require_float_tensor(v, "v", 0)
    for x, name, layout in ((q, "q", "(total_q, H, E)"), (k, "k", "(total_k, Hkv, E)"), (v, "v", "(total_k, Hkv, Ev)")):
        if x.ndim != 3:
            raise ValueError(f"expected {name} laid out as {layout}, got shape {shape_str(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"expected q, k and v of one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    total_q, H, E = q.shape
    total_k, Hkv, Ek = k.shape
    Ev = v.shape[2]
    if Ek != E:
        raise ValueError(f"expected k of shape (total_k, Hkv, E) with E={E} like q, got {shape_str(k.shape)}")
    if v.shape[:2] != (total_k, Hkv):
        raise ValueError(
            f"expected v of shape (total_k={total_k}, Hkv={Hkv}, Ev) like k {shape_str(k.shape)}, "
            f"got {shape_str(v.shape)}"
        )
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"expected the query head count to be a multiple of the key/value head count, "
            f"got {H} query heads over {Hkv}"
        )
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q, "total_q")
    cu_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k, "total_k")
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"expected cu_seqlens_q and cu_seqlens_k for the same batch, got {cu_q.shape[0] - 1} "
            f"and {cu_k.shape[0] - 1} sequences"
        )
    lens_q, lens_k = np.diff(cu_q), np.diff(cu_k)
    _check_max_seqlen(max_seqlen_q, "max_seqlen_q", int(lens_q.max(initial=0)))
    _check_max_seqlen(max_seqlen_k, "max_seqlen_k", int(lens_k.max(initial=0)))
    scale = check_scale(scale, E)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"expected causal to be a bool, got {type(causal).__name__}")
    dropout_p = check_dropout(dropout_p)
    if dropout_p and not BACKEND_CAPABILITIES[backend].dropout:
        raise ValueError(f"the {backend} backend has no dropout; expected dropout_p=0.0, got {dropout_p}")
    if rng is not None or dropout_p:
        rng = check_rng(rng)  # one Generator across the sequences

    out = np.zeros((total_q, H, Ev), dtype=q.dtype)
    lse_dtype = compute_dtype_of(q.dtype)
    lse = np.full((H, total_q), -np.inf, dtype=lse_dtype) if return_lse else None
    for L, S, seqs in _shape_groups(lens_q, lens_k, separate=bool(dropout_p)):
        # the group's sequences as one batch (n, H, L, E): one backend call per shape
        rows_q = _rows(cu_q, seqs, L)
        rows_k = _rows(cu_k, seqs, S)
        qb = q[rows_q].reshape(len(seqs), L, H, E).transpose(0, 2, 1, 3)  # (n, H, L, E)
        kb = k[rows_k].reshape(len(seqs), S, Hkv, E).transpose(0, 2, 1, 3)  # (n, Hkv, S, E)
        vb = v[rows_k].reshape(len(seqs), S, Hkv, Ev).transpose(0, 2, 1, 3)  # (n, Hkv, S, Ev)
        if backend == "flash":
            res = flash_attention(qb, kb, vb, is_causal=causal, scale=scale, enable_gqa=True,
                                  causal_align="bottom_right", return_lse=True)
        else:
            mask = causal_mask(L, S, align="bottom_right") if causal and L != S else None
            if return_lse and lse_dtype != q.dtype:
                # naive returns its lse in the inputs' dtype: float16 inputs run in float32 here
                # (as naive computes them anyway), so the lse keeps float32's digits, as flash's
                qb, kb, vb = (x.astype(lse_dtype) for x in (qb, kb, vb))
            res = scaled_dot_product_attention(qb, kb, vb, mask, dropout_p, causal and L == S, scale, True,
                                               rng=rng, return_lse=True)
        out[rows_q] = res.output.transpose(0, 2, 1, 3).reshape(len(seqs) * L, H, Ev)
        if return_lse:
            lse[:, rows_q] = res.lse.transpose(1, 0, 2).reshape(H, len(seqs) * L)
    return VarlenOutput(out, lse) if return_lse else out
