"""`attnkit.record_attention` for transformers models: which modules attend.

    import attnkit, attnkit.hf
    attnkit.hf.register()
    model = AutoModel.from_pretrained(path, attn_implementation="attnkit")
    with attnkit.record_attention(model) as recording:
        model(**inputs)
    recording.maps   # [(B, H, L, S) float32 NumPy arrays], one per attention call, in call order

attnkit's recorder lives in `attnkit.nn`, which never imports torch or transformers;
importing `attnkit.hf` adds `ADAPTER` to `attnkit.nn.interface.RECORDING_ADAPTERS`.
The adapter finds the modules a transformers model hands to its attention function
(`attention_modules`); while a recording is open in the calling thread, the "attnkit"
and "attnkit_flash" attention functions (`attnkit.hf.attention`) append their weights
to the sinks `attnkit.nn.active_recorders(module)` returns. A model loaded with another
implementation (eager, sdpa) records nothing: its attention function does not know them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnkit.nn.interface import RECORDING_ADAPTERS, RecordingAdapter

__all__ = ["ADAPTER", "attention_modules", "is_transformers_model"]


def is_transformers_model(model: Any) -> bool:
    """Whether `model` is a transformers model or module (a class defined in transformers)."""
    return type(model).__module__.startswith("transformers.") and callable(getattr(model, "named_modules", None))


def _attends(module: Any) -> bool:
    """Whether a module looks like one that calls transformers' attention interface: its
    class is named "...Attention" or it carries the attributes those modules have."""
    return type(module).__name__.endswith("Attention") or hasattr(module, "is_causal") or hasattr(module, "scaling")


def attention_modules(model: Any) -> list[Any]:
    """The modules of a transformers model that compute attention, in registration order.

    The innermost modules that look like attention (`_attends`): a wrapper such as
    BertAttention holds the BertSelfAttention that does the work, so only the latter
    counts. Registration order is call order for encoders, decoders and encoder-decoders
    (the encoder's layers, then each decoder layer's self and cross attention).
    """
    names = [(name, module) for name, module in model.named_modules() if _attends(module)]
    inner = []
    for name, module in names:
        prefix = f"{name}." if name else ""
        if not any(other.startswith(prefix) and other != name for other, _ in names):
            inner.append(module)
    return inner


def _find(model: Any) -> list[Any] | None:
    return attention_modules(model) if is_transformers_model(model) else None


def _to_numpy(weights: Any) -> np.ndarray:
    """(B, H, L, S) torch weights -> a float32 NumPy array."""
    import torch

    return weights.detach().to(device="cpu", dtype=torch.float32).numpy()


def _intervenes(module: Any) -> bool:
    """A transformers attention module: attnkit's attention functions apply its edits."""
    return is_transformers_model(module) and _attends(module)


ADAPTER = RecordingAdapter(find=_find, to_numpy=_to_numpy, intervenes=_intervenes)
"""The adapter `record_attention` asks about transformers models."""

if ADAPTER not in RECORDING_ADAPTERS:
    RECORDING_ADAPTERS.append(ADAPTER)
