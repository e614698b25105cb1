"""attnkit's attention as transformers attention implementations: "attnkit", "attnkit_flash", "attnkit_tiled".

transformers looks attention up by name (`AttentionInterface`): every function has
one signature,

    fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)
        -> (attn_output (B, L, Hq, Ev), attn_weights (B, Hq, L, S) or None)

with query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev).

- "attnkit": attention written out (`_exact_attention`), the weights formed and
  returned (after dropout, the ones the output is made of), so
  `output_attentions=True` works; autograd differentiates it.
- "attnkit_tiled": `attnkit.torch.flash_attention`, the tiled autograd Function:
  O(L + S) extra memory, a recomputing backward, no weights (with
  `output_attentions=True` it and "attnkit_flash" warn once, as transformers' sdpa
  does, and return None for them: the model's `attentions` come back empty);
  dropout draws each tile's keep mask from a seed and draws it again in the backward. Attention
  sinks (`s_aux`) go to the kernel's `sinks`. It reads the 4-D masks transformers builds.
- "attnkit_flash" (`attnkit_flash_attention`): the same kernel through transformers'
  FlashAttention route: the mask is None or the (B, S) padding mask, and transformers
  calls `attnkit.hf.flash_api`'s flash_attn_func / flash_attn_varlen_func (unpadded),
  seated where it keeps a loaded flash kernel (`seat_flash_functions`); sinks travel as
  their `s_aux`. Refuses what the flash interface cannot carry (position bias, paged attention).

"attnkit" and "attnkit_tiled" read the same arguments (`_read_call`) and differ only in the kernel.

What the architectures pass, and what becomes of it:

- `attention_mask`: built by transformers through the mask function registered
  under the same name (`attnkit_mask`): None for a plain causal or a full
  bidirectional pattern (the kernel's own `is_causal` then, no (L, S) tensor), a
  (B, 1, 1, S) key mask for an encoder with padding, else sdpa's boolean
  (B, 1, L, S) mask, True = may attend (sliding windows, causal + padding, caches).
  A float mask (a custom 4-D mask) is added to the scores.
- `is_causal` (or `module.is_causal`), used when there is no mask, top-left as in
  torch's SDPA; one query (decoding) sees every key.
- `scaling` (default 1/sqrt(E)), `dropout` (transformers passes 0 in eval mode).
- `softcap` (Gemma 2): scores -> softcap * tanh(scores / softcap) before the mask.
- `s_aux` (attention sinks, gpt-oss): one extra logit per head in the softmax's
  denominator, no value.
- `position_bias` (T5-style relative bias): added to the scores.
- `sliding_window`: already in the mask transformers builds; read, not re-applied.
- bookkeeping kwargs (`position_ids`, `output_attentions`, ...): no math.
Anything else with a value that is not None is refused, naming the architecture
and the keyword: nothing is silently ignored.

Interventions: while an `attnkit.nn.intervene` edit is open on the module in the calling
thread (`active_edits(module)`: what `attnkit.interpret`'s ablation and patching open), the
per-head output (B, Hq, L, Ev), before transformers' output projection, goes through each
edit as `AttentionModule.attend`'s does (`_apply_edits`): the edit sees an `AttentionCall`
of NumPy arrays (float32, or float64 for a float64 model) and its result goes back into the
output's dtype and device. An edited output is a constant for autograd (interpretation runs
under torch.no_grad()). "attnkit_tiled" and "attnkit_flash" compute exactly for such calls,
as they do while recording.

Conventions are attnkit's: a query whose keys are all masked gets output 0 and
weights 0 (eager's finite fill value would spread it evenly over the masked
keys instead); GQA query head h reads key/value head h // (Hq // Hkv).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from attnkit.nn.interface import AttentionCall, active_edits, active_recorders
from attnkit.torch.flash import flash_attention

__all__ = [
    "BOOKKEEPING_KWARGS", "attnkit_attention", "attnkit_flash_attention", "attnkit_tiled_attention", "attnkit_mask",
    "refusal", "seat_flash_functions",
]

# Keywords transformers passes along that carry no attention math (or whose math is
# already in the mask it built: packed sequences' boundaries, the window).
BOOKKEEPING_KWARGS = frozenset({
    "position_ids", "output_attentions", "output_hidden_states", "use_cache", "cache_position", "layer_idx",
    "past_key_values", "past_key_value", "return_dict", "sliding_window", "cu_seq_lens_q", "cu_seq_lens_k",
    "max_length_q", "max_length_k", "position_embeddings", "encoder_hidden_states", "token_type_ids",
    "output_router_logits",  # mixture-of-experts routers
    "deterministic",  # flash-attn's deterministic backward (ModernBERT): attnkit's always is
})


_WARNED_NO_WEIGHTS: set[str] = set()  # the implementations that already said they return no weights


def _warn_no_weights(implementation: str, kwargs: dict) -> None:
    """Warn, once per implementation and process, that `output_attentions=True` gets no weights.

    transformers' "sdpa" and flash routes do the same (`logger.warning_once`) and hand back
    None as the weights, which the model's output capture leaves out: `attentions` is empty.
    """
    if not kwargs.get("output_attentions") or implementation in _WARNED_NO_WEIGHTS:
        return
    _WARNED_NO_WEIGHTS.add(implementation)
    warnings.warn(
        f"attn_implementation={implementation!r} does not form attention weights, so output_attentions=True "
        "returns none (the model's attentions come back empty, as with 'sdpa'); use "
        "attn_implementation='attnkit' for the weights, or attnkit.record_attention(model) to record them",
        UserWarning, stacklevel=3,
    )


def architecture(module: torch.nn.Module) -> str:
    """The name a refusal gives the model: its config's model_type and the module's class."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    name = type(module).__name__
    return f"{model_type} ({name})" if model_type else name


