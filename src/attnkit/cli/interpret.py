"""`attnkit heads`, `attnkit patch` and `attnkit lens`: what each head does, and whether it matters.

- heads: every head's detector scores (`attnkit.interpret.heads`), its role (the detector
  that scores highest, when above --threshold) and its importance: how much the model's
  loss on the text rises when the head alone is turned off (zero ablation), sorted.
- patch: activation patching of every head (`attnkit.interpret.patch_heads`), the answer's
  logit minus the wrong answer's at the last position, as a layers x heads heatmap.
- lens: the logit lens (`attnkit.interpret.logit_lens`), the top tokens of each layer at
  each position.

Each command checks its arguments and the files it will write before the model loads,
and writes its files only when the work succeeded (cli/_output.py).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer
from rich.table import Table
from rich.text import Text

from attnkit.cli._app import app, check_float, check_int, check_text, console, err_console, fail, note, say, usage, \
    use_color, warn
from attnkit.cli._output import Output, plan, write_all
from attnkit.cli.models import ANY, DECODER, model_option, require_pieces

_MODEL_HELP = ("smollm2 (the embedded decoder, the default), a .gguf file or a Llama or GPT-2 folder; "
               "heads also takes minilm or a BERT folder (no importance: an encoder has no loss to raise).")
_DECODER_HELP = "smollm2 (the embedded decoder, the default), a .gguf file, or a Llama or GPT-2 folder."
MAX_TOKENS = 256
"""The most tokens these commands take (the lens keeps layers x T x vocab logits)."""

ROLES = {"previous_token": "previous", "duplicate_token": "duplicate", "induction": "induction",
         "first_token": "first", "self": "self"}
"""Detector names as the table's role words."""


# ----------------------------------------------------------------------------- shared


def _check_text(name: str, text: str) -> None:
    check_text(name, text)
    if not text.strip():
        usage(f"expected a non-empty text for {name}, got {text!r}")


def _is_encoder(name: str) -> bool:
    if name == "minilm":
        return True
    config = Path(name).expanduser() / "config.json"
    if not config.is_file():
        return False
    from attnkit.viz.providers import OWN_ENCODER_TYPES

    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") in OWN_ENCODER_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def _load(name: str, command: str, *, encoders: bool = False) -> Any:
    """The model `--model` names, checked first; an encoder only where `encoders`."""
    if encoders and name == "random":
        fail("random draws attention maps only; attnkit heads needs a model to run and intervene on "
             "(smollm2, minilm, or a model path)")
    if encoders and _is_encoder(name):
        model_option(name, ANY, command)
        from attnkit.models.sentence import SentenceEncoder
        from attnkit.models.embedded import ModelPackageNotFoundError

        try:
            with err_console.status("loading the model..."):
                return SentenceEncoder.from_pretrained(None if name == "minilm" else name)
        except (ModelPackageNotFoundError, ValueError, OSError, KeyError) as error:
            fail(str(error))
    from attnkit.cli.generate import load_decoder

    require_pieces(model_option(name, DECODER, command), DECODER, command)
    return load_decoder(name, command)


def _ids(model: Any, text: str, max_tokens: int, name: str = "TEXT") -> np.ndarray:
    """The text's token ids (the model's tokenizer, special tokens as it adds them), cut to
    `max_tokens` with a warning."""
    from attnkit.models.causal_lm import CausalLM

    ids = model.tokenizer.encode(text) if isinstance(model, CausalLM) else model.tokenizer.encode([text])[0].ids
    ids = np.asarray(list(ids), dtype=np.int64)
    if ids.size == 0:
        fail(f"expected {name} with at least one token, got none")
    if ids.size > max_tokens:
        warn(f"{name} has {ids.size} tokens; using the first {max_tokens} (--max-tokens)")
        ids = ids[:max_tokens]
    return ids


def _plan(png: Optional[str], html: Optional[str]) -> dict[str, Output]:
    from attnkit.runtime import require

    outputs = {}
    if png is not None:
        outputs["png"] = plan("--png", png, (".png",))
        require("matplotlib", "png", "--png")
    if html is not None:
        outputs["html"] = plan("--html", html, (".html", ".htm"))
    return outputs


def _write_grids(outputs: dict[str, Output], grids: dict[str, np.ndarray], title: str, subtitle: str) -> None:
    """Write the planned grid files all or none, then name each file written."""
    from attnkit.viz.interpret_views import render_grids_html, save_grids_png

    jobs = []
    if "png" in outputs:
        jobs.append((outputs["png"], lambda path: save_grids_png(grids, path, title=title)))
    if "html" in outputs:
        page = render_grids_html(grids, title=title, subtitle=subtitle)
        jobs.append((outputs["html"], lambda path: path.write_text(page, encoding="utf-8")))
    results = write_all(jobs)
    if "png" in outputs:
        w, h = results[0]
        say(f"wrote {outputs['png'].path} ({w}x{h})")
    if "html" in outputs:
        say(f"wrote {outputs['html'].path} (self-contained; open it in a browser)")


