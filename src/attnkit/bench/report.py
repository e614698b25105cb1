"""What a benchmark suite returns (`BenchReport`) and how it reports headway (`Progress`).

Suites import these from here; `attnkit.bench` re-exports them and lists the
suites by name, so a suite never imports the package that names it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

__all__ = ["BenchReport", "NullProgress", "Progress"]


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
    """What a suite measured, ready to render as one table."""

    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"row {i} has {len(row)} values for {len(self.columns)} columns")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
