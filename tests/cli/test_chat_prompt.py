"""`attnkit chat` as a person uses it: a real prompt driven through a pseudo-terminal (pexpect),
its commands, history across runs, multi-line messages, cut replies, and the repetition
penalty (transformers' definition, checked against transformers itself)."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from attnkit.cli import app
from attnkit.models.auto import AutoCausalLM
from attnkit.models.causal_lm import CausalLM
from attnkit.models.sampling import apply_repetition_penalty
from conftest import missing_oracle, optional

TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
runner = CliRunner()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, torch, transformers):
    """A tiny random Llama saved by transformers, with a byte-level tokenizer and a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny-chat-llama")
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = special + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}
    ))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokens), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger than init, so that greedy text varies (and repeats without a penalty)
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# ----------------------------------------------------------------------------- the repetition penalty


def test_repetition_penalty_is_transformers_logits_processor(torch):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    logits = (3 * rng.standard_normal((3, 40))).astype(np.float32)
    ids = rng.integers(0, 40, (3, 15))
    seen = np.zeros((3, 40), dtype=bool)
    np.put_along_axis(seen, ids, True, axis=1)
    for penalty in (0.7, 1.0, 1.1, 2.5):
        ours = apply_repetition_penalty(logits, seen, penalty)
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(ids), torch.tensor(logits)).numpy()
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, theirs)  # one multiply or divide per logit: exact


@pytest.mark.slow
def test_greedy_generation_with_a_penalty_equals_transformers(folder, torch, transformers):
    """The same tokens as transformers' generate(repetition_penalty=...), prompt tokens included."""
    ours = AutoCausalLM.from_pretrained(folder)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    prompt = ours.tokenizer.encode("the cat sat on the mat")
    for penalty in (1.0, 1.3):
        mine = ours.generate(np.array(prompt), 24, repetition_penalty=penalty)
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)[0].numpy()
        np.testing.assert_array_equal(mine, theirs[: len(mine)])


@pytest.mark.slow
def test_a_penalty_over_a_kept_cache_counts_the_earlier_tokens(folder):
    """Continuing a cache with `penalty_context` gives exactly a fresh generation on the whole text."""
    model = AutoCausalLM.from_pretrained(folder)
    first = model.tokenizer.encode("the cat sat on the mat and")
    more = model.tokenizer.encode(" then the cat")
    cache = model.new_cache(1, 128)
    model.forward(np.array(first), cache=cache)
    continued = [int(t[0]) for t in model.stream(np.array(more), 16, cache=cache, repetition_penalty=1.5,
                                                 penalty_context=first)]
    fresh = model.generate(np.array(first + more), 16, repetition_penalty=1.5)[len(first + more):]
    assert continued == [int(t) for t in fresh]


# ----------------------------------------------------------------------------- piped input


