"""Where replies and figures go: reply text to stdout, the live panel (rich) on a terminal.

The panel draws on stderr so that stdout stays clean for pipes. When stdout is the terminal too,
the reply text is routed through the panel's console (on stdout): finished lines print above the
panel, the unfinished line is part of it, so the two never overwrite each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from ftchat.session import Figures, StepRecord
from ftchat.ui.text import plural

# label, backend stats key, format: the offload figures, "-" until the backend reports them
OFFLOAD = (
    ("misses/token", "misses_per_token", "{:.2f}"),
    ("hit rate", "hit_rate", "{:.1%}"),
    ("prefetch copies", "prefetch_copies", "{:,.0f}"),
    ("useful prefetches", "useful_prefetches", "{:,.0f}"),
    ("precision", "precision", "{:.1%}"),
    ("copy GB/s", "copy_gbps", "{:.1f}"),
)


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def figure_rows(f: Figures | None, context: str | None = None) -> list[tuple[str, str]]:
    """(label, value) pairs of everything the panel shows; "-" where unknown."""
    g = f or Figures(0, 0.0, 0, 0.0, 0, 0, 0)
    rows = [
        ("decode tok/s", _num(g.decode_tps)),
        ("prefill tok/s", _num(g.prefill_tps)),
        ("tokens", str(g.tokens) if f else "-"),
        ("context", context or (f"{g.context}/{g.max_context}" if f else "-")),
        ("VRAM used", _gib(g.vram_used)),
        ("VRAM peak", _gib(g.vram_peak)),
    ]
    for label, key, fmt in OFFLOAD:
        rows.append((label, _num(g.offload.get(key), fmt)))
    return rows


def figures_text(f: Figures | None, status: str = "") -> Text:
    """The panel: throughput and memory on one line, offload figures on the next."""
    rows = figure_rows(f)
    text = Text()
    for i, (label, value) in enumerate(rows):
        sep = "" if i == 0 else "\n" if i == 6 else "   "
        text.append(sep + label + " ", style="dim")
        text.append(value, style="bold")
    if status:
        text.append("\n" + status, style="cyan")
    return text


def timing_line(prefill_s: float, prefill_tokens: int, decode_s: float, decode_tokens: int,
                offload: dict | None = None) -> str:
    """llama-cli style timing: prompt eval (prefill), then eval (decode steps)."""
    def rate(n: int, s: float) -> str:
        return _num(n / s if s > 0 else None)

    offload = offload or {}
    return (f"prompt eval {prefill_s * 1e3:.1f} ms / {plural(prefill_tokens, 'token')} "
            f"({rate(prefill_tokens, prefill_s)} tok/s) | eval {decode_s * 1e3:.1f} ms / "
            f"{plural(decode_tokens, 'run')} ({rate(decode_tokens, decode_s)} tok/s) | misses/token "
            f"{_num(offload.get('misses_per_token'), '{:.2f}')} | hit rate "
            f"{_num(offload.get('hit_rate'), '{:.1%}')}")


def summary_line(rec: StepRecord) -> str:
    """The timing line after a chat reply."""
    f = rec.figures
    return (f"{plural(rec.n, 'token')}, context {f.context}/{f.max_context} | "
            + timing_line(f.prefill_s, f.prefill_tokens, f.decode_s, f.decode_tokens, f.offload))


class PlainWriter:
    """No panel: text straight to the stream."""

    def __init__(self, out: TextIO):
        self.out = out

    def write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    def show(self, figures: Figures | None, status: str = "") -> None:
        pass


class PanelWriter:
    """A rich Live panel; text either goes to `out` or, when `out` is None, through the panel."""

    def __init__(self, console: Console, out: TextIO | None):
        self.console, self.out = console, out
        self.line = ""  # the unfinished line of text, drawn inside the panel
        self.figures: Figures | None = None
        self.status = ""
        self.live = Live(console=console, refresh_per_second=10, transient=True,
                         redirect_stdout=False, redirect_stderr=False,
                         get_renderable=self._render)

    def _render(self) -> Group:
        return Group(Text(self.line), figures_text(self.figures, self.status))

    def write(self, text: str) -> None:
        if not text:
            return
        if self.out is not None:
            self.out.write(text)
            self.out.flush()
            return
        done, newline, self.line = (self.line + text).rpartition("\n")
        if newline:
            self.console.print(Text(done), soft_wrap=True)  # above the panel, for good

    def show(self, figures: Figures | None, status: str = "") -> None:
        self.figures, self.status = figures, status


class Screen:
    """The terminal or pipes a run writes to, and whether it shows the live panel."""

    def __init__(self, out: TextIO, err: TextIO, panel: bool | None):
        self.out, self.err = out, err
        self.panel = isatty(err) if panel is None else panel

    def note(self, line: str) -> None:
        """A status line on stderr (banner, timing summary, notices)."""
        self.err.write(line + "\n")
        self.err.flush()

    @contextmanager
    def live(self) -> Iterator[PlainWriter | PanelWriter]:
        """A writer for one reply (chat) or one run (batch); the panel lives as long as it."""
        if not self.panel:
            yield PlainWriter(self.out)
            return
        through = isatty(self.out)  # the same screen: draw where the text goes
        console = Console(file=self.out if through else self.err, highlight=False)
        w = PanelWriter(console, None if through else self.out)
        try:
            with w.live:
                yield w
        finally:
            if w.line:  # the unfinished last line stays on screen once the panel is gone
                console.print(Text(w.line), end="", soft_wrap=True)
                console.file.flush()


def isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
