"""A shape fuzz over every public compiled entry: random shapes (zero-size axes too),
dtypes, strides, read-only arrays, aliasing and scalars, each call either a ValueError or
TypeError, or the NumPy reference's result.

Each array is cut from a larger buffer whose margins hold a known byte pattern, so a
write past either end shows as a changed margin; a read past the end shows as a result
other than the reference's, or, with luck, a crash. The cases run in a child process
(`python tests/kernels/test_kernel_fuzz.py ENTRIES SEED COUNT`), one line printed before each, so
a crash fails the test and names its case instead of taking the test run with it.

The quick tests run a few hundred cases per group; the slow-marked test many more. The
quantized products (`attnkit.quant`) are fuzzed through
their current import path.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

try:
    import pytest
except ImportError:  # pragma: no cover - the child process needs no pytest
    pytest = None

MARGIN = 64  # bytes of known pattern either side of every array
PATTERN = 0xA5
RTOL, ATOL = 2e-5, 2e-6

# ----------------------------------------------------------------------------- arrays in guarded buffers

_BUFFERS: list[tuple[np.ndarray, int, int]] = []  # (bytes, start, stop) of every array made this case


def _guarded(shape, dtype=np.float32, *, strided: bool = False, fortran: bool = False) -> np.ndarray:
    """An array of `shape` inside a buffer with PATTERN margins (registered for `_margins_intact`):
    C-contiguous, or every other element of a twice-as-long last axis, or Fortran order."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    full = list(shape)
    if strided and full:
        full[-1] *= 2
    size = int(np.prod(full, dtype=np.int64)) * dtype.itemsize
    raw = np.full(size + 2 * MARGIN + 64, PATTERN, np.uint8)
    start = MARGIN + (-raw.ctypes.data - MARGIN) % 64  # aligned for every dtype
    _BUFFERS.append((raw, start, start + size))
    body = raw[start:start + size].view(dtype)
    if fortran:
        a = body.reshape(full[::-1]).T
    else:
        a = body.reshape(full)
    if strided and full:
        a = a[..., ::2]
    return a


def _margins_intact() -> bool:
    return all((raw[:start] == PATTERN).all() and (raw[stop:] == PATTERN).all() for raw, start, stop in _BUFFERS)


def _filled(rng, shape, dtype=np.float32, scale=2.0, **layout) -> np.ndarray:
    a = _guarded(shape, dtype, **layout)
    if np.dtype(dtype).kind == "f":
        a[...] = rng.standard_normal(a.shape) * scale
    else:
        a[...] = rng.integers(-3, 4, a.shape)
    return a


def _dim(rng, low=0, high=24) -> int:
    """A size: mostly 1..high, sometimes 0."""
    return 0 if rng.random() < 0.08 else int(rng.integers(max(low, 1), high + 1))


# ----------------------------------------------------------------------------- references (float64 where it matters)


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _gelu64(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))) if x.size else x


def _layer_norm64(x, weight, bias, eps):
    x = np.asarray(x, np.float64)
    if x.shape[-1] == 0:
        return x
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _softmax64(s):
    s = np.asarray(s, np.float64)
    if s.shape[-1] == 0:
        return s, np.full(s.shape[:-1], -np.inf)
    top = s.max(axis=-1, keepdims=True)
    top = np.where(np.isneginf(top), 0.0, top)
    e = np.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(total[..., 0]) + top[..., 0]
        w = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    return w, lse


def _f32(a):
    return np.asarray(a, np.float32)


# ----------------------------------------------------------------------------- one spec per public entry
# A spec makes valid arguments (a dict, in call order), names the ones the call writes and
# the ones it converts (any layout/dtype documented), and computes what the call must give:
# {argument name: its expected contents afterwards, "return": the expected return value}.


class Spec:
    def __init__(self, call, make, expect, written=(), converted=(), scalars=None):
        self.call, self.make, self.expect = call, make, expect
        self.written, self.converted = tuple(written), tuple(converted)
        self.scalars = scalars or {}