def chat(folder, *args, input: str):
    return runner.invoke(app, ["chat", "--model", str(folder), *args], input=input,
                         env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.mark.slow
def test_commands_are_never_sent_to_the_model_and_a_cut_reply_is_marked(folder):
    result = chat(folder, "-n", "4", "--repetition-penalty", "1", input="/help\n/bogus\n/system\n/attention\n")
    assert result.exit_code == 0, result.output
    assert "model>" not in result.stdout  # nothing was sent
    assert "/attention" in result.stdout and "/reset" in result.stdout  # the help
    assert "unknown command /bogus" in result.stderr and "no system prompt" in result.stderr
    assert "no reply yet" in result.stderr
    result = chat(folder, "-n", "4", "--system", "Be brief.", input="hello\n/attention\n//slash\n")
    assert result.exit_code == 0, result.output
    replies = result.stdout.split("model> ")[1:]
    assert len(replies) == 2  # '//slash' was sent (as '/slash')
    # 4 tokens and no end of turn: cut, marked at the end of the reply (on stderr: stdout is the text;
    # in a terminal the mark shows after the reply, then stdout's line break, then the note)
    assert result.stderr.count(" […]reply cut at 4 tokens: --max-new-tokens is 4\n") == 2
    assert "[…]" not in result.stdout
    assert "The last reply (4 tokens)" in result.stdout and "% on the first token" in result.stdout


@pytest.mark.slow
def test_system_and_reset_restart_the_conversation(folder):
    """After /reset (or a new /system) a message gets the reply it gets in a fresh chat."""
    fresh = chat(folder, "-n", "6", "--system", "Be brief.", input="he the\n")
    after = chat(folder, "-n", "6", "--system", "Be brief.", input="the\n/reset\nhe the\n")
    changed = chat(folder, "-n", "6", "--system", "Other.", input="the\n/system Be brief.\nhe the\n/system\n")
    reply = fresh.stdout.split("model> ")[1].split("\n")[0]
    assert after.stdout.split("model> ")[2].split("\n")[0] == reply
    assert changed.stdout.split("model> ")[2].split("\n")[0] == reply
    assert "Be brief." in changed.stdout.split("model> ")[2]  # /system shows it
    assert "forgotten" in after.stderr and "new system prompt" in changed.stderr


@pytest.mark.slow
def test_a_line_ending_in_a_backslash_continues_the_message(folder, monkeypatch):
    seen = []
    real = CausalLM.stream

    def spy(self, ids, *args, **kwargs):
        seen.append(self.tokenizer.decode([int(i) for i in np.asarray(ids).ravel()]))
        return real(self, ids, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "stream", spy)
    result = chat(folder, "-n", "2", input="line one\\\nline two\n")
    assert result.exit_code == 0 and result.stdout.count("model> ") == 1
    assert "user\nline one\nline two<|im_end|>" in seen[-1]  # (the first call may be the kernels' one-time warm-up)


# ----------------------------------------------------------------------------- a real terminal


def _spawn(folder, home, *args):
    pexpect = optional("pexpect")
    if pexpect is None:
        missing_oracle("the Python package 'pexpect' is not installed (pip install 'attnkit[test]')")
    # PROMPT_TOOLKIT_NO_CPR: pexpect does not answer a cursor-position request, as a terminal would.
    env = {**os.environ, "HOME": str(home), "XDG_DATA_HOME": str(home / "data"), "TERM": "xterm",
           "COLUMNS": "120", "LINES": "40", "PROMPT_TOOLKIT_NO_CPR": "1"}
    env.pop("NO_COLOR", None)
    child = pexpect.spawn(sys.executable, ["-m", "attnkit", "chat", "--model", str(folder), "-n", "5", *args],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 120))
    return pexpect, child


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|[\r]")


def _history(home) -> list[str]:
    """The entries of prompt_toolkit's history file, oldest first."""
    from prompt_toolkit.history import FileHistory

    return list(reversed(list(FileHistory(str(home / "data" / "attnkit" / "chat-history")).load_history_strings())))


@pytest.mark.slow
def test_the_prompt_in_a_terminal_edits_lines_keeps_history_and_runs_commands(folder, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    pexpect, child = _spawn(folder, home, "--system", "Be brief.")
    try:
        child.expect("attnkit chat: ")
        child.expect("system prompt: --system")
        child.expect("repetition penalty 1.1")
        child.expect(r"history: .*chat-history")
        child.expect("you> ")
        child.send("/help\r")  # a command: answered, never sent to the model
        child.expect("/attention")
        child.expect("you> ")
        child.send("helo")
        child.send("\x1b[D")  # Left: the cursor goes back before 'o'
        child.send("l\r")  # 'hello', edited in place, not '^[[D'
        child.expect("model> ")
        child.expect("you> ")
        child.send("\x1b[A")  # Up: the last message again
        child.send("\r")
        child.expect("model> ")
        child.expect("you> ")
        child.send("line one\\\r")  # a backslash at the end: the message goes on
        child.send("line two\r")
        child.expect("model> ")
        child.expect("you> ")
        child.send("/attention\r")
        child.expect("The last reply")
        child.expect("you> ")
        child.sendeof()  # Ctrl-D quits
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, ANSI.sub("", child.before or "")
    # (Up + Enter sent 'hello' again: a reply came; prompt_toolkit keeps one copy of a repeat.)
    assert _history(home) == ["/help", "hello", "line one\nline two", "/attention"]

    # A second run finds the history: Up brings back the last message of the first run.
    pexpect, child = _spawn(folder, home)
    try:
        child.expect("you> ")
        child.send("\x1b[A")
        child.send("\r")
        child.expect("The last reply|no reply yet")  # '/attention', recalled and run
        child.expect("you> ")
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert _history(home)[-1] == "/attention"


@pytest.mark.slow
def test_no_history_keeps_nothing(folder, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    pexpect, child = _spawn(folder, home, "--no-history")
    try:
        child.expect("history: off")
        child.expect("you> ")
        child.send("/reset\r")
        child.expect("forgotten")
        child.expect("you> ")
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert not (home / "data" / "attnkit" / "chat-history").exists()


# ----------------------------------------------------------------------------- the loop of issue 14


def _repeated_sentences(text: str) -> list[str]:
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) > 30]
    return sorted({s for s in sentences if sentences.count(s) > 1})


