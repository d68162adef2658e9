"""The live status line of `ftchat serve` on a terminal (stderr): requests running and queued,
decode and prompt tok/s over the last seconds, prefix reuse, expert misses per token when the
experts are offloaded. Drawn with rich as the chat panel is (ftchat/ui/panel.py: the same
`label value` cells); the log lines print above it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.live import Live
from rich.text import Text

from ftchat.server.metrics import Metrics
from ftchat.ui.panel import cells_text

RATE_WINDOW_S = 2.0  # tok/s are measured over about this long
NOTES = {"loading": "loading the model", "failed": "the model failed to load"}  # worker state


@dataclass(frozen=True)
class ServeFigures:
    running: int  # requests in a row (prefilling or decoding)
    queued: int  # requests waiting for a row
    decode_tps: float | None  # tokens decoded per second, all rows together; None: idle
    prefill_tps: float | None  # prompt tokens prefilled per second; None: idle
    served: int  # requests finished with a reply
    prefix_hits: int  # of them, those that reused a kept prefix
    cached_tokens: int  # prompt tokens reused instead of prefilled
    misses_per_token: float | None  # expert demand misses per decoded token (offloaded)
    offloaded: bool  # the expert backend is offloaded (it reports misses)


def status_rows(f: ServeFigures) -> list[tuple[str, str]]:
    """(label, value) cells; misses/token only when the experts are offloaded ("-" until
    known)."""
    rows = [("running", str(f.running)), ("queued", str(f.queued)),
            ("decode tok/s", _num(f.decode_tps)), ("prompt tok/s", _num(f.prefill_tps)),
            ("prefix hits", f"{f.prefix_hits}/{f.served}"),
            ("cached tokens", f"{f.cached_tokens:,}")]
    if f.offloaded:
        rows.append(("misses/token", _num(f.misses_per_token, "{:.2f}")))
    return rows


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


class Rate:
    """Units per second of a running count, over the last `window` seconds: measured from the
    newest sample at least `window` old (or the oldest kept) to the one just added."""

    def __init__(self, window: float = RATE_WINDOW_S):
        self.window = window
        self.samples: deque[tuple[float, int]] = deque()

    def update(self, now: float, count: int) -> float | None:
        """The rate up to `now`, when the count is `count`; None when it did not grow."""
        self.samples.append((now, count))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window:
            self.samples.popleft()
        t0, c0 = self.samples[0]
        if now <= t0 or count <= c0:
            return None
        return (count - c0) / (now - t0)


class StatusLine:
    """The status line of one server: figures read from its Metrics at each refresh, and below
    them a note while the engine worker's `state()` is not "ready"."""

    def __init__(self, metrics: Metrics, console: Console,
                 state: Callable[[], str] = lambda: "ready"):
        self.metrics, self.console, self.state = metrics, console, state
        self.decode, self.prefill = Rate(), Rate()

    def figures(self, now: float) -> ServeFigures:
        m = self.metrics
        with m.lock:
            running, queued = m.running, m.queue_depth
            decoded, prefilled = m.live_decoded, m.live_prefilled
            served, hits, cached = m.served, m.prefix_hits, m.cached_tokens
            offloaded = "misses_per_token" in m.backend
            mpt = m.backend.get("misses_per_token")
        return ServeFigures(running, queued, self.decode.update(now, decoded),
                            self.prefill.update(now, prefilled), served, hits, cached, mpt,
                            offloaded)

    def render(self) -> Text:
        return cells_text(status_rows(self.figures(time.monotonic())),
                          NOTES.get(self.state(), ""), self.console.width)

    def log(self, line: str) -> None:
        """A log line, printed above the status line (thread-safe: rich holds its lock)."""
        self.console.print(Text(line), soft_wrap=True)

    @contextmanager
    def live(self) -> Iterator[None]:
        """The status line drawn while the block runs; what else is written to stderr (the
        HTTP server's own warnings) goes above it."""
        with Live(console=self.console, refresh_per_second=4, transient=True,
                  redirect_stdout=False, redirect_stderr=True, get_renderable=self.render):
            yield
