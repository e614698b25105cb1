"""What every attention module shares: a backend chosen by name, and recording.

Where code must know what a backend can do, it asks `backend_capabilities(name)` /
`supports(name, capability)` (the table in `attnkit.functional.backends`), never its name.

`AttentionModule` is the base of attnkit's NumPy attention modules
(`MultiHeadAttention`, `SingleHeadSelfAttention`, `PerHeadMultiHeadAttention`,
`CausalSelfAttention`). Each owns a `backend`, a name in
`attnkit.functional.ATTENTION_BACKENDS` ("naive" by default; an unknown name is
refused with ValueError), and computes its attention with `self.attend(q, k, v, ...)`:
the one place a backend is looked up and the one place attention maps are
recorded. `Module.set_attention_backend(name)` sets the backend of every
attention module in a model, encoder or decoder alike.

`record_attention(model)` collects the weights of every attention call inside
`model` while the context is open:

    with attnkit.record_attention(model) as recording:
        model(input_ids)
    recording.maps   # [(B, H, L, S), ...] one per attention call, in call order

Outside the context nothing extra is computed: a backend is asked for weights
only while a module is recorded, or when a caller asks (need_weights).

A recording belongs to the call that opened it, not to the model: it lives in a
context variable, so it sees the attention calls made by the thread (or asyncio task)
that opened it, and the work that thread hands to attnkit's own worker threads. Another
thread running the same model at the same time records nothing into it, and leaves
nothing behind when it ends: `record_attention` never writes to a module.

`intervene({module: edit, ...})` is the one way to change what a module's attention
returns, scoped the same way (per call, never written to a module): while open, each
call of a listed module hands `edit` an `AttentionCall` (the query, key, value and
per-head output (B, H, L, E), before the output projection: TransformerLens's hook_z)
and continues with what `edit` returns (None: unchanged). `attnkit.interpret` builds
ablation, activation capture and patching on it:

    with intervene({model.layers[3].attn: zero_head_2}):   # attnkit.nn.interface.intervene
        model(input_ids)   # layer 3's head 2 is off, in this call and nowhere else
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import numpy as np

from attnkit.functional import ATTENTION_BACKENDS, AttentionOutput, get_attention
from attnkit.functional.backends import BACKEND_CAPABILITIES, CAPABILITIES, BackendCapabilities
from attnkit.nn.module import Module

__all__ = [
    "AttentionCall",
    "BackendCapabilities",
    "backend_capabilities",
    "check_backend",
    "supports",
    "AttentionModule",
    "AttentionRecording",
    "RECORDING_ADAPTERS",
    "RecordingAdapter",
    "active_edits",
    "active_recorders",
    "intervene",
    "record_attention",
]


# ----------------------------------------------------------------------------- backends


def check_backend(name: Any) -> str:
    """`name` if it is a registered attention backend (`attnkit.functional.ATTENTION_BACKENDS`).

    Raises:
        TypeError: `name` is not a str.
        ValueError: no backend has that name; the message lists the registered ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"expected backend as a str naming an attention backend "
                        f"({', '.join(sorted(ATTENTION_BACKENDS))}), got {type(name).__name__}")
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(sorted(ATTENTION_BACKENDS))}")
    return name


def backend_capabilities(name: str) -> BackendCapabilities:
    """What the registered backend `name` can do (`attnkit.functional.backends`: reference,
    exact, weightless, varlen, dropout): ask this instead of comparing backend names.
    A backend put into ATTENTION_BACKENDS by hand rather than registered has none of them.

    Raises:
        TypeError, ValueError: `name` is no registered backend (see `check_backend`).
    """
    return BACKEND_CAPABILITIES.get(check_backend(name), BackendCapabilities())


def supports(name: str, capability: str) -> bool:
    """Whether the registered backend `name` has `capability` (e.g. `supports("flash", "exact")`).

    Raises:
        ValueError: an unknown backend or capability (the message lists the known ones).
    """
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown backend capability {capability!r}; expected one of {list(CAPABILITIES)}")
    return getattr(backend_capabilities(name), capability)


class _Open(NamedTuple):
    """A recording open in this context: the modules it records (by identity, and held so
    that an identity cannot be reused while it is open) and where their weights go."""

    ids: frozenset[int]
    modules: tuple[Any, ...]
    sink: Any  # a list, or anything with append(weights)


_OPEN: ContextVar[tuple[_Open, ...]] = ContextVar("attnkit_open_recordings", default=())


def active_recorders(module: Any) -> tuple[Any, ...]:
    """The sinks of the recordings open on `module` in the calling context (thread or asyncio
    task): each takes `append(weights)`. Empty outside `record_attention`, and in every other
    thread. An attention implementation calls this to know whether to form the weights."""
    open_recordings = _OPEN.get()
    if not open_recordings:
        return ()
    key = id(module)
    return tuple(entry.sink for entry in open_recordings if key in entry.ids)


def watching() -> bool:
    """Whether any recording (`record_attention`) or intervention (`intervene`) is open in
    the calling context: a compiled path that skips the attention modules runs only when not."""
    return bool(_OPEN.get() or _EDITS.get())


