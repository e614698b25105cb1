"""Twin parity: every attnkit.nn (NumPy) class and its attnkit.torch twin of the same name.

For each pair found by listing both packages' public classes: the same
constructor signature (names, kinds and defaults; the differences allowed are
listed below, each with its reason), the same state-dict keys and shapes, the
same call signature, and equal outputs after moving the weights with
`attnkit.torch.interop`:

- eval mode: truth = the NumPy twin in float64; attnkit's result = one twin in
  float32, oracle = the other twin in float32, both ways round
  (`assert_within_budget`); the two float64 twins agree to float64 rounding.
- with a KV cache: both twins decode through their own `new_kv_cache()`, prompt
  then one token at a time, left-padded; each step within budget of the other
  twin (truth: the NumPy twin in float64), and step-by-step decoding equals the
  full causal forward.
- train mode with dropout: the twins cannot share a dropout mask (NumPy draws
  from a numpy Generator, torch from torch's RNG; neither can replay the
  other's stream), so train mode is compared by its statistics (the mean over
  many draws, within a few standard errors) and, for MultiHeadAttention, by
  the returned weights, which are the dropped weights the output is formed
  with in both twins (as torch.nn.MultiheadAttention returns them).
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

import attnkit.nn as ann
from conftest import assert_within_budget, optional

torch = optional("torch")
at = importlib.import_module("attnkit.torch") if torch else None

pytestmark = pytest.mark.usefixtures("torch")  # every test here runs attnkit.torch


def _public_classes(module) -> dict[str, type]:
    return {name: getattr(module, name) for name in module.__all__ if inspect.isclass(getattr(module, name))}


# The twin pairs this test knows how to build; test_every_twin_pair_is_covered
# fails when a new same-named pair appears without being added here.
MODULE_TWINS = ["Linear", "LayerNorm", "FeedForward", "MultiHeadAttention", "TransformerBlock"]
# Same-named classes that are not modules: results (NamedTuples) and the KV cache.
RESULT_TWINS = ["AttentionResult", "BlockOutput"]
OTHER_TWINS = ["KVCache"]

# Constructor sizes, the same on both sides.
SIZES = {
    "Linear": dict(in_features=12, out_features=8),
    "LayerNorm": dict(normalized_shape=16),
    "FeedForward": dict(d_model=16, d_ff=40, activation="gelu"),
    "MultiHeadAttention": dict(d_model=16, num_heads=4),
    "TransformerBlock": dict(d_model=16, num_heads=4, d_ff=40),
}

# Constructor parameters only one side has, with the reason.
CTOR_ONLY_TORCH = {
    "device": "torch parameters live on a device; NumPy arrays are on the CPU",
    "dtype": "torch modules take a factory dtype; NumPy modules convert with Module.astype",
}
# MultiHeadAttention and TransformerBlock also run context-parallel (attnkit.torch.distributed).
CTOR_ONLY_TORCH_CONTEXT_PARALLEL = {
    **CTOR_ONLY_TORCH,
    "context_parallel": "sequence sharded over torch.distributed ranks; NumPy has no process groups",
}
CTOR_ONLY_TORCH_KVCACHE = {
    "device": "the torch cache's buffers live on a device",
}
# Parameters both have with a different default, with the reason.
CTOR_DEFAULT_DIFFERS = {
    ("KVCache", "dtype"): "each side's float32 (np.float32 vs torch.float32)",
}
# Call parameters only one side has, with the reason (none today: both twins decode
# through a KV cache).
CALL_ONLY_TORCH: dict[str, dict[str, str]] = {}
# Call parameters named differently, with the reason.
CALL_RENAMED = {
    "Linear": {"x": ("input", "the torch twin inherits torch.nn.Linear.forward(input)")},
    "LayerNorm": {"x": ("input", "the torch twin inherits torch.nn.LayerNorm.forward(input)")},
}
# Methods with different signatures, with the reason (none today).
METHOD_DIFFERS: dict[tuple[str, str], str] = {}


def _params(fn) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _compare_signatures(name, nn_fn, torch_fn, only_torch, renamed=None, default_differs=()):
    renamed = renamed or {}
    nn_params = _params(nn_fn)
    torch_params = [p for p in _params(torch_fn) if p.name not in only_torch]
    assert [p.name for p in _params(torch_fn) if p.name in only_torch] == list(only_torch), (
        f"{name}: the allowed torch-only parameters {list(only_torch)} are gone or moved; update the test"
    )
    assert len(nn_params) == len(torch_params), (
        f"{name}: nn {[p.name for p in nn_params]} vs torch {[p.name for p in torch_params]}"
    )
    for a, b in zip(nn_params, torch_params):
        expected = renamed.get(a.name, (a.name,))[0]
        assert b.name == expected, f"{name}: parameter {a.name!r} (nn) vs {b.name!r} (torch)"
        assert a.kind == b.kind, f"{name}.{a.name}: kind {a.kind} (nn) vs {b.kind} (torch)"
        if a.name not in default_differs:
            assert a.default == b.default, f"{name}.{a.name}: default {a.default!r} (nn) vs {b.default!r} (torch)"


# ----- which pairs --------------------------------------------------------------------------


def test_every_twin_pair_is_covered():
    common = set(_public_classes(ann)) & set(_public_classes(at))
    assert common == set(MODULE_TWINS + RESULT_TWINS + OTHER_TWINS)


@pytest.mark.parametrize("name", RESULT_TWINS)
def test_result_twins_have_the_same_fields(name):
    assert getattr(ann, name)._fields == getattr(at, name)._fields


# ----- signatures and state dicts -----------------------------------------------------------


@pytest.mark.parametrize("name", MODULE_TWINS)
def test_same_constructor_signature(name):
    only_torch = CTOR_ONLY_TORCH_CONTEXT_PARALLEL if name in ("MultiHeadAttention", "TransformerBlock") \
        else CTOR_ONLY_TORCH
    _compare_signatures(name, getattr(ann, name).__init__, getattr(at, name).__init__, only_torch)


def test_kv_cache_constructor_and_methods():
    _compare_signatures("KVCache", ann.KVCache.__init__, at.KVCache.__init__, CTOR_ONLY_TORCH_KVCACHE,
                        default_differs={"dtype"})
    assert ann.KVCache.__init__.__defaults__ is None  # dtype is keyword-only on both sides
    assert np.dtype(inspect.signature(ann.KVCache).parameters["dtype"].default) == np.float32
    assert inspect.signature(at.KVCache).parameters["dtype"].default == torch.float32
    shared = {m for m in dir(ann.KVCache) if not m.startswith("_")} & {m for m in dir(at.KVCache) if not m.startswith("_")}
    for method in sorted(shared):
        a, b = getattr(ann.KVCache, method), getattr(at.KVCache, method)
        if not callable(a) or not callable(b) or ("KVCache", method) in METHOD_DIFFERS:
            continue
        assert [p.name for p in _params(a)] == [p.name for p in _params(b)], f"KVCache.{method}"
    assert "mask" in shared and "update" in shared and "add_padding" in shared
    for a, b in zip(_params(ann.KVCache.mask), _params(at.KVCache.mask)):
        assert (a.name, a.kind, a.default) == (b.name, b.kind, b.default)


@pytest.mark.parametrize("name", MODULE_TWINS)
def test_same_call_signature(name):
    _compare_signatures(name, getattr(ann, name).forward, getattr(at, name).forward,
                        CALL_ONLY_TORCH.get(name, {}), CALL_RENAMED.get(name))


@pytest.mark.parametrize("name", MODULE_TWINS)
@pytest.mark.parametrize("seed", [None, 0])
def test_same_state_dict_keys_and_shapes(name, seed):
    sizes = dict(SIZES[name])
    if name not in ("LayerNorm",):
        sizes["seed"] = seed
    ours = getattr(ann, name)(**sizes)
    theirs = getattr(at, name)(**sizes)
    a = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    b = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert list(a) == list(b)
    assert a == b


def test_same_state_dict_gqa_and_cross_attention():
    for sizes in (dict(d_model=16, num_heads=4, num_kv_heads=2), dict(d_model=16, num_heads=2, kdim=6, vdim=10),
                  dict(d_model=16, num_heads=2, bias=False)):
        a = {k: v.shape for k, v in ann.MultiHeadAttention(**sizes).state_dict().items()}
        b = {k: tuple(v.shape) for k, v in at.MultiHeadAttention(**sizes).state_dict().items()}
        assert a == b, sizes


# ----- outputs: eval mode --------------------------------------------------------------------


def _inputs(name, seed=1):
    rng = np.random.default_rng(seed)
    width = 12 if name == "Linear" else 16
    return (rng.standard_normal((2, 6, width)),), {}


def _twins(name, dropout=None, **extra):
    """(NumPy float32, torch float32, NumPy float64, torch float64), one set of weights."""
    sizes = dict(SIZES[name], **extra)
    if dropout is not None:
        sizes["dropout"] = dropout
    if name != "LayerNorm":
        sizes["seed"] = 0
    ours = getattr(ann, name)(**sizes)
    if name == "LayerNorm":  # starts at ones / zeros: make the affine part matter
        rng = np.random.default_rng(2)
        ours.load_state_dict({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in ours.state_dict().items()})
    theirs = at.interop.from_numpy(ours)
    truth = at.interop.to_numpy(theirs).astype(np.float64)
    theirs64 = at.interop.from_numpy(truth)
    assert {p.dtype for p in theirs.parameters()} == {torch.float32}
    assert {p.dtype for p in theirs64.parameters()} == {torch.float64}
    assert not theirs.training and not theirs64.training
    return ours, theirs, truth, theirs64


def _out(result):
    if isinstance(result, tuple):
        return [_np(r) for r in result]
    return [_np(result)]


def _np(x):
    if x is None:
        return None
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _run(module, args, kwargs, dtype):
    if isinstance(module, torch.nn.Module):
        targs = [torch.from_numpy(np.asarray(a, dtype=dtype)) for a in args]
        with torch.no_grad():
            return _out(module(*targs, **kwargs))
    return _out(module(*[np.asarray(a, dtype=dtype) for a in args], **kwargs))


EVAL_CASES = [
    ("Linear", {}),
    ("LayerNorm", {}),
    ("FeedForward", {}),
    ("MultiHeadAttention", {}),
    ("MultiHeadAttention", {"need_weights": True}),
    ("MultiHeadAttention", {"need_weights": True, "average_attn_weights": False, "is_causal": True}),
    ("TransformerBlock", {}),
    ("TransformerBlock", {"need_weights": True, "is_causal": True}),
]


@pytest.mark.parametrize("name,kwargs", EVAL_CASES, ids=[f"{n}-{'-'.join(k) or 'plain'}" for n, k in EVAL_CASES])
def test_equal_outputs_eval(name, kwargs):
    ours, theirs, truth, theirs64 = _twins(name, dropout=0.1 if name in ("FeedForward", "MultiHeadAttention",
                                                                         "TransformerBlock") else None)
    args, _ = _inputs(name)
    want = _run(truth, args, kwargs, np.float64)
    got_nn = _run(ours, args, kwargs, np.float32)
    got_torch = _run(theirs, args, kwargs, np.float32)
    got_torch64 = _run(theirs64, args, kwargs, np.float64)
    assert len(want) == len(got_nn) == len(got_torch) == len(got_torch64)
    for i, (t, a, b, b64) in enumerate(zip(want, got_nn, got_torch, got_torch64)):
        if t is None:  # weights without need_weights
            assert a is None and b is None and b64 is None
            continue
        # truth: the NumPy twin in float64; each float32 twin within budget of the other as oracle
        assert_within_budget(a, b, t, what=f"{name}[{i}] nn float32 (oracle torch float32)")
        assert_within_budget(b, a, t, what=f"{name}[{i}] torch float32 (oracle nn float32)")
        np.testing.assert_allclose(b64, t, rtol=1e-10, atol=1e-12 * max(1.0, float(np.abs(t).max())))


def test_cross_attention_and_masks_eval():
    rng = np.random.default_rng(3)
    ours, theirs, truth, theirs64 = _twins("MultiHeadAttention", kdim=6, vdim=10, num_kv_heads=2)
    q, k, v = rng.standard_normal((2, 4, 16)), rng.standard_normal((2, 7, 6)), rng.standard_normal((2, 7, 10))
    key_mask = np.ones((2, 7), bool)
    key_mask[1, 5:] = False
    kw_np = dict(key_mask=key_mask, need_weights=True)
    kw_t = dict(key_mask=torch.from_numpy(key_mask), need_weights=True)
    want = [np.asarray(r) for r in truth(q, k, v, **kw_np)]
    got_nn = [np.asarray(r) for r in ours(*(x.astype(np.float32) for x in (q, k, v)), **kw_np)]
    with torch.no_grad():
        got_t = [_np(r) for r in theirs(*(torch.from_numpy(x.astype(np.float32)) for x in (q, k, v)), **kw_t)]
    for i, (t, a, b) in enumerate(zip(want, got_nn, got_t)):
        assert_within_budget(a, b, t, what=f"cross[{i}] nn float32 (oracle torch float32)")
        assert_within_budget(b, a, t, what=f"cross[{i}] torch float32 (oracle nn float32)")


# ----- outputs: decoding through a KV cache ---------------------------------------------------


def _decode(module, x, real, dtype, **kwargs):
    """Prompt (first 3 positions) then one position at a time through the module's own
    `new_kv_cache()`, left padding marked with `add_padding`; the steps' outputs, concatenated."""
    B, T, _ = x.shape
    cache = (module.attn if hasattr(module, "attn") else module).new_kv_cache(B, T)
    as_input = (lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))) if isinstance(
        module, torch.nn.Module) else (lambda a: np.asarray(a, dtype=dtype))
    outs = []
    with torch.no_grad():
        for start, stop in [(0, 3)] + [(t, t + 1) for t in range(3, T)]:
            cache.add_padding(as_input(real[:, start:stop]) if not isinstance(module, torch.nn.Module)
                              else torch.from_numpy(real[:, start:stop]))
            out = module(as_input(x[:, start:stop]), is_causal=True, kv_cache=cache, **kwargs)
            outs.append(_np(out.output if hasattr(out, "output") else out))
    assert cache.length == T
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", ["MultiHeadAttention", "TransformerBlock"])
def test_equal_outputs_with_a_kv_cache(name):
    extra = {"num_kv_heads": 2} if name == "MultiHeadAttention" else {}
    ours, theirs, truth, _ = _twins(name, **extra)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 7, 16))
    real = np.ones((2, 7), bool)
    real[1, :2] = False  # sequence 1 is left-padded by two
    want = _decode(truth, x, real, np.float64)
    got_nn = _decode(ours, x, real, np.float32)
    got_torch = _decode(theirs, x, real, np.float32)
    keep = real[:, :, None]  # padded queries' rows are not compared (no key may be seen)
    assert_within_budget(np.where(keep, got_nn, 0), np.where(keep, got_torch, 0), np.where(keep, want, 0),
                         what=f"{name} decode nn float32 (oracle torch float32)")
    assert_within_budget(np.where(keep, got_torch, 0), np.where(keep, got_nn, 0), np.where(keep, want, 0),
                         what=f"{name} decode torch float32 (oracle nn float32)")
    # step by step equals the full causal forward with the same padding (float64, both twins)
    full = truth(x, is_causal=True, key_mask=real)
    full = full.output if hasattr(full, "output") else full
    np.testing.assert_allclose(np.where(keep, want, 0), np.where(keep, full, 0), rtol=1e-10, atol=1e-12)


