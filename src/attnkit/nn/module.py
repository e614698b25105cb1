"""The Module base class: named parameters, state dicts, dtype, train/eval.

A Module holds its parameters as NumPy float arrays (float32 by default,
float64 on request) and its child modules as attributes, like torch.nn.Module.
Parameter names are dotted paths (``q_proj.weight``), the same keys torch
uses, so a state dict moves between the two with at most a transpose-free
rename at a model loader's boundary.

Parameters are read-only arrays. Change a weight by assigning a new array
(``linear.weight = w``) or with ``load_state_dict``; both check the shape and
cast to the module's dtype. Read-only arrays make it impossible for a cached
derived array (the fused QKV weight of MultiHeadAttention) to go stale
silently.

Every change made through this API (assigning or deleting an attribute, a parameter or a
child module, `register_parameter`, `load_state_dict`, `astype`, writing the `_parameters`
or `_modules` mappings, unpickling) moves `structure_version()`, a process-wide number: a
cache built from a model's modules (the compiled decode step's frame) is valid while that
number has not moved, and checks its own links again only when it has. A change around the
API (`object.__setattr__`, writing an instance's `__dict__`) is not counted.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from attnkit.functional import get_attention

_CHANGES = itertools.count(1)  # next() is atomic: two changes never store the same number
_VERSION = [0]


def structure_version() -> int:
    """A number that moves whenever any module's parameters, child modules or attributes
    change through the Module API (see the module docstring); equal numbers mean no such
    change happened in between."""
    return _VERSION[0]


def _changed() -> None:
    _VERSION[0] = next(_CHANGES)


class _Tracked(OrderedDict):
    """A module's `_parameters` / `_modules` mapping: every write moves `structure_version()`."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        _changed()

    def pop(self, *args):
        try:
            return super().pop(*args)
        finally:
            _changed()

    def popitem(self, last=True):
        try:
            return super().popitem(last)
        finally:
            _changed()

    def setdefault(self, key, default=None):
        try:
            return super().setdefault(key, default)
        finally:
            _changed()

    def update(self, *args, **kwargs):
        try:
            super().update(*args, **kwargs)
        finally:
            _changed()

    def clear(self):
        super().clear()
        _changed()

    def move_to_end(self, key, last=True):
        super().move_to_end(key, last)
        _changed()

    def __ior__(self, other):
        try:
            return super().__ior__(other)
        finally:
            _changed()


# dtypes a module's parameters may have.
PARAMETER_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

def make_rng(seed: int | np.random.Generator | None) -> np.random.Generator:
    """A Generator from a seed: an int, an existing Generator (used as is) or None
    (fresh OS entropy). Never touches NumPy's global random state."""
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is None or (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool)):
        return np.random.default_rng(seed)
    raise TypeError(f"expected seed to be an int, a numpy.random.Generator or None, got {type(seed).__name__}")


def parameter_dtype(dtype: Any) -> np.dtype:
    """Check and normalize a parameter dtype (float32 or float64)."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"expected a dtype of float32 or float64, got {dtype!r}") from exc
    if dt not in PARAMETER_DTYPES:
        raise TypeError(f"expected parameter dtype float32 or float64, got {dt}")
    return dt


def compute_dtype(x_dtype: np.dtype, param_dtype: np.dtype) -> np.dtype:
    """The dtype a module computes in: the wider of the input's and the
    parameters', and at least float32 (float16 input computes in float32)."""
    return np.promote_types(np.promote_types(x_dtype, np.float32), param_dtype)


def check_float_input(name: str, x: Any) -> np.ndarray:
    """Return `x` as an ndarray, rejecting anything that is not floating point."""
    if not isinstance(x, np.ndarray):
        if hasattr(x, "detach") and hasattr(x, "numpy"):
            raise TypeError(f"expected {name} to be a numpy array, got a torch tensor; pass tensor.detach().cpu().numpy()")
        x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"expected {name} to be a floating-point array (float16/32/64), got dtype {x.dtype}")
    return x


