"""One signature for every attention backend, and the KV cache that uses it.

Every registered backend takes SDPA's positional arguments and the keywords
causal_align, window, key_padding_mask, score_mod, mask_mod (attnkit.functional).
Each keyword, on each backend, is checked against a float64 dense reference
(truth) and torch in float32 given the same thing as an explicit dense mask or
bias (oracle), with `assert_within_budget`. The KV cache hands the backend
is_causal + causal_align="bottom_right" + key_padding_mask, never a dense mask:
a spy on flash proves it, and naive and flash agree through a padded GQA cache.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from conftest import assert_within_budget, reference_attention

from attnkit import nn
from attnkit.functional import (
    ATTENTION_BACKENDS,
    AttentionOutput,
    BACKEND_KEYWORDS,
    WEIGHTLESS_BACKENDS,
    get_attention,
    masks,
    mods,
    register_attention,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)

B, HQ, HKV, L, S, E = 2, 4, 2, 5, 11, 8
BACKENDS = ["naive", "flash"]


def _inputs(seed=0, L=L, S=S):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, HQ, L, E))
    k = rng.standard_normal((B, HKV, S, E))
    v = rng.standard_normal((B, HKV, S, E))
    padding = np.ones((B, S), bool)
    padding[1, :3] = False  # sequence 1 is left-padded by three
    padding[0, -1] = False  # and one key of sequence 0 is padding
    return q, k, v, padding


def _dense(kw, L=L, S=S):
    """(bool mask (B, HQ, L, S), score_mod or None) that the keywords stand for, from
    attnkit.masks / mods' dense forms (float64, no flash involved)."""
    allowed = np.ones((B, HQ, L, S), bool)
    align = kw.get("causal_align", "top_left")
    if kw.get("is_causal"):
        allowed &= masks.causal_mask(L, S, align=align)
    if kw.get("window") is not None:
        left, right = (kw["window"], 0) if isinstance(kw["window"], int) else kw["window"]
        right_ok = np.ones((L, S), bool) if right is None else masks.sliding_window_mask(L, S, right=right, align=align)
        left_ok = masks.sliding_window_mask(L, S, left=left, right=S, align=align) if left is not None else True
        allowed &= right_ok & left_ok
    if kw.get("key_padding_mask") is not None:
        allowed &= np.broadcast_to(kw["key_padding_mask"], (B, S))[:, None, None, :]
    if kw.get("mask_mod") is not None:
        allowed &= mods.create_mask(kw["mask_mod"], B, HQ, L, S)
    return allowed


def _truth_and_oracle(torch, q, k, v, kw):
    """float64 truth (plain NumPy) and torch float32 with the same dense mask and score mod."""
    allowed = _dense(kw, q.shape[-2], k.shape[-2])
    score_mod = kw.get("score_mod")
    group = HQ // HKV
    if score_mod is None:
        truth = reference_attention(q, k, v, allowed, gqa_group=group)[0]
    else:
        scores = np.einsum("bhle,bhse->bhls", q, np.repeat(k, group, axis=1)) / np.sqrt(E)
        bias = mods.apply_score_mod(score_mod, scores) - scores  # what the mod adds, float64
        truth = reference_attention(q, k, v, np.where(allowed, bias, -np.inf), gqa_group=group)[0]
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)) for x in (q, k, v))
    tk, tv = tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1)
    scores = (tq / np.sqrt(E)) @ tk.transpose(-1, -2)  # (B, HQ, L, S) float32
    if score_mod is not None:
        bound = score_mod.bind(q.shape[-2], k.shape[-2])
        scores = torch.stack([torch.stack([torch.from_numpy(np.asarray(
            bound(scores[b, h].numpy().copy(), b, h, np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]),
            dtype=np.float32)) for h in range(HQ)]) for b in range(B)])
    scores = scores.masked_fill(~torch.from_numpy(allowed), -torch.inf)
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # a fully masked row gives 0
    oracle = (weights @ tv).numpy()
    return truth, oracle


CASES = [
    dict(is_causal=True, causal_align="top_left"),
    dict(is_causal=True, causal_align="bottom_right"),
    dict(window=3),
    dict(window=(2, 1), causal_align="bottom_right"),
    dict(window=(None, 0), causal_align="bottom_right"),
    dict(is_causal=True, window=4, causal_align="bottom_right"),
    dict(key_padding_mask="padding"),
    dict(key_padding_mask="padding", is_causal=True, causal_align="bottom_right"),
    dict(key_padding_mask="padding", window=(3, 2)),
    dict(mask_mod=mods.causal("bottom_right")),
    dict(mask_mod=mods.document(np.array([0, 0, 0, 1, 1]), np.array([0] * 6 + [1] * 5))),
    dict(score_mod=mods.softcap(1.5)),
    dict(score_mod=mods.alibi(HQ, align="bottom_right"), is_causal=True, causal_align="bottom_right"),
    dict(score_mod=mods.softcap(2.0), mask_mod=mods.sliding_window(2), key_padding_mask="padding"),
]


