"""Progress bars (rich, on stderr, only on a terminal) for loading and writing checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)


@contextmanager
def progress_bar(err: TextIO | None, label: str) -> Iterator[Callable[[str, int, int], None]]:
    """Yields a callback (stage, done, total) that draws one bar per stage (none if `err` is
    None: --quiet)."""
    console = Console(file=err) if err is not None else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True,
                  disable=console is None or not console.is_terminal
                  or console.is_dumb_terminal) as bars:  # TERM=dumb: no erasing, a blank line
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(f"{label} {stage}", total=total)
            bars.update(tasks[stage], completed=done, total=total)

        yield update
