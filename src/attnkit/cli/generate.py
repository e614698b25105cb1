"""`attnkit generate`: text from a decoder, streamed as it is chosen; and what `attnkit chat`
shares with it (loading, checking the sampling options, streaming, cut replies)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, Optional

import typer

from attnkit.cli._app import app, check_text, console, err_console, fail, note, usage
from attnkit.cli._input import read_stdin
from attnkit.cli._wrap import WordWrap, wrap_width
from attnkit.cli.models import BACKEND_HELP, DECODER, check_backend, model_option, require_pieces
from attnkit.viz.text import printable

MODEL_HELP = ("smollm2 (the embedded SmolLM2-135M-Instruct, the default), gemma3 (the embedded Gemma 3 270M), "
              "a .gguf file or a Hugging Face Llama/Gemma 3/GPT-2 folder.")
TEMPERATURE_HELP = "0 = greedy; else between 0.0001 and 100 (higher = more random)."
PENALTY_HELP = ("transformers' repetition penalty: the logits of tokens already in the context are divided by it "
                "(multiplied when negative); 1 = off, at most 10.")
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 100.0
"""Sampling temperatures other than 0 (greedy) lie in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""


def counted(count: int, noun: str, plural: Optional[str] = None) -> str:
    """`count` and the noun, singular for exactly one: '1 token', '0 tokens', '42 tokens'."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def load_decoder(model_path: Optional[str], command: str, backend: str = "naive", *, prepare: bool = False):
    """The decoder named by `--model` (checked first; see cli/models.py), with its tokenizer,
    attending through `backend`; with `prepare`, its native kernels built or loaded now, before
    any text is printed (`cli/_kernels.py`: a notice and progress on stderr)."""
    from attnkit.models.embedded import ModelPackageNotFoundError
    from attnkit.models.auto import AutoCausalLM

    model_path = model_option(model_path, DECODER, command)
    try:
        with err_console.status("loading the model..."):
            model = AutoCausalLM.from_pretrained(model_path)
    except (ModelPackageNotFoundError, ValueError, OSError, KeyError) as error:
        fail(str(error))
    if model.tokenizer is None:
        fail(f"{model_path} has no tokenizer.json; attnkit {command} needs one to turn text into tokens")
    model = model if backend == "naive" else model.set_attention_backend(backend)  # models start on naive
    if prepare:
        from attnkit.cli import _kernels

        _kernels.prepare(model)
    return model


def sampling_problem(key: str, value, name: Optional[str] = None) -> Optional[str]:
    """What is wrong with one sampling setting, or None when it is in range: the one place
    that says the ranges, for the command line and for chat's /set.

    Arguments:
        key: max_new_tokens, temperature, top_k, top_p, seed or repetition_penalty.
        value: its value (None is allowed for top_k, top_p and seed: off).
        name: how the message names the setting (default: its option, `--top-k`).
    """
    name = name or "--" + key.replace("_", "-")
    if value is None:
        return None if key in ("top_k", "top_p", "seed") else f"expected a value for {name}, got none"
    if key in ("max_new_tokens", "top_k", "seed"):
        low = 1 if key == "top_k" else 0
        return None if value >= low else f"expected {name} >= {low}, got {value}"
    if key == "temperature":
        if value == 0 or (math.isfinite(value) and MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
            return None
        return f"expected {name} 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {value}"
    high = {"top_p": 1.0, "repetition_penalty": 10.0}[key]
    if math.isfinite(value) and 0.0 < value <= high:
        return None
    return f"expected a finite {name} in (0, {high:g}], got {value}"


def check_sampling(
    max_new_tokens: int, temperature: float, top_k: Optional[int], top_p: Optional[float], seed: Optional[int],
    repetition_penalty: float = 1.0,
) -> None:
    """Usage errors for sampling options out of range, before the model loads."""
    for key, value in (("max_new_tokens", max_new_tokens), ("repetition_penalty", repetition_penalty),
                       ("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
        problem = sampling_problem(key, value)
        if problem:
            usage(problem)


class Printer:
    """Streams token ids to stdout as text (complete UTF-8 characters only).

    Arguments:
        tokenizer: the model's `DecoderTokenizer`.
        width: in a terminal, a function giving its width (`_wrap.wrap_width`): lines then
            break between words, never in one; None writes the text as it comes (a pipe).
        column: the cells already used on the first line (chat's `model> `).
    """

    def __init__(self, tokenizer, width: Optional[Callable[[], int]] = None, column: int = 0) -> None:
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self.wrap = None if width is None else WordWrap(width, column)

    def write(self, text: str) -> None:
        """Write text (a model can produce escape sequences too: shown, never sent raw)."""
        text = printable(text, lines=True)
        if self.wrap is not None:
            text = self.wrap.feed(text)
        if text:
            console.out(text, end="", highlight=False)
            console.file.flush()

    def __call__(self, token: int) -> None:
        piece = self.decoder.step(self.tokenizer.tokenizer, int(token))
        if piece:
            self.write(piece)

    def finish(self) -> None:
        """Write the last word, which wrapping holds back until it is complete."""
        if self.wrap is not None:
            rest = self.wrap.flush()
            if rest:
                console.out(rest, end="", highlight=False)
                console.file.flush()


def run(model, prompt_ids, printer, *, cache=None, **sampling) -> tuple[list[int], float, bool]:
    """Generate, streaming through `printer`. Returns (new ids, seconds, interrupted)."""
    import numpy as np

    new: list[int] = []
    start = time.perf_counter()
    interrupted = False
    try:
        for step in model.stream(np.asarray(prompt_ids, dtype=np.int64), cache=cache, **sampling):
            token = int(step[0])
            new.append(token)
            printer(token)
    except KeyboardInterrupt:
        interrupted = True
    return new, time.perf_counter() - start, interrupted


def was_cut(model, new: list[int], limit: int) -> bool:
    """Whether generation stopped at the token limit rather than at an end-of-sequence token."""
    if not new or len(new) < limit:
        return False
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    ends = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    ends.add(getattr(model.tokenizer, "eos_token_id", None))
    return new[-1] not in ends


CUT_MARK = " […]"
"""Shown (on stderr, so the text on stdout stays the model's) after a reply the token limit cut."""


def end_reply(cut: bool) -> None:
    """End a streamed reply's line; a cut reply gets the mark `CUT_MARK` at its end."""
    if cut:
        console.file.flush()
        err_console.out(CUT_MARK, end="", style="yellow", highlight=False)
        err_console.file.flush()
    console.out("", highlight=False)


def _report(prompt_tokens: int, new_tokens: int, seconds: float) -> None:
    rate = new_tokens / seconds if seconds > 0 else float("inf")
    note(f"{counted(new_tokens, 'token')} in {seconds:.2f} s: {rate:.1f} tokens/s "
         f"(after a prompt of {counted(prompt_tokens, 'token')}; the time includes its prefill)")


def _without_final_line_break(text: str) -> str:
    """Text read from stdin without the line break `echo` (or an editor) puts at its end."""
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            return text[: -len(end)]
    return text


INT8_HELP = ("Decode a GGUF model's quantized products on 8-bit activations, as llama.cpp does: faster, "
             "with llama.cpp's size of logit error instead of float32's (needs the compiled kernels).")


@contextmanager
def int8_activations(on: bool) -> Iterator[None]:
    """`quant.activations("int8")` while open when `on` (a note when the kernels are off)."""
    if not on:
        yield
        return
    from attnkit import kernels
    from attnkit import quant

    if not kernels.enabled():
        note(f"--int8 has no effect: {kernels.reason_disabled()}", style="yellow")
        yield
        return
    with quant.activations("int8"):
        yield


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Text to continue; '-' reads it from stdin (one final line break dropped)."),
    model_path: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help=TEMPERATURE_HELP),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Sample among the most likely tokens up to this probability."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (>= 0)."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help=PENALTY_HELP),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as one user message with the chat template."),
    backend: str = typer.Option("naive", "--backend", help=BACKEND_HELP),
    int8: bool = typer.Option(False, "--int8", help=INT8_HELP),
) -> None:
    """Continue PROMPT, printing the text as it is generated, then tokens/s.

    PROMPT '-' reads the prompt from stdin: `echo "The capital of France is" | attnkit generate -`.

    The embedded SmolLM2-135M is a small model: fluent, but often wrong on facts and
    questions (a real decoder to watch, not an assistant).
    """
    check_text("PROMPT", prompt)
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, repetition_penalty)
    check_backend(backend)
    require_pieces(model_option(model_path, DECODER, "generate"), DECODER, "generate", template=chat)
    if prompt == "-":
        prompt = _without_final_line_break(read_stdin())
    model = load_decoder(model_path, "generate", backend, prepare=True)
    tokenizer = model.tokenizer
    if chat:
        try:
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        except ValueError as error:
            fail(str(error))
    else:
        ids = tokenizer.encode(prompt)
    if not ids:
        fail("expected a prompt with at least one token, got an empty prompt")
    if len(ids) > model.context_length:
        fail(f"the prompt has {counted(len(ids), 'token')}, more than the model's context of {model.context_length}")
    printer = Printer(tokenizer, wrap_width(console))
    if not chat:
        printer.write(prompt)
    limit = min(max_new_tokens, model.context_length - len(ids))
    with int8_activations(int8):
        new, seconds, interrupted = run(
            model, ids, printer, max_new_tokens=limit, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, repetition_penalty=repetition_penalty,
        )
    printer.finish()
    cut = not interrupted and was_cut(model, new, limit)
    end_reply(cut)
    if interrupted:
        note("interrupted", style="yellow")
    elif cut:
        note(f"stopped at the limit of {counted(limit, 'new token')} (--max-new-tokens)", style="yellow")
    _report(len(ids), len(new), seconds)
