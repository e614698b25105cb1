"""What a benchmark suite returns (`BenchReport`) and how it reports headway (`Progress`).

Suites import these from here; `attnkit.bench` re-exports them and lists the
suites by name, so a suite never imports the package that names it.

Results and goals are apart. The notes say what was measured and how to read
it; goal lines compare a number with a target the project set itself
(`PASS forward vs torch SDPA at L=2048: 0.93x (goal >= 0.80x)`), which is for
the people who work on attnkit, not for a user's first run: `attnkit bench`
shows them only with `--goals`. A suite gives its goal lines in `goals`; a goal
line left among the notes is still recognised (`is_goal_line`), and a result
note's trailing `(goal ...)` is dropped from what a user reads.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

__all__ = ["BenchReport", "NullProgress", "Progress", "goal_failed", "is_goal_line", "without_goal"]

_VERDICT = re.compile(r"^\s*(PASS|FAIL|MISS|N/A|info)\b")
_GOAL = re.compile(r"\bgoals?\b", re.IGNORECASE)
_TRAILING_GOAL = re.compile(r"\s*\([^()]*\bgoal\b[^()]*\)\s*$", re.IGNORECASE)
_FAILED = re.compile(r"\b(FAIL|FAILED|MISS|NOT met)\b")


def without_goal(line: str) -> str:
    """`line` without a trailing parenthesis that states a goal:
    "agree within 3e-07 (goal 1e-6)" -> "agree within 3e-07"."""
    return _TRAILING_GOAL.sub("", line)


def is_goal_line(line: str) -> bool:
    """Whether a note is about a goal: it opens with a verdict (PASS, FAIL, MISS, N/A,
    info) or names a goal outside a trailing parenthesis."""
    return bool(_VERDICT.match(line) or _GOAL.search(without_goal(line)))


def goal_failed(line: str) -> bool:
    """Whether a goal line says the goal was not met (FAIL, MISS, NOT met)."""
    return bool(_FAILED.search(line))


class Progress(Protocol):
    def total(self, n: int) -> None: ...

    def step(self, description: str) -> None: ...


class NullProgress:
    """A Progress that reports nowhere."""

    def total(self, n: int) -> None:
        pass

    def step(self, description: str) -> None:
        pass


@dataclass
class BenchReport:
    """What a suite measured, ready to render as one table.

    Arguments:
        title: one line above the table.
        columns: the column names.
        rows: one list of plain values per row, as many as columns (None shows as "-").
        notes: short lines under the table: what was measured, how to read it.
        raw: everything measured, JSON-serializable.
        goals: lines that check a number against a target the project set
            ("FAIL causal / full forward time at L=1024: 0.71x (goal <= 0.60x)"),
            shown only when asked for (`attnkit bench --goals`).
    """

    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    goals: list[str] = field(default_factory=list)

    def __post_init__(self):
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"row {i} has {len(row)} values for {len(self.columns)} columns")

    def findings(self) -> list[str]:
        """The notes a user reads: goal lines left out, trailing "(goal ...)" dropped."""
        return [without_goal(note) for note in self.notes if not is_goal_line(note)]

    def goal_lines(self) -> list[str]:
        """Every line that checks a goal: notes about one (whole), then `goals`."""
        about_goals = [note for note in self.notes if is_goal_line(note) or without_goal(note) != note]
        return about_goals + list(self.goals)

    def failed_goals(self) -> list[str]:
        """The goal lines that say a goal was not met."""
        return [line for line in self.goal_lines() if goal_failed(line)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
