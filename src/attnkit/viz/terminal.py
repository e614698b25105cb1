"""Terminal views: a heatmap of one head and a layers x heads summary.

Everything here returns rich renderables (`Text`, `Table`); the CLI prints
them. With colour, each cell is a truecolor block on a viridis scale (rich
downgrades it on 256-colour terminals); without colour, the cells use the
shades ' ░▒▓█'. Every query token keeps its own row, named by its word and
position; when more keys than the width allows, key columns are summed in
blocks (every row still sums to 1) and the key line says so. Past `MAX_ROWS`
tokens the rows pool too (by mean), and every token is listed under the
legend. Tables fit the width they are printed at: cells are never cut into '…'.
"""

from __future__ import annotations

import math
import textwrap

import numpy as np
from rich.cells import cell_len, set_cell_size
from rich.table import Table
from rich.text import Text

from attnkit.viz.data import AttentionMaps
from attnkit.viz.summary import HeadSummary
from attnkit.viz.text import token_label

SHADES = " ░▒▓█"

# Viridis at 9 evenly spaced stops, as 0-255 RGB.
_VIRIDIS = np.array(
    [
        [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
        [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37],
    ],
    dtype=np.float64,
)
_LABEL_WIDTH = 12  # at most this many cells for a row label


def viridis(x: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] to (..., 3) uint8 RGB on the viridis scale."""
    x = np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0) * (len(_VIRIDIS) - 1)
    lo = np.floor(x).astype(int).clip(0, len(_VIRIDIS) - 2)
    frac = (x - lo)[..., None]
    rgb = _VIRIDIS[lo] * (1 - frac) + _VIRIDIS[lo + 1] * frac
    return np.rint(rgb).astype(np.uint8)


def pool(weights: np.ndarray, block: int) -> np.ndarray:
    """Pool a (T, T) matrix into ceil(T/block) blocks: rows by mean, columns by sum."""
    T = weights.shape[0]
    n = math.ceil(T / block)
    padded = np.zeros((n * block, n * block))
    padded[:T, :T] = weights
    summed = padded.reshape(n * block, n, block).sum(axis=-1)  # (n*block, n)
    counts = np.full(n, block, dtype=np.float64)
    counts[-1] = T - (n - 1) * block
    return summed.reshape(n, block, n).sum(axis=1) / counts[:, None]


def pool_columns(weights: np.ndarray, block: int) -> np.ndarray:
    """Sum a (T, S) matrix's columns in blocks of `block` keys: (T, ceil(S/block)); rows still sum to 1."""
    T, S = weights.shape
    n = math.ceil(S / block)
    padded = np.zeros((T, n * block))
    padded[:, :S] = weights
    return padded.reshape(T, n, block).sum(axis=-1)


MAX_ROWS = 128
"""Up to this many tokens a heatmap has a row per token, named; longer texts pool rows too."""


def _visible(token: str) -> str:
    return token_label(token)


def _fit(label: str, width: int, *, visible: bool = True, align: str = "right", mark: bool = True) -> str:
    """Align `label` in `width` cells, cutting it when too long, with '…' when `mark`
    (the heatmap then lists the whole token under its legend)."""
    label = _visible(label) if visible else label
    if cell_len(label) > width:
        label = set_cell_size(label, width - 1) + "…" if mark else set_cell_size(label, width)
    pad = " " * (width - cell_len(label))
    return pad + label if align == "right" else label + pad


LOG_DECADES = 3
"""A log colour scale spans this many powers of ten below the largest weight."""


def colour_scale(weights: np.ndarray, vmax: float, log_scale: bool = False) -> np.ndarray:
    """Weights as positions in [0, 1] on the colour scale.

    Linear: w / vmax. Log: log10(w / vmax) over the `LOG_DECADES` decades below vmax
    (vmax -> 1, vmax / 1000 or less -> 0), so that small weights get distinct colours.
    """
    w = np.asarray(weights, dtype=np.float64) / vmax
    if not log_scale:
        return np.clip(w, 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return np.clip(1.0 + np.log10(w) / LOG_DECADES, 0.0, 1.0)


def _number_rows(labels: list[str], cell: int, indent: int) -> list[str]:
    """Column numbers above their columns: one line when they fit in a cell, else even
    and odd columns on two staggered lines (each number then has two cells of room)."""
    width = max(len(label) for label in labels)
    lines = 1 if width < cell else 2
    rows = [[" "] * (indent + cell * len(labels) + width) for _ in range(lines)]
    for j, label in enumerate(labels):
        x = indent + j * cell + (cell - 1 - len(label) if lines == 1 else 0)
        rows[j % lines][x : x + len(label)] = list(label)
    return ["".join(row).rstrip() for row in rows]


def _layout(tokens, width: int, values: bool) -> tuple[int, int, int]:
    """(cells a column takes, cells of the row labels, tokens pooled per column) at `width`."""
    T = len(tokens)
    cell = 5 if values else 2
    digits = len(str(T - 1))
    longest = max(cell_len(_visible(t)) for t in tokens)
    label_width = max(min(max(_LABEL_WIDTH, width // 4), longest) + digits + 1, digits * 2 + 2)
    columns = max(1, (width - label_width - 1) // cell)
    return cell, label_width, max(1, math.ceil(T / columns))


def heatmap_pools(tokens: list[str] | tuple[str, ...], width: int, *, values: bool = False) -> bool:
    """Whether `heatmap` at `width` cells pools key columns: more tokens than columns fit.

    A caller that may choose its width (two heatmaps side by side, or one under the
    other at the full width) asks this first."""
    return _layout(tokens, width, values)[2] > 1


def heatmap(
    weights: np.ndarray,
    tokens: list[str] | tuple[str, ...],
    *,
    color: bool = True,
    values: bool = False,
    width: int = 80,
    title: str | None = None,
    log_scale: bool = False,
) -> Text:
    """A heatmap of one (T, T) attention matrix with token labels.

    Rows are labelled with their token and number; columns with the same numbers,
    written across (the row labels are the key), on two staggered lines when a
    number is wider than a cell.

    Arguments:
        weights: (T, T); row i = where token i attends.
        tokens: T labels.
        color: truecolor cells if True, else the shades ' ░▒▓█'.
        values: print each weight (two decimals) in its cell.
        width: the number of terminal cells available.
        title: a first line, for example 'layer 0, head 3'.
        log_scale: colours (or shades) on a log scale over the `LOG_DECADES` decades
            below the largest weight, instead of a linear one from 0.

    Returns:
        A rich Text, at most `width` cells wide.
    """
    weights = np.asarray(weights, dtype=np.float64)
    T = len(tokens)
    if weights.shape != (T, T):
        raise ValueError(f"expected weights of shape ({T}, {T}) like tokens, got {weights.shape}")
    cell, label_width, block = _layout(tokens, width, values)
    digits = len(str(T - 1))
    pool_rows = block > 1 and T > MAX_ROWS
    if pool_rows:  # a long text: rows in the columns' blocks too, and a key of every token below
        shown = pool(weights, block)
        starts = list(range(0, T, block))
        row_labels = [f"{s}-{min(s + block, T) - 1}" for s in starts]
        col_labels = [str(s) for s in starts]
    else:  # a row per query token, named; only the key columns pool (by sum) when they must
        shown = pool_columns(weights, block)
        row_labels = [f"{_fit(t, label_width - digits - 1)} {i:>{digits}}" for i, t in enumerate(tokens)]
        col_labels = [str(i) for i in range(0, T, block)]
    cut = [i for i, t in enumerate(tokens) if not pool_rows and cell_len(_visible(t)) > label_width - digits - 1]
    vmax = float(shown.max()) if shown.size and shown.max() > 0 else 1.0
    scaled = colour_scale(shown, vmax, log_scale)
    out = Text(no_wrap=True, overflow="crop")
    if title:
        for line in textwrap.wrap(_visible(title), max(20, width), break_on_hyphens=False) or [""]:
            out.append(line + "\n", style="bold")

    # Column numbers, across; the row labels say which token each number is.
    for line in _number_rows(col_labels, cell, label_width + 1):
        out.append(line[:width] + "\n", style="dim")

    rgb = viridis(scaled) if color else None
    for i, label in enumerate(row_labels):
        out.append(_fit(label, label_width, visible=False, mark=False) + " ")
        for j in range(len(col_labels)):
            w = shown[i, j]
            if values:
                text = f"{w:4.2f} "
            elif color:
                text = " " * cell
            else:
                text = SHADES[int(round(scaled[i, j] * (len(SHADES) - 1)))] * cell
            if color:
                r_, g_, b_ = (int(c) for c in rgb[i, j])
                fg = "black" if scaled[i, j] > 0.6 else "white"
                out.append(text, style=f"{fg} on #{r_:02x}{g_:02x}{b_:02x}")
            else:
                out.append(text)
        out.append("\n")

    # Legend: what the darkest and brightest cells mean, and how to read the labels.
    low = f"{vmax / 10**LOG_DECADES:.1e}" if log_scale else "0"
    scale = " (log scale)" if log_scale else ""
    top = f"{vmax:.2f} (max){scale}"
    if color:  # under the cells, or further left when the width is short
        out.append(" " * max(0, min(label_width + 1, width - len(low) - len(top) - 18)) + f"{low} ")
        for x in np.linspace(0, 1, 8):
            r_, g_, b_ = (int(c) for c in viridis(x))
            out.append("  ", style=f"on #{r_:02x}{g_:02x}{b_:02x}")
        out.append(f" {top}\n")
    elif not values:
        legend = f"' '={low}  ░ ▒ ▓  █={top}"
        out.append(" " * max(0, min(label_width + 1, width - cell_len(legend))) + legend + "\n")
    if pool_rows:
        key = f"{T} tokens pooled in blocks of {block} (rows: mean, columns: sum); numbers are token positions"
    elif block > 1:
        key = (f"rows: queries, numbered; columns: keys in blocks of {block} from the number above "
               "(their weights summed)")
    else:
        key = "rows: queries, numbered; columns: keys, same numbers"
    for line in textwrap.wrap(key, max(20, width)):  # wrapped at words, never cut into '…'
        out.append(line + "\n", style="italic")
    if pool_rows or cut:  # every token, whole: the pooled rows' words, or the labels cut short
        listed = range(T) if pool_rows else cut
        words = [f"{i}:{_visible(tokens[i])}" for i in listed]
        for line in textwrap.wrap("tokens: " + "  ".join(words), max(20, width), break_long_words=True,
                                  break_on_hyphens=False):
            out.append(line + "\n", style="dim")
    out.rstrip()
    return out


_PATTERN_CODE = {"previous": "P", "first": "F", "self": "S", "broad": "B", "mixed": "·"}
_PATTERN_STYLE = {
    "previous": "bold cyan",
    "first": "bold magenta",
    "self": "bold green",
    "broad": "yellow",
    "mixed": "dim",
}


def _summary_cell(summary: HeadSummary, layer: int, head: int) -> tuple[str, str]:
    """One head's cell and its style name: the pattern's letter, then the weight in percent
    ('P45') or, for broad and mixed heads, the entropy in bits ('B2.1')."""
    pattern = summary.pattern[layer, head]
    by_name = {"previous": summary.previous, "first": summary.first, "self": summary.self}
    if pattern in by_name:
        return f"{_PATTERN_CODE[pattern]}{min(99, int(round(100 * by_name[pattern][layer, head]))):02d}", pattern
    return f"{_PATTERN_CODE[pattern]}{min(9.9, summary.entropy[layer, head]):.1f}", pattern


class SummaryTable:
    """The layers x heads summary as a rich renderable that fits the width it is given.

    Every cell is printed whole (3 or 4 characters: 'P45', 'B2.1'): when all heads do
    not fit side by side, the heads are split into blocks printed one under the other
    (heads 0-5, then 6-11, each with every layer), never cut into '…'. The width is
    the console's at print time: a terminal's, or when output is piped, rich's
    default (80 columns, or $COLUMNS).
    """

    TITLE = "What each head does (layers x heads)"

    def __init__(self, summary: HeadSummary, *, color: bool = True) -> None:
        self.summary = summary
        self.color = color
        layers, heads = summary.previous.shape
        self.cells = [[_summary_cell(summary, layer, h) for h in range(heads)] for layer in range(layers)]

    def heads_per_block(self, width: int) -> int:
        """How many head columns fit in `width` cells beside the layer column (at least 1)."""
        layers, heads = self.summary.previous.shape
        label = max(1, len(str(layers - 1)))  # the "L" column
        cell = max([len(f"h{heads - 1}")] + [len(text) for row in self.cells for text, _ in row])
        fit = max(1, min(heads, (width - label) // (cell + 1)))  # one space before each column
        blocks = math.ceil(heads / fit)
        return math.ceil(heads / blocks)  # blocks of even size: 12 heads in 7 columns are 6 + 6

    def _table(self, heads: range, title: str | None) -> Table:
        cell = max([len(f"h{heads[-1]}")] + [len(row[h][0]) for row in self.cells for h in heads])
        table = Table(
            title=title, box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False,
            header_style="bold" if self.color else "", title_style="bold" if self.color else "",
            title_justify="left",
        )
        table.add_column("L", justify="right", no_wrap=True)
        for h in heads:
            table.add_column(f"h{h}", justify="left", no_wrap=True, min_width=cell)
        for layer, row in enumerate(self.cells):
            table.add_row(str(layer), *(
                Text(row[h][0], style=_PATTERN_STYLE[row[h][1]] if self.color else "") for h in heads
            ))
        return table

    def legend(self) -> Text:
        uniform = float(self.summary.max_entropy.mean())
        return Text(
            "P previous token, F first token, S itself: % of weight there\n"
            f"B broad, · mixed: entropy in bits (uniform = {uniform:.1f})",
            style="dim" if self.color else "",
        )

    def __rich_console__(self, console, options):
        heads = self.summary.previous.shape[1]
        per_block = self.heads_per_block(options.max_width)
        if per_block >= heads:
            yield self._table(range(heads), self.TITLE)
        else:
            yield Text(self.TITLE, style="bold" if self.color else "")
            for first in range(0, heads, per_block):
                if first:
                    yield Text("")
                yield self._table(range(first, min(first + per_block, heads)), None)
        yield self.legend()


def summary_table(summary: HeadSummary, *, color: bool = True) -> SummaryTable:
    """A layers x heads table: each head's dominant pattern, its score and its entropy.

    A rich renderable (`SummaryTable`) that fits the width it is printed at: heads that
    do not fit side by side go on in blocks below, each cell whole."""
    return SummaryTable(summary, color=color)


class SideBySide:
    """Two multi-line Texts next to each other when the width they are printed at holds both,
    else one under the other (never cropped): a rich renderable."""

    def __init__(self, left: Text, right: Text, *, gap: int = 3) -> None:
        self.left, self.right, self.gap = left, right, gap

    def joined(self) -> Text:
        left_lines = self.left.split("\n")
        right_lines = self.right.split("\n")
        left_width = max((line.cell_len for line in left_lines), default=0)
        out = Text(no_wrap=True, overflow="crop")
        for i in range(max(len(left_lines), len(right_lines))):
            a = left_lines[i] if i < len(left_lines) else Text("")
            b = right_lines[i] if i < len(right_lines) else Text("")
            out.append_text(a)
            out.append(" " * (left_width - a.cell_len + self.gap))
            out.append_text(b)
            out.append("\n")
        out.rstrip()
        return out

    def __rich_console__(self, console, options):
        joined = self.joined()
        if max((line.cell_len for line in joined.split("\n")), default=0) <= options.max_width:
            yield joined
        else:
            yield self.left
            yield Text("")
            yield self.right


def side_by_side(left: Text, right: Text, *, gap: int = 3) -> SideBySide:
    """Two multi-line Texts next to each other, `gap` cells apart, or one under the other
    when the console is narrower than both (a rich renderable: `SideBySide`)."""
    return SideBySide(left, right, gap=gap)


def maps_heatmap(
    maps: AttentionMaps,
    layer: int,
    head: int | None,
    *,
    color: bool = True,
    values: bool = False,
    width: int = 80,
    log_scale: bool = False,
) -> Text:
    """`heatmap` of one head (or the mean of a layer's heads when head is None)."""
    title = f"{maps.model}: {maps.label(layer, head)}"
    if maps.hidden:
        title += f" ({maps.hidden_note})"
    return heatmap(
        maps.head(layer, head),
        maps.tokens,
        color=color,
        values=values,
        width=width,
        title=title,
        log_scale=log_scale,
    )
