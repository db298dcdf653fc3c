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


class Stages:
    """Long work in counted stages, shown as it goes: a progress bar on a terminal, else one line
    per stage when it ends (a log or a pipe sees each stage, not only the total at the end)."""

    def __init__(self, show: bool, say=None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.say = say if show and not self.console.is_terminal else None
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            transient=True, console=self.console, disable=not (show and self.console.is_terminal))

    def __enter__(self) -> "Stages":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def __call__(self, what: str, total: int, work, done: str = "done"):
        """work(advance) for a stage of `total` steps; `done(result)` words the stage's line, said
        where the result is something (a stage that found all its work done says nothing)."""
        import time

        task = self.bar.add_task(what, total=total)
        start = time.perf_counter()
        result = work(lambda n=1: self.bar.advance(task, n))
        self.bar.remove_task(task)
        if self.say and result:
            self.say(f"{what}: {done(result) if callable(done) else done} in {time.perf_counter() - start:.1f} s")
        return result
