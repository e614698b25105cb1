"""The Typer application every command module registers on.

Command modules import heavy dependencies (torch, matplotlib, transformers,
web frameworks) inside the command functions, never at module level, so that
`attnkit --help` stays fast.
"""

from __future__ import annotations

import typer
from rich.console import Console

app = typer.Typer(
    name="attnkit",
    help="Attention from first principles to production.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def fail(message: str, code: int = 2) -> None:
    """Print a user-facing error and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print attnkit's version."""
    from attnkit import __version__

    console.print(f"attnkit {__version__}")