def _case_id(kw):
    return "-".join(f"{k}={v if not callable(v) else type(v).__name__}" for k, v in kw.items() if k != "enable_gqa")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", CASES, ids=[_case_id(c) for c in CASES])
def test_every_keyword_on_every_backend(torch, backend, kw):
    q, k, v, padding = _inputs()
    kw = {name: (padding if isinstance(value, str) and value == "padding" else value) for name, value in kw.items()}
    truth, oracle = _truth_and_oracle(torch, q, k, v, kw)
    fn = get_attention(backend)
    for L_here in (L, 1):  # a prompt chunk, and a decode step (flash's plain-kernel case)
        qq = q[:, :, -L_here:]
        t, o = (truth, oracle) if L_here == L else _truth_and_oracle(torch, qq, k, v, kw)
        got = fn(*(x.astype(np.float32) for x in (qq, k, v)), enable_gqa=True, **kw)
        assert got.dtype == np.float32
        assert_within_budget(got, o, t, what=f"{backend} L={L_here} {_case_id(kw)}")
        got64 = fn(qq, k, v, enable_gqa=True, **kw)
        np.testing.assert_allclose(got64, t, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_padding_mask_broadcasts_over_batch_dims_and_flattens(backend):
    q, k, v, padding = _inputs(1)
    one = padding[:1]  # (1, S) broadcasts over the batch
    got = get_attention(backend)(q, k, v, enable_gqa=True, key_padding_mask=one)
    want = reference_attention(q, k, v, one[:, None, None, :], gqa_group=HQ // HKV)[0]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    # (L, E) inputs take an (S,) key mask
    got = get_attention(backend)(q[0, 0], k[0, 0], v[0, 0], key_padding_mask=padding[1])
    want = reference_attention(q[0, :1], k[0, :1], v[0, :1], padding[1][None, :])[0][0]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_a_fully_padded_row_gives_zero_on_every_backend():
    q, k, v, _ = _inputs(2)
    nothing = np.zeros((B, S), bool)
    for backend in BACKENDS:
        out = get_attention(backend)(q, k, v, enable_gqa=True, is_causal=True, causal_align="bottom_right",
                                     key_padding_mask=nothing)
        assert np.array_equal(out, np.zeros_like(out)), backend


# ----- the backward takes the same keywords --------------------------------------------------


BACKWARD_CASES = [
    dict(is_causal=True, causal_align="bottom_right", key_padding_mask="padding"),
    dict(window=(2, 1)),
    dict(mask_mod=mods.causal("bottom_right")),
    dict(score_mod=mods.softcap(1.5), is_causal=True),
    dict(score_mod=mods.alibi(HQ), key_padding_mask="padding"),
]


@pytest.mark.parametrize("kw", BACKWARD_CASES, ids=[_case_id(c) for c in BACKWARD_CASES])
def test_backward_takes_the_keywords_and_matches_torch_autograd(torch, kw):
    q, k, v, padding = _inputs(3)
    kw = {name: (padding if isinstance(value, str) and value == "padding" else value) for name, value in kw.items()}
    d_out = np.random.default_rng(4).standard_normal((B, HQ, L, E))
    grads = scaled_dot_product_attention_backward(d_out, q, k, v, enable_gqa=True, **kw)
    # torch autograd in float64 through the dense form of the same keywords
    allowed = torch.from_numpy(_dense(kw))
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    group = HQ // HKV
    scores = (tq / np.sqrt(E)) @ tk.repeat_interleave(group, dim=1).transpose(-1, -2)
    mod = kw.get("score_mod")
    if isinstance(mod, mods.ScoreMod) and mod.name.startswith("softcap"):
        scores = 1.5 * torch.tanh(scores / 1.5)
    elif mod is not None:  # alibi: a bias
        bias = mods.score_bias(mod, B, HQ, L, S)
        scores = scores + torch.from_numpy(bias)
    weights = torch.nan_to_num(torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1), nan=0.0)
    (weights @ tv.repeat_interleave(group, dim=1)).backward(torch.from_numpy(d_out))
    for ours, theirs, name in zip(grads, (tq, tk, tv), ("query", "key", "value")):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def test_backward_refuses_a_score_mod_without_its_derivative():
    q, k, v, _ = _inputs()
    with pytest.raises(TypeError, match="derivative of score_mod"):
        scaled_dot_product_attention_backward(np.ones((B, HQ, L, E)), q, k, v, enable_gqa=True,
                                              score_mod=lambda s, b, h, qi, ki: s * 2)


# ----- refused clearly ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_keyword_and_bad_key_padding_mask_are_refused(backend):
    q, k, v, padding = _inputs()
    fn = get_attention(backend)
    with pytest.raises(TypeError, match="unexpected keyword argument 'key_paddng_mask'"):
        fn(q, k, v, enable_gqa=True, key_paddng_mask=padding)  # a typo is not silently ignored
    with pytest.raises(ValueError, match=r"key_padding_mask of shape \(\.\.\., S\) with S=11.*got \(2, 10\)"):
        fn(q, k, v, enable_gqa=True, key_padding_mask=padding[:, :10])
    with pytest.raises(ValueError, match=r"key_padding_mask of shape .*got \(3, 11\)"):
        fn(q, k, v, enable_gqa=True, key_padding_mask=np.ones((3, S), bool))
    with pytest.raises(TypeError, match="key_padding_mask to be boolean.*got dtype float64"):
        fn(q, k, v, enable_gqa=True, key_padding_mask=padding.astype(float))
    with pytest.raises(ValueError, match="causal_align to be one of"):
        fn(q, k, v, enable_gqa=True, is_causal=True, causal_align="bottom-right")
    with pytest.raises(TypeError, match="window as an int"):
        fn(q, k, v, enable_gqa=True, window=(1, 2, 3))
    with pytest.raises(ValueError, match="both attn_mask and is_causal"):
        fn(q, k, v, np.ones((L, S), bool), is_causal=True, enable_gqa=True)


def test_every_backend_has_the_one_signature():
    from attnkit.functional.backends import supports

    for name, fn in ATTENTION_BACKENDS.items():
        params = inspect.signature(fn).parameters
        positional = [p.name for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                              "enable_gqa"], name
        keyword_only = [p.name for p in params.values() if p.kind is p.KEYWORD_ONLY]
        # a backend with the table's `sinks` capability takes that one keyword more
        sinks = {"sinks"} if supports(name, "sinks") else set()
        assert set(keyword_only) == set(BACKEND_KEYWORDS) - set(positional) | sinks, name
        defaults = {p.name: p.default for p in params.values() if p.kind is p.KEYWORD_ONLY}
        assert defaults == dict(causal_align="top_left", window=None, key_padding_mask=None, score_mod=None,
                                mask_mod=None, rng=None, return_weights=False, return_lse=False,
                                **dict.fromkeys(sinks)), name


@pytest.fixture
def clean_registry():
    """Forget the backend "mine" after the test."""
    yield
    ATTENTION_BACKENDS.pop("mine", None)
    WEIGHTLESS_BACKENDS.discard("mine")


def test_register_attention_validates_and_registers(clean_registry):

    def old_style(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, *, rng=None, return_weights=False, return_lse=False):
        return scaled_dot_product_attention(query, key, value)

    with pytest.raises(TypeError, match=r"missing \['causal_align', 'window', 'key_padding_mask'"):
        register_attention("old", old_style)
    with pytest.raises(ValueError, match="'flash' is built in"):
        register_attention("flash", scaled_dot_product_attention)
    with pytest.raises(TypeError, match="callable"):
        register_attention("mine", 3)
    with pytest.raises(ValueError, match="non-empty str"):
        register_attention("", scaled_dot_product_attention)

    calls = []

    def mine(query, key, value, *args, **kwargs):  # **kwargs takes every keyword
        calls.append(kwargs)
        return scaled_dot_product_attention(query, key, value, *args, **kwargs)

    register_attention("mine", mine, weightless=True)
    assert get_attention("mine").__wrapped__ is mine and "mine" in WEIGHTLESS_BACKENDS
    register_attention("mine", mine)  # re-registering replaces, and clears weightless
    assert "mine" not in WEIGHTLESS_BACKENDS
    module = nn.MultiHeadAttention(16, 4, num_kv_heads=2, seed=0)
    module.backend = "mine"
    cache = module.new_kv_cache(1, 4)
    module(np.ones((1, 3, 16), np.float32), is_causal=True, kv_cache=cache)
    assert calls and calls[-1]["causal_align"] == "bottom_right" and calls[-1]["is_causal"] is True


# ----- a registered backend's results are checked at the registry ------------------------------


def _transposed(query, key, value, *args, return_weights=False, return_lse=False, **kwargs):
    """Returns (B, L, H, E), the layout of another library, instead of (B, H, L, E)."""
    result = scaled_dot_product_attention(query, key, value, *args, return_weights=return_weights,
                                          return_lse=return_lse, **kwargs)
    if return_weights or return_lse:
        return result._replace(output=np.swapaxes(result.output, -2, -3))
    return np.swapaxes(result, -2, -3)


def _no_weights(query, key, value, *args, return_weights=False, return_lse=False, **kwargs):
    """Ignores return_weights: gives an AttentionOutput with weights None when asked."""
    out = scaled_dot_product_attention(query, key, value, *args, **kwargs)
    return AttentionOutput(out, None, None) if return_weights or return_lse else out


def _output_only(query, key, value, *args, return_weights=False, return_lse=False, **kwargs):
    """Ignores return_weights: gives the bare output."""
    return scaled_dot_product_attention(query, key, value, *args, **kwargs)


def _float64(query, key, value, *args, **kwargs):
    """Computes in float64 and forgets to round back to the inputs' dtype."""
    return scaled_dot_product_attention(*(np.asarray(x, np.float64) for x in (query, key, value)), *args, **kwargs)


def _short_weights(query, key, value, *args, **kwargs):
    """Weights (..., H, L, S - 1), the last key dropped, when asked."""
    result = scaled_dot_product_attention(query, key, value, *args, **kwargs)
    if isinstance(result, AttentionOutput) and result.weights is not None:
        return result._replace(weights=result.weights[..., :-1])
    return result


BAD_BACKENDS = {  # name: (fn, error type, what the message says)
    "transposed": (_transposed, ValueError, r"'mine' to return output of shape \(\.\.\., Hq, L, Ev\) = "
                                            r"\(2, 4, 3, 4\) .*got \(2, 3, 4, 4\)"),
    "no weights": (_no_weights, TypeError, r"'mine' to return weights as an array of shape \(\.\.\., Hq, L, S\)"
                                           r" = \(2, 4, 3, 3\), got None"),
    "output only": (_output_only, TypeError, r"'mine' to return an AttentionOutput.* for return_weights=True, "
                                             r"got ndarray"),
    "float64": (_float64, TypeError, r"'mine' to return output of dtype float32 like its inputs, got float64"),
    "short weights": (_short_weights, ValueError, r"'mine' to return weights of shape .* = \(2, 4, 3, 3\) "
                                                   r".*got \(2, 4, 3, 2\)"),
}


@pytest.mark.parametrize("bad", list(BAD_BACKENDS))
def test_a_misbehaving_backend_is_refused_through_a_module_and_a_recording(clean_registry, bad):
    import attnkit

    fn, error, message = BAD_BACKENDS[bad]
    register_attention("mine", fn)
    module = nn.MultiHeadAttention(16, 4, seed=0)
    module.set_attention_backend("mine")
    x = np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)
    if bad in ("transposed", "float64"):  # wrong in every call
        with pytest.raises(error, match=message):
            module(x)
    else:  # wrong only when weights are asked for: plain calls work
        module(x)
    with pytest.raises(error, match=message):
        with attnkit.record_attention(module):
            module(x)


