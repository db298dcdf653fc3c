"""The consoles and tables every command prints with, so that no cell is ever cut.

rich fits a table to the terminal and cuts what does not fit with "…": a device name read as
"llvmp…" is useless, and so is one cut in a pipe or a log, where there is no width to fit. So
tables fold long cells onto more lines, and output that is not a terminal is laid out at the
width its content needs (a file, `| cat` or `| grep` gets every cell whole, on one line).
"""

from __future__ import annotations

import rich.table
from rich.console import Console

UNBOUNDED = 1 << 16  # columns: wider than any table zdsl prints, so none is narrowed


def make_console(*, stderr: bool = False) -> Console:
    """A console for stdout (or stderr): the terminal's width, or unbounded when not a terminal."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=UNBOUNDED)


class Table(rich.table.Table):
    """A rich Table whose columns fold long cells (and headers) onto more lines instead of
    cutting them with "…"."""

    def add_column(self, *args, overflow: str = "fold", **kwargs) -> None:
        super().add_column(*args, overflow=overflow, **kwargs)
