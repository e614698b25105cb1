"""PNG views (matplotlib, imported only here): one head, and all heads as a grid.

Figures are built on `matplotlib.figure.Figure` with the Agg canvas, never
pyplot, so nothing global changes and no window opens. Sizes are exact
(no tight bounding box): a file's pixel size is `figure_size(...) * dpi`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np

from attnkit.viz.data import AttentionMaps
from attnkit.viz.summary import summarize_heads
from attnkit.viz.terminal import LOG_DECADES, colour_scale, viridis
from attnkit.viz.text import printable, token_label

INCHES_PER_TOKEN = 0.11  # one tick label per token: ~8 pt apart
MAX_MATRIX_INCHES = 57.0  # 512 tokens still get a label each
MIN_MATRIX_INCHES = 4.0
THUMBNAIL_PIXELS = 96
_GAP_PIXELS = 8
BADGE_BAND_PIXELS = 22
"""The band above each row of thumbnails that holds their pattern letters, so that a letter
never covers a thumbnail's cells (its first-token column least of all)."""
MASKED_GREY = (0.82, 0.82, 0.82)
"""The colour of the cells a causal model cannot attend to (a later token): excluded, which is
not the same as weight 0 (the lowest colour of the scale)."""
MASKED_KEY = "masked\n(later token)"
"""The words beside the grey square that every PNG of a causal model carries."""
WINDOW_TINT = (0.93, 0.86, 0.74)
"""The colour of the cells a local layer's window hides (keys older than the window)."""
WINDOW_EDGE = (0.85, 0.1, 0.1)
"""The colour of the line drawn along a local layer's window edge."""


def _label_font(inches_per_token: float) -> float:
    return float(np.clip(inches_per_token * 72 * 0.8, 5.0, 10.0))


def head_figure_size(tokens: tuple[str, ...] | list[str]) -> tuple[float, float, dict]:
    """(width, height) in inches of `save_head_png`'s figure, and its layout."""
    T = len(tokens)
    side = float(np.clip(T * INCHES_PER_TOKEN, MIN_MATRIX_INCHES, MAX_MATRIX_INCHES))
    font = _label_font(side / T)
    chars = min(16, max(len(t) for t in tokens))
    margin = 0.6 + chars * font / 72 * 0.62  # room for the longest tick label
    # The bottom holds the tick labels, the axis label and two lines of legend (0.45 inch).
    layout = {"side": side, "font": font, "left": margin, "bottom": margin + 0.45, "top": 0.8, "right": 1.3}
    width = layout["left"] + side + layout["right"]
    height = layout["bottom"] + side + layout["top"]
    return width, height, layout


def _short(token: str) -> str:
    """A tick label (`token_label`), at most 16 characters."""
    token = token_label(token)
    return token if len(token) <= 16 else token[:15] + "…"


def _save(fig, path: str | Path, dpi: int) -> None:
    """fig as PNG (whatever the file name's suffix), without warnings about glyphs the font lacks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph .* missing from", category=UserWarning)
        fig.savefig(path, dpi=dpi, format="png")


PATTERN_WORDS = {
    "previous": ("P", "previous token"),
    "first": ("F", "first token"),
    "self": ("S", "itself"),
    "broad": ("B", "broad (near uniform)"),
    "mixed": ("", "mixed"),
}
LETTER_LEGEND = "Letters: P previous token · F first token · S itself · B broad (near uniform) · none: mixed"
"""The legend of the head-pattern letters, as every PNG prints it."""
_BADGE = {"boxstyle": "round,pad=0.18", "facecolor": "black", "alpha": 0.7, "linewidth": 0}


def masked_cells(maps: AttentionMaps) -> np.ndarray | None:
    """(T, T) booleans, True where the query's model could not attend (a causal model: the keys
    after the query); None for a model that attends everywhere."""
    if not maps.causal:
        return None
    T = maps.num_tokens
    return np.triu(np.ones((T, T), dtype=bool), k=1)


def _masked_key(fig, x: float, y: float, width: float, height: float, colour=MASKED_GREY,
                words: str = MASKED_KEY) -> None:
    """A square of `colour` and `words` (default: the grey of `MASKED_KEY`) at (x, y) inches
    from the figure's bottom left."""
    from matplotlib.patches import Rectangle

    fig.add_artist(Rectangle((x / width, y / height), 0.18 / width, 0.18 / height, transform=fig.transFigure,
                             facecolor=colour, edgecolor="0.45", linewidth=0.6))
    fig.text((x + 0.24) / width, (y + 0.09) / height, words, fontsize=7, ha="left", va="center",
             linespacing=1.1)


