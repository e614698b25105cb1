"""`attnkit.masks`: the mask helpers of `attnkit.functional.masks`, at the top level."""

from attnkit.functional.masks import (  # noqa: F401
    ALIGNMENTS,
    and_masks,
    causal_mask,
    from_torch_mask,
    key_mask_to_attn_mask,
    or_masks,
    padding_mask,
    sliding_window_mask,
    to_additive,
)
