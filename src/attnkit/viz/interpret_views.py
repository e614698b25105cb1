"""Views of `attnkit.interpret` results: layers x heads grids and the logit lens.

- A grid is a (layers, heads) array of one score per head (a detector's score, the loss
  increase when the head is ablated, a patching result). `grid_text` draws it in the
  terminal (blocks of heads one under the other when they do not fit, never a cell cut
  into '…'), `render_grids_html` as a self-contained page (no script at all: coloured
  table cells, each value in its title), `save_grids_png` as one picture with a panel
  per grid.
- The logit lens is (layers + 1, T) lists of top tokens: `lens_table` for the terminal,
  `render_lens_html` for a page.
- In Jupyter, `grids_view(...)` and `lens_view(...)` show the same pages inline
  (`NotebookView`, as `head_view` does).

Signed grids (patching, importance) use a diverging scale (blue below 0, red above,
white at 0); grids of shares in [0, 1] the viridis scale of the attention views.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from rich.table import Table
from rich.text import Text

from attnkit.viz.terminal import SHADES, viridis
from attnkit.viz.text import printable, token_label

# ----------------------------------------------------------------------------- colours


def _check_grid(name: str, grid: Any) -> np.ndarray:
    array = np.asarray(grid, dtype=np.float64)
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(f"expected the grid {name!r} of shape (layers, heads), got {array.shape}")
    return array


def is_signed(grid: np.ndarray) -> bool:
    """Whether a grid needs the diverging scale (it has values below 0)."""
    return bool(np.nanmin(grid) < 0)


def _diverging(x: np.ndarray) -> np.ndarray:
    """Values in [-1, 1] as (..., 3) uint8 RGB: blue (-1), white (0), red (1)."""
    x = np.clip(np.nan_to_num(np.asarray(x, dtype=np.float64)), -1.0, 1.0)[..., None]
    white = np.array([247.0, 247.0, 247.0])
    blue, red = np.array([33.0, 102.0, 172.0]), np.array([178.0, 24.0, 43.0])
    rgb = np.where(x < 0, white + (blue - white) * -x, white + (red - white) * x)
    return np.rint(rgb).astype(np.uint8)


def grid_colours(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    """(RGB (layers, heads, 3), position on the scale (layers, heads), legend words) of a grid:
    diverging around 0 by the largest |value| when signed, else viridis from 0 to the max."""
    if is_signed(grid):
        limit = float(np.nanmax(np.abs(grid))) or 1.0
        scaled = grid / limit
        return _diverging(scaled), (scaled + 1) / 2, f"blue -{limit:.3g} · white 0 · red +{limit:.3g}"
    top = float(np.nanmax(grid)) if np.nanmax(grid) > 0 else 1.0
    scaled = np.nan_to_num(grid / top)
    return viridis(scaled), scaled, f"dark 0 · bright {top:.3g}"


# ----------------------------------------------------------------------------- terminal


class GridText:
    """A (layers, heads) grid as a rich renderable: a coloured (or shaded) block per head with
    its value, heads split into blocks one under the other when the width is short."""

    def __init__(self, grid: Any, title: str, *, color: bool = True, digits: int = 2) -> None:
        self.grid = _check_grid(title, grid)
        self.title = title
        self.color = color
        self.rgb, self.scaled, self.legend = grid_colours(self.grid)
        self.cells = [[f"{v:.{digits}f}" if math.isfinite(v) else "-" for v in row] for row in self.grid]

    def __rich_console__(self, console, options):
        layers, heads = self.grid.shape
        cell = max(max(len(c) for row in self.cells for c in row), len(f"h{heads - 1}"))
        label = len(str(layers - 1)) + 1
        fit = max(1, min(heads, (options.max_width - label) // (cell + 1)))
        blocks = math.ceil(heads / fit)
        per_block = math.ceil(heads / blocks)
        yield Text(printable(self.title), style="bold" if self.color else "")
        for first in range(0, heads, per_block):
            shown = range(first, min(first + per_block, heads))
            table = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False)
            table.add_column("L", justify="right", no_wrap=True)
            for h in shown:
                table.add_column(f"h{h}", justify="right", no_wrap=True, min_width=cell)
            for layer in range(layers):
                table.add_row(str(layer), *(self._cell(layer, h) for h in shown))
            yield table
        yield Text(self.legend if self.color else self._plain_legend(), style="dim")

    def _plain_legend(self) -> str:
        if is_signed(self.grid):
            limit = float(np.nanmax(np.abs(self.grid)))
            return f"shades ' ░▒▓█' from -{limit:.3g} to +{limit:.3g}; ▒ is 0"
        return f"shades ' ░▒▓█' from 0 to {float(np.nanmax(self.grid)):.3g}"

    def _cell(self, layer: int, head: int) -> Text:
        text = self.cells[layer][head]
        if not self.color:
            shade = SHADES[int(round(float(self.scaled[layer, head]) * (len(SHADES) - 1)))]
            return Text(shade + text)
        r, g, b = (int(c) for c in self.rgb[layer, head])
        foreground = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "white"
        return Text(text, style=f"{foreground} on #{r:02x}{g:02x}{b:02x}")


def grid_text(grid: Any, title: str, *, color: bool = True, digits: int = 2) -> GridText:
    """A layers x heads grid for the terminal (see `GridText`)."""
    return GridText(grid, title, color=color, digits=digits)


def lens_table(tokens: Sequence[str], top: Sequence[Sequence[Sequence[str]]], *, width: int = 80,
               color: bool = True) -> list[Table]:
    """The logit lens as tables: a row per layer ('embed', 'L0', ...), a column per position.

    Arguments:
        tokens: the T input tokens (the column headers).
        top: [layer][position] -> the top predicted tokens there, best first.
        width: the terminal width; positions that do not fit side by side go on in further
            tables below, and a cell wraps its tokens over lines rather than cutting them.

    Returns:
        The tables to print, in order.
    """
    from rich.cells import cell_len

    T = len(tokens)
    words = [[" ".join(token_label(t) for t in cell) for cell in row] for row in top]
    headers = [f"{p}:{token_label(tokens[p])}" for p in range(T)]
    label = len("embed")
    room = max(4, width - label - 1)  # the most one column can take beside the row labels
    # each position as wide as its widest cell (header included), up to the room there is;
    # positions go side by side while they fit, the rest in further tables below
    natural = [min(room, max([cell_len(headers[p]), 3] + [cell_len(row[p]) for row in words])) for p in range(T)]
    blocks, used = [[]], label
    for p in range(T):
        if blocks[-1] and used + 1 + natural[p] > width:
            blocks.append([])
            used = label
        blocks[-1].append(p)
        used += 1 + natural[p]
    tables = []
    for shown in blocks:
        table = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False,
                      header_style="bold" if color else "")
        table.add_column("", no_wrap=True)
        for p in shown:
            table.add_column(Text(headers[p]), overflow="fold", min_width=natural[p], max_width=natural[p])
        for layer, row in enumerate(words):
            name = "embed" if layer == 0 else f"L{layer - 1}"
            table.add_row(Text(name, style="dim" if color else ""), *(Text(row[p]) for p in shown))
        tables.append(table)
    return tables


# ----------------------------------------------------------------------------- HTML

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.3em; }} h2 {{ font-size: 1.05em; margin-top: 1.6em; }}
p.sub {{ color: #555; }} .legend {{ color: #555; font-size: 0.85em; }}
table.grid {{ border-collapse: collapse; font-size: 0.75em; font-variant-numeric: tabular-nums; }}
table.grid td, table.grid th {{ padding: 0.2em 0.35em; text-align: right; }}
table.grid th {{ color: #555; font-weight: normal; }}
table.lens td {{ text-align: left; font-family: ui-monospace, monospace; white-space: pre; }}
.wrap {{ overflow-x: auto; }}
</style></head><body>
<h1>{title}</h1>
<p class="sub">{subtitle}</p>
{body}
<p class="legend">Made by attnkit; this page loads nothing from the network.</p>
</body></html>
"""


