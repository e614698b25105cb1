"""`attnkit chat`: a multi-turn chat with a decoder, at a real prompt.

In a terminal the prompt is prompt_toolkit's: line editing (arrows, Home/End,
Ctrl-A/E/W...), history across runs in a file under the user's data folder
(Up/Down, Ctrl-R), and multi-line messages (Alt+Enter, or a line ending in a
backslash, starts a new line; a paste keeps its line breaks). Piped input is
read line by line, with the same commands. Lines that start with `/` are
commands, never sent to the model: /help, /system, /reset, /attention, /quit.

The conversation is kept in a KV cache: each turn prefills only the new
tokens. The repetition penalty counts every token of the conversation, as a
fresh generation on the whole of it would (so a reply is the same whether or
not the cache was reused).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import typer
from rich.text import Text

from attnkit.cli._app import app, check_text, console, fail, note, say, usage, warn
from attnkit.cli._input import StdinLines, read_text_file
from attnkit.cli.models import BACKEND_HELP, DECODER, check_backend, model_option, require_pieces
from attnkit.cli.generate import (
    MODEL_HELP, PENALTY_HELP, TEMPERATURE_HELP, Printer, check_sampling, end_reply, load_decoder, run, was_cut,
)
from attnkit.viz.text import printable, token_label

DEFAULT_REPETITION_PENALTY = 1.1
"""Chat's default: enough to stop SmolLM2-135M repeating one sentence until the token limit
(at 1.0 it does, asked "What is attention in a transformer?" with the explainer prompt), too
little to push it off its words (at 1.3 its sentences run on)."""
ATTENTION_WINDOW = 384
"""/attention runs the model again on at most this many of the conversation's last tokens
(the weights of 30 layers x 9 heads at 384 tokens: 160 MB)."""

HELP = """Commands (a line that starts with / is never sent to the model; //text sends /text):
  /help             this list
  /system           show the system prompt
  /system TEXT      use TEXT as the system prompt and start over ('/system -' removes it)
  /reset            forget the conversation (the system prompt stays)
  /attention        where the last reply looked: its attention, summed over layers and heads
  /quit             leave (or Ctrl-D)
Keys: arrows and Ctrl-A/E/W edit the line; Up/Down and Ctrl-R search the history;
Alt+Enter, or a line ending in \\, starts a new line; Ctrl-C stops a reply."""


def user_data_dir() -> Path:
    """Where attnkit keeps its files for this user (the chat history): $XDG_DATA_HOME/attnkit,
    ~/.local/share/attnkit on Linux, ~/Library/Application Support/attnkit on macOS,
    %APPDATA%/attnkit on Windows."""
    if sys.platform == "win32" and os.environ.get("APPDATA"):
        return Path(os.environ["APPDATA"]) / "attnkit"
    if os.environ.get("XDG_DATA_HOME"):
        return Path(os.environ["XDG_DATA_HOME"]) / "attnkit"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "attnkit"
    return Path.home() / ".local" / "share" / "attnkit"


# ----------------------------------------------------------------------------- reading messages


class _PipedInput:
    """Messages from stdin, one per line; a line ending in a backslash continues on the next."""

    def __init__(self) -> None:
        self.lines = StdinLines()

    def __call__(self) -> Optional[str]:
        console.out("you> ", end="", style="bold green", highlight=False)
        console.file.flush()
        parts: list[str] = []
        while True:
            line = self.lines.read()
            if line is None:
                return "\n".join(parts) if parts else None
            if line.endswith("\\") and not line.endswith("\\\\"):
                parts.append(line[:-1])
                continue
            parts.append(line)
            return "\n".join(parts)


def _typed_mouse_event(event: Any) -> None:
    """A "mouse event" at the chat prompt: text the user typed, inserted as text.

    prompt_toolkit's input parser reads any `ESC [ digits;... m`/`M` (and `ESC [ M`
    with three more characters) as a mouse report, and its own mouse handler raises on
    most of them: typing `\\x1b[31mRED` (a colour code) gave a traceback and "Press
    ENTER to continue...". The chat never turns mouse reporting on, so no terminal
    sends real mouse reports here: the sequence was typed. It is inserted as
    prompt_toolkit inserts any escape sequence it does not know: without the ESC
    (which no key inserts), and without control characters (which no key inserts).
    """
    event.current_buffer.insert_text("".join(c for c in event.data[1:] if c.isprintable()))


class _TerminalInput:
    """Messages at a prompt_toolkit prompt, with line editing, history and multi-line input."""

    def __init__(self, history_file: Optional[Path]) -> None:
        from attnkit.runtime import require

        require("prompt_toolkit", "chat", "attnkit chat at a terminal")
        from prompt_toolkit import PromptSession
        from prompt_toolkit.formatted_text import FormattedText
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings
        from prompt_toolkit.keys import Keys

        bindings = KeyBindings()

        @bindings.add("enter")
        def _(event: Any) -> None:
            buffer = event.current_buffer
            if buffer.document.text_before_cursor.endswith("\\") and buffer.document.is_cursor_at_the_end:
                buffer.delete_before_cursor(1)
                buffer.insert_text("\n")
            else:
                buffer.validate_and_handle()

        @bindings.add("escape", "enter")  # Alt+Enter
        def _(event: Any) -> None:
            event.current_buffer.insert_text("\n")

        @bindings.add(Keys.Vt100MouseEvent)
        def _(event: Any) -> None:
            _typed_mouse_event(event)

        history = InMemoryHistory() if history_file is None else FileHistory(str(history_file))
        self.session = PromptSession(
            history=history, multiline=True, key_bindings=bindings, enable_history_search=False,
            prompt_continuation=lambda width, line, wrap: "... ".rjust(width),
        )
        self.message = FormattedText([("bold ansigreen", "you> ")])

    def __call__(self) -> Optional[str]:
        try:
            return self.session.prompt(self.message)
        except EOFError:
            return None


def _history_file(enabled: bool) -> Optional[Path]:
    """The history file under the user's data folder, or None (no history, or it cannot be made)."""
    if not enabled:
        return None
    path = user_data_dir() / "chat-history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    except OSError as error:
        warn(f"no chat history: cannot write {path}: {(error.strerror or str(error)).lower()}")
        return None
    return path


