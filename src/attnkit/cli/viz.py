"""`attnkit show`, `attnkit compare` and `attnkit serve`: views of attention."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from attnkit.cli._app import app, console, err_console, fail as _fail

def fail(message: str) -> None:
    """Exit with an error; the message is shown as text (brackets are not rich markup)."""
    from rich.markup import escape

    _fail(escape(message))


_MODEL_HELP = "minilm (embedded encoder), smollm2 (embedded decoder), random (untrained), or a model path."


def _use_color(no_color: bool) -> bool:
    return not no_color and not console.no_color and console.color_system in ("truecolor", "256")


def _compute(text: str, model: str, max_tokens: int):
    """AttentionMaps for `text`, or a clean exit with the reason."""
    from attnkit.viz.providers import ModelNotAvailableError, get_provider

    try:
        maps = get_provider(model, max_tokens=max_tokens).attention(text)
    except ModelNotAvailableError as error:
        fail(str(error))
    except (ValueError, TypeError) as error:
        fail(str(error))
    if maps.truncated_from:
        err_console.print(
            f"[yellow]warning:[/] the text has {maps.truncated_from} tokens; "
            f"showing the first {maps.num_tokens} (the most this view takes is {max_tokens})"
        )
    return maps


def _selection(maps, layer: int, head: int, mean: bool) -> tuple[int, int | None]:
    try:
        layer = maps.check_layer(layer)
        return layer, None if mean else maps.check_head(head)
    except ValueError as error:
        fail(str(error))


def _write_files(maps, layer: int, head: int | None, png: Optional[Path], html: Optional[Path]) -> None:
    if png is not None:
        from attnkit.viz.png import save_grid_png, save_head_png

        size = save_head_png(maps, png, layer, head)
        grid_path = png.with_name(png.stem + "-grid" + (png.suffix or ".png"))
        grid_size = save_grid_png(maps, grid_path)
        console.print(f"wrote {png} ({size[0]}x{size[1]}) and {grid_path} ({grid_size[0]}x{grid_size[1]})",
                      markup=False)
    if html is not None:
        from attnkit.viz.html import save_html

        save_html(maps, html, layer=layer, head=head)
        console.print(f"wrote {html} (self-contained; open it in a browser)", markup=False)


@app.command()
def show(
    text: str = typer.Argument(..., help="The sentence to look at."),
    model: str = typer.Option("minilm", "--model", "-m", help=_MODEL_HELP),
    layer: int = typer.Option(0, "--layer", "-l", help="Layer to show (0-based; negative counts from the end)."),
    head: int = typer.Option(0, "--head", help="Head to show (0-based)."),
    mean: bool = typer.Option(False, "--mean", help="Show the mean of the layer's heads instead of one head."),
    png: Optional[Path] = typer.Option(None, "--png", help="Also write this head as a PNG, and all heads as FILE-grid.png."),
    html: Optional[Path] = typer.Option(None, "--html", help="Also write a self-contained interactive HTML file."),
    values: bool = typer.Option(False, "--values", help="Print the weights in the heatmap's cells."),
    no_color: bool = typer.Option(False, "--no-color", help="Shade with ░▒▓█ instead of colour."),
    summary: bool = typer.Option(True, "--summary/--no-summary", help="Show what every head does (layers x heads)."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Truncate longer texts to this many tokens."),
) -> None:
    """Show where a model's attention goes on TEXT: heatmap of one head and a summary of all."""
    from attnkit.viz.summary import summarize_heads
    from attnkit.viz.terminal import maps_heatmap, summary_table

    maps = _compute(text, model, max_tokens)
    layer, chosen = _selection(maps, layer, head, mean)
    color = _use_color(no_color)
    console.print(maps_heatmap(maps, layer, chosen, color=color, values=values, width=console.width))
    if summary:
        console.print()
        console.print(summary_table(summarize_heads(maps), color=color))
    _write_files(maps, layer, chosen, png, html)


