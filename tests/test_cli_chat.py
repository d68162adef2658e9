"""The chat loop and the display helpers, in-process (the pty test is in test_cli_subprocess)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ftchat import engine
from ftchat.session import Figures, Session
from ftchat.settings import Settings
from ftchat.ui.chat import read_message, run_chat
from ftchat.ui.panel import PanelWriter, Screen, figure_rows, summary_line
from ftchat.ui.text import one_line, printable


def reader(lines):
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            value = next(it)
        except StopIteration:
            raise EOFError from None
        if isinstance(value, BaseException):
            raise value
        return value

    return read


@pytest.mark.parametrize("lines, message", [
    (["plain"], "plain"),
    (["first \\", "second\\", "third"], "first \nsecond\nthird"),
    (['"""', "a", "", "b", '"""'], "a\n\nb"),
    (['"""start', "middle", 'end"""'], "start\nmiddle\nend"),
    (['"""one line"""'], "one line"),
    (["not \\ at the end"], "not \\ at the end"),
])
def test_read_message(lines, message):
    read = reader(lines)
    assert read_message(read) == message
    with pytest.raises(EOFError):  # every line was consumed
        read(">>> ")


def test_chat_loop(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=10))
    out, err = io.StringIO(), io.StringIO()
    script = ["hello", "/stats", "/reset", "hello", "   ", "/bogus", "/help", "/exit", "never read"]
    code = run_chat(s, Screen(out, err, panel=False), None, reader(script))
    assert code == 0
    ids = s.encode_messages([{"role": "user", "content": "hello"}])
    tokens = [st.tokens[0] for st in engine.generate(s.model, [ids], 10, s.experts)]
    end = next((i for i, t in enumerate(tokens) if t in s.tokenizer.eos_ids), len(tokens))
    reply = printable(s.tokenizer.decode(tokens[:end])) + "\n"
    assert out.getvalue() == reply * 2  # the same reply again after /reset
    log = err.getvalue()
    assert "decode tok/s" in log and "conversation cleared" in log
    assert "unknown command /bogus" in log and "/reset  forget the conversation" in log
    assert log.count(" | prompt eval ") == 2


@pytest.mark.parametrize("ending, code", [(EOFError(), 0), (KeyboardInterrupt(), 130)])
def test_chat_quits_on_ctrl_d_and_ctrl_c(tiny_nvfp4, ending, code):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=2))
    out = io.StringIO()
    assert run_chat(s, Screen(out, io.StringIO(), panel=False), None, reader([ending])) == code
    assert out.getvalue() == ""


def test_chat_reports_a_turn_that_does_not_fit(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=2, context=12))
    err = io.StringIO()
    code = run_chat(s, Screen(io.StringIO(), err, panel=False), None,
                    reader(["a long message that will not fit", "/exit"]))
    assert code == 0 and "error: the prompt has" in err.getvalue()


def test_text_escapes():
    assert one_line("a\nb\\c\td\re\x1b[31m\x7f\u2028") == "a\\nb\\\\c\\td\\re\\x1b[31m\\x7f\\u2028"
    assert printable("a\nb\\c\td\x1b[2J\x00é😀") == "a\nb\\c\td\\x1b[2J\\x00é😀"


def test_figures_show_dash_until_known():
    rows = dict(figure_rows(None))
    assert set(rows.values()) == {"-"} and len(rows) == 12
    f = Figures(10, 0.5, 4, 0.2, 5, 14, 4096, vram_used=3 * 2**30, vram_peak=2**32,
                offload={"misses_per_token": 1.25, "hit_rate": 0.9, "prefetch_copies": 1234,
                         "useful_prefetches": 1000, "precision": 0.81, "copy_gbps": 48.04})
    assert dict(figure_rows(f)) == {
        "decode tok/s": "20.0", "prefill tok/s": "20.0", "tokens": "5", "context": "14/4096",
        "VRAM used": "3.00 GiB", "VRAM peak": "4.00 GiB", "misses/token": "1.25",
        "hit rate": "90.0%", "prefetch copies": "1,234", "useful prefetches": "1,000",
        "precision": "81.0%", "copy GB/s": "48.0"}


def test_panel_keeps_text_and_figures_apart():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200, color_system=None)
    w = PanelWriter(console, None)
    f = Figures(10, 0.5, 4, 0.2, 5, 14, 4096)
    with w.live:
        w.write("first line\nsecond ")
        w.show(f)
        w.write("half\n")
        w.write("tail")
        w.live.refresh()
    assert w.line == "tail"
    text = buf.getvalue()
    assert "first line\n" in text and "second half\n" in text and "decode tok/s" in text


def test_summary_line():
    from ftchat.session import StepRecord

    f = Figures(17, 0.25, 31, 0.5, 32, 49, 4096, offload={"misses_per_token": 2.5})
    line = summary_line(StepRecord(0, 7, 32, "eos", 17, 0.25, 0.5, f))
    assert line == ("32 tokens, context 49/4096 | prompt eval 250.0 ms / 17 tokens (68.0 tok/s) | "
                    "eval 500.0 ms / 31 runs (62.0 tok/s) | misses/token 2.50 | hit rate -")
