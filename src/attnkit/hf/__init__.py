"""attnkit's attention inside Hugging Face transformers (optional extra `attnkit[hf]`).

    import attnkit.hf
    attnkit.hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")
    model.set_attn_implementation("attnkit_flash")

`register()` adds three implementations to transformers' `AttentionInterface`, and
the mask function each needs to its `AttentionMaskInterface`:

- "attnkit": exact attention that returns the weights (`output_attentions=True`);
- "attnkit_flash": attnkit.torch's tiled (flash) autograd Function, memory-efficient
  and trainable, never holding the (L, S) weights, through transformers'
  FlashAttention route: `attnkit.hf.flash_api`'s flash_attn_func and
  flash_attn_varlen_func are seated as the loaded flash kernel (padding is unpadded
  into varlen, windows and softcap are flash keywords; no 4-D mask is built);
- "attnkit_tiled": the same kernel through transformers' 4-D masks, for the
  architectures whose class does not support flash attention (T5) or that need
  what the flash interface cannot carry (position bias).

See `attnkit.hf.attention` for what each takes and refuses, and docs/hf.md.
Importing this module imports torch but not transformers; `register()` does.
"""

from __future__ import annotations

from attnkit import runtime
from attnkit.hf.attention import (
    FLASH_NAME, attnkit_attention, attnkit_flash_attention, attnkit_mask, attnkit_tiled_attention, seat_flash_functions,
)
from attnkit.hf import recording as _recording  # noqa: F401  (record_attention takes transformers models)

__all__ = ["IMPLEMENTATIONS", "register"]

IMPLEMENTATIONS = {"attnkit": attnkit_attention, FLASH_NAME: attnkit_flash_attention,
                   "attnkit_tiled": attnkit_tiled_attention}
"""attn_implementation name -> attention function, as `register()` adds them."""


def register() -> tuple[str, ...]:
    """Add "attnkit", "attnkit_flash" and "attnkit_tiled" to transformers (idempotent).

    "attnkit_flash" also seats attnkit's flash_attn functions as transformers' loaded
    FlashAttention implementation (`attnkit.hf.attention.seat_flash_functions`), so that
    model init (which loads the flash kernel a name containing "flash" asks for) finds them.

    Returns:
        the names now usable as `attn_implementation`.
    """
    runtime.require("transformers", "hf", "attnkit.hf")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    for name, function in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, flash_attention_mask if name == FLASH_NAME else attnkit_mask)
    seat_flash_functions()
    return tuple(IMPLEMENTATIONS)
