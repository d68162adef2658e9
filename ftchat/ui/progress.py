"""Progress bars (rich, on stderr, only on a terminal) for loading and writing checkpoints, and
the chat's prefill line."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)


def _drawn(console: Console | None) -> bool:
    """A live line only on a real terminal (TERM=dumb: no erasing, it would leave blank lines)."""
    return console is not None and console.is_terminal and not console.is_dumb_terminal


@contextmanager
def progress_bar(err: TextIO | None, label: str) -> Iterator[Callable[[str, int, int], None]]:
    """Yields a callback (stage, done, total) that draws one bar per stage (none if `err` is
    None: --quiet)."""
    console = Console(file=err) if err is not None else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True,
                  disable=not _drawn(console)) as bars:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(f"{label} {stage}", total=total)
            bars.update(tasks[stage], completed=done, total=total)

        yield update


def _eta(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def prefill_text(done: int, total: int, elapsed_s: float) -> str:
    """`done/total tokens  N tok/s  ETA T` (rate and ETA so far; "-" before any time passed)."""
    tps = done / elapsed_s if done and elapsed_s > 0 else None
    rate = "-" if tps is None else f"{tps:,.0f}"
    eta = "-" if tps is None else _eta((total - done) / tps)
    return f"{done:,}/{total:,} tokens  {rate} tok/s  ETA {eta}"


class PrefillProgress:
    """engine.decode's `on_prefill(done, total)`: a transient line while a prompt of more than
    one chunk prefills, gone before the reply streams. Draws only on a terminal: nothing for
    None (--quiet), a pipe or TERM=dumb. Also a context manager that erases the line on exit
    (an interrupted prefill)."""

    def __init__(self, console: Console | None):
        self.console = console
        self.bar: Progress | None = None
        self.task = 0
        self.t0 = time.perf_counter()

    @classmethod
    def on(cls, err: TextIO | None) -> PrefillProgress:
        return cls(Console(file=err, highlight=False) if err is not None else None)

    @property
    def callback(self) -> PrefillProgress | None:
        """self where it can draw, else None: no reports asked (nor the device waits for them)."""
        return self if _drawn(self.console) else None

    def __call__(self, done: int, total: int) -> None:
        if done == 0:
            self.t0 = time.perf_counter()  # the prefill starts now
        if done >= total:
            self.close()  # a one-chunk prompt never draws: its first report is its last
            return
        if done == 0 or not _drawn(self.console):
            return
        info = prefill_text(done, total, time.perf_counter() - self.t0)
        if self.bar is None:
            # auto_refresh off: the line changes once per chunk, refreshed here (no thread)
            self.bar = Progress(TextColumn("prefill"), BarColumn(),
                                TextColumn("{task.fields[info]}"), console=self.console,
                                transient=True, auto_refresh=False,
                                redirect_stdout=False, redirect_stderr=False)
            self.bar.start()
            self.task = self.bar.add_task("prefill", total=total, info=info)
        self.bar.update(self.task, completed=done, total=total, info=info)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()  # transient: the line is erased
            self.bar = None

    def __enter__(self) -> PrefillProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
