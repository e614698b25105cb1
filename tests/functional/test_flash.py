"""Flash attention against the float64 reference, the plain float32 path and torch SDPA.

The tiled kernel's error against float64 must be at most twice the plain
float32 path's (three times for gradients), FlashAttention's own rule; tiles are
kept tiny here so every case crosses many tile edges.
"""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest
from hypothesis import given, strategies as st

import attnkit
from attnkit import masks
from attnkit.functional import mods
from attnkit.functional.band import Band
from conftest import F32_EPS, assert_close, assert_within_budget, max_rel_err, optional, reference_attention, score_conditioning
from wide_range import row_natural_sizes

torch = optional("torch")  # tests that use it ask for the `torch` fixture

# FlashAttention's rule through conftest.assert_within_budget. On the small random
# cases below, the max error over a few outputs is a noisy statistic: the plain path
# can round luckily while flash's scores, summed in another order, do not. With
# conftest's epsilon (8 ulps of max|truth|) about 1 draw in 2,000 failed, 2% of
# 40-example runs (flash 20 ulps vs plain 3 at scale 1.7, E=59; an lse near 0 needed
# 225). So the epsilon here is taken at each quantity's natural size, set by the
# conditioning: a float32 score q.k*scale is typically off by u*sqrt(E)*rms|q_e k_e|
# = u*s_abs/sqrt(E), with s_abs = scale * max_ij sum_e |q_ie k_je| (rounding errors
# add like a random walk), which moves the weights by that relative amount: the
# output by ~max|v| * cond, the lse by ~cond and each gradient by its size times
# cond, where cond = max(1, s_abs/sqrt(E)) (the 1 is the result's own rounding).
# Measured over 16,000 forward and 6,000 backward random cases drawn like flash_case, with
# OpenBLAS's own kernel and with OPENBLAS_CORETYPE=Haswell, what the rule needed
# beyond its 2x (3x) part was at most 1.8 ulps of these sizes; 4 leaves 2x. The
# factor itself is checked sharply, with conftest's epsilon, on the larger fixed
# cases below.
ULPS = 4.0


def _conditioning(q, k, scale, group: int) -> float:
    return score_conditioning(q, k, scale, group)


def _assert_within(ours, oracle, truth, natural_size: float, what: str, factor: float = 2.0):
    """assert_within_budget with its epsilon (ULPS) at the larger of max|truth| and
    the problem's natural size."""
    return assert_within_budget(ours, oracle, truth, what, factor=factor, ulps=ULPS, scale=natural_size)


def _ref_grads(q, k, v, d_out, mask, scale, group):
    """float64 gradients through torch autograd on the explicit, GQA-repeated math."""
    tq, tk, tv = (torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True) for x in (q, k, v))
    kk, vv = tk.repeat_interleave(group, dim=-3), tv.repeat_interleave(group, dim=-3)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = tq @ kk.transpose(-1, -2) * scale
    if mask is not None:
        m = torch.tensor(np.asarray(mask))
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)  # fully masked rows: weights 0, no gradient
    p = torch.softmax(torch.where(dead, 0.0, s), dim=-1) * ~dead
    (p @ vv).backward(torch.tensor(np.asarray(d_out, dtype=np.float64)))
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@st.composite
def flash_case(draw):
    batch = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=2)))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    L = draw(st.sampled_from([1, 2, 5, 17, 33]))
    S = draw(st.sampled_from([1, 3, 16, 29, 40]))
    E = draw(st.sampled_from([4, 8, 59]))
    Ev = draw(st.sampled_from([E, 7]))
    kind = draw(st.sampled_from(["none", "causal", "causal_br", "window", "bool", "bool_bcast", "float"]))
    scale = draw(st.sampled_from([None, 0.3, 1.7]))
    block_q = draw(st.integers(1, 12))
    block_k = draw(st.integers(1, 12))
    piece = draw(st.sampled_from([1, 2, 3, 128]))  # rows per piece where a band's edge crosses a tile
    seed = draw(st.integers(0, 2**16))
    return batch, kv_heads, group, L, S, E, Ev, kind, scale, block_q, block_k, piece, seed


@pytest.fixture(autouse=True)
def _restore_piece_rows():
    """_build sets the rows per piece each case draws; every test ends with the default."""
    from attnkit.functional.flash import plan

    default = plan.PIECE_ROWS
    yield
    plan.PIECE_ROWS = default


def _build(case, dtype=np.float32):
    batch, kv_heads, group, L, S, E, Ev, kind, scale, block_q, block_k, piece, seed = case
    from attnkit.functional.flash import plan

    plan.PIECE_ROWS = piece  # plans made from here on cut band tiles into pieces of this many rows
    rng = np.random.default_rng(seed)
    Hq = kv_heads * group
    q = rng.standard_normal((*batch, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((*batch, kv_heads, S, E)).astype(dtype)
    v = rng.standard_normal((*batch, kv_heads, S, Ev)).astype(dtype)
    flash_kw, dense = {}, None  # flash's arguments, and the same mask for the plain path
    if kind == "causal":
        flash_kw, dense = dict(is_causal=True), masks.causal_mask(L, S)
    elif kind == "causal_br":
        flash_kw = dict(is_causal=True, causal_align="bottom_right")
        dense = masks.causal_mask(L, S, align="bottom_right")
    elif kind == "window":
        left, right = int(rng.integers(0, 6)), int(rng.integers(0, 3))
        flash_kw = dict(window=(left, right), causal_align="bottom_right")
        dense = masks.sliding_window_mask(L, S, left=left, right=right, align="bottom_right")
    elif kind == "bool":
        dense = rng.random((*batch, Hq, L, S)) > 0.3
        flash_kw = dict(attn_mask=dense)
    elif kind == "bool_bcast":
        dense = rng.random((L, S)) > 0.5  # some rows fully masked now and then
        flash_kw = dict(attn_mask=dense)
    elif kind == "float":
        dense = (rng.standard_normal((1, L, S)) * 2).astype(dtype)
        dense[..., 0, :] = -np.inf  # a fully masked row through the float path
        flash_kw = dict(attn_mask=dense)
    flash_kw.update(scale=scale, enable_gqa=group > 1, block_q=block_q, block_k=block_k)
    return q, k, v, flash_kw, dense, scale, group


@given(flash_case())
def test_forward_within_twice_the_plain_float32_error(case):
    q, k, v, kw, dense, scale, group = _build(case)
    res = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
    assert res.output.dtype == np.float32 and res.output.shape == (*q.shape[:-1], v.shape[-1])
    assert res.lse.shape == q.shape[:-1]
    ref_out, _, ref_lse = reference_attention(q, k, v, dense, scale, group)
    plain = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=group > 1,
                                                 return_lse=True)
    cond = _conditioning(q, k, scale, group)
    _assert_within(res.output, plain.output, ref_out, np.abs(v).max() * cond, "output vs plain float32")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(res.lse), finite), "lse is -inf exactly on fully masked rows"
    _assert_within(res.lse[finite], plain.lse[finite], ref_lse[finite], cond, "lse vs plain float32")
    assert np.array_equal(res.output[~finite], np.zeros_like(res.output[~finite]))


