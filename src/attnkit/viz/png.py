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
from attnkit.viz.terminal import viridis
from attnkit.viz.text import printable

INCHES_PER_TOKEN = 0.11  # one tick label per token: ~8 pt apart
MAX_MATRIX_INCHES = 57.0  # 512 tokens still get a label each
MIN_MATRIX_INCHES = 4.0
THUMBNAIL_PIXELS = 96
_GAP_PIXELS = 8


def _label_font(inches_per_token: float) -> float:
    return float(np.clip(inches_per_token * 72 * 0.8, 5.0, 10.0))


def head_figure_size(tokens: tuple[str, ...] | list[str]) -> tuple[float, float, dict]:
    """(width, height) in inches of `save_head_png`'s figure, and its layout."""
    T = len(tokens)
    side = float(np.clip(T * INCHES_PER_TOKEN, MIN_MATRIX_INCHES, MAX_MATRIX_INCHES))
    font = _label_font(side / T)
    chars = min(16, max(len(t) for t in tokens))
    margin = 0.6 + chars * font / 72 * 0.62  # room for the longest tick label
    layout = {"side": side, "font": font, "left": margin, "bottom": margin, "top": 0.7, "right": 1.3}
    width = layout["left"] + side + layout["right"]
    height = layout["bottom"] + side + layout["top"]
    return width, height, layout


def _short(token: str) -> str:
    """A tick label: control characters shown, BPE's leading space dropped, at most 16 characters."""
    token = printable(token.replace("\n", "⏎").replace("\r", "␍").replace("\t", "⇥")).strip(" ") or "␣"
    return token if len(token) <= 16 else token[:15] + "…"


def _save(fig, path: str | Path, dpi: int) -> None:
    """fig as PNG (whatever the file name's suffix), without warnings about glyphs the font lacks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph .* missing from", category=UserWarning)
        fig.savefig(path, dpi=dpi, format="png")


def save_head_png(
    maps: AttentionMaps,
    path: str | Path,
    layer: int = 0,
    head: int | None = 0,
    *,
    dpi: int = 100,
) -> tuple[int, int]:
    """Write one head (or a layer's mean when head is None) as a labelled heatmap.

    Rows are queries (the token attending), columns keys (the token attended
    to); every token gets a tick label up to 512 tokens.

    Returns:
        The (width, height) of the file in pixels.
    """
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
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, interpolation="nearest", aspect="auto")
    step = max(1, math.ceil(T / (MAX_MATRIX_INCHES / INCHES_PER_TOKEN)))
    ticks = np.arange(0, T, step)
    labels = [_short(maps.tokens[i]) for i in ticks]
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, rotation=90, fontsize=lay["font"], parse_math=False)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=lay["font"], parse_math=False)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(f"{printable(maps.model)}: {maps.label(layer, head)}", parse_math=False)
    cax = fig.add_axes(
        ((lay["left"] + lay["side"] + 0.25) / width, lay["bottom"] / height, 0.2 / width, lay["side"] / height)
    )
    fig.colorbar(image, cax=cax, label="attention weight")
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


def grid_image(maps: AttentionMaps, thumbnail: int = THUMBNAIL_PIXELS) -> np.ndarray:
    """All heads as one RGB mosaic, (layers x heads) thumbnails, each scaled to its own max.

    Returns:
        uint8 array of shape (layers * (thumbnail + gap) - gap, heads * (...) - gap, 3).
    """
    L, H = maps.num_layers, maps.num_heads
    step = thumbnail + _GAP_PIXELS
    mosaic = np.full((L * step - _GAP_PIXELS, H * step - _GAP_PIXELS, 3), 255, dtype=np.uint8)
    for layer in range(L):
        for head in range(H):
            small = resample(maps.weights[layer, head].astype(np.float64), thumbnail)
            top = small.max()
            rgb = viridis(small / top if top > 0 else small)
            mosaic[layer * step : layer * step + thumbnail, head * step : head * step + thumbnail] = rgb
    return mosaic


def save_grid_png(maps: AttentionMaps, path: str | Path, *, dpi: int = 100) -> tuple[int, int]:
    """Write every head as a thumbnail, layers down and heads across.

    Each thumbnail is scaled to its own largest weight; the letter above it
    names the head's dominant pattern (P previous, F first, S self, B broad).

    Returns:
        The (width, height) of the file in pixels.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    mosaic = grid_image(maps)
    rows, cols = mosaic.shape[:2]
    left, right, top, bottom = 0.7, 0.2, 0.9, 0.3
    width = left + cols / dpi + right
    height = top + rows / dpi + bottom
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((left / width, bottom / height, cols / dpi / width, rows / dpi / height))
    ax.imshow(mosaic, interpolation="nearest")
    step = THUMBNAIL_PIXELS + _GAP_PIXELS
    centers = np.arange(THUMBNAIL_PIXELS / 2, step * maps.num_heads, step)[: maps.num_heads]
    ax.set_xticks(centers)
    ax.set_xticklabels([f"h{h}" for h in range(maps.num_heads)], fontsize=8)
    ax.xaxis.tick_top()
    centers = np.arange(THUMBNAIL_PIXELS / 2, step * maps.num_layers, step)[: maps.num_layers]
    ax.set_yticks(centers)
    ax.set_yticklabels([f"L{layer}" for layer in range(maps.num_layers)], fontsize=8)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    summary = summarize_heads(maps)
    codes = {"previous": "P", "first": "F", "self": "S", "broad": "B", "mixed": ""}
    for layer in range(maps.num_layers):
        for head in range(maps.num_heads):
            code = codes[summary.pattern[layer, head]]
            if code:
                ax.text(head * step + 3, layer * step + 3, code, color="white", fontsize=7,
                        va="top", ha="left", fontweight="bold")
    fig.suptitle(f"{printable(maps.model)}: all heads ({maps.num_tokens} tokens)", fontsize=10, parse_math=False)
    _save(fig, path, dpi)
    return fig.canvas.get_width_height()
