"""Files a command writes: checked before the work starts, written whole or not at all.

A command names every file it will write before it does anything else
(`plan`): the name must end in the option's suffix (`--png out` is refused,
not silently renamed), its folder must exist and take a new file, and the name
must not be a folder. After the work, `write_all` writes each file to a hidden
temporary file in the same folder and renames them all into place at the end;
the command then reports exactly the names it wrote. On any failure, before or
during writing, nothing new is left behind.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from attnkit.cli._app import fail, usage


@dataclass(frozen=True)
class Output:
    """One file to write: the option that named it, the name as given, and where it lands."""

    option: str
    path: Path  # as the user wrote it: what the command reports
    target: Path  # the file that is replaced (a symlink's target, when the name is a link)


def _why(error: OSError) -> str:
    return (error.strerror or str(error)).lower()


def plan(option: str, name: str | os.PathLike, suffixes: Sequence[str]) -> Output:
    """Check that `name` can be written as `option`'s file; exit with the reason if not.

    Arguments:
        option: the option that named the file, for messages ('--png').
        name: the file name as given.
        suffixes: the accepted suffixes, first preferred ('.png'); compared
            without regard to case.
    """
    text = os.fspath(name)
    path = Path(text)
    if not text or text.endswith(("/", os.sep)) or path.suffix.lower() not in suffixes:
        usage(f"expected {option} to name a {' or '.join(suffixes)} file, got {text!r}")
    if "\0" in text:
        usage(f"expected {option} to name a file, got a name with a NUL character: {text!r}")
    try:
        return _check_folder(option, text, path, suffixes[0])
    except OSError as error:  # a name too long, a loop of links, ...
        fail(f"cannot write {option} {text}: {_why(error)}")


def _check_folder(option: str, text: str, path: Path, suffix: str) -> Output:
    if path.is_dir():
        fail(f"cannot write {option} {text}: it is a folder; give a file name such as "
             f"{path / ('attention' + suffix)}")
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    folder = target.parent
    if not folder.exists():
        fail(f"cannot write {option} {text}: folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        fail(f"cannot write {option} {text}: {str(folder)!r} is not a folder")
    if target.exists() and not os.access(target, os.W_OK):
        fail(f"cannot write {option} {text}: the file is read-only")
    # The only sure test that a new file can go there (permissions, read-only disks).
    handle, probe = tempfile.mkstemp(dir=folder, prefix=".attnkit-", suffix=".probe")
    os.close(handle)
    os.unlink(probe)
    return Output(option, path, target)


def beside(output: Output, name: str) -> Output:
    """A second file in the same folder as `output` (for example FILE-grid.png), checked like it."""
    return plan(output.option, output.path.with_name(name), (Path(name).suffix.lower(),))


def _new_file_mode(target: Path) -> int:
    """The mode the file would get from a plain open(): kept when replacing, else 0o666 less umask."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_all(jobs: Sequence[tuple[Output, Callable[[Path], Any]]]) -> list[Any]:
    """Write every file, or none: each `write(temporary_path)` fills a temporary file in the
    target's folder (its name has the target's suffix, for writers that look at it); when
    all succeeded, all are renamed into place.

    Returns:
        What each write returned, in order. On an OSError the temporary files are removed
        and the command exits with the reason; other exceptions propagate after the cleanup.
    """
    temporaries: list[str] = []
    results = []
    try:
        for output, write in jobs:
            current = output
            handle, temporary = tempfile.mkstemp(
                dir=output.target.parent, prefix=".attnkit-", suffix=".tmp" + output.target.suffix
            )
            os.close(handle)
            temporaries.append(temporary)
            results.append(write(Path(temporary)))
            os.chmod(temporary, _new_file_mode(output.target))
        for (output, _), temporary in zip(jobs, temporaries):
            current = output
            os.replace(temporary, output.target)
        temporaries.clear()
    except OSError as error:
        fail(f"cannot write {current.option} {current.path}: {_why(error)}")
    finally:
        for temporary in temporaries:
            try:
                os.unlink(temporary)
            except OSError:
                pass
    return results