@pytest.mark.slow
def test_the_default_penalty_stops_smollm2_repeating_itself(smollm2_file):
    """Asked "What is attention in a transformer?" with the explainer prompt, greedy SmolLM2
    repeats one sentence until the limit without a penalty; chat's default stops that."""
    from attnkit.cli.chat import DEFAULT_REPETITION_PENALTY
    from attnkit.models.chat import load_prompt

    model = AutoCausalLM.from_pretrained(smollm2_file)
    messages = [{"role": "system", "content": load_prompt("attention-explainer").strip()},
                {"role": "user", "content": "What is attention in a transformer?"}]
    ids = np.array(model.tokenizer.encode_chat(messages))
    without = model.generate(ids, 160, repetition_penalty=1.0)[len(ids):]
    assert _repeated_sentences(model.tokenizer.decode(without, skip_special_tokens=True))  # the loop
    result = runner.invoke(app, ["chat", "--explain-attention", "-n", "256"],
                           input="What is attention in a transformer?\n", env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    reply = result.stdout.split("model> ")[1]
    assert _repeated_sentences(reply) == [], reply
    assert f"{DEFAULT_REPETITION_PENALTY}" == "1.1"


# ----------------------------------------------------------------------------- typed bytes at the prompt


def _prompt_with(monkeypatch, *inputs: str) -> list:
    """What `_TerminalInput` returns for each of `inputs`, typed (not pasted) into a pipe.

    An exception in a key handler is not allowed to reach prompt_toolkit's "Press ENTER to
    continue" handler: it ends the prompt with that exception instead, so the test sees it.
    """
    pytest.importorskip("prompt_toolkit")
    from prompt_toolkit.application import Application, create_app_session
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from attnkit.cli.chat import _TerminalInput

    def handle_exception(self, loop, context):
        error = context.get("exception") or RuntimeError(context.get("message"))
        if not self.future.done():
            self.exit(exception=error)

    monkeypatch.setattr(Application, "_handle_exception", handle_exception)
    results = []
    with create_pipe_input() as pipe, create_app_session(input=pipe, output=DummyOutput()):
        read = _TerminalInput(None)
        for text in inputs:
            pipe.send_text(text)
            results.append(read())
    return results


def test_a_typed_colour_code_is_text_not_a_mouse_event(monkeypatch):
    """prompt_toolkit parses `ESC [ 31 m` as a mouse report, and its mouse handler raised (a
    traceback, "Press ENTER to continue"). Typed, it is text: inserted without the ESC, as
    prompt_toolkit inserts any escape sequence it does not know."""
    got = _prompt_with(monkeypatch, "Say hello. \x1b[31mRED\x1b[0m\r", "a\x1b[Mxyzb\r", "\x1b[<0;1;1Mok\r",
                       "\x1b[99z\r")
    assert got == ["Say hello. [31mRED[0m", "a[Mxyzb", "[<0;1;1Mok", "[99z"]


@pytest.mark.slow  # over 2 s in the quick loop (2-core Xeon, 2026-12-08)
def test_any_typed_byte_sequence_gives_text_never_an_exception(monkeypatch):
    """Random sequences of the pieces escape sequences are made of, and of any characters:
    each prompt returns a string. Left out: keys that end the prompt or change its mode on
    purpose (Enter, Ctrl-C, Ctrl-D, Ctrl-R/S search, a bracketed paste's start)."""
    rng = np.random.default_rng(29)
    pieces = ["\x1b[", "\x1b[<", "\x1b[M", "\x1bO", "\x1b", "[", ";", "<", "?", "~", "M", "m", "R", "A", "u", " ", "a",
              "1", "31", "0", "65", "200", "\t", "\x7f", "\x08", "\x00", "\x01", "\x15", "\x17", "é", "☃", "\u202e"]
    stops = set("\r\n\x03\x04\x12\x13")
    inputs = []
    for _ in range(300):
        if rng.random() < 0.7:
            chars = rng.choice(pieces, size=int(rng.integers(1, 16)))
        else:
            chars = [chr(int(c)) for c in rng.integers(0, 256, size=int(rng.integers(1, 24)))]
        text = "".join(c for c in chars if c not in stops).replace("200~", "")
        # Plain keys before Enter: a trailing ESC is not Alt+Enter, and `ESC [ M` (a mouse report
        # and its three characters) does not take the Enter.
        inputs.append(text + "xyz\r")
    got = _prompt_with(monkeypatch, *inputs)
    assert all(isinstance(text, str) for text in got)