def _window_edge(ax, outside: np.ndarray) -> None:
    """A line along the window's edge: left of each row's first key inside the window."""
    T = outside.shape[0]
    first = outside.sum(axis=1)  # outside cells are the oldest keys: the first inside is their count
    xs, ys = [], []
    for i in range(T):
        xs += [first[i] - 0.5, first[i] - 0.5]
        ys += [i - 0.5, i + 0.5]
    ax.plot(xs, ys, color=WINDOW_EDGE, linewidth=2.0)


def _pattern_line(maps: AttentionMaps, weights: np.ndarray) -> str:
    """What one (T, T) matrix does, in words: 'P: 99% of the weight on the previous token'."""
    one = AttentionMaps(tokens=maps.tokens, weights=weights[None, None], causal=maps.causal, special=maps.special)
    summary = summarize_heads(one)
    pattern = summary.pattern[0, 0]
    code, words = PATTERN_WORDS[pattern]
    if pattern in ("previous", "first", "self"):
        score = {"previous": summary.previous, "first": summary.first, "self": summary.self}[pattern][0, 0]
        return f"Pattern {code}: {100 * score:.0f}% of each token's weight on {'' if pattern == 'self' else 'the '}{words}"
    detail = f"entropy {summary.entropy[0, 0]:.1f} bits; uniform {summary.max_entropy[0, 0]:.1f}"
    if code:
        return f"Pattern {code}: {words} ({detail})"
    return f"No single pattern: mixed ({detail})"


def _matplotlib():
    """matplotlib, or a `MissingExtraError` naming the extra that installs it."""
    from attnkit.extras import require

    return require("matplotlib", "png", "PNG output")


def _norm(vmax: float, log_scale: bool):
    from matplotlib.colors import LogNorm, Normalize

    if log_scale:
        return LogNorm(vmin=vmax / 10**LOG_DECADES, vmax=vmax, clip=True)
    return Normalize(vmin=0.0, vmax=vmax)


def _viridis():
    from matplotlib import colormaps

    low = colormaps["viridis"](0.0)
    return colormaps["viridis"].with_extremes(bad=low, under=low)  # zeros on a log scale: the lowest colour


def save_head_png(
    maps: AttentionMaps,
    path: str | Path,
    layer: int = 0,
    head: int | None = 0,
    *,
    dpi: int = 100,
    log_scale: bool = False,
) -> tuple[int, int]:
    """Write one head (or a layer's mean when head is None) as a labelled heatmap.

    Rows are queries (the token attending), columns keys (the token attended to);
    every token gets a tick label up to 512 tokens. A colour bar gives the scale
    (linear from 0, or with `log_scale` the 3 decades below the largest weight), and
    two lines under the picture name the head's pattern and the pattern letters. In a
    causal model's picture the cells it cannot attend to (the later tokens) are grey,
    not the colour of weight 0, and a grey square under the colour bar says so.

    Returns:
        The (width, height) of the file in pixels.

    Raises:
        MissingExtraError: matplotlib is not installed (`pip install 'attnkit[png]'`).
    """
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    weights = maps.head(layer, head)  # (T, T); checks the range
    T = maps.num_tokens
    width, height, lay = head_figure_size(maps.tokens)
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes(
        (lay["left"] / width, lay["bottom"] / height, lay["side"] / width, lay["side"] / height)
    )
    vmax = float(weights.max()) if weights.size and weights.max() > 0 else 1.0
    image = ax.imshow(weights, cmap=_viridis(), norm=_norm(vmax, log_scale), interpolation="nearest", aspect="auto")
    masked = masked_cells(maps)
    outside = maps.outside_window(layer)
    if masked is not None and masked.any() or outside is not None:  # the cells the model cannot attend to
        overlay = np.zeros((T, T, 4))  # (T, T, RGBA), transparent where the model may attend
        if masked is not None:
            overlay[masked] = (*MASKED_GREY, 1.0)
        if outside is not None:
            overlay[outside] = (*WINDOW_TINT, 1.0)
        ax.imshow(overlay, interpolation="nearest", aspect="auto")
    if outside is not None:
        _window_edge(ax, outside)
        ax.set_xlim(-0.5, T - 0.5)
        ax.set_ylim(T - 0.5, -0.5)
    step = max(1, math.ceil(T / (MAX_MATRIX_INCHES / INCHES_PER_TOKEN)))
    ticks = np.arange(0, T, step)
    labels = [_short(maps.tokens[i]) for i in ticks]
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, rotation=90, fontsize=lay["font"], parse_math=False)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=lay["font"], parse_math=False)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    title = f"{printable(maps.model)}: {maps.label(layer, head)}"
    ax.set_title(title + (f"\n{maps.hidden_note}" if maps.hidden else ""), parse_math=False,
                 fontsize=10 if maps.hidden else 12)
    cax = fig.add_axes(
        ((lay["left"] + lay["side"] + 0.25) / width, lay["bottom"] / height, 0.2 / width, lay["side"] / height)
    )
    fig.colorbar(image, cax=cax, label="attention weight" + (" (log scale)" if log_scale else ""))
    if masked is not None and masked.any():  # under the colour bar
        _masked_key(fig, lay["left"] + lay["side"] + 0.25, lay["bottom"] - 0.45, width, height)
    if outside is not None:  # under that
        _masked_key(fig, lay["left"] + lay["side"] + 0.25, lay["bottom"] - 0.8, width, height, WINDOW_TINT,
                    f"outside the\nwindow ({maps.window_of(layer)})")
    for line, text in enumerate((_pattern_line(maps, weights), LETTER_LEGEND)):
        fig.text(0.15 / width, (0.32 - 0.18 * line) / height, text, fontsize=8, ha="left", va="center",
                 parse_math=False)
    _save(fig, path, dpi)
    return fig.canvas.get_width_height()


