"""Where replies and figures go: reply text to stdout, the live panel (rich) on a terminal.

The panel draws on stderr so that stdout stays clean for pipes. When stdout is the terminal too,
the reply text is routed through the panel's console (on stdout): finished lines print above the
panel, the unfinished line is part of it, so the two never overwrite each other.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator, Mapping
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
    """(label, value) pairs of what applies: throughput, tokens and context always ("-" until
    known); VRAM on CUDA only; an offload figure when the expert backend reports it (a resident
    backend on the CPU reports none)."""
    g = f or Figures(0, 0.0, 0, 0.0, 0, 0, 0)
    rows = [
        ("decode tok/s", _num(g.decode_tps)),
        ("prefill tok/s", _num(g.prefill_tps)),
        ("tokens", str(g.tokens) if f else "-"),
        ("context", context or (f"{g.context}/{g.max_context}" if f else "-")),
    ]
    if g.vram_used is not None or g.vram_peak is not None:
        rows += [("VRAM used", _gib(g.vram_used)), ("VRAM peak", _gib(g.vram_peak))]
    for label, key, fmt in OFFLOAD:
        if key in g.offload:
            rows.append((label, _num(g.offload[key], fmt)))
    return rows


CELL_GAP = "   "


def figures_text(f: Figures | None, status: str = "", width: int = 80) -> Text:
    """The panel: the figures' cells (cells_text), the status below."""
    return cells_text(figure_rows(f), status, width)


def cells_text(rows: list[tuple[str, str]], status: str = "", width: int = 80) -> Text:
    """`label value` cells flowed into lines of at most `width` columns (a cell is never
    split), the status below."""
    text, col = Text(), 0
    for label, value in rows:
        cell = len(label) + 1 + len(value)
        if col and col + len(CELL_GAP) + cell > width:
            text.append("\n")
            col = 0
        if col:
            text.append(CELL_GAP)
            col += len(CELL_GAP)
        text.append(label + " ", style="dim")
        text.append(value, style="bold")
        col += cell
    if status:
        text.append("\n" + status, style="cyan")
    return text


def timing_parts(prefill_s: float, prefill_tokens: int, decode_s: float, decode_tokens: int,
                 offload: Mapping[str, object] | None = None) -> list[str]:
    """llama-cli style timing: prompt eval (prefill), then eval (decode steps); the demand
    misses and hit rate when the expert backend reports them."""
    def rate(n: int, s: float) -> str:
        return _num(n / s if s > 0 else None)

    offload = offload or {}
    parts = [f"prompt eval {prefill_s * 1e3:.1f} ms / {plural(prefill_tokens, 'token')} "
             f"({rate(prefill_tokens, prefill_s)} tok/s)",
             f"eval {decode_s * 1e3:.1f} ms / {plural(decode_tokens, 'run')} "
             f"({rate(decode_tokens, decode_s)} tok/s)"]
    if "misses_per_token" in offload:
        parts.append(f"misses/token {_num(offload['misses_per_token'], '{:.2f}')}")
    if "hit_rate" in offload:
        parts.append(f"hit rate {_num(offload['hit_rate'], '{:.1%}')}")
    return parts


def timing_line(prefill_s: float, prefill_tokens: int, decode_s: float, decode_tokens: int,
                offload: Mapping[str, object] | None = None) -> str:
    return " | ".join(timing_parts(prefill_s, prefill_tokens, decode_s, decode_tokens, offload))


def summary_parts(rec: StepRecord, context: str | None = None) -> list[str]:
    """The timing line after a chat reply, in parts; `context` overrides the record's (chat
    passes the conversation's, which counts the <|im_end|> that closes the turn)."""
    f = rec.figures
    return ([f"{plural(rec.n, 'token')}, context {context or f'{f.context}/{f.max_context}'}"]
            + timing_parts(f.prefill_s, f.prefill_tokens, f.decode_s, f.decode_tokens, f.offload))


def summary_line(rec: StepRecord, context: str | None = None) -> str:
    return " | ".join(summary_parts(rec, context))


def fit(parts: list[str], width: int | None) -> str:
    """Parts joined by ` | `, wrapped between parts so that no line is wider than `width`
    (None: one line); a continuation line starts with `  `."""
    if width is None:
        return " | ".join(parts)
    lines = [parts[0]] if parts else []
    for part in parts[1:]:
        if len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " | " + part
        else:
            lines.append("  " + part)
    return "\n".join(lines)


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

    def note(self, err: TextIO, line: str) -> None:
        """A status line on `err` while the writer is in use."""
        err.write(line + "\n")
        err.flush()


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
        return Group(Text(self.line), figures_text(self.figures, self.status,
                                                   self.console.width))

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

    def note(self, err: TextIO, line: str) -> None:
        """A status line while the panel is drawn: printed above it when `err` is a terminal
        (written straight there, the panel's next refresh would draw over it)."""
        if self.console.file is err or isatty(err):
            self.console.print(Text(line), soft_wrap=True)
        else:
            err.write(line + "\n")
            err.flush()


class Screen:
    """The terminal or pipes a run writes to, and whether it shows the live panel."""

    def __init__(self, out: TextIO, err: TextIO, panel: bool | None):
        self.out, self.err = out, err
        self.panel = isatty(err) if panel is None else panel

    def note(self, line: str) -> None:
        """A status line on stderr (banner, timing summary, notices)."""
        self.err.write(line + "\n")
        self.err.flush()

    def note_words(self, line: str) -> None:
        """A long status line (the banner), wrapped between words to a terminal's width; one
        line when stderr is not a terminal."""
        width = terminal_width(self.err)
        self.note(line if width is None else
                  textwrap.fill(line, width, subsequent_indent="  ", break_on_hyphens=False))

    def note_parts(self, parts: list[str]) -> None:
        """A ` | `-separated status line, wrapped between parts to fit a terminal's width; one
        line when stderr is not a terminal (logs stay greppable)."""
        self.note(fit(parts, terminal_width(self.err)))

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


def terminal_width(stream: TextIO) -> int | None:
    """The terminal's width in columns; None when `stream` is not a terminal."""
    if not isatty(stream):
        return None
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return 80
