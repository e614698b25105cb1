"""Docs that run: every ```python block in README.md and docs/*.md is executed, and every
`attnkit ...` line of a ```bash block is parsed by the real command line.

The blocks of one file run in order in one namespace (a later block may use what an earlier
one defined, as a reader would), in a fresh working folder, with the embedded models and
torch installed. A block that only illustrates (output, a sketch) is skipped when the line
right before its fence says why:

    <!-- not-run: the output of the block above -->

(README.md, "Documentation"). Use it sparingly: everything else must run.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(\S.*?)\s*-->\s*$")


def blocks(path: Path, language: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, reason it is not run or None) of every block of `language`."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) != language:
            continue
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(before)
        found.append((line, match.group(2), skip.group(1) if skip else None))
    return found


def test_the_marker_is_found_and_blocks_are_extracted(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("x\n```python\na = 1\n```\n<!-- not-run: output only -->\n```python\nboom(\n```\n"
                    "```bash\nattnkit show hi  # a comment\n```\n", encoding="utf-8")
    assert blocks(page, "python") == [(2, "a = 1\n", None), (6, "boom(\n", "output only")]
    assert blocks(page, "bash") == [(9, "attnkit show hi  # a comment\n", None)]


def test_every_documented_file_has_its_blocks_found():
    """A typo in a fence (```pyhton) would silently drop a block: every fence is a known language."""
    known = {"python", "bash", "text", "", "console"}
    for path in FILES:
        languages = {m.group(1) for m in FENCE.finditer(path.read_text(encoding="utf-8"))}
        assert languages <= known, f"{path.name}: unknown code block languages {languages - known}"


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in FILES if blocks(p, "python")], ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path, monkeypatch, capsys, minilm_folder, smollm2_file, torch):
    """Each block runs; what the blocks print holds no special token (`<|im_end|>` is not text)."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    ran = 0
    for line, code, skip in blocks(path, "python"):
        if skip:
            continue
        start = time.perf_counter()
        try:
            exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
        except Exception as error:  # name the block, as a reader would find it
            pytest.fail(f"{path.relative_to(ROOT)}, the block at line {line}: {type(error).__name__}: {error}",
                        pytrace=False)
        printed = capsys.readouterr().out
        assert "<|" not in printed, f"{path.name}, the block at line {line} printed a special token: {printed!r}"
        with capsys.disabled():
            print(f"\n{path.name}:{line} ran in {time.perf_counter() - start:.1f} s", end="")
        ran += 1
    assert ran, f"{path.name}: every python block is marked not-run"


def command_lines(path: Path) -> list[tuple[int, list[str]]]:
    """Every `attnkit ...` command in the shell blocks of `path`, without comments."""
    found = []
    for line, code, skip in blocks(path, "bash"):
        if skip:
            continue
        for offset, text in enumerate(code.splitlines()):
            for part in re.split(r"&&|\|", text):
                words = shlex.split(part, comments=True)
                if words[:1] == ["attnkit"]:
                    found.append((line + 1 + offset, words[1:]))
    return found


@pytest.mark.parametrize("path", [p for p in FILES if command_lines(p)], ids=lambda p: p.name)
def test_documented_commands_parse(path):
    """Each documented command exists and takes the options it is shown with (parsed, not run)."""
    from attnkit.cli import app
    import typer.main

    group = typer.main.get_command(app)
    for line, args in command_lines(path):
        where = f"{path.relative_to(ROOT)}:{line}: attnkit {shlex.join(args)}"
        if not args or args[0].startswith("-"):
            continue
        command = group.get_command(None, args[0])
        assert command is not None, f"{where}: no such command"
        try:
            command.make_context(f"attnkit {args[0]}", args[1:])
        except Exception as error:
            if type(error).__name__ != "Exit":  # --help and --version end parsing early
                pytest.fail(f"{where}: {type(error).__name__}: {error}", pytrace=False)