def test_a_well_behaved_backend_passes_the_check_unchanged(clean_registry):
    import attnkit

    register_attention("mine", scaled_dot_product_attention)
    q, k, v, padding = _inputs()
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    mine = get_attention("mine")
    assert mine is not scaled_dot_product_attention and mine.__wrapped__ is scaled_dot_product_attention
    assert get_attention("naive") is scaled_dot_product_attention  # built-ins are not wrapped
    expected = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    np.testing.assert_array_equal(mine(q, k, v, enable_gqa=True), expected)
    both = mine(q, k, v, enable_gqa=True, key_padding_mask=padding, return_weights=True, return_lse=True)
    assert both.weights.shape == (B, HQ, L, S) and both.lse.shape == (B, HQ, L)
    module = nn.MultiHeadAttention(16, 4, seed=0)
    module.set_attention_backend("mine")
    with attnkit.record_attention(module) as recording:
        module(np.ones((1, 3, 16), np.float32))
    assert len(recording) == 1 and recording[0].shape == (1, 4, 3, 3)
    # a backend returning an lse of the wrong shape, or a tuple when nothing extra is asked
    register_attention("mine", lambda q, k, v, *a, **kw: AttentionOutput(scaled_dot_product_attention(q, k, v),
                                                                         None, np.zeros(3)))
    with pytest.raises(TypeError, match=r"'mine' to return the output array alone"):
        get_attention("mine")(q, q, q)
    with pytest.raises(ValueError, match=r"'mine' to return lse of shape \(\.\.\., Hq, L\) = \(2, 4, 5\)"):
        get_attention("mine")(q, q, q, return_lse=True)


