"""Text a command reads from stdin or a file: UTF-8 or refused, with the byte offset.

One behaviour for every command (docs/conventions.md, "The command line"):
input that is not UTF-8 is refused with the file (or stdin) and the offset of
the first bad byte named, never guessed at or replaced. A leading byte-order
mark is dropped. Inputs larger than `MAX_INPUT_BYTES` are refused.
"""

from __future__ import annotations

import sys

from attnkit.cli._app import fail
from attnkit.viz.text import decode_utf8

MAX_INPUT_BYTES = 64 * 1024 * 1024
"""The most a text file or stdin may hold (64 MiB)."""


def _decode(data: bytes, source: str) -> str:
    if len(data) > MAX_INPUT_BYTES:
        fail(f"{source} holds more than {MAX_INPUT_BYTES // 2**20} MiB; the most attnkit reads is "
             f"{MAX_INPUT_BYTES // 2**20} MiB")
    text, problem = decode_utf8(data)
    if problem:
        fail(f"{source} is not valid UTF-8: {problem}")
    return text


def read_stdin() -> str:
    """All of stdin as text (UTF-8)."""
    stream = sys.stdin
    if stream is None:
        fail("cannot read stdin: it is closed")
    buffer = getattr(stream, "buffer", None)
    try:
        if buffer is None:  # a text-only stream (already decoded by whoever made it)
            return stream.read()
        return _decode(buffer.read(MAX_INPUT_BYTES + 1), "stdin")
    except OSError as error:
        fail(f"cannot read stdin: {(error.strerror or str(error)).lower()}")


def read_text_file(option: str, name: str) -> str:
    """The file named by `option` as text (UTF-8); '-' reads stdin."""
    if name == "-":
        return read_stdin()
    try:
        with open(name, "rb") as handle:
            data = handle.read(MAX_INPUT_BYTES + 1)
    except IsADirectoryError:
        fail(f"cannot read {option} {name}: it is a folder, not a text file")
    except OSError as error:
        fail(f"cannot read {option} {name}: {(error.strerror or str(error)).lower()}")
    except ValueError:  # a NUL character in the name
        fail(f"cannot read {option} {name!r}: a file name cannot hold a NUL character")
    return _decode(data, f"{option} {name}")


class StdinLines:
    """Lines of stdin, one at a time (for `chat`): UTF-8, or refused with the line number."""

    def __init__(self) -> None:
        self.number = 0

    def read(self) -> str | None:
        """The next line without its line break; None at the end of the input."""
        buffer = getattr(sys.stdin, "buffer", None)
        if buffer is None:  # a text-only stream
            line = sys.stdin.readline()
            return line.rstrip("\r\n") if line else None
        data = buffer.readline()
        if not data:
            return None
        self.number += 1
        text, problem = decode_utf8(data)
        if problem:
            fail(f"stdin is not valid UTF-8: line {self.number}, {problem} of the line")
        return text.rstrip("\r\n")
