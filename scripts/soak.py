"""Soak: a scripted multi-turn chat through the real Session for N minutes (issue 15).

    python scripts/soak.py [MODEL] --minutes 15 [--interval 60] [--warmup 2]
        [--max-rss-slope 16] [--max-vram-slope 16] [--max-new-tokens 64] [--side 2]
        [--side-tokens 16] [--reset-every 6] [--seed 0] [--out FILE] [--turns N] [--trim]
        [--device auto|cuda|cpu] [--slots N] [--prefetch off|measure|on] [--budget N] ...

Each turn is a user prompt of varied length answered on the chat path (`Session.chat`, which
decodes in `Session._reply`), then a batch of side prompts on the batch path
(`Session.generate_batch`). Every --reset-every turns, and whenever the next turn would not fit,
the conversation is reset as `/reset` does. Decoding runs as `ftchat run` runs it: the same
settings, CUDA graphs on CUDA by default, no debug hooks.

At the first turn boundary after every --interval seconds, one JSON line (kind "interval"):
tokens, tok/s, the worst gap between two tokens of one reply, VRAM allocated/reserved (0 on CPU)
and host RSS (smaps_rollup's Rss). Memory is read between turns, where no step's buffers are alive. At the end
one line (kind "summary") with the least-squares slopes of RSS and of VRAM reserved against
time, in MiB per minute, over the intervals after --warmup. Exit 1, with one `error:` line on
stderr, when a slope exceeds its bound or anything fails; exit 2 for bad arguments.

--trim calls glibc's malloc_trim before each RSS reading: RSS then follows live memory instead of
swinging with the pages the allocator keeps (about +-15 MB between turns on the CPU demo), which
matters only for runs of seconds (the tests); a soak of minutes reads RSS as a user sees it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # ftchat without an install

from ftchat.errors import FtchatError  # noqa: E402

MIB = 1 << 20

# Prompt material: sentences joined into prompts of 1 to --long sentences (varied lengths).
SENTENCES = (
    "Write a Python function that merges two sorted lists.",
    "Explain what a hash table is.",
    "What does the with statement do in Python?",
    "List three uses of a priority queue.",
    "How do I reverse a string?",
    "Describe the difference between a process and a thread.",
    "Write a SQL query that counts rows per customer.",
    "What is the time complexity of binary search?",
    "Summarise the previous answer in one sentence.",
    "Give an example with a dictionary of lists.",
    "Why would a generator use less memory than a list here?",
    "Rewrite it without recursion.",
)


class SoakError(FtchatError):
    """A soak that failed: its message is the one error line."""


# ===== measurements =====

def rss_bytes(status: Path = Path("/proc/self/smaps_rollup")) -> int:
    """Host resident set size of this process, in bytes: the Rss line of smaps_rollup (the
    kernel walks the page tables), else VmRSS of a status file (proc(5): VmRSS may lag, its
    counters are folded in now and then in a threaded process)."""
    try:
        text = status.read_text()
    except OSError as e:
        raise SoakError(f"cannot read the host RSS from {status} (Linux only): "
                        f"{e.strerror or e}") from None
    for line in text.splitlines():
        if line.startswith(("Rss:", "VmRSS:")):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise SoakError(f"{status} has no Rss or VmRSS line")


def malloc_trim() -> None:
    """Give the heap's free pages back to the OS (glibc), so that RSS counts live memory, not
    the pages the allocator keeps for reuse."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        raise SoakError("--trim needs glibc's malloc_trim") from None
    trim(0)