# ----- the KV cache hands flash its band ---------------------------------------------------------


@pytest.fixture
def flash_spy(monkeypatch):
    """Every call to flash_attention (inside the flash backend) and to the flash backend."""
    import attnkit.functional.flash as flash_module

    kernel_calls, backend_calls = [], []
    real_kernel, real_backend = flash_module.flash_attention, ATTENTION_BACKENDS["flash"]

    def kernel(*args, **kwargs):
        kernel_calls.append((args, kwargs))
        return real_kernel(*args, **kwargs)

    def backend(*args, **kwargs):
        backend_calls.append((args, kwargs))
        return real_backend(*args, **kwargs)

    monkeypatch.setattr(flash_module, "flash_attention", kernel)
    monkeypatch.setitem(ATTENTION_BACKENDS, "flash", backend)
    return kernel_calls, backend_calls


def test_the_cache_gives_flash_its_band_and_no_dense_mask(flash_spy):
    kernel_calls, backend_calls = flash_spy
    q, k, v, padding = _inputs(5, L=S, S=S)
    cache = nn.KVCache(1, B, HKV, E, S, dtype=np.float64)
    cache.add_padding(padding[:, :6])
    cache.attend(0, q[:, :, :6], k[:, :, :6], v[:, :, :6], backend="flash")  # a prompt chunk, L=6
    cache.add_padding(padding[:, 6:7])
    cache.attend(0, q[:, :, 6:7], k[:, :, 6:7], v[:, :, 6:7], backend="flash")  # a decode step
    assert len(backend_calls) == 2
    for args, kwargs in backend_calls:
        assert len(args) == 3 and "attn_mask" not in kwargs  # no dense mask
        assert kwargs["is_causal"] is True and kwargs["causal_align"] == "bottom_right"
        assert kwargs["key_padding_mask"].shape == (B, cache.length if args is backend_calls[-1][0] else 6)
    # the chunk ran the tiled kernel with the band (is_causal, bottom_right) and no attn_mask
    assert len(kernel_calls) == 1
    args, kwargs = kernel_calls[0]
    query, key, value, attn_mask, is_causal = args[:5]
    assert attn_mask is None and is_causal is True and kwargs["causal_align"] == "bottom_right"
    assert kwargs["mask_mod"] is not None  # the key padding, evaluated per tile


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_padded_gqa_cache_naive_and_flash_agree(dtype):
    """Prompt (a chunk), then decode steps, left-padded, GQA: flash within budget of
    naive as oracle (float32), both equal the float64 truth in float64."""
    q, k, v, padding = _inputs(6, L=S, S=S)
    outs = {}
    for backend in ("naive", "flash", "truth"):
        cache = nn.KVCache(1, B, HKV, E, S, dtype=np.float64 if backend == "truth" else dtype)
        cast = (lambda x: x) if backend == "truth" else (lambda x: x.astype(dtype))
        parts = []
        for start, stop in [(0, 7)] + [(t, t + 1) for t in range(7, S)]:
            cache.add_padding(padding[:, start:stop])
            parts.append(cache.attend(0, *(cast(x[:, :, start:stop]) for x in (q, k, v)),
                                      backend="naive" if backend == "truth" else backend))
        outs[backend] = np.concatenate(parts, axis=2)
    dense = masks.causal_mask(S, S) & padding[:, None, None, :]
    truth = reference_attention(q, k, v, dense, gqa_group=HQ // HKV)[0]
    np.testing.assert_allclose(outs["truth"], truth, rtol=1e-10, atol=1e-12)
    if dtype == np.float64:
        np.testing.assert_allclose(outs["flash"], truth, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(outs["naive"], truth, rtol=1e-10, atol=1e-12)
    else:
        assert_within_budget(outs["flash"], outs["naive"], truth, what="flash through the cache (oracle naive)")


def test_kv_cache_mask_is_still_the_dense_form():
    cache = nn.KVCache(1, 2, 1, 4, 8)
    cache.add_padding(np.array([[True] * 5, [False, False, True, True, True]]))
    assert cache.mask(1, 5) is not None and cache.mask(1, 5).shape == (2, 1, 1, 5)
    both = cache.mask(3, 5)
    assert np.array_equal(both, masks.causal_mask(3, 5, align="bottom_right") & cache.key_padding[:, None, None, :5])
    assert np.array_equal(cache.mask(3, 5, causal=False), np.broadcast_to(cache.key_padding[:, None, None, :5],
                                                                          (2, 1, 1, 5)))
