"""Local (sliding-window) and global layers in the views: `AttentionMaps.windows` in the
labels, the cells a window hides (`outside_window`, kept through `hide_special`), the
window's tint and edge on a head's PNG and the grid, the HTML's layer names, and
`attnkit show --model gemma3` marking Gemma 3's layers."""

from __future__ import annotations

import re

import numpy as np
import pytest
from typer.testing import CliRunner

from attnkit.viz.data import AttentionMaps

TOKENS = ("<bos>", "a", "b", "c", "d", "e", "f", "g")


def causal_maps(windows=(3, None), tokens=TOKENS) -> AttentionMaps:
    """Two layers of two heads over `tokens`, each row uniform over what its layer may see."""
    T = len(tokens)
    weights = np.zeros((len(windows), 2, T, T), np.float32)
    for layer, window in enumerate(windows):
        for i in range(T):
            first = 0 if window is None else max(0, i - window + 1)
            weights[layer, :, i, first: i + 1] = 1.0 / (i + 1 - first)
    return AttentionMaps(tokens=tokens, weights=weights, model="tiny", causal=True, windows=windows)


def test_labels_say_local_or_global():
    maps = causal_maps()
    assert maps.label(0, 1) == "layer 0 (local: window 3), head 1"
    assert maps.label(1, None) == "layer 1 (global), mean of 2 heads"
    assert maps.window_of(0) == 3 and maps.window_of(-1) is None
    named = AttentionMaps(tokens=TOKENS, weights=maps.weights, windows=(3, None), layer_names=("x", "y"))
    assert named.label(0, 0) == "layer 0 (x, local: window 3), head 0"
    plain = AttentionMaps(tokens=TOKENS, weights=maps.weights, windows=(None, None))
    assert plain.windows is None and plain.label(0, 0) == "layer 0, head 0"
    rollout = AttentionMaps(tokens=TOKENS, weights=maps.weights, windows=(3, None), meta={"kind": "rollout"})
    assert rollout.label(0, None) == "layer 0, all heads"  # through every layer below: no one window


def test_outside_window_is_what_the_band_hides():
    maps = causal_maps()
    outside = maps.outside_window(0)
    T = len(TOKENS)
    i, j = np.indices((T, T))
    np.testing.assert_array_equal(outside, j <= i - 3)
    assert not (maps.weights[0][:, outside] != 0).any()  # a windowed head puts no weight there
    assert maps.outside_window(1) is None  # global
    assert causal_maps(windows=(T, None)).outside_window(0) is None  # the window reaches every key shown


def test_hide_special_keeps_the_window_on_the_original_positions():
    shown = causal_maps().hide_special()  # drops <bos>: positions 1..7
    assert shown.positions == tuple(range(1, len(TOKENS)))
    i, j = np.indices((len(TOKENS) - 1, len(TOKENS) - 1))
    np.testing.assert_array_equal(shown.outside_window(0), j <= i - 3)  # the same offsets
    gapped = AttentionMaps(tokens=("a", "<|x|>", "b", "c", "d"), weights=np.full((1, 1, 5, 5), 0.2, np.float32),
                           windows=(2,), causal=True).hide_special()  # drops a and <|x|>: b, c, d at 2, 3, 4
    np.testing.assert_array_equal(gapped.outside_window(0), np.array([[0, 0, 0], [0, 0, 0], [1, 0, 0]], bool))


@pytest.mark.parametrize("windows, message", [
    ((3,), r"expected 2 windows like layers, got 1"),
    ((0, None), r"expected each window to be a positive int or None, got 0"),
    ((2.5, None), r"expected each window to be a positive int or None, got 2.5"),
])
def test_windows_are_checked(windows, message):
    with pytest.raises(ValueError, match=re.escape(message) if "(" not in message else message):
        AttentionMaps(tokens=TOKENS, weights=causal_maps().weights, windows=windows)
    with pytest.raises(ValueError, match="increasing positions"):
        AttentionMaps(tokens=TOKENS[:2], weights=np.ones((1, 1, 2, 2)), positions=(1, 1))


def _colour_count(image: np.ndarray, rgb, tolerance: float = 0.02) -> int:
    return int((np.abs(image[..., :3] - np.asarray(rgb)) < tolerance).all(axis=-1).sum())


def test_png_tints_a_local_heads_hidden_cells_and_draws_the_edge(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from attnkit.viz.png import MASKED_GREY, WINDOW_EDGE, WINDOW_TINT, grid_image, save_grid_png, save_head_png

    maps = causal_maps()
    save_head_png(maps, tmp_path / "local.png", 0, 0)
    save_head_png(maps, tmp_path / "global.png", 1, 0)
    local, global_ = (matplotlib.image.imread(tmp_path / name) for name in ("local.png", "global.png"))
    assert _colour_count(local, WINDOW_TINT) > 500 and _colour_count(local, WINDOW_EDGE, 0.15) > 200
    assert _colour_count(global_, WINDOW_TINT) == 0 and _colour_count(global_, WINDOW_EDGE, 0.15) == 0
    assert _colour_count(local, MASKED_GREY) > 500  # the later tokens stay grey
    mosaic = grid_image(maps, 32)
    tint = np.rint(np.asarray(WINDOW_TINT) * 255)
    rows = (np.abs(mosaic - tint) < 1).all(axis=-1).any(axis=1)  # mosaic rows holding tinted pixels
    assert rows[:32].any() and not rows[40:].any()  # layer 0's thumbnails only
    width, height = save_grid_png(maps, tmp_path / "grid.png")
    assert (width, height) == matplotlib.image.imread(tmp_path / "grid.png").shape[1::-1]


def test_html_names_local_and_global_layers():
    from attnkit.viz.html import doc_payload

    payload = doc_payload(causal_maps())
    assert payload["layer_names"] == ["local: window 3", "global"] and payload["windows"] == [3, None]
    assert doc_payload(causal_maps(windows=(None, None)))["layer_names"] is None


@pytest.mark.slow  # over 2 s in the quick loop (2-core Xeon, 2026-12-08)
def test_show_gemma3_marks_local_and_global_layers(gemma3_file, tmp_path):
    """The embedded Gemma 3: layer 0 local (512), layer 5 global, the summary says which."""
    from attnkit.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["show", "The capital of France is", "--model", "gemma3", "--no-color",
                                 "--png", str(tmp_path / "g.png")])
    assert result.exit_code == 0, result.output
    assert "gemma3: layer 0 (local: window 512), head 0" in result.stdout
    assert "Layers 5, 11, 17 global; the others local (sliding window of 512 tokens)." in result.stdout
    result = runner.invoke(app, ["show", "The capital of France is", "--model", "gemma3", "--no-color", "--layer",
                                 "5", "--no-summary"])
    assert result.exit_code == 0 and "gemma3: layer 5 (global), head 0" in result.stdout
