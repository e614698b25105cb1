"""Every subcommand against bad arguments and hostile input: a table of cases and random ones.

The contract (docs/conventions.md, "The command line"), checked after every run:

- the exit code is 0, 1 (user error) or 2 (usage error), as the table says;
- a failing run prints exactly one line on stderr, `error: ...`, and nothing on stdout;
- no "Traceback" and no "internal error", whatever the input;
- no file left behind: the working folder holds what it held before, plus exactly the
  files the command said it wrote ("wrote ..." lines);
- user text is data: no raw control character reaches the output.

Models, training, benchmarks and the server are replaced by stand-ins that exit with
`REACHED`: a bad argument must be refused before any of that work starts, and random
arguments that are all valid end there, fast.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import typer.main
from typer.testing import CliRunner

from attnkit.cli import app

REACHED = 99  # the exit code of the stand-ins for the heavy work
ENV = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
runner = CliRunner()


# ----------------------------------------------------------------------------- the working folder


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working folder, but for two subfolders and three input files."""
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "pics.png").mkdir()  # a folder whose name looks like a file's
    (work / "input.txt").write_text("[red]x[/red] a\x1b]0;PWNED\x07b\nsecond line\n", encoding="utf-8")
    (work / "bad.txt").write_bytes(b"ok\n\xff\n")
    (work / "binary.bin").write_bytes(bytes(range(256)))
    monkeypatch.chdir(work)
    return work


