"""What each attention backend can do: one table, asked instead of comparing names.

Every backend has the one signature (`attnkit.functional`, `BACKEND_KEYWORDS`: masks,
causal alignment, windows, padding, score and mask mods take the same keywords
everywhere). Where code must know more than that, it asks this table:

| capability  | means                                                            | naive | flash |
|-------------|------------------------------------------------------------------|-------|-------|
| `reference` | the plain float64-checked reference: a compiled kernel that      | yes   | no    |
|             | computes its very operations may stand in for it                 |       |       |
| `exact`     | exact attention (no approximation): a fused compiled step that   | yes   | yes   |
|             | computes exact attention may stand in for it                     |       |       |
| `weightless`| never forms the (L, S) weights: a recording runs "naive" instead | no    | yes   |
| `varlen`    | `varlen_attention` runs it on packed sequences                   | yes   | yes   |
| `dropout`   | takes dropout_p > 0                                              | yes   | no    |
| `sinks`     | takes `sinks=` (Hq,), learned logits in each row's denominator   | yes   | yes   |
|             | (gpt-oss); a backend without it is never passed the keyword      |       |       |

    supports("flash", "weightless")       # True
    backend_capabilities("naive").exact   # True

A backend registered with `attnkit.functional.register_attention(name, fn, ...)` has the
capabilities given there (by default: none of these, which is always safe: it is not
replaced by a compiled path, recorded through "naive" only if weightless, and packed
sequences reach it padded). The table names only backends that are registered.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BACKEND_CAPABILITIES", "BackendCapabilities", "CAPABILITIES", "backend_capabilities", "supports"]


class BackendCapabilities(NamedTuple):
    """What one attention backend can do (see the module docstring's table)."""

    reference: bool = False
    exact: bool = False
    weightless: bool = False
    varlen: bool = False
    dropout: bool = False
    sinks: bool = False


CAPABILITIES = BackendCapabilities._fields
"""The capability names `supports` takes."""

BACKEND_CAPABILITIES: dict[str, BackendCapabilities] = {
    "naive": BackendCapabilities(reference=True, exact=True, varlen=True, dropout=True, sinks=True),
    "flash": BackendCapabilities(exact=True, weightless=True, varlen=True, sinks=True),
}
"""Backend name -> its capabilities; `register_attention` adds an entry for each backend it registers."""


def backend_capabilities(name: str) -> BackendCapabilities:
    """The capabilities of backend `name`.

    Raises:
        ValueError: `name` is no registered backend; the message lists the registered ones.
    """
    try:
        return BACKEND_CAPABILITIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend {name!r}; expected one of {sorted(BACKEND_CAPABILITIES)}") \
            from None


def supports(name: str, capability: str) -> bool:
    """Whether backend `name` has `capability` (one of `CAPABILITIES`).

    Raises:
        ValueError: an unknown backend or capability name (the message lists the known ones).
    """
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown backend capability {capability!r}; expected one of {list(CAPABILITIES)}")
    return getattr(backend_capabilities(name), capability)