def _elementwise_specs():
    from attnkit.kernels import elementwise as e

    def rows(rng):
        return [_dim(rng) for _ in range(int(rng.integers(1, 4)))]

    return {
        "elementwise.gelu": Spec(
            e.gelu, lambda rng: {"x": _filled(rng, rows(rng))},
            lambda a: {"x": _gelu64(a["x"])}, written=["x"]),
        "elementwise.gelu_bias": Spec(
            e.gelu_bias, lambda rng: (lambda n, f: {"x": _filled(rng, (n, f)), "bias": _filled(rng, (f,))})(
                _dim(rng), _dim(rng)),
            lambda a: {"x": _gelu64(_f32(a["x"]) + _f32(a["bias"]))}, written=["x"]),
        "elementwise.layer_norm": Spec(
            e.layer_norm, lambda rng: (lambda shape: {
                "x": _filled(rng, shape), "weight": _filled(rng, shape[-1:]), "bias": _filled(rng, shape[-1:]),
                "eps": 1e-5})(rows(rng)),
            lambda a: {"x": _layer_norm64(a["x"], _f32(a["weight"]), _f32(a["bias"]), a["eps"])}, written=["x"],
            scalars={"eps": [float("nan"), "1e-5", None, np.float32(1e-3)]}),
        "elementwise.add_layer_norm": Spec(
            e.add_layer_norm, lambda rng: (lambda n, d: {
                "y": _filled(rng, (n, d)), "add_bias": _filled(rng, (d,)), "residual": _filled(rng, (n, d)),
                "weight": _filled(rng, (d,)), "bias": _filled(rng, (d,)), "eps": 1e-5})(_dim(rng), _dim(rng)),
            lambda a: {"y": _layer_norm64((_f32(a["y"]) + _f32(a["add_bias"])) + _f32(a["residual"]),
                                          _f32(a["weight"]), _f32(a["bias"]), a["eps"])}, written=["y"],
            scalars={"eps": [float("inf"), b"x", 2]}),
        "elementwise.softmax": Spec(
            e.softmax, lambda rng: (lambda shape: {"scores": _scores(rng, shape), "lse": _guarded(shape[:-1])})(
                rows(rng)),
            lambda a: dict(zip(("scores", "lse"), _softmax64(a["scores"]))), written=["scores", "lse"]),
        "elementwise.attention_softmax": Spec(
            e.attention_softmax, lambda rng: {"scores": _scores(rng, rows(rng)), "scale": float(rng.uniform(0.05, 2))},
            lambda a: {"scores": _softmax64(_f32(a["scores"]).astype(np.float64) * a["scale"])[0]},
            written=["scores"], scalars={"scale": [0.0, -1.0, float("nan"), "0.5", None, True, 1e300]}),
        "elementwise.add_bias_to_leading_columns": Spec(
            e.add_bias_to_leading_columns,
            lambda rng: (lambda n, c: {"x": _filled(rng, (n, c)), "bias": _filled(rng, (int(rng.integers(0, c + 1)),))})(
                _dim(rng), _dim(rng)),
            lambda a: {"x": _leading(a["x"], a["bias"])}, written=["x"]),
    }


def _scores(rng, shape):
    s = _filled(rng, shape, scale=3.0)
    if s.size and rng.random() < 0.3:  # some -inf entries, sometimes whole rows
        s[rng.random(s.shape) < 0.3] = -np.inf
        if s.ndim and s.shape[0]:
            s[0] = -np.inf
    return s


def _leading(x, bias):
    out = _f32(x).copy()
    out[:, : len(bias)] += _f32(bias)
    return out


