"""The CLI as a real process: console script, one-line errors, and chat in a pseudo-terminal.

Few tests: each process start imports torch (~2 s).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from ftchat import engine
from ftchat.session import Session
from ftchat.settings import Settings
from ftchat.ui.text import printable
from tests.cli_harness import (CLI, child_env, endless_checkpoint, quit_chat, reply_ids, run,
                               send_at_prompt, spawn)

FTCHAT = Path(sys.executable).parent / "ftchat"  # the console script of pyproject.toml


def greedy(s: Session, ids: list[int], n: int) -> list[int]:
    return [step.tokens[0] for step in engine.generate(s.model, [ids], n, s.experts)]


def test_console_script_piped_and_json(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings())
    stdin = 'What is 2+2?\n\n{"prompt": "hello", "max_new_tokens": 4}\n'
    p = run([str(FTCHAT), "run", str(tiny_nvfp4), "--json", "--max-new-tokens", "7",
             "--no-panel"], child_env(), input=stdin)
    assert p.returncode == 0, p.stderr
    got = [json.loads(line)["tokens"] for line in p.stdout.splitlines()]
    want = [reply_ids(s, [{"role": "user", "content": text}], n)
            for text, n in (("What is 2+2?", 7), ("hello", 4))]
    assert got == want


def test_subprocess_error_is_one_line(tiny_nvfp4, tmp_path):
    bad = tmp_path / "ck"
    bad.mkdir()
    for f in tiny_nvfp4.iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[:100] if f.name.endswith("00001-of-00002.safetensors")
                                   else data)
    p = run([*CLI, "run", str(bad)], child_env(), input="hi\n")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ")
    assert "model-00001-of-00002.safetensors: unreadable safetensors file" in p.stderr


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    return endless_checkpoint(tmp_path_factory, "nvfp4-modelopt")


def test_interactive_chat_in_a_terminal(endless):
    child = spawn([*CLI[1:], "run", str(endless), "--max-new-tokens", "100000"], child_env(),
                  rows=50, timeout=60)
    try:
        send_at_prompt(child, "hello")
        time.sleep(1.0)
        child.sendintr()  # Ctrl-C mid-reply
        child.expect_exact("[interrupted]")
        shown = child.before
        child.expect(r"(\d+) tokens, context \d+/\d+ \| prompt eval")
        n = int(child.match.group(1))
        child.expect_exact(">>> ")  # the session survived
        child.sendline("/stats")
        child.expect(r"tokens  (\d+)")
        assert int(child.match.group(1)) == n
        quit_chat(child)
    finally:
        child.close()
    assert child.exitstatus == 0
    # The reply shown is the engine's greedy reply, as far as it got.
    s = Session.open(endless, Settings())
    tokens = greedy(s, s.encode_messages([{"role": "user", "content": "hello"}]), n)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown).replace("\r\n", "\n").replace("^C", "")
    assert n > 1 and shown.strip("\n") == printable(s.tokenizer.decode(tokens)).strip("\n")
