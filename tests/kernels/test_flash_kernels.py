"""Flash attention's compiled tile loops (attnkit.kernels.flash) against float64 truth,
NumPy's float32 reference lines they replace, and torch SDPA.

The budget (docs/kernels.md, "Flash and encoder kernels"): each kernel's error against
the float64 truth is at most twice the NumPy float32 reference's on the same inputs,
plus one float32 ulp at the truth's size (the result is stored in float32: half an ulp
is unavoidable, and NumPy can round luckily to an error near zero). Whole flash calls
with the kernels follow the flash tests' rule: 2x (3x for gradients) the NumPy path's
and torch's float32 error, with the epsilon at the problem's natural size.

Without numba, or with ATTNKIT_KERNELS=numpy, the kernel-level tests skip (there is
no kernel to test; the whole-call tests then check the NumPy path against the same oracles).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnkit
from attnkit import kernels, masks
from attnkit.functional.flash import ONES_MIN_ROWS, PEAK, _make_plan
from attnkit.kernels import flash as compiled
from conftest import F32_EPS, assert_within_budget, optional, reference_attention, score_conditioning

torch = optional("torch")

needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason=f"compiled kernels off: {kernels.reason_disabled()}")


@pytest.fixture(autouse=True, scope="module")
def _started():
    """The loops start at once here (a process otherwise runs NumPy until its work pays for them)."""
    compiled.load()


def _assert_elementwise_budget(ours, numpy_ref, truth, what):
    """|ours - truth| <= 2 * (NumPy's max relative error) * |truth| + 1 ulp of truth,
    element by element; NaN and inf exactly where the truth has them."""
    ours = np.asarray(ours, np.float64)
    numpy_ref = np.asarray(numpy_ref, np.float64)
    truth = np.asarray(truth, np.float64)
    special = ~np.isfinite(truth) | (np.abs(truth) > np.finfo(np.float32).max)
    with np.errstate(invalid="ignore", over="ignore"):
        want_special = truth.astype(np.float32)
    assert np.array_equal(np.isnan(ours), np.isnan(truth)), f"{what}: NaN where the truth has none (or missing)"
    assert np.array_equal(ours[special & ~np.isnan(truth)], want_special[special & ~np.isnan(truth)]), (
        f"{what}: inf/overflow not where the truth has it")
    ok = ~special
    t = truth[ok]
    tiny = np.finfo(np.float32).tiny
    normal = np.abs(t) >= tiny
    ref_rel = float(np.max(np.abs(numpy_ref[ok][normal] - t[normal]) / np.abs(t[normal]), initial=0.0))
    ulp = np.spacing(np.abs(t).astype(np.float32)).astype(np.float64)
    budget = 2 * ref_rel * np.abs(t) + ulp
    err = np.abs(ours[ok] - t)
    worst = int(np.argmax(err - budget)) if err.size else 0
    print(f"{what}: kernel max rel {np.max(err[normal] / np.abs(t[normal]), initial=0):.2e}, NumPy {ref_rel:.2e}")
    assert (err <= budget).all(), (
        f"{what}: error {err[worst]:.3e} at truth {t[worst]:.6e} exceeds 2 x NumPy's relative error "
        f"{ref_rel:.2e} + 1 ulp (= {budget[worst]:.3e})")


def _exp_inputs(rng, n):
    """Random scores over exp's whole float32 range, and the adversarial ones."""
    special = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 1e-30, -1e-30, -87.33, -87.34, -103.0, -103.9,
                        -104.0, -150.0, -1e30, 88.72, 88.73, 89.0, 1e30, 0.3465736, -0.3465736, 0.6931472,
                        -0.6931472], dtype=np.float32)
    wide = rng.uniform(-110, 95, n).astype(np.float32)
    near = (rng.standard_normal(n) * 3).astype(np.float32)
    return np.concatenate([special, wide, near])


