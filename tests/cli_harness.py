"""Running the CLI in tests: `run_main` in this process (stdin given, output captured), and
ftchat as a real process: the child's environment, a subprocess runner, a pseudo-terminal
(pexpect) with its terminal modes, and a tiny checkpoint that never stops by itself (a chat reply
that runs until it is interrupted).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import termios
import time
from pathlib import Path

import pexpect

from ftchat import engine
from ftchat.cli import main
from ftchat.model.synth import write_checkpoint
from ftchat.session import Session

CLI = [sys.executable, "-m", "ftchat.cli"]


def run_main(argv, capsys, monkeypatch, stdin: bytes | str = b"") -> tuple[int, str, str]:
    """ftchat.cli.main(argv) in this process with `stdin` as its standard input (FTCHAT_DEBUG
    unset): (exit code, stdout, stderr) of the call alone."""
    capsys.readouterr()
    monkeypatch.delenv("FTCHAT_DEBUG", raising=False)
    data = stdin.encode() if isinstance(stdin, str) else stdin
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def reply_ids(s: Session, messages: list[dict], n: int) -> list[int]:
    """What a reply must contain: the engine's greedy tokens, up to and with the first stop id."""
    ids = s.encode_messages(messages)
    out = []
    for step in engine.generate(s.model, [ids], n, s.experts):
        out.append(step.tokens[0])
        if out[-1] in s.tokenizer.eos_ids:
            break
    return out


def child_env(*, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This environment for a child ftchat, without FREETOKEN_MOE_* and the names in `drop`:
    one intra-op thread, TERM=dumb, then `extra` (TERM="xterm" for a chat in a pty)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FREETOKEN_MOE_") and k not in drop}
    return {**env, "OMP_NUM_THREADS": "1", "TERM": "dumb", **extra}


def run(cmd: list[str], env: dict[str, str], *, timeout: float = 120,
        **kw) -> subprocess.CompletedProcess:
    """cmd run to its end, stdout and stderr captured as text (kw: stdin, input, preexec_fn)."""
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def spawn(args: list[str], env: dict[str, str], *, rows: int = 40, columns: int = 200,
          timeout: float = 90) -> pexpect.spawn:
    """This Python with `args` in a pseudo-terminal of rows x columns, read as UTF-8 text."""
    return pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=timeout,
                         dimensions=(rows, columns))


def send_at_prompt(child: pexpect.spawn, line: str) -> None:
    """Wait for the chat prompt, type `line` and wait for its echo: the reply comes after it."""
    child.expect_exact(">>> ")
    child.sendline(line)
    child.expect_exact(line + "\r\n")


def quit_chat(child: pexpect.spawn) -> None:
    """At the next chat prompt, /exit, and wait for the process to end."""
    child.expect_exact(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def local_modes(fd: int) -> int:
    """The terminal's local modes (termios lflag: ECHO, ICANON, ...)."""
    return termios.tcgetattr(fd)[3]


def wait_for_echo_off(child: pexpect.spawn, seconds: float = 30) -> None:
    """Until the pty's echo is off: the chat's reply or its line editor has the terminal."""
    deadline = time.monotonic() + seconds
    while local_modes(child.child_fd) & termios.ECHO:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def endless_checkpoint(tmp_path_factory, fmt: str) -> Path:
    """A tiny checkpoint whose stop tokens never win: lm_head rows of the eos ids are zero."""

    def no_eos(name, t):
        if name == "lm_head.weight":
            t = t.clone()
            t[[507, 509]] = 0  # <|endoftext|>, <|im_end|> of the tiny vocab
        return t

    return write_checkpoint(tmp_path_factory.mktemp("ck") / "endless", "tiny", fmt=fmt, seed=1,
                            weights_fn=no_eos)