def test_kv_cache_is_for_self_attention_only_on_both_sides():
    ours, theirs, _, _ = _twins("MultiHeadAttention")
    x = np.zeros((1, 2, 16), np.float32)
    messages = []
    for module, arr in ((ours, x), (theirs, torch.from_numpy(x))):
        with pytest.raises(ValueError, match="kv_cache is for self-attention") as info:
            module(arr, arr, arr, kv_cache=module.new_kv_cache(1, 4))
        messages.append(str(info.value))
    assert messages[0] == messages[1]


# ----- outputs: train mode with dropout ---------------------------------------------------------


def _attention_from_weights(module_np64, x, weights):
    """out_proj(merge(weights @ v)) with weights (B, H, L, S): the output the returned
    weights imply, computed in float64 from the NumPy twin's parameters."""
    sd = module_np64.state_dict()
    B, L, _ = x.shape
    H, E = module_np64.num_heads, module_np64.head_dim
    v = x @ sd["v_proj.weight"].T + sd["v_proj.bias"]
    v = v.reshape(B, L, H, E).transpose(0, 2, 1, 3)
    heads = weights @ v
    merged = heads.transpose(0, 2, 1, 3).reshape(B, L, H * E)
    return merged @ sd["out_proj.weight"].T + sd["out_proj.bias"]


