"""`ftchat run`: pick the mode (interactive chat, --prompt, piped batch), load, and hand over."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TextIO

from ftchat.errors import FtchatError
from ftchat.model.config import check_context, load_args
from ftchat.resolve import demo_notice, ResolvedModel, resolve_model
from ftchat.session import Session
from ftchat.settings import Settings
from ftchat.ui.batch import Job, parse_jobs, run_batch
from ftchat.ui.chat import run_chat
from ftchat.ui.panel import Screen, isatty
from ftchat.ui.progress import progress_bar


def run(model: str | None, settings: Settings, env: Mapping[str, str], stdin: TextIO,
        stdout: TextIO, stderr: TextIO) -> int:
    """Chat when stdin is a terminal, else one reply per piped prompt; returns the exit code."""
    screen = Screen(stdout, stderr, settings.panel)
    interactive = settings.prompt is None and isatty(stdin)
    jobs: list[Job] = []
    if settings.prompt is not None:
        jobs = [Job(settings.prompt, settings.system)]
    elif not interactive:
        jobs = parse_jobs(read_text(stdin), settings.system)  # before loading: fail fast
        if not jobs:
            screen.note("ftchat: no prompts on stdin, nothing to do")
            return 0
    resolved = resolve_model(model, env)
    session = open_session(resolved, settings, screen)
    try:
        if not interactive:
            return run_batch(session, screen, jobs, settings.json,
                             one_shot=settings.prompt is not None)
        if settings.json:
            screen.note("note: --json applies to piped input and --prompt, not to chat")
        screen.note("/help for commands, Ctrl-C stops a reply, Ctrl-D or /exit quits")
        return run_chat(session, screen, settings.system)
    finally:
        session.close()


def open_session(resolved: ResolvedModel, settings: Settings, screen: Screen) -> Session:
    check_context(load_args(resolved.path), settings.context)  # before the KV cache is sized
    if resolved.demo:
        screen.note(demo_notice(resolved.path))
    t = time.perf_counter()
    with progress_bar(screen.err, "loading") as progress:
        session = Session.open(resolved.path, settings, progress)
    screen.note(f"ftchat: {resolved.name}: {session.describe()}; loaded in "
                f"{time.perf_counter() - t:.1f} s")
    return session


def read_text(stdin: TextIO) -> str:
    raw = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read()
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FtchatError(f"stdin is not UTF-8 text ({e})") from None