def _flash_specs():
    from attnkit.kernels import flash as f

    def band(s, shift, extra, scale, lo, hi):
        s = np.asarray(s, np.float32)
        rows, cols = s.shape[-2], s.shape[-1]
        i = np.arange(rows)[:, None]
        j = np.arange(cols)[None, :]
        allowed = (j - i >= lo) & (j - i <= hi)
        with np.errstate(over="ignore", invalid="ignore"):
            p = np.exp(((s - _f32(shift)[..., None]) - _f32(extra)[..., None]).astype(np.float64)) \
                * _f32(scale)[..., None]
        p = np.where(allowed, p, 0.0)
        return p, p.sum(axis=-1)

    def grad(ds, p, d, weight, peak):
        ds32, p32 = _f32(ds), _f32(p)
        out = (p32 * (ds32 - _f32(d)[:, None])).astype(np.float64)
        top = np.full(ds32.shape[0], -1, np.int64)
        if ds32.shape[1]:
            for i in range(ds32.shape[0]):
                if _f32(weight)[i] > np.float32(peak):
                    at = int(np.argmax(p32[i]))
                    if p32[i, at] > np.float32(peak):
                        out[i, at] = 0.0
                        top[i] = at
        return {"ds": out, "top": top, "ds_sums": out.sum(axis=1), "return": int((top >= 0).sum())}

    def make_band(rng):
        shape = [_dim(rng, high=4)] + [_dim(rng) for _ in range(2)]
        if rng.random() < 0.3:
            shape = shape[1:]
        rows = shape[:-1]
        lo, hi = sorted(int(v) for v in rng.integers(-30, 30, 2))
        if rng.random() < 0.2:
            lo, hi = -f.NO_BAND, f.NO_BAND
        return {"s": _filled(rng, shape), "shift": _filled(rng, rows), "extra": _filled(rng, rows, scale=0.5),
                "scale": _filled(rng, rows, scale=1.0), "sums": _guarded(rows), "lo": lo, "hi": hi}

    def make_grad(rng):
        r, c = _dim(rng), _dim(rng)
        p = _guarded((r, c))
        p[...] = rng.random((r, c)) ** 4
        return {"ds": _filled(rng, (r, c)), "p": p, "d": _filled(rng, (r,)), "weight": _filled(rng, (r,), scale=1.0),
                "peak": 0.3, "top": _guarded((r,), np.int64), "ds_sums": _guarded((r,))}

    return {
        "flash.exp_tile": Spec(
            f.exp_tile, lambda rng: {"s": _filled(rng, [_dim(rng) for _ in range(int(rng.integers(1, 4)))])},
            lambda a: {"s": np.exp(_f32(a["s"]).astype(np.float64))}, written=["s"]),
        "flash.shifted_exp_tile": Spec(
            f.shifted_exp_tile, lambda rng: (lambda shape: {"s": _filled(rng, shape), "shift": _filled(rng, shape[:-1])})(
                [_dim(rng) for _ in range(int(rng.integers(1, 4)))]),
            lambda a: {"s": np.exp((_f32(a["s"]) - _f32(a["shift"])[..., None]).astype(np.float64))},
            written=["s"], converted=["shift"]),
        "flash.weighted_grad_tile": Spec(
            f.weighted_grad_tile, lambda rng: (lambda r, c: {"ds": _filled(rng, (r, c)), "p": _filled(rng, (r, c)),
                                                             "sums": _guarded((r,))})(_dim(rng), _dim(rng)),
            lambda a: {"ds": _f32(a["ds"]) * _f32(a["p"]), "sums": _f32(a["p"]).astype(np.float64).sum(axis=1)},
            written=["ds", "sums"]),
        "flash.band_exp_tile": Spec(
            f.band_exp_tile, make_band,
            lambda a: dict(zip(("s", "sums"), band(a["s"], a["shift"], a["extra"], a["scale"], a["lo"], a["hi"]))),
            written=["s", "sums"], converted=["shift", "extra", "scale"],
            scalars={"lo": [0.5, "1", None, np.float32(2)], "hi": [1.5, None]}),
        "flash.grad_scores_tile": Spec(
            f.grad_scores_tile, make_grad,
            lambda a: grad(a["ds"], a["p"], a["d"], a["weight"], a["peak"]),
            written=["ds", "top", "ds_sums"], converted=["d", "weight"],
            scalars={"peak": [float("nan"), "0.3", None]}),
    }