@needs_kernels
@pytest.mark.parametrize("n", [1, 7, 1025, 100_003])
def test_exp_tile_within_twice_numpys_error_over_the_whole_range(n):
    x = _exp_inputs(np.random.default_rng(n), n)
    ours = x.copy()
    compiled.exp_tile(ours)
    with np.errstate(over="ignore"):
        numpy_ref = np.exp(x)
        truth = np.exp(x.astype(np.float64))
    _assert_elementwise_budget(ours, numpy_ref, truth, f"exp, n={n}")


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (2, 64, 129)])
def test_shifted_exp_tile_within_twice_the_two_numpy_passes(shape):
    rng = np.random.default_rng(sum(shape))
    s = (rng.standard_normal(shape) * 30).astype(np.float32)
    s[..., 0] = -np.inf  # a masked key
    shift = s.max(axis=-1) - rng.uniform(0, 3, shape[:-1]).astype(np.float32)  # not quite the max
    s[0, 0, :] = -np.inf  # a fully masked row, shifted by 0 as the forward does
    shift[0, 0] = 0
    ours = s.copy()
    compiled.shifted_exp_tile(ours, shift)
    numpy_ref = s - shift[..., None]
    np.exp(numpy_ref, out=numpy_ref)
    with np.errstate(invalid="ignore"):
        truth = np.exp(s.astype(np.float64) - shift[..., None].astype(np.float64))
    assert (ours[0, 0] == 0).all(), "a fully masked row gives weights 0, not NaN"
    _assert_elementwise_budget(ours, numpy_ref, truth, f"shifted exp {shape}")


