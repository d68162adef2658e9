"""The process around a command: its standard streams and the signals that stop it.

`standard_streams` makes a closed stdin or stderr harmless before anything runs: a closed file
descriptor 0, 1 or 2 would otherwise be reused by the next file ftchat opens (a result file
would receive the replies), Python leaves `sys.stdin`/`sys.stderr` as None, and `print(...,
file=None)` writes to stdout. A closed stdout is refused: the replies have nowhere to go.

`stop_signals` turns SIGTERM and SIGHUP into `Terminated`, raised in the main thread, so that
they unwind as Ctrl-C does: every `finally` runs (a synth's temporary folder and a result file's
temporary name removed, the chat terminal's echo and line mode restored) before the exit.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TextIO

from ftchat.errors import FtchatError, StdoutError, Terminated

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def standard_streams() -> None:
    """Give a closed stdin or stderr /dev/null (stdin: no input; stderr: messages dropped, the
    exit status still tells); refuse a closed stdout (FtchatError, written to stderr). The real
    stdout becomes a `CheckedStdout`."""
    for fd, name, mode in ((0, "stdin", "r"), (2, "stderr", "w")):
        if not _fd_open(fd) or getattr(sys, name) is None:
            if not _fd_open(fd):
                null = os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY)
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)
            setattr(sys, name, open(fd, mode, encoding="utf-8", errors="replace",
                                    closefd=False))
    if not _fd_open(1) or sys.stdout is None:
        null = os.open(os.devnull, os.O_WRONLY)  # takes fd 1 if closed: no file lands there
        if null != 1 and not _fd_open(1):
            os.dup2(null, 1)
            os.close(null)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        raise FtchatError("stdout is closed: ftchat writes its output there; redirect it to a "
                          "file or to /dev/null")
    if sys.stdout is sys.__stdout__:  # the real one (tests capture theirs)
        sys.stdout = CheckedStdout(sys.stdout)


class CheckedStdout:
    """The process's stdout, its write errors named: `StdoutError` instead of a bare OSError
    (which could be any file's). A closed pipe stays BrokenPipeError."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to stdout: {e.strerror or e}") from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to stdout: {e.strerror or e}") from None

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Terminated` while the block runs (main thread only)."""
    previous = {}
    try:
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, _raise_terminated)
    except ValueError:  # not the main thread (tests calling main() from a worker)
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
