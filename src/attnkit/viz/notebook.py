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

bertviz's calls work as written, with the import swapped: the attention first, as
transformers returns it (`outputs.attentions`, a tuple of one (1, H, T, T) tensor or
array per layer), then the tokens, and bertviz's keywords (`sentence_b_start`,
`prettify_tokens`, `layer`, `heads`, `include_layers`, `include_heads`, `html_action`):

    outputs = model(inputs, output_attentions=True)
    head_view(outputs.attentions, tokens)
    html = head_view(outputs.attentions, tokens, html_action="return")   # html.data: the page
"""

from __future__ import annotations

import html
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from attnkit.viz.data import AttentionMaps

VIEWS = ("all", "head", "model")
"""What a page shows: everything, the head view with its matrix, or the model view."""

HTML_ACTIONS = ("view", "return")
"""bertviz's html_action: display the view now, or return it."""


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

    @property
    def data(self) -> str:
        """The whole page, as `IPython.display.HTML(...).data` holds bertviz's HTML (what
        `html_action="return"` callers write to a file)."""
        return self.html

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
        "expected AttentionMaps, a text, a list of two of them (to compare), or attention weights "
        f"with their tokens (bertviz's head_view(attention, tokens)), got {type(source).__name__}"
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
    title: str | None = None,
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
        title: the page's title (by default it names the model).
    """
    from attnkit.viz.html import render_html

    if show not in VIEWS:
        raise ValueError(f"expected show to be one of {', '.join(VIEWS)}, got {show!r}")
    maps = _maps(source, model, max_tokens)
    docs = [maps] if isinstance(maps, AttentionMaps) else maps
    page = render_html(maps, layer=layer, head=head, hide_special=hide_special, log_scale=log_scale, view=show,
                       title=title)
    return NotebookView(page, height if height is not None else _height(docs, show))


# ----------------------------------------------------------------------------- bertviz's calls


def _prettify(token: str) -> str:
    """bertviz's prettify_tokens: the BPE space markers as spaces, '</w>' dropped."""
    return token.replace("Ġ", " ").replace("▁", " ").replace("</w>", "")


def _pick(values: Sequence[int] | None, size: int, what: str) -> list[int] | None:
    """bertviz's include_layers / include_heads, checked: None (or empty, as bertviz reads it) = all."""
    if values is None or len(values) == 0:
        return None
    if isinstance(values, (str, bytes)) or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                                    for v in values):
        raise TypeError(f"expected {what} as a list of int, got {values!r}")
    bad = [int(v) for v in values if not 0 <= v < size]
    if bad:
        raise ValueError(f"expected {what} in 0..{size - 1}, got {bad}")
    return [int(v) for v in values]


