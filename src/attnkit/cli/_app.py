"""The Typer application every command module registers on, and the CLI's one error policy.

Command modules import heavy dependencies (torch, matplotlib, transformers,
web frameworks) inside the command functions, never at module level, so that
`attnkit --help` stays fast.

Errors (docs/conventions.md, "The command line"): a failing command prints one
line on stderr, `error: ...`, and nothing else; it never shows a traceback.

- exit 2, a usage error: the command line itself is wrong, as one can tell from
  it and `--help` alone: an unknown option, a missing argument, a value of the
  wrong type or outside its documented range, options that exclude each other,
  text arguments that are not UTF-8 (click's usage errors are reformatted to
  the same one line);
- exit 1, a user error: the command line is well formed but the world refuses
  it: a missing file or folder, a model that is not installed, a layer the
  model does not have, input on stdin that is not UTF-8, a port in use, an
  optional package not installed (`MissingExtraError`: the message names the
  pip extra to install, e.g. `pip install 'attnkit[png]'`).

Anything else that escapes a command is a bug; it is still reported in one
line (`error: internal error: ...`), with exit code 1.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from attnkit.cli import _interrupt
from attnkit.extras import MissingExtraError
from attnkit.viz.text import printable, utf8_problem

try:  # typer >= 0.22 carries its own copy of click
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - older typer on click
    from click import exceptions as _click_errors

# Never markup in what users wrote, never emoji codes. Messages (`print_error`, `warn`,
# `note`, `say`) are soft-wrapped: a line is never broken in the middle of a path or a
# command to copy, whatever the width of the terminal, a pipe or a log (rich would
# otherwise wrap at 80 columns when the output is not a terminal).
class _Stdout:
    """sys.stdout as it is at each write (tests swap it), remembering whether the last text
    written ended a line: a note on stderr then starts on its own line (`_own_line`) instead
    of landing after streamed text when both reach one terminal (`generate ... | cat`)."""

    mid_line = False

    def write(self, text: str) -> int:
        if text:
            _Stdout.mid_line = not text.endswith("\n")
        return sys.stdout.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.stdout, name)


console = Console(file=_Stdout(), highlight=False, emoji=False)
err_console = Console(stderr=True, highlight=False, emoji=False)


def _own_line() -> None:
    """Before a line on stderr: if stdout was left in the middle of a line, flush it and
    end that line on stderr, so the message starts a line of its own."""
    if _Stdout.mid_line:
        _Stdout.mid_line = False
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        err_console.file.write("\n")

USAGE = 2
"""Exit code of a usage error (the command line is wrong), as click uses."""
USER = 1
"""Exit code of a user error (a file, model, input or the system refused)."""


def print_error(message: str) -> None:
    """`error: message` as one line on stderr: control characters escaped, never wrapped."""
    line = Text("error:", style="bold red")
    line.append(" " + printable(message))
    _own_line()
    err_console.print(line, soft_wrap=True)


def warn(message: str) -> None:
    """`warning: message` as one line on stderr."""
    line = Text("warning:", style="yellow")
    line.append(" " + printable(message))
    _own_line()
    err_console.print(line, soft_wrap=True)


def note(message: str, *, style: str = "dim") -> None:
    """A one-line message on stderr (status, hints, timings): plain text, never wrapped, on a
    line of its own."""
    _own_line()
    err_console.print(Text(printable(message), style=style), soft_wrap=True)


def say(message: str, *, style: str = "") -> None:
    """A line on stdout that must stay whole (a file written, an address to open):
    plain text, control characters escaped, never wrapped."""
    console.print(Text(printable(message), style=style), soft_wrap=True)


def use_color(no_color: bool = False) -> bool:
    """Whether views draw with colour: the one terminal-capability check of every command.

    Colour needs stdout to be a terminal that shows 256 colours or more, no `NO_COLOR` in
    the environment, and no `--no-color`. Otherwise views fall back to the shades ' ░▒▓█',
    which survive `| less`, a file or a log (colour cells would be blank there).
    """
    return not no_color and not console.no_color and console.color_system in ("truecolor", "256")


def fail(message: str, code: int = USER) -> NoReturn:
    """Print `error: message` (plain text, never markup) and exit with `code`."""
    print_error(message)
    raise typer.Exit(code)


def usage(message: str) -> NoReturn:
    """A usage error: the command line is wrong (exit 2)."""
    fail(message, USAGE)


# ----------------------------------------------------------------------------- checks where arguments enter


def check_int(option: str, value: int | None, low: int | None = None, high: int | None = None,
              why: str = "") -> None:
    """Usage error unless low <= value <= high (None: no bound); `why` names the limit."""
    if value is None:
        return
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            expected = f"{option} >= {low}"
        elif low is None:
            expected = f"{option} <= {high}"
        else:
            expected = f"{option} in {low}..{high}"
        usage(f"expected {expected}{f' ({why})' if why else ''}, got {value}")


def check_float(option: str, value: float | None, low: float, high: float, *,
                low_open: bool = False) -> None:
    """Usage error unless `value` is finite and in [low, high] ((low, high] with low_open)."""
    if value is None:
        return
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        bracket = "(" if low_open else "["
        usage(f"expected a finite {option} in {bracket}{low:g}, {high:g}], got {value}")


def check_text(name: str, value: str | None) -> None:
    """Usage error when a text argument is not UTF-8 (it came from the shell as bytes)."""
    if value is None:
        return
    problem = utf8_problem(value)
    if problem:
        usage(f"{name} is not valid UTF-8: {problem}")


# ----------------------------------------------------------------------------- the application


def _usage_line(error: Any) -> str:
    """click's usage error as one line: the message, then where to find help."""
    message = error.format_message().strip().rstrip(".")
    message = message[:1].lower() + message[1:]
    ctx = getattr(error, "ctx", None)
    if ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