def _fit_columns(table_columns: list[tuple[str, int]], width: int, keep: int) -> list[int]:
    """Indices of the columns that fit in `width` cells (one space between columns): the
    first `keep` always, then the others in order while they fit."""
    shown, used = [], -1
    for index, (_, size) in enumerate(table_columns):
        if index < keep or used + 1 + size <= width:
            shown.append(index)
            used += 1 + size
    return shown


# ----------------------------------------------------------------------------- heads


def ablation_losses(model: Any, ids: np.ndarray, progress=None) -> tuple[float, np.ndarray]:
    """The model's loss on `ids` (mean next-token cross-entropy), and the loss with each head
    alone set to zero: (loss, (layers, heads)); `attnkit.interpret.head_importance`."""
    from attnkit.interpret import head_importance

    result = head_importance(model, ids, progress=progress)
    return result.loss, result.ablated


@contextlib.contextmanager
def _heads_progress(total: int):
    """A transient progress bar on stderr for `total` head ablations: yields its `advance`
    (n/total, elapsed, an estimate of what is left)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    columns = (TextColumn("ablating each head"), BarColumn(), MofNCompleteColumn(), TextColumn("heads ·"),
               TimeElapsedColumn(), TextColumn("elapsed · about"), TimeRemainingColumn(), TextColumn("left"))
    with Progress(*columns, console=err_console, transient=True, redirect_stdout=False,
                  redirect_stderr=False) as bar:
        task = bar.add_task("ablate", total=total)
        yield lambda done: bar.advance(task, done)


@app.command()
def heads(
    text: str = typer.Argument(..., help="The text to run."),
    model: str = typer.Option("smollm2", "--model", "-m", help=_MODEL_HELP),
    threshold: float = typer.Option(0.4, "--threshold", help="A head's role is its highest detector score "
                                    "when at least this (0..1]; below it the role is '-'."),
    importance: bool = typer.Option(True, "--importance/--no-importance",
                                    help="Ablate each head and measure the loss increase (every head in one batched "
                                    "sweep; --no-importance: detectors only, in a second)."),
    top: int = typer.Option(0, "--top", help="Show only the first N rows (0: every head)."),
    png: Optional[str] = typer.Option(None, "--png", metavar="FILE.png",
                                      help="Also draw a layers x heads grid of each score as FILE.png."),
    html: Optional[str] = typer.Option(None, "--html", metavar="FILE.html",
                                       help="Also write the grids as a self-contained HTML file."),
    no_color: bool = typer.Option(False, "--no-color", help="Plain text, no colour."),
    max_tokens: int = typer.Option(128, "--max-tokens", help=f"Use at most this many tokens (at most {MAX_TOKENS})."),
) -> None:
    """Every head of the model on TEXT: detector scores, role and importance, most important first."""
    from attnkit.interpret.heads import HEAD_PATTERNS, detection_pattern, pattern_scores
    from attnkit.models.causal_lm import CausalLM

    _check_text("TEXT", text)
    check_float("--threshold", threshold, 0.0, 1.0, low_open=True)
    check_int("--top", top, 0)
    check_int("--max-tokens", max_tokens, 2, MAX_TOKENS)
    outputs = _plan(png, html)
    loaded = _load(model, "heads", encoders=True)
    decoder = isinstance(loaded, CausalLM)
    ids = _ids(loaded, text, max_tokens)
    if ids.size < 2:
        fail(f"expected TEXT with at least 2 tokens to score heads, got {ids.size}")
    weights = _attention(loaded, ids)  # (layers, heads, T, T)
    scores = {name: pattern_scores(weights, detection_pattern(ids, name)) for name in HEAD_PATTERNS}
    grids = {ROLES[name]: values for name, values in scores.items()}
    loss_up = None
    if importance and decoder:
        with _heads_progress(weights.shape[0] * weights.shape[1]) as advance:
            base, ablated = ablation_losses(loaded, ids, advance)
        loss_up = ablated - base
        grids = {"loss increase when ablated": loss_up, **grids}
    elif importance:
        note("an encoder has no next-token loss: no importance column (heads runs detectors only)")
    _print_heads(scores, loss_up, threshold, top, use_color(no_color), ids.size)
    if loss_up is not None:
        say(f"loss on the text: {base:.4f} nats per token over {ids.size - 1} predictions")
    name = model if model in ("smollm2", "minilm") else Path(model).name
    _write_grids(outputs, grids, f"attnkit: the heads of {name}",
                 f"{ids.size} tokens; detector scores as TransformerLens's detect_head ('mul'), "
                 "importance = loss increase when the head alone is zero-ablated")


def _attention(model: Any, ids: np.ndarray) -> np.ndarray:
    from attnkit.nn.interface import record_attention
    from attnkit.models.causal_lm import CausalLM

    if isinstance(model, CausalLM):
        return np.asarray(model.attention(ids).weights, dtype=np.float64)
    bert = model.model
    with record_attention(bert) as recording:
        bert(ids[None], token_type_ids=np.zeros((1, ids.size), np.int64))
    return np.stack([w[0] for w in recording.maps]).astype(np.float64)


def _print_heads(scores: dict[str, np.ndarray], loss_up: np.ndarray | None, threshold: float, top: int,
                 color: bool, tokens: int) -> None:
    names = list(scores)
    stacked = np.stack([scores[n] for n in names])  # (detectors, layers, heads)
    best = stacked.argmax(axis=0)
    best_score = stacked.max(axis=0)
    layers, heads_ = best.shape
    rows = []
    for layer in range(layers):
        for head in range(heads_):
            if np.isnan(stacked[:, layer, head]).all():
                continue
            role = ROLES[names[best[layer, head]]] if best_score[layer, head] >= threshold else "-"
            key = loss_up[layer, head] if loss_up is not None else best_score[layer, head]
            rows.append((float(key), layer, head, role))
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    columns = [("layer", 5), ("head", 4), ("role", 9)]
    if loss_up is not None:
        columns.append(("Δloss", 8))
    columns += [(ROLES[n], max(5, len(ROLES[n]))) for n in names]
    shown = _fit_columns(columns, console.width, keep=4 if loss_up is not None else 3)
    table = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False,
                  header_style="bold" if color else "")
    for index in shown:
        table.add_column(columns[index][0], justify="left" if columns[index][0] == "role" else "right",
                         no_wrap=True, min_width=columns[index][1])
    for key, layer, head, role in rows[: top or None]:
        cells = [str(layer), str(head), role]
        if loss_up is not None:
            cells.append(f"{loss_up[layer, head]:+.4f}")
        cells += [f"{scores[n][layer, head]:.3f}" for n in names]
        table.add_row(*(Text(cells[i], style=_role_style(cells[i]) if i == 2 and color else "") for i in shown))
    console.print(Text(f"Every head on {tokens} tokens, " + ("most important first" if loss_up is not None
                       else "highest detector score first"), style="bold" if color else ""))
    console.print(table)
    dropped = [columns[i][0] for i in range(len(columns)) if i not in shown]
    console.print(Text("scores: share of the head's attention on the detector's pattern (TransformerLens "
                       f"detect_head, 'mul'); role: the highest score if >= {threshold:g}"
                       + ("; Δloss: loss increase with the head zero-ablated" if loss_up is not None else ""),
                       style="dim" if color else ""))
    if dropped:
        console.print(Text(f"columns left out to fit {console.width} columns: {', '.join(dropped)} "
                           "(a wider terminal, or --html, shows them)", style="dim" if color else ""))


def _role_style(role: str) -> str:
    return {"previous": "cyan", "duplicate": "yellow", "induction": "bold red", "first": "magenta",
            "self": "green"}.get(role, "dim")


# ----------------------------------------------------------------------------- patch


def _one_token(model: Any, option: str, text: str) -> int:
    """The id of `text` as one token (without the special tokens a tokenizer adds)."""
    check_text(option, text)
    if not text:
        usage(f"expected {option} to be a token, got ''")
    ids = list(model.tokenizer.encode(text, add_special_tokens=False))
    if len(ids) != 1:
        pieces = [model.tokenizer.decode([i]) for i in ids]
        hint = "" if text.startswith(" ") else "; a word after a space is usually its own token: try ' " + text + "'"
        fail(f"expected {option} to be one token of the model, got {len(ids)}: {pieces}{hint}")
    return int(ids[0])


def _name_tokens(model: Any, logits: np.ndarray, options: list[tuple[str, Optional[str], Optional[int]]]) -> None:
    """Say which token each of --answer / --wrong became; warn when the text has no leading
    space but its space-prefixed form is one token too and likelier after the clean text
    (the word that follows another usually carries its space: ' Mary', not 'Mary')."""
    for option, text, token in options:
        if text is None or token is None:
            continue
        note(f"{option} {text!r} is the token {model.tokenizer.decode([token])!r} (id {token})")
        if text.startswith(" "):
            continue
        spaced = list(model.tokenizer.encode(" " + text, add_special_tokens=False))
        if len(spaced) == 1 and spaced[0] != token and logits[spaced[0]] > logits[token]:
            warn(f"{option} {text!r} has no leading space, but {' ' + text!r} is a token too and likelier after "
                 f"the clean text (logit {logits[spaced[0]]:.2f} against {logits[token]:.2f}); "
                 f"did you mean {option} {' ' + text!r}?")


def _check_clean_run(model: Any, logits: np.ndarray, answer: str, wrong: Optional[str], answer_id: int,
                     clean_value: float, corrupt_value: float) -> None:
    """Warn when the model does not get the clean prompt right: patching then measures how
    heads move a wrong answer, and the share recovered can be any number (not 0..1)."""
    if wrong is not None and clean_value <= 0:
        warn(f"the clean run does not prefer {answer!r} to {wrong!r} (logit difference {clean_value:.3f}): the model "
             "gets this prompt wrong, so the shares recovered below are hard to read; choose a prompt the model "
             "answers correctly")
    elif wrong is None and int(np.argmax(logits)) != answer_id:
        rank = int(np.sum(logits > logits[answer_id])) + 1
        top = model.tokenizer.decode([int(np.argmax(logits))])
        warn(f"{answer!r} is not the clean run's most likely next token (rank {rank}; the top one is {top!r}): "
             "choose a prompt the model answers correctly, or give --wrong to compare two answers")
    if clean_value <= corrupt_value:
        warn(f"the clean run scores the answer no higher than the corrupt one (clean {clean_value:.3f}, corrupt "
             f"{corrupt_value:.3f}): the corrupt text does not take the answer away, so 'recovered' is not a share")


@app.command()
def patch(
    clean: str = typer.Option(..., "--clean", help="The text whose run gives the answer."),
    corrupt: str = typer.Option(..., "--corrupt", help="The same number of tokens, changed so the answer changes."),
    answer: str = typer.Option(..., "--answer", help="The token the clean text predicts next (one token, "
                               "with its leading space: ' Paris')."),
    wrong: Optional[str] = typer.Option(None, "--wrong", help="A token to subtract: the metric is "
                                        "logit(answer) - logit(wrong) at the last position."),
    model: str = typer.Option("smollm2", "--model", "-m", help=_DECODER_HELP),
    top: int = typer.Option(10, "--top", help="How many of the heads that recover most to list (>= 0)."),
    png: Optional[str] = typer.Option(None, "--png", metavar="FILE.png", help="Also draw the heatmap as FILE.png."),
    html: Optional[str] = typer.Option(None, "--html", metavar="FILE.html",
                                       help="Also write the heatmap as a self-contained HTML file."),
    no_color: bool = typer.Option(False, "--no-color", help="Shade with ░▒▓█ instead of colour."),
) -> None:
    """Patch each head's output from the clean run into the corrupt run: which heads carry the answer."""
    from attnkit.interpret import patch_heads
    from attnkit.viz.interpret_views import grid_text

    _check_text("--clean", clean)
    _check_text("--corrupt", corrupt)
    check_int("--top", top, 0)
    outputs = _plan(png, html)
    loaded = _load(model, "patch")
    answer_id = _one_token(loaded, "--answer", answer)
    wrong_id = _one_token(loaded, "--wrong", wrong) if wrong is not None else None
    clean_ids = _ids(loaded, clean, MAX_TOKENS, "--clean")
    corrupt_ids = _ids(loaded, corrupt, MAX_TOKENS, "--corrupt")
    if clean_ids.size != corrupt_ids.size:
        fail(f"expected --clean and --corrupt of the same number of tokens (patching goes position by position), "
             f"got {clean_ids.size} and {corrupt_ids.size}")

    def metric(logits: np.ndarray) -> float:
        last = logits[-1].astype(np.float64)
        return float(last[answer_id] - (last[wrong_id] if wrong_id is not None else 0.0))

    clean_logits = loaded.forward(clean_ids)[-1].astype(np.float64)  # (vocab,) at the last position
    _name_tokens(loaded, clean_logits, [("--answer", answer, answer_id), ("--wrong", wrong, wrong_id)])
    clean_value = metric(clean_logits[None])
    corrupt_value = metric(loaded.forward(corrupt_ids))
    _check_clean_run(loaded, clean_logits, answer, wrong, answer_id, clean_value, corrupt_value)
    heads_ = int(max(block.attn.num_heads for block in loaded.layers))
    with err_console.status(f"patching each of {len(loaded.layers) * heads_} heads..."):
        try:
            patched = patch_heads(loaded, clean_ids, corrupt_ids, metric)
        except (ValueError, TypeError) as error:
            fail(str(error))
    gap = clean_value - corrupt_value
    what = f"logit({answer!r})" + (f" - logit({wrong!r})" if wrong is not None else "")
    if abs(gap) > 1e-6 * max(1.0, abs(clean_value)):
        recovered = (patched - corrupt_value) / gap
        title = f"Share of the clean - corrupt difference each head recovers (1: all of it); metric {what}"
    else:
        recovered = patched - corrupt_value
        title = f"Change of {what} when each head is patched (clean and corrupt give the same metric)"
    color = use_color(no_color)
    console.print(grid_text(recovered, title, color=color))
    say(f"metric {what} at the last position: clean {clean_value:.4f}, corrupt {corrupt_value:.4f}")
    if top:
        flat = np.argsort(-np.abs(np.nan_to_num(recovered)), axis=None)  # largest change first
        order = np.stack(np.unravel_index(flat, recovered.shape), axis=-1)  # (layers * heads, 2)
        table = Table(title=None, box=None, padding=(0, 1), pad_edge=False, show_edge=False,
                      header_style="bold" if color else "")
        for name in ("layer", "head", "recovered", "patched metric"):
            table.add_column(name, justify="right", no_wrap=True)
        for layer, head in order[:top]:
            table.add_row(str(layer), str(head), f"{recovered[layer, head]:+.3f}", f"{patched[layer, head]:.4f}")
        console.print()
        console.print(Text(f"The {min(top, order.shape[0])} heads that move the metric most",
                           style="bold" if color else ""))
        console.print(table)
    name = model if model == "smollm2" else Path(model).name
    _write_grids(outputs, {"recovered": recovered, "patched metric": patched}, f"attnkit: patching the heads of {name}",
                 f"clean {clean!r} -> corrupt {corrupt!r}; metric {what}: clean {clean_value:.4f}, "
                 f"corrupt {corrupt_value:.4f}")