def _bertviz_view(
    show: str, attention: Any, tokens: Sequence[str] | None, *, sentence_b_start: int | None,
    prettify_tokens: bool, layer: int | None, head: int | None, include_layers: Sequence[int] | None,
    include_heads: Sequence[int] | None, html_action: str | None, encoder_decoder: dict[str, Any],
    options: dict[str, Any],
) -> NotebookView | None:
    given = sorted(name for name, value in encoder_decoder.items() if value is not None)
    if given:
        raise ValueError(
            f"attnkit's views take one token sequence, got the encoder-decoder arguments {given}; an "
            "encoder-decoder folder's maps come from head_view(text, model=path) (the decoder reads the "
            "encoder's tokens, docs/hf-views.md)"
        )
    if html_action is not None and html_action not in HTML_ACTIONS:
        raise ValueError(f"expected html_action 'view' or 'return', got {html_action!r}")
    if attention is None:
        raise ValueError("expected attention (the first argument), got None")
    if isinstance(tokens, str):
        if not isinstance(attention, str):
            raise TypeError(f"expected tokens as a list of the T token strings of the weights, got a text "
                            f"{tokens!r}; a text goes first, alone: {show}_view(text, model=...)")
        attention, tokens = [attention, tokens], None  # two sentences: {show}_view([A, B]), compared
    if tokens is not None:  # bertviz's order: attention, tokens
        tokens = [str(t) for t in tokens]
        maps: Any = AttentionMaps(tuple(_prettify(t) for t in tokens) if prettify_tokens else tuple(tokens),
                                  attention, text=" ".join(tokens).strip())
    else:
        maps = _maps(attention, options.get("model", "minilm"), options.get("max_tokens", 512))
    docs = [maps] if isinstance(maps, AttentionMaps) else list(maps)
    first = docs[0]
    layers = _pick(include_layers, first.num_layers, "include_layers")
    heads = _pick(include_heads, first.num_heads, "include_heads")
    if layer is None:
        layer = layers[0] if layers else 0
    elif layers is not None and layer not in layers:
        raise ValueError(f"expected layer in include_layers {layers}, got {layer}")
    first.check_layer(layer)
    if layers is not None or heads is not None:
        docs = [_subset(d, layers, heads) for d in docs]
        layer = layers.index(layer) if layers is not None else layer
    title = options.pop("title", None)
    if sentence_b_start is not None:
        if isinstance(sentence_b_start, bool) or not isinstance(sentence_b_start, (int, np.integer)) \
                or not 0 < sentence_b_start < first.num_tokens:
            raise ValueError(f"expected sentence_b_start in 1..{first.num_tokens - 1} (the first token of "
                             f"sentence B), got {sentence_b_start!r}")
        docs = [replace(d, meta={**d.meta, "sentence_b_start": int(sentence_b_start)}) for d in docs]
        title = title or (f"attnkit: attention of {first.model or 'the model'}: sentence A is tokens "
                          f"0-{sentence_b_start - 1}, sentence B tokens {sentence_b_start}-{first.num_tokens - 1}")
    shown = view(docs[0] if len(docs) == 1 else docs, show=show, layer=layer, head=head, title=title, **options)
    if html_action == "view":  # bertviz: display now, return nothing
        from IPython.display import display

        display(shown)
        return None
    return shown


def _subset(maps: AttentionMaps, layers: list[int] | None, heads: list[int] | None) -> AttentionMaps:
    """`maps` with only these layers and heads; each kept layer is named by its number in the model."""
    weights = maps.weights if layers is None else maps.weights[layers]
    weights = weights if heads is None else weights[:, heads]
    names = None
    if layers is not None:
        names = tuple(f"model layer {i}" + (f", {maps.layer_names[i]}" if maps.layer_names else "") for i in layers)
    elif maps.layer_names:
        names = maps.layer_names
    windows = maps.windows if layers is None or maps.windows is None else tuple(maps.windows[i] for i in layers)
    return replace(maps, weights=weights, layer_names=names, windows=windows)


def _first_head(heads: Sequence[int] | None, head: int | None) -> int | None:
    """bertviz's heads (those selected at first) as the page's one head: one head is that head,
    several are the mean of the layer (the page shows one head or the mean)."""
    if heads is None:
        return head
    heads = list(heads)
    return int(heads[0]) if len(heads) == 1 else None