class _TidyHelp:
    """The help option of a command or group, tidied like its other parameters."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            _tidy_param(self, option)
        return option


class _Group(_TidyHelp, TyperGroup):
    """attnkit's command group: every failure ends as one `error:` line and an exit code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            _tidy_param(self, param)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except getattr(_click_errors, "NoArgsIsHelpError", ()) as error:
            help_text = error.format_message()  # `attnkit` alone: the help (rich prints it itself)
            if help_text.strip():
                console.out(help_text, highlight=False)
            code = USAGE
        except _click_errors.UsageError as error:
            print_error(_usage_line(error))
            code = USAGE
        except _click_errors.ClickException as error:
            print_error(error.format_message())
            code = error.exit_code
        except (typer.Abort, EOFError):
            print_error("aborted")
            code = USER
        except KeyboardInterrupt:
            code = 130
        except MemoryError:
            print_error("out of memory; try smaller sizes")
            code = USER
        except MissingExtraError as error:  # an optional package: the message says which extra
            print_error(str(error))
            code = USER
        except Exception as error:
            if _interrupt.caused(error):  # Ctrl+C, wrapped by Python or by a library (see there)
                code = 130
            else:  # a bug in attnkit: still one line, never a traceback
                print_error(f"internal error: {type(error).__name__}: {error} (please report it)")
                code = USER
        sys.exit(code if isinstance(code, int) else 0)


class _Command(_TidyHelp, TyperCommand):
    """A command whose help reads as written: click-style usage (`TEXT`, `[TEXTS]...`),
    argument names in capitals, no type tag on flags, and help text never read as markup
    (`[min-half-len, half-len]` stays as it is)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = _plain_help(self, self.help)
        for param in self.params:
            _tidy_param(self, param)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if _is_argument(param):
                name = param.metavar or (param.name or "").upper()
                name = name if param.required else f"[{name}]"
                pieces.append(name + ("..." if param.nargs != 1 else ""))
        return pieces


def _is_argument(param: Any) -> bool:
    return getattr(param, "param_type_name", "") == "argument"


def _markup_help(command: Any) -> bool:
    return getattr(typer.core, "HAS_RICH", True) and getattr(command, "rich_markup_mode", None) == "rich"


def _plain_help(command: Any, text: str | None) -> str | None:
    """Help text as it was written: when typer renders help as rich markup, brackets are escaped."""
    if not text or not _markup_help(command):
        return text
    from rich.markup import escape

    return escape(text)


def _tidy_param(command: Any, param: Any) -> None:
    if getattr(param, "_attnkit_tidy", False):
        return
    param._attnkit_tidy = True
    param.help = _plain_help(command, getattr(param, "help", None))
    if _is_argument(param):
        if param.metavar is None:
            param.metavar = (param.name or "").upper()  # `TEXT`, as click writes arguments
        param.display_type_rich = lambda ctx: None  # the name says it; no `<list[str]>`
    elif getattr(param, "is_flag", False) and param.metavar is None:
        param.metavar = ""  # a flag takes no value: no `<bool>` beside it


class _Typer(typer.Typer):
    """Typer whose commands are `_Command`s (see there)."""

    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _Typer(
    name="attnkit",
    cls=_Group,
    help="Attention from first principles to production. Everything runs on this machine: attnkit never "
    "downloads a model (`attnkit models` lists those it can load).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from attnkit import __version__

        console.print(f"attnkit {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", "-V", is_eager=True, callback=_print_version, help="Print attnkit's version and exit."
    ),
) -> None:
    """Attention from first principles to production."""
    # rich reads $COLUMNS once, when a console is made; the consoles live as long as the
    # process (tests and notebooks call the app many times), so each call measures anew
    for each in (console, err_console):
        each.width = None
    _check_environment()


def _check_environment() -> None:
    """The environment's settings, checked before any command starts its work: a wrong
    value is the user's to fix, a usage error (exit 2), never an internal error found
    halfway through (the library reads ATTNKIT_KERNELS only when the kernels start)."""
    from attnkit import kernels  # (light: numba is not imported here)

    try:
        kernels.setting()
    except ValueError as error:
        usage(str(error))


@app.command()
def version() -> None:
    """Print attnkit's version."""
    from attnkit import __version__

    console.print(f"attnkit {__version__}")