def _readonly(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _stored(value: Any, dtype: np.dtype, order: str, copy: bool = False) -> np.ndarray:
    """A read-only parameter array in `dtype` and memory `order` ("C" or "F")."""
    array = np.array(value, dtype=dtype, order=order, copy=True) if copy else np.asarray(value, dtype=dtype, order=order)
    return _readonly(array)


class LoadResult(NamedTuple):
    """What `load_state_dict(strict=False)` skipped."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Module:
    """Base class of attnkit's NumPy modules.

    Subclasses register parameters with `register_parameter(name, array)` and
    child modules by plain attribute assignment, then implement `forward`.
    Calling the module calls `forward`. A new module is in eval mode
    (`training` False): dropout is off until `train()` is called.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", _Tracked())
        object.__setattr__(self, "_modules", _Tracked())
        object.__setattr__(self, "_parameter_order", {})
        object.__setattr__(self, "training", False)

    # ----- registration -----------------------------------------------------

    def register_parameter(
        self, name: str, value: np.ndarray | None, dtype: Any = np.float32, *, order: str = "C"
    ) -> None:
        """Add a parameter (or None for an absent optional one, like a bias).

        `order` is the memory layout kept through assignment, loading and
        astype: "F" stores a (out, in) weight column-major, so that
        ``x @ weight.T`` is a plain row-major GEMM.
        """
        if "." in name or not name:
            raise ValueError(f"expected a parameter name without dots, got {name!r}")
        if order not in ("C", "F"):
            raise ValueError(f"expected order 'C' or 'F', got {order!r}")
        self._parameter_order[name] = order
        if value is None:
            self._parameters[name] = None
            return
        array = np.asarray(value)
        if not np.issubdtype(array.dtype, np.floating):
            raise TypeError(f"expected parameter {name!r} to be floating point, got dtype {array.dtype}")
        self._parameters[name] = _stored(array, parameter_dtype(dtype), order)

    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        if params is None:
            raise AttributeError("call Module.__init__() before assigning attributes")
        if isinstance(value, Module):
            self._modules[name] = value
            self.__dict__.pop(name, None)
        elif name in params:
            self._set_parameter(name, value)
        elif name in self._modules:
            if value is not None:
                raise TypeError(f"expected {name!r} to be a Module (or None to remove it), got {type(value).__name__}")
            del self._modules[name]
            object.__setattr__(self, name, None)
        else:
            object.__setattr__(self, name, value)
        _changed()

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        _changed()

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: parameters and child modules.
        d = self.__dict__
        if "_parameters" in d and name in d["_parameters"]:
            return d["_parameters"][name]
        if "_modules" in d and name in d["_modules"]:
            return d["_modules"][name]
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def _set_parameter(self, name: str, value: Any) -> None:
        old = self._parameters[name]
        if value is None or old is None:
            if value is not None or old is not None:
                raise ValueError(
                    f"parameter {name!r} is {'absent' if old is None else 'present'} in this module; "
                    "build the module with/without it instead of assigning None or an array"
                )
            return
        array = np.asarray(value)
        if not np.issubdtype(array.dtype, np.floating):
            raise TypeError(f"expected parameter {name!r} to be floating point, got dtype {array.dtype}")
        if array.shape != old.shape:
            raise ValueError(f"expected parameter {name!r} of shape {old.shape}, got {array.shape}")
        self._parameters[name] = _stored(array, old.dtype, self._parameter_order[name])
        self._parameters_changed()

    def __setstate__(self, state: dict) -> None:
        # pickle and deepcopy restore arrays as writable; parameters stay read-only.
        self.__dict__.update(state)
        for key in ("_parameters", "_modules"):  # a module pickled before the mappings were tracked
            if type(self.__dict__.get(key)) is OrderedDict:
                self.__dict__[key] = _Tracked(self.__dict__[key])
        _changed()
        for array in self._parameters.values():
            if array is not None:
                array.flags.writeable = False

    def _parameters_changed(self) -> None:
        """Hook for modules that cache arrays derived from their parameters."""

    def _dtype_changed(self, dtype: np.dtype) -> None:
        """Hook for modules that hold arrays in the parameters' dtype that are not
        parameters (rotary tables): `astype` calls it with the new dtype."""

    # ----- traversal ----------------------------------------------------------

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """Yield (dotted name, module) for this module ("" ) and all descendants."""
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def children(self) -> Iterator[Module]:
        yield from self._modules.values()

    @property
    def child_modules(self) -> Mapping[str, Module]:
        """This module's direct children by attribute name: a live, read-only view (it sees
        every later assignment; change children through attributes). Reading it is as fast
        as reading a dict, which is what a cache built from a model's parts (the compiled
        decode step's frame) uses to check that they are still there."""
        return MappingProxyType(self._modules)

    @property
    def own_parameters(self) -> Mapping[str, np.ndarray | None]:
        """This module's own parameters (not its children's) by name, None for an absent
        optional one (a bias): a live, read-only view, as `child_modules`."""
        return MappingProxyType(self._parameters)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
        """Yield (dotted name, array) for every parameter, in registration order."""
        for mod_name, module in self.named_modules(prefix):
            for name, array in module._parameters.items():
                if array is not None:
                    yield (f"{mod_name}.{name}" if mod_name else name), array

    def parameters(self) -> Iterator[np.ndarray]:
        for _, array in self.named_parameters():
            yield array

    def num_parameters(self) -> int:
        """Total number of scalar parameters."""
        return sum(int(a.size) for a in self.parameters())

    # ----- state dict -----------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """A flat dict of dotted names to (read-only) parameter arrays, e.g.
        ``{"q_proj.weight": (d_model, d_model) array, ...}``. Shares memory with
        the module; the arrays cannot be written to."""
        return dict(self.named_parameters())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> LoadResult:
        """Copy arrays from `state_dict` into this module's parameters.

        Every key present in both is checked for shape (always) and cast to the
        parameter's dtype. With ``strict=True`` (default) a missing or unexpected
        key is an error. Nothing is changed unless every check passes.

        Returns:
            LoadResult(missing_keys, unexpected_keys).
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"expected state_dict to be a mapping of names to arrays, got {type(state_dict).__name__}")
        owners: dict[str, tuple[Module, str]] = {}
        for mod_name, module in self.named_modules():
            for name, array in module._parameters.items():
                if array is not None:
                    owners[f"{mod_name}.{name}" if mod_name else name] = (module, name)
        missing = [k for k in owners if k not in state_dict]
        unexpected = [k for k in state_dict if k not in owners]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if unexpected:
                parts.append(f"unexpected keys {unexpected}")
            raise ValueError(f"state_dict does not match {type(self).__name__}: " + "; ".join(parts))
        staged: list[tuple[Module, str, np.ndarray]] = []
        for key, (module, name) in owners.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if hasattr(value, "detach") and hasattr(value, "numpy"):
                value = value.detach().cpu().numpy()
            array = np.asarray(value)
            old = module._parameters[name]
            if not np.issubdtype(array.dtype, np.floating):
                raise TypeError(f"state_dict[{key!r}]: expected a floating-point array, got dtype {array.dtype}")
            if array.shape != old.shape:
                raise ValueError(f"state_dict[{key!r}]: expected shape {old.shape}, got {array.shape}")
            staged.append((module, name, _stored(array, old.dtype, module._parameter_order[name], copy=True)))
        for module, name, array in staged:
            module._parameters[name] = array
        for _, module in self.named_modules():
            module._parameters_changed()
        return LoadResult(missing, unexpected)

    # ----- dtype ----------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the parameters (float32 unless converted with `astype`)."""
        dtypes = {a.dtype for a in self.parameters()}
        if not dtypes:
            return np.dtype(np.float32)
        if len(dtypes) > 1:
            raise TypeError(f"{type(self).__name__} has parameters of mixed dtypes {sorted(map(str, dtypes))}")
        return dtypes.pop()

    def astype(self, dtype: Any) -> Module:
        """Convert every parameter to `dtype` (float32 or float64) in place; returns self."""
        dt = parameter_dtype(dtype)
        for _, module in self.named_modules():
            for name, array in module._parameters.items():
                if array is not None and array.dtype != dt:
                    module._parameters[name] = _stored(array, dt, module._parameter_order[name])
            module._parameters_changed()
            module._dtype_changed(dt)
        return self

    # ----- modes ----------------------------------------------------------------

    def train(self, mode: bool = True) -> Module:
        """Set training mode (dropout on) for this module and its children; returns self."""
        for _, module in self.named_modules():
            object.__setattr__(module, "training", bool(mode))
        return self

    def eval(self) -> Module:
        """Set eval mode (dropout off, the default); returns self."""
        return self.train(False)

    def set_rng(self, seed: int | np.random.Generator | None) -> Module:
        """Give this module and its children one Generator for dropout draws."""
        rng = make_rng(seed)
        for _, module in self.named_modules():
            if "rng" in module.__dict__:
                object.__setattr__(module, "rng", rng)
        return self

    def set_attention_backend(self, name: str) -> Module:
        """Use attention backend `name` (a key of attnkit.functional.ATTENTION_BACKENDS,
        e.g. "naive" or "flash") in every attention module inside this one, encoder or
        decoder alike; returns self. An unknown name raises ValueError naming the known ones."""
        get_attention(name)
        for _, module in self.named_modules():
            module._use_backend(name)
        return self

    def _use_backend(self, name: str) -> None:
        """Hook: attention modules (attnkit.nn.interface.AttentionModule) take backend `name`."""

    # ----- calling ----------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, child in self._modules.items():
            child_repr = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({name}): {child_repr}")
        if len(lines) == 1:
            return lines[0] + ")"
        return "\n".join(lines) + "\n)"


class ModuleList(Module):
    """An indexable list of modules; state-dict keys are ``"0.weight"``, ``"1.weight"``, ..."""

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        super().__init__()
        for module in modules:
            self.append(module)

    def append(self, module: Module) -> ModuleList:
        if not isinstance(module, Module):
            raise TypeError(f"expected a Module, got {type(module).__name__}")
        self._modules[str(len(self._modules))] = module
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int) -> Module:
        n = len(self._modules)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for ModuleList of length {n}")
        return self._modules[str(index % n)]
