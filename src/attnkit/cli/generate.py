"""`attnkit generate` and `attnkit chat`: text from a decoder, streamed as it is chosen."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from attnkit.cli._app import app, check_float, check_int, check_text, console, err_console, fail, usage, warn
from attnkit.cli._input import StdinLines, read_text_file
from attnkit.viz.text import printable

MODEL_HELP = "smollm2 (the embedded SmolLM2-135M-Instruct, the default), a .gguf file or a Hugging Face Llama/GPT-2 folder."
TEMPERATURE_HELP = "0 = greedy; else between 0.0001 and 100 (higher = more random)."
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 100.0
"""Sampling temperatures other than 0 (greedy) lie in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""


def _load(model_path: Optional[str]):
    from attnkit.models.embedded import ModelPackageNotFoundError
    from attnkit.models.generation import CausalLM

    try:
        with err_console.status("loading the model..."):
            model = CausalLM.from_pretrained(model_path)
    except (ModelPackageNotFoundError, ValueError, OSError, KeyError) as error:
        fail(str(error))
    if model.tokenizer is None:
        fail(f"{model_path} has no tokenizer.json; attnkit generate needs one to turn text into tokens")
    return model


def _check_sampling(
    max_new_tokens: int, temperature: float, top_k: Optional[int], top_p: Optional[float], seed: Optional[int]
) -> None:
    """Usage errors for sampling options out of range, before the model loads."""
    check_int("--max-new-tokens", max_new_tokens, 0)
    if temperature != 0 and not (math.isfinite(temperature) and MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        usage(f"expected --temperature 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {temperature}")
    check_int("--top-k", top_k, 1)
    check_float("--top-p", top_p, 0.0, 1.0, low_open=True)
    check_int("--seed", seed, 0)


class _Printer:
    """Streams token ids to the terminal as text (complete UTF-8 characters only)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True)

    def __call__(self, token: int) -> None:
        piece = self.decoder.step(self.tokenizer.tokenizer, int(token))
        if piece:  # a model can produce escape sequences too: shown, never sent raw
            console.out(printable(piece, lines=True), end="", highlight=False)
            console.file.flush()


def _run(model, prompt_ids, printer, *, cache=None, **sampling) -> tuple[list[int], float, bool]:
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


def _report(prompt_tokens: int, new_tokens: int, seconds: float) -> None:
    rate = new_tokens / seconds if seconds > 0 else float("inf")
    err_console.print(
        f"{new_tokens} tokens in {seconds:.2f} s: {rate:.1f} tokens/s "
        f"(after a prompt of {prompt_tokens} tokens; the time includes its prefill)",
        style="dim", markup=False, soft_wrap=True,
    )


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Text to continue."),
    model_path: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help=TEMPERATURE_HELP),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Sample among the most likely tokens up to this probability."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (>= 0)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as one user message with the chat template."),
) -> None:
    """Continue PROMPT, printing the text as it is generated, then tokens/s."""
    check_text("PROMPT", prompt)
    _check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    model = _load(model_path)
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
        fail(f"the prompt has {len(ids)} tokens, more than the model's context of {model.context_length}")
    if not chat:
        console.out(printable(prompt, lines=True), end="", highlight=False)
    max_new_tokens = min(max_new_tokens, model.context_length - len(ids))
    printer = _Printer(tokenizer)
    new, seconds, interrupted = _run(
        model, ids, printer, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed,
    )
    console.out("")
    if interrupted:
        err_console.print("interrupted", style="yellow")
    _report(len(ids), len(new), seconds)


@app.command()
def chat(
    model_path: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    system_file: Optional[str] = typer.Option(
        None, "--system-file", metavar="FILE", help="Read the system prompt from a UTF-8 text file."
    ),
    explain_attention: bool = typer.Option(
        False, "--explain-attention", help="Use attnkit's attention-explainer prompt as the system prompt."
    ),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Tokens per reply at most."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help=TEMPERATURE_HELP),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Sample among the most likely tokens up to this probability."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (>= 0)."),
) -> None:
    """A multi-turn chat in the terminal. Ctrl-C stops a reply; Ctrl-D (or Ctrl-C at the prompt) quits."""
    check_text("--system", system)
    _check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    chosen = [name for name, on in (("--system", system is not None), ("--system-file", system_file is not None),
                                    ("--explain-attention", explain_attention)) if on]
    if len(chosen) > 1:
        usage(f"expected at most one of --system, --system-file, --explain-attention, got {', '.join(chosen)}")
    if system_file == "-":
        usage("expected --system-file to name a file: chat reads your messages from stdin")
    if system_file is not None:
        system = read_text_file("--system-file", system_file)
    if explain_attention:
        from attnkit.models.chat import load_prompt

        system = load_prompt("attention-explainer")

    model = _load(model_path)
    tokenizer = model.tokenizer
    if not tokenizer.chat_template:
        fail("this model has no chat template; use attnkit generate instead")
    messages: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system.strip()}]
    cache = model.new_cache(1, model.context_length)
    cached: list[int] = []  # the token ids whose keys and values are in `cache`
    total_new, total_seconds = 0, 0.0
    if sys.stdin is not None and sys.stdin.isatty():
        err_console.print("Chat with the model. Ctrl-C stops a reply, Ctrl-D quits.", style="dim")
    lines = StdinLines()

    def prompt() -> None:
        console.out("you> ", end="", style="bold green", highlight=False)
        console.file.flush()

    while True:
        try:
            prompt()
            text = lines.read()
        except KeyboardInterrupt:
            text = None
        if text is None:
            console.out("")
            break
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            ids = tokenizer.encode_chat(messages)
        except ValueError as error:
            fail(str(error))
        # Reuse the cache for the conversation so far: only the new turn is prefilled.
        common = 0
        while common < min(len(ids) - 1, len(cached)) and ids[common] == cached[common]:
            common += 1
        cache.crop(common)
        cached = cached[:common]
        room = model.context_length - len(ids)
        if room <= 0:
            warn("the conversation is longer than the context; start a new chat")
            break
        console.out("model> ", end="", style="bold cyan", highlight=False)
        printer = _Printer(tokenizer)
        new, seconds, interrupted = _run(
            model, ids[common:], printer, cache=cache, max_new_tokens=min(max_new_tokens, room),
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        )
        console.out("")
        if interrupted:
            err_console.print("reply stopped", style="yellow")
        total_new += len(new)
        total_seconds += seconds
        # The cache holds the prompt and every new token but the last (never fed back). After
        # Ctrl-C in the middle of a step some layers may hold one more: crop them all alike.
        cached = ids + new[:-1] if new else list(ids)
        cache.crop(min(cache.length, len(cached)))
        cached = cached[: cache.length]
        reply = tokenizer.decode(new, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply.strip()})
    if total_new:
        rate = total_new / total_seconds if total_seconds > 0 else float("inf")
        err_console.print(f"{total_new} tokens in {total_seconds:.2f} s: {rate:.1f} tokens/s", style="dim")
