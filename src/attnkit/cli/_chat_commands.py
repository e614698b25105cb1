"""The /commands of `attnkit chat`: /set, /save, /load and /attention, and the suggestion
for a mistyped one. `chat.py` holds the conversation and the prompt; this file what the
commands do to it (any object with the attributes `Conversation` has)."""

from __future__ import annotations

import difflib
import json
import os
import shlex
from pathlib import Path
from typing import Any, Optional

import numpy as np

from attnkit.cli._input import MAX_INPUT_BYTES
from attnkit.cli.generate import counted, sampling_problem
from attnkit.viz.text import decode_utf8, token_label

COMMANDS = ("/help", "/system", "/reset", "/set", "/save", "/load", "/attention", "/quit", "/exit")
"""Every command chat knows (a mistyped one gets the nearest as a suggestion)."""

ATTENTION_WINDOW = 384
"""/attention runs the model again on at most this many of the conversation's last tokens
(the weights of 30 layers x 9 heads at 384 tokens: 160 MB)."""


def suggestion(name: str, known: tuple[str, ...] = COMMANDS) -> str:
    """'; did you mean /help?' for a name close to a known one (difflib), else ''."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


# ----------------------------------------------------------------------------- /set


SETTINGS = {  # the name /set takes: (the sampling key, its type)
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "max_tokens": ("max_new_tokens", int),
    "seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", float),
}
"""What `/set NAME VALUE` changes; --max-new-tokens is `max_tokens`, as OpenAI names it."""
_ALIASES = {"max_new_tokens": "max_tokens"}
_OFF = ("off", "none")


def settings_line(sampling: dict[str, Any]) -> str:
    """The sampling settings in one line, as /set shows them."""
    parts = []
    for name, (key, _) in SETTINGS.items():
        value = sampling[key]
        shown = "off" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
        parts.append(f"{name} {shown}" + (" (greedy)" if key == "temperature" and value == 0 else ""))
    return "sampling: " + ", ".join(parts)


def set_sampling(sampling: dict[str, Any], rest: str) -> str:
    """Apply `/set NAME VALUE` to `sampling`. Returns what to tell the user.

    Raises:
        ValueError: an unknown name, a value that is not a number, or out of its range;
            `sampling` is then unchanged.
    """
    words = rest.replace("=", " ").split()
    if len(words) != 2:
        raise ValueError(f"expected /set NAME VALUE with NAME one of {', '.join(SETTINGS)}, got /set {rest}")
    name, text = words[0].lower().replace("-", "_"), words[1]
    name = _ALIASES.get(name, name)
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {words[0]}{suggestion(name, tuple(SETTINGS))} "
                         f"(expected one of {', '.join(SETTINGS)})")
    key, kind = SETTINGS[name]
    if text.lower() in _OFF and key in ("top_k", "top_p", "seed"):
        value = None
    else:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"expected {name} to be {'an integer' if kind is int else 'a number'}, "
                             f"got {text!r}") from None
    problem = sampling_problem(key, value, name)
    if problem:
        raise ValueError(problem)
    before = sampling[key]
    sampling[key] = value
    return f"{name} {'off' if value is None else f'{value:g}'} (was {'off' if before is None else f'{before:g}'})"


# ----------------------------------------------------------------------------- /save and /load


def _path(rest: str) -> Path:
    """The file named after /save or /load: the rest of the line, quotes around it removed."""
    if len(rest) >= 2 and rest[0] == rest[-1] and rest[0] in "'\"":
        rest = rest[1:-1]
    if not rest:
        raise ValueError("expected a file name after the command, got none")
    return Path(rest).expanduser()


def _reason(error: OSError) -> str:
    return (error.strerror or str(error)).lower()


def save_messages(messages: list[dict[str, str]], rest: str) -> str:
    """Write the conversation to the file named by `rest` as a JSON list of messages
    (OpenAI's shape: `[{"role": "system", "content": ...}, ...]`), UTF-8. The file is
    replaced only once the new one is complete. Returns what to tell the user.

    Raises:
        ValueError: no file name, or the file cannot be written (the reason named).
    """
    path = _path(rest)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    existed = path.exists()
    try:
        temporary.write_text(json.dumps(messages, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        os.replace(temporary, path)
    except OSError as error:
        try:
            temporary.unlink()
        except OSError:
            pass
        raise ValueError(f"cannot write {path}: {_reason(error)}") from None
    return f"wrote {path} ({counted(len(messages), 'message')}{', replacing the file there' if existed else ''})"


def load_messages(rest: str) -> tuple[Path, list[dict[str, str]]]:
    """The conversation in the file named by `rest`: JSON messages as /save writes them (or
    an OpenAI request body with a "messages" list), checked by `check_messages`; a system
    message may only come first.

    Raises:
        ValueError: no such file, not UTF-8, not JSON, or not messages; saying which and where.
    """
    from attnkit.models.chat import check_messages

    path = _path(rest)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_INPUT_BYTES + 1)
    except IsADirectoryError:
        raise ValueError(f"cannot load {path}: it is a folder, not a JSON file") from None
    except OSError as error:
        raise ValueError(f"cannot load {path}: {_reason(error)}") from None
    if len(data) > MAX_INPUT_BYTES:
        raise ValueError(f"cannot load {path}: it holds more than {MAX_INPUT_BYTES // 2**20} MiB")
    text, problem = decode_utf8(data)
    if problem:
        raise ValueError(f"cannot load {path}: it is not valid UTF-8: {problem}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"cannot load {path}: it is not JSON: {error.msg} at line {error.lineno}, "
                         f"column {error.colno}") from None
    try:
        messages = check_messages(value)
    except ValueError as error:
        raise ValueError(f"cannot load {path}: {error}") from None
    for index, message in enumerate(messages[1:], 1):
        if message["role"] == "system":
            raise ValueError(f"cannot load {path}: messages[{index}] is a system message; chat takes the "
                             "system prompt as the first message only")
    return path, messages


# ----------------------------------------------------------------------------- /attention


def _quoted(token: str) -> str:
    return "“" + token_label(token) + "”"


def show_command(model_path: Optional[str]) -> str:
    """The `attnkit show` line for the model chat runs: its path when it was given one."""
    model = "smollm2" if model_path is None else shlex.quote(model_path)
    return f'attnkit show --model {model} "TEXT" --html out.html'


def attention_summary(model: Any, prompt: list[int], reply: list[int], window: int = ATTENTION_WINDOW,
                      model_path: Optional[str] = None) -> list[str]:
    """Where a reply looked, in a few lines: the attention of the positions that chose its
    tokens, averaged over every layer and head, on the conversation's last `window` tokens;
    the most attended tokens each with its position in the conversation (#0 is its first).

    Arguments:
        model: the decoder.
        prompt: the token ids before the reply; reply: the reply's ids.
        model_path: the model as chat was given it (None: the embedded smollm2), for the
            `attnkit show` line to copy.
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
    where = f"the {'last ' if start else ''}{counted(len(ids), 'token')} of the conversation"
    lines = [
        f"The last reply ({counted(len(reply), 'token')}): attention of the positions that chose its tokens, "
        f"the mean of {layers} layers x {heads} heads, over {where}:",
        f"  {100 * looked[0]:5.1f}% on the first token, where decoders park attention they do not need (a sink)",
        f"  {100 * looked[1:][~in_reply[1:]].sum():5.1f}% on the prompt (system prompt and messages), "
        f"{100 * looked[in_reply].sum():.1f}% on the reply itself",
        "  most attended after the first token (#: the position in the conversation):",
    ]
    order = [int(i) for i in np.argsort(-looked, kind="stable") if i > 0][:8]
    for i in order:
        lines.append(f"  {100 * looked[i]:5.1f}%  {_quoted(tokens[i])} "
                     f"({'reply' if in_reply[i] else 'prompt'}, #{start + i})")
    maps = AttentionMaps(tokens=tokens, weights=weights, causal=True)
    pattern = summarize_heads(maps).pattern
    counts = {name: int((pattern == name).sum()) for name in ("first", "previous", "self", "broad", "mixed")}
    lines.append(
        f"  heads on this text: {counts['first']} first-token (F), {counts['previous']} previous-token (P), "
        f"{counts['self']} self (S), {counts['broad']} broad (B), {counts['mixed']} mixed"
    )
    lines.append(f"  (for the picture of every head: {show_command(model_path)})")
    return lines