def _quant_specs():
    from attnkit import quant as q

    kinds = [kind.name for kind in q.GGMLType]

    def blocks(rng, kind, rows, columns):
        # bytes below 0x3C: every float16/bfloat16/float32 scale they form is finite and modest
        raw = _guarded((rows, q.row_bytes(kind, columns)), np.uint8)
        raw[...] = rng.integers(0, 0x3C, raw.shape)
        return raw

    def make_matmul(rng):
        kind = kinds[int(rng.integers(len(kinds)))]
        columns = q.GGMLType[kind].block_size * int(rng.integers(1, 4))  # K = 0 is refused (below)
        n = int(rng.choice([0, 1, 2, 3, 8, 9, 13]))
        return {"x": _filled(rng, (n, columns), scale=1.0), "raw": blocks(rng, kind, _dim(rng, high=40), columns),
                "kind": kind, "columns": columns}

    def weights(raw, kind, columns):
        """The dequantized W (R, K): the NumPy reference, which fails on no rows or columns."""
        if isinstance(raw, np.ndarray) and raw.ndim == 2 and 0 in (raw.shape[0], columns):
            if raw.dtype != np.uint8 or raw.shape[1] != q.row_bytes(kind, columns):
                raise ValueError("not blocks of this type")
            return np.zeros((raw.shape[0], columns), np.float32)
        return q.dequantize(raw, kind, columns)

    def product(x, parts, columns, int8=False):
        """x @ W.T in float64; with int8, the decode products' 8-bit x (matmul_int8_reference)."""
        x_in = np.asarray(x)
        if x_in.ndim != 2 or x_in.shape[1] != columns:
            raise ValueError("x does not fit")
        x64 = x_in.astype(np.float32).astype(np.float64)
        out = []
        for raw, kind in parts:
            w = weights(raw, kind, columns)
            decode = int8 and x_in.dtype != np.float64 and x_in.shape[0] <= q.DECODE_ROWS and kind in q.INT8_TYPES
            if decode and w.size and x_in.shape[0]:
                out.append(q.matmul_int8_reference(x_in, raw, kind, columns))
            else:
                out.append(x64 @ w.astype(np.float64).T)
        return np.concatenate(out, axis=1) if out else np.zeros((x_in.shape[0], 0))

    def expect_matmul(a):
        return {"return": product(a["x"], [(a["raw"], a["kind"])], a["columns"])}

    def make_stack(rng):
        first = make_matmul(rng)
        parts = [(first["raw"], first["kind"])]
        for _ in range(int(rng.integers(0, 3))):
            kind = kinds[int(rng.integers(len(kinds)))]
            if first["columns"] % q.GGMLType[kind].block_size == 0:
                parts.append((blocks(rng, kind, _dim(rng, high=20), first["columns"]), kind))
        return {"x": first["x"], "parts": parts, "columns": first["columns"]}

    def expect_stack(a):
        return {"return": product(a["x"], a["parts"], a["columns"])}

    def make_int8(rng):
        a = make_matmul(rng)
        a["kind"] = q.INT8_TYPES[int(rng.integers(len(q.INT8_TYPES)))]
        a["columns"] = 32 * int(rng.integers(1, 5))
        a["x"] = _filled(rng, (int(rng.integers(1, q.DECODE_ROWS + 1)), a["columns"]), scale=1.0)
        a["raw"] = blocks(rng, a["kind"], _dim(rng, high=40), a["columns"])
        return a

    def int8_matmul(x, raw, kind, columns):
        with q.activations("int8"):
            return q.matmul(x, raw, kind, columns)

    def expect_int8(a):
        return {"return": product(a["x"], [(a["raw"], a["kind"])], a["columns"], int8=True)}

    def expect_dequantize(a):
        return {"return": weights(a["raw"], a["kind"], a["columns"])}

    def make_dequantize(rng):
        a = make_matmul(rng)
        return {"raw": a["raw"], "kind": a["kind"], "columns": a["columns"]}

    return {
        "quant.matmul": Spec(lambda **a: q.matmul(**a, compiled=True), make_matmul, expect_matmul,
                             scalars={"kind": ["Q9_9", None, 4], "columns": [-32, 0, 31, "64", None, 2.0]}),
        "quant.matmul_stack": Spec(lambda **a: q.matmul_stack(**a, compiled=True), make_stack, expect_stack,
                                   scalars={"parts": [[], None, [(None, "Q4_0")]], "columns": [-32, 0, 7, None]}),
        "quant.matmul int8": Spec(lambda **a: int8_matmul(**a), make_int8, expect_int8,
                                  scalars={"columns": [16, -32], "kind": ["Q6_K"]}),
        "quant.dequantize_compiled": Spec(
            q.dequantize_compiled, make_dequantize,
            expect_dequantize,
            scalars={"kind": ["Q9_9", None], "columns": [-32, 0, 33, None]}),
    }


GROUPS = {"elementwise": _elementwise_specs, "flash": _flash_specs, "quant": _quant_specs}

# ----------------------------------------------------------------------------- mutations

_DTYPES = [np.float64, np.float16, np.int32, np.dtype(">f4"), np.int64, np.float32, np.uint8, np.int8]


def _copy_like(rng, a, shape=None, dtype=None, **layout):
    shape = a.shape if shape is None else shape
    out = _guarded(shape, a.dtype if dtype is None else dtype, **layout)
    flat = np.asarray(a).reshape(-1)
    if out.size:
        with np.errstate(all="ignore"):
            out[...] = np.resize(flat, out.size).reshape(out.shape).astype(out.dtype) if flat.size else 0
    return out