@app.command()
def compare(
    text_a: str = typer.Argument(..., metavar="A", help="First sentence."),
    text_b: str = typer.Argument(..., metavar="B", help="Second sentence."),
    model: str = typer.Option("minilm", "--model", "-m", help=_MODEL_HELP),
    layer: int = typer.Option(0, "--layer", "-l", help="Layer to show side by side."),
    head: int = typer.Option(0, "--head", help="Head to show side by side."),
    mean: bool = typer.Option(False, "--mean", help="Show the mean of the layer's heads."),
    top: int = typer.Option(8, "--top", help="How many of the most different heads to list."),
    html: Optional[Path] = typer.Option(None, "--html", help="Also write both as one interactive HTML file."),
    no_color: bool = typer.Option(False, "--no-color", help="Shade with ░▒▓█ instead of colour."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Truncate longer texts to this many tokens."),
) -> None:
    """The same model on two sentences, side by side, and the heads whose patterns differ most."""
    import numpy as np
    from rich.table import Table

    from attnkit.viz.summary import pattern_difference, summarize_heads
    from attnkit.viz.terminal import maps_heatmap, side_by_side

    maps_a = _compute(text_a, model, max_tokens)
    maps_b = _compute(text_b, model, max_tokens)
    layer, chosen = _selection(maps_a, layer, head, mean)
    color = _use_color(no_color)
    half = max(30, (console.width - 3) // 2)
    left = maps_heatmap(maps_a, layer, chosen, color=color, width=half)
    right = maps_heatmap(maps_b, layer, chosen, color=color, width=half)
    console.print(side_by_side(left, right))

    diff = pattern_difference(maps_a, maps_b)
    same_length = maps_a.num_tokens == maps_b.num_tokens
    sa, sb = summarize_heads(maps_a), summarize_heads(maps_b)
    table = Table(title="Where the patterns differ most", box=None, padding=(0, 1))
    for name in ("layer", "head", "difference", "A", "B"):
        table.add_column(name, justify="right" if name in ("layer", "head", "difference") else "left")
    order = sorted(((float(diff[index]), index) for index in np.ndindex(diff.shape)), reverse=True)
    def describe(summary, ly: int, h: int) -> str:
        """'first P03 F91 S02 1.2b': the pattern, the three scores in %, the entropy in bits."""
        scores = " ".join(
            f"{code}{min(99, int(round(100 * float(values[ly, h])))):02d}"
            for code, values in (("P", summary.previous), ("F", summary.first), ("S", summary.self))
        )
        return f"{summary.pattern[ly, h]:<8} {scores} {summary.entropy[ly, h]:.1f}b"

    for value, (ly, h) in order[: max(0, top)]:
        table.add_row(str(ly), str(h), f"{value:.3f}", describe(sa, ly, h), describe(sb, ly, h))
    console.print()
    console.print(table)
    how = (
        "difference: mean total variation distance of matching rows (0 same, 1 disjoint)"
        if same_length
        else "lengths differ: difference = the largest change of P, F, S or entropy/uniform"
    )
    console.print(how, style="dim")
    console.print("P, F, S: % of weight on the previous token, first token, itself; b: bits", style="dim")
    console.print(f"mean difference over all heads: {float(diff.mean()):.3f}", style="dim")
    if html is not None:
        from attnkit.viz.html import save_html

        save_html([maps_a, maps_b], html, layer=layer, head=chosen)
        console.print(f"wrote {html}", markup=False)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: this machine only)."),
    port: int = typer.Option(8000, "--port", "-p", help="Port to listen on."),
    model: list[str] = typer.Option(["minilm", "smollm2", "random"], "--model", "-m", help=_MODEL_HELP + " Repeat to offer several."),
    max_chars: int = typer.Option(2000, "--max-chars", help="Refuse longer texts."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Truncate longer texts to this many tokens."),
) -> None:
    """A local web page: type a sentence, pick a model, explore its attention."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as error:
        fail(f"`attnkit serve` needs FastAPI and uvicorn ({error.name} is missing); "
             "install them with: pip install 'attnkit[serve]'")
    from rich.markup import escape

    from attnkit.viz.server import create_app

    loopback = host in ("127.0.0.1", "localhost", "::1")
    try:
        application = create_app(
            models=model,
            max_chars=max_chars,
            max_tokens=max_tokens,
            # On this machine only, answer only requests addressed to it (no DNS rebinding).
            allowed_hosts=["127.0.0.1", "localhost", "::1", "[::1]"] if loopback else None,
        )
    except ValueError as error:
        fail(str(error))
    if not loopback:
        err_console.print(f"[yellow]warning:[/] binding {escape(host)}: other machines can reach this page")
    shown = f"[{host}]" if ":" in host else host
    console.print(f"attnkit: open http://{shown}:{port}/ (Ctrl+C to stop)", markup=False)
    uvicorn.run(application, host=host, port=port, log_level="warning")
