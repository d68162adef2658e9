"""Chat in a real pseudo-terminal (pexpect): keys typed while a reply streams (echo
off, nothing lost, nothing sent unseen), Ctrl-D typed during a reply, Ctrl-C at the prompt with
stderr redirected, and output at 80 columns.

Each test starts ftchat (~2 s of torch import) on a tiny checkpoint that never stops by itself.
"""

from __future__ import annotations

import re

import pexpect
import pytest

from tests.cli_harness import CLI, child_env, endless_checkpoint, quit_chat, send_at_prompt, spawn

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


def plain(text: str) -> str:
    return ANSI.sub("", text)


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    return endless_checkpoint(tmp_path_factory, "nvfp4-modelopt")


# runs ftchat with stderr sent to /dev/null (as `2>/dev/null` would), stdin/stdout the pty
NO_STDERR = ("import os, sys; fd = os.open(os.devnull, os.O_WRONLY); os.dup2(fd, 2); "
             "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def chat(model, *flags, columns=200, no_stderr=False):
    args = [*CLI[1:], "run", str(model), "--threads", "1", *flags]
    if no_stderr:
        args = ["-c", NO_STDERR, *args]
    return spawn(args, child_env(TERM="xterm", COLUMNS="", LINES=""), columns=columns)


TIMING = r"\d+ tokens, context \d+/\d+ \| prompt eval"


def test_keys_typed_during_a_reply_wait_for_the_next_prompt(endless):
    child = chat(endless, "--max-new-tokens", "150", "--no-panel")
    try:
        send_at_prompt(child, "hello")
        child.expect(r"\S")  # the reply streams
        child.send("/sta")  # type-ahead: a finished line, then the start of another
        child.send("ts\r")
        child.send("/he")
        child.expect(TIMING)
        reply = plain(child.before)
        assert "/sta" not in reply and "/he" not in reply  # echo was off: the reply is intact
        # the finished line is shown after the prompt and sent; the unfinished one waits in
        # the next prompt's line editor
        child.expect_exact(">>> /stats")
        child.expect_exact("decode tok/s")
        child.expect(r">>> (\x1b\[[0-9;?]*[A-Za-z]|\r)*(>>> )?/he")
        child.send("lp\r")  # completes the kept "/he"
        child.expect_exact("/stats  figures of the last reply")  # /help ran
        quit_chat(child)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_d_typed_during_a_reply_quits_after_it(endless):
    child = chat(endless, "--max-new-tokens", "120", "--no-panel")
    try:
        send_at_prompt(child, "hello")
        child.expect(r"\S")
        child.sendeof()  # before: lost, the chat waited at the next prompt
        child.expect(TIMING)
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_at_the_prompt_ends_its_line_with_stderr_redirected(endless):
    child = chat(endless, "--max-new-tokens", "3", no_stderr=True)
    try:
        child.expect_exact(">>> ")
        child.sendintr()
        child.expect(pexpect.EOF)
        tail = plain(child.before)
    finally:
        child.close()
    # before: nothing after `>>> `: the newline went to the redirected stderr, and the shell's
    # next prompt was drawn on the same line
    assert tail.endswith("\n") and "Traceback" not in tail, repr(tail)
    assert child.exitstatus == 130


def test_chat_at_80_columns(endless):
    child = chat(endless, "--max-new-tokens", "60", columns=80)  # the panel: on, a terminal
    try:
        child.expect_exact(">>> ")
        banner = plain(child.before)
        child.sendline("hello")
        child.expect_exact(">>> ")
        shown = plain(child.before)
        child.sendline("/stats")
        child.expect_exact(">>> ")
        stats = plain(child.before)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        drawn = plain(child.before)
    finally:
        child.close()
    assert child.exitstatus == 0
    lines = shown.split("\n")
    first = next(i for i, ln in enumerate(lines) if re.match(r"\d+ tokens, context", ln))
    timing = lines[first:first + 1] + [ln for ln in lines[first + 1:] if ln.startswith("  ")]
    assert " | eval " in " | ".join(timing).replace("\n  ", " | ") or len(timing) > 1
    assert all(len(ln) <= 80 for ln in timing), timing  # before: one line of ~140 columns
    assert any(ln.startswith("  eval ") for ln in timing), timing  # wrapped between parts
    # the CPU with every expert resident: no VRAM and no offload figures, in the panel or /stats
    assert "decode tok/s" in stats and "context" in stats
    for field in ("VRAM", "misses/token", "hit rate", "precision", "copy GB/s"):
        assert field not in stats and field not in shown, field
    assert "Traceback" not in banner + shown + stats + drawn
