"""User text as data: what may reach a terminal, and what is not valid UTF-8.

Every view that prints text it did not write (a sentence, a token, a file
name, a model's reply) passes it through `printable`, so control characters
are shown escaped (`\\x1b`, `\\n`, `\\u202e`) and never reach the terminal raw.
Rich markup is a separate concern: views build `rich.text.Text` objects, which
are never parsed as markup.

`utf8_problem` says where a string stops being UTF-8: Python turns bytes that
are not UTF-8 in command-line arguments into lone surrogates (PEP 383), and a
JSON body can spell one as `"\\ud800"`.
"""

from __future__ import annotations

import re

# C0 and C1 controls and DEL; bidirectional overrides and isolates (they reorder
# what follows them on screen); line and paragraph separators; lone surrogates.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    code = ord(char)
    if char in _NAMED:
        return _NAMED[char]
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (PEP 383): show the byte
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, lines: bool = False) -> str:
    """`text` with every control character shown as an escape, as Python writes it.

    Arguments:
        text: any string from a user, a file or a model.
        lines: keep newlines and tabs (for multi-line text such as a model's
            reply); by default they are escaped too, so the result is one line.

    Returns:
        A string safe to write to a terminal. Backslashes are not doubled, so
        the text `\\x1b` and the character ESC read the same; nothing is lost
        that could change the terminal.
    """
    if lines:
        return _UNSAFE.sub(lambda m: m.group() if m.group() in "\n\t" else _escape(m.group()), text)
    return _UNSAFE.sub(lambda m: _escape(m.group()), text)


def token_label(token: str) -> str:
    """A token as a one-line label: line breaks and tabs drawn as ⏎ ␍ ⇥, other control
    characters escaped, the leading space of BPE pieces dropped; a token of spaces is ␣
    and an empty one ∅."""
    label = printable(token.replace("\n", "⏎").replace("\r", "␍").replace("\t", "⇥"))
    return label.strip(" ") or ("␣" if label else "∅")


def utf8_problem(text: str) -> str | None:
    """Where `text` cannot be encoded as UTF-8, in words; None when it can.

    Returns, for example, "byte 0xff at offset 3" (a byte that came from the
    command line, with its offset in the original bytes) or "lone surrogate
    U+D800 at character 5".
    """
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as error:
        char = text[error.start]
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            offset = len(text[: error.start].encode("utf-8"))
            return f"byte 0x{code - 0xDC00:02x} at offset {offset}"
        return f"lone surrogate U+{code:04X} at character {error.start}"


def decode_utf8(data: bytes) -> tuple[str | None, str | None]:
    """`data` decoded as UTF-8 (a leading byte-order mark dropped), or the problem in words.

    Returns:
        (text, None) or (None, "byte 0xff at offset 12").
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, f"byte 0x{data[error.start]:02x} at offset {error.start}"
    return text.removeprefix("\ufeff"), None