def snapshot(folder: Path) -> set[str]:
    """Every file and folder under `folder`, hidden ones included."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


_WROTE = [
    re.compile(r"wrote (.+?) \(\d+x\d+\) and (.+?) \(\d+x\d+\)"),
    re.compile(r"wrote (.+?) \(self-contained; open it in a browser\)"),
    re.compile(r"wrote (.+)"),
]


def reported_files(stdout: str, folder: Path) -> set[str]:
    """The files named on "wrote ..." lines, relative to `folder`."""
    names: set[str] = set()
    for line in stdout.splitlines():
        for pattern in _WROTE:
            match = pattern.fullmatch(line)
            if match:
                names.update(os.path.relpath(os.path.abspath(n), folder) for n in match.groups())
                break
    return names


@pytest.fixture(autouse=True)
def no_heavy_work(monkeypatch):
    """Stand-ins for loading models, training, benchmarking and serving: they exit with REACHED."""
    import attnkit.bench
    import attnkit.cli.viz
    from attnkit.models.bert import SentenceEncoder
    from attnkit.models.auto import AutoCausalLM

    def reached(*args, **kwargs):
        for value in args:
            if isinstance(value, socket.socket):
                value.close()
        raise SystemExit(REACHED)

    monkeypatch.setattr(SentenceEncoder, "from_pretrained", classmethod(reached))
    monkeypatch.setattr(AutoCausalLM, "from_pretrained", classmethod(reached))
    monkeypatch.setattr(attnkit.bench, "get_suite", reached)
    monkeypatch.setattr(attnkit.cli.viz, "_run_server", reached)
    monkeypatch.setattr("attnkit.viz.providers._cache", {})


@pytest.fixture
def no_training(monkeypatch):
    """`train` stops where the training would start (torch is imported only for the tests of `train`)."""
    try:
        import attnkit.torch.induction as induction
    except ImportError:  # no torch: `train` stops at its import
        return

    def reached(*args, **kwargs):
        raise SystemExit(REACHED)

    monkeypatch.setattr(induction, "train_induction", reached)


def invoke(args: list[str], folder: Path, input: bytes | str | None = None):
    """Run `attnkit *args` in `folder` and check the contract; returns the result."""
    before = snapshot(folder)
    result = runner.invoke(app, args, input=input, env=ENV)
    out, err = result.stdout, result.stderr
    shown = f"attnkit {args!r}\nexit {result.exit_code}\nstdout: {out[-2000:]!r}\nstderr: {err!r}"
    assert "Traceback" not in out + err, shown
    assert "internal error" not in err, shown
    assert result.exit_code in (0, 1, 2, REACHED), shown
    assert not RAW_CONTROL.search(out + err), shown
    if result.exit_code in (1, 2):
        assert out == "", shown
        assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, shown
    if result.exit_code == 0:
        assert snapshot(folder) == before | reported_files(out, folder), shown
    elif result.exit_code != REACHED:
        assert snapshot(folder) == before, shown
    return result


# ----------------------------------------------------------------------------- the table

BAD = "\udcff\udcfe"  # the bytes ff fe on the command line, as Python receives them (PEP 383)
R = ["--model", "random"]
CASES = [
    # what a command says it wrote is exactly what it wrote: output names checked before the work
    ("show", ["show", "hi", *R, "--png", "out"], None, 2, "expected --png to name a .png file, got 'out'"),
    ("show", ["show", "hi", *R, "--png", "out.txt"], None, 2, "expected --png to name a .png file, got 'out.txt'"),
    ("show", ["show", "hi", *R, "--png", ""], None, 2, "expected --png to name a .png file, got ''"),
    ("show", ["show", "hi", *R, "--png", "x.png/"], None, 2, "expected --png to name a .png file"),
    ("show", ["show", "hi", *R, "--png", "sub"], None, 2, "expected --png to name a .png file, got 'sub'"),
    ("show", ["show", "hi", *R, "--png", "sub.png/"], None, 2, "expected --png to name a .png file"),
    ("show", ["show", "hi", *R, "--png", "missing/x.png"], None, 1, "folder 'missing' does not exist"),
    ("show", ["show", "hi", *R, "--png", "pics.png"], None, 1, "cannot write --png pics.png: it is a folder"),
    ("train", ["train", "--out", "pics.png"], None, 1, "cannot write --out pics.png: it is a folder"),
    ("show", ["show", "hi", *R, "--png", "ok.png", "--html", "missing/p.html"], None, 1,
     "cannot write --html missing/p.html: folder 'missing' does not exist"),
    ("show", ["show", "hi", *R, "--png", "input.txt/x.png"], None, 1, "'input.txt' is not a folder"),
    ("show", ["show", "hi", *R, "--html", "x.png"], None, 2, "expected --html to name a .html or .htm file"),
    ("compare", ["compare", "a", "b", *R, "--html", "sub/"], None, 2, "expected --html to name a .html"),
    ("compare", ["compare", "a", "b", *R, "--html", "missing/c.html"], None, 1, "does not exist"),
    ("train", ["train", "--out", "out"], None, 2, "expected --out to name a .png file, got 'out'"),
    ("train", ["train", "--out", "missing/x.png"], None, 1, "folder 'missing' does not exist"),
    ("bench", ["bench", "attention", "--json", "out"], None, 2, "expected --json to name a .json file"),
    ("bench", ["bench", "attention", "--json", "missing/b.json"], None, 1, "does not exist"),
    # invalid UTF-8: refused, naming the argument or file and the byte offset
    ("show", ["show", BAD, *R], None, 2, "TEXT is not valid UTF-8: byte 0xff at offset 0"),
    ("compare", ["compare", "a", "ok" + BAD, *R], None, 2, "B is not valid UTF-8: byte 0xff at offset 2"),
    ("embed", ["embed", BAD], None, 2, "TEXT is not valid UTF-8: byte 0xff at offset 0"),
    ("embed", ["embed", "-"], b"\xff\n", 1, "stdin is not valid UTF-8: byte 0xff at offset 0"),
    ("embed", ["embed", "--file", "-"], b"fine\n\xc3\x28\n", 1, "stdin is not valid UTF-8: byte 0xc3 at offset 5"),
    ("embed", ["embed", "--file", "bad.txt"], None, 1, "--file bad.txt is not valid UTF-8: byte 0xff at offset 3"),
    ("similarity", ["similarity", "--file", "binary.bin"], None, 1, "--file binary.bin is not valid UTF-8: byte 0x80"),
    ("generate", ["generate", "caf\u00e9 " + BAD], None, 2, "PROMPT is not valid UTF-8: byte 0xff at offset 6"),
    ("chat", ["chat", "--system", BAD], None, 2, "--system is not valid UTF-8"),
    ("chat", ["chat", "--system-file", "binary.bin"], None, 1, "--system-file binary.bin is not valid UTF-8: byte 0x80"),
    ("demo", ["demo", "--text", "a " + BAD], None, 2, "--text is not valid UTF-8: byte 0xff at offset 2"),
    ("serve", ["serve", "--host", BAD], None, 2, "--host is not valid UTF-8"),
    ("heads", ["heads", "hi", "-m", "gpt5"], None, 1, "unknown model 'gpt5': expected one of minilm, smollm2"),
    ("heads", ["heads", "hi", "--top", "-1"], None, 2, "expected --top >= 0, got -1"),
    ("lens", ["lens", "hi", "--top", "0"], None, 2, "expected --top in 1..5, got 0"),
    ("patch", ["patch", "--clean", "a"], None, 2, "missing option '--corrupt'"),
    # files that cannot be read
    ("embed", ["embed", "--file", "sub"], None, 1, "cannot read --file sub: it is a folder"),
    ("embed", ["embed", "--file", "none.txt"], None, 1, "cannot read --file none.txt: no such file or directory"),
    ("chat", ["chat", "--system-file", "none.txt"], None, 1, "cannot read --system-file none.txt"),
    ("chat", ["chat", "--system-file", "-"], None, 2, "chat reads your messages from stdin"),
    ("embed", ["embed", "-", "--file", "input.txt"], None, 2, "got both"),
    # sampling parameters finite and in range, seeds non-negative: before the model loads
    *[("generate", ["generate", "hi", "--temperature", t], None, 2, "expected --temperature 0 (greedy) or in")
      for t in ("nan", "inf", "-inf", "-1", "1e-9", "101")],
    *[("chat", ["chat", "--temperature", t], None, 2, "expected --temperature 0 (greedy) or in") for t in ("nan", "inf")],
    ("generate", ["generate", "hi", "--seed", "-1"], None, 2, "expected --seed >= 0, got -1"),
    ("chat", ["chat", "--seed", "-1"], None, 2, "expected --seed >= 0, got -1"),
    ("generate", ["generate", "hi", "--top-p", "nan"], None, 2, "expected a finite --top-p in (0, 1], got nan"),
    ("generate", ["generate", "hi", "--top-p", "0"], None, 2, "expected a finite --top-p in (0, 1], got 0.0"),
    ("chat", ["chat", "--top-p", "1.5"], None, 2, "--top-p in (0, 1]"),
    ("generate", ["generate", "hi", "--top-k", "0"], None, 2, "expected --top-k >= 1, got 0"),
    ("generate", ["generate", "hi", "-n", "-1"], None, 2, "expected --max-new-tokens >= 0, got -1"),
    ("generate", ["generate", "hi", "--temperature", "x"], None, 2, "invalid value for '--temperature'"),
    ("chat", ["chat", "--system", "a", "--explain-attention"], None, 2, "expected at most one of"),
    ("chat", ["chat", "--repetition-penalty", "0"], None, 2, "expected a finite --repetition-penalty in (0, 10], got 0.0"),
    ("generate", ["generate", "hi", "--repetition-penalty", "nan"], None, 2, "--repetition-penalty in (0, 10]"),
    ("chat", ["chat", "-m", "minilm"], None, 1, "minilm does not generate text"),
    ("embed", ["embed", "x", "-m", "smollm2"], None, 1, "smollm2 is not a sentence encoder"),
    ("generate", ["generate", "hi", "-m", "missing/x.gguf"], None, 1,
     "no model at 'missing/x.gguf': folder 'missing' does not exist"),
    ("models", ["models", "extra"], None, 2, "got unexpected extra argument"),
    ("show", ["show", "hi", *R, "--hide-special", "--log-scale", "--layer", "9"], None, 1, "valid layers are 0..1"),
    # serve: ports, model names, sizes, all before anything is printed
    *[("serve", ["serve", "--port", p], None, 2, f"expected --port in 1..65535, got {p}") for p in ("70000", "-1", "0")],
    ("serve", ["serve", "--port", "x"], None, 2, "invalid value for '--port'"),
    ("serve", ["serve", "--max-new-tokens", "0"], None, 2, "expected --max-new-tokens in 1..8192, got 0"),
    ("serve", ["serve", "--api-key", ""], None, 2, "expected --api-key to be printable text"),
    ("serve", ["serve", "-m", "gpt5"], None, 1, "unknown model 'gpt5': expected one of minilm, smollm2, gemma3, random"),
    ("serve", ["serve", "-m", "random", "-m", "binary.bin"], None, 1, "cannot read a model from 'binary.bin'"),
    ("serve", ["serve", "--host", ""], None, 2, "expected --host to be an address"),
    ("serve", ["serve", "--host", "192.0.2.1", "-m", "random"], None, 1, "cannot listen on 192.0.2.1:8000"),
    ("serve", ["serve", "--max-chars", "0"], None, 2, "expected --max-chars in 1..100000, got 0"),
    ("serve", ["serve", "--max-tokens", "5000"], None, 2, "expected --max-tokens in 1..1024, got 5000"),
    # sizes with documented limits, named in the error
    ("demo", ["demo", "--d-model", "200000", "--heads", "1"], None, 2, "expected --d-model <= 1024 (demo's limit)"),
    ("demo", ["demo", "--text", "w " * 5000], None, 2, "expected --text of at most 2000 characters (demo's limit)"),
    ("demo", ["demo", "--text", "w " * 65], None, 2, "expected --text of at most 64 words (demo's limit), got 65"),
    ("demo", ["demo", "--d-model", "128", "--heads", "128"], None, 2, "expected --heads <= 64 (demo's limit)"),
    ("demo", ["demo", "--seed", "-1"], None, 2, "non-negative --seed"),
    ("demo", ["demo", "--text", " "], None, 2, "expected some words in --text"),
    ("train", ["train", "--steps", "0"], None, 2, "expected --steps in 1..1000000"),
    ("train", ["train", "--d-model", "100000"], None, 2, "expected --d-model in 1..1024 (attnkit train's limit)"),
    ("train", ["train", "--lr", "nan"], None, 2, "expected a finite --lr in (0, 1], got nan"),
    ("train", ["train", "--seed", "-1"], None, 2, "expected --seed >= 0, got -1"),
    ("bench", ["bench", "nosuch"], None, 2, "unknown suite 'nosuch'"),
    ("bench", ["bench", "--threads", "100000"], None, 2, "expected --threads in 1..256"),
    ("embed", ["embed", "x", "--threads", "0"], None, 2, "expected --threads in 1..256, got 0"),
    ("embed", ["embed", "x", "--batch-size", "-3"], None, 2, "expected --batch-size >= 1, got -3"),
    ("similarity", ["similarity", "one"], None, 2, "expected at least two sentences to compare, got 1"),
    ("embed", ["embed"], None, 2, "expected at least one sentence"),
    # the views: model names, layers and heads
    ("show", ["show", "", *R], None, 2, "expected a non-empty text for TEXT"),
    ("show", ["show", "hi", *R, "--layer", "99"], None, 1, "layer 99 is out of range: the model has 2 layers"),
    ("show", ["show", "hi", *R, "--head", "-99"], None, 1, "valid heads are 0..3"),
    ("show", ["show", "hi", *R, "--layer", "x"], None, 2, "invalid value for '--layer'"),
    ("show", ["show", "hi", *R, "--max-tokens", "0"], None, 2, "expected --max-tokens in 1..1024, got 0"),
    ("show", ["show", "hi", "--model", "gpt5"], None, 1, "unknown model 'gpt5'"),
    ("show", ["show", "hi", "--model", "binary.bin"], None, 1, "cannot read a model from 'binary.bin'"),
    ("compare", ["compare", "a", "b", *R, "--top", "-1"], None, 2, "expected --top >= 0, got -1"),
    ("compare", ["compare", "a", " ", *R], None, 2, "expected a non-empty text for B"),
    # usage errors from click itself, as one line
    ("show", ["show"], None, 2, "missing argument"),
    ("walkthrough", ["walkthrough", "extra"], None, 2, "got unexpected extra argument"),
    ("version", ["version", "--bogus"], None, 2, "no such option: --bogus"),
    ("models", ["models", "extra"], None, 2, "got unexpected extra argument"),
    ("show", ["show", "hi", "--bogus\x1b[31m"], None, 2, "no such option: --bogus\\x1b[31m"),
]


@pytest.mark.parametrize("command, args, stdin, code, message", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_arguments_and_inputs(workdir, command, args, stdin, code, message, request):
    if command == "train":
        request.getfixturevalue("no_training")
    result = invoke(args, workdir, stdin)
    assert result.exit_code == code, result.output
    assert message in result.stderr


def test_every_subcommand_is_in_the_table():
    commands = set(typer.main.get_command(app).commands)
    assert commands == {case[0] for case in CASES}


def test_one_good_file_is_not_left_behind_when_another_is_bad(workdir):
    """--png ok.png --html missing/p.html used to write ok.png, then crash."""
    result = invoke(["show", "hi", *R, "--png", "ok.png", "--html", "missing/p.html"], workdir)
    assert result.exit_code == 1 and not (workdir / "ok.png").exists()


@pytest.fixture
def unwritable_folder(workdir):
    """A folder that refuses new files: mode 0500, or /sys when we are root (root writes anywhere else)."""
    locked = workdir / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        (locked / "probe").touch()
    except PermissionError:
        yield locked
    else:  # root
        (locked / "probe").unlink()
        try:
            (Path("/sys") / ".attnkit-probe").touch()
        except OSError:
            yield Path("/sys")
        else:
            pytest.skip("no folder here refuses new files")
    finally:
        locked.chmod(0o700)


def test_output_in_a_folder_that_takes_no_files(workdir, unwritable_folder):
    target = unwritable_folder / "x.png"
    result = invoke(["show", "hi", *R, "--png", str(target)], workdir)
    assert result.exit_code == 1 and result.stderr.startswith(f"error: cannot write --png {target}: ")


def test_files_are_replaced_whole_and_reported_exactly(workdir):
    (workdir / "old.png").write_bytes(b"not a png")
    (workdir / "old.png").chmod(0o640)
    result = invoke(["show", "a b c", *R, "--no-summary", "--png", "old.png", "--html", "sub/v.HTML"], workdir)
    assert result.exit_code == 0
    assert reported_files(result.stdout, workdir) == {"old.png", "old-grid.png", "sub/v.HTML"}
    assert (workdir / "old.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (workdir / "old.png").stat().st_mode & 0o777 == 0o640  # a replaced file keeps its mode
    assert (workdir / "sub" / "v.HTML").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_a_port_in_use_is_refused_before_anything_is_printed(workdir):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = invoke(["serve", "--port", str(port), "-m", "random"], workdir)
    assert result.exit_code == 1
    assert result.stderr == f"error: cannot listen on 127.0.0.1:{port}: address already in use\n"


# ----------------------------------------------------------------------------- user text is data

HOSTILE = "[red]x[/red] [link=https://evil.example]click[/link] [/] a\x1b]0;PWNED\x07b \u202eevil"


@pytest.mark.parametrize(
    "args",
    [
        ["show", HOSTILE, *R, "--no-summary"],
        ["compare", HOSTILE, "plain words here", *R, "--top", "1"],
        ["demo", "--text", HOSTILE, "--heads", "1", "--d-model", "4", "--no-color"],
    ],
    ids=["show", "compare", "demo"],
)
def test_user_text_is_never_markup_and_control_characters_are_escaped(workdir, args):
    result = invoke(args, workdir)  # checks that no raw control character was printed
    assert result.exit_code == 0
    for shown in ("[red]", "[/]", "\\x1b]0;", "\\u202e"):
        assert shown in result.stdout, shown


class FakeTokenizer:
    """Characters as token ids; enough of attnkit's tokenizer for generate and chat."""

    chat_template = "fake"
    tokenizer = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(i) for i in ids)

    def stream_decoder(self, skip_special_tokens=True):
        class Step:
            def step(self, tokenizer, token):
                return chr(token)

        return Step()


