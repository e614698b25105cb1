"""`attnkit chat`: a multi-turn chat with a decoder, at a real prompt.

In a terminal the prompt is prompt_toolkit's: line editing (arrows, Home/End,
Ctrl-A/E/W...), history across runs in a file under the user's data folder
(Up/Down, Ctrl-R), and multi-line messages (Alt+Enter, or a line ending in a
backslash, starts a new line; a paste keeps its line breaks). Piped input is
read line by line, with the same commands, and no prompt is echoed. Lines that
start with `/` are commands, never sent to the model: /help, /system, /reset,
/set, /save, /load, /attention, /quit. In a terminal a reply wraps between words
(`_wrap.WordWrap`), and each reply ends with its timing (on stderr, when stderr is a
terminal).

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

import typer
from rich.cells import cell_len
from rich.text import Text

from attnkit.cli._app import app, check_text, console, err_console, fail, note, say, usage, warn
from attnkit.cli._input import StdinLines, read_text_file
from attnkit.cli import _chat_commands as commands
from attnkit.cli._wrap import cells_prefix, wrap_width
from attnkit.cli.models import BACKEND_HELP, DECODER, check_backend, model_option, require_pieces
from attnkit.cli.generate import (
    MODEL_HELP, PENALTY_HELP, TEMPERATURE_HELP, Printer, check_sampling, counted, end_reply, load_decoder, run,
    was_cut,
)
from attnkit.viz.text import printable

DEFAULT_REPETITION_PENALTY = 1.1
"""Chat's default: enough to stop SmolLM2-135M repeating one sentence until the token limit
(at 1.0 it does, asked "What is attention in a transformer?" with the explainer prompt), too
little to push it off its words (at 1.3 its sentences run on)."""
HELP = """Commands (a line that starts with / is never sent to the model; //text sends /text):
  /help             this list
  /system           show the system prompt
  /system TEXT      use TEXT as the system prompt and start over ('/system -' removes it)
  /reset            forget the conversation (the system prompt stays)
  /set              show the sampling settings
  /set NAME VALUE   change one: temperature, top_p, top_k, max_tokens, seed, repetition_penalty
                    ('/set top_p off' turns top_p, top_k or seed off)
  /save FILE        write the conversation as JSON messages (OpenAI's shape)
  /load FILE        continue a conversation saved by /save (or any such JSON list of messages)
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
        parts: list[str] = []  # no 'you> ': the messages are not echoed, so it would stand alone
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
    """Messages, the KV cache that holds them, the sampling settings, and the last reply
    (for /attention)."""

    model: Any
    system: Optional[str]
    sampling: dict[str, Any]
    model_path: Optional[str] = None  # --model as given (None: the embedded smollm2)
    messages: list[dict[str, str]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # the token ids whose keys and values are in `cache`
    last_prompt: list[int] = field(default_factory=list)  # the ids before the last reply
    last_reply: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cache = self.model.new_cache(1, self.model.context_length)
        self.reset()

    def reset(self, messages: Optional[list[dict[str, str]]] = None) -> None:
        """Start over: from the system prompt alone, or from `messages` (a loaded conversation,
        whose system prompt, if it has one, comes first)."""
        if messages is None:
            messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        else:
            self.system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        self.messages = list(messages)
        self.cache.crop(0)
        self.cached, self.last_prompt, self.last_reply = [], [], []

    def reply(self, text: str) -> Optional[tuple[list[int], float, bool, bool]]:
        """Answer `text`, streaming the reply, then its timing. Returns (new ids, seconds,
        interrupted, cut), or None when the conversation no longer fits the context."""
        model, tokenizer, sampling = self.model, self.model.tokenizer, self.sampling
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
        console.out(REPLY_PROMPT, end="", style="bold cyan", highlight=False)
        printer = Printer(tokenizer, wrap_width(console), column=len(REPLY_PROMPT))
        new, seconds, interrupted = run(
            model, ids[common:], printer, cache=self.cache, penalty_context=ids[:common],
            **{**sampling, "max_new_tokens": limit},
        )
        printer.finish()
        cut = not interrupted and was_cut(model, new, limit)
        end_reply(cut)
        if interrupted:
            note("reply stopped", style="yellow")
        elif cut:
            why = "the context is full" if limit < sampling["max_new_tokens"] else f"--max-new-tokens is {limit}"
            note(f"reply cut at {counted(limit, 'token')}: {why}", style="yellow")
        if timing_wanted():
            note(turn_timing(len(new), seconds))
        # The cache holds the prompt and every new token but the last (never fed back). After
        # Ctrl-C in the middle of a step some layers may hold one more: crop them all alike.
        cached = ids + new[:-1] if new else list(ids)
        self.cache.crop(min(self.cache.length, len(cached)))
        self.cached = cached[: self.cache.length]
        self.last_prompt, self.last_reply = list(ids), list(new)
        reply = tokenizer.decode(new, skip_special_tokens=True)
        self.messages = [*messages, {"role": "assistant", "content": reply.strip()}]
        return new, seconds, interrupted, cut


REPLY_PROMPT = "model> "


def timing_wanted() -> bool:
    """Whether each reply ends with its timing: when someone watches stderr (a terminal).
    Piped to a file or a program, stderr keeps notes and errors, and the total comes at the end."""
    return err_console.is_terminal


def turn_timing(tokens: int, seconds: float) -> str:
    """A reply's timing, as shown (dim) after it: '(42 tokens, 1.3 s, 32 tok/s)'; the time
    includes the prefill of the turn's new message."""
    rate = tokens / seconds if seconds > 0 else float("inf")
    shown = f"{seconds:.2f}" if seconds < 10 else f"{seconds:.1f}"
    return f"({counted(tokens, 'token')}, {shown} s, {rate:.0f} tok/s)" if rate >= 10 else \
        f"({counted(tokens, 'token')}, {shown} s, {rate:.1f} tok/s)"


# ----------------------------------------------------------------------------- the banner and commands


def fit_line(prefix: str, text: str, width: int) -> str:
    """`prefix` then `text` on one line of at most `width` cells: the text made one line and
    shortened with '…' at its end when it does not fit (at least 8 cells of it shown; a
    prefix too long for that is shortened too)."""
    text = " ".join(text.split())
    line = prefix + text
    if cell_len(line) <= width:
        return line
    room = width - cell_len(prefix) - 1
    if room < 8:  # keep some of the text: shorten the prefix instead
        prefix = cells_prefix(prefix, max(0, width - 11)) + "… "
        room = width - cell_len(prefix) - 1
    return prefix + cells_prefix(text, max(0, room)) + "…"


def _banner(conversation: Conversation, system_name: str, history: Optional[Path]) -> None:
    model, system, sampling = conversation.model, conversation.system, conversation.sampling
    name = conversation.model_path or "smollm2 (SmolLM2-135M-Instruct, embedded)"
    layers = getattr(getattr(model, "config", None), "num_layers", None)
    say(f"attnkit chat: {name}{f', {layers} layers' if layers else ''}, context of {model.context_length} tokens",
        style="bold")
    if system is None:
        note("system prompt: none (/system TEXT sets one)")
    else:
        tokens = counted(len(model.tokenizer.encode(system)), "token")
        note(fit_line(f"system prompt: {printable(system_name)} ({tokens}): ", printable(system),
                      err_console.size.width - 1))
    how = "greedy" if sampling["temperature"] == 0 else f"temperature {sampling['temperature']:g}"
    if sampling["temperature"] != 0:
        how += "".join(f", {name} {sampling[key]}" for name, key in (("top-k", "top_k"), ("top-p", "top_p"),
                                                                       ("seed", "seed")) if sampling[key] is not None)
    note(f"sampling: {how}, repetition penalty {sampling['repetition_penalty']:g}, "
         f"at most {counted(sampling['max_new_tokens'], 'token')} a reply")
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
    elif name == "/set":
        if not rest:
            note(commands.settings_line(conversation.sampling))
        else:
            try:
                note(commands.set_sampling(conversation.sampling, rest))
            except ValueError as error:
                note(str(error), style="yellow")
    elif name == "/save":
        try:
            note(commands.save_messages(conversation.messages, rest))
        except ValueError as error:
            note(str(error), style="yellow")
    elif name == "/load":
        _load(conversation, rest)
    elif name == "/attention":
        if not conversation.last_reply:
            note("no reply yet: /attention shows where the last reply looked")
        else:
            with console.status("running the model again on the conversation..."):
                lines = commands.attention_summary(conversation.model, conversation.last_prompt,
                                                   conversation.last_reply, model_path=conversation.model_path)
            for line_ in lines:
                say(line_)
    else:
        note(f"unknown command {name}{commands.suggestion(name)} (/help lists them; start with // to send "
             "a message beginning with /)", style="yellow")
    return True


def _load(conversation: Conversation, rest: str) -> None:
    """/load FILE: continue the conversation saved there, if it is one this model can take."""
    model = conversation.model
    try:
        path, messages = commands.load_messages(rest)
        tokens = len(model.tokenizer.encode_chat(messages)) if messages else 0
    except ValueError as error:
        note(str(error), style="yellow")
        return
    if tokens >= model.context_length:
        note(f"cannot load {path}: its {counted(tokens, 'token')} leave no room in the model's context of "
             f"{model.context_length}", style="yellow")
        return
    conversation.reset(messages)
    system = "with a system prompt" if conversation.system is not None else "without a system prompt"
    note(f"loaded {path}: {counted(len(messages), 'message')} ({counted(tokens, 'token')}), {system}")


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
    model = load_decoder(model_path, "chat", backend, prepare=True)
    if not model.tokenizer.chat_template:
        fail("this model has no chat template; use attnkit generate instead")
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "seed": seed, "repetition_penalty": repetition_penalty}
    history_file = _history_file(history) if interactive else None
    read: Callable[[], Optional[str]] = _TerminalInput(history_file) if interactive else _PipedInput()
    conversation = Conversation(model, system, sampling, model_path)
    if interactive:  # piped, stderr stays for errors and notes
        _banner(conversation, system_name, history_file)
    total_new, total_seconds = 0, 0.0
    while True:
        try:
            text = read()
        except KeyboardInterrupt:
            text = None
        if text is None:
            if interactive:  # end the prompt's line
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
        answer = conversation.reply(text)
        if answer is None:
            warn("the conversation no longer fits the model's context; /reset starts over")
            continue
        new, seconds, _, _ = answer
        total_new += len(new)
        total_seconds += seconds
    if total_new:
        rate = total_new / total_seconds if total_seconds > 0 else float("inf")
        note(f"{counted(total_new, 'token')} in {total_seconds:.2f} s: {rate:.1f} tokens/s")
