"""Pictures that explain themselves: column labels with a key in the terminal, a colour bar and
the pattern letters' legend on every PNG, readable letters, hidden special tokens with
renormalised rows, a log colour scale, and colour only where a terminal can show it."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from attnkit.viz.data import AttentionMaps, looks_special, maps_from_random_model
from attnkit.viz.terminal import SHADES, colour_scale, heatmap

runner = CliRunner()


def render(renderable, width=80) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


# ----------------------------------------------------------------------------- terminal labels


def test_columns_are_numbered_across_and_rows_carry_the_key():
    tokens = ["[CLS]", "the", "cat", "sat", "[SEP]"]
    w = np.eye(5)[[0, 0, 1, 2, 3]]  # a previous-token head
    lines = render(heatmap(w, tokens, color=False), 60).splitlines()
    assert lines[0].split() == ["0", "1", "2", "3", "4"]  # one header line: the numbers fit their cells
    rows = [line for line in lines if line.split()[:1] and line.split()[0] in tokens]
    assert [r.split()[:2] for r in rows] == [[t, str(i)] for i, t in enumerate(tokens)]
    start = lines[0].index("0")  # each number sits over its own column's first cell
    for i, row in enumerate(rows):
        j = int(np.argmax(w[i]))
        assert row[start + 2 * j] == "█" and row[start + 2 * j - 1] != "█"
    assert any("numbered" in line and "same numbers" in line for line in lines)  # the key


def test_two_digit_numbers_stagger_over_two_lines_and_stay_over_their_columns():
    tokens = [f"w{i}" for i in range(14)]
    w = np.eye(14)
    lines = render(heatmap(w, tokens, color=False), 80).splitlines()
    even, odd = lines[0], lines[1]
    assert even.split() == [str(i) for i in range(0, 14, 2)]
    assert odd.split() == [str(i) for i in range(1, 14, 2)]
    start = even.index("0")
    for i in (10, 11, 13):
        header = even if i % 2 == 0 else odd
        assert header[start + 2 * i:].startswith(str(i))
        row = next(line for line in lines if re.match(rf"^\s*w{i} {i} ", line))
        assert row[start + 2 * i] == "█"


def test_log_scale_separates_small_weights_and_says_so():
    w = np.array([[1.0, 1e-2, 1e-4], [1e-3, 1.0, 0.0], [0.5, 0.5, 0.0]])
    np.testing.assert_allclose(colour_scale(w, 1.0, log_scale=True)[0], [1.0, 1 / 3, 0.0], atol=1e-12)
    assert colour_scale(w, 1.0, log_scale=True)[1, 2] == 0.0  # a zero weight: the lowest colour
    linear = render(heatmap(w, list("abc"), color=False))
    log = render(heatmap(w, list("abc"), color=False, log_scale=True))
    assert "(log scale)" in log and "' '=1.0e-03" in log and "(log scale)" not in linear
    row_a = next(line for line in log.splitlines() if re.match(r"^\s*a 0 ", line))
    assert SHADES[1] in row_a or SHADES[2] in row_a  # 1e-2 shows on a log scale...
    row_a = next(line for line in linear.splitlines() if re.match(r"^\s*a 0 ", line))
    assert row_a.rstrip().endswith("██")  # ...and not on a linear one (only the 1.0 cell)


# ----------------------------------------------------------------------------- hiding special tokens


def test_hide_special_drops_rows_and_columns_and_renormalises_each_row():
    rng = np.random.default_rng(0)
    w = rng.random((2, 3, 5, 5))
    w /= w.sum(-1, keepdims=True)
    maps = AttentionMaps(tokens=["[CLS]", "a", "b", "c", "[SEP]"], weights=w.astype(np.float32))
    assert maps.special == (True, False, False, False, True)
    shown = maps.hide_special()
    assert shown.tokens == ("a", "b", "c") and shown.hidden == 2
    assert shown.hidden_note == "2 special tokens hidden, rows renormalised"
    kept = w[:, :, 1:4, 1:4]
    np.testing.assert_allclose(shown.weights, kept / kept.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(shown.weights.sum(-1), 1.0, rtol=1e-6)
    assert shown.hide_special() is shown  # nothing left to hide


def test_a_causal_model_hides_its_first_token_the_sink_and_never_every_token():
    maps = maps_from_random_model(["The", "cat", "sat"], causal=True)
    shown = maps.hide_special()
    assert shown.tokens == ("cat", "sat") and shown.hidden_note.startswith("1 special or first token")
    assert np.all(np.triu(shown.weights, k=1) == 0)  # still causal
    np.testing.assert_allclose(shown.weights[..., 0, 0], 1.0, rtol=1e-6)  # 'cat' sees only itself now
    only = AttentionMaps(tokens=["[CLS]", "[SEP]"], weights=np.full((1, 1, 2, 2), 0.5))
    assert only.hide_special().tokens == ("[SEP]",)


def test_special_tokens_are_read_from_their_text_or_given():
    assert [looks_special(t) for t in ["[CLS]", "<|im_end|>", "</s>", "<pad>", "[red]", "<b>", "cat"]] == [
        True, True, True, True, False, False, False]
    maps = AttentionMaps(tokens=["x", "[CLS]"], weights=np.full((1, 1, 2, 2), 0.5), special=[True, False])
    assert maps.hide_special().tokens == ("[CLS]",)
    with pytest.raises(ValueError, match="2 special flags like tokens, got 1"):
        AttentionMaps(tokens=["x", "y"], weights=np.full((1, 1, 2, 2), 0.5), special=[True])


@pytest.mark.slow
def test_the_models_name_their_special_tokens(minilm_folder, smollm2_file):
    from attnkit.viz.providers import get_provider

    minilm = get_provider("minilm").attention("The cat sat.")
    assert [t for t, s in zip(minilm.tokens, minilm.special) if s] == ["[CLS]", "[SEP]"]
    smollm2 = get_provider("smollm2").attention("Hi <|im_start|> there")  # the tokenizer's own special token
    assert [t for t, s in zip(smollm2.tokens, smollm2.special) if s] == ["<|im_start|>"]
    assert list(smollm2.hide_special().tokens) == [" ", " there"]  # and the first token, the sink


# ----------------------------------------------------------------------------- PNG


@pytest.fixture
def figures(monkeypatch):
    """Every figure a PNG writer saves, drawn, so its texts and axes can be inspected."""
    import attnkit.viz.png as png

    saved = []
    real = png._save

    def keep(fig, path, dpi):
        real(fig, path, dpi)
        saved.append(fig)

    monkeypatch.setattr(png, "_save", keep)
    return saved


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.texts] + [t.get_text() for ax in fig.axes for t in ax.texts]


def test_every_png_has_a_colour_bar_and_the_letters_legend(tmp_path, figures):
    from attnkit.viz.png import LETTER_LEGEND, save_grid_png, save_head_png

    maps = maps_from_random_model(["[CLS]", "the", "cat", "sat", "[SEP]"], layers=2, heads=3)
    save_head_png(maps, tmp_path / "h.png", 1, 2)
    save_head_png(maps.hide_special(), tmp_path / "hl.png", 0, None, log_scale=True)
    save_grid_png(maps, tmp_path / "g.png")
    save_grid_png(maps, tmp_path / "gl.png", log_scale=True)
    for fig in figures:
        bars = [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]
        assert len(bars) == 1, fig
        assert LETTER_LEGEND in _texts(fig)
    head, hidden, grid, grid_log = figures
    assert any(t.startswith(("Pattern ", "No single pattern")) for t in _texts(head))
    assert "2 special tokens hidden, rows renormalised" in hidden.axes[0].get_title()
    assert "(log scale)" in hidden.axes[1].get_ylabel()
    assert [t.get_text() for t in grid_log.axes[1].get_yticklabels()] == ["max/10^3", "max"]


def test_grid_letters_sit_on_a_dark_badge_and_the_title_clears_the_column_labels(tmp_path, figures):
    from attnkit.viz.png import save_grid_png

    T = 6
    first = np.zeros((T, T))
    first[:, 0] = 1.0  # a first-token head: its left column is the brightest yellow, under the letter
    weights = np.broadcast_to(first, (2, 3, T, T)).copy()
    maps = AttentionMaps(tokens=[f"t{i}" for i in range(T)], weights=weights, model="m")
    save_grid_png(maps, tmp_path / "g.png")
    fig = figures[0]
    letters = fig.axes[0].texts
    assert [t.get_text() for t in letters] == ["F"] * 6
    for letter in letters:
        badge = letter.get_bbox_patch()
        assert badge is not None and badge.get_facecolor()[:3] == (0.0, 0.0, 0.0) and letter.get_color() == "white"
    renderer = fig.canvas.get_renderer()
    title = next(t for t in fig.texts if t.get_text().startswith("m: all heads"))
    labels = [t for t in fig.axes[0].get_xticklabels() if t.get_text()]
    top_of_labels = max(t.get_window_extent(renderer).y1 for t in labels)
    assert title.get_window_extent(renderer).y0 > top_of_labels  # no overlap
    # Pixels: around each letter the badge is dark, and the letter white.
    from PIL import Image

    image = np.asarray(Image.open(tmp_path / "g.png").convert("RGB")).astype(int)
    box = letters[0].get_bbox_patch().get_window_extent(renderer)
    h = image.shape[0]
    patch = image[int(h - box.y1) + 2: int(h - box.y0) - 2, int(box.x0) + 2: int(box.x1) - 2]
    assert patch.size and (patch.max(-1) < 100).mean() > 0.3  # mostly dark (on yellow): the badge
    assert (patch.min(-1) > 200).any()  # and white: the letter


def _first_token_maps(causal: bool, T: int = 6) -> AttentionMaps:
    """Every head puts all its weight on the first token: weight 0 everywhere else, and in a
    causal model the cells above the diagonal masked."""
    first = np.zeros((T, T))
    first[:, 0] = 1.0
    return AttentionMaps(tokens=[f"t{i}" for i in range(T)], weights=np.broadcast_to(first, (2, 3, T, T)).copy(),
                         model="m", causal=causal)


def _pixel(image: np.ndarray, fig, ax, x: float, y: float) -> np.ndarray:
    """The RGB of the PNG at data point (x, y) of `ax`."""
    px, py = ax.transData.transform((x, y))
    return image[int(round(image.shape[0] - py)), int(round(px))]


@pytest.mark.parametrize("causal", [True, False])
def test_masked_cells_are_grey_and_weight_0_keeps_the_lowest_colour(tmp_path, figures, causal):
    """A causal model cannot attend to later tokens: those cells are excluded, not weighted 0,
    and every PNG draws them apart (grey, with a key); a model that attends everywhere has none."""
    from matplotlib import colormaps
    from PIL import Image

    from attnkit.viz.png import BADGE_BAND_PIXELS, MASKED_GREY, MASKED_KEY, THUMBNAIL_PIXELS, save_grid_png, save_head_png

    maps = _first_token_maps(causal)
    save_head_png(maps, tmp_path / "h.png", 0, 0)
    save_grid_png(maps, tmp_path / "g.png")
    save_head_png(maps.hide_special(), tmp_path / "hidden.png", 0, None, log_scale=True)
    grey = np.rint(np.array(MASKED_GREY) * 255)
    lowest = np.rint(np.array(colormaps["viridis"](0.0)[:3]) * 255)  # matplotlib's colour of weight 0
    cell = THUMBNAIL_PIXELS / 6  # a grid thumbnail of 6 tokens: 16 pixels a cell
    for fig, name in zip(figures, ("h.png", "g.png", "hidden.png")):
        image = np.asarray(Image.open(tmp_path / name).convert("RGB")).astype(float)
        ax = fig.axes[0]
        if name == "g.png":  # the thumbnail of L1 h2: row 1, column 4 is above the diagonal; row 4, column 2 below
            top, left = BADGE_BAND_PIXELS + (BADGE_BAND_PIXELS + THUMBNAIL_PIXELS + 8), 2 * (THUMBNAIL_PIXELS + 8)
            above = _pixel(image, fig, ax, left + 4.5 * cell, top + 1.5 * cell)
            below = _pixel(image, fig, ax, left + 2.5 * cell, top + 4.5 * cell)
        else:
            above, below = _pixel(image, fig, ax, 4, 1), _pixel(image, fig, ax, 2, 4)
        assert np.abs(below - lowest).max() <= 2, name  # weight 0, allowed: the scale's lowest colour
        if causal:
            assert np.abs(above - grey).max() <= 2, name  # masked: grey
            assert np.abs(above - below).sum() > 200, name  # told apart at a glance
            assert MASKED_KEY in _texts(fig)
        else:
            assert np.abs(above - lowest).max() <= 2, name
            assert MASKED_KEY not in _texts(fig)


def test_grid_letters_sit_outside_every_thumbnail(tmp_path, figures):
    """The "F" of a first-token head once covered the first-token column it names: every badge
    now lies in the band above its thumbnail, inside the mosaic, clear of all cells."""
    from matplotlib.transforms import Bbox

    from attnkit.viz.png import BADGE_BAND_PIXELS, THUMBNAIL_PIXELS, save_grid_png

    maps = _first_token_maps(causal=False)
    save_grid_png(maps, tmp_path / "g.png")
    fig = figures[0]
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    thumbnails = []
    for layer in range(2):
        for head in range(3):
            top = BADGE_BAND_PIXELS + layer * (BADGE_BAND_PIXELS + THUMBNAIL_PIXELS + 8)
            left = head * (THUMBNAIL_PIXELS + 8)
            corners = ax.transData.transform([(left - 0.5, top - 0.5), (left + THUMBNAIL_PIXELS - 0.5,
                                                                          top + THUMBNAIL_PIXELS - 0.5)])
            thumbnails.append(Bbox.from_extents(*corners.min(0), *corners.max(0)))
    badges = [t.get_bbox_patch().get_window_extent(renderer) for t in ax.texts]
    assert len(badges) == 6
    axes_box = ax.get_window_extent(renderer)
    for index, badge in enumerate(badges):
        assert not any(badge.overlaps(thumbnail) for thumbnail in thumbnails), index
        assert badge.y0 >= thumbnails[index].y1 and badge.x0 >= thumbnails[index].x0  # above its own
        assert axes_box.y1 >= badge.y1  # under the column labels, which sit above the mosaic
    labels = [t.get_window_extent(renderer) for t in ax.get_yticklabels() if t.get_text()]
    for label, thumbnail in zip(labels, thumbnails[::3]):  # L0, L1 centred on their thumbnails' rows
        assert abs((label.y0 + label.y1) / 2 - (thumbnail.y0 + thumbnail.y1) / 2) < 2


# ----------------------------------------------------------------------------- HTML


def test_the_page_carries_what_to_hide_and_its_two_checkboxes():
    from attnkit.viz.html import payload, render_html

    maps = maps_from_random_model(["[CLS]", "a", "b", "[SEP]"])
    assert payload(maps)["docs"][0]["hide"] == [0, 3]
    causal = maps_from_random_model(["x", "a", "b"], causal=True)
    assert payload(causal)["docs"][0]["hide"] == [0]
    page = render_html(maps, hide_special=True, log_scale=False)
    assert '"options":{"hide_special":true,"log_scale":false}' in page
    assert 'id="hide-special"' in page and 'id="log-scale"' in page
    with pytest.raises(ValueError, match="view 'all', 'head' or 'model'"):
        render_html(maps, view="grid")


# ----------------------------------------------------------------------------- the CLI


def cli(*args, env=None):
    from attnkit.cli import app

    return runner.invoke(app, list(args), env={"COLUMNS": "100", "NO_COLOR": "1", **(env or {})})


def test_show_hide_special_and_log_scale(tmp_path):
    result = cli("show", "[CLS] the cat sat [SEP]", "-m", "random", "--hide-special", "--log-scale",
                 "--png", str(tmp_path / "v.png"), "--html", str(tmp_path / "v.html"))
    assert result.exit_code == 0, result.output
    assert "random: layer 0, head 0 (2 special tokens hidden, rows renormalised)" in result.stdout
    assert "(log scale)" in result.stdout
    assert "[CLS]" not in result.stdout.split("What each head does")[0].split("\n", 1)[1]
    assert '"hide_special":true,"log_scale":true' in (tmp_path / "v.html").read_text(encoding="utf-8")
    result = cli("compare", "[CLS] a b [SEP]", "[CLS] a c [SEP]", "-m", "random", "--hide-special")
    # both sides say so (side-by-side titles are cut to the column width, which the runner's terminal sets)
    assert result.exit_code == 0 and result.stdout.count("(2 special to") == 2


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_demo_piped_or_without_colour_draws_shades_not_blank_cells(env):
    """`attnkit demo | less` and `NO_COLOR=1 attnkit demo`: the heatmaps have their shades."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    done = subprocess.run([sys.executable, "-m", "attnkit", "demo", "--text", "a b c d"], capture_output=True,
                          text=True, env={**run_env, **env}, check=True)
    heat_rows = [line for line in done.stdout.splitlines() if re.match(r"^\s*[abcd] \d ", line)]
    assert len(heat_rows) == 4 * 5  # one head, then four: 4 rows each
    assert all(any(ch in line for ch in SHADES[1:]) for line in heat_rows)
    assert "\x1b" not in done.stdout


def test_demo_in_a_colour_terminal_uses_colour():
    run_env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    done = subprocess.run([sys.executable, "-m", "attnkit", "demo", "--text", "a b c"], capture_output=True,
                          text=True, check=True,
                          env={**run_env, "FORCE_COLOR": "1", "COLORTERM": "truecolor", "TERM": "xterm-256color"})
    assert "48;2;" in done.stdout  # truecolor cells
    assert not any(ch in done.stdout for ch in SHADES[1:4])
