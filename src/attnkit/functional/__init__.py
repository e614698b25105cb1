"""attnkit's NumPy core: pure functions, no state, no printing.

Every attention implementation ("backend") has one signature, torch SDPA's
positional arguments followed by keywords that carry what any backend needs,
and is chosen by name from `ATTENTION_BACKENDS` (see `get_attention`), never by
a chain of fast-path conditions:

    fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
       enable_gqa=False, *, causal_align="top_left", window=None, key_padding_mask=None,
       score_mod=None, mask_mod=None, rng=None, return_weights=False, return_lse=False)

    query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev)
    attn_mask     bool (True = may attend) or float (added), broadcastable to (..., Hq, L, S)
    is_causal     causal mask aligned by causal_align: "top_left" (query i sees keys 0..i,
                  torch's) or "bottom_right" (keys 0..i + S - L: the L new queries of a KV
                  cache); not together with attn_mask
    window        int left, or (left, right): query i sees keys i - left .. i + right,
                  aligned by causal_align (masks.sliding_window_mask)
    key_padding_mask  bool (..., S), True = a real key; combines with everything above
    score_mod, mask_mod   FlexAttention-style mods (attnkit.functional.mods)
    rng           Generator or seed for dropout
    returns       the output (..., Hq, L, Ev), or AttentionOutput(output, weights, lse)
                  when return_weights or return_lse is set

A query with no key allowed gets output 0 (weights 0, lse -inf). "naive"
(`scaled_dot_product_attention`) builds the dense mask and scores; "flash"
(`flash_backend`) turns is_causal / causal_align / window into its band and
skips the tiles outside it, and refuses dropout and return_weights.

Register your own with `register_attention(name, fn)`; it checks that `fn`
takes this signature (a `**kwargs` catches what it does not use), and wraps it
so that every call's result is checked once, at this boundary: an output of
shape (..., Hq, L, Ev) in the inputs' dtype, and an AttentionOutput whose
weights (..., Hq, L, S) and lse (..., Hq, L) are there when asked for
(`_checked_backend`). Pass `weightless=True` when it cannot return weights:
`attnkit.record_attention` then runs "naive" for the calls it records.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy as np

from attnkit.functional import masks
from attnkit.functional.attention import (
    AttentionGrads,
    AttentionOutput,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from attnkit.functional.sinks import AttentionSinkGrads
from attnkit.functional.softmax import log_softmax, logsumexp, softmax
from attnkit.functional import mods
from attnkit.functional.flash import (
    AttentionState,
    flash_attention,
    flash_attention_backward,
    flash_backend,
    merge_attention_states,
)
from attnkit.functional.varlen import VarlenOutput, varlen_attention
from attnkit.functional.backends import BACKEND_CAPABILITIES, BackendCapabilities, backend_capabilities, supports

ATTENTION_BACKENDS: dict[str, Callable] = {
    "naive": scaled_dot_product_attention,
    "flash": flash_backend,
}

# Backends that never form the (L, S) weights. When weights are only wanted for
# recording (attnkit.record_attention), an attention module uses "naive" for that
# call instead, as transformers falls back to eager attention for output_attentions.
# A user-registered backend that cannot return weights belongs here too.
WEIGHTLESS_BACKENDS: set[str] = {"flash"}


# The keywords every backend takes, after query, key, value (see the module docstring).
BACKEND_KEYWORDS = (
    "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "causal_align", "window",
    "key_padding_mask", "score_mod", "mask_mod", "rng", "return_weights", "return_lse",
)
BUILTIN_BACKENDS = ("naive", "flash")


def register_attention(name: str, fn: Callable, *, weightless: bool = False) -> None:
    """Register `fn` as attention backend `name` (then `module.backend = name`,
    `model.set_attention_backend(name)` and `get_attention(name)` find it).

    Arguments:
        name: a new name, or one registered before (not "naive" or "flash").
        fn: a function with the one backend signature (module docstring).
        weightless: `fn` never returns weights (return_weights=True is refused);
            recording then runs "naive" instead (its capabilities in
            `attnkit.functional.backends.BACKEND_CAPABILITIES`).

    Raises:
        TypeError: `fn` is not callable or does not take the signature;
        ValueError: `name` is empty, not a string, or a built-in backend.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"expected a backend name as a non-empty str, got {name!r}")
    if name in BUILTIN_BACKENDS:
        raise ValueError(f"expected a new backend name; {name!r} is built in ({', '.join(BUILTIN_BACKENDS)})")
    if not callable(fn):
        raise TypeError(f"expected the backend {name!r} to be callable, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except ValueError:  # a builtin without a signature: trust it
        signature = None
    if signature is not None:
        try:
            signature.bind(None, None, None, **{keyword: None for keyword in BACKEND_KEYWORDS})
        except TypeError:
            params = signature.parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            missing = [k for k in BACKEND_KEYWORDS if k not in params and not takes_any]
            raise TypeError(
                f"expected the backend {name!r} to take fn(query, key, value, {', '.join(BACKEND_KEYWORDS)}) "
                f"(see attnkit.functional), got {fn.__name__ if hasattr(fn, '__name__') else fn}{signature}"
                + (f"; missing {missing}" if missing else "")
            ) from None
    ATTENTION_BACKENDS[name] = _checked_backend(name, fn)
    BACKEND_CAPABILITIES[name] = BackendCapabilities(weightless=bool(weightless))
    if weightless:
        WEIGHTLESS_BACKENDS.add(name)
    else:
        WEIGHTLESS_BACKENDS.discard(name)


def _checked_backend(name: str, fn: Callable) -> Callable:
    """`fn` with its result checked on every call (`_check_result`); the original is
    `.__wrapped__`. Built-in backends are not wrapped: their tests check them."""

    @functools.wraps(fn)
    def checked(query, key, value, *args, **kwargs):
        result = fn(query, key, value, *args, **kwargs)
        _check_result(name, result, query, key, value, kwargs)
        return result

    return checked


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _check_result(name: str, result: Any, query, key, value, kwargs: dict) -> None:
    """Raise if backend `name` returned something other than the one signature's
    result for these inputs (shapes and dtypes only: nothing is computed).

    Expected: the output (..., Hq, L, Ev) in the inputs' dtype, alone when neither
    return_weights nor return_lse is set, else an AttentionOutput whose weights
    (..., Hq, L, S) and lse (..., Hq, L) are arrays when asked for."""
    q, k, v = _shape(query), _shape(key), _shape(value)
    if len(q) < 2 or len(k) < 2 or len(v) < 2:
        return  # the backend accepted inputs no backend takes: nothing to compare with
    try:
        batch = np.broadcast_shapes(q[:-3], k[:-3], v[:-3]) if len(q) >= 3 else ()
    except ValueError:
        return
    lead = (*batch, *q[-3:-1]) if len(q) >= 3 else q[:-1]  # (..., Hq, L)
    S, Ev = k[-2], v[-1]
    want_weights, want_lse = bool(kwargs.get("return_weights")), bool(kwargs.get("return_lse"))
    asked = " and ".join(f"{flag}=True" for flag, on in (("return_weights", want_weights),
                                                        ("return_lse", want_lse)) if on)
    if asked:
        if not isinstance(result, AttentionOutput):
            raise TypeError(f"expected the attention backend {name!r} to return an "
                            f"AttentionOutput(output, weights, lse) for {asked}, got {type(result).__name__}")
        output = result.output
    else:
        if isinstance(result, tuple):
            raise TypeError(f"expected the attention backend {name!r} to return the output array alone "
                            f"(no return_weights or return_lse), got {type(result).__name__}")
        output = result
    dtypes = {np.dtype(x.dtype) for x in (query, key, value) if hasattr(x, "dtype")}
    expected_dtype = np.result_type(*dtypes) if dtypes else None
    parts = [("output", output, (*lead, Ev), "(..., Hq, L, Ev)", True)]
    if want_weights:
        parts.append(("weights", result.weights, (*lead, S), "(..., Hq, L, S)", False))
    if want_lse:
        parts.append(("lse", result.lse, lead, "(..., Hq, L)", False))
    for what, arr, shape, layout, same_dtype in parts:
        if arr is None or not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"expected the attention backend {name!r} to return {what} as an array of shape "
                            f"{layout} = {shape}, got {'None' if arr is None else type(arr).__name__}")
        if tuple(arr.shape) != shape:
            raise ValueError(f"expected the attention backend {name!r} to return {what} of shape {layout} = {shape} "
                             f"for query {q}, key {k}, value {v}, got {tuple(arr.shape)}")
        if same_dtype and expected_dtype is not None and arr.dtype != expected_dtype:
            raise TypeError(f"expected the attention backend {name!r} to return {what} of dtype {expected_dtype} "
                            f"like its inputs, got {arr.dtype}")


def get_attention(name: str) -> Callable:
    """The attention implementation registered under `name` (e.g. "naive", "flash");
    a user-registered one comes wrapped so that each result is checked
    (`register_attention`), the function itself as `.__wrapped__`."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; expected one of {sorted(ATTENTION_BACKENDS)}"
        ) from None


__all__ = [
    "ATTENTION_BACKENDS",
    "BACKEND_CAPABILITIES",
    "BackendCapabilities",
    "WEIGHTLESS_BACKENDS",
    "backend_capabilities",
    "supports",
    "BACKEND_KEYWORDS",
    "AttentionGrads",
    "AttentionSinkGrads",
    "AttentionOutput",
    "AttentionState",
    "VarlenOutput",
    "flash_attention",
    "flash_attention_backward",
    "merge_attention_states",
    "mods",
    "get_attention",
    "register_attention",
    "log_softmax",
    "logsumexp",
    "masks",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "softmax",
    "varlen_attention",
]
