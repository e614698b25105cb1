"""`attnkit train`: watch attention learn to copy (an induction head), on the CPU."""

from __future__ import annotations

import typer
from rich.text import Text

from attnkit.cli._app import app, check_float, check_int, console, err_console, say, usage
from attnkit.cli._output import plan, write_all
from attnkit.extras import require

# Sizes that keep one training run on a laptop CPU (each is named in its error).
LIMITS = {
    "--steps": 1_000_000, "--vocab-size": 100_000, "--half-len": 1024, "--layers": 16, "--d-model": 1024,
    "--heads": 64, "--d-ff": 8192, "--batch-size": 4096, "--threads": 256, "--context-parallel": 64,
}


@app.command()
def train(
    out: str = typer.Option(
        "induction_head.png", "--out", "-o", metavar="FILE.png", help="Where to save the copying head's PNG."
    ),
    steps: int = typer.Option(400, "--steps", help="Optimizer steps (one fresh batch each)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the initial weights and the data (>= 0)."),
    vocab_size: int = typer.Option(24, "--vocab-size", help="Tokens in the vocabulary."),
    half_len: int = typer.Option(12, "--half-len", help="n: n random tokens, then the same n again."),
    min_half_len: int = typer.Option(
        6, "--min-half-len", help="Training draws the repeat period from [min-half-len, half-len]."
    ),
    layers: int = typer.Option(2, "--layers", help="TransformerBlocks (an induction head needs 2)."),
    d_model: int = typer.Option(64, "--d-model", help="Model width."),
    heads: int = typer.Option(4, "--heads", help="Attention heads per layer."),
    d_ff: int = typer.Option(128, "--d-ff", help="Feed-forward hidden size."),
    batch_size: int = typer.Option(64, "--batch-size", help="Sequences per step."),
    lr: float = typer.Option(3e-3, "--lr", help="Peak AdamW learning rate, in (0, 1]."),
    threads: int = typer.Option(1, "--threads", help="torch threads (one is fastest for this small model)."),
    context_parallel: int = typer.Option(
        1, "--context-parallel", metavar="N",
        help="Split every sequence over N local processes (gloo, ring attention); 1 = one process.",
    ),
) -> None:
    """Train a small attnkit.torch decoder to continue repeated random tokens.

    Predicting the repeated half needs an induction head: find the earlier
    occurrence of the current token and copy the token after it. Shows loss and
    accuracy as it trains, then saves a PNG of the head that learned to copy
    (its off-diagonal stripe).
    """
    minimum = {"--vocab-size": 2, "--half-len": 2, "--min-half-len": 2}
    for option, value in (("--steps", steps), ("--vocab-size", vocab_size), ("--half-len", half_len),
                          ("--min-half-len", min_half_len), ("--layers", layers), ("--d-model", d_model),
                          ("--heads", heads), ("--d-ff", d_ff), ("--batch-size", batch_size),
                          ("--threads", threads), ("--context-parallel", context_parallel)):
        check_int(option, value, minimum.get(option, 1), LIMITS.get(option), "attnkit train's limit")
    check_int("--seed", seed, 0)
    check_float("--lr", lr, 0.0, 1.0, low_open=True)
    if context_parallel > half_len:
        usage(f"--context-parallel {context_parallel} cuts each sequence of 2 x --half-len = {2 * half_len} tokens "
              f"into {2 * context_parallel} zigzag chunks: expected --half-len >= {context_parallel}")
    output = plan("--out", out, (".png",))
    torch = require("torch", "torch", "attnkit train")
    require("matplotlib", "png", "attnkit train's PNG")
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
        usage(str(e))

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    console.print(Text.assemble(
        ("attnkit train", "bold"),
        f": {layers}-layer decoder (d_model={d_model}, {heads} heads), vocab {vocab_size}, sequences of "
        f"{half_len} random tokens then the same again, {steps} steps, seed {seed}",
    ), soft_wrap=True)
    try:
        with Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  repeat-half accuracy {task.fields[accuracy]}"),
            TimeElapsedColumn(), console=err_console, transient=False,
        ) as bar:
            # No number before the first step has been measured (not "nan").
            task = bar.add_task("train", total=steps, loss="  –   ", accuracy="  –   ")

            def report(metrics) -> None:
                bar.update(task, completed=metrics.step, loss=f"{metrics.loss:.4f}",
                           accuracy=f"{metrics.accuracy:6.1%}")

            if context_parallel > 1:
                result = _train_context_parallel(config, context_parallel, bar, task)
            else:
                result = train_induction(config, callback=report)
        variable_loss, variable_accuracy = evaluate(result.model, fixed_period=False)
        head = find_copy_head(result.model)
        replaced = output.target.exists()
        write_all([(output, lambda path: plot_copy_head(head, path, config.half_len))])
    finally:
        torch.set_num_threads(previous_threads)

    table = Table(show_header=False, box=None)
    table.add_column(no_wrap=True)  # the labels stay whole; the values wrap
    table.add_column()
    table.add_row("held-out accuracy, repeated half (n + n)", f"{result.eval_accuracy:.2%}")
    table.add_row(f"held-out accuracy, periods {min_half_len}..{half_len}", f"{variable_accuracy:.2%}")
    table.add_row("held-out loss", f"{result.eval_loss:.4f}")
    table.add_row("training time", f"{result.seconds:.1f} s")
    table.add_row("copying head", f"layer {head.layer}, head {head.head} (stripe score {head.score:.2f})")
    table.add_row("what it means", _meaning(result.eval_accuracy, vocab_size, steps))
    console.print(table)
    say(f"wrote {output.path}" + (" (replaced the file that was there)" if replaced else ""))


def _meaning(accuracy: float, vocab_size: int, steps: int) -> str:
    """One sentence on the held-out accuracy: learned, or how to get there."""
    from attnkit.torch.induction import InductionConfig

    if accuracy >= 0.95:
        return "learned: predicting the repeated half takes an induction head, drawn in the picture"
    return (f"not learned yet (chance is {1 / (vocab_size - 1):.0%}, learned is about 100%): "
            f"train longer, --steps {max(2 * steps, InductionConfig.steps)}")


def _train_context_parallel(config, world_size: int, bar, task):
    """train_induction's result, trained in world_size local processes with the sequence split."""
    import time

    from attnkit.torch.induction import TrainResult, evaluate
    from attnkit.torch.train_cp import train_on_local_ranks

    bar.update(task, description=f"training on {world_size} processes")
    start = time.perf_counter()
    model, history = train_on_local_ranks(config, world_size)
    seconds = time.perf_counter() - start
    last = history[-1]
    bar.update(task, completed=last.step, loss=f"{last.loss:.4f}", accuracy=f"{last.accuracy:6.1%}")
    eval_loss, eval_accuracy = evaluate(model)
    return TrainResult(model, history, eval_accuracy, eval_loss, seconds)