class AttentionCall(NamedTuple):
    """One attention call as an `intervene` edit sees it.

    module: the attention module called.
    query: (B, Hq, L, E), after any rotary embedding; key, value: (B, Hkv, S, E) (everything
        attended over, cached positions included; Hkv < Hq with grouped-query attention).
    output: (B, Hq, L, E) per-head output, before the output projection.
    scale: the score scale (None: 1/sqrt(E)).
    """

    module: Any
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    output: np.ndarray
    scale: float | None


class _Edits(NamedTuple):
    """An intervention open in this context: module identity -> edit (modules held, so that
    an identity cannot be reused while it is open)."""

    edits: dict[int, Callable[[AttentionCall], "np.ndarray | None"]]
    modules: tuple[Any, ...]


_EDITS: ContextVar[tuple[_Edits, ...]] = ContextVar("attnkit_open_interventions", default=())


def active_edits(module: Any) -> tuple[Callable[[AttentionCall], "np.ndarray | None"], ...]:
    """The edits open on `module` in the calling context (see `intervene`), outermost first;
    empty outside `intervene` and in every other thread."""
    open_edits = _EDITS.get()
    if not open_edits:
        return ()
    key = id(module)
    return tuple(entry.edits[key] for entry in open_edits if key in entry.edits)


@contextmanager
def intervene(edits: Any) -> Iterator[None]:
    """Change the per-head output of attention modules while open.

    Arguments:
        edits: a mapping {attention module: edit}, each edit a function of an
            `AttentionCall` returning the new (B, H, L, E) output (same shape; float
            arrays are cast to the output's dtype) or None to keep it (an edit may also
            read the call, or write to `call.output` in place).

    Every call of a listed module made by the opening thread (or asyncio task, and the
    work it hands to attnkit's worker threads) while open goes through its edits, in
    the order the contexts were opened; other threads are untouched. A backend that
    forms no weights keeps its speed: the edit sees the output only. Edits never change
    the attention weights that `record_attention` records.

    Raises:
        TypeError: a key is not an attention module (an `AttentionModule`, or one an adapter
            in `RECORDING_ADAPTERS` says it edits), or an edit is not callable.
    """
    items = list(dict(edits).items())
    for module, edit in items:
        if not (isinstance(module, AttentionModule) or _adapter_intervenes(module)):
            raise TypeError(
                "expected attention modules as keys (an AttentionModule, or a module an adapter in "
                f"RECORDING_ADAPTERS edits, e.g. a transformers model's under attnkit.hf), got {type(module).__name__}"
            )
        if not callable(edit):
            raise TypeError(f"expected a callable edit for {type(module).__name__}, got {type(edit).__name__}")
    entry = _Edits({id(module): edit for module, edit in items}, tuple(module for module, _ in items))
    _EDITS.set(_EDITS.get() + (entry,))
    try:
        yield
    finally:  # by identity, as record_attention
        _EDITS.set(tuple(other for other in _EDITS.get() if other is not entry))


def _adapter_intervenes(module: Any) -> bool:
    return any(adapter.intervenes is not None and adapter.intervenes(module) for adapter in RECORDING_ADAPTERS)


def _edited(module: Any, edits: tuple, query, key, value, output: np.ndarray, scale) -> np.ndarray:
    """`output` after each edit in turn."""
    for edit in edits:
        changed = edit(AttentionCall(module, query, key, value, output, scale))
        if changed is not None:
            changed = np.asarray(changed)
            if changed.shape != output.shape:
                raise ValueError(
                    f"expected an edit to return the per-head output's shape {output.shape}, got {changed.shape}"
                )
            output = changed.astype(output.dtype, copy=False)
    return output


