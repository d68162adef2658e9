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
    out, err = io.StringIO(), io.StringIO()
    assert run_chat(s, Screen(out, err, panel=False), None, reader([ending])) == code
    # the prompt's line is ended where the prompt was drawn (stdout), not on stderr: with
    # stderr redirected the shell's prompt would follow `>>> ^C` on the same line
    assert (out.getvalue(), err.getvalue()) == ("\n", "")


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
    assert rows == {"decode tok/s": "-", "prefill tok/s": "-", "tokens": "-", "context": "-"}
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
                    "eval 500.0 ms / 31 runs (62.0 tok/s) | misses/token 2.50")


def test_summary_shows_only_what_the_backend_reports():
    from ftchat.session import StepRecord

    f = Figures(17, 0.25, 31, 0.5, 32, 49, 4096)  # the resident backend on the CPU: no offload
    line = summary_line(StepRecord(0, 7, 32, "eos", 17, 0.25, 0.5, f), "50/4096")
    assert line.startswith("32 tokens, context 50/4096 | prompt eval") and line.endswith("tok/s)")
    assert "misses" not in line and "hit rate" not in line and " - " not in line


def test_cpu_figures_leave_out_what_does_not_apply():
    f = Figures(10, 0.5, 4, 0.2, 5, 14, 4096)  # CPU, resident experts: no VRAM, no offload
    assert [label for label, _ in figure_rows(f)] == ["decode tok/s", "prefill tok/s", "tokens",
                                                      "context"]
    f = Figures(10, 0.5, 4, 0.2, 5, 14, 4096, offload={"misses_per_token": None, "hit_rate": 0.5})
    assert dict(figure_rows(f))["misses/token"] == "-"  # reported, not known yet
    assert "precision" not in dict(figure_rows(f))


FULL = Figures(12345, 0.5, 4000, 0.2, 40000, 32768, 32768, vram_used=3 * 2**30,
               vram_peak=2**32, offload={"misses_per_token": 11.25, "hit_rate": 0.9,
                                         "prefetch_copies": 1234567, "useful_prefetches": 1000000,
                                         "precision": 0.81, "copy_gbps": 48.04})


@pytest.mark.parametrize("width", [80, 60, 120])
def test_panel_fits_the_width_and_cuts_no_field(width):
    from ftchat.ui.panel import figures_text

    text = figures_text(FULL, "3/10 replies", width).plain
    lines = text.split("\n")
    assert all(len(ln) <= width for ln in lines), lines
    for label, value in figure_rows(FULL):  # every field whole, on one line
        assert any(f"{label} {value}" in ln for ln in lines), (label, lines)
    if width == 120:
        assert len(lines) <= 4


def test_panel_is_not_cut_at_80_columns_in_rich():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=80, color_system=None)
    w = PanelWriter(console, None)
    with w.live:
        w.show(FULL)
        w.live.refresh()
    text = buf.getvalue()
    for label, value in figure_rows(FULL):
        assert f"{label} {value}" in text, label  # not cut: "VRAM us", "precisio"


@pytest.mark.parametrize("width", [80, 100])
def test_timing_line_wraps_between_parts(width):
    from ftchat.session import StepRecord
    from ftchat.ui.panel import fit, summary_parts

    parts = summary_parts(StepRecord(0, 7, 4000, "length", 12345, 0.5, 0.2, FULL), "32768/32768")
    text = fit(parts, width)
    assert all(len(ln) <= width for ln in text.split("\n")), text
    assert text.replace("\n  ", " | ") == " | ".join(parts)  # nothing lost, only wrapped
    assert fit(parts, None) == " | ".join(parts)  # not a terminal: one line


def test_clear_is_an_alias_of_reset(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=6))
    out, err = io.StringIO(), io.StringIO()
    code = run_chat(s, Screen(out, err, panel=False), None, reader(["hello", "/clear", "hello"]))
    assert code == 0
    assert "conversation cleared" in err.getvalue() and "unknown command" not in err.getvalue()
    replies = out.getvalue().rstrip("\n").split("\n")
    assert replies[0] == replies[-1]  # the same reply after /clear: the conversation was reset


def test_timing_line_context_agrees_with_stats(tiny_nvfp4):
    # Before: the timing line said context 102/4096 and /stats right after 103/4096. The right
    # number is the conversation's: the reply's tokens and the <|im_end|> that closes the turn,
    # which the next turn starts from (and which "the conversation is full" counts).
    import re

    for first in ("hello", "The quick brown fox jumps over the lazy dog."):  # eos / length
        s = Session.open(tiny_nvfp4, Settings(max_new_tokens=16))
        err = io.StringIO()
        run_chat(s, Screen(io.StringIO(), err, panel=False), None, reader([first, "/stats"]))
        timing = re.search(r"context (\d+)/4096 \|", err.getvalue()).group(1)
        stats = re.search(r"context  (\d+)/4096", err.getvalue()).group(1)
        assert int(timing) == int(stats) == s.context_used, err.getvalue()


def test_chat_json_writes_one_object_per_reply(tiny_nvfp4):
    import json

    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=6))
    ref = Session.open(tiny_nvfp4, Settings(max_new_tokens=6))
    out = io.StringIO()
    code = run_chat(s, Screen(out, io.StringIO(), panel=False), None, reader(["hello", "more"]),
                    as_json=True)
    assert code == 0
    objs = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    assert [o["index"] for o in objs] == [0, 1]
    want = [[r.token for r in ref.chat(ref.turn_ids("hello"))],
            [r.token for r in ref.chat(ref.turn_ids("more"))]]
    assert [o["tokens"] for o in objs] == want
    assert all(o["stop"] in ("eos", "length") and "seed" not in o for o in objs)


def test_type_ahead_keeps_lines_edits_and_ctrl_d():
    from ftchat.ui.tty import TypeAhead

    t = TypeAhead()
    t.feed(b"helo\x7flo\rsecond \x1b[Aline\nwo")
    t.feed("rd\xc3".encode("latin-1") + b"\xa9 x\x17")  # UTF-8 split over two reads; Ctrl-W
    assert (t.lines, t.partial, t.eof) == (["hello", "second line"], "word\u00e9 ", False)
    t.feed(b"\x15\x04more")  # Ctrl-U erases the line; Ctrl-D on an empty line: end of input
    assert (t.partial, t.eof) == ("", True)


def test_terminal_replays_type_ahead_at_the_prompt():
    from ftchat.ui.tty import Terminal

    out = io.StringIO()
    term = Terminal(None, out)
    term.pending.feed(b"first\r\x04")
    assert term.read(">>> ") == "first"
    assert out.getvalue() == ">>> first\n"  # shown as if typed at the prompt
    with pytest.raises(EOFError):  # the Ctrl-D typed during the reply is not lost
        term.read(">>> ")
