"""`attnkit embed` and `attnkit similarity`: sentence embeddings from a real encoder.

The model loads inside the commands (never at import), so `attnkit --help`
stays fast. Progress bars go to stderr, so `--json` output on stdout stays
clean for pipes.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

import typer
from rich.text import Text

from attnkit.cli._app import app, check_int, check_text, console, err_console, fail, usage
from attnkit.cli._input import read_stdin, read_text_file
from attnkit.cli.models import BACKEND_HELP, ENCODER, check_backend, model_option
from attnkit.viz.text import printable

_MODEL_HELP = "minilm (the embedded all-MiniLM-L6-v2, the default) or a BERT-family model folder (config.json, model.safetensors, tokenizer.json or vocab.txt)."
MAX_THREADS = 256
"""The most worker threads --threads takes."""


def _read_texts(texts: list[str], file: Optional[str]) -> list[str]:
    """TEXT arguments, then the lines of --file (or of stdin for '-'); blank lines skipped.

    A single TEXT '-' reads stdin. Text arguments, files and stdin must be UTF-8.
    """
    stdin_text = texts == ["-"]
    if stdin_text and file is not None:
        usage("expected sentences from '-' (stdin) or from --file, got both")
    for text in texts:
        check_text("TEXT", text)
    if stdin_text:
        texts, lines = [], read_stdin().splitlines()
    elif file is not None:
        lines = read_text_file("--file", file).splitlines()
    else:
        lines = []
    return list(texts) + [line for line in lines if line.strip()]


def _check_sizes(batch_size: int, threads: Optional[int]) -> None:
    check_int("--batch-size", batch_size, 1)
    check_int("--threads", threads, 1, MAX_THREADS)


def _load_encoder(model: Optional[str], threads: Optional[int], command: str, backend: str = "naive") -> Any:
    from attnkit.models.bert import SentenceEncoder
    from attnkit.models.embedded import ModelPackageNotFoundError

    model = model_option(model, ENCODER, command)
    try:
        return SentenceEncoder.from_pretrained(model, num_threads=threads, backend=backend)
    except (ModelPackageNotFoundError, ValueError, OSError, KeyError) as error:
        fail(str(error))


def _encode(encoder: Any, texts: list[str], batch_size: int) -> Any:
    """encoder.encode with a progress bar on stderr when there are many sentences."""
    if len(texts) <= batch_size:
        return encoder.encode(texts, batch_size=batch_size)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task("embed", total=len(texts))
        return encoder.encode(
            texts, batch_size=batch_size, progress=lambda done: progress.advance(task, done)
        )


def _short(text: str, width: int = 48) -> Text:
    """A sentence as one table cell: plain text (never markup), control characters escaped."""
    text = printable(" ".join(text.split()))
    return Text(text if len(text) <= width else text[: width - 1] + "…")


@app.command()
def embed(
    texts: list[str] = typer.Argument(None, help="Sentences to embed ('-' reads lines from stdin)."),
    file: Optional[str] = typer.Option(None, "--file", "-f", help="Read one sentence per line from this file ('-' for stdin)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: model, dim and each text with its embedding."),
    batch_size: int = typer.Option(32, "--batch-size", help="Sentences per batch."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Worker threads (default: all CPUs)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    backend: str = typer.Option("naive", "--backend", help=BACKEND_HELP),
) -> None:
    """Print sentence embeddings (mean-pooled, L2-normalized, like sentence-transformers)."""
    import numpy as np
    from rich.table import Table

    _check_sizes(batch_size, threads)
    check_backend(backend)
    sentences = _read_texts(texts or [], file)
    if not sentences:
        usage("expected at least one sentence: give TEXT arguments, --file F, or '-' for stdin")
    encoder = _load_encoder(model, threads, "embed", backend)
    embeddings = _encode(encoder, sentences, batch_size)
    if as_json:
        payload = {
            "model": str(encoder.path),
            "dim": int(embeddings.shape[1]),
            "embeddings": [
                {"text": text, "embedding": [float(v) for v in row]}
                for text, row in zip(sentences, embeddings)
            ],
        }
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    table = Table(title=f"{len(sentences)} embedding(s) of dimension {embeddings.shape[1]}", show_edge=False)
    table.add_column("#", justify="right")
    table.add_column("text")
    table.add_column("first values")
    table.add_column("norm", justify="right")
    with np.printoptions(precision=4, suppress=True):
        for index, (text, row) in enumerate(zip(sentences, embeddings)):
            head = " ".join(f"{v:+.4f}" for v in row[:4]) + " …"
            table.add_row(str(index), _short(text), head, f"{np.linalg.norm(row):.4f}")
    console.print(table)
    console.print("use --json for the full vectors", style="dim")


@app.command()
def similarity(
    texts: list[str] = typer.Argument(None, help="Two or more sentences to compare ('-' reads stdin)."),
    file: Optional[str] = typer.Option(None, "--file", "-f", help="Read one sentence per line from this file ('-' for stdin)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: the texts and the cosine similarity matrix."),
    batch_size: int = typer.Option(32, "--batch-size", help="Sentences per batch."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Worker threads (default: all CPUs)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    backend: str = typer.Option("naive", "--backend", help=BACKEND_HELP),
) -> None:
    """Print the cosine similarity of every pair of sentences."""
    import numpy as np
    from rich.table import Table

    _check_sizes(batch_size, threads)
    check_backend(backend)
    sentences = _read_texts(texts or [], file)
    if len(sentences) < 2:
        usage(f"expected at least two sentences to compare, got {len(sentences)}")
    encoder = _load_encoder(model, threads, "similarity", backend)
    embeddings = _encode(encoder, sentences, batch_size)
    norms = np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), np.float32(1e-12))
    unit = embeddings / norms
    matrix = unit @ unit.T  # (n, n) cosine similarities
    if as_json:
        payload = {"texts": sentences, "similarity": [[float(v) for v in row] for row in matrix]}
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    if len(sentences) == 2:
        console.print(Text.assemble("cosine similarity: ", (f"{matrix[0, 1]:.4f}", "bold")))
        console.print(Text.assemble("  A: ", _short(sentences[0], 70), "\n  B: ", _short(sentences[1], 70)))
        return
    table = Table(title="cosine similarity", show_edge=False)
    table.add_column("#", justify="right")
    table.add_column("text")
    for index in range(len(sentences)):
        table.add_column(str(index), justify="right")
    for index, (text, row) in enumerate(zip(sentences, matrix)):
        others = np.delete(np.arange(len(row)), index)
        closest = others[np.argmax(row[others])]
        cells = []
        for j, value in enumerate(row):
            cell = "—" if j == index else f"{value:.3f}"
            cells.append(Text(cell, style="bold" if j == closest else ""))
        table.add_row(str(index), _short(text, 40), *cells)
    console.print(table)
    console.print("bold: each sentence's closest match", style="dim")
