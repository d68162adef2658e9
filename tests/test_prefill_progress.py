"""The prefill progress line: engine.decode reports each prefill chunk, and the chat
draws a transient line from the reports only on a terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ftchat import engine
from ftchat.session import Session
from ftchat.settings import Settings
from ftchat.ui.chat import run_chat
from ftchat.ui.panel import Screen
from ftchat.ui.progress import PrefillProgress, prefill_text

from tests.test_cli_chat import reader


class TtyIO(io.StringIO):
    """A stream that says it is a terminal (rich then draws live lines on it)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 4)  # a short prompt takes several chunks
    monkeypatch.setenv("TERM", "xterm")  # not dumb, whatever runs the tests


def test_decode_reports_each_prefill_chunk(tiny_nvfp4, small_chunks):
    m = engine.load_model(tiny_nvfp4)
    dec = engine.Decoder(m, engine.build_experts(m, Settings()), 1, 32)
    calls: list[tuple[int, int]] = []
    steps = list(engine.decode(dec, [list(range(3, 13))], [0], [2],
                               on_prefill=lambda done, total: calls.append((done, total))))
    assert calls == [(0, 10), (4, 10), (8, 10), (10, 10)]
    assert len(steps) == 2


def test_session_chat_passes_on_prefill(tiny_nvfp4, small_chunks):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=2))
    ids = s.turn_ids("hello there")
    calls: list[tuple[int, int]] = []
    list(s.chat(ids, lambda done, total: calls.append((done, total))))
    assert calls[0] == (0, len(ids)) and calls[-1] == (len(ids), len(ids))
    assert [d for d, _ in calls] == sorted({d for d, _ in calls})  # strictly increasing


def test_prefill_text():
    assert prefill_text(2048, 8192, 2.0) == "2,048/8,192 tokens  1,024 tok/s  ETA 6 s"
    assert prefill_text(1000, 200_000, 10.0).endswith("ETA 33:10")
    assert prefill_text(0, 10, 0.0) == "0/10 tokens  - tok/s  ETA -"


def report(progress: PrefillProgress, total: int, chunk: int) -> None:
    for done in [0, *range(chunk, total, chunk), total]:
        progress(done, total)


def test_progress_draws_only_on_a_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    pipe = io.StringIO()
    report(PrefillProgress.on(pipe), 3000, 1024)
    report(PrefillProgress.on(None), 3000, 1024)  # --quiet
    assert pipe.getvalue() == ""
    term = io.StringIO()
    report(PrefillProgress(Console(file=term, force_terminal=True, width=100)), 3000, 1024)
    drawn = term.getvalue()
    assert "1,024/3,000 tokens" in drawn and "2,048/3,000 tokens" in drawn
    assert " tok/s  ETA " in drawn and "- tok/s" not in drawn  # a rate once a chunk is done
    assert drawn.endswith("\x1b[2K") or "\x1b[2K" in drawn[-40:]  # transient: erased at the end


def test_one_chunk_prompt_draws_nothing(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    term = io.StringIO()
    report(PrefillProgress(Console(file=term, force_terminal=True)), 1000, 1024)
    assert term.getvalue() == ""


@pytest.mark.parametrize("panel", [False, True])
def test_chat_shows_the_prefill_line_on_a_terminal_only(tiny_nvfp4, small_chunks, panel):
    def chat(err: io.StringIO, quiet: bool = False) -> str:
        s = Session.open(tiny_nvfp4, Settings(max_new_tokens=4, quiet=quiet))
        out = io.StringIO()
        assert run_chat(s, Screen(out, err, panel=panel), None, reader(["hello there"])) == 0
        return out.getvalue()

    piped, tty, quiet = io.StringIO(), TtyIO(), TtyIO()
    reply = chat(piped)
    assert chat(tty) == reply and chat(quiet, quiet=True) == reply  # the reply is unchanged
    assert "ETA" not in piped.getvalue()
    assert "tok/s  ETA" in tty.getvalue() and "ETA" not in quiet.getvalue()
