"""`attnkit chat` and `attnkit generate` around the model: replies wrapped between words (checked
against textwrap), a banner that fits the terminal, /attention with positions, suggestions for
mistyped commands, no prompt echoed when piped, /set, /save and /load (checked against the
openai package's message types), and each reply's timing."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.cells import cell_len
from typer.testing import CliRunner

from attnkit.cli import app
from attnkit.cli._wrap import WordWrap
from attnkit.models.auto import AutoCausalLM
from attnkit.models.causal_lm import CausalLM
from conftest import missing_oracle, optional, require
from test_chat_prompt import folder  # noqa: F401 - the tiny Llama folder with a chat template

runner = CliRunner()
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


# ----------------------------------------------------------------------------- wrapping


def _wrapped(text: str, width: int, column: int, cuts: list[int]) -> str:
    """`text` streamed through WordWrap in pieces cut at `cuts`."""
    wrap = WordWrap(lambda: width, column)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    out = "".join(wrap.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    return out + wrap.flush()


def _textwrap(text: str, width: int, column: int) -> str:
    """textwrap's lines for `text` after `column` cells already used (a word of column - 1
    letters and a space stand for chat's `model> `), without the trailing spaces it
    sometimes leaves before a broken long word."""
    if column == 0:
        filled = textwrap.fill(text, width, break_on_hyphens=False)
    else:
        filled = textwrap.fill("x" * (column - 1) + " " + text, width, break_on_hyphens=False)[column - 1:]
        filled = filled[1:] if filled.startswith(" ") else filled
    return "\n".join(line.rstrip(" ") for line in filled.split("\n"))


words = st.lists(st.text("abcdefgh", min_size=1, max_size=30), min_size=1, max_size=30)


@given(words=words, width=st.integers(2, 50), data=st.data())
def test_streamed_text_wraps_as_textwrap_wraps_it(words, width, data):
    """Whatever the pieces (tokens) the text arrives in, the lines are textwrap's: a break
    only between words, and inside a word only when it is longer than a line."""
    text = " ".join(words)
    column = data.draw(st.sampled_from([0, *range(2, width)]))
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=12))
    assert _wrapped(text, width, column, cuts) == _textwrap(text, width, column)


@given(lines=st.lists(words, min_size=1, max_size=4), width=st.integers(8, 40), cuts=st.lists(st.integers(0, 10_000)))
def test_the_texts_own_line_breaks_stay_and_each_line_wraps_alone(lines, width, cuts):
    text = "\n".join(" ".join(line) for line in lines)
    assert _wrapped(text, width, 7, cuts) == "\n".join(
        _textwrap(" ".join(line), width, 7 if i == 0 else 0) for i, line in enumerate(lines))


@given(text=st.text("ab 世界é", min_size=1, max_size=80), width=st.integers(2, 30), cuts=st.lists(st.integers(0, 999)))
def test_wide_characters_are_counted_in_cells_and_nothing_is_lost(text, width, cuts):
    out = _wrapped(text, width, 0, cuts)
    assert all(cell_len(line) <= width for line in out.split("\n"))
    assert out.replace("\n", "").replace(" ", "") == text.replace(" ", "")


def test_a_chat_reply_wraps_between_words_at_the_terminal_width(folder, monkeypatch):  # noqa: F811
    """The reply streams token by token after 'model> ' and breaks where textwrap breaks it."""
    import attnkit.cli.chat as chat_cli

    sentence = "attention weighs every earlier token and the softmax keeps the weights positive " * 3
    model = AutoCausalLM.from_pretrained(folder)
    ids = model.tokenizer.encode(sentence.strip())

    def stream(self, prompt, *args, **kwargs):  # the model "says" the sentence, one byte-level token at a time
        yield from (np.array([token]) for token in ids)

    monkeypatch.setattr(CausalLM, "stream", stream)
    monkeypatch.setattr(chat_cli, "wrap_width", lambda console: lambda: 30)
    result = runner.invoke(app, ["chat", "--model", str(folder), "-n", str(len(ids) + 1)], input="hi\n",
                           env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    reply = result.stdout.split("model> ", 1)[1].rstrip("\n")
    assert reply == _textwrap(sentence.strip(), 30, len("model> "))
    assert max(len(line) for line in ("model> " + reply).split("\n")) <= 30


def _pty(args: list[str], home, width: int):
    pexpect = optional("pexpect")
    if pexpect is None:
        missing_oracle("the Python package 'pexpect' is not installed (pip install 'attnkit[test]')")
    env = {**os.environ, "HOME": str(home), "XDG_DATA_HOME": str(home / "data"), "TERM": "xterm",
           "PROMPT_TOOLKIT_NO_CPR": "1"}
    for name in ("NO_COLOR", "COLUMNS", "LINES"):
        env.pop(name, None)
    child = pexpect.spawn(sys.executable, ["-m", "attnkit", *args], env=env, encoding="utf-8", timeout=120,
                          dimensions=(24, width))
    return pexpect, child


@pytest.mark.slow
def test_generate_in_a_terminal_wraps_the_text_between_words(folder, tmp_path):  # noqa: F811
    prompt = "the cat sat on the mat because it was tired and the dog barked at the moon all night"
    pexpect, child = _pty(["generate", prompt, "--model", str(folder), "-n", "1"], tmp_path, 32)
    try:
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    printed = ANSI.sub("", child.before)
    lines = printed[printed.index("the cat sat"):].split("\n")  # after the spinner (stderr, same terminal)
    expected = textwrap.fill(prompt, 32).split("\n")
    # the last word may continue with the generated token: every line before it is textwrap's
    assert lines[: len(expected) - 1] == expected[:-1]


@pytest.mark.slow
def test_the_banner_fits_a_narrow_terminal_and_replies_are_timed(folder, tmp_path):  # noqa: F811
    system = "You are a patient teacher who explains attention in transformers with small examples. " * 3
    pexpect, child = _pty(["chat", "--model", str(folder), "--system", system, "--no-history"], tmp_path, 50)
    try:
        child.expect("you> ")
        banner = ANSI.sub("", child.before)
        child.send("the\r")
        child.expect(r"\(\d+ tokens?, [\d.]+ s, [\d.]+ tok/s\)")  # each reply's timing, in a terminal
        child.expect("you> ")
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    line = next(line for line in banner.split("\n") if line.startswith("system prompt:"))
    assert len(line) < 50 and line.endswith("…")
    assert line.startswith("system prompt: --system (") and "You are a" in line


def test_fit_line_shortens_the_text_then_the_prefix():
    from attnkit.cli.chat import fit_line

    assert fit_line("a: ", "short  text\nhere", 40) == "a: short text here"
    for width in (12, 20, 35, 60):
        line = fit_line("system prompt: from /a/long/path/prompt.txt (9 tokens): ", "Be brief. " * 10, width)
        assert cell_len(line) <= width and line.endswith("…") and "Be" in line


# ----------------------------------------------------------------------------- piped chat


def chat(folder, *args, input: str):  # noqa: F811
    return runner.invoke(app, ["chat", "--model", str(folder), *args], input=input,
                         env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_piped_chat_echoes_no_prompt_and_times_each_reply(folder, monkeypatch):  # noqa: F811
    import attnkit.cli.chat as chat_cli

    monkeypatch.setattr(chat_cli, "timing_wanted", lambda: True)  # as when stderr is a terminal
    result = chat(folder, "-n", "4", input="the\nhe\n")
    assert result.exit_code == 0, result.output
    assert "you>" not in result.stdout and result.stdout.count("model> ") == 2
    assert re.findall(r"^\(4 tokens, \d+\.\d+ s, \d+(\.\d)? tok/s\)$", result.stderr, re.M) != []
    assert len(re.findall(r"^\(\d+ tokens?, [\d.]+ s, [\d.]+ tok/s\)$", result.stderr, re.M)) == 2
    one = chat(folder, "-n", "1", input="the\n")
    assert re.search(r"^\(1 token, [\d.]+ s, [\d.]+ tok/s\)$", one.stderr, re.M), one.stderr
    assert "1 token in " in one.stderr  # the closing total, singular too
    monkeypatch.setattr(chat_cli, "timing_wanted", lambda: False)  # stderr to a file: only the total
    quiet = chat(folder, "-n", "4", input="the\n")
    assert "tok/s)" not in quiet.stderr and "4 tokens in " in quiet.stderr


def test_a_mistyped_command_gets_the_nearest_one(folder):  # noqa: F811
    result = chat(folder, input="/hepl\n/sav x.json\n/zzzzzz\n/set tmperature 1\n")
    assert result.exit_code == 0, result.output
    assert "unknown command /hepl; did you mean /help?" in result.stderr
    assert "unknown command /sav; did you mean /save?" in result.stderr
    assert "unknown command /zzzzzz (" in result.stderr  # nothing close: no suggestion
    assert "unknown setting tmperature; did you mean temperature?" in result.stderr


def _tokens_of(model, messages, reply_ids):
    ids = model.tokenizer.encode_chat(messages)
    return ids, model.tokenizer.tokens(ids + reply_ids)


def test_attention_lists_positions_and_suggests_the_given_path(folder):  # noqa: F811
    from attnkit.viz.text import token_label

    model = AutoCausalLM.from_pretrained(folder)
    result = chat(folder, "-n", "5", "--repetition-penalty", "1", input="the cat sat\n/attention\n")
    assert result.exit_code == 0, result.output
    ids = model.tokenizer.encode_chat([{"role": "user", "content": "the cat sat"}])
    reply = [int(t) for t in model.generate(np.array(ids), 5)[len(ids):]]
    tokens = model.tokenizer.tokens(ids + reply)
    rows = re.findall(r"^ +(\d+\.\d)%  “(.*)” \((prompt|reply), #(\d+)\)$", result.stdout, re.M)
    assert len(rows) == 8
    for percent, label, where, position in rows:
        position = int(position)
        assert label == token_label(tokens[position])  # the token at that place in the conversation
        assert where == ("reply" if position >= len(ids) else "prompt")
    percents = [float(p) for p, *_ in rows]
    assert percents == sorted(percents, reverse=True)
    assert f"attnkit show --model {folder} " in result.stdout and "--model smollm2" not in result.stdout


# ----------------------------------------------------------------------------- /set


def test_set_changes_the_sampling_of_the_next_reply(folder):  # noqa: F811
    model = AutoCausalLM.from_pretrained(folder)
    result = chat(folder, "-n", "6", input="/set temperature 0.8\n/set seed 7\n/set top_p 0.9\n/set max_tokens 5\n"
                                          "/set top_p 2\n/set seed x\n/set\nthe\n")
    assert result.exit_code == 0, result.output
    ids = model.tokenizer.encode_chat([{"role": "user", "content": "the"}])
    expected = model.generate(np.array(ids), 5, temperature=0.8, seed=7, top_p=0.9, repetition_penalty=1.1)
    text = model.tokenizer.decode(expected[len(ids):], skip_special_tokens=True)
    from attnkit.viz.text import printable

    assert result.stdout.split("model> ")[1][:-1] == printable(text, lines=True).rstrip("\ufffd")
    assert "temperature 0.8 (was 0)" in result.stderr and "max_tokens 5 (was 6)" in result.stderr
    assert "expected a finite top_p in (0, 1], got 2.0" in result.stderr  # refused: top_p stays 0.9
    assert "expected seed to be an integer, got 'x'" in result.stderr
    assert "temperature 0.8, top_p 0.9, top_k off, max_tokens 5, seed 7, repetition_penalty 1.1" in result.stderr


# ----------------------------------------------------------------------------- /save and /load


def test_save_writes_openai_messages_and_load_continues_the_conversation(folder, tmp_path):  # noqa: F811
    pydantic = require("pydantic")
    require("openai")
    from openai.types.chat import ChatCompletionMessageParam

    saved = tmp_path / "conversation.json"
    first = chat(folder, "-n", "6", "--system", "Be brief.", input=f"the\n/save {saved}\n")
    assert first.exit_code == 0, first.output
    messages = json.loads(saved.read_text(encoding="utf-8"))
    pydantic.TypeAdapter(list[ChatCompletionMessageParam]).validate_python(messages)  # OpenAI's shape
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[0]["content"] == "Be brief." and messages[1]["content"] == "the"
    assert f"wrote {saved} (3 messages)" in first.stderr

    # continuing from the file answers as the chat that never stopped
    loaded = chat(folder, "-n", "6", input=f"/load {saved}\nhe the\n/system\n")
    straight = chat(folder, "-n", "6", "--system", "Be brief.", input="the\nhe the\n")
    assert loaded.exit_code == 0, loaded.output
    assert loaded.stdout.split("model> ")[1] .split("\n")[0] == straight.stdout.split("model> ")[2].split("\n")[0]
    assert "loaded" in loaded.stderr and "3 messages" in loaded.stderr and "with a system prompt" in loaded.stderr
    assert "Be brief." in loaded.stdout  # /system shows the loaded system prompt


@pytest.mark.parametrize(("content", "expected"), [
    (None, "no such file or directory"),
    (b"{not json", "it is not JSON: "),
    (b"\xff\xfe[]", "it is not valid UTF-8"),
    (json.dumps({"role": "user"}).encode(), "expected a JSON list of messages"),
    (json.dumps([{"role": "bot", "content": "hi"}]).encode(), "expected messages[0]['role'] to be one of system, user, assistant, got 'bot'"),
    (json.dumps([{"role": "user", "content": ["hi"]}]).encode(), "expected messages[0]['content'] to be a string, got a list"),
    (json.dumps([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]).encode(),
     "messages[1] is a system message"),
])
def test_load_refuses_what_is_not_a_conversation_and_says_why(folder, tmp_path, content, expected):  # noqa: F811
    path = tmp_path / "c.json"
    if content is not None:
        path.write_bytes(content)
    result = chat(folder, "-n", "2", input=f"/load {path}\nthe\n")
    assert result.exit_code == 0, result.output  # the chat goes on
    assert f"cannot load {path}: " in result.stderr and expected in result.stderr
    assert result.stdout.count("model> ") == 1


def test_save_says_why_it_cannot_write(folder, tmp_path):  # noqa: F811
    result = chat(folder, input=f"/save {tmp_path / 'no' / 'such' / 'dir.json'}\n/save\n")
    assert result.exit_code == 0
    assert "cannot write" in result.stderr and "no such file or directory" in result.stderr
    assert "expected a file name after the command" in result.stderr