@given(case=flash_case())
def test_forward_within_twice_torch_sdpa_float32_error(torch, case):
    q, k, v, kw, dense, scale, group = _build(case)
    out = attnkit.flash_attention(q, k, v, **kw)
    ref_out = reference_attention(q, k, v, dense, scale, group)[0]
    tmask = None if dense is None else torch.tensor(dense)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(x) for x in (q, k, v)), attn_mask=tmask, scale=scale, enable_gqa=group > 1
    ).numpy()
    # torch gives NaN on a fully masked row of a float mask; the truth there is 0
    _assert_within(out, np.nan_to_num(sdpa), ref_out, np.abs(v).max() * _conditioning(q, k, scale, group),
                   "output vs torch SDPA float32")


@given(flash_case())
def test_float64_inputs_match_reference_to_1e_10(case):
    q, k, v, kw, dense, scale, group = _build(case, np.float64)
    out = attnkit.flash_attention(q, k, v, **kw)
    assert out.dtype == np.float64
    assert_close(out, reference_attention(q, k, v, dense, scale, group)[0], 1e-10, "float64 output")


@given(case=flash_case())
def test_backward_matches_torch_autograd_and_three_times_the_plain_error(torch, case):
    q, k, v, kw, dense, scale, group = _build(case)
    d_out = np.random.default_rng(case[-1] + 1).standard_normal((*q.shape[:-1], v.shape[-1])).astype(np.float32)
    res = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
    grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
    plain = attnkit.scaled_dot_product_attention_backward(
        d_out, q, k, v, attn_mask=dense, scale=scale, enable_gqa=group > 1
    )
    expected = _ref_grads(q, k, v, d_out, dense, scale, group)
    # each gradient's natural size: dQ ~ dP K scale, dK ~ dP Q scale, dV ~ dO, where
    # dP = dO V^T is at most dp_abs = max_ij sum_e |dO_ie V_je|; times cond (above)
    sc = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    big = lambda x: float(np.abs(x).max())  # noqa: E731
    dp_abs = float((np.abs(d_out.astype(np.float64)) @ np.swapaxes(np.abs(np.repeat(v, group, -3)), -1, -2)).max())
    cond = _conditioning(q, k, scale, group)
    sizes = (dp_abs * big(k) * sc * cond, dp_abs * big(q) * sc * cond, big(d_out) * cond)
    for name, ours, theirs, ref, size in zip(("query", "key", "value"), grads, plain, expected, sizes):
        assert ours.dtype == np.float32 and ours.shape == ref.shape, name
        assert np.isfinite(ours).all(), f"grad_{name} not finite"
        _assert_within(ours, theirs, ref, size, f"grad_{name} vs plain float32", factor=3.0)

    # float64 through the same tiles agrees with torch autograd to ~1e-10
    q64, k64, v64, d64 = (x.astype(np.float64) for x in (q, k, v, d_out))
    kw64 = {key: (val.astype(np.float64) if isinstance(val, np.ndarray) and val.dtype != bool else val)
            for key, val in kw.items()}
    res64 = attnkit.flash_attention(q64, k64, v64, return_lse=True, **kw64)
    grads64 = attnkit.flash_attention_backward(d64, q64, k64, v64, res64.output, res64)
    for name, ours, ref in zip(("query", "key", "value"), grads64, expected):
        assert_close(ours, ref, 1e-10, f"float64 grad_{name}")


def test_backward_matches_finite_differences_float64():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 7, 5))
    k = rng.standard_normal((1, 9, 5))
    v = rng.standard_normal((1, 9, 3))
    d_out = rng.standard_normal((2, 7, 3))
    kw = dict(enable_gqa=True, scale=0.7, window=(4, 1), causal_align="bottom_right",
              score_mod=mods.softcap(2.0), block_q=3, block_k=4)
    res = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
    grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)

    def loss(q_, k_, v_):
        return float(np.sum(attnkit.flash_attention(q_, k_, v_, **kw) * d_out))

    h = 1e-6
    for which, (x, g) in enumerate(zip((q, k, v), grads)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[which][idx] += h
            up = loss(*args)
            args[which][idx] -= 2 * h
            numeric[idx] = (up - loss(*args)) / (2 * h)
        # central differences in float64: truncation h^2 |f'''| ~ 1e-12, cancellation
        # eps64 |loss| / h ~ 1e-16 * 10 / 1e-6 = 1e-9; 1e-7 leaves 100x for both
        assert max_rel_err(g, numeric) < 1e-7, f"input {which}: {max_rel_err(g, numeric):.2e}"


# ---------------------------------------------------------------- every row: one key, FlashAttention's grid


def _assert_rows_within(ours, plain, truth, row_sizes, what, factor=3.0, ulps=8.0):
    """conftest's rule applied row by row: each row's error (max over its last axis)
    at most `factor` times the plain float32 path's error in the same row, plus `ulps`
    float32 ulps of the row's natural size (wide_range.row_natural_sizes) or of its
    largest true entry, if larger."""
    ours, plain, truth = (np.asarray(x, dtype=np.float64) for x in (ours, plain, truth))
    assert ours.shape == truth.shape and not np.isnan(ours).any(), what
    err = np.abs(ours - truth).max(-1, initial=0.0)
    base = np.abs(plain - truth).max(-1, initial=0.0)
    budget = factor * base + ulps * F32_EPS * np.maximum(row_sizes, np.abs(truth).max(-1, initial=0.0))
    worst = np.unravel_index(np.argmax(err - budget), err.shape)
    print(f"{what}: worst row {worst}: flash {err[worst]:.3e}, plain {base[worst]:.3e}, budget {budget[worst]:.3e}")
    assert (err <= budget).all(), (
        f"{what}: row {worst} off by {err[worst]:.3e}, over {factor}x the plain path's {base[worst]:.3e} "
        f"+ {ulps} ulps of its size (= {budget[worst]:.3e})"
    )


def _check_every_row(q, k, v, d_out, mask, kw):
    """flash forward and backward against the plain float32 path, row by row, with
    the float64 truth (reference forward, torch autograd backward)."""
    res = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
    grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
    plain = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    plain_grads = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, attn_mask=mask)
    truth = reference_attention(q, k, v, mask)[0]
    truth_grads = _ref_grads(q, k, v, d_out, mask, None, 1)
    sizes = row_natural_sizes(q, k, v, mask, None, 1, d_out)
    _assert_rows_within(res.output, plain, truth, sizes["out"], "output", factor=2.0)
    for name, ours, base, t in zip(("dq", "dk", "dv"), grads, plain_grads, truth_grads):
        _assert_rows_within(ours, base, t, sizes[name], name)
    return grads, plain_grads