def resample(weights: np.ndarray, size: int) -> np.ndarray:
    """A (T, T) matrix as (size, size): block means when T > size, nearest copy when smaller."""
    T = weights.shape[0]
    if T >= size:
        starts = (np.arange(size) * T) // size
        counts = np.diff(np.append(starts, T))
        summed = np.add.reduceat(np.add.reduceat(weights, starts, axis=0), starts, axis=1)
        return summed / np.outer(counts, counts)
    source = (np.arange(size) * T) // size
    return weights[np.ix_(source, source)]


def grid_image(maps: AttentionMaps, thumbnail: int = THUMBNAIL_PIXELS, *, log_scale: bool = False,
               label_band: int = 0) -> np.ndarray:
    """All heads as one RGB mosaic, (layers x heads) thumbnails, each scaled to its own max.
    In a causal model's thumbnails, the pixels that stand only for cells it cannot attend
    to are `MASKED_GREY`.

    Arguments:
        label_band: white pixels above each row of thumbnails (room for their letters).

    Returns:
        uint8 array of shape (layers * (label_band + thumbnail + gap) - gap, heads * (thumbnail + gap) - gap, 3).
    """
    L, H = maps.num_layers, maps.num_heads
    step = thumbnail + _GAP_PIXELS
    row_step = label_band + step
    mosaic = np.full((L * row_step - _GAP_PIXELS, H * step - _GAP_PIXELS, 3), 255, dtype=np.uint8)
    masked = masked_cells(maps)
    # a pixel is grey when every cell it stands for is masked (a block mean of "may attend" of 0)
    grey = None if masked is None else resample((~masked).astype(np.float64), thumbnail) == 0  # (thumbnail,) * 2
    for layer in range(L):
        outside = maps.outside_window(layer)
        tinted = None if outside is None else resample((~outside).astype(np.float64), thumbnail) == 0
        for head in range(H):
            small = resample(maps.weights[layer, head].astype(np.float64), thumbnail)
            top = float(small.max())
            rgb = viridis(colour_scale(small, top if top > 0 else 1.0, log_scale))
            if grey is not None:
                rgb[grey] = np.rint(np.asarray(MASKED_GREY) * 255).astype(np.uint8)
            if tinted is not None:
                rgb[tinted] = np.rint(np.asarray(WINDOW_TINT) * 255).astype(np.uint8)
            y = layer * row_step + label_band
            mosaic[y : y + thumbnail, head * step : head * step + thumbnail] = rgb
    return mosaic


GRID_MARGINS = {"left": 0.6, "right": 1.1, "top": 0.75, "bottom": 0.75, "min_width": 6.8}
"""Inches around the grid's mosaic: room for the title, the labels, the colour bar and the legend."""


def _grid_left(maps: AttentionMaps) -> float:
    """Inches left of the mosaic: wider where the layer labels say local or global."""
    return GRID_MARGINS["left"] + (0.45 if maps.windows is not None else 0.0)


def _grid_layer_label(maps: AttentionMaps, layer: int) -> str:
    """'L3', or 'L3 local' / 'L5 global' where some layers have windows."""
    if maps.windows is None:
        return f"L{layer}"
    return f"L{layer} " + ("global" if maps.windows[layer] is None else "local")


def grid_figure_size(maps: AttentionMaps, dpi: int = 100) -> tuple[float, float]:
    """(width, height) in inches of `save_grid_png`'s figure."""
    step = THUMBNAIL_PIXELS + _GAP_PIXELS
    cols = maps.num_heads * step - _GAP_PIXELS
    rows = maps.num_layers * (BADGE_BAND_PIXELS + step) - _GAP_PIXELS
    m = GRID_MARGINS
    left = _grid_left(maps)  # the legend's lines start there: the minimum width moves with it
    width = max(left + cols / dpi + m["right"], m["min_width"] + left - m["left"])
    return width, m["top"] + rows / dpi + m["bottom"]


