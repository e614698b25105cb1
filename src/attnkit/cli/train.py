"""`attnkit train`: watch attention learn to copy (an induction head), on the CPU."""

from __future__ import annotations

from pathlib import Path

import typer

from attnkit.cli._app import app, console, err_console, fail


@app.command()
def train(
    out: Path = typer.Option(Path("induction_head.png"), "--out", "-o", help="Where to save the copying head's PNG."),
    steps: int = typer.Option(400, "--steps", min=1, help="Optimizer steps (one fresh batch each)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the initial weights and the data."),
    vocab_size: int = typer.Option(24, "--vocab-size", min=2, help="Tokens in the vocabulary."),
    half_len: int = typer.Option(12, "--half-len", min=2, help="n: n random tokens, then the same n again."),
    min_half_len: int = typer.Option(
        6, "--min-half-len", min=2, help="Training draws the repeat period from [min-half-len, half-len]."
    ),
    layers: int = typer.Option(2, "--layers", min=1, help="TransformerBlocks (an induction head needs 2)."),
    d_model: int = typer.Option(64, "--d-model", min=1, help="Model width."),
    heads: int = typer.Option(4, "--heads", min=1, help="Attention heads per layer."),
    d_ff: int = typer.Option(128, "--d-ff", min=1, help="Feed-forward hidden size."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Sequences per step."),
    lr: float = typer.Option(3e-3, "--lr", min=0.0, help="Peak AdamW learning rate."),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads (one is fastest for this small model)."),
) -> None:
    """Train a small attnkit.torch decoder to continue repeated random tokens.

    Predicting the repeated half needs an induction head: find the earlier
    occurrence of the current token and copy the token after it. Shows loss and
    accuracy as it trains, then saves a PNG of the head that learned to copy
    (its off-diagonal stripe).
    """
    try:
        import torch
    except ImportError:
        fail("attnkit train needs PyTorch: pip install 'attnkit[torch]'")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from attnkit.torch.induction import InductionConfig, evaluate, find_copy_head, plot_copy_head, train_induction

    try:
        config = InductionConfig(
            vocab_size=vocab_size, half_len=half_len, min_half_len=min_half_len, d_model=d_model,
            num_heads=heads, num_layers=layers, d_ff=d_ff, batch_size=batch_size, steps=steps, lr=lr,
            warmup_steps=min(50, max(1, steps // 8)), seed=seed,
        )
    except ValueError as e:
        fail(str(e))
    if out.parent and not out.parent.exists():
        fail(f"cannot save {out}: directory {out.parent} does not exist")

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    console.print(
        f"[bold]attnkit train[/]: {layers}-layer decoder (d_model={d_model}, {heads} heads), "
        f"vocab {vocab_size}, sequences of {half_len} random tokens then the same again, "
        f"{steps} steps, seed {seed}"
    )
    try:
        with Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}  repeat-half accuracy {task.fields[accuracy]:6.1%}"),
            TimeElapsedColumn(), console=err_console, transient=False,
        ) as bar:
            task = bar.add_task("train", total=steps, loss=float("nan"), accuracy=0.0)

            def report(metrics) -> None:
                bar.update(task, completed=metrics.step, loss=metrics.loss, accuracy=metrics.accuracy)

            result = train_induction(config, callback=report)
        variable_loss, variable_accuracy = evaluate(result.model, fixed_period=False)
        head = find_copy_head(result.model)
        plot_copy_head(head, out, config.half_len)
    finally:
        torch.set_num_threads(previous_threads)

    table = Table(show_header=False, box=None)
    table.add_row("held-out accuracy, repeated half (n + n)", f"{result.eval_accuracy:.2%}")
    table.add_row(f"held-out accuracy, periods {min_half_len}..{half_len}", f"{variable_accuracy:.2%}")
    table.add_row("held-out loss", f"{result.eval_loss:.4f}")
    table.add_row("training time", f"{result.seconds:.1f} s")
    table.add_row("copying head", f"layer {head.layer}, head {head.head} (stripe score {head.score:.2f})")
    table.add_row("picture", str(out))
    console.print(table)
