"""Per-head outputs of every layer, captured through `attnkit.nn.interface.intervene`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


from attnkit.nn.interface import AttentionCall, intervene

__all__ = ["capturing", "check_heads"]


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

    with intervene({module: recorder(i) for i, module in enumerate(modules)}):
        yield found


def check_heads(heads: Any, modules: list[Any]) -> list[tuple[int, int]]:
    """`heads` as a list of (layer, head) pairs, each in range; ValueError otherwise."""
    pairs = []
    for item in heads:
        try:
            layer, head = (int(v) for v in item)
        except (TypeError, ValueError):
            raise ValueError(f"expected heads as (layer, head) pairs, got {item!r}") from None
        if not 0 <= layer < len(modules):
            raise ValueError(f"expected a layer in [0, {len(modules)}), got {layer} in {item!r}")
        count = int(modules[layer].num_heads)
        if not 0 <= head < count:
            raise ValueError(f"expected a head in [0, {count}) of layer {layer}, got {head} in {item!r}")
        pairs.append((layer, head))
    return pairs