def _mutate(rng, spec: Spec, args: dict) -> str:
    """Change one argument (or none) at random; returns what was done."""
    arrays = [k for k, v in args.items() if isinstance(v, np.ndarray)]
    choice = rng.choice(["valid", "shape", "dtype", "strided", "fortran", "readonly", "alias", "list", "scalar",
                         "ndim"], p=[0.2, 0.2, 0.12, 0.1, 0.06, 0.07, 0.1, 0.04, 0.06, 0.05])
    if choice == "scalar" and spec.scalars:
        name = list(spec.scalars)[int(rng.integers(len(spec.scalars)))]
        values = spec.scalars[name]
        args[name] = values[int(rng.integers(len(values)))]
        return f"scalar {name}={args[name]!r}"
    if not arrays or choice in ("valid", "scalar"):
        return "valid"
    name = arrays[int(rng.integers(len(arrays)))]
    a = args[name]
    if choice == "shape":
        shape = list(a.shape)
        if shape:
            axis = int(rng.integers(len(shape)))
            shape[axis] = max(0, shape[axis] + int(rng.choice([-3, -1, 1, 2, 7, 100])))
        args[name] = _copy_like(rng, a, tuple(shape))
    elif choice == "ndim":
        shape = list(a.shape)
        if shape and rng.random() < 0.5:
            shape = shape[1:] if rng.random() < 0.5 else shape[:-1]
        else:
            shape.insert(int(rng.integers(len(shape) + 1)), int(rng.integers(1, 3)))
        args[name] = _copy_like(rng, a, tuple(shape))
    elif choice == "dtype":
        args[name] = _copy_like(rng, a, dtype=_DTYPES[int(rng.integers(len(_DTYPES)))])
    elif choice == "strided":
        args[name] = _copy_like(rng, a, strided=True)
    elif choice == "fortran":
        args[name] = _copy_like(rng, a, fortran=True)
    elif choice == "readonly":
        a.flags.writeable = False
    elif choice == "list":
        args[name] = a.tolist()
    elif choice == "alias":
        others = [k for k in arrays if k != name and args[k].size >= a.size and args[k].dtype == a.dtype]
        if not others or not a.size:
            return "valid"
        other = others[int(rng.integers(len(others)))]
        args[name] = args[other].reshape(-1)[: a.size].reshape(a.shape)
        return f"alias {name} -> {other}"
    return f"{choice} {name}"


# ----------------------------------------------------------------------------- comparing


def _close(actual, expected) -> bool:
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        return False
    if actual.dtype.kind in "iu" or expected.dtype.kind in "iu":
        return bool((actual == expected).all())
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    same_nan = np.isnan(a) == np.isnan(e)
    finite = np.isfinite(a) & np.isfinite(e)
    same_inf = np.where(np.isinf(a) | np.isinf(e), a == e, True)
    near = np.where(finite, np.abs(a - e) <= RTOL * np.abs(e) + ATOL, True)
    return bool(same_nan.all() and same_inf.all() and near.all())


def _quant_close(actual, expected, args) -> bool:
    """Products: within a few float32 roundings of |W| @ |x| (docs/kernels.md's budget, loosened)."""
    from attnkit import quant as q

    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return False
    if "x" not in args:
        return _close(actual, expected)
    parts = args["parts"] if "parts" in args else [(args["raw"], args["kind"])]
    columns = args["columns"]
    w = [q.dequantize(raw, kind, columns) if raw.shape[0] and columns else np.zeros((raw.shape[0], columns))
         for raw, kind in parts]
    w = np.concatenate(w, axis=0) if w else np.zeros((0, columns))
    bound = np.abs(np.asarray(args["x"], np.float64)) @ np.abs(w.astype(np.float64)).T
    # (8-bit x: its rounding, |W| @ |x| / 254 at worst, is in the reference already; the rest float32's)
    return bool((np.abs(actual.astype(np.float64) - expected.astype(np.float64)) <= 1e-5 * bound + 1e-30).all())


def _snapshot(args: dict) -> dict:
    return {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else
                [(np.array(r, copy=True), kind) for r, kind in v] if k == "parts" and isinstance(v, list)
                and all(isinstance(p, tuple) and isinstance(p[0], np.ndarray) for p in v) else v)
            for k, v in args.items()}


