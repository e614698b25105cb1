"""Tables that fit the width they are printed at, every cell whole.

A terminal is as wide as it is; a pipe or a file is as wide as rich says
(80 columns, or `$COLUMNS`). A table wider than that is not squeezed until its
cells read `sente… to… b…`: its columns go on in blocks printed one under the
other, each block repeating the key columns that say what a row is (as pandas
prints a wide frame). A header wider than its values wraps at its spaces
first. Where not even one column fits beside the keys, each row is printed as
a record, one `column  value` line per cell (psql's expanded display), values
wrapped at spaces.
The JSON a command writes (`--json`) is the form for programs.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

from rich import box as boxes
from rich.cells import cell_len
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

Cell = Union[str, Text]


def _text(value) -> Text:
    return value.copy() if isinstance(value, Text) else Text(str(value))


def _longest_word(text: str) -> int:
    return max((cell_len(word) for word in text.split()), default=0)


class FittedTable:
    """A rich renderable: a table whose columns go on in blocks when they do not fit.

    Arguments:
        columns: the header of each column.
        rows: one sequence of cells per row (str or rich Text, never markup), as many as columns.
        title: a line above the table (wrapped at words when narrow).
        keys: how many leading columns say what a row is; each block repeats them.
        justify: "left" or "right" per column (default: left).
        box: a rich box (default: a line under the header).
        header_style: the style of the headers.
        title_style: the style of the title line.
        show_header: print the header line (a table of numbers labelled by its first
            column may go without).
    """

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[Cell]], *, title: str | None = None,
                 keys: int = 1, justify: Sequence[str] | None = None, box=boxes.SIMPLE_HEAD,
                 header_style: str = "bold", title_style: str = "bold", show_header: bool = True) -> None:
        self.columns = [str(c) for c in columns]
        self.rows = [[_text(cell) for cell in row] for row in rows]
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"expected {len(self.columns)} cells in row {i} like the columns, got {len(row)}")
        self.title = title
        self.keys = max(0, min(keys, len(self.columns) - 1))
        self.justify = list(justify) if justify is not None else ["left"] * len(self.columns)
        self.box = box
        self.header_style = header_style
        self.title_style = title_style
        self.show_header = show_header

    def _cells_width(self, j: int) -> int:
        return max((row[j].cell_len for row in self.rows), default=0)

    def _widest(self) -> list[Text]:
        """One row holding each column's widest cell: a table of it measures as wide as the
        whole table (every column is as wide as its widest cell), at a cost that does not
        grow with the rows."""
        def width(cell: Text) -> int:
            return max((cell_len(line) for line in cell.plain.split("\n")), default=0)

        return [max((row[j] for row in self.rows), key=width, default=Text("")) for j in range(len(self.columns))]

    def _table(self, indices: Sequence[int], widths: dict[int, int] | None,
               rows: Sequence[Sequence[Text]] | None = None) -> Table:
        """The columns `indices` of `rows` (default: all rows); `widths` fixes a column's width
        (its header wraps at spaces)."""
        table = Table(box=self.box, header_style=self.header_style, show_edge=False, pad_edge=False,
                      padding=(0, 1), show_header=self.show_header)
        for j in indices:
            width = None if widths is None else widths.get(j)
            table.add_column(Text(self.columns[j]), justify=self.justify[j], width=width,
                             no_wrap=width is None, overflow="fold")
        for row in self.rows if rows is None else rows:
            table.add_row(*(row[j] for j in indices))
        return table

    def blocks(self, console, options) -> list[Table]:
        """The tables to print at `options.max_width`: one when everything fits, else blocks."""
        width = options.max_width
        widest = [self._widest()]

        def fits(indices: Sequence[int], widths: dict[int, int] | None) -> bool:
            """Whether the columns `indices` fit the width (measured on the widest cells only)."""
            table = self._table(indices, widths, widest)
            return Measurement.get(console, options.update(width=10**6), table).maximum <= width

        everything = range(len(self.columns))
        if fits(everything, None):
            return [self._table(everything, None)]
        # headers wrapped at their spaces: a column is as wide as its widest cell or header word
        narrow = {j: max(self._cells_width(j), _longest_word(self.columns[j]), 1) for j in everything}
        if fits(everything, narrow):
            return [self._table(everything, narrow)]
        keys = list(range(self.keys))
        blocks: list[list[int]] = []
        current: list[int] = []
        for j in range(self.keys, len(self.columns)):
            if not fits(keys + [j], narrow):  # not even one column beside the keys
                return [self._records(width)]
            if current and not fits(keys + current + [j], narrow):
                blocks.append(current)
                current = []
            current.append(j)
        blocks.append(current)
        if len(blocks) > 1:  # as many blocks, of even size where they fit: 6 columns as 3 + 3, not 4 + 2
            rest = [j for block in blocks for j in block]
            size = math.ceil(len(rest) / len(blocks))
            even = [rest[i:i + size] for i in range(0, len(rest), size)]
            if len(even) == len(blocks) and all(fits(keys + block, narrow) for block in even):
                blocks = even
        # headers whole where the block allows
        return [self._table(keys + block, None if fits(keys + block, None) else narrow) for block in blocks]

    def _records(self, width: int) -> Table:
        """Each row as a record, one `column  value` line per cell, records apart by a blank
        line (like psql's expanded display): for widths where no block fits. Values wrap at
        spaces."""
        names = max(cell_len(name) for name in self.columns)
        table = Table(box=None, show_header=False, show_edge=False, pad_edge=False, padding=(0, 1))
        table.add_column(justify="left", no_wrap=True, style=self.header_style,
                         max_width=max(1, min(names, width // 2)), overflow="fold")
        table.add_column(justify="left", overflow="fold")
        for i, row in enumerate(self.rows):
            if i:
                table.add_row("", "")
            for name, value in zip(self.columns, row):
                table.add_row(Text(name), value)
        return table

    def __rich_console__(self, console, options):
        if self.title:
            yield Text(self.title, style=self.title_style)
        for i, table in enumerate(self.blocks(console, options)):
            if i:
                yield Text("")
            yield table

    def __rich_measure__(self, console, options):
        return Measurement(1, options.max_width)


def fitted_table(columns: Sequence[str], rows: Sequence[Sequence[Cell]], **options) -> FittedTable:
    """A table that fits the width it is printed at (see `FittedTable` for the arguments).

    Returns:
        A rich renderable: print it with a rich console; at a width where all columns do
        not fit, they go on in blocks one under the other, each repeating the key columns,
        and no cell is ever cut into '…'.
    """
    return FittedTable(columns, rows, **options)


__all__ = ["FittedTable", "fitted_table"]