class AttentionModule(Module):
    """A module that attends through a named backend (see the module docstring).

    Subclasses call `super().__init__()` and compute attention with `self.attend`.
    """

    returns_weights = False
    """Whether every forward returns the weights (SingleHeadSelfAttention): then a backend
    that forms none gives way to "naive", as while recording."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = "naive"

    @property
    def backend(self) -> str:
        """The name of the attention implementation (a key of ATTENTION_BACKENDS)."""
        return self.__dict__["_backend"]

    @backend.setter
    def backend(self, name: str) -> None:
        get_attention(name)  # raises ValueError naming the known backends
        object.__setattr__(self, "_backend", name)

    def _use_backend(self, name: str) -> None:
        self.backend = name

    def attend(
        self, query: np.ndarray, key: np.ndarray, value: np.ndarray, *, return_weights: bool = False, **options: Any
    ) -> np.ndarray | AttentionOutput:
        """`scaled_dot_product_attention(query, key, value, **options)` through this
        module's backend, with its arguments and results.

        While the module is recorded (`record_attention`), the (..., H, L, S) weights are
        formed and appended to each recording; a backend that never forms them
        (capability `weightless`, e.g. "flash") gives way to "naive" for that call, as it
        does for a module whose every result holds its weights (`returns_weights`).
        Otherwise `return_weights=True` asks the module's own backend for them (flash refuses).
        While an `intervene` edit is open on the module, the output goes through it.
        """
        recorders = active_recorders(self)
        edits = active_edits(self)
        if not (return_weights or recorders):
            output = get_attention(self.backend)(query, key, value, **options)
            if edits:
                output = _edited(self, edits, query, key, value, output, options.get("scale"))
            return output
        asked = return_weights and not self.returns_weights  # a caller asks this backend for weights
        name = "naive" if supports(self.backend, "weightless") and not asked else self.backend
        result = get_attention(name)(query, key, value, return_weights=True, **options)
        for maps in recorders:
            maps.append(result.weights)
        if edits:
            result = result._replace(
                output=_edited(self, edits, query, key, value, result.output, options.get("scale")))
        return result if return_weights else result.output


class AttentionRecording:
    """What `record_attention` yields: `maps`, the weights of every attention call,
    each (B, H, L, S), in call order (for a decoder's `generate`: layer by layer,
    step by step). Also a sequence itself: `len(recording)`, `recording[i]`."""

    def __init__(self) -> None:
        self.maps: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self.maps)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.maps)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.maps[index]

    def __repr__(self) -> str:
        shapes = sorted({m.shape for m in self.maps})
        return f"AttentionRecording(calls={len(self.maps)}, shapes={shapes})"


def attention_modules(model: Any) -> list[AttentionModule]:
    """The attention modules inside `model` (a Module, or a wrapper such as
    `SentenceEncoder` with `named_modules()`), in registration order."""
    named_modules = getattr(model, "named_modules", None)
    if not callable(named_modules):
        raise TypeError(
            f"expected a model or module (an attnkit.nn.Module or a SentenceEncoder), got {type(model).__name__}"
        )
    return [module for _, module in named_modules() if isinstance(module, AttentionModule)]


@contextmanager
def record_attention(model: Any) -> Iterator[AttentionRecording]:
    """Record the attention weights of every attention module in `model` while open.

    Arguments:
        model: any attnkit model or module (BertModel, SentenceEncoder, a CausalLM,
            MultiHeadAttention, TransformerBlock, ...), or a model an adapter in
            `RECORDING_ADAPTERS` knows: a transformers model loaded with
            attn_implementation="attnkit" once `attnkit.hf` is imported.

    Yields:
        An `AttentionRecording`; `.maps` fills with one (B, H, L, S) array per attention
        call, in call order. Recordings may nest; each sees every call the opening thread
        (or asyncio task) makes while it is open, and none made by other threads.

    Raises:
        TypeError: `model` is not a module; ValueError: it has no attention module.
    """
    recording = AttentionRecording()
    modules, sink = _recorded_modules(model, recording)
    entry = _Open(frozenset(id(module) for module in modules), tuple(modules), sink)
    _OPEN.set(_OPEN.get() + (entry,))
    try:
        yield recording
    finally:  # by identity, not by token: a generator may close it in another order
        _OPEN.set(tuple(other for other in _OPEN.get() if other is not entry))


class RecordingAdapter(NamedTuple):
    """How `record_attention` records a model that is not made of attnkit modules.

    find(model): the modules of `model` that compute attention, in call order, or None
        when `model` is not of this adapter's kind. While recorded, each such module's
        attention function appends its (B, H, L, S) weights to every sink
        `active_recorders(module)` returns.
    to_numpy(weights): those weights as a NumPy float32 array.
    """

    find: Callable[[Any], "list[Any] | None"]
    to_numpy: Callable[[Any], np.ndarray]
    intervenes: "Callable[[Any], bool] | None" = None
    """Whether a module of this kind applies `intervene` edits (its attention function
    reads `active_edits(module)`); None: none does."""


RECORDING_ADAPTERS: list[RecordingAdapter] = []
"""Adapters `record_attention` asks, in order, before attnkit's own modules. `attnkit.hf`
adds the one for transformers models when it is imported (nn imports no upper layer)."""


class _ConvertingSink:
    """A recording's list as a foreign module sees it: `append` stores the weights as NumPy."""

    __slots__ = ("maps", "to_numpy")

    def __init__(self, maps: list[np.ndarray], to_numpy: Callable[[Any], np.ndarray]) -> None:
        self.maps, self.to_numpy = maps, to_numpy

    def append(self, weights: Any) -> None:
        self.maps.append(self.to_numpy(weights))


def _recorded_modules(model: Any, recording: AttentionRecording) -> tuple[list[Any], Any]:
    """The modules to record and where their weights go."""
    for adapter in RECORDING_ADAPTERS:
        found = adapter.find(model)
        if found is not None:
            if not found:
                raise ValueError(f"{type(model).__name__} has no attention module to record")
            return list(found), _ConvertingSink(recording.maps, adapter.to_numpy)
    modules = attention_modules(model)
    if not modules:
        hint = ""
        if type(model).__module__.startswith("transformers."):
            hint = (" (a transformers model records after `import attnkit.hf`, "
                    "loaded with attn_implementation='attnkit')")
        raise ValueError(f"{type(model).__name__} has no attention module to record{hint}")
    return modules, recording.maps