def head_view(
    attention: Any = None,
    tokens: Sequence[str] | None = None,
    sentence_b_start: int | None = None,
    prettify_tokens: bool = True,
    layer: int | None = None,
    heads: Sequence[int] | None = None,
    encoder_attention: Any = None,
    decoder_attention: Any = None,
    cross_attention: Any = None,
    encoder_tokens: Sequence[str] | None = None,
    decoder_tokens: Sequence[str] | None = None,
    include_layers: Sequence[int] | None = None,
    html_action: str | None = None,
    *,
    head: int | None = 0,
    **options: Any,
) -> NotebookView | None:
    """The head view (as in bertviz) and the matrix of one head, inline.

    Arguments (bertviz's, in its order):
        attention: the weights, as transformers returns them (`outputs.attentions`: a
            tuple of one (1, H, T, T) torch tensor or NumPy array per layer) or stacked
            (layers, heads, T, T); or, without `tokens`, AttentionMaps, a text (run
            through `model=`), or a list of two of either to compare.
        tokens: the T tokens of the weights.
        sentence_b_start: the first token of the second sentence of a pair; the title
            says where each sentence is (the page has no A/B filter yet).
        prettify_tokens: show 'Ġ' and '▁' (BPE space markers) as spaces and drop '</w>'.
        layer: the layer shown first (a layer of the model: it must be in include_layers).
        heads: the heads shown first: one head is that head, several the mean of the layer.
        encoder_attention, decoder_attention, cross_attention, encoder_tokens,
            decoder_tokens: bertviz's encoder-decoder form; refused with the way attnkit
            shows such a model (its maps come from head_view(text, model=folder)).
        include_layers: only these layers (each named by its number in the model).
        html_action: None (attnkit's default): return the view, which Jupyter shows
            when it ends a cell; "view" (bertviz's default): display it now and return
            None; "return": return it (`.data` is the page, as bertviz's HTML object's).
        head: attnkit's spelling of `heads=[h]` (None: the mean of the layer).
        **options: `view`'s keywords (model, hide_special, log_scale, max_tokens, height, title).
    """
    return _bertviz_view(
        "head", attention, tokens, sentence_b_start=sentence_b_start, prettify_tokens=prettify_tokens, layer=layer,
        head=_first_head(heads, head), include_layers=include_layers, include_heads=None, html_action=html_action,
        encoder_decoder={"encoder_attention": encoder_attention, "decoder_attention": decoder_attention,
                         "cross_attention": cross_attention, "encoder_tokens": encoder_tokens,
                         "decoder_tokens": decoder_tokens},
        options=options,
    )


def model_view(
    attention: Any = None,
    tokens: Sequence[str] | None = None,
    sentence_b_start: int | None = None,
    prettify_tokens: bool = True,
    *,
    encoder_attention: Any = None,
    decoder_attention: Any = None,
    cross_attention: Any = None,
    encoder_tokens: Sequence[str] | None = None,
    decoder_tokens: Sequence[str] | None = None,
    include_layers: Sequence[int] | None = None,
    include_heads: Sequence[int] | None = None,
    html_action: str | None = None,
    layer: int | None = None,
    head: int | None = 0,
    **options: Any,
) -> NotebookView | None:
    """Every head of every layer as a thumbnail, inline; click one to enlarge it.

    bertviz's arguments, with its meaning (see `head_view`); `include_heads` keeps only
    these heads (numbered again from 0). bertviz's `display_mode` is not taken: the page
    has its own colours. `layer` and `head` choose the enlarged head shown first.
    """
    return _bertviz_view(
        "model", attention, tokens, sentence_b_start=sentence_b_start, prettify_tokens=prettify_tokens, layer=layer,
        head=head, include_layers=include_layers, include_heads=include_heads, html_action=html_action,
        encoder_decoder={"encoder_attention": encoder_attention, "decoder_attention": decoder_attention,
                         "cross_attention": cross_attention, "encoder_tokens": encoder_tokens,
                         "decoder_tokens": decoder_tokens},
        options=options,
    )


# ----------------------------------------------------------------------------- derived maps


def derived_view(
    source: AttentionMaps | str,
    kind: str,
    *,
    model: str = "minilm",
    show: str = "all",
    layer: int = -1,
    max_tokens: int = 512,
    **options: Any,
) -> NotebookView:
    """Attention rollout, attention flow or value-weighted maps, inline (`attnkit show --rollout`,
    `--flow`, `--value-weighted` in a notebook cell).

    Arguments:
        source: AttentionMaps, or a text run through `model`.
        kind: "rollout", "flow" or "value-weighted" (see `attnkit.viz.derived`); value-weighted
            maps need the model itself, so `source` is then a text and `model` an attnkit model
            (minilm, smollm2, or a model path).
        show, layer, **options: `view`'s (the last layer first: the whole model for rollout and flow).
    """
    from attnkit.viz.derived import derive

    maps = _maps(source, model, max_tokens)
    if not isinstance(maps, AttentionMaps):
        raise TypeError(f"expected one AttentionMaps or one text, got {type(source).__name__}")
    if kind == "value-weighted" and not isinstance(source, str):
        raise ValueError("value-weighted maps need the model's weights: pass the text and model=, not maps")
    shown = derive(maps, kind, model=model)
    return view(shown, show=show, layer=layer, head=0, model=model, max_tokens=max_tokens, **options)