# ----------------------------------------------------------------------------- lens


@app.command()
def lens(
    text: str = typer.Argument(..., help="The text to run."),
    model: str = typer.Option("smollm2", "--model", "-m", help=_DECODER_HELP),
    top: int = typer.Option(1, "--top", help="Tokens to list per layer and position (1-5)."),
    html: Optional[str] = typer.Option(None, "--html", metavar="FILE.html",
                                       help="Also write the table as a self-contained HTML file."),
    no_color: bool = typer.Option(False, "--no-color", help="Plain text, no colour."),
    max_tokens: int = typer.Option(32, "--max-tokens", help=f"Use at most this many tokens (at most {MAX_TOKENS})."),
) -> None:
    """The logit lens on TEXT: what each layer's residual stream would predict next, at each position."""
    from attnkit.interpret import logit_lens
    from attnkit.interpret import top_tokens
    from attnkit.viz.interpret_views import lens_table, render_lens_html

    _check_text("TEXT", text)
    check_int("--top", top, 1, 5)
    check_int("--max-tokens", max_tokens, 1, MAX_TOKENS)
    outputs = {"html": plan("--html", html, (".html", ".htm"))} if html is not None else {}
    loaded = _load(model, "lens")
    ids = _ids(loaded, text, max_tokens)
    try:
        logits = logit_lens(loaded, ids)  # (layers + 1, T, vocab)
    except (ValueError, TypeError) as error:
        fail(str(error))
    best = top_tokens(loaded, logits, top)
    tokens = loaded.tokenizer.tokens(ids)
    color = use_color(no_color)
    console.print(Text(f"Logit lens: the top {top} next token{'s' if top > 1 else ''} after each layer, "
                       "at each position", style="bold" if color else ""))
    for index, table in enumerate(lens_table(tokens, best, width=console.width, color=color)):
        if index:
            console.print()
        console.print(table)
    console.print(Text("rows: the residual stream entering the first layer (embed) and after each layer (L0, ...), "
                       "through the final norm and the unembedding; the last row is the model's own prediction",
                       style="dim" if color else ""))
    if outputs:
        name = model if model == "smollm2" else Path(model).name
        page = render_lens_html(tokens, best, title=f"attnkit: logit lens of {name}", subtitle=text)
        write_all([(outputs["html"], lambda path: path.write_text(page, encoding="utf-8"))])
        say(f"wrote {outputs['html'].path} (self-contained; open it in a browser)")