def save_grid_png(maps: AttentionMaps, path: str | Path, *, dpi: int = 100, log_scale: bool = False) -> tuple[int, int]:
    """Write every head as a thumbnail, layers down and heads across.

    Each thumbnail is scaled to its own largest weight (the colour bar: 0 to that
    maximum, or its 3 decades below with `log_scale`); a badge above its top left corner,
    outside its cells, names the head's dominant pattern (P previous, F first, S self,
    B broad), and the legend under the grid says so. A causal model's masked cells are
    grey, as in `save_head_png`.

    Returns:
        The (width, height) of the file in pixels.

    Raises:
        MissingExtraError: matplotlib is not installed (`pip install 'attnkit[png]'`).
    """
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    mosaic = grid_image(maps, log_scale=log_scale, label_band=BADGE_BAND_PIXELS)
    rows, cols = mosaic.shape[:2]
    m = GRID_MARGINS
    width, height = grid_figure_size(maps, dpi)
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    left = _grid_left(maps)
    ax = fig.add_axes((left / width, m["bottom"] / height, cols / dpi / width, rows / dpi / height))
    ax.imshow(mosaic, interpolation="nearest")
    step = THUMBNAIL_PIXELS + _GAP_PIXELS
    row_step = BADGE_BAND_PIXELS + step  # a row: the letters' band, the thumbnails, the gap
    centers = np.arange(THUMBNAIL_PIXELS / 2, step * maps.num_heads, step)[: maps.num_heads]
    ax.set_xticks(centers)
    ax.set_xticklabels([f"h{h}" for h in range(maps.num_heads)], fontsize=8)
    ax.xaxis.tick_top()
    centers = BADGE_BAND_PIXELS + THUMBNAIL_PIXELS / 2 + row_step * np.arange(maps.num_layers)
    ax.set_yticks(centers)
    ax.set_yticklabels([_grid_layer_label(maps, layer) for layer in range(maps.num_layers)], fontsize=8)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    summary = summarize_heads(maps)
    for layer in range(maps.num_layers):
        for head in range(maps.num_heads):
            code = PATTERN_WORDS[summary.pattern[layer, head]][0]
            if code:  # white on a dark badge, in the band above the thumbnail: never on its cells
                ax.text(head * step + 3, layer * row_step + BADGE_BAND_PIXELS / 2, code, color="white", fontsize=9,
                        va="center", ha="left", fontweight="bold", bbox=_BADGE)
    title = f"{printable(maps.model)}: all heads ({maps.num_tokens} tokens"
    title += f"; {maps.hidden_note})" if maps.hidden else ")"
    # The title sits in its own band above the column labels, never on them.
    fig.text(0.5, 1 - 0.2 / height, title, fontsize=10, ha="center", va="center", parse_math=False)
    causal = maps.causal and maps.num_tokens > 1
    window_key = any(maps.outside_window(layer) is not None for layer in range(maps.num_layers))
    key_room = (0.45 if causal else 0.0) + (0.4 if window_key else 0.0)  # under the bar: the squares' keys
    bar_height = min(rows / dpi - key_room, 2.5)  # beside the first rows of the mosaic
    cax = fig.add_axes(((left + cols / dpi + 0.3) / width, (m["bottom"] + rows / dpi - bar_height) / height,
                        0.18 / width, bar_height / height))
    if causal:
        _masked_key(fig, left + cols / dpi + 0.3, m["bottom"] + rows / dpi - bar_height - 0.4, width, height)
    if window_key:
        _masked_key(fig, left + cols / dpi + 0.3, m["bottom"] + rows / dpi - bar_height - 0.8, width, height,
                    WINDOW_TINT, "outside a local\nlayer's window")
    bar = fig.colorbar(ScalarMappable(norm=Normalize(0, 1), cmap=_viridis()), cax=cax)
    bar.set_ticks([0, 1])
    low = f"max/10^{LOG_DECADES}" if log_scale else "0"
    bar.set_ticklabels([low, "max"], fontsize=7)
    bar.set_label("each head's\nown scale" + ("\n(log)" if log_scale else ""), fontsize=7)
    fig.text(left / width, 0.42 / height, LETTER_LEGEND, fontsize=8, ha="left", va="center")
    fig.text(left / width, 0.22 / height,
             "Rows: query (attending); columns: key (attended to). Each thumbnail is scaled to its own largest weight.",
             fontsize=8, ha="left", va="center")
    _save(fig, path, dpi)
    return fig.canvas.get_width_height()
