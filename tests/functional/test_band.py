"""attnkit.functional.band: the one causal / sliding-window band, and everything that reads it.

Oracles: the band written out per pair in float64 positions, gradcheck for
attnkit.torch.flash_attention's `window` (tests/torch/test_torch_flash.py compares it
with torch SDPA on the equivalent dense mask), and every entry point's errors
against attnkit.functional's.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.functional.band import ALIGNMENTS, Band, alignment_offset, check_window
from conftest import optional

torch = optional("torch")
at = importlib.import_module("attnkit.torch") if torch else None
distributed = importlib.import_module("attnkit.torch.distributed") if torch else None


def _reference(L, S, *, is_causal, align, window) -> np.ndarray:
    """The band as the math reads, pair by pair, on float64 positions: query i stands at
    key position i (+ S - L bottom-right) and sees keys pos - left .. pos + right, and
    none after pos when causal."""
    left, right = (None, None) if window is None else (window, 0) if isinstance(window, int) else window
    pos = np.arange(L, dtype=np.float64)[:, None] + (float(S - L) if align == "bottom_right" else 0.0)
    key = np.arange(S, dtype=np.float64)[None, :]
    allowed = np.ones((L, S), dtype=bool)
    if is_causal:
        allowed &= key <= pos
    if left is not None:
        allowed &= key >= pos - left
    if right is not None:
        allowed &= key <= pos + right
    return allowed


windows = st.one_of(
    st.none(),
    st.integers(0, 50),
    st.tuples(st.one_of(st.none(), st.integers(0, 50)), st.one_of(st.none(), st.integers(0, 50))),
)


@settings(max_examples=200, deadline=None)
@given(L=st.integers(0, 40), S=st.integers(0, 40), is_causal=st.booleans(), align=st.sampled_from(ALIGNMENTS),
       window=windows)
def test_dense_mask_is_the_band_written_out(L, S, is_causal, align, window):
    band = Band.from_options(is_causal=is_causal, causal_align=align, window=window, L=L, S=S)
    want = _reference(L, S, is_causal=is_causal, align=align, window=window)
    np.testing.assert_array_equal(band.dense(L, S), want)
    assert band.excludes_nothing(L, S) == bool(want.all())


@pytest.mark.parametrize("L,S", [(7, 3), (3, 7), (6, 6), (1, 9), (9, 1)], ids=lambda n: str(n))
@pytest.mark.parametrize("window", [None, 1, 0, (1, 1), (0, 0), (20, None), (None, 2), 100], ids=str)
@pytest.mark.parametrize("align", ALIGNMENTS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_dense_mask_edge_cases(L, S, window, align, is_causal):
    """L > S, L < S, a window wider than S, a window of one key: as written out, and as
    masks.causal_mask / sliding_window_mask give them."""
    band = Band.from_options(is_causal=is_causal, causal_align=align, window=window, L=L, S=S)
    np.testing.assert_array_equal(band.dense(L, S), _reference(L, S, is_causal=is_causal, align=align, window=window))
    if is_causal and window is None:
        np.testing.assert_array_equal(band.dense(L, S), masks.causal_mask(L, S, align=align))
    if not is_causal and window is not None:
        left, right = check_window(window)
        if right is not None:
            np.testing.assert_array_equal(band.dense(L, S),
                                          masks.sliding_window_mask(L, S, left=left, right=right, align=align))


@settings(max_examples=150, deadline=None)
@given(L=st.integers(1, 30), S=st.integers(1, 30), is_causal=st.booleans(), align=st.sampled_from(ALIGNMENTS),
       window=windows, data=st.data())
def test_ranges_and_tiles_agree_with_the_dense_mask(L, S, is_causal, align, window, data):
    band = Band.from_options(is_causal=is_causal, causal_align=align, window=window, L=L, S=S)
    dense = band.dense(L, S)
    q0 = data.draw(st.integers(0, L - 1))
    q1 = data.draw(st.integers(q0 + 1, L))
    k0 = data.draw(st.integers(0, S - 1))
    k1 = data.draw(st.integers(k0 + 1, S))

    def span(flags):  # [first, last + 1) of the True entries, or an empty range
        hit = np.flatnonzero(flags)
        return (int(hit[0]), int(hit[-1]) + 1) if hit.size else None

    start, stop = band.kv_range(q0, q1, S)  # the keys any of these queries sees
    seen = span(dense[q0:q1].any(axis=0))
    assert (start, stop) == seen if seen else stop == start
    start, stop = band.q_range(k0, k1, L)  # the queries that see any of these keys
    seen = span(dense[:, k0:k1].any(axis=1))
    assert (start, stop) == seen if seen else stop == start
    c0, c1 = band.tile_cols(q0, q1, k0, k1)
    seen = span(dense[q0:q1, k0:k1].any(axis=0))
    assert (c0 - k0, c1 - k0) == seen if seen else c1 == c0
    start, stop = band.shared_kv_range(q0, q1, k0, k1)  # the keys every one of these queries sees
    every = dense[q0:q1, k0:k1].all(axis=0)
    assert (start - k0, stop - k0) == span(every) if every.any() else stop == start
    tile = dense[q0:q1, k0:k1]
    assert band.tile(q0, q1, k0, k1) == ("inside" if tile.all() else "outside" if not tile.any() else "partial")
    local = band.shifted(q0, k0)  # the same pairs on the tile's own positions
    np.testing.assert_array_equal(local.dense(q1 - q0, k1 - k0), tile)


def test_band_values():
    assert Band.from_options(L=4, S=9) == Band() and not Band().bounded
    assert Band.from_options(is_causal=True, causal_align="bottom_right", L=4, S=9) == Band(None, 5)
    assert Band.from_options(window=3, L=4, S=9) == Band(-3, 0)
    assert Band.from_options(is_causal=True, window=(2, 5), causal_align="bottom_right", L=4, S=9) == Band(3, 5)
    assert Band(-3, 0).intersect(Band(None, -1)) == Band(-3, -1)
    assert alignment_offset(4, 9, "bottom_right") == 5 and alignment_offset(4, 9, "top_left") == 0


# ----------------------------------------------------------------------------- one set of errors


BAD = [
    dict(window="wide"),
    dict(window=(1, 2, 3)),
    dict(window=(1.5, 0)),
    dict(window=(0, True)),
    dict(window=-2),
    dict(window=(3, -1)),
    dict(causal_align="middle"),
    dict(causal_align=None),
    dict(is_causal="yes"),
]


def _error(call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("bad", BAD, ids=str)
def test_every_entry_point_raises_the_same_error(bad):
    """functional.scaled_dot_product_attention is the reference; flash_attention, the band
    itself, attnkit.torch.flash_attention and torch.distributed's entry check (the window:
    it has no alignment) raise the same type with the same message."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    want = _error(lambda: attnkit.scaled_dot_product_attention(q, k, v, **bad))
    assert _error(lambda: attnkit.flash_attention(q, k, v, **bad)) == want
    assert _error(lambda: Band.from_options(L=5, S=5, **bad)) == want
    if torch is None:
        return
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    assert _error(lambda: at.flash_attention(tq, tk, tv, **bad)) == want
    if "window" in bad:  # checked on each rank before any collective: no process group needed
        assert _error(lambda: distributed.ring_attention(tq, tk, tv, window=bad["window"])) == want
        assert _error(lambda: distributed.ulysses_attention(tq, tk, tv, window=bad["window"])) == want