def refusal(implementation: str, module: torch.nn.Module, feature: str, hint: str = "") -> ValueError:
    """The error for a feature `implementation` cannot compute, naming the architecture."""
    message = f"attn_implementation={implementation!r} cannot compute {feature}, which {architecture(module)} uses"
    return ValueError(message + (f"; {hint}" if hint else ""))


class _Call(NamedTuple):
    """One attention call, read: what the kernel needs beyond q, k, v."""

    mask: torch.Tensor | None  # bool (True = may attend) or float (added), broadcastable to (B, Hq, L, S)
    is_causal: bool  # top-left, only when mask carries no causal pattern of its own
    scale: float
    dropout: float
    softcap: float | None
    sinks: torch.Tensor | None  # (Hq,) extra logits, or None


def _read_call(implementation, module, query, key, attention_mask, scaling, dropout, kwargs) -> _Call:
    """Check and read transformers' arguments; refuse what is unknown."""
    is_causal = kwargs.pop("is_causal", None)
    position_bias = kwargs.pop("position_bias", None)
    softcap = kwargs.pop("softcap", None)
    sinks = kwargs.pop("s_aux", None)
    unknown = sorted(name for name, value in kwargs.items() if value is not None and name not in BOOKKEEPING_KWARGS)
    if unknown:
        raise refusal(implementation, module, f"the keyword argument(s) {', '.join(unknown)}",
                      "attnkit does not know what they mean for attention")
    L, S = query.shape[-2], key.shape[-2]
    mask = attention_mask
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            what = type(mask).__name__ if not isinstance(mask, torch.Tensor) else f"a {mask.dim()}-D tensor"
            raise refusal(implementation, module, f"an attention_mask given as {what}",
                          "expected None or a 4-D boolean (True = may attend) or float mask (B, 1|H, L, S)")
        mask = mask[..., :S]  # a mask built for a longer cache than the keys handed over (as eager slices)
    if position_bias is not None:
        # T5-style relative bias (B|1, H, L, S): added to the scores, inside the mask
        position_bias = position_bias[..., :S]
        if mask is None:
            mask = position_bias
        elif mask.dtype == torch.bool:
            mask = position_bias.masked_fill(~mask, -math.inf)
        else:
            mask = position_bias + mask
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # with a mask, the mask says everything (sdpa's rule); one query sees every cached key
    causal = bool(is_causal) and attention_mask is None and L > 1
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    return _Call(mask, causal, scale, float(dropout or 0.0), None if softcap is None else float(softcap), sinks)


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; a row of -inf (no key to see) gives zeros, never NaN."""
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    exp = torch.exp(scores - torch.where(row_max == -math.inf, 0.0, row_max))
    total = exp.sum(dim=-1, keepdim=True)
    return exp / torch.where(total > 0, total, 1.0)


def _exact_attention(module, query, key, value, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out: output (B, Hq, L, Ev) and weights (B, Hq, L, S) after dropout.

    Half-precision inputs compute in float32 (attnkit's rule); the results come back
    in the query's dtype."""
    dtype = query.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v = query.to(work) * call.scale, key.to(work), value.to(work)  # scaled before the product
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)  # (B, Hq, S, E): query head h reads kv head h // groups
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2))  # (B, Hq, L, S)
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    if call.is_causal:
        L, S = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=q.device).tril(), -math.inf)
    if call.mask is not None:
        mask = call.mask
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.to(work)
    if call.sinks is not None:
        B, H, L, _ = scores.shape
        sink = call.sinks.to(work).reshape(1, H, 1, 1).expand(B, H, L, 1)  # one logit per head, no value
        weights = _softmax(torch.cat([scores, sink], dim=-1))[..., :-1]
    else:
        weights = _softmax(scores)  # (B, Hq, L, S)
    weights = F.dropout(weights, p=call.dropout, training=module.training) if call.dropout > 0 else weights
    return torch.matmul(weights, v).to(dtype), weights.to(dtype)


