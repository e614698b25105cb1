"""`attnkit demo` and `attnkit walkthrough`: the seeds' demos, made real."""

from __future__ import annotations

import numpy as np
import typer
from rich.box import HEAVY_HEAD
from rich.console import Group
from rich.text import Text

from attnkit.cli._app import app, check_int, check_text, console, usage, use_color
from attnkit.viz.tables import fitted_table
from attnkit.viz.text import printable

DEMO_SENTENCE = "The cat sat on the mat"
MAX_WORDS = 64
"""The most words `demo --text` takes (it prints a table with a column per word)."""
MAX_TEXT_CHARS = 2000
"""The most characters `demo --text` takes."""
MAX_D_MODEL = 1024
"""The largest `demo --d-model`."""
MAX_HEADS = 64
"""The most `demo --heads` (it prints a heatmap per head)."""


def _weight_table(weights: np.ndarray, tokens: list[str], title: str) -> Group:
    """(T, T) weights with a row and a column per word; at a width where the columns do not
    fit they go on in blocks, each repeating the row's word (every value whole)."""
    words = [printable(token) for token in tokens]
    rows = [[Text(word, style="bold"), *(f"{w:.3f}" for w in row)] for word, row in zip(words, weights)]
    table = fitted_table(["", *words], rows, keys=1, justify=["left"] + ["right"] * len(words), box=HEAVY_HEAD)
    return Group(Text(title, style="italic"), table)


def _matrix_table(matrix: np.ndarray, title: str, labels: list[str] | None = None) -> Group:
    """A (T, D) matrix, rows t0, t1, ...; columns in blocks when they do not fit the width."""
    columns = ["", *(labels or [""] * matrix.shape[1])]
    rows = [[Text(f"t{i}", style="bold"), *(f"{v:.4f}" for v in row)] for i, row in enumerate(matrix)]
    table = fitted_table(columns, rows, keys=1, justify=["left"] + ["right"] * matrix.shape[1], box=HEAVY_HEAD,
                         show_header=labels is not None)
    return Group(Text(title, style="italic"), table)


def _heading(title: str, rest: str) -> None:
    """A bold title and its details on one line (never wrapped), then a blank line."""
    console.print(Text.assemble((title, "bold"), " " + rest), soft_wrap=True)
    console.print()


@app.command()
def demo(
    text: str = typer.Option(
        DEMO_SENTENCE, "--text", help=f"Words to attend over (split on spaces; at most {MAX_WORDS} words, {MAX_TEXT_CHARS} characters)."
    ),
    seed: int = typer.Option(42, help="Seed for the embeddings and weights (>= 0)."),
    causal: bool = typer.Option(False, "--causal", help="Apply a causal mask: each word sees only earlier words."),
    d_model: int = typer.Option(16, help=f"Embedding size (2 to {MAX_D_MODEL})."),
    heads: int = typer.Option(4, help=f"Heads in the multi-head layer (must divide d_model; at most {MAX_HEADS})."),
    no_color: bool = typer.Option(
        False, "--no-color", help="Shade with ░▒▓█ instead of colour (the default when the output is not a colour terminal)."
    ),
) -> None:
    """A seeded single head and a multi-head layer over a sentence, with random weights."""
    from attnkit.nn import MultiHeadAttention, SingleHeadSelfAttention
    from attnkit.viz.terminal import heatmap

    check_text("--text", text)
    tokens = text.split()
    if not tokens:
        usage("expected some words in --text, got an empty string")
    if len(text) > MAX_TEXT_CHARS:
        usage(f"expected --text of at most {MAX_TEXT_CHARS} characters (demo's limit), got {len(text)}")
    if len(tokens) > MAX_WORDS:
        usage(f"expected --text of at most {MAX_WORDS} words (demo's limit), got {len(tokens)}")
    check_int("--d-model", d_model, 2, None, "the single head has d_model // 2 dimensions")
    check_int("--d-model", d_model, None, MAX_D_MODEL, "demo's limit")
    check_int("--heads", heads, None, MAX_HEADS, "demo's limit")
    if heads < 1 or d_model % heads:
        usage(f"expected --heads to divide --d-model={d_model}, got {heads}")
    if seed < 0:
        usage(f"expected a non-negative --seed, got {seed}")
    color = use_color(no_color)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(tokens), d_model)).astype(np.float32)  # (T, d_model) random embeddings
    width = min(console.width, 100)
    mask_note = "causal: each word sees itself and earlier words" if causal else "no mask: every word sees every word"

    head = SingleHeadSelfAttention(d_model, d_model // 2, seed=seed)
    _, weights = head(x, is_causal=causal)  # (T, T)
    _heading("One self-attention head", f"(d_model={d_model}, d_head={d_model // 2}, seed={seed}; {mask_note})")
    console.print(_weight_table(weights, tokens, "Attention weights: row = the word that looks, column = where it looks"))
    console.print()
    console.print(heatmap(weights, tokens, color=color, width=width))
    sums = weights.sum(axis=-1)
    console.print(f"row sums: {' '.join(f'{s:.6f}' for s in sums)}")
    if causal:
        above = weights[np.triu_indices(len(tokens), k=1)]
        console.print(f"largest weight above the diagonal (on a future word): {above.max() if above.size else 0.0:g}")

    mha = MultiHeadAttention(d_model, heads, seed=seed)
    _, per_head = mha(x[None], is_causal=causal, need_weights=True, average_attn_weights=False)  # (1, H, T, T)
    console.print()
    _heading("Multi-head attention", f"({heads} heads of size {d_model // heads}): each head looks differently")
    for h in range(heads):
        console.print(heatmap(per_head[0, h], tokens, color=color, width=width, title=f"head {h}"))


@app.command()
def walkthrough() -> None:
    """The 3-token, 2-head numeric trace with identity projections, step by step."""
    from attnkit.walkthrough import walkthrough as trace_walkthrough

    trace = trace_walkthrough()
    labels = [f"d{j}" for j in range(trace.x.shape[1])]
    console.print("[bold]Numerical walkthrough:[/] 3 tokens, d_model=4, 2 heads, d_head=2, W_Q = W_K = W_V = I\n")
    console.print(_matrix_table(trace.x, "Input X (3, 4); with identity projections Q = K = V = X", labels))
    for h, head in enumerate(trace.heads):
        cols = f"columns {2 * h}-{2 * h + 1}"
        console.print(f"\n[bold cyan]Head {h}[/] reads {cols} of X")
        console.print(_matrix_table(head.query, f"Q{h} = K{h} = V{h} (3, 2)"))
        console.print(_matrix_table(head.scores, f"1. scores = Q{h} @ K{h}^T (3, 3)"))
        console.print(_matrix_table(head.scaled_scores, f"2. scaled scores = scores / sqrt({trace.d_head})"))
        console.print(_matrix_table(head.weights, "3. weights = softmax of each row (rows sum to 1)"))
        console.print(_matrix_table(head.output, f"4. head {h} output = weights @ V{h} (3, 2)"))
    console.print()
    console.print(_matrix_table(trace.concatenated, "5. concatenation [head 0 | head 1] (3, 4)", labels))
    console.print("\nWith W_O = I this concatenation is the layer's output.")