# ----------------------------------------------------------------------------- the conversation


@dataclass
class Conversation:
    """Messages, the KV cache that holds them, and the last reply (for /attention)."""

    model: Any
    system: Optional[str]
    messages: list[dict[str, str]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # the token ids whose keys and values are in `cache`
    last_prompt: list[int] = field(default_factory=list)  # the ids before the last reply
    last_reply: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cache = self.model.new_cache(1, self.model.context_length)
        self.reset()

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self.cache.crop(0)
        self.cached, self.last_prompt, self.last_reply = [], [], []

    def reply(self, text: str, sampling: dict[str, Any]) -> Optional[tuple[list[int], float, bool, bool]]:
        """Answer `text`, streaming the reply. Returns (new ids, seconds, interrupted, cut), or
        None when the conversation no longer fits the context."""
        model, tokenizer = self.model, self.model.tokenizer
        messages = [*self.messages, {"role": "user", "content": text}]
        try:
            ids = tokenizer.encode_chat(messages)
        except ValueError as error:
            fail(str(error))
        room = model.context_length - len(ids)
        if room <= 0:
            return None
        # Reuse the cache for the conversation so far: only the new turn is prefilled.
        common = 0
        while common < min(len(ids) - 1, len(self.cached)) and ids[common] == self.cached[common]:
            common += 1
        self.cache.crop(common)
        limit = min(sampling["max_new_tokens"], room)
        console.out("model> ", end="", style="bold cyan", highlight=False)
        new, seconds, interrupted = run(
            model, ids[common:], Printer(tokenizer), cache=self.cache, penalty_context=ids[:common],
            **{**sampling, "max_new_tokens": limit},
        )
        cut = not interrupted and was_cut(model, new, limit)
        end_reply(cut)
        if interrupted:
            note("reply stopped", style="yellow")
        elif cut:
            why = "the context is full" if limit < sampling["max_new_tokens"] else f"--max-new-tokens is {limit}"
            note(f"reply cut at {limit} tokens: {why}", style="yellow")
        # The cache holds the prompt and every new token but the last (never fed back). After
        # Ctrl-C in the middle of a step some layers may hold one more: crop them all alike.
        cached = ids + new[:-1] if new else list(ids)
        self.cache.crop(min(self.cache.length, len(cached)))
        self.cached = cached[: self.cache.length]
        self.last_prompt, self.last_reply = list(ids), list(new)
        reply = tokenizer.decode(new, skip_special_tokens=True)
        self.messages = [*messages, {"role": "assistant", "content": reply.strip()}]
        return new, seconds, interrupted, cut


# ----------------------------------------------------------------------------- /attention


def attention_summary(model: Any, prompt: list[int], reply: list[int], window: int = ATTENTION_WINDOW) -> list[str]:
    """Where a reply looked, in a few lines: the attention of the positions that chose its
    tokens, averaged over every layer and head, on the conversation's last `window` tokens.

    Arguments:
        model: the decoder.
        prompt: the token ids before the reply; reply: the reply's ids.
    """
    from attnkit.viz.data import AttentionMaps
    from attnkit.viz.summary import summarize_heads

    fed = prompt + reply[:-1]  # the reply's last token was chosen, never fed back
    start = max(0, len(fed) - window)
    ids = fed[start:]
    rows = np.arange(len(prompt) - 1 - start, len(fed) - start)  # each chose the next reply token
    rows = rows[rows >= 0]
    tokens, weights = model.attention(np.asarray(ids, dtype=np.int64))  # (layers, heads, T, T)
    looked = weights[:, :, rows].astype(np.float64).mean(axis=(0, 1, 2))  # (T,) sums to 1
    in_reply = np.arange(len(ids)) >= len(prompt) - start
    layers, heads = weights.shape[:2]
    where = f"the last {len(ids)} tokens of the conversation" if start else f"the {len(ids)} tokens of the conversation"
    lines = [
        f"The last reply ({len(reply)} tokens): attention of the positions that chose its tokens, "
        f"the mean of {layers} layers x {heads} heads, over {where}:",
        f"  {100 * looked[0]:5.1f}% on the first token, where decoders park attention they do not need (a sink)",
        f"  {100 * looked[1:][~in_reply[1:]].sum():5.1f}% on the prompt (system prompt and messages), "
        f"{100 * looked[in_reply].sum():.1f}% on the reply itself",
    ]
    order = [int(i) for i in np.argsort(-looked) if i > 0][:8]
    tops = [f"{100 * looked[i]:.1f}% {_quoted(tokens[i])} ({'reply' if in_reply[i] else 'prompt'})" for i in order]
    lines.append("  most attended after the first token: " + ", ".join(tops))
    maps = AttentionMaps(tokens=tokens, weights=weights, causal=True)
    pattern = summarize_heads(maps).pattern
    counts = {name: int((pattern == name).sum()) for name in ("first", "previous", "self", "broad", "mixed")}
    lines.append(
        f"  heads on this text: {counts['first']} first-token (F), {counts['previous']} previous-token (P), "
        f"{counts['self']} self (S), {counts['broad']} broad (B), {counts['mixed']} mixed"
    )
    lines.append("  (for the picture of every head: attnkit show --model smollm2 \"TEXT\" --html out.html)")
    return lines


def _quoted(token: str) -> str:
    return "“" + token_label(token) + "”"


# ----------------------------------------------------------------------------- the command


def _banner(model: Any, model_path: Optional[str], system: Optional[str], system_name: str,
            sampling: dict[str, Any], history: Optional[Path]) -> None:
    name = model_path or "smollm2 (SmolLM2-135M-Instruct, embedded)"
    layers = getattr(getattr(model, "config", None), "num_layers", None)
    say(f"attnkit chat: {name}{f', {layers} layers' if layers else ''}, context of {model.context_length} tokens",
        style="bold")
    if system is None:
        note("system prompt: none (/system TEXT sets one)")
    else:
        tokens = len(model.tokenizer.encode(system))
        first = " ".join(system.split())
        first = first if len(first) <= 60 else first[:59] + "…"
        note(f"system prompt: {system_name} ({tokens} tokens): {first}")
    how = "greedy" if sampling["temperature"] == 0 else f"temperature {sampling['temperature']:g}"
    if sampling["temperature"] != 0:
        how += "".join(f", {name} {sampling[key]}" for name, key in (("top-k", "top_k"), ("top-p", "top_p"),
                                                                       ("seed", "seed")) if sampling[key] is not None)
    note(f"sampling: {how}, repetition penalty {sampling['repetition_penalty']:g}, "
         f"at most {sampling['max_new_tokens']} tokens a reply")
    note(f"history: {history}" if history else "history: off")
    note("/help lists the commands; Ctrl-C stops a reply, Ctrl-D quits.")


def _command(line: str, conversation: Conversation) -> bool:
    """Run a /command; returns False to quit."""
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        console.print(Text(HELP), soft_wrap=True)
    elif name == "/reset":
        conversation.reset()
        note("the conversation is forgotten; the system prompt stays")
    elif name == "/system":
        if not rest:
            if conversation.system is None:
                note("no system prompt (/system TEXT sets one)")
            else:
                console.print(Text(printable(conversation.system, lines=True)), soft_wrap=True)
        else:
            conversation.system = None if rest == "-" else rest
            conversation.reset()
            note("system prompt removed; starting over" if rest == "-" else "new system prompt; starting over")
    elif name == "/attention":
        if not conversation.last_reply:
            note("no reply yet: /attention shows where the last reply looked")
        else:
            with console.status("running the model again on the conversation..."):
                lines = attention_summary(conversation.model, conversation.last_prompt, conversation.last_reply)
            for line_ in lines:
                say(line_)
    else:
        note(f"unknown command {name}: /help lists them (start with // to send a message beginning with /)",
             style="yellow")
    return True


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
    repetition_penalty: float = typer.Option(DEFAULT_REPETITION_PENALTY, "--repetition-penalty", help=PENALTY_HELP),
    history: bool = typer.Option(
        True, "--history/--no-history", help="Keep the prompt's history across runs, in a file under your data folder."
    ),
    backend: str = typer.Option("naive", "--backend", help=BACKEND_HELP),
) -> None:
    """A multi-turn chat in the terminal, with line editing and history; /help lists its commands.

    Ctrl-C stops a reply; Ctrl-D (or Ctrl-C at the prompt) quits.
    """
    check_text("--system", system)
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, repetition_penalty)
    check_backend(backend)
    chosen = [name for name, on in (("--system", system is not None), ("--system-file", system_file is not None),
                                    ("--explain-attention", explain_attention)) if on]
    if len(chosen) > 1:
        usage(f"expected at most one of --system, --system-file, --explain-attention, got {', '.join(chosen)}")
    if system_file == "-":
        usage("expected --system-file to name a file: chat reads your messages from stdin")
    system_name = "--system"
    if system_file is not None:
        system, system_name = read_text_file("--system-file", system_file), f"from {system_file}"
    if explain_attention:
        from attnkit.models.chat import load_prompt

        system, system_name = load_prompt("attention-explainer"), "attnkit's attention explainer"
    system = system.strip() if system is not None else None

    interactive = sys.stdin is not None and sys.stdin.isatty() and sys.stdout.isatty()
    # the model's package, gguf, the template's jinja2 and the prompt's prompt_toolkit: all
    # that is missing, named at once, before the model loads
    require_pieces(model_option(model_path, DECODER, "chat"), DECODER, "chat", template=True, prompt=interactive)
    model = load_decoder(model_path, "chat", backend)
    if not model.tokenizer.chat_template:
        fail("this model has no chat template; use attnkit generate instead")
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "seed": seed, "repetition_penalty": repetition_penalty}
    history_file = _history_file(history) if interactive else None
    read: Callable[[], Optional[str]] = _TerminalInput(history_file) if interactive else _PipedInput()
    if interactive:  # piped, stderr stays for errors and notes
        _banner(model, model_path, system, system_name, sampling, history_file)
    conversation = Conversation(model, system)
    total_new, total_seconds = 0, 0.0
    while True:
        try:
            text = read()
        except KeyboardInterrupt:
            text = None
        if text is None:
            console.out("")
            break
        if not text.strip():
            continue
        if text.startswith("/") and not text.startswith("//"):
            if not _command(text.strip(), conversation):
                break
            continue
        if text.startswith("//"):
            text = text[1:]
        answer = conversation.reply(text, sampling)
        if answer is None:
            warn("the conversation no longer fits the model's context; /reset starts over")
            continue
        new, seconds, _, _ = answer
        total_new += len(new)
        total_seconds += seconds
    if total_new:
        rate = total_new / total_seconds if total_seconds > 0 else float("inf")
        note(f"{total_new} tokens in {total_seconds:.2f} s: {rate:.1f} tokens/s")
