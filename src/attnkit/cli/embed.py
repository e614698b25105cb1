"""`attnkit embed` and `attnkit similarity`: sentence embeddings from a real encoder.

The model loads inside the commands (never at import), so `attnkit --help`
stays fast. Progress bars go to stderr, so `--json` output on stdout stays
clean for pipes.

`embed` streams: it reads, encodes and writes `STREAM_SENTENCES` sentences at a
time, the JSON document written piece by piece, so its memory is bounded by that
window and not by the input (a 64 MiB file holds millions of short lines; kept
whole, their tokens and Python floats took gigabytes: docs/benchmarks.md). What it
holds beyond the window is the input text itself, read and checked (UTF-8, at
most 64 MiB) before anything is printed. `similarity` needs every embedding for
its n x n matrix, so it takes at most `MAX_SIMILARITY_SENTENCES`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import sys
from typing import Any, Callable, Iterable, Iterator, Optional

import typer
from rich.text import Text

from attnkit.cli._app import app, check_int, check_text, console, err_console, fail, usage
from attnkit.cli._input import read_stdin, read_text_file
from attnkit.cli.models import BACKEND_HELP, ENCODER, check_backend, model_option
from attnkit.viz.text import printable

_MODEL_HELP = "minilm (the embedded all-MiniLM-L6-v2, the default) or a BERT-family model folder (config.json, model.safetensors, tokenizer.json or vocab.txt)."
MAX_THREADS = 256
"""The most worker threads --threads takes."""
STREAM_SENTENCES = 1024
"""Sentences read, encoded and written together (rounded down to a multiple of --batch-size,
at least one batch): embed's memory is bounded by this window, not by the input."""
MAX_TABLE_ROWS = 1000
"""The most sentences embed's table shows (and embeds); --json has no limit."""
MAX_SIMILARITY_SENTENCES = 2000
"""The most sentences similarity compares: its matrix has n x n values (2000: 4 million,
16 MB as float32 and about 80 MB of JSON)."""
PIECE_CHARS = 1 << 20
"""Characters of the input split into lines at a time (then extended to the next line break)."""
_LINE_BREAK = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
"""Where str.splitlines splits: a cut right after one of these keeps every line whole."""


class Sentences:
    """The sentences of a command: TEXT arguments, then the non-blank lines of a text.

    The lines are found a piece of the text at a time as they are iterated (exactly
    `[l for l in text.splitlines() if l.strip()]`), never kept all at once: a 64 MiB file
    of short lines is millions of strings. `len()` counts them without keeping them.
    """

    def __init__(self, texts: list[str], text: str = "") -> None:
        self._texts = texts
        self._text = text
        self._count = len(texts) + sum(1 for _ in self._lines())

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        yield from self._texts
        yield from self._lines()

    def _lines(self) -> Iterator[str]:
        text, start = self._text, 0
        while start < len(text):
            found = _LINE_BREAK.search(text, min(start + PIECE_CHARS, len(text)))
            end = found.end() if found else len(text)
            yield from (line for line in text[start:end].splitlines() if line.strip())
            start = end


def _read_texts(texts: list[str], file: Optional[str]) -> Sentences:
    """TEXT arguments, then the lines of --file (or of stdin for '-'); blank lines skipped.

    A single TEXT '-' reads stdin. Text arguments, files and stdin must be UTF-8.
    """
    stdin_text = texts == ["-"]
    if stdin_text and file is not None:
        usage("expected sentences from '-' (stdin) or from --file, got both")
    for text in texts:
        check_text("TEXT", text)
    if stdin_text:
        return Sentences([], read_stdin())
    if file is not None:
        return Sentences(list(texts), read_text_file("--file", file))
    return Sentences(list(texts))


def _check_sizes(batch_size: int, threads: Optional[int]) -> None:
    check_int("--batch-size", batch_size, 1)
    check_int("--threads", threads, 1, MAX_THREADS)


def _load_encoder(model: Optional[str], threads: Optional[int], command: str, backend: str = "naive") -> Any:
    from attnkit.models.sentence import SentenceEncoder
    from attnkit.models.embedded import ModelPackageNotFoundError

    model = model_option(model, ENCODER, command)
    try:
        return SentenceEncoder.from_pretrained(model, num_threads=threads, backend=backend)
    except (ModelPackageNotFoundError, ValueError, OSError, KeyError) as error:
        fail(str(error))


@contextlib.contextmanager
def _progress(total: int, batch_size: int) -> Iterator[Optional[Callable[[int], None]]]:
    """A progress bar on stderr when there is more than one batch: yields its `advance`."""
    if total <= batch_size:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    # stdout is not redirected through the bar: what embed writes there stays on stdout.
    with Progress(*columns, console=err_console, transient=True, redirect_stdout=False,
                  redirect_stderr=False) as progress:
        task = progress.add_task("embed", total=total)
        yield lambda done: progress.advance(task, done)