ONE_KEY = {  # flash's arguments and the same mask for the plain path; rows seeing one key
    "L=S=1": lambda L, S: (dict(), np.ones((L, S), bool)),
    "causal L>S": lambda L, S: (dict(is_causal=True, causal_align="bottom_right"),
                                masks.causal_mask(L, S, align="bottom_right")),
    "window (0, 0)": lambda L, S: (dict(window=(0, 0)), masks.sliding_window_mask(L, S, left=0, right=0)),
    "bool, one key a row": lambda L, S: (None, np.eye(L, S, k=S - L, dtype=bool) | np.eye(L, S, dtype=bool)),
}


@pytest.mark.parametrize("tiles", [(None, None), (3, 4), (2, 2), (5, 3)], ids=str)
@pytest.mark.parametrize("kind, L, S", [("L=S=1", 1, 1), ("causal L>S", 7, 3), ("causal L>S", 12, 5),
                                        ("window (0, 0)", 9, 9), ("window (0, 0)", 6, 11),
                                        ("bool, one key a row", 8, 8)])
def test_rows_that_see_one_key_get_exactly_the_plain_paths_zero_gradients(torch, kind, L, S, tiles):
    """Where a row sees a single key its softmax is constant: dQ of that row (and that
    row's share of dK) is exactly 0, as the plain path gives. FlashAttention-2's
    D = rowsum(dO * O) would leave the rounding of dO . v there (4e-7..1.7e-5 before);
    a row the band lets see one key takes D from its tile instead. Every row, these
    and the rest, stays within 3x of the plain path's error (the row budget)."""
    flash_kw, mask = ONE_KEY[kind](L, S)
    if flash_kw is None:
        flash_kw = dict(attn_mask=mask)
    rng = np.random.default_rng(L * 100 + S)
    q, k = rng.standard_normal((2, 3, L, 59)).astype(np.float32), rng.standard_normal((2, 3, S, 59)).astype(np.float32)
    v = rng.standard_normal((2, 3, S, 40)).astype(np.float32)
    d_out = rng.standard_normal((2, 3, L, 40)).astype(np.float32)
    grads, plain_grads = _check_every_row(q, k, v, d_out, mask, dict(flash_kw, block_q=tiles[0], block_k=tiles[1]))
    one = mask.sum(-1) == 1  # rows that see exactly one key
    assert one.any()
    assert not plain_grads.grad_query[..., one, :].any()
    if kind == "bool, one key a row":
        return  # a mask is no band: FlashAttention-2's D there, within the row budget above
    assert not grads.grad_query[..., one, :].any(), "dQ of a row that sees one key"
    if kind in ("L=S=1", "window (0, 0)"):  # every key seen by one row only: dK = 0 too
        assert not plain_grads.grad_key.any() and not grads.grad_key.any()


def _fa_grid():
    """FlashAttention's test grid (tests/test_flash_attn.py: seqlen pairs and head
    dims), sampled: each pair of lengths twice, every head dim at least once, causal
    (bottom-right, as FlashAttention aligns it) and not, with 512 x 512 tiles and
    64 x 96 tiles (rows span key blocks). Lengths of 1024 and more are slow."""
    seqlens = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
               (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]
    head_dims = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
    cases = []
    for i, (L, S) in enumerate(seqlens):
        for j, tiles in enumerate([(None, None), (64, 96)]):
            E = head_dims[(2 * i + j) % len(head_dims)]
            causal = (i + j) % 2 == 1
            marks = [pytest.mark.slow] if max(L, S) >= 1024 else []
            name = f"{L}x{S}-E{E}-{'causal' if causal else 'full'}-{tiles[0] or 512}x{tiles[1] or 512}"
            cases.append(pytest.param(L, S, E, causal, tiles, marks=marks, id=name))
    return cases


@pytest.mark.parametrize("L, S, E, causal, tiles", _fa_grid())
def test_flash_attention_grid_every_row_within_the_plain_error(torch, L, S, E, causal, tiles):
    """Every row of the output within 2x, of each gradient within 3x, of the plain
    float32 path's error in that row (plus 8 ulps of the row's natural size)."""
    rng = np.random.default_rng(L * 1000 + S + E)
    q = rng.standard_normal((1, 2, L, E)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, S, E)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal((1, 2, L, E)).astype(np.float32)
    mask = masks.causal_mask(L, S, align="bottom_right") if causal else None
    kw = dict(is_causal=causal, causal_align="bottom_right", block_q=tiles[0], block_k=tiles[1])
    _check_every_row(q, k, v, d_out, mask, kw)


@pytest.mark.parametrize("piece", [1, 7, 64])
@pytest.mark.parametrize("band", [dict(is_causal=True), dict(is_causal=True, causal_align="bottom_right"),
                                  dict(window=(40, 0)), dict(window=(9, 30), causal_align="bottom_right")], ids=str)
def test_band_tiles_cut_into_pieces_keep_every_row_within_the_plain_error(torch, band, piece):
    """Tiles a band's edge crosses are computed as runs of `piece` rows, forward
    and backward alike (the backward rebuilds the forward's products bitwise)."""
    from attnkit.functional.flash import plan

    plan.PIECE_ROWS = piece
    L, S, E = 300, 260, 40
    rng = np.random.default_rng(piece)
    q = rng.standard_normal((1, 2, L, E)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, S, E)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal((1, 2, L, E)).astype(np.float32)
    align = band.get("causal_align", "top_left")
    if "window" in band:
        left, right = band["window"]
        mask = masks.sliding_window_mask(L, S, left=left, right=right, align=align)
    else:
        mask = masks.causal_mask(L, S, align=align)
    _check_every_row(q, k, v, d_out, mask, dict(band, block_q=128, block_k=96))