class FakeLM:
    """A model whose reply is an escape sequence that would retitle the terminal."""

    tokenizer = FakeTokenizer()
    context_length = 64

    def stream(self, ids, cache=None, max_new_tokens=0, **sampling):
        for char in "\x1b]0;PWNED\x07ok\n"[:max_new_tokens]:
            yield np.array([ord(char)])

    def new_cache(self, batch, length):
        class Cache:
            length = 0

            def crop(self, n):
                self.length = min(self.length, n)

        return Cache()


@pytest.fixture
def fake_lm(monkeypatch):
    from attnkit.models.auto import AutoCausalLM

    monkeypatch.setattr(AutoCausalLM, "from_pretrained", classmethod(lambda cls, path=None: FakeLM()))


def test_generate_shows_escapes_in_the_prompt_and_the_reply(workdir, fake_lm):
    result = invoke(["generate", "x\x1b[2Jy", "-n", "20"], workdir)
    assert result.exit_code == 0
    assert result.stdout == "x\\x1b[2Jy\\x1b]0;PWNED\\x07ok\n\n"


def test_chat_shows_escapes_and_refuses_a_line_that_is_not_utf8(workdir, fake_lm):
    result = invoke(["chat", "-n", "20"], workdir, input=b"hello\n")
    assert result.exit_code == 0
    assert "model> \\x1b]0;PWNED\\x07ok\n" in result.stdout and "\x1b" not in result.stdout
    result = runner.invoke(app, ["chat", "-n", "20"], input=b"hello\nbad \xff line\n", env=ENV)
    assert result.exit_code == 1
    assert result.stderr == "error: stdin is not valid UTF-8: line 2, byte 0xff at offset 4 of the line\n"