# ----------------------------------------------------------------------------- attnkit.torch.flash_attention(window=)


def _qkv(B, Hq, Hkv, L, S, E, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, E, generator=g, dtype=torch.float64) for H, N in ((Hq, L), (Hkv, S), (Hkv, S))]


def test_torch_flash_window_gradcheck(torch):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 9, 11, 3, seed=2))

    def fn(q, k, v):
        return at.flash_attention(q, k, v, is_causal=True, causal_align="bottom_right", window=(3, None),
                                  block_q=4, block_k=3)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8)


def test_torch_flash_skips_the_tiles_outside_the_window(torch, monkeypatch):
    """Forward and backward compute only tiles the band reaches: with a window of 8 over
    L = S = 256 and 16 x 16 tiles, 2 tiles per block row, not 16."""
    from attnkit.torch import flash as torch_flash

    computed = []
    real = torch_flash._scores
    monkeypatch.setattr(torch_flash, "_scores", lambda *a, **kw: computed.append(1) or real(*a, **kw))
    q, k, v = (t.float().requires_grad_() for t in _qkv(1, 1, 1, 256, 256, 8, seed=3))
    out = at.flash_attention(q, k, v, is_causal=True, window=8, block_q=16, block_k=16)
    assert len(computed) == 16 * 2 - 1  # the first block row has one tile
    out.sum().backward()
    assert len(computed) == 2 * (16 * 2 - 1)