def _embedded(encoder: Any, sentences: Iterable[str], total: int, batch_size: int) -> Iterator[tuple[list[str], Any]]:
    """(texts, embeddings (n, D) float32) for `sentences`, a window of STREAM_SENTENCES at a time.

    Each window is one `encoder.encode` call (sorted by length inside it), so an input of
    at most one window is encoded exactly as a single call would.
    """
    window = batch_size * max(1, STREAM_SENTENCES // batch_size)
    iterator = iter(sentences)
    with _progress(total, batch_size) as advance:
        while texts := list(itertools.islice(iterator, window)):
            yield texts, encoder.encode(texts, batch_size=batch_size, progress=advance)


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
    if as_json:
        _write_json(encoder, sentences, batch_size)
        return
    shown = min(len(sentences), MAX_TABLE_ROWS)
    table = Table(title=f"{shown} embedding(s) of dimension {encoder.dim}", show_edge=False)
    table.add_column("#", justify="right")
    table.add_column("text")
    table.add_column("first values")
    table.add_column("norm", justify="right")
    index = 0
    for batch, embeddings in _embedded(encoder, itertools.islice(sentences, shown), shown, batch_size):
        for text, row in zip(batch, embeddings):
            head = " ".join(f"{v:+.4f}" for v in row[:4]) + " …"
            table.add_row(str(index), _short(text), head, f"{np.linalg.norm(row):.4f}")
            index += 1
    console.print(table)
    if shown < len(sentences):
        console.print(f"the first {shown} of {len(sentences)} sentences; use --json for all of them, "
                      "with the full vectors", style="dim")
    else:
        console.print("use --json for the full vectors", style="dim")


def _write_json(encoder: Any, sentences: Sentences, batch_size: int) -> None:
    """`{"model": ..., "dim": D, "embeddings": [{"text": ..., "embedding": [...]}, ...]}` on stdout,
    written a window at a time: the bytes of `json.dumps` of the whole document, one line.
    The floats are the float32 values, exactly (Python's shortest repr of each)."""
    out = sys.stdout
    out.write(f'{{"model": {json.dumps(str(encoder.path))}, "dim": {int(encoder.dim)}, "embeddings": [')
    separator = ""
    for batch, embeddings in _embedded(encoder, sentences, len(sentences), batch_size):
        items = (json.dumps({"text": text, "embedding": row.tolist()}) for text, row in zip(batch, embeddings))
        out.write(separator + ", ".join(items))
        separator = ", "
    out.write("]}\n")


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

    from attnkit.viz.tables import fitted_table

    _check_sizes(batch_size, threads)
    check_backend(backend)
    sentences = _read_texts(texts or [], file)
    if len(sentences) < 2:
        usage(f"expected at least two sentences to compare, got {len(sentences)}")
    if len(sentences) > MAX_SIMILARITY_SENTENCES:
        fail(f"expected at most {MAX_SIMILARITY_SENTENCES} sentences to compare (the matrix has n x n values), "
             f"got {len(sentences)}; attnkit embed --json writes the embeddings of any number")
    encoder = _load_encoder(model, threads, "similarity", backend)
    sentences = list(sentences)
    embeddings = np.concatenate([e for _, e in _embedded(encoder, sentences, len(sentences), batch_size)])
    norms = np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), np.float32(1e-12))
    unit = embeddings / norms
    matrix = unit @ unit.T  # (n, n) cosine similarities
    if as_json:  # the bytes of json.dumps({"texts": ..., "similarity": ...}), a row at a time
        sys.stdout.write(f'{{"texts": {json.dumps(sentences)}, "similarity": [')
        for index, row in enumerate(matrix):
            sys.stdout.write((", " if index else "") + json.dumps(row.tolist()))
        sys.stdout.write("]}\n")
        return
    if len(sentences) == 2:
        console.print(Text.assemble("cosine similarity: ", (f"{matrix[0, 1]:.4f}", "bold")))
        console.print(Text.assemble("  A: ", _short(sentences[0], 70), "\n  B: ", _short(sentences[1], 70)))
        return
    rows = []
    for index, (text, row) in enumerate(zip(sentences, matrix)):
        others = np.delete(np.arange(len(row)), index)
        closest = others[np.argmax(row[others])]
        cells = []
        for j, value in enumerate(row):
            cell = "—" if j == index else f"{value:.3f}"
            cells.append(Text(cell, style="bold" if j == closest else ""))
        rows.append([str(index), _short(text, 40), *cells])
    # the columns go on in blocks when they do not fit, each block repeating # and text
    columns = ["#", "text", *(str(index) for index in range(len(sentences)))]
    console.print(fitted_table(columns, rows, title="cosine similarity", keys=2,
                               justify=["right", "left"] + ["right"] * len(sentences)))
    console.print("bold: each sentence's closest match", style="dim")