@needs_kernels
@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 17), (64, 256)])
def test_weighted_grad_tile_is_numpys_product_and_row_sums(rows, cols):
    rng = np.random.default_rng(rows * cols)
    p = rng.random((rows, cols), dtype=np.float32) ** 4  # weights in [0, 1), some tiny
    p[0, 0] = 0.0
    ds = (rng.standard_normal((rows, cols)) * 10).astype(np.float32)
    ours, sums = ds.copy(), np.empty(rows, np.float32)
    compiled.weighted_grad_tile(ours, p, sums)
    assert np.array_equal(ours, ds * p), "dS = P * (dP - D) is one IEEE product per element, as NumPy's"
    truth = p.astype(np.float64).sum(axis=1)
    numpy_ref = p @ np.ones(cols, np.float32)
    assert_within_budget(sums, numpy_ref, truth, "row sums of the tile's weights", ulps=1.0 * max(1, cols // 16))


def _band_reference(s, shift, extra, scale, lo, hi):
    """The NumPy reference lines `band_exp_tile` replaces: the band's 0/-inf bias added,
    the two shifts subtracted, the exp, the rows' factor, and the rows' sums."""
    rows, cols = s.shape[-2:]
    offset = np.arange(cols)[None, :] - np.arange(rows)[:, None]  # j - i
    bias = np.where((offset >= lo) & (offset <= hi), np.float32(0), np.float32(-np.inf))
    with np.errstate(invalid="ignore"):
        x = s + bias
        x -= shift[..., None]
        x -= extra[..., None]
        np.exp(x, out=x)
        x *= scale[..., None]
        truth = np.exp((s.astype(np.float64) + bias) - shift[..., None].astype(np.float64)
                       - extra[..., None].astype(np.float64)) * scale[..., None].astype(np.float64)
    return x, x.sum(axis=-1, dtype=np.float32), truth


@needs_kernels
@pytest.mark.parametrize("shape, lo, hi", [
    ((1, 1, 1), -compiled.NO_BAND, compiled.NO_BAND),
    ((2, 7, 33), -compiled.NO_BAND, 0),  # a causal diagonal, heads side by side
    ((3, 40, 130), -5, 20),  # a window's two edges
    ((1, 64, 256), 100, 300),  # rows with no key in the band: all 0
])
def test_band_exp_tile_within_twice_the_numpy_passes(shape, lo, hi):
    rng = np.random.default_rng(sum(shape) + hi % 97)
    s = (rng.standard_normal(shape) * 20).astype(np.float32)
    if shape[-1] > 1:
        s[..., 1] = -np.inf  # a key a mask took out
    shift = s.max(axis=-1) - rng.uniform(0, 3, shape[:-1]).astype(np.float32)
    extra = rng.uniform(-2, 2, shape[:-1]).astype(np.float32)
    scale = (1 + rng.uniform(-4, 4, shape[:-1]) * F32_EPS).astype(np.float32)  # f: within a few ulps of 1
    ours, sums = s.copy(), np.empty(shape[:-1], np.float32)
    compiled.band_exp_tile(ours, shift, extra, scale, sums, lo, hi)
    numpy_ref, numpy_sums, truth = _band_reference(s, shift, extra, scale, max(lo, -10**9), min(hi, 10**9))
    assert (ours[truth == 0] == 0).all(), "0 exactly where the band or a mask excludes a pair"
    _assert_elementwise_budget(ours, numpy_ref, truth, f"band exp {shape} [{lo}, {hi}]")
    cols = shape[-1]
    assert_within_budget(sums, numpy_sums, truth.sum(axis=-1), "the rows' sums of the weights",
                         ulps=1.0 * max(1, cols // 16))


@needs_kernels
def test_band_exp_tile_propagates_nan_and_takes_the_forwards_shift_bitwise():
    """extra = 0 and scale = 1 give exp(s - shift) with the same s - shift the backward
    forms before subtracting lse - shift: one shift, then the other, never their sum."""
    rng = np.random.default_rng(11)
    s = (rng.standard_normal((16, 64)) * 10).astype(np.float32)
    s[3, 5] = np.nan
    shift = s[:, :8].max(axis=1)
    ones, zeros = np.ones(16, np.float32), np.zeros(16, np.float32)
    forward, sums = s.copy(), np.empty(16, np.float32)
    compiled.band_exp_tile(forward, shift, zeros, ones, sums, -compiled.NO_BAND, compiled.NO_BAND)
    assert np.isnan(forward[3, 5]) and np.isnan(sums[3]) and not np.isnan(np.delete(sums, 3)).any()
    expected = s - shift[:, None]
    compiled.exp_tile(expected)  # the same exp on the same s - shift
    assert np.array_equal(forward, expected, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 17), (64, 256)])
def test_grad_scores_tile_is_numpys_ds_and_leaves_out_the_dominant_keys(rows, cols):
    rng = np.random.default_rng(rows + cols)
    p = (rng.random((rows, cols), dtype=np.float32) ** 4 / cols).astype(np.float32)
    if rows > 2:
        p[1] = 0
        p[1, cols // 2] = 1  # one-hot: its key is dominant
        p[2, 0] = 0.6  # above PEAK only after f: not dominant (f is 1 here)
    d_p = (rng.standard_normal((rows, cols)) * 10).astype(np.float32)
    d = rng.standard_normal(rows).astype(np.float32)
    weight = p.sum(axis=1, dtype=np.float32)
    ours, top, sums = d_p.copy(), np.empty(rows, np.int64), np.empty(rows, np.float32)
    found = compiled.grad_scores_tile(ours, p, d, weight, PEAK, top, sums)

    expected = (d_p - d[:, None]) * p  # the NumPy reference: two IEEE operations per element
    want_top = np.where((weight > PEAK) & (p.max(axis=1) > PEAK), np.argmax(p, axis=1), -1)
    assert np.array_equal(top, want_top) and found == int((want_top >= 0).sum())
    if rows > 2:
        assert top[1] == cols // 2 and top[2] == -1
    expected[want_top >= 0, want_top[want_top >= 0]] = 0
    assert np.array_equal(ours, expected), "dS = P (dP - D): the same two roundings per element as NumPy's"
    truth = expected.astype(np.float64).sum(axis=1)
    assert_within_budget(sums, expected.sum(axis=1, dtype=np.float32), truth, "the rows' sums of dS",
                         ulps=1.0 * max(1, cols // 16), scale=float(np.abs(expected).sum(axis=1).max()))


# ----------------------------------------------------------------------------- whole flash calls


def _numpy_path(monkeypatch):
    """Within the block: the NumPy reference lines run, as with ATTNKIT_KERNELS=numpy."""
    monkeypatch.setattr(compiled, "usable", lambda *arrays: False)
    monkeypatch.setattr(compiled, "wants", lambda elements: False)  # the fused tiles too


def _counting(monkeypatch):
    """Counts calls of the compiled loops (to prove the whole-call tests ran them): the
    unchecked paths the library's tiles take (each public entry checks, then runs one)."""
    calls = {"exp": 0, "shifted": 0, "grad": 0, "band_exp": 0, "grad_scores": 0, "forward_band_exp": 0}
    for name, key in (("_exp_tile", "exp"), ("_shifted_exp_tile", "shifted"), ("_weighted_grad_tile", "grad"),
                      ("_band_exp_tile", "band_exp"), ("_grad_scores_tile", "grad_scores")):
        real = getattr(compiled, name)

        def wrapped(*args, _real=real, _key=key):
            calls[_key] += 1
            return _real(*args)

        monkeypatch.setattr(compiled, name, wrapped)
    loop = compiled._band_exp_loop

    def counted_loop():  # the forward's fused tiles call band_exp_tile's loop as it is
        real = loop()

        def wrapped(*args):
            calls["band_exp"] += 1
            calls["forward_band_exp"] += 1
            return real(*args)

        return wrapped

    monkeypatch.setattr(compiled, "_band_exp_loop", counted_loop)
    return calls


CASES = {
    # name: (L, S, E, scale multiplier on q, mask kind)
    "odd sizes, fast path": (97, 1025, 59, 1.0, None),
    "causal, fast path": (130, 130, 64, 1.0, "causal"),
    "peaked rows (scores x30)": (64, 200, 32, 30.0, None),
    "bool mask with fully masked rows": (50, 77, 16, 1.0, "bool"),
    "float mask with -inf rows": (33, 65, 8, 2.0, "float"),
}


def _case(name, dtype=np.float32):
    L, S, E, boost, kind = CASES[name]
    rng = np.random.default_rng(len(name))
    q = rng.standard_normal((2, L, E)).astype(dtype) * dtype(boost)
    k, v = (rng.standard_normal((2, S, E)).astype(dtype) for _ in range(2))
    d_out = rng.standard_normal((2, L, E)).astype(dtype)
    kw, dense = {}, None
    if kind == "causal":
        kw, dense = dict(is_causal=True), masks.causal_mask(L, S)
    elif kind == "bool":
        dense = rng.random((2, L, S)) > 0.5
        dense[:, :3] = False  # fully masked rows: output 0, never NaN
        kw = dict(attn_mask=dense)
    elif kind == "float":
        dense = (rng.standard_normal((1, L, S)) * 3).astype(dtype)
        dense[..., ::4] = -np.inf
        dense[:, 0] = -np.inf
        kw = dict(attn_mask=dense)
    return q, k, v, d_out, kw, dense


def _float64_grads(q, k, v, d_out, dense):
    """float64 gradients by torch autograd on the plain math (fully masked rows: 0)."""
    tq, tk, tv = (torch.tensor(x.astype(np.float64), requires_grad=True) for x in (q, k, v))
    s = tq @ tk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    if dense is not None:
        m = torch.tensor(np.asarray(dense))
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(dead, 0.0, s), dim=-1) * ~dead
    (p @ tv).backward(torch.tensor(d_out.astype(np.float64)))
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@pytest.mark.parametrize("name", list(CASES))
def test_flash_with_kernels_within_twice_the_numpy_path_and_torch(torch, monkeypatch, name):
    q, k, v, d_out, kw, dense = _case(name)
    tiles = dict(block_q=32, block_k=64)
    with monkeypatch.context() as m:
        _numpy_path(m)
        ref = attnkit.flash_attention(q, k, v, return_lse=True, **kw, **tiles)
        ref_grads = attnkit.flash_attention_backward(d_out, q, k, v, ref.output, ref)
    calls = _counting(monkeypatch)
    res = attnkit.flash_attention(q, k, v, return_lse=True, **kw, **tiles)
    grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
    if kernels.enabled():
        if q.shape[-2] >= ONES_MIN_ROWS:  # rows enough for the fused tiles (FlashPlan.fused): they run both passes
            assert calls["band_exp"] > 0 and calls["grad_scores"] > 0, f"the fused tiles did not run: {calls}"
        else:
            assert calls["exp"] + calls["shifted"] > 0 and calls["grad"] > 0, f"the compiled loops did not run: {calls}"

    truth, _, truth_lse = reference_attention(q, k, v, dense)
    tmask = None if dense is None else torch.tensor(dense)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(x) for x in (q, k, v)), attn_mask=tmask)
    sdpa = np.nan_to_num(sdpa.numpy())  # torch: NaN on a fully masked float-mask row; the truth is 0
    cond = score_conditioning(q, k)
    size = float(np.abs(v).max()) * cond
    dead = np.isneginf(truth_lse)
    assert np.array_equal(res.output[dead], np.zeros_like(res.output[dead])), "fully masked rows give 0"
    assert_within_budget(res.output, ref.output, truth, f"{name}: output vs NumPy path", ulps=4, scale=size)
    assert_within_budget(res.output, sdpa, truth, f"{name}: output vs torch SDPA", ulps=4, scale=size)
    live = ~dead
    assert_within_budget(res.lse[live], ref.lse[live], truth_lse[live], f"{name}: lse", ulps=4, scale=cond)

    expected = _float64_grads(q, k, v, d_out, dense)
    dp_abs = float((np.abs(d_out.astype(np.float64)) @ np.abs(v.astype(np.float64)).swapaxes(-1, -2)).max())
    sc = 1.0 / np.sqrt(q.shape[-1])
    sizes = (dp_abs * np.abs(k).max() * sc * cond, dp_abs * np.abs(q).max() * sc * cond, np.abs(d_out).max() * cond)
    for what, ours, theirs, want, size in zip(("query", "key", "value"), grads, ref_grads, expected, sizes):
        assert np.isfinite(ours).all(), f"{name}: grad_{what} not finite"
        assert_within_budget(ours, theirs, want, f"{name}: grad_{what} vs NumPy path", factor=3.0, ulps=4,
                             scale=float(size))


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(window=(100, 20)), dict(is_causal=True, enable_gqa=True)],
                         ids=["causal", "window", "causal GQA"])
