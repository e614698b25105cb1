"""Per-head outputs of every layer, captured through `attnkit.nn.interface.intervene`.

`edit_heads` opens edits on attnkit's attention modules and on the attention modules of a
transformers model loaded with attn_implementation="attnkit" (whose attention function,
`attnkit.hf.attention`, applies `active_edits(module)` as attnkit's modules do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from attnkit.nn.interface import AttentionCall, AttentionModule, intervene

__all__ = ["capturing", "check_heads", "edit_heads", "num_heads"]


@contextmanager
def edit_heads(edits: dict) -> Iterator[None]:
    """`intervene(edits)`: attnkit's `AttentionModule`s, or the attention modules of a
    transformers model (`attnkit.hf` registers them with `intervene`; its attention
    functions read the edits through `active_edits`)."""
    if any(not isinstance(module, AttentionModule) for module in edits):
        import attnkit.hf  # noqa: F401  (registers the transformers adapter)
    with intervene(edits):
        yield


def num_heads(module: Any) -> int:
    """The query heads of an attention module: attnkit's, or a transformers one (GPT-2's
    `num_heads`, Llama-family `config.num_attention_heads`)."""
    count = getattr(module, "num_heads", None)
    if count is None:
        count = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if count is None:
        raise TypeError(f"cannot tell how many heads {type(module).__name__} has")
    return int(count)


@contextmanager
def capturing(modules: list[Any], keep: Callable[[AttentionCall], Any] | None = None) -> Iterator[list[list[Any]]]:
    """While open, what each module's attention calls produce, per module in call order:
    `found[layer]` is a list of `keep(call)` (default: a copy of the (B, H, L, E) output)."""
    found: list[list[Any]] = [[] for _ in modules]
    keep = keep or (lambda call: call.output.copy())

    def recorder(index: int):
        def edit(call: AttentionCall) -> None:
            found[index].append(keep(call))
        return edit

    with edit_heads({module: recorder(i) for i, module in enumerate(modules)}):
        yield found


def check_heads(heads: Any, modules: list[Any]) -> list[tuple[int, int]]:
    """`heads` as a list of (layer, head) pairs of ints, each in range; TypeError for an index
    that is not an integer (a float is not truncated, a bool is not 0 or 1), ValueError otherwise."""
    pairs = []
    for item in heads:
        try:
            layer, head = item
        except (TypeError, ValueError):
            raise ValueError(f"expected heads as (layer, head) pairs, got {item!r}") from None
        for what, value in (("layer", layer), ("head", head)):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"expected the {what} of a (layer, head) pair as an int, got "
                                f"{type(value).__name__} {value!r} in {item!r}")
        layer, head = int(layer), int(head)
        if not 0 <= layer < len(modules):
            raise ValueError(f"expected a layer in [0, {len(modules)}), got {layer} in {item!r}")
        count = num_heads(modules[layer])
        if not 0 <= head < count:
            raise ValueError(f"expected a head in [0, {count}) of layer {layer}, got {head} in {item!r}")
        pairs.append((layer, head))
    return pairs
