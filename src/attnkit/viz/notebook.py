"""Views that render inline in Jupyter: `head_view(...)` and `model_view(...)`.

Each returns a `NotebookView`, which Jupyter shows through `_repr_html_`: the
same self-contained page as `attnkit show --html` (its CSS, JavaScript and
weights inside, nothing loaded from the network), in an `<iframe srcdoc=...>`.
The frame keeps the page's Content-Security-Policy and its element ids apart
from the notebook's, so several views in one notebook never interfere, and the
output works offline, in a saved notebook too (when the notebook is trusted).

    from attnkit.viz import head_view, model_view
    head_view("The cat sat on the mat.", model="minilm", layer=0, head=2)
    model_view(maps)   # any AttentionMaps: every head as a thumbnail
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Sequence

from attnkit.viz.data import AttentionMaps

VIEWS = ("all", "head", "model")
"""What a page shows: everything, the head view with its matrix, or the model view."""


class NotebookView:
    """An attention page that Jupyter displays inline.

    Attributes:
        html: the whole self-contained page (what `save` writes).
        height: the frame's height in pixels.
    """

    def __init__(self, page: str, height: int) -> None:
        self.html = page
        self.height = int(height)

    def _repr_html_(self) -> str:
        # srcdoc takes the page as an attribute value: every '&', '<', '>' and '"' escaped.
        return (
            f'<iframe class="attnkit-view" srcdoc="{html.escape(self.html, quote=True)}" '
            f'style="width: 100%; height: {self.height}px; border: 0;" '
            'title="attnkit attention view"></iframe>'
        )

    def save(self, path: str | Path) -> Path:
        """Write the page as a standalone HTML file and return its path."""
        path = Path(path)
        path.write_text(self.html, encoding="utf-8")
        return path

    def __repr__(self) -> str:
        return f"<attnkit NotebookView: {len(self.html)} characters of HTML; display it in Jupyter>"


def _maps(source: Any, model: str, max_tokens: int) -> AttentionMaps | list[AttentionMaps]:
    if isinstance(source, AttentionMaps):
        return source
    if isinstance(source, str):
        from attnkit.viz.providers import get_provider

        return get_provider(model, max_tokens=max_tokens).attention(source)
    items = list(source) if isinstance(source, (list, tuple)) else None
    if items and len(items) <= 2 and all(isinstance(m, (AttentionMaps, str)) for m in items):
        return [_maps(m, model, max_tokens) for m in items]  # type: ignore[misc]
    raise TypeError(
        "expected AttentionMaps, a text, or a list of two of them (to compare), "
        f"got {type(source).__name__}"
    )


def _height(docs: list[AttentionMaps], view: str) -> int:
    """A frame height in pixels that shows the whole view without scrolling (the page's own
    layout: title and controls, then per text its head view and matrix, or its model view)."""
    top = 190  # title, subtitle, controls
    tokens = max(d.num_tokens for d in docs)
    matrix = max(240, min(720 if len(docs) == 1 else 480, tokens * 14)) + 110  # + labels above it
    doc = 130 + max(min(tokens * 18, 620), matrix)  # text, meta line, views, status line
    grid = 80 + docs[0].num_layers * 74  # heading, rows of 64-pixel thumbnails, legend
    difference = 60 + 24 * docs[0].num_layers if len(docs) == 2 else 0
    heights = {
        "head": top + doc * len(docs),
        "model": top + grid * len(docs),
        "all": top + (doc + grid) * len(docs) + difference,
    }
    return heights[view] + 60  # the footer


def view(
    source: AttentionMaps | str | Sequence[AttentionMaps | str],
    *,
    show: str = "all",
    model: str = "minilm",
    layer: int = 0,
    head: int | None = 0,
    hide_special: bool = False,
    log_scale: bool = False,
    max_tokens: int = 512,
    height: int | None = None,
) -> NotebookView:
    """An inline view of attention: the page of `attnkit show --html`, in a notebook cell.

    Arguments:
        source: AttentionMaps, a text (run through `model`), or a list of two of
            either to compare side by side.
        show: "all", "head" (the head view and its matrix) or "model" (every head as
            a thumbnail; click one to enlarge it).
        model: the model for texts: minilm, smollm2, random, or a path.
        layer, head: what the page shows first (head None: the mean of the layer).
        hide_special, log_scale: the page's checkboxes, ticked or not at first.
        max_tokens: texts are cut to this many tokens.
        height: the frame's height in pixels (by default from the size of the maps).
    """
    from attnkit.viz.html import render_html

    if show not in VIEWS:
        raise ValueError(f"expected show to be one of {', '.join(VIEWS)}, got {show!r}")
    maps = _maps(source, model, max_tokens)
    docs = [maps] if isinstance(maps, AttentionMaps) else maps
    page = render_html(maps, layer=layer, head=head, hide_special=hide_special, log_scale=log_scale, view=show)
    return NotebookView(page, height if height is not None else _height(docs, show))


def head_view(source: AttentionMaps | str | Sequence[AttentionMaps | str], **kwargs: Any) -> NotebookView:
    """The head view (as in bertviz) and the matrix of one head, inline. See `view`."""
    return view(source, show="head", **kwargs)


def model_view(source: AttentionMaps | str | Sequence[AttentionMaps | str], **kwargs: Any) -> NotebookView:
    """Every head of every layer as a thumbnail, inline; click one to enlarge it. See `view`."""
    return view(source, show="model", **kwargs)