@pytest.mark.parametrize("side", ["nn", "torch"])
def test_train_mode_weights_are_after_dropout(side):
    """Both twins return the weights after dropout, the ones the output is formed with
    (torch.nn.MultiheadAttention's convention). The masks differ (two RNGs), so each
    twin is checked against its own returned weights."""
    p = 0.5
    ours, _, truth, theirs64 = _twins("MultiHeadAttention", dropout=p)
    x = np.random.default_rng(4).standard_normal((2, 6, 16))
    eval_w = np.asarray(truth(x, need_weights=True, average_attn_weights=False).weights)  # (B, H, L, S)
    if side == "nn":
        module = truth.train()
        module.set_rng(0)
        out, w = module(x, need_weights=True, average_attn_weights=False)
    else:
        module = theirs64.train()
        torch.manual_seed(0)
        with torch.no_grad():
            out, w = module(torch.from_numpy(x), need_weights=True, average_attn_weights=False)
        out, w = _np(out), _np(w)
    dropped = w == 0
    assert 0.3 < dropped.mean() < 0.7  # about p of 288 weights zeroed
    np.testing.assert_allclose(w[~dropped], eval_w[~dropped] / (1 - p), rtol=1e-12)
    np.testing.assert_allclose(out, _attention_from_weights(truth, x, w), rtol=1e-10, atol=1e-12)