def _record(module: torch.nn.Module, weights: torch.Tensor) -> None:
    """Hand the (B, Hq, L, S) weights to every recorder attnkit's views set on the module."""
    for recorder in active_recorders(module):
        recorder.append(weights.detach())


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as a NumPy array an edit reads: float64 stays float64, the rest float32."""
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return tensor.detach().to(device="cpu", dtype=dtype).numpy()


def _apply_edits(module, query, key, value, output: torch.Tensor, call: _Call) -> torch.Tensor:
    """`output` (B, Hq, L, Ev) after each edit `intervene` opened on `module`, in turn (as
    `attnkit.nn.AttentionModule.attend`); unchanged when none is open."""
    edits = active_edits(module)
    if not edits:
        return output
    q, k, v = _numpy(query), _numpy(key), _numpy(value)
    current = _numpy(output)  # (B, Hq, L, Ev)
    for edit in edits:
        changed = edit(AttentionCall(module, q, k, v, current, call.scale))
        if changed is not None:
            changed = np.asarray(changed)
            if changed.shape != current.shape:
                raise ValueError(
                    f"expected an edit to return the per-head output's shape {current.shape}, got {changed.shape}"
                )
            current = changed.astype(current.dtype, copy=False)
    return torch.from_numpy(np.ascontiguousarray(current)).to(device=output.device, dtype=output.dtype)


def attnkit_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' "attnkit": exact attention with its weights.

    Arguments:
        query: (B, Hq, L, E); key: (B, Hkv, S, E); value: (B, Hkv, S, Ev).
        attention_mask: None, bool (True = may attend) or float (added), (B, 1|Hq, L|1, S).
        scaling, dropout, **kwargs: as transformers passes them (see the module docstring).

    Returns:
        (output (B, L, Hq, Ev), weights (B, Hq, L, S)).
    """
    call = _read_call("attnkit", module, query, key, attention_mask, scaling, dropout, kwargs)
    output, weights = _exact_attention(module, query, key, value, call)
    _record(module, weights)
    output = _apply_edits(module, query, key, value, output, call)
    return output.transpose(1, 2).contiguous(), weights


