"""`attnkit demo` and `attnkit walkthrough`: the seeds' demos, made real."""

from __future__ import annotations

import numpy as np
import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from attnkit.cli._app import app, console, fail

DEMO_SENTENCE = "The cat sat on the mat"


def _weight_table(weights: np.ndarray, tokens: list[str], title: str) -> Group:
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("", style="bold")
    for token in tokens:
        table.add_column(token, justify="right")
    for token, row in zip(tokens, weights):
        table.add_row(token, *(f"{w:.3f}" for w in row))
    return Group(Text(title, style="italic"), table)


def _matrix_table(matrix: np.ndarray, title: str, labels: list[str] | None = None) -> Group:
    table = Table(show_header=labels is not None, show_edge=False)
    table.add_column("", style="bold")
    for label in labels or [""] * matrix.shape[1]:
        table.add_column(label, justify="right")
    for i, row in enumerate(matrix):
        table.add_row(f"t{i}", *(f"{v:.4f}" for v in row))
    return Group(Text(title, style="italic"), table)


@app.command()
def demo(
    text: str = typer.Option(DEMO_SENTENCE, "--text", help="Words to attend over (split on spaces)."),
    seed: int = typer.Option(42, help="Seed for the embeddings and weights."),
    causal: bool = typer.Option(False, "--causal", help="Apply a causal mask: each word sees only earlier words."),
    d_model: int = typer.Option(16, help="Embedding size."),
    heads: int = typer.Option(4, help="Heads in the multi-head layer (must divide d_model)."),
    color: bool = typer.Option(True, "--color/--no-color", help="Truecolor heatmaps, or ░▒▓█ shading."),
) -> None:
    """A seeded single head and a multi-head layer over a sentence, with random weights."""
    from attnkit.nn import MultiHeadAttention, SingleHeadSelfAttention
    from attnkit.viz.terminal import heatmap

    tokens = text.split()
    if not tokens:
        fail("expected some words in --text, got an empty string")
    if d_model < 2:
        fail(f"expected --d-model >= 2 (the single head has d_model // 2 dimensions), got {d_model}")
    if heads < 1 or d_model % heads:
        fail(f"expected --heads to divide --d-model={d_model}, got {heads}")
    if seed < 0:
        fail(f"expected a non-negative --seed, got {seed}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(tokens), d_model)).astype(np.float32)  # (T, d_model) random embeddings
    width = min(console.width, 100)
    mask_note = "causal: each word sees itself and earlier words" if causal else "no mask: every word sees every word"

    head = SingleHeadSelfAttention(d_model, d_model // 2, seed=seed)
    _, weights = head(x, is_causal=causal)  # (T, T)
    console.print(f"[bold]One self-attention head[/] (d_model={d_model}, d_head={d_model // 2}, seed={seed}; {mask_note})\n")
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
    console.print(f"\n[bold]Multi-head attention[/] ({heads} heads of size {d_model // heads}): each head looks differently\n")
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