def _train_mean(module, x, draws):
    total = None
    sq = None
    for _ in range(draws):
        if isinstance(module, torch.nn.Module):
            with torch.no_grad():
                y = module(torch.from_numpy(x))
        else:
            y = module(x)
        y = _np(y[0] if isinstance(y, tuple) else y)
        total = y if total is None else total + y
        sq = y * y if sq is None else sq + y * y
    mean = total / draws
    return mean, np.sqrt(np.maximum(sq / draws - mean * mean, 0.0) / draws)


@pytest.mark.parametrize("name", ["FeedForward", "MultiHeadAttention", "TransformerBlock"])
def test_train_mode_statistics(name):
    """Train mode with dropout: no shared mask is possible (numpy Generator vs torch's
    RNG), so compare the mean over many draws, per element, within 6 combined
    standard errors, and check that dropout is on in both (draws differ)."""
    ours, _, truth, theirs64 = _twins(name, dropout=0.2)
    x = np.random.default_rng(5).standard_normal((1, 4, 16))
    truth.train().set_rng(0)
    theirs64.train()
    torch.manual_seed(0)
    draws = 300
    m_nn, se_nn = _train_mean(truth, x, draws)
    m_t, se_t = _train_mean(theirs64, x, draws)
    assert se_nn.max() > 0 and se_t.max() > 0  # dropout ran on both sides
    bound = 6 * np.sqrt(se_nn**2 + se_t**2) + 1e-12
    assert np.all(np.abs(m_nn - m_t) <= bound), float(np.max(np.abs(m_nn - m_t) / bound))