def _grid_html(name: str, grid: np.ndarray) -> str:
    rgb, _, legend = grid_colours(grid)
    layers, heads = grid.shape
    rows = ["<tr><th>layer</th>" + "".join(f"<th>h{h}</th>" for h in range(heads)) + "</tr>"]
    for layer in range(layers):
        cells = []
        for h in range(heads):
            r, g, b = (int(c) for c in rgb[layer, h])
            dark = 0.299 * r + 0.587 * g + 0.114 * b <= 140
            value = grid[layer, h]
            shown = f"{value:.2f}" if math.isfinite(value) else "-"
            cells.append(f'<td style="background:#{r:02x}{g:02x}{b:02x};color:{"#fff" if dark else "#000"}" '
                         f'title="layer {layer}, head {h}: {value:.6g}">{shown}</td>')
        rows.append(f"<tr><th>{layer}</th>{''.join(cells)}</tr>")
    return (f"<h2>{html.escape(name)}</h2><div class=\"wrap\"><table class=\"grid\">{''.join(rows)}</table></div>"
            f"<p class=\"legend\">{html.escape(legend)}</p>")


def render_grids_html(grids: Mapping[str, Any], *, title: str, subtitle: str = "") -> str:
    """One self-contained page with a coloured layers x heads table per grid.

    Arguments:
        grids: name -> (layers, heads) values, in the order to show them.
        title, subtitle: the page's heading and the line under it (text, escaped here).
    """
    if not grids:
        raise ValueError("expected at least one grid, got none")
    body = "".join(_grid_html(name, _check_grid(name, grid)) for name, grid in grids.items())
    return _PAGE.format(title=html.escape(title), subtitle=html.escape(subtitle), body=body)


