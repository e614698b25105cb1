"""Streamed text wrapped at word boundaries, for a reply printed token by token.

A terminal wraps a long line wherever the last column falls, often in the middle of
a word. `WordWrap` decides the line breaks itself as the pieces arrive: it holds back
the word being written (and the spaces before it) until the word is complete, then
writes it on the current line if it fits, or starts a new line for it. It keeps the
text's own line breaks, and breaks only a word longer than a whole line. The result
is what `textwrap.fill(text, width, break_on_hyphens=False)` gives for text of words
separated by single spaces (tests/cli/test_chat_cli.py checks it against textwrap).

Widths are counted in terminal cells (`rich.cells.cell_len`: a CJK character takes two).
"""

from __future__ import annotations

from typing import Callable, Optional

from rich.cells import cell_len


class WordWrap:
    """Wrap streamed text at `width()` cells, starting at column `column`.

    Arguments:
        width: the line width in cells, asked before each word is placed (a terminal
            may be resized while a reply streams); values below 2 count as 2.
        column: the cells already used on the first line (a `model> ` prefix).

    `feed(piece)` returns the text to write now; `flush()` returns what is held back
    (call it when the reply ends or is interrupted). Spaces at the end of a line are
    never written; a tab becomes the spaces up to the next multiple of 8 columns.
    """

    def __init__(self, width: Callable[[], int], column: int = 0) -> None:
        self.width = width
        self.column = column
        self.spaces = ""  # spaces after the last word written (or at a line's start), not yet written
        self.word = ""  # the word being received

    def _width(self) -> int:
        return max(2, int(self.width()))

    def _write(self, text: str) -> str:
        self.column += cell_len(text)
        return text

    def _newline(self) -> str:
        self.column, self.spaces = 0, ""
        return "\n"

    def _place(self, complete: bool) -> str:
        """Write the held word: after its spaces when it fits on this line, else on a new line;
        a word longer than a line fills this line and goes on, as textwrap breaks it. An
        incomplete word keeps its last part (at most a line) held back."""
        word, width = self.word, self._width()
        if not word:
            return ""
        out = ""
        spaces, self.spaces = self.spaces, ""
        if cell_len(word) <= width:  # fits on a line of its own at worst
            if self.column + cell_len(spaces) + cell_len(word) > width:
                out += self._newline()
                spaces = ""
            self.word = ""
            return out + self._write(spaces) + self._write(word)
        if self.column + cell_len(spaces) < width:
            out += self._write(spaces)
        else:
            out += self._newline()
        while cell_len(word) > width - self.column:
            cut = cells_prefix(word, width - self.column) or (word[0] if self.column == 0 else "")
            out += self._write(cut) + self._newline()
            word = word[len(cut):]
            if not complete and cell_len(word) <= width:
                break
        self.word = "" if complete else word
        return out + (self._write(word) if complete else "")

    def feed(self, piece: str) -> str:
        """The text to write for `piece` (maybe empty: the word is not complete yet)."""
        out = []
        for char in piece:
            if char == "\n":
                out.append(self._place(complete=True))
                out.append(self._newline())
            elif char in " \t":
                out.append(self._place(complete=True))
                if char == " ":
                    self.spaces += " "
                else:  # to the next tab stop
                    self.spaces += " " * (8 - (self.column + len(self.spaces)) % 8)
            else:
                self.word += char
                if cell_len(self.word) > self._width():  # longer than any line: no reason to wait
                    out.append(self._place(complete=False))
        return "".join(out)

    def flush(self) -> str:
        """What is held back: the last word (spaces at the end of the text are dropped)."""
        out = self._place(complete=True)
        self.spaces = ""
        return out


def cells_prefix(text: str, cells: int) -> str:
    """The longest prefix of `text` that takes at most `cells` terminal cells."""
    used, end = 0, 0
    for end, char in enumerate(text):
        used += cell_len(char)
        if used > cells:
            return text[:end]
    return text


def wrap_width(console) -> Optional[Callable[[], int]]:
    """A function giving `console`'s current width when it is a terminal, else None (piped
    text is data: never wrapped)."""
    if not console.is_terminal:
        return None
    return lambda: console.size.width