# ----- one spec: the same checks and messages on both sides (attnkit.nn.spec) --------------------


def _message(fn):
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


BAD_CALLS = [
    ("query 2-D", lambda x: (x[0],), {}),
    ("value without key", lambda x: (x, None, x), {}),
    ("key batch", lambda x: (x, x[:1]), {}),
    ("value length", lambda x: (x, x, x[:, :2]), {}),
    ("is_causal", lambda x: (x,), {"is_causal": 1}),
    ("key_mask shape", lambda x: (x,), {"key_mask": np.ones((2, 5), bool)}),
    ("attn_mask 3-D", lambda x: (x,), {"attn_mask": np.ones((8, 6, 6), bool)}),
    ("attn_mask shape", lambda x: (x,), {"attn_mask": np.ones((6, 5), bool)}),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_same_errors_and_messages(case):
    _, make_args, kwargs = case
    ours = ann.MultiHeadAttention(16, 4, seed=0)
    theirs = at.MultiHeadAttention(16, 4, seed=0)
    x = np.random.default_rng(0).standard_normal((2, 6, 16)).astype(np.float32)
    tkw = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    a = _message(lambda: ours(*make_args(x), **kwargs))
    b = _message(lambda: theirs(*[None if t is None else torch.from_numpy(np.ascontiguousarray(t))
                                  for t in make_args(x)], **tkw))
    assert a is not None and a == b


@pytest.mark.parametrize("bad", [-0.1, 1.0, True, "0.1", None])
def test_same_dropout_validation(bad):
    for name in ("FeedForward", "MultiHeadAttention", "TransformerBlock"):
        sizes = {k: v for k, v in SIZES[name].items()}
        a = _message(lambda: getattr(ann, name)(**sizes, dropout=bad))
        b = _message(lambda: getattr(at, name)(**sizes, dropout=bad))
        assert a == b == ("ValueError", f"expected dropout to be a float in [0, 1), got {bad!r}")


@pytest.mark.parametrize("name", ["FeedForward", "MultiHeadAttention", "TransformerBlock"])
def test_same_extra_repr(name):
    extras = [{}, {"dropout": 0.25}]
    if name == "MultiHeadAttention":
        extras += [{"num_kv_heads": 2, "kdim": 6, "vdim": 10}]
    for extra in extras:
        sizes = dict(SIZES[name], **extra)
        assert getattr(ann, name)(**sizes).extra_repr() == getattr(at, name)(**sizes).extra_repr()


def test_spec_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, attnkit.nn.spec; assert 'torch' not in sys.modules, 'attnkit.nn.spec imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
