"""Messages on stderr start a line of their own: after text streamed to stdout without a
newline (a generation), a note, warning or error first ends that line, so that in a terminal
showing both streams (`attnkit generate ... | cat`) it never lands after the text."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("kind", ["note", "warn", "print_error"])
def test_a_message_after_a_partial_stdout_line_starts_its_own_line(kind, capsys):
    from attnkit.cli import _app

    message = getattr(_app, kind)
    _app.console.out("ready\n", end="")
    message("first")
    _app.console.out("The capital of France", end="", highlight=False)
    message("second")
    message("third")
    _app.console.out(" is Paris.\n", end="", highlight=False)
    message("fourth")
    out, err = capsys.readouterr()
    assert out == "ready\nThe capital of France is Paris.\n"
    lines = err.split("\n")
    assert [line.endswith(word) for line, word in zip(lines, ["first", "", "second", "third", "fourth"])] \
        == [True] * 5, err
    assert lines[1] == "" and err.count("\n") == 5  # one line ended, nothing else added