def attnkit_tiled_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' "attnkit_tiled": attnkit.torch's tiled kernel, never holding (L, S) weights.

    Same arguments as `attnkit_attention`. Returns (output (B, L, Hq, Ev), None).
    While attnkit's views record the module's maps in the calling thread
    (`attnkit.nn.active_recorders(module)` non-empty) it computes exactly instead, so that
    the maps exist; so it does while an `intervene` edit is open on the module.
    """
    _warn_no_weights("attnkit_tiled", kwargs)
    call = _read_call("attnkit_tiled", module, query, key, attention_mask, scaling, dropout, kwargs)
    if active_recorders(module) or active_edits(module):
        output, weights = _exact_attention(module, query, key, value, call)
        _record(module, weights)
        output = _apply_edits(module, query, key, value, output, call)
        return output.transpose(1, 2).contiguous(), None
    output = flash_attention(
        query, key, value, attn_mask=call.mask, is_causal=call.is_causal, scale=call.scale,
        enable_gqa=query.shape[1] != key.shape[1], softcap=call.softcap,
        dropout_p=call.dropout if module.training else 0.0, sinks=call.sinks,
    )  # (B, Hq, L, Ev)
    return output.transpose(1, 2).contiguous(), None


FLASH_NAME = "attnkit_flash"
# what transformers' flash route reads itself (flash_attention_forward's and _flash_attention_forward's keywords)
_FLASH_ROUTE_KWARGS = frozenset({"is_causal", "softcap", "sliding_window", "s_aux", "target_dtype"})


def seat_flash_functions() -> None:
    """Seat attnkit's FlashAttention-API functions (`attnkit.hf.flash_api`) as transformers'
    loaded flash implementation "attnkit_flash".

    transformers has no public way to name a local FlashAttention kernel: a name containing
    "flash" makes it call `lazy_import_flash_attention(name)`, which keeps the functions of the
    last implementation it loaded in module globals of `modeling_flash_attention_utils` and
    otherwise looks the name up on the hub. This fills those globals as a loaded implementation
    would (the hub path's `load_and_register_attn_kernel` does the registering part): flash_attn_func,
    flash_attn_varlen_func, no kv-cache (paged) function, transformers' own pad/unpad, and the
    kwargs processor built from flash_attn_varlen_func's signature. Called by `register()` and,
    when another flash implementation was loaded since, by every "attnkit_flash" call.
    """
    from transformers import modeling_flash_attention_utils as fa
    from attnkit.hf import flash_api

    if fa._loaded_implementation == FLASH_NAME and fa._flash_varlen_fn is flash_api.flash_attn_varlen_func:
        return
    fa._flash_fn, fa._flash_varlen_fn = flash_api.flash_attn_func, flash_api.flash_attn_varlen_func
    fa._flash_with_kvcache_fn, fa._pad_fn, fa._unpad_fn = None, fa._pad_input, fa._unpad_input
    fa._process_flash_kwargs_fn = fa._lazy_define_process_function(flash_api.flash_attn_varlen_func)
    fa._process_with_kvcache_kwargs_fn = dict
    fa._loaded_implementation = FLASH_NAME


def attnkit_flash_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' "attnkit_flash": its FlashAttention route on attnkit's FlashAttention-API functions.

    Same arguments as `attnkit_attention`; `attention_mask` is what the flash mask function
    gives: None (plain causal or full) or the (B, S) padding mask, which transformers unpads
    into `flash_attn_varlen_func`. Windows and softcap travel as flash keywords. A 4-D mask (an
    architecture building its own) runs through "attnkit_tiled" instead, the same kernel.
    Attention sinks (s_aux, gpt-oss) travel as the flash functions' `s_aux`. Refused: position
    bias (T5), which the flash interface cannot carry.
    Returns (output (B, L, Hq, Ev), None); with `output_attentions=True` it warns once that
    the weights are not formed (`_warn_no_weights`).
    """
    _warn_no_weights(FLASH_NAME, kwargs)
    four_d = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
    if active_recorders(module) or active_edits(module) or four_d:
        kwargs = {name: value for name, value in kwargs.items() if name != "output_attentions"}  # warned above
        return attnkit_tiled_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if kwargs.get("position_bias") is not None:
        raise refusal(FLASH_NAME, module, "a position bias", "use attn_implementation='attnkit_tiled' (or 'attnkit')")
    unknown = sorted(name for name, value in kwargs.items()
                     if value is not None and name not in BOOKKEEPING_KWARGS | _FLASH_ROUTE_KWARGS)
    if unknown:
        raise refusal(FLASH_NAME, module, f"the keyword argument(s) {', '.join(unknown)}",
                      "attnkit does not know what they mean for attention")
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        what = type(attention_mask).__name__ if not isinstance(attention_mask, torch.Tensor) \
            else f"a {attention_mask.dim()}-D tensor"
        raise refusal(FLASH_NAME, module, f"an attention_mask given as {what}",
                      "expected None, a (B, S) padding mask or a 4-D mask")
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    seat_flash_functions()  # another flash implementation may have been loaded since register()
    # transformers' flash_attention_forward, less its dtype guess (it looks for an nn.Linear,
    # which GPT-2's Conv1D layers are not): attnkit computes float32 as it comes
    is_causal = kwargs.pop("is_causal", None)
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    for name in ("position_bias", "target_dtype", "attn_implementation"):  # s_aux (sinks) travels on
        kwargs.pop(name, None)
    output = _flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask,
        query_length=query.shape[2], is_causal=bool(is_causal), dropout=dropout, softmax_scale=scaling,
        use_top_left_mask=False, target_dtype=None, attn_implementation=FLASH_NAME, **kwargs,
    )  # (B, L, Hq, Ev)
    return output, None


def attnkit_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask transformers builds for "attnkit" and "attnkit_tiled" (AttentionMaskInterface).

    sdpa's boolean mask (True = may attend), None where the kernels' is_causal or no
    mask at all says the same; and for an encoder's padding (a full bidirectional
    pattern, no window) the (B, 1, 1, S) key mask instead of (B, 1, L, S).
    """
    from transformers import masking_utils

    mask_function = mask_function or masking_utils.causal_mask_function
    plain_bidirectional = (
        mask_function is masking_utils.bidirectional_mask_function and not use_vmap
        and kwargs.get("local_size") is None and attention_mask is not None and attention_mask.dim() == 2
    )
    if plain_bidirectional:
        padding = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        keys = padding[:, kv_offset : kv_offset + kv_length].to(torch.bool)  # (B, S), True = a real token
        if allow_is_bidirectional_skip and bool(keys.all()):
            return None
        return keys[:, None, None, :]  # (B, 1, 1, S)
    return masking_utils.sdpa_mask(
        batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
        attention_mask=attention_mask, allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap,
        **kwargs,
    )