def run_case(spec: Spec, rng, group: str) -> str | None:
    """One random case: None when it held, else what went wrong."""
    _BUFFERS.clear()
    args = spec.make(rng)
    what = _mutate(rng, spec, args)
    before = _snapshot(args)
    print(f"  {what}: " + ", ".join(f"{k}={getattr(v, 'shape', v)!s:.40}{'/' + str(v.dtype) if hasattr(v, 'dtype') else ''}"
                                    for k, v in args.items()), flush=True)
    try:
        returned = spec.call(**args)
    except (ValueError, TypeError) as error:
        if what == "valid":
            return f"valid input refused: {type(error).__name__}: {error}"
        if not _margins_intact():
            return "raised, but wrote outside its arrays"
        return None
    if not _margins_intact():
        return "wrote outside its arrays"
    try:
        expected = spec.expect(before)
    except Exception as error:  # the reference refuses: the kernel should have
        return f"accepted what the reference refuses ({type(error).__name__}: {error})"
    for name, value in expected.items():
        actual = returned if name == "return" else args[name]
        ok = _quant_close(actual, value, before) if group == "quant" and name == "return" else _close(actual, value)
        if not ok:
            return f"{name} differs from the reference"
    return None


def run(groups: list[str], seed: int, count: int) -> int:
    """Run `count` cases per entry of the groups; prints each; returns the number of failures."""
    import warnings

    warnings.simplefilter("ignore")
    failures = 0
    for group in groups:
        specs = GROUPS[group]()
        if group != "quant":
            from attnkit.kernels import elementwise

            elementwise.load()
        for name, spec in specs.items():
            rng = np.random.default_rng([seed, sum(map(ord, name))])
            for i in range(count):
                print(f"CASE {name} #{i}", flush=True)
                try:
                    problem, tag = run_case(spec, rng, group), "FAIL"
                except Exception as error:  # neither ValueError nor TypeError: a wrong error, memory intact
                    where = traceback.extract_tb(error.__traceback__)[-1]
                    problem, tag = f"{type(error).__name__}: {error} (at {Path(where.filename).name}:{where.lineno})", \
                        "RAISED"
                    if not _margins_intact():
                        problem, tag = problem + ", and wrote outside its arrays", "FAIL"
                if problem:
                    failures += 1
                    print(f"{tag} {name} #{i}: {problem}", flush=True)
    print(f"DONE {failures} failures", flush=True)
    return failures


# ----------------------------------------------------------------------------- the tests (parent side)


def _fuzz(groups: str, seed: int, count: int, timeout: float = 600, wrong_errors: bool = False) -> None:
    """Run the cases in a child; fails on a crash, a write outside an array, a result other
    than the reference's, a valid input refused, and (unless `wrong_errors`) an error other
    than ValueError/TypeError."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2] / "src"),
                                                                      os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__, groups, str(seed), str(count)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = done.stdout.splitlines()
    fails = [line for line in lines if line.startswith("FAIL") or (line.startswith("RAISED") and not wrong_errors)]
    if done.returncode < 0 or not any(line.startswith("DONE") for line in lines):
        last = [line for line in lines if line.startswith("CASE")][-1:]
        pytest.fail(f"the child died (exit {done.returncode}) in {last} {lines[-1:]}: {done.stderr[-800:]}")
    assert not fails, "\n".join(fails[:20])
    assert done.returncode == 0 or wrong_errors, done.stderr[-2000:]


if pytest is not None:
    from attnkit import kernels

    needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason=f"compiled kernels off: {kernels.reason_disabled()}")

    @needs_kernels
    @pytest.mark.parametrize("group", ["elementwise", "flash"])
    def test_every_entry_refuses_or_matches_the_reference(group):
        _fuzz(group, seed=45, count=40)

    @needs_kernels
    def test_quantized_products_never_crash_and_match_the_reference():
        """attnkit.quant's public entries: no crash, no write outside an array, the
        reference's result; what they raise is left to the next test."""
        _fuzz("quant", seed=45, count=40, wrong_errors=True)

    @needs_kernels
    def test_quantized_products_raise_only_value_or_type_errors():
        _fuzz("quant", seed=45, count=40)

    @needs_kernels
    @pytest.mark.slow
    @pytest.mark.parametrize("seed", [1, 2])
    def test_every_entry_refuses_or_matches_the_reference_many_cases(seed):
        _fuzz("elementwise,flash", seed=seed, count=400, timeout=1800)
        _fuzz("quant", seed=seed, count=400, timeout=1800, wrong_errors=True)


if __name__ == "__main__":
    sys.exit(1 if run(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])) else 0)
