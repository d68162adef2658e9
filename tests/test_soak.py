"""scripts/soak.py: the slope fit, the verdict, the turn loop on a fake session and clock, and
short soaks of the demo model on the CPU: a clean one passes, a planted leak fails the growth
check. Expected values are worked out by hand here, never by the code under test."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import soak  # noqa: E402

MIB = 1 << 20


# ===== the slope fit =====

def test_slope_of_exact_lines():
    assert soak.slope([0, 1, 2, 3], [5, 8, 11, 14]) == 3  # y = 3t + 5
    assert soak.slope([0, 2], [1, 0]) == -0.5
    assert soak.slope([1, 2, 3], [7, 7, 7]) == 0


def test_slope_is_the_least_squares_one():
    # residuals +1 -1 -1 +1 around y = 2t are orthogonal to t: the fitted slope stays 2
    assert soak.slope([0, 1, 2, 3], [1, 1, 3, 7]) == pytest.approx(2)
    # t 0 1 2, y 0 0 3: sum (t - 1)(y - 1) = 1 + 0 + 2 = 3, sum (t - 1)^2 = 2
    assert soak.slope([0, 1, 2], [0, 0, 3]) == pytest.approx(1.5)
    # uneven times: t 0 1 4, y 0 2 4; mean t 5/3, mean y 2; cov = 10/3 + 0 + 14/3 = 8,
    # var = 25/9 + 4/9 + 49/9 = 26/3: slope 24/26
    assert soak.slope([0, 1, 4], [0, 2, 4]) == pytest.approx(12 / 13)


def test_slope_needs_two_distinct_times():
    for ts, ys in (([1.0], [1.0]), ([2.0, 2.0], [0.0, 1.0]), ([0.0, 1.0], [1.0])):
        with pytest.raises(ValueError):
            soak.slope(ts, ys)


# ===== the verdict =====

def _args(*extra: str):
    return soak.parse_args(["--minutes", "1", *extra])


def _samples(rss_mib: list[float], vram_mib: list[float] | None = None, every_s: float = 60):
    vram_mib = vram_mib or [0.0] * len(rss_mib)
    return [{"t_s": (i + 1) * every_s, "tokens": 10, "rss": r * MIB, "vram_reserved": v * MIB}
            for i, (r, v) in enumerate(zip(rss_mib, vram_mib))]


def test_verdict_leaves_the_warmup_out_of_the_fit():
    jump_in_warmup = _samples([100, 400, 500, 500, 500, 500])  # one point a minute
    summary, why = soak.verdict(jump_in_warmup, _args("--warmup", "2"))
    assert why is None and summary["fitted"] == 4 and summary["rss_slope_mib_per_min"] == 0
    # the same series with one warm-up interval: 400 500 500 500 500 is a rise
    summary, why = soak.verdict(jump_in_warmup, _args("--warmup", "1"))
    assert why is not None and why.startswith("host RSS grows 20.0 MiB/min over 5 intervals")


def test_verdict_bounds_rss_and_vram_reserved():
    ten_a_minute = [500 + 10 * i for i in range(6)]
    assert soak.verdict(_samples(ten_a_minute), _args())[1] is None  # default bound 16
    why = soak.verdict(_samples(ten_a_minute), _args("--max-rss-slope", "8"))[1]
    assert why == "host RSS grows 10.0 MiB/min over 4 intervals, above the bound of 8 MiB/min"
    # 20 MiB a minute of VRAM reserved, every 30 s: 10 MiB a step
    summary, why = soak.verdict(_samples([500] * 6, [10 * i for i in range(6)], every_s=30),
                                _args())
    assert summary["vram_reserved_slope_mib_per_min"] == pytest.approx(20)
    assert why == ("VRAM reserved grows 20.0 MiB/min over 4 intervals, above the bound of "
                   "16 MiB/min")


def test_verdict_of_a_soak_too_short_to_fit():
    why = soak.verdict(_samples([500, 510, 520]), _args("--warmup", "2"))[1]
    assert why.startswith("too short to fit a slope: 3 intervals, 2 of them warm-up")


# ===== measurements =====

def test_rss_is_read_from_smaps_rollup_or_vmrss(tmp_path):
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text("55d0-7ffc ---p 00000000 00:00 0  [rollup]\nRss:    5678 kB\nPss:  5000 kB\n")
    assert soak.rss_bytes(rollup) == 5678 * 1024
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  9999 kB\nVmRSS:\t    1234 kB\n")
    assert soak.rss_bytes(status) == 1234 * 1024
    status.write_text("Name:\tpython\n")
    with pytest.raises(soak.SoakError, match="no Rss or VmRSS"):
        soak.rss_bytes(status)
    with pytest.raises(soak.SoakError, match="Linux only"):
        soak.rss_bytes(tmp_path / "none")


def test_rss_sees_memory_this_process_touches():
    # a fresh anonymous mapping, every page written: a bytearray may reuse heap pages that
    # earlier tests left resident (the full suite saw RSS unchanged after one); "most of it", as
    # other memory may be paged out meanwhile on a loaded machine
    before = soak.rss_bytes()
    block = mmap.mmap(-1, 64 * MIB)
    for i in range(0, 64 * MIB, mmap.PAGESIZE):
        block[i] = 1
    assert soak.rss_bytes() - before > 48 * MIB
    block.close()


# ===== the turn loop, on a fake session and clock =====

class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeSession:
    """A turn: 6 prompt tokens; the chat reply's first token after 5 s (prefill), two more 1 s
    apart; a side batch answers every prompt at once after 2 s. 9 s and 5 tokens a turn."""

    max_len = 30

    def __init__(self, clock: Clock) -> None:
        self.clock, self.context_used, self.resets, self.batches = clock, 0, 0, []

    def turn_ids(self, text: str) -> list[int]:
        return [0] * 6

    def reset(self) -> None:
        self.context_used, self.resets = 0, self.resets + 1

    def chat(self, ids):
        self.context_used += len(ids)
        self.clock.t += 5
        for i in range(3):
            self.clock.t += 1 if i else 0
            self.context_used += 1
            yield i

    def encode_messages(self, messages) -> list[int]:
        return [0]

    def generate_batch(self, batch, max_new_tokens: int):
        self.batches.append((len(batch), max_new_tokens))
        self.clock.t += 2
        yield from (0 for _ in batch)


def _fake_soak(*extra: str) -> tuple[FakeSession, soak.Meter]:
    clock = Clock()
    session = FakeSession(clock)
    meter = soak.Meter(10, torch.device("cpu"), lambda rec: None, clock=clock)
    soak.soak(session, soak.parse_args(["--minutes", "0.5", "--max-new-tokens", "3",
                                         "--side-tokens", "4", *extra]), meter)
    return session, meter


def test_soak_loop_runs_to_the_deadline_and_reports_at_turn_boundaries():
    session, meter = _fake_soak("--reset-every", "0")
    # turns start at 0, 9, 18, 27 s (30 s deadline) and end at 9, 18, 27, 36 s
    assert meter.counts == {"turns": 4, "resets": 1, "side_prompts": 8}
    assert session.batches == [(2, 4)] * 4
    # 9 tokens a turn: before the fourth, 27 + 6 + 3 > 30, so it starts with a /reset
    assert session.resets == 1
    # reports at the first turn boundary 10 s after the last: 18 s and 36 s, 10 tokens each
    assert [(s["t_s"], s["tokens"]) for s in meter.samples] == [(18, 10), (36, 10)]
    assert [s["tok_s"] for s in meter.samples] == [round(10 / 18, 2)] * 2
    # the worst gap is the 1 s between chat tokens: not the prefill's 5 s, not the batch's 2 s
    assert [s["worst_gap_ms"] for s in meter.samples] == [1000.0, 1000.0]
    assert all(s["vram_reserved"] == 0 and s["rss"] > 0 for s in meter.samples)


def test_soak_loop_resets_every_n_turns_and_stops_after_turns():
    session, meter = _fake_soak("--reset-every", "1")
    assert session.resets == 3  # before turns 2, 3 and 4
    session, meter = _fake_soak("--turns", "2", "--side", "0")
    assert meter.counts["turns"] == 2 and session.batches == []


# ===== the command line =====

def test_bad_arguments_are_one_line(capsys):
    for argv, expected in (
        (["--minutes", "0"], "error: argument --minutes: expected a positive number, got '0'"),
        ([], "error: the following arguments are required: --minutes"),
        (["--minutes", "1", "--side", "-1"],
         "error: argument --side: expected a count >= 0, got '-1'"),
    ):
        with pytest.raises(SystemExit) as e:
            soak.main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines() == [expected]
    # as a script too: the one line, no traceback
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes", "x"],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.splitlines() == ["error: argument --minutes: expected a positive number, "
                                     "got 'x'"]


def test_bad_settings_and_a_missing_model_are_one_line(capsys, tmp_path):
    assert soak.main(["--minutes", "1", "--device", "gpu"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --device") and "gpu" in err[0], err
    assert soak.main([str(tmp_path / "none"), "--minutes", "1", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "none" in err[0], err


# ===== short soaks of the demo model on the CPU =====

# Four turns (a chat reply of 2 tokens, then a side batch of one reply of 2: each prefill costs
# ~0.5-1 s on this CPU), a report after every turn, the first left out of the fit (the second
# turn still allocates ~4 MB once). --trim: glibc otherwise keeps freed pages resident and RSS
# swings by ~15 MB between turns, more than seconds of a real leak would add. Measured here:
# 0-15 MiB/min without the leak, 300-650 with it.
TURNS = 4
DEMO = ["--minutes", "2", "--turns", str(TURNS), "--interval", "0.01", "--warmup", "1",
        "--max-new-tokens", "2", "--side", "1", "--side-tokens", "2", "--long", "2",
        "--reset-every", "2", "--context", "256", "--slots", "96", "--prefetch", "on",
        "--device", "cpu", "--trim", "--max-rss-slope", "64"]
LEAK_PER_TURN = 16 * MIB  # at 4 s a turn still 240 MiB/min


def _demo_soak(tmp_path, capsys, on_turn=None) -> tuple[int, list[dict], list[str]]:
    out = tmp_path / "soak.jsonl"
    rc = soak.main([*DEMO, "--out", str(out)], on_turn=on_turn)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return rc, lines, capsys.readouterr().err.splitlines()


def test_short_soak_of_the_demo_passes(tmp_path, capsys):
    # also the negative control of the leak below: the same run without the leak
    rc, lines, err = _demo_soak(tmp_path, capsys)
    assert rc == 0, err
    *intervals, summary = lines
    assert [s["kind"] for s in intervals] == ["interval"] * TURNS
    assert summary["kind"] == "summary" and summary["fitted"] == TURNS - 1
    assert [s["turns"] for s in intervals] == [1, 2, 3, 4]
    assert summary["ok"] is True and summary["resets"] == 1  # before the third turn
    assert summary["side_prompts"] == TURNS
    for s in intervals:
        assert 2 <= s["tokens"] <= 4 and s["tok_s"] > 0  # 1-2 chat tokens, 1-2 side tokens
        assert s["worst_gap_ms"] > 0  # a reply of two tokens has one gap
        assert s["vram_allocated"] == s["vram_reserved"] == 0  # the CPU
        assert s["rss"] > 100 * MIB
    assert summary["rss_slope_mib_per_min"] <= 64
    assert err[-1].startswith("soak: ok, host RSS ") and not any("error" in e for e in err)


def test_planted_leak_fails_the_growth_check(tmp_path, capsys):
    kept: list[bytearray] = []
    rc, lines, err = _demo_soak(tmp_path, capsys,
                                on_turn=lambda turn: kept.append(bytearray(b"\x01") * LEAK_PER_TURN))
    assert len(kept) == TURNS
    assert rc == 1
    assert [e for e in err if e.startswith("error")] == [err[-1]]
    assert err[-1].startswith("error: host RSS grows ")
    assert err[-1].endswith(f"MiB/min over {TURNS - 1} intervals, above the bound of 64 MiB/min")
    summary = lines[-1]
    assert summary["ok"] is False and summary["rss_slope_mib_per_min"] > 64
    # what was planted shows in the readings: 16 MiB more after each turn
    rss = [s["rss"] for s in lines[:-1]]
    assert all(b - a > 12 * MIB for a, b in zip(rss, rss[1:])), rss