def vram_bytes(device) -> tuple[int, int]:
    """(allocated, reserved) bytes of the torch allocator; (0, 0) off CUDA."""
    import torch

    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against ts (at least two distinct ts)."""
    if len(ts) != len(ys) or len(ts) < 2:
        raise ValueError("a slope needs two points or more")
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        raise ValueError("a slope needs two distinct times")
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


# ===== the scripted chat =====

@dataclass
class Interval:
    """What happened since the last report."""

    tokens: int = 0
    worst_gap_s: float = 0.0


@dataclass
class Meter:
    """Counts tokens and token gaps, and writes one JSON line per `every` seconds."""

    every: float
    device: object
    write: Callable[[dict], None]
    clock: Callable[[], float] = time.perf_counter
    trim: bool = False  # malloc_trim before each RSS reading (--trim)
    samples: list[dict] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"turns": 0, "resets": 0,
                                                             "side_prompts": 0})

    def __post_init__(self) -> None:
        self.start = self.last_report = self.clock()
        self.now = Interval()
        self.prev_token: float | None = None

    def reply_starts(self) -> None:
        self.prev_token = None  # a reply's first token waits for its prefill: not a gap

    def token(self) -> None:
        t = self.clock()
        if self.prev_token is not None:
            self.now.worst_gap_s = max(self.now.worst_gap_s, t - self.prev_token)
        self.prev_token = t
        self.now.tokens += 1

    def poll(self, final: bool = False) -> None:
        """Report if an interval has passed; at the end, if tokens came since the last report
        (not merely time: a report itself takes milliseconds)."""
        t = self.clock()
        if (self.now.tokens > 0) if final else (t - self.last_report >= self.every):
            self.report(t)

    def report(self, t: float) -> None:
        if self.trim:
            malloc_trim()
        alloc, reserved = vram_bytes(self.device)
        span = max(t - self.last_report, 1e-9)
        sample = {"kind": "interval", "interval": len(self.samples),
                  "t_s": round(t - self.start, 3), "tokens": self.now.tokens,
                  "tok_s": round(self.now.tokens / span, 2),
                  "worst_gap_ms": round(self.now.worst_gap_s * 1e3, 2),
                  "vram_allocated": alloc, "vram_reserved": reserved, "rss": rss_bytes(),
                  **self.counts}
        self.samples.append(sample)
        self.write(sample)
        self.last_report, self.now = t, Interval()


def prompts(rng: random.Random, longest: int) -> Iterator[str]:
    """Prompts of 1 to `longest` sentences, short ones more often (a log-uniform length)."""
    while True:
        n = min(longest, int(2 ** rng.uniform(0, max(longest, 1).bit_length())))
        yield " ".join(rng.choice(SENTENCES) for _ in range(max(n, 1)))


def soak(session, a: argparse.Namespace, meter: Meter,
         on_turn: Callable[[int], None] | None = None) -> None:
    """Turns until --minutes have passed (or --turns are done): chat turn, side batch, /reset
    now and then."""
    rng = random.Random(a.seed)
    user, side = prompts(rng, a.long), prompts(rng, 3)
    deadline = meter.start + a.minutes * 60
    turn = 0
    while meter.clock() < deadline and (a.turns is None or turn < a.turns):
        text = next(user)
        ids = session.turn_ids(text)
        full = session.context_used + len(ids) + a.max_new_tokens > session.max_len
        if full or (turn and a.reset_every and turn % a.reset_every == 0):
            session.reset()  # what /reset does
            meter.counts["resets"] += 1
            ids = session.turn_ids(text)
        _consume(session.chat(ids), meter)
        if a.side:
            batch = [session.encode_messages([{"role": "user", "content": next(side)}])
                     for _ in range(a.side)]
            _consume(session.generate_batch(batch, max_new_tokens=a.side_tokens), meter)
            meter.counts["side_prompts"] += a.side
        turn += 1
        meter.counts["turns"] = turn
        if on_turn is not None:
            on_turn(turn)  # tests: a planted leak
        meter.poll()
    meter.poll(final=True)


def _consume(records: Iterable, meter: Meter) -> None:
    meter.reply_starts()
    for _ in records:
        meter.token()


# ===== the verdict =====

def verdict(samples: list[dict], a: argparse.Namespace) -> tuple[dict, str | None]:
    """The summary line and why the soak failed (None: it passed)."""
    fit = samples[a.warmup:]
    summary = {"kind": "summary", "intervals": len(samples), "fitted": len(fit),
               "tokens": sum(s["tokens"] for s in samples),
               "max_rss_slope_mib_per_min": a.max_rss_slope,
               "max_vram_slope_mib_per_min": a.max_vram_slope}
    if len(fit) < 2:
        return summary, (f"too short to fit a slope: {len(samples)} intervals, {a.warmup} of "
                         "them warm-up (run longer or give a shorter --interval)")
    minutes = [s["t_s"] / 60 for s in fit]
    rss = slope(minutes, [s["rss"] / MIB for s in fit])
    vram = slope(minutes, [s["vram_reserved"] / MIB for s in fit])
    summary.update(rss_slope_mib_per_min=round(rss, 3),
                   vram_reserved_slope_mib_per_min=round(vram, 3))
    if rss > a.max_rss_slope:
        return summary, (f"host RSS grows {rss:.1f} MiB/min over {len(fit)} intervals, above the "
                         f"bound of {a.max_rss_slope:g} MiB/min")
    if vram > a.max_vram_slope:
        return summary, (f"VRAM reserved grows {vram:.1f} MiB/min over {len(fit)} intervals, above "
                         f"the bound of {a.max_vram_slope:g} MiB/min")
    return summary, None


# ===== command line =====

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the usage block
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive(kind: type) -> Callable[[str], float | int]:
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return v
    return parse


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {text!r}")
    return v


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="checkpoint folder or hub id (default: the demo)")
    p.add_argument("--minutes", type=_positive(float), required=True, help="how long to run")
    p.add_argument("--turns", type=_positive(int),
                   help="stop after N turns, if --minutes have not run out first")
    p.add_argument("--interval", type=_positive(float), default=60.0,
                   help="seconds per report line (default 60)")
    p.add_argument("--warmup", type=_count, default=2,
                   help="first intervals left out of the slope fit (default 2)")
    p.add_argument("--max-rss-slope", type=float, default=16.0,
                   help="MiB/min of host RSS growth allowed (default 16)")
    p.add_argument("--max-vram-slope", type=float, default=16.0,
                   help="MiB/min of VRAM reserved growth allowed (default 16)")
    p.add_argument("--max-new-tokens", type=_positive(int), default=64,
                   help="tokens per chat reply at most (default 64)")
    p.add_argument("--long", type=_positive(int), default=24,
                   help="sentences in the longest user prompt (default 24)")
    p.add_argument("--side", type=_count, default=2,
                   help="side prompts decoded as one batch after each turn (default 2)")
    p.add_argument("--side-tokens", type=_positive(int), default=16,
                   help="tokens per side reply at most (default 16)")
    p.add_argument("--reset-every", type=_count, default=6,
                   help="a /reset every N turns, 0: only when full (default 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt script")
    p.add_argument("--out", type=Path, help="write the JSON lines to FILE (default stdout)")
    p.add_argument("--trim", action="store_true", help="malloc_trim before each RSS reading")
    same = "as for ftchat run"  # parsed and checked by resolve_settings, as the CLI does
    for flag in ("--device", "--dtype", "--prefetch", "--eviction"):
        p.add_argument(flag, help=same)
    for flag in ("--slots", "--budget", "--context", "--threads", "--copy-programs"):
        p.add_argument(flag, type=int, help=same)
    p.add_argument("--expert-vram", type=float, help=same)
    p.add_argument("--graph", action="store_true", default=None, help="CUDA graphs (CUDA default)")
    p.add_argument("--eager", dest="graph", action="store_false", default=None,
                   help="no CUDA graphs")
    return p.parse_args(argv)


ENGINE_FLAGS = ("device", "dtype", "prefetch", "eviction", "slots", "budget", "context",
                "threads", "copy_programs", "expert_vram", "graph")


def open_session(a: argparse.Namespace, env):
    """The Session `ftchat run` would open with these flags."""
    from ftchat.resolve import resolve_model
    from ftchat.session import Session
    from ftchat.generation_defaults import generation_defaults
    from ftchat.settings import resolve_settings
    from ftchat.ui.run import apply_threads

    flags = {k: getattr(a, k) for k in ENGINE_FLAGS}
    settings = resolve_settings({**flags, "max_new_tokens": a.max_new_tokens,
                                 "batch_size": max(a.side, 1)}, env)
    apply_threads(settings)
    resolved = resolve_model(a.model, env)
    settings = settings.with_generation_defaults(generation_defaults(resolved.path))
    return resolved, Session.open(resolved.path, settings)


def main(argv: list[str] | None = None, on_turn: Callable[[int], None] | None = None,
         err: TextIO | None = None) -> int:
    """Run the soak; `on_turn(turn)` runs after each turn (tests plant a leak there)."""
    a = parse_args(argv)
    err = err or sys.stderr
    try:
        out = open(a.out, "w") if a.out else sys.stdout  # noqa: SIM115 (closed below)
    except OSError as e:
        print(f"error: --out {a.out}: cannot write it ({e.strerror or e})", file=err)
        return 1
    try:
        return _run(a, out, err, on_turn)
    except FtchatError as e:
        print(f"error: {e}", file=err)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=err)
        return 130
    except Exception as e:  # a bug or a device error while loading: one line
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"error: internal error: {type(e).__name__}: {first}", file=err)
        return 1
    finally:
        if a.out:
            out.close()


def _run(a: argparse.Namespace, out: TextIO, err: TextIO, on_turn) -> int:
    def write(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")
        out.flush()  # a soak is watched while it runs

    resolved, session = open_session(a, os.environ)
    print(f"soak: {resolved.name}: {session.describe()}; {a.minutes:g} min, a report every "
          f"{a.interval:g} s", file=err)
    meter = Meter(a.interval, session.model.device, write, trim=a.trim)
    error = None
    try:
        soak(session, a, meter, on_turn)
    except SoakError as e:
        error = str(e)
    except Exception as e:  # any failure ends the soak: one line, where and what
        first = (str(e).strip().splitlines() or [""])[0]
        what = first if isinstance(e, FtchatError) else f"{type(e).__name__}: {first}"
        error = f"the soak stopped in turn {meter.counts['turns'] + 1}: {what}"
    finally:
        session.close()
    summary, why = verdict(meter.samples, a)
    why = error or why
    write({**summary, **meter.counts, "ok": why is None, **({"error": why} if why else {})})
    if why:
        raise SoakError(why)
    print(f"soak: ok, host RSS {summary['rss_slope_mib_per_min']:+.1f} MiB/min, VRAM reserved "
          f"{summary['vram_reserved_slope_mib_per_min']:+.1f} MiB/min over {summary['fitted']} "
          f"intervals", file=err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
