"""`attnkit generate`: text from a decoder, streamed as it is chosen; and what `attnkit chat`
shares with it (loading, checking the sampling options, streaming, cut replies)."""

from __future__ import annotations

import math
import time
from typing import Optional

import typer

from attnkit.cli._app import app, check_float, check_int, check_text, console, err_console, fail, note, usage
from attnkit.cli.models import BACKEND_HELP, DECODER, check_backend, model_option, require_pieces
from attnkit.viz.text import printable

MODEL_HELP = "smollm2 (the embedded SmolLM2-135M-Instruct, the default), a .gguf file or a Hugging Face Llama/GPT-2 folder."
TEMPERATURE_HELP = "0 = greedy; else between 0.0001 and 100 (higher = more random)."
PENALTY_HELP = ("transformers' repetition penalty: the logits of tokens already in the context are divided by it "
                "(multiplied when negative); 1 = off, at most 10.")
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 100.0
"""Sampling temperatures other than 0 (greedy) lie in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""


def load_decoder(model_path: Optional[str], command: str, backend: str = "naive"):
    """The decoder named by `--model` (checked first; see cli/models.py), with its tokenizer,
    attending through `backend`."""
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
    return model if backend == "naive" else model.set_attention_backend(backend)  # models start on naive


def check_sampling(
    max_new_tokens: int, temperature: float, top_k: Optional[int], top_p: Optional[float], seed: Optional[int],
    repetition_penalty: float = 1.0,
) -> None:
    """Usage errors for sampling options out of range, before the model loads."""
    check_int("--max-new-tokens", max_new_tokens, 0)
    check_float("--repetition-penalty", repetition_penalty, 0.0, 10.0, low_open=True)
    if temperature != 0 and not (math.isfinite(temperature) and MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        usage(f"expected --temperature 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {temperature}")
    check_int("--top-k", top_k, 1)
    check_float("--top-p", top_p, 0.0, 1.0, low_open=True)
    check_int("--seed", seed, 0)


class Printer:
    """Streams token ids to the terminal as text (complete UTF-8 characters only)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True)

    def __call__(self, token: int) -> None:
        piece = self.decoder.step(self.tokenizer.tokenizer, int(token))
        if piece:  # a model can produce escape sequences too: shown, never sent raw
            console.out(printable(piece, lines=True), end="", highlight=False)
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
    note(f"{new_tokens} tokens in {seconds:.2f} s: {rate:.1f} tokens/s "
         f"(after a prompt of {prompt_tokens} tokens; the time includes its prefill)")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Text to continue."),
    model_path: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help=TEMPERATURE_HELP),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Sample among the most likely tokens up to this probability."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (>= 0)."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help=PENALTY_HELP),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as one user message with the chat template."),
    backend: str = typer.Option("naive", "--backend", help=BACKEND_HELP),
) -> None:
    """Continue PROMPT, printing the text as it is generated, then tokens/s."""
    check_text("PROMPT", prompt)
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, repetition_penalty)
    check_backend(backend)
    require_pieces(model_option(model_path, DECODER, "generate"), DECODER, "generate", template=chat)
    model = load_decoder(model_path, "generate", backend)
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
    limit = min(max_new_tokens, model.context_length - len(ids))
    new, seconds, interrupted = run(
        model, ids, Printer(tokenizer), max_new_tokens=limit, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, repetition_penalty=repetition_penalty,
    )
    cut = not interrupted and was_cut(model, new, limit)
    end_reply(cut)
    if interrupted:
        note("interrupted", style="yellow")
    elif cut:
        note(f"stopped at the limit of {limit} new tokens (--max-new-tokens)", style="yellow")
    _report(len(ids), len(new), seconds)
