"""FlashAttention's function interface on attnkit.torch's tiled kernel: what "attnkit_flash" seats in transformers.

transformers' FlashAttention route (integrations/flash_attention.py ->
modeling_flash_attention_utils._flash_attention_forward) calls a kernel package's

    flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, ...)
        q (B, L, Hq, E), k and v (B, S, Hkv, E) -> (B, L, Hq, Ev)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
        q (total_q, Hq, E), k and v (total_k, Hkv, E), sequences packed back to back -> (total_q, Hq, Ev)

(padded batches are unpadded into the varlen call; packed sequences go there too).
The two functions here have the flash_attn package's argument names, so
transformers maps the features it may pass (dropout_p, softmax_scale, causal,
window_size, softcap, deterministic, max_seqlen_q/k, s_aux) by inspecting them.
Both run `attnkit.torch.flash_attention`, the tiled autograd Function: exact,
trainable, the (L, S) weights never formed. The conventions are FlashAttention's:

- `causal` is aligned bottom-right (query i sees keys j <= i + S - L), as
  flash_attn >= 2.1; a query row with no key gets 0.
- `window_size=(left, right)`: query i (at its bottom-right aligned position)
  sees keys j in [pos - left, pos + right]; -1 is unbounded on that side. The
  window goes to the kernel as attnkit's `window` (one band with `causal`):
  tiles outside it are skipped, no mask is ever formed.
- `softcap=0.0` is no softcapping; `softmax_scale=None` is 1/sqrt(E).
- varlen runs sequence by sequence over `cu_seqlens` (one host sync to read them).
- GQA: query head h reads key/value head h // (Hq // Hkv).

- `s_aux` (gpt-oss's attention sinks, (Hq,)): one logit per head joins every row's
  softmax denominator (`attnkit.functional.sinks`), differentiable.

What attnkit cannot compute is refused (ValueError), never dropped: ALiBi slopes,
`return_attn_probs`.
"""

from __future__ import annotations

import torch

from attnkit.torch.flash import flash_attention

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def _refuse(alibi_slopes, return_attn_probs) -> None:
    for name, given in (("alibi_slopes", alibi_slopes is not None), ("return_attn_probs=True", bool(return_attn_probs))):
        if given:
            raise ValueError(f"attnkit's flash_attn functions cannot compute {name}; expected it unset, got a value")


def _window(window_size) -> tuple[int | None, int | None] | None:
    """FlashAttention's window_size (left, right), -1 = unbounded, as attnkit's window
    (left, right), None = unbounded; None when neither side is bounded."""
    if window_size is None:
        return None
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"expected window_size as a pair (left, right) of ints, got {window_size!r}") from None
    if left < 0 and right < 0:
        return None
    return (None if left < 0 else left), (None if right < 0 else right)


def _attend(q, k, v, *, causal: bool, window, scale: float | None, softcap, dropout_p: float, sinks=None):
    """q (..., Hq, L, E), k and v (..., Hkv, S, E): FlashAttention's causal and window semantics,
    bottom-right aligned, on attnkit.torch.flash_attention. Returns (..., Hq, L, Ev)."""
    return flash_attention(q, k, v, is_causal=causal, causal_align="bottom_right", window=window, scale=scale,
                           enable_gqa=q.shape[-3] != k.shape[-3], softcap=softcap or None, dropout_p=dropout_p,
                           sinks=sinks)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attn.flash_attn_func on attnkit's tiled kernel: q (B, L, Hq, E), k, v (B, S, Hkv, E)
    -> (B, L, Hq, Ev). `deterministic` is accepted and changes nothing (attnkit's backward always is)."""
    _refuse(alibi_slopes, return_attn_probs)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"expected {name} of shape (B, L, H, E), got {shape}")
    out = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=bool(causal),
                  window=_window(window_size), scale=softmax_scale, softcap=softcap, dropout_p=float(dropout_p),
                  sinks=s_aux)
    return out.transpose(1, 2)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attn.flash_attn_varlen_func on attnkit's tiled kernel: sequences packed back to back,
    q (total_q, Hq, E), k, v (total_k, Hkv, E), cu_seqlens_* (N + 1,) int offsets -> (total_q, Hq, Ev).
    Sequence n's queries q[cu_seqlens_q[n]:cu_seqlens_q[n+1]] see only its keys; max_seqlen_* are
    not needed (accepted for the interface)."""
    _refuse(alibi_slopes, return_attn_probs)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"expected {name} of shape (total, H, E), got {shape}")
    starts_q = [int(c) for c in torch.as_tensor(cu_seqlens_q).tolist()]
    starts_k = [int(c) for c in torch.as_tensor(cu_seqlens_k).tolist()]
    def rising(starts: list[int], total: int) -> bool:  # 0, never falling, ending at the packed total
        return starts[0] == 0 and starts[-1] == total and all(a <= b for a, b in zip(starts, starts[1:]))

    if len(starts_q) != len(starts_k) or len(starts_q) < 1 or not (
        rising(starts_q, q.shape[0]) and rising(starts_k, k.shape[0])
    ):
        raise ValueError(
            f"expected cu_seqlens_q and cu_seqlens_k of one length N + 1, each rising from 0 (never falling) "
            f"to total_q={q.shape[0]} and total_k={k.shape[0]}, got {starts_q} and {starts_k}"
        )
    window = _window(window_size)
    outputs = []
    for n in range(len(starts_q) - 1):
        (q0, q1), (k0, k1) = starts_q[n : n + 2], starts_k[n : n + 2]
        out = _attend(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
                      causal=bool(causal), window=window, scale=softmax_scale, softcap=softcap,
                      dropout_p=float(dropout_p), sinks=s_aux)  # (Hq, Lq, Ev)
        outputs.append(out.transpose(0, 1))
    if not outputs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat(outputs, dim=0)