# ----------------------------------------------------------------------------- random arguments

VALUES = [
    "", "-", "0", "1", "2", "3", "-1", "7", "64", "70000", "99999999999999999999", "1.5", "1e999", "nan", "inf",
    "-inf", "x", "[red]x[/red]", "[/]", "a\x1b]0;PWNED\x07b", BAD, "\u202eevil", "w " * 1200, "%s%n{0}",
    "sub", "sub/", "missing/x.png", "out", "out.png", "out.txt", "out.html", "out.json", "input.txt", "bad.txt",
    "binary.bin", "random", "gpt5", "::1", "127.0.0.1", "attention", "--", "--help-me",
]
NUMBERS = ["0", "1", "2", "4", "-1", "-5", "16", "1024", "1025", "65535", "70000", "1e-9", "0.5", "nan", "inf"]


TEXTS = ["the cat sat on the mat", "a", "attention", "hello world"]


def random_arguments(command, rng: random.Random) -> list[str]:
    """A random command line for `command`: some of its options (found by introspection, so a
    new option is fuzzed too), each with its default or a value drawn to be bad; texts that
    are fine or not; sometimes a stray extra argument."""
    args: list[str] = [command.name]
    options = [p for p in command.params if p.param_type_name == "option"]
    for param in rng.sample(options, k=rng.randint(0, min(4, len(options)))):
        names = list(param.opts) + list(getattr(param, "secondary_opts", []) or [])
        if param.is_flag:
            args.append(rng.choice(names))
            continue
        default = param.default[0] if isinstance(param.default, (list, tuple)) and param.default else param.default
        pool = [NUMBERS, VALUES] + ([[str(default)]] if default not in (None, "") else [])
        args += [rng.choice(names), rng.choice(rng.choice(pool))]
    for param in command.params:
        if param.param_type_name == "argument":
            count = rng.randint(0, 3) if param.nargs == -1 else rng.choice([1, 1, 1, 0, 2])
            args += [rng.choice(TEXTS if rng.random() < 0.5 else VALUES) for _ in range(count)]
    if rng.random() < 0.15:
        args.insert(rng.randint(1, len(args)), rng.choice(VALUES))
    if command.name in ("show", "compare") and "--model" not in args and "-m" not in args and rng.random() < 0.9:
        args += ["--model", "random"]  # the default loads MiniLM
    if "--help" in args:
        args.remove("--help")
    return args