def _plan_with_band(L: int, S: int, bq: int, bk: int, band, piece: int):
    """A plan on an (L, S) grid of (bq, bk) tiles with its band replaced by Band(*band) and
    pieces of `piece` rows, and the (L, S) booleans of the pairs the band allows."""
    from attnkit.functional import flash

    q = np.zeros((1, L, 4), np.float32)
    k = np.zeros((1, S, 4), np.float32)
    plan = flash._make_plan(q, k, k, block_q=bq, block_k=bk)[-1]
    plan = dataclasses.replace(plan, band=Band(*band), piece_q=piece, _band_cache={})
    rel = np.arange(S)[None, :] - np.arange(L)[:, None]
    allowed = rel <= band[1]
    if band[0] is not None:
        allowed &= rel >= band[0]
    return plan, allowed


@pytest.mark.parametrize("band", [(None, 0), (None, 40), (-40, 0), (-9, 30), (-3, -1)], ids=str)
@pytest.mark.parametrize("piece", [1, 5, 128])
def test_pieces_cover_exactly_the_pairs_the_band_allows(band, piece):
    """Over the whole grid, the pieces hold every allowed (query, key) pair once
    and each piece's columns are the union of what its rows may see."""
    L, S, bq, bk = 70, 90, 16, 24
    plan, allowed = _plan_with_band(L, S, bq, bk, band, piece)
    covered = np.zeros((L, S), int)
    whole = 0  # pairs computed if each tile were one piece
    for q0 in range(0, L, bq):
        for k0 in range(0, S, bk):
            c0, c1 = plan.tile_cols(q0, min(q0 + bq, L), k0, min(k0 + bk, S))
            whole += (min(q0 + bq, L) - q0) * max(0, c1 - c0)
            for r0, r1, c0, c1 in plan.pieces(q0, min(q0 + bq, L), k0, min(k0 + bk, S)):
                assert q0 <= r0 < r1 <= min(q0 + bq, L) and k0 <= c0 < c1 <= min(k0 + bk, S)
                seen = np.flatnonzero(allowed[r0:r1, k0:min(k0 + bk, S)].any(axis=0)) + k0
                assert (c0, c1) == (seen.min(), seen.max() + 1), "a piece's columns are what its rows may see"
                covered[r0:r1, c0:c1] += 1
    assert covered.max() == 1, "no pair is computed twice"
    assert (covered[allowed] == 1).all(), "every allowed pair is computed"
    if piece < bq:
        assert covered.sum() < whole, "pieces compute fewer pairs than whole tiles"
    else:
        assert covered.sum() == whole


@pytest.mark.parametrize("band", [(None, 0), (None, 40), (-40, 0), (-9, 30), (-3, -1)], ids=str)
@pytest.mark.parametrize("piece", [1, 5, 128])
def test_value_runs_hold_every_pair_their_piece_computes_and_leave_out_only_zero_weights(band, piece):
    """The forward's P V product of a piece runs as `value_runs`: over the piece's rows
    once, each run's columns within the piece's and holding every allowed pair of its
    rows (the weights left out are the band's zeros); where the band's edge crosses a
    piece of more rows than a run, fewer pairs than the piece's whole rectangle."""
    from attnkit.functional.flash.plan import VALUE_ROWS

    L, S, bq, bk = 300, 330, 160, 96
    plan, allowed = _plan_with_band(L, S, bq, bk, band, piece)
    trimmed = 0
    for q0 in range(0, L, bq):
        for r0, r1, c0, c1, _, _ in plan.row_pieces(q0, min(q0 + bq, L), 0, S):
            rows = np.zeros(r1 - r0, int)
            kept = np.zeros((r1 - r0, c1 - c0), bool)
            for a, b, v0, v1 in plan.value_runs(r0, r1, c0, c1):
                assert 0 <= a < b <= r1 - r0
                rows[a:b] += 1
                if v1 > v0:
                    assert 0 <= v0 < v1 <= c1 - c0, "a run's columns lie in its piece"
                    kept[a:b, v0:v1] = True
            assert (rows == 1).all(), "the runs cover the piece's rows once"
            assert not (allowed[r0:r1, c0:c1] & ~kept).any(), "every allowed pair is in a run"
            trimmed += kept.sum() < kept.size
    if piece > VALUE_ROWS:
        assert trimmed, "runs leave out the weights the band zeroes"


# ---------------------------------------------------------------- merging


@given(st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**16), st.booleans())
def test_merge_over_any_split_of_keys_equals_unsplit(S, n_parts, seed, masked):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 5, 8))
    k = rng.standard_normal((2, S, 8))
    v = rng.standard_normal((2, S, 3))
    mask = rng.random((5, S)) > 0.6 if masked else np.ones((5, S), dtype=bool)
    cuts = np.sort(rng.integers(0, S + 1, size=n_parts - 1))
    edges = [0, *cuts.tolist(), S]
    outs, lses = [], []
    for a, b in zip(edges[:-1], edges[1:]):  # empty parts included: they must weigh nothing
        part = attnkit.flash_attention(q, k[:, a:b], v[:, a:b], attn_mask=mask[:, a:b], return_lse=True, block_k=3)
        outs.append(part.output)
        lses.append(part.lse)
    merged = attnkit.merge_attention_states(outs, lses)
    whole = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert_close(merged.output, whole.output, 1e-12, "merged output")
    finite = np.isfinite(whole.lse)
    assert np.array_equal(np.isfinite(merged.lse), finite)
    np.testing.assert_allclose(merged.lse[finite], whole.lse[finite], rtol=1e-12)
    assert np.array_equal(merged.output[~finite], np.zeros_like(merged.output[~finite]))
    stacked = attnkit.merge_attention_states(np.stack(outs), np.stack(lses))
    np.testing.assert_array_equal(stacked.output, merged.output)


