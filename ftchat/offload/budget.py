"""`--budget auto`: the prefetch budget that fills the link's idle time under one layer's compute.

A prefetch copy of layer l+1 rides the link while layer l computes. Installs beyond what fits
in that time delay l+1's demand copy, which is on the critical path; installs within it cost
only the residents they evict. The link model (docs/routing.md 4) puts the budget at the number
of rows the link carries in one layer's compute time,

    r = T_compute / L / t_row

and the budget is floor(r) or floor(r) + 1, clamped to 0..cap: which of the two is faster
depends on what the model leaves out (each copy's latency, the copy kernel's programs beside
the layer's own kernels), so both are timed and the faster one is kept.

Everything is measured in this process, on this machine:
  t_row      at construction: a timed copy of `LINK_PROBE_ROWS` expert rows from the host store
             into the bank's sink row (no slot is touched), best of three;
  T_compute  over `WINDOW_STEPS` decode steps after `SKIP_STEPS`, the auto layers at budget 0
             (prefetch predicts but installs nothing there: the prefetch-off step): the mean
             step time less the demand copies' link time (misses x t_row);
  the trial  `TRIAL_STEPS` steps after `SKIP_STEPS` at each budget of the bracket, budget 0
             too (the window ran on a colder cache); the larger one is kept only if its steps
             are more than `TRIAL_MARGIN` faster. At most `SETTLE_STEPS` decode steps until
             the choice, unless a span starts again: at a prefill, an emptied cache or a new
             batch size (a span times decode steps of one shape only).
The budget lives in a device tensor [L] int32 that the prefetch kernel reads (`limit`), so a
captured graph picks each new value up without a recapture. The choice is kept for the process:
link and compute do not change between sequences. One host sync at the end of each timed span.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from ftchat.offload.copy import copy_rows

LINK_PROBE_ROWS = 32  # rows in the link probe: a few MB at the real geometry
SKIP_STEPS = 2  # decode steps before the window (the first ones after a prefill or capture)
WINDOW_STEPS = 8  # decode steps timed at budget 0
TRIAL_STEPS = 16  # decode steps timed at each budget of the bracket
TRIAL_MARGIN = 0.01  # the larger budget is kept only if its steps are more than this faster
AUTO_CAP = 4  # the largest budget auto picks (and the prefetch plan's size)
# decode steps until the budget is chosen, at most: the window, then two trials
SETTLE_STEPS = SKIP_STEPS + WINDOW_STEPS + 2 * (SKIP_STEPS + TRIAL_STEPS)


def bracket(compute_s: float, num_layers: int, row_s: float, cap: int) -> tuple[int, int]:
    """The two budgets around the link model's rows per layer: floor(r) and floor(r) + 1,
    clamped to 0..cap (one budget twice where r reaches the cap)."""
    lo = min(max(int(compute_s / num_layers / row_s), 0), cap)
    return lo, min(lo + 1, cap)


class StepClock:
    """Time stamps on the compute stream: CUDA events (read after a sync), else the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, start: object, end: object) -> float:
        """SYNC on CUDA: waits for `end`."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


def probe_row_seconds(host: Tensor, bank: Tensor, run_copy: Callable[[Callable[[], None]], None],
                      clock: StepClock, programs: int) -> float:
    """Seconds one expert row takes over the link: copies of LINK_PROBE_ROWS host rows into the
    sink row (bank row S), timed as the prefetch copies run (`run_copy` puts the work on the
    prefetch stream). Best of three after one warm-up."""
    n = min(LINK_PROBE_ROWS, host.shape[0])
    src = torch.arange(n, dtype=torch.int64, device=bank.device)  # [n]
    dst = torch.full((n,), bank.shape[0] - 1, dtype=torch.int32, device=bank.device)  # the sink
    count = torch.tensor([n], dtype=torch.int32, device=bank.device)
    best = float("inf")
    for i in range(4):
        marks = []

        def copy():
            marks.append(clock.mark())
            copy_rows(host, bank, src, dst, count, programs)
            marks.append(clock.mark())
        run_copy(copy)
        if i > 0:  # the first one compiles and warms up
            best = min(best, clock.seconds(marks[0], marks[1]))
    return max(best, 1e-12) / n


class AutoBudget:
    """The adaptive budget of one offload backend. `limit` [L] int32 is what the prefetch kernel
    reads: a fixed layer's budget from the start, an auto layer's 0 during the window, then each
    trial's budget, then the chosen one. `end_step` runs after every decode step (on the host,
    outside any graph)."""

    def __init__(self, fixed: list[int | None], cap: int, row_s: float, device: torch.device,
                 misses: Tensor, clock: StepClock):
        self.num_layers, self.cap, self.row_s = len(fixed), cap, row_s
        self.misses = misses  # [L] int64 running demand-miss counters (the maps' stats)
        self.clock = clock
        self.auto = torch.tensor([b is None for b in fixed], device=device)  # [L] bool
        self.limit = torch.tensor([0 if b is None else b for b in fixed], dtype=torch.int32,
                                  device=device)  # [L]
        self.chosen: int | None = None  # the budget of the auto layers, once settled
        self.compute_s: float | None = None  # the measured compute time of a step
        self.window_s: float | None = None  # the window's step time (budget 0, cold cache)
        self.step_s: dict[int, float] = {}  # budget -> measured step time in its trial
        self.pending: list[int] = []  # budgets still to time
        self.pair: tuple[int, int] | None = None  # the bracket (floor(r), floor(r) + 1)
        self.trying: int | None = None  # the budget being timed; None: the window (budget 0)
        self.steps = 0  # steps into the current span
        self.start: tuple[object, Tensor] | None = None  # (time stamp, misses so far)
        self.rows: int | None = None  # the batch rows of the span's steps

    @property
    def layer_compute_us(self) -> float | None:
        """The measured compute of one layer in microseconds (None until the window ended)."""
        return None if self.compute_s is None else self.compute_s / self.num_layers * 1e6

    @property
    def trial_ms(self) -> dict[str, float]:
        """The measured step time in ms of the window and of each budget timed."""
        out = {} if self.window_s is None else {"window": round(self.window_s * 1e3, 3)}
        return out | {str(b): round(t * 1e3, 3) for b, t in sorted(self.step_s.items())}

    @classmethod
    def measured(cls, fixed: list[int | None], cap: int, host: Tensor, bank: Tensor, streams,
                 misses: Tensor, programs: int) -> AutoBudget:
        """Probe the link now, on the prefetch stream of `streams` (no slot touched); the
        compute time and the trials are measured over the first decode steps."""
        clock = StepClock(bank.device)

        def on_prefetch_stream(fn):
            streams.run("prefetch", fn)
            streams.synchronize()
        row_s = probe_row_seconds(host, bank, on_prefetch_stream, clock, programs)
        return cls(fixed, cap, row_s, bank.device, misses, clock)

    def restart(self) -> None:
        """A span in progress starts again (a chosen budget stays): the cache was emptied, or
        a prefill runs between decode steps (its time is not a decode step's)."""
        self.steps, self.start = 0, None

    def end_step(self, rows: int = 1) -> None:
        """A decode step of `rows` batch rows ended."""
        if self.chosen is not None:
            return
        if rows != self.rows:  # a span times steps of one batch size
            self.restart()
            self.rows = rows
        self.steps += 1
        span = WINDOW_STEPS if self.trying is None else TRIAL_STEPS
        if self.steps == SKIP_STEPS:
            self.start = (self.clock.mark(), self.misses.sum())  # the sum stays on the device
        elif self.steps == SKIP_STEPS + span:
            t0, m0 = self.start
            step_s = self.clock.seconds(t0, self.clock.mark()) / span  # SYNC
            self.steps, self.start = 0, None
            if self.trying is None:
                misses = int(self.misses.sum() - m0) / span  # SYNC
                self.choose(step_s, misses)
            else:
                self.step_s[self.trying] = step_s
                self._next_trial()

    def choose(self, step_s: float, misses_per_step: float) -> None:
        """After the window: the compute time from its step time and demand misses, then the
        bracket's trials. A fixed layer's installs count as compute here: the window runs them
        as configured."""
        # the demand copies are on the critical path; what remains is compute
        self.compute_s = max(step_s - misses_per_step * self.row_s, 0.0)
        self.window_s = step_s
        self.pair = bracket(self.compute_s, self.num_layers, self.row_s, self.cap)
        lo, hi = self.pair
        # budget 0 is timed again too: the window's steps ran on a colder cache
        self.pending = [] if lo == hi else [lo, hi]
        self._next_trial()

    def _next_trial(self) -> None:
        if self.pending:
            self.trying = self.pending.pop(0)
            self.limit.masked_fill_(self.auto, self.trying)  # compute stream, before the next step
            return
        lo, hi = self.pair
        faster = lo == hi or self.step_s[hi] < self.step_s[lo] * (1 - TRIAL_MARGIN)
        self.chosen, self.trying = hi if faster else lo, None
        self.limit.masked_fill_(self.auto, self.chosen)