COMMANDS = sorted(typer.main.get_command(app).commands)


@pytest.mark.slow
@pytest.mark.parametrize("name", COMMANDS)
def test_random_arguments_keep_the_contract(workdir, name, request):
    if name == "train":
        request.getfixturevalue("no_training")
    command = typer.main.get_command(app).commands[name]
    rng = random.Random(f"attnkit-{name}")
    for _ in range(40):
        args = random_arguments(command, rng)
        stdin = rng.choice([None, b"", b"one\ntwo\n", b"\xff\xfe\n", "[/] \x1b[31m\n".encode()])
        invoke(args, workdir, stdin)
        for path in workdir.iterdir():  # start the next case from the same folder
            if path.name not in ("sub", "pics.png", "input.txt", "bad.txt", "binary.bin"):
                path.unlink()


# ----------------------------------------------------------------------------- the real entry point


@pytest.mark.slow
def test_the_installed_command_with_bytes_and_pipes(tmp_path):
    """Real argv bytes, a real pipe on stdin, stderr not a terminal: one unwrapped line each."""
    exe = [sys.executable, "-m", "attnkit"]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}

    def run(args, stdin=b""):
        done = subprocess.run(exe + args, input=stdin, capture_output=True, cwd=tmp_path, env=env, timeout=120)
        assert b"Traceback" not in done.stderr and done.stdout == b"", done
        assert done.stderr.count(b"\n") == 1, done.stderr
        return done.returncode, done.stderr.decode()

    assert run([b"embed", b"\xff\xfe"]) == (2, "error: TEXT is not valid UTF-8: byte 0xff at offset 0\n")
    assert run(["embed", "-"], b"\xff\n") == (1, "error: stdin is not valid UTF-8: byte 0xff at offset 0\n")
    long = "a-folder-that-does-not-exist-" * 8 + "/attention.png"
    code, line = run(["show", "hi", "--model", "random", "--png", long])
    assert code == 1 and line == f"error: cannot write --png {long}: folder {long.rsplit('/', 1)[0]!r} does not exist\n"
    assert sorted(os.listdir(tmp_path)) == []