@pytest.mark.parametrize("marker", [-np.inf, np.inf], ids=["-inf (attnkit, FlexAttention)", "+inf (FlashAttention-2)"])
def test_merge_reads_either_marker_of_an_empty_part_and_never_gives_nan(marker):
    """A part where a row saw no key: lse -inf (ours) or +inf (FlashAttention-2, vLLM),
    whatever its output holds there (NaN here), weighs nothing; a row that no part
    saw comes out output 0 and lse -inf."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 6, 8)), rng.standard_normal((2, 10, 8)), rng.standard_normal((2, 10, 5))
    mask = rng.random((6, 10)) > 0.3
    mask[1, 4:] = False  # row 1 sees nothing in the second part
    mask[4] = False  # row 4 sees nothing at all
    parts = [attnkit.flash_attention(q, k[:, a:b], v[:, a:b], attn_mask=mask[:, a:b], return_lse=True)
             for a, b in [(0, 4), (4, 10)]]
    outputs, lses = [], []
    for part in parts:
        empty = np.isneginf(part.lse)
        outputs.append(np.where(empty[..., None], np.nan, part.output))
        lses.append(np.where(empty, marker, part.lse))
    merged = attnkit.merge_attention_states(outputs, lses)
    whole = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert not np.isnan(merged.output).any() and not np.isnan(merged.lse).any()
    assert_close(merged.output, whole.output, 1e-12, "merged output")
    np.testing.assert_array_equal(np.isneginf(merged.lse), np.isneginf(whole.lse))
    assert np.isneginf(merged.lse[:, 4]).all() and not merged.output[:, 4].any()


def test_merge_rejects_mismatched_states():
    o, l = np.zeros((2, 3, 4)), np.zeros((2, 3))
    with pytest.raises(ValueError, match="at least one"):
        attnkit.merge_attention_states([], [])
    with pytest.raises(ValueError, match="as many lses"):
        attnkit.merge_attention_states([o, o], [l])
    with pytest.raises(ValueError, match=r"lses\[0\] of shape \(2, 3\)"):
        attnkit.merge_attention_states([o], [np.zeros((2, 4))])


# ---------------------------------------------------------------- special rows and paths


def test_fully_masked_rows_give_zero_output_and_finite_zero_gradients():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 9, 4)).astype(np.float32) for _ in range(3))
    mask = rng.random((9, 9)) > 0.4
    mask[[0, 4, 8]] = False
    res = attnkit.flash_attention(q, k, v, attn_mask=mask, return_lse=True, block_q=2, block_k=4)
    assert np.array_equal(res.output[:, [0, 4, 8]], np.zeros((2, 3, 4)))
    assert np.isneginf(res.lse[:, [0, 4, 8]]).all()
    d_out = rng.standard_normal(res.output.shape).astype(np.float32)
    g = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
    assert all(np.isfinite(x).all() for x in g)
    assert np.array_equal(g.grad_query[:, [0, 4, 8]], np.zeros((2, 3, 4)))
    # a mask that excludes everything: all zeros, nothing computed
    none = np.zeros((9, 9), dtype=bool)
    res = attnkit.flash_attention(q, k, v, attn_mask=none, return_lse=True)
    assert np.array_equal(res.output, np.zeros_like(res.output)) and np.isneginf(res.lse).all()
    g = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
    assert all(np.array_equal(x, np.zeros_like(x)) for x in g)


def test_scores_that_jump_between_tiles_stay_exact():
    """Tile after tile the scores rise by ~60 and then by ~100: the rescaling by
    exp(m_old - m_new) underflows what came before, and nothing overflows."""
    S, E = 12, 4
    q = np.ones((1, 3, E), dtype=np.float32)
    k = np.zeros((1, S, E), dtype=np.float32)
    k[0, :, 0] = np.repeat([0.0, 60.0, 160.0], 4)  # tiles of 4 keys
    k[0, :, 1] = np.linspace(0, 1, S)
    v = np.random.default_rng(0).standard_normal((1, S, 5)).astype(np.float32)
    ref_out, _, ref_lse = reference_attention(q, k, v, scale=1.0)
    plain = attnkit.scaled_dot_product_attention(q, k, v, scale=1.0, return_lse=True)
    for block_k in (4, 2, 5):
        res = attnkit.flash_attention(q, k, v, scale=1.0, block_k=block_k, return_lse=True)
        assert_within_budget(res.output, plain.output, ref_out, f"output, block_k={block_k}")
        assert_within_budget(res.lse, plain.lse, ref_lse, f"lse, block_k={block_k}")
    # and the other way round: falling scores underflow harmlessly
    k[0, :, 0] = k[0, ::-1, 0]
    res = attnkit.flash_attention(q, k, v, scale=1.0, block_k=4)
    ref_out = reference_attention(q, k, v, scale=1.0)[0]
    plain = attnkit.scaled_dot_product_attention(q, k, v, scale=1.0)
    assert_within_budget(res, plain, ref_out, "output, falling scores")


def test_fixed_shift_fast_path_and_its_running_max_fallback_both_match_float64(torch):
    """The forward subtracts a fixed per-row shift inside BLAS (the best of a few
    keys every row sees); scores far above it overflow, and that task reruns on
    the running max (shift 0). Both kinds of row, forward and backward, stay
    within the plain path's error of the float64 truth, and the state records
    which shift each row used."""
    rng = np.random.default_rng(3)
    q, k, v, d_out = (rng.standard_normal((2, 3, 40, 16)).astype(np.float32) for _ in range(4))
    q[..., 0] = np.abs(q[..., 0]) + 1
    k_jump = k.copy()
    k_jump[..., 30:, 0] += 100.0  # keys 30.. score >= 100 above the others, for every row
    for keys, fast in ((k, True), (k_jump, False)):
        for causal in (False, True):
            mask = masks.causal_mask(40, 40) if causal else None
            ref_out = reference_attention(q, keys, v, mask, scale=1.0)[0]
            ref_grads = _ref_grads(q, keys, v, d_out, mask, 1.0, 1)
            plain = attnkit.scaled_dot_product_attention(q, keys, v, is_causal=causal, scale=1.0)
            plain_grads = attnkit.scaled_dot_product_attention_backward(d_out, q, keys, v, is_causal=causal, scale=1.0)
            res = attnkit.flash_attention(q, keys, v, is_causal=causal, scale=1.0, block_q=8, block_k=16,
                                          return_lse=True)
            assert res.shift.shape == res.lse.shape
            used_fast = res.shift != 0
            # rows from 32 on see the jump in every case: their tasks fell back
            assert used_fast.all() if fast else not used_fast[..., 32:].any(), f"fast={fast} causal={causal}"
            assert_within_budget(res.output, plain, ref_out, f"output fast={fast} causal={causal}")
            grads = attnkit.flash_attention_backward(d_out, q, keys, v, res.output, res)
            for name, ours, base, ref in zip(("query", "key", "value"), grads, plain_grads, ref_grads):
                assert_within_budget(ours, base, ref, f"grad_{name} fast={fast} causal={causal}", factor=3.0)


def test_decode_splits_keys_across_threads_and_merges():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 1, 1, 16)).astype(np.float32)  # one query: one task, so keys are split
    k = rng.standard_normal((1, 1, 1000, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1, 1000, 16)).astype(np.float32)
    ref = reference_attention(q, k, v)[0]
    plain = attnkit.scaled_dot_product_attention(q, k, v)
    for threads in (1, 2, 3):
        out = attnkit.flash_attention(q, k, v, block_k=64, num_threads=threads)
        assert_within_budget(out, plain, ref, f"split keys, {threads} threads")
    cached = attnkit.flash_attention(q, k, v, is_causal=True, causal_align="bottom_right", block_k=64, num_threads=2)
    assert_within_budget(cached, plain, ref, "decode step over the whole cache")


def test_peaked_rows_keep_gradients_as_exact_as_the_plain_path(torch):
    """Large scores make near-one-hot rows; the backward's exp(s - lse) must then
    give the top weight 1 to rounding, which needs bitwise the forward's scores
    (a version that shifted by a stale max got grad_value 3.2x the plain error here)."""
    rng = np.random.default_rng(12)
    q = (rng.standard_normal((4, 24, 59)) * 1.7).astype(np.float32)
    k, v = (rng.standard_normal((4, 70, 59)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal((4, 24, 59)).astype(np.float32)
    for causal in (False, True):
        mask = masks.causal_mask(24, 70, align="bottom_right") if causal else None
        expected = _ref_grads(q, k, v, d_out, mask, 1.7, 1)
        plain = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, attn_mask=mask, scale=1.7)
        for bq, bk in [(1, 3), (4, 8), (8, 16), (None, None)]:
            kw = dict(scale=1.7, block_q=bq, block_k=bk, is_causal=causal, causal_align="bottom_right")
            res = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
            grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
            for name, ours, base, ref in zip(("query", "key", "value"), grads, plain, expected):
                # no epsilon: the plain errors here are far above rounding, and the
                # regression this guards against sat at 3.2x
                assert_within_budget(ours, base, ref, f"grad_{name} {bq}x{bk}", factor=3.0, ulps=0.0)


def test_few_query_rows_take_keys_as_they_are_in_wide_tiles(torch):
    """A decode step (fewer than ONES_MIN_ROWS query rows per kv head) runs on the
    keys and values as they are, without the ones-column copy, in key tiles of
    FEW_ROWS_KEYS; answers and gradients stay within the plain path's error of
    the float64 truth, and the backward rebuilds the forward's scores (peaked
    rows keep exact gradients). More rows keep the ones column."""
    from attnkit.functional import flash

    rng = np.random.default_rng(21)
    S = flash.FEW_ROWS_KEYS + 1000  # two key tiles, the second partial
    k, v = (rng.standard_normal((1, 2, S, 16)).astype(np.float32) for _ in range(2))
    for L, causal in ((1, False), (3, True)):
        q = (rng.standard_normal((1, 6, L, 16)) * 2.5).astype(np.float32)  # peaked rows
        d_out = rng.standard_normal((1, 6, L, 16)).astype(np.float32)
        mask = masks.causal_mask(L, S, align="bottom_right") if causal else None
        kw = dict(enable_gqa=True, is_causal=causal, causal_align="bottom_right")
        res = attnkit.flash_attention(q, k, v, return_lse=True, **kw)
        assert (res.plan.key_ones, res.plan.block_k) == (False, flash.FEW_ROWS_KEYS)
        plain = attnkit.scaled_dot_product_attention(q, k, v, **kw)
        ref = reference_attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), mask)[0]
        assert_within_budget(res.output, plain, ref, f"few rows L={L}")
        grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
        base = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, **kw)
        expected = _ref_grads(q, k, v, d_out, mask, None, 3)
        for name, ours, b, e in zip(("query", "key", "value"), grads, base, expected):
            assert_within_budget(ours, b, e, f"few rows grad_{name} L={L}", factor=3.0)
    q = rng.standard_normal((1, 6, -(-flash.ONES_MIN_ROWS // 3), 16)).astype(np.float32)  # L x group >= it
    res = attnkit.flash_attention(q, k[..., :600, :], v[..., :600, :], enable_gqa=True, return_lse=True)
    assert res.plan.key_ones and res.plan.block_k == 512


def test_threads_do_not_change_results_and_default_tiles_work():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 3, 1025, 32)).astype(np.float32) for _ in range(3))
    one = attnkit.flash_attention(q, k, v, is_causal=True, num_threads=1)
    two = attnkit.flash_attention(q, k, v, is_causal=True, num_threads=2)
    np.testing.assert_array_equal(one, two)  # same tiles, same order per row: bitwise equal
    plain = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = reference_attention(q, k, v, masks.causal_mask(1025))[0]
    assert_within_budget(two, plain, ref, "default tiles")


def test_reused_scratch_never_leaks_between_calls_or_threads(monkeypatch):
    """Each call's temporaries come from its thread's reused block (no page
    faults on every call): calls of other shapes in between, and calls from
    several threads at once, must not change a single bit."""
    import threading

    def problem(L, S, seed):
        r = np.random.default_rng(seed)
        return [r.standard_normal(shape).astype(np.float32) for shape in
                ((2, 4, L, 16), (2, 2, S, 16), (2, 2, S, 16), (2, 4, L, 16))]

    def fwd_bwd(q, k, v, d_out, threads=2):
        res = attnkit.flash_attention(q, k, v, enable_gqa=True, is_causal=True, causal_align="bottom_right",
                                      block_q=32, block_k=48, return_lse=True, num_threads=threads)
        return (res.output, res.lse, *attnkit.flash_attention_backward(d_out, q, k, v, res.output, res))

    small, big = problem(70, 90, 1), problem(200, 260, 2)
    first = fwd_bwd(*small)
    fwd_bwd(*big)  # grows the scratch
    again = fwd_bwd(*small)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    results = {}

    def worker(i):
        results[i] = fwd_bwd(*(small if i % 2 else big))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone_big = fwd_bwd(*big)
    for i, got in results.items():
        for a, b in zip(got, first if i % 2 else alone_big):
            np.testing.assert_array_equal(a, b)
    # over the kept size a call gets a fresh block, and the same bits
    from attnkit import runtime

    monkeypatch.setattr(runtime, "ARENA_BYTES", 1024)
    for a, b in zip(fwd_bwd(*big), alone_big):
        np.testing.assert_array_equal(a, b)


def test_float16_and_2d_inputs():
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((6, 8)).astype(np.float16) for _ in range(3))
    res = attnkit.flash_attention(q, k, v, is_causal=True, return_lse=True, block_q=4, block_k=4)
    assert res.output.dtype == np.float16 and res.output.shape == (6, 8)
    assert res.lse.dtype == np.float64 and res.lse.shape == (6,)
    plain = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True)
    truth = reference_attention(q[None], k[None], v[None], masks.causal_mask(6))[0][0]  # it wants a head axis
    # float16 results: the epsilon is one float16 ulp (2^-10 = 8192 float32 ulps) at the largest
    # output, half for storing in float16 and half for the float32 compute nudging across a tie
    assert_within_budget(res.output, plain, truth, "float16 output vs plain float16", ulps=8192)
    g = attnkit.flash_attention_backward(q, q, k, v, res.output, res)
    assert all(x.dtype == np.float16 and x.shape == (6, 8) for x in g)


def test_nan_propagates_like_torch():
    q = np.ones((1, 2, 4), dtype=np.float32)
    k = np.ones((1, 6, 4), dtype=np.float32)
    k[0, 4, 0] = np.nan
    out = attnkit.flash_attention(q, k, k, block_k=2)
    assert np.isnan(out).all()


def test_registered_as_a_backend_with_the_sdpa_signature():
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    flash = attnkit.get_attention("flash")
    mask = masks.causal_mask(5)
    np.testing.assert_allclose(flash(q, k, v, mask), attnkit.scaled_dot_product_attention(q, k, v, mask), rtol=1e-12)
    res = flash(q, k, v, None, 0.0, True, return_lse=True)
    assert isinstance(res, attnkit.AttentionOutput) and res.weights is None
    with pytest.raises(ValueError, match="dropout"):
        flash(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="weights"):
        flash(q, k, v, return_weights=True)


# ---------------------------------------------------------------- bad input


def _two_args(b, h):
    return True


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_q=0), ValueError, "block_q >= 1"),
        (dict(block_k=-3), ValueError, "block_k >= 1"),
        (dict(block_k=2.5), TypeError, "block_k"),
        (dict(num_threads=0), ValueError, "num_threads"),
        (dict(mask_mod=_two_args), TypeError, r"mask_mod to take 4 positional arguments"),
        (dict(score_mod=lambda s, b, h: s), TypeError, r"score_mod to take 5"),
        (dict(score_mod=3), TypeError, "callable"),
        (dict(attn_mask=np.ones((5, 4), dtype=bool)), ValueError, "broadcastable"),
        (dict(attn_mask=np.ones((3, 4), dtype=bool), is_causal=True), ValueError, "is_causal"),
        (dict(window=-1), ValueError, "window left >= 0"),
        (dict(window=(1, 2, 3)), TypeError, "window"),
        (dict(causal_align="middle"), ValueError, "causal_align"),
        (dict(key=np.ones((2, 4, 5))), ValueError, "E=4"),
        (dict(mask_mod=lambda b, h, q, kv: q - kv), TypeError, "booleans"),
        (dict(score_mod=lambda s, b, h, q, kv: s[:1, :1].repeat(2, 0)), ValueError, "score_mod to return"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(kwargs, error, match):
    args = dict(query=np.ones((2, 3, 4)), key=np.ones((2, 4, 4)), value=np.ones((2, 4, 4)), block_q=2, block_k=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        attnkit.flash_attention(**args)


def test_backward_rejects_bad_saved_state_and_underivable_mods():
    q = np.ones((2, 3, 4))
    res = attnkit.flash_attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match=r"lse of shape \(2, 3\)"):
        attnkit.flash_attention_backward(q, q, q, q, res.output, dataclasses.replace(res, lse=res.lse[:, :2]))
    with pytest.raises(ValueError, match="grad_output"):
        attnkit.flash_attention_backward(q[:, :2], q, q, q, res.output, res)
    plain_mod = attnkit.flash_attention(q, q, q, return_lse=True, score_mod=lambda s, b, h, i, j: s * 2)
    with pytest.raises(TypeError, match="ScoreMod"):
        attnkit.flash_attention_backward(q, q, q, q, plain_mod.output, plain_mod)


def test_backward_takes_the_forwards_plan_and_refuses_another_problems_state():
    """The state carries the forward's tile grid, mask and settings: the backward
    cannot be run on another grid, and a state of other shapes, a bare lse or a
    merged state (no plan) is refused with what was expected."""
    rng = np.random.default_rng(22)
    q, k, v, d_out = (rng.standard_normal((2, 19, 8)) for _ in range(4))
    res = attnkit.flash_attention(q, k, v, is_causal=True, block_q=3, block_k=5, return_lse=True)
    assert (res.plan.block_q, res.plan.block_k) == (3, 5)
    out, lse = res  # still unpacks as (output, lse)
    assert out is res.output and lse is res.lse
    expected = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, is_causal=True)
    for threads in (1, 2):
        grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res, num_threads=threads)
        for ours, theirs in zip(grads, expected):
            np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"expected the inputs of the forward .*query \(2, 19, 8\).*got query \(2, 18, 8\)"):
        attnkit.flash_attention_backward(d_out[:, :18], q[:, :18], k, v, res.output[:, :18], res)
    with pytest.raises(ValueError, match="expected the inputs of the forward"):
        attnkit.flash_attention_backward(d_out, *(x.astype(np.float32) for x in (q, k, v)), res.output, res)
    with pytest.raises(TypeError, match="AttentionState that flash_attention"):
        attnkit.flash_attention_backward(d_out, q, k, v, res.output, res.lse)
    merged = attnkit.merge_attention_states([res.output], [res.lse])
    with pytest.raises(TypeError, match="merged state without a plan"):
        attnkit.flash_attention_backward(d_out, q, k, v, res.output, merged)


def test_flash_broadcasts_like_sdpa_forward_and_backward():
    rng = np.random.default_rng(21)
    for q_shape, k_shape in [((2, 3, 40, 8), (1, 3, 33, 8)), ((3, 40, 8), (2, 3, 33, 8)), ((40, 8), (33, 8))]:
        q, k, v = rng.standard_normal(q_shape), rng.standard_normal(k_shape), rng.standard_normal(k_shape)
        plain = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True)
        res = attnkit.flash_attention(q, k, v, is_causal=True, block_q=16, block_k=16, return_lse=True)
        np.testing.assert_allclose(res.output, plain, rtol=1e-12, atol=1e-12)
        d_out = rng.standard_normal(plain.shape)
        expected = attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, is_causal=True)
        grads = attnkit.flash_attention_backward(
            d_out, q, k, v, res.output, res
        )
        for ours, theirs in zip(grads, expected):
            assert ours.shape == theirs.shape
            np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-10)


def test_tile_sizes_follow_the_l2_cache_and_the_band(monkeypatch):
    """Key tiles are MAX_BLOCK wide (never 256: an sgemm inner side that runs 3x
    slower on some CPUs) and query blocks fill a tile of twice the L2 the OS
    reports; a chunk of rows over a longer cache (a causal band, 2L < S) cuts
    its query blocks to L / 8 (at least 64); a causal self-attention and a
    window keep whole tiles (their edges are followed by pieces)."""
    from attnkit.functional import flash

    assert flash.l2_cache_bytes() >= 1 << 14
    monkeypatch.setattr(flash.plan, "l2_cache_bytes", lambda: 1 << 20)  # what choose_blocks reads
    assert flash.choose_blocks(4096, 4096, 4, banded=False) == (1024, 512)  # 2 MiB of scores
    assert flash.choose_blocks(4096, 4096, 8, banded=False) == (512, 512)
    assert flash.choose_blocks(1024, 1024, 4, banded=True) == (1024, 512)  # causal self-attention: whole tiles
    assert flash.choose_blocks(4096, 4096, 4, banded=True) == (1024, 512)
    monkeypatch.setattr(flash.plan, "l2_cache_bytes", lambda: 4 << 20)
    assert flash.choose_blocks(4096, 4096, 4, banded=False) == (flash.MAX_BLOCK_Q, 512)  # at most MAX_BLOCK_Q rows
    monkeypatch.setattr(flash.plan, "l2_cache_bytes", lambda: 1 << 20)
    assert flash.choose_blocks(64, 1024, 4, banded=True) == (64, 512)  # a chunk of rows over a long cache
    assert flash.choose_blocks(1024, 4096, 4, banded=True) == (128, 512)
    assert flash.choose_blocks(100, 30, 4, banded=False) == (100, 30)
    monkeypatch.setattr(flash.plan, "l2_cache_bytes", lambda: 512 << 10)
    assert flash.choose_blocks(4096, 4096, 4, banded=False) == (512, 512)
    assert flash.choose_blocks(4096, 4096, 8, banded=False) == (256, 512)
    monkeypatch.setattr(flash.plan, "l2_cache_bytes", lambda: 256 << 10)
    assert flash.choose_blocks(4096, 4096, 4, banded=False) == (256, 512)
    assert flash.choose_blocks(4096, 4096, 8, banded=False) == (128, 512)
    for L, S, itemsize, banded in ((4096, 4096, 4, False), (2048, 2048, 4, True), (8192, 8192, 8, False)):
        assert flash.choose_blocks(L, S, itemsize, banded)[1] != 256
    q = np.ones((1, 2, 300, 8), np.float32)
    res = attnkit.flash_attention(q, q, q, is_causal=True, return_lse=True, num_threads=1)
    assert (res.plan.block_q, res.plan.block_k) == (300, 300)
    res = attnkit.flash_attention(q[..., :50, :], q, q, is_causal=True, return_lse=True, num_threads=1)
    assert (res.plan.block_q, res.plan.block_k) == (50, 300)
    # a window keeps whole query blocks: its edges are followed by pieces of PIECE_ROWS rows
    res = attnkit.flash_attention(q, q, q, window=(8, 0), return_lse=True, num_threads=1)
    assert (res.plan.block_q, res.plan.block_k, res.plan.piece_q) == (300, 300, flash.plan.PIECE_ROWS)
    # query blocks shrink (to PIECE_ROWS at least) until every thread the work can use (one per
    # 2^21 scores) has two forward tasks
    q = np.ones((1, 1, 4096, 8), np.float32)
    kv = np.ones((1, 1, 16384, 8), np.float32)  # 2^26 scores: work for 32 threads
    for threads, block_q in ((1, 256), (8, 256), (16, 128), (32, 128), (64, 128)):
        assert attnkit.flash_attention(q, kv, kv, return_lse=True, num_threads=threads).plan.block_q == block_q
    assert attnkit.flash_attention(q, q, q, return_lse=True, num_threads=64).plan.block_q == 256  # work for 8


def test_small_calls_stay_on_the_calling_thread():
    """Threads never hurt: work too small to split runs on the caller's thread."""
    import threading

    seen = set()

    def spy(b, h, q_idx, kv_idx):
        seen.add(threading.current_thread().name)
        return np.ones((q_idx.shape[0], kv_idx.shape[1]), dtype=bool)

    q = np.ones((1, 4, 64, 8), np.float32)
    attnkit.flash_attention(q, q, q, mask_mod=spy, num_threads=2, block_q=16, block_k=16)
    assert seen == {threading.current_thread().name}


