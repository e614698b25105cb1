"""Packaging promises: light imports, a working console script."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "matplotlib", "fastapi", "uvicorn", "starlette", "transformers", "flask")


def _imported_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_import_attnkit_stays_light():
    loaded = _imported_after("import attnkit, attnkit.nn, attnkit.masks, attnkit.functional")
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, f"import attnkit pulled in {heavy}"


def test_cli_help_stays_light_and_lists_commands():
    loaded = _imported_after(
        "import sys; sys.argv=['attnkit','--help']\n"
        "from attnkit.cli import app\n"
        "try:\n    app()\nexcept SystemExit:\n    pass"
    )
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, f"attnkit --help pulled in {heavy}"
    help_text = subprocess.run(
        [sys.executable, "-m", "attnkit", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("demo", "walkthrough"):
        assert command in help_text