def test_an_error_after_ctrl_c_exits_130_whatever_wrapped_it(monkeypatch, capsys):
    """Ctrl+C that a library turned into an error of its own, keeping only the text
    (pydantic-core's SchemaError when it lands while a validator is built: seen under
    `attnkit serve`), exits 130 without an "internal error" line once the command line has
    recorded the Ctrl+C; the same error without a Ctrl+C stays an internal error."""
    import typer

    from attnkit.cli import _app, _interrupt

    cli = typer.Typer(cls=_app._Group)

    @cli.command()
    def fail() -> None:
        raise ValueError('Error building "model" validator:\n  KeyboardInterrupt: ')

    @cli.command()
    def other() -> None:
        pass

    monkeypatch.setattr(_interrupt, "_received", [])
    for recorded, code in ((False, 1), (True, 130)):
        if recorded:
            _interrupt.note()
        with pytest.raises(SystemExit) as exit_info:
            typer.main.get_command(cli).main(["fail"], prog_name="attnkit")
        assert exit_info.value.code == code
        err = capsys.readouterr().err
        assert ("internal error" in err) is (code == 1), err


def test_ctrl_c_wrapped_while_the_commands_load_exits_130(monkeypatch):
    """Ctrl+C landing while a class is built as `main()` imports the commands (a dataclass
    of rich's: Python wraps the KeyboardInterrupt from `__set_name__` in a RuntimeError,
    seen once in 50 CI runs of the interrupt test as a traceback and exit 1) exits 130; an
    error with no Ctrl+C behind it is not swallowed."""
    import attnkit.cli as cli
    from attnkit.cli import _interrupt

    monkeypatch.setattr(_interrupt, "_received", [])
    monkeypatch.setattr(_interrupt, "install", lambda: None)  # (keep pytest's own SIGINT handler)

    def wrapped():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance '_cells' in 'Column'") from interrupt

    monkeypatch.setattr(cli, "_load_app", wrapped)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 130

    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "_load_app", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main()