def test_fused_tiles_at_the_default_tiles_within_budget(torch, monkeypatch, kw):
    """The fused tiles (FlashPlan.fused) on the default grid: tiles cut into pieces along
    the band's edges, heads side by side, against the NumPy path and the float64 truth;
    with the kernels off the plan never takes them."""
    rng = np.random.default_rng(7)
    L, E, Hq = 700, 64, 4
    Hkv = 2 if kw.get("enable_gqa") else Hq
    q = rng.standard_normal((Hq, L, E)).astype(np.float32)
    k, v = (rng.standard_normal((Hkv, L, E)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal((Hq, L, E)).astype(np.float32)
    with monkeypatch.context() as m:
        _numpy_path(m)
        assert not _make_plan(q, k, v, **kw)[3].fused
        ref = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
        ref_grads = attnkit.flash_attention_backward(d_out, q, k, v, ref.output, ref)
    calls = _counting(monkeypatch)
    res = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
    grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
    if kernels.enabled():
        assert res.plan.fused and calls["band_exp"] > 0 and calls["grad_scores"] > 0, calls
        if "window" not in kw:  # (a narrow window leaves a block's rows no key in common: the running max)
            assert calls["forward_band_exp"] > 0, calls

    window = kw.get("window", (None, 0))
    dense = masks.sliding_window_mask(L, L, left=window[0], right=window[1])
    kr, vr = (np.repeat(x, Hq // Hkv, axis=0) for x in (k, v))
    truth, _, truth_lse = reference_attention(q, kr, vr, dense)
    cond = score_conditioning(q, kr)
    assert_within_budget(res.output, ref.output, truth, "output vs NumPy path", ulps=4,
                         scale=float(np.abs(v).max()) * cond)
    assert_within_budget(res.lse, ref.lse, truth_lse, "lse vs NumPy path", ulps=4, scale=cond)
    expected = list(_float64_grads(q, kr, vr, d_out, dense))
    g = Hq // Hkv
    expected[1:] = [x.reshape(Hkv, g, L, E).sum(axis=1) for x in expected[1:]]  # GQA: summed over each group
    dp_abs = float((np.abs(d_out.astype(np.float64)) @ np.abs(vr.astype(np.float64)).swapaxes(-1, -2)).max())
    sc = 1.0 / np.sqrt(E)
    sizes = (dp_abs * np.abs(k).max() * sc * cond, g * dp_abs * np.abs(q).max() * sc * cond,
             g * np.abs(d_out).max() * cond)
    for what, ours, theirs, want, size in zip(("query", "key", "value"), grads, ref_grads, expected, sizes):
        assert_within_budget(ours, theirs, want, f"grad_{what} vs NumPy path", factor=3.0, ulps=4, scale=float(size))


def test_fused_forward_with_value_runs_that_see_no_key_within_budget(monkeypatch):
    """A narrow window on small key tiles: the forward's P V runs (`FlashPlan.value_runs`)
    include runs of rows that see no key of their piece (their part of the product is 0);
    output and lse against the NumPy path and the float64 truth."""
    rng = np.random.default_rng(3)
    L, E = 512, 64
    q, k, v = (rng.standard_normal((2, L, E)).astype(np.float32) for _ in range(3))
    kw = dict(window=(100, 40), block_q=128, block_k=32)
    with monkeypatch.context() as m:
        _numpy_path(m)
        ref = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
    compiled.load()
    res = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
    if kernels.enabled():
        runs = [r for key, r in res.plan._band_cache.items() if key[0] == "values"]
        assert res.plan.fused and any(c1 <= c0 for r in runs for _, _, c0, c1 in r), "no run without a key"
    dense = masks.sliding_window_mask(L, L, left=100, right=40)
    truth, _, truth_lse = reference_attention(q, k, v, dense)
    cond = score_conditioning(q, k)
    assert_within_budget(res.output, ref.output, truth, "output vs NumPy path", ulps=4,
                         scale=float(np.abs(v).max()) * cond)
    assert_within_budget(res.lse, ref.lse, truth_lse, "lse vs NumPy path", ulps=4, scale=cond)


def test_kernels_give_the_same_results_on_one_thread_and_two():
    """Each row's tiles run in the same order whatever thread takes them (the loops
    release the GIL and run side by side on the runtime's workers): bitwise equal."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((4, 1024, 32)).astype(np.float32) for _ in range(3))
    one, two = (attnkit.flash_attention(q, k, v, is_causal=True, num_threads=n) for n in (1, 2))
    assert np.array_equal(one, two)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(is_causal=True, enable_gqa=True),
                                dict(is_causal=True, causal_align="bottom_right"), dict(window=(600, 300))],
                         ids=["causal", "causal GQA", "bottom-right chunk", "wide window"])
def test_fused_pieces_with_heads_side_by_side_are_bitwise_head_by_head(monkeypatch, kw):
    """The forward's fused tiles put several heads' pieces of a causal diagonal side by
    side in each call (`_heads_per_task`, `_heads_per_call`): NumPy's batched product
    multiplies head by head, so output, lse and shift are the bits of one head per
    task, and the same on one thread and two."""
    from attnkit.functional.flash import forward

    rng = np.random.default_rng(11)
    Hq, Hkv = (8, 2) if kw.get("enable_gqa") else (8, 8)
    L, S, E = (300, 1100, 64) if kw.get("causal_align") else (1100, 1100, 64)
    q = rng.standard_normal((Hq, L, E)).astype(np.float32)
    k, v = (rng.standard_normal((Hkv, S, E)).astype(np.float32) for _ in range(2))
    compiled.load()
    if not kernels.enabled():
        pytest.skip("the fused tiles need the compiled kernels")
    calls = _counting(monkeypatch)
    monkeypatch.setattr(forward, "l2_cache_bytes", lambda: 1 << 20)  # several heads a task on any machine
    side = attnkit.flash_attention(q, k, v, return_lse=True, num_threads=1, **kw)
    assert side.plan.fused and calls["forward_band_exp"] > 0, calls
    wide = forward._heads_per_task(side.plan, 1, 1, 4, 1, True)
    assert wide > 1, "the heads did not go side by side"
    with monkeypatch.context() as m:
        m.setattr(forward, "_heads_per_task", lambda *args, **kwargs: 1)
        alone = attnkit.flash_attention(q, k, v, return_lse=True, num_threads=1, **kw)
    for what in ("output", "lse", "shift", "shifted_lse"):
        assert np.array_equal(getattr(side, what), getattr(alone, what)), f"{what} (tasks of {wide} heads vs 1)"
    two = attnkit.flash_attention(q, k, v, num_threads=2, **kw)
    assert np.array_equal(side.output, two), "one thread and two"


@pytest.mark.parametrize("Hq", [5, 6, 7, 8, 12])
@pytest.mark.parametrize("L", [1024, 2048])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_forward_tasks_take_heads_evenly_and_keep_every_thread_busy(monkeypatch, Hq, L, threads):
    """`_heads_per_task`: the fewest tasks (so each piece's calls take many heads) that
    give every thread one when the tasks are alike (one query block) and two when they
    differ (a causal diagonal's blocks), each with as many heads as the count allows."""
    from attnkit.functional.flash import forward

    monkeypatch.setattr(forward, "l2_cache_bytes", lambda: 1 << 20)
    q = np.zeros((Hq, L, 64), np.float32)
    plan = _make_plan(q, q, q, is_causal=True, block_q=1024, num_threads=threads)[3]
    n_blocks = -(-L // plan.block_q)
    heads = forward._heads_per_task(plan, n_blocks, 1, 4, threads, True)
    tasks = n_blocks * -(-Hq // heads)
    assert heads == -(-Hq // -(-Hq // heads)), f"{Hq} heads as tasks of {heads}: uneven"
    least = threads if n_blocks == 1 else 2 * threads
    assert tasks >= min(least, n_blocks * Hq), f"{tasks} tasks for {threads} threads"
    if heads < Hq:  # one more head a task would leave a thread without work
        assert n_blocks * -(-Hq // (2 * heads)) < least or 2 * heads * 128 * plan.block_k * 4 > (1 << 20)