def render_lens_html(tokens: Sequence[str], top: Sequence[Sequence[Sequence[str]]], *, title: str,
                     subtitle: str = "") -> str:
    """The logit lens as a self-contained page: a row per layer, a column per position."""
    head = "<tr><th></th>" + "".join(f"<th>{p}: {html.escape(token_label(t))}</th>"
                                     for p, t in enumerate(tokens)) + "</tr>"
    rows = []
    for layer, row in enumerate(top):
        name = "embed" if layer == 0 else f"L{layer - 1}"
        cells = "".join(f"<td>{html.escape(' | '.join(token_label(t) for t in cell))}</td>" for cell in row)
        rows.append(f"<tr><th>{name}</th>{cells}</tr>")
    body = f'<div class="wrap"><table class="grid lens">{head}{"".join(rows)}</table></div>'
    return _PAGE.format(title=html.escape(title), subtitle=html.escape(subtitle), body=body)


# ----------------------------------------------------------------------------- PNG


def save_grids_png(grids: Mapping[str, Any], path: str | Path, *, title: str = "", dpi: int = 100) -> tuple[int, int]:
    """A picture with one layers x heads panel per grid, each with its colour bar.

    Returns:
        The (width, height) of the file in pixels.

    Raises:
        MissingExtraError: matplotlib is not installed (`pip install 'attnkit[png]'`).
    """
    from attnkit.runtime import require

    require("matplotlib", "png", "PNG output")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    arrays = {name: _check_grid(name, grid) for name, grid in grids.items()}
    if not arrays:
        raise ValueError("expected at least one grid, got none")
    layers, heads = next(iter(arrays.values())).shape
    columns = min(3, len(arrays))
    rows = math.ceil(len(arrays) / columns)
    panel_w, panel_h = 1.2 + 0.3 * heads, 0.8 + 0.18 * layers
    fig = Figure(figsize=(panel_w * columns, panel_h * rows + 0.6), dpi=dpi)
    FigureCanvasAgg(fig)
    for index, (name, grid) in enumerate(arrays.items()):
        ax = fig.add_subplot(rows, columns, index + 1)
        if is_signed(grid):
            limit = float(np.nanmax(np.abs(grid))) or 1.0
            image = ax.imshow(grid, cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -limit, limit), aspect="auto",
                              interpolation="nearest")
        else:
            image = ax.imshow(grid, cmap="viridis", vmin=0.0, aspect="auto", interpolation="nearest")
        ax.set_title(name, fontsize=9, parse_math=False)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.colorbar(image, ax=ax, fraction=0.05)
    if title:
        fig.suptitle(title, fontsize=10, parse_math=False)
    fig.tight_layout()
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph .* missing from", category=UserWarning)
        fig.savefig(path, dpi=dpi, format="png")
    return fig.canvas.get_width_height()


# ----------------------------------------------------------------------------- notebook


def _height(rows: int) -> int:
    return 160 + 22 * rows


def grids_view(grids: Mapping[str, Any], *, title: str = "attnkit: heads", subtitle: str = "",
               height: int | None = None) -> Any:
    """The grids page (`render_grids_html`) inline in Jupyter: a `NotebookView`.

    Example:
        grids_view({"induction": attnkit.interpret.induction_scores(model)}, title="induction heads")
    """
    from attnkit.viz.notebook import NotebookView

    page = render_grids_html(grids, title=title, subtitle=subtitle)
    layers = sum(_check_grid(n, g).shape[0] + 4 for n, g in grids.items())
    return NotebookView(page, height if height is not None else _height(layers))


def lens_view(tokens: Sequence[str], top: Sequence[Sequence[Sequence[str]]], *, title: str = "attnkit: logit lens",
              subtitle: str = "", height: int | None = None) -> Any:
    """The logit lens page (`render_lens_html`) inline in Jupyter: a `NotebookView`."""
    from attnkit.viz.notebook import NotebookView

    page = render_lens_html(tokens, top, title=title, subtitle=subtitle)
    return NotebookView(page, height if height is not None else _height(len(top) + 2))


def top_tokens(model: Any, lens: np.ndarray, k: int = 1) -> list[list[list[str]]]:
    """`attnkit.interpret.top_tokens` (its home; this name stays for the views' callers)."""
    from attnkit.interpret.lens import top_tokens as top

    return top(model, lens, k)