def test_work_one_thread_runs_is_planned_for_one_thread(monkeypatch):
    """Threads never hurt: a call too small to split (a decode step over a 4096-key
    cache, GQA) runs the same tasks at num_threads=2 as at 1, the three query heads
    of a kv head side by side, not one task per head cut for a second thread that
    never runs (that made it 1.5x slower at 2 threads than at 1); forward and
    backward give bitwise the same answer at both counts."""
    from attnkit.functional import flash

    calls = []
    real = flash.forward.run_tasks

    def spy(tasks, fn, threads):
        calls.append((len(tasks), threads))
        return real(tasks, fn, threads)

    monkeypatch.setattr(flash.forward, "run_tasks", spy)
    monkeypatch.setattr(flash.backward, "run_tasks", spy)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 9, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 3, 4096, 16)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal((1, 9, 1, 16)).astype(np.float32)
    results = {}
    for threads in (1, 2):
        calls.clear()
        res = attnkit.flash_attention(q, k, v, enable_gqa=True, num_threads=threads, return_lse=True)
        grads = attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)
        results[threads] = (res.output, *grads)
        assert calls[0] == (3, 1)  # forward: 3 tasks (one per kv head) on one thread
        assert calls[1][1] == 1  # backward: one thread
    for one, two in zip(results[1], results[2]):
        np.testing.assert_array_equal(one, two)


def test_mods_are_read_through_their_protocols():
    """Any object with a band (and rest) is a banded mask mod, any with grad a
    differentiable score mod; flash reads them by isinstance, a plain function is neither."""

    class Diagonal:  # allows only kv == q: a band (0, 0), exact
        band, rest = (0, 0, True), None

        def __call__(self, b, h, q_idx, kv_idx):
            raise AssertionError("an exact band is never evaluated")

    assert isinstance(Diagonal(), mods.BandedMaskMod)
    assert not isinstance(lambda b, h, q, kv: q >= kv, mods.BandedMaskMod)
    assert isinstance(mods.softcap(3.0), mods.DifferentiableScoreMod)
    assert isinstance(mods.causal("bottom_right"), mods.BindsLengths)
    rng = np.random.default_rng(23)
    q, k, v = (rng.standard_normal((2, 9, 4)) for _ in range(3))
    np.testing.assert_allclose(attnkit.flash_attention(q, k, v, mask_mod=Diagonal(), block_q=2, block_k=3), v,
                               rtol=1e-12, atol=1e-12)
