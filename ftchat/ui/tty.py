"""The chat's terminal: the prompt, and what the user types while a reply streams.

While a reply streams the terminal's echo is off (so typed text cannot overwrite the reply) and
line mode too, so that ftchat reads every key as it comes: the type-ahead. Nothing typed is
lost or sent unseen: a line finished with Enter is shown after the next prompt, as if typed
there, and sent; an unfinished line is put into the next prompt for editing; a Ctrl-D quits
once the reply is done, as it would at the prompt. Ctrl-C keeps its meaning (the signal stays
on). This follows a shell's type-ahead, with the echo deferred to the prompt.
"""

from __future__ import annotations

import codecs
import os
import select
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

try:
    import termios
except ImportError:  # not a POSIX system: no type-ahead handling
    termios = None  # type: ignore[assignment]


class TypeAhead:
    """Keys typed during a reply, edited as a terminal's line mode would: Backspace, Ctrl-U
    (erase the line), Ctrl-W (erase a word); Enter ends a line; Ctrl-D on an empty line is the
    end of input; escape sequences (arrow keys) and other control keys are dropped."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.partial = ""
        self.eof = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._escape = ""  # an escape sequence under way

    def feed(self, data: bytes) -> None:
        for c in self._utf8.decode(data):
            self._key(c)

    def _key(self, c: str) -> None:
        if self.eof:
            return
        if self._escape:
            self._escape += c
            # ESC [ ... final (0x40-0x7e), ESC O x, or ESC x
            if len(self._escape) == 2 and c not in "[O":
                self._escape = ""
            elif len(self._escape) > 2 and ("@" <= c <= "~" or self._escape[1] == "O"):
                self._escape = ""
            return
        if c == "\x1b":
            self._escape = c
        elif c in "\r\n":
            self.lines.append(self.partial)
            self.partial = ""
        elif c in "\x7f\x08":
            self.partial = self.partial[:-1]
        elif c == "\x15":
            self.partial = ""
        elif c == "\x17":
            self.partial = self.partial.rstrip()
            self.partial = self.partial[: len(self.partial) - len(self.partial.split(" ")[-1])]
        elif c == "\x04":
            if not self.partial:
                self.eof = True
        elif c == "\t" or (ord(c) >= 0x20 and c != "\x7f"):
            self.partial += c


class Terminal:
    """Reads chat input on a terminal and keeps the type-ahead of a reply. Without a terminal
    (stdin not a tty, or tests) `read` is plain input() and `replying` does nothing."""

    def __init__(self, stdin: TextIO | None, stdout: TextIO | None):
        self.out = stdout or sys.stdout
        self.fd: int | None = None
        if termios is not None and stdin is not None:
            try:
                if stdin.isatty():
                    self.fd = stdin.fileno()
            except (AttributeError, OSError, ValueError):
                self.fd = None
        self.pending = TypeAhead()
        self._saved = None

    # ===== while a reply streams =====
    @contextmanager
    def replying(self) -> Iterator[None]:
        """Echo and line mode off for the reply; the keys typed meanwhile are kept."""
        if self.fd is None:
            yield
            return
        try:
            saved = termios.tcgetattr(self.fd)
        except termios.error:
            yield
            return
        quiet = list(saved)
        quiet[3] &= ~(termios.ECHO | termios.ICANON)  # lflag; ISIG stays: Ctrl-C works
        quiet[6] = list(saved[6])
        quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 0, 0
        termios.tcsetattr(self.fd, termios.TCSANOW, quiet)  # TCSANOW: keep typed input
        try:
            yield
        finally:  # also on SIGTERM/SIGHUP (raised as Terminated): the terminal is restored
            try:
                self.poll()
            finally:
                try:
                    termios.tcsetattr(self.fd, termios.TCSANOW, saved)
                except termios.error:  # the terminal is gone (hung up)
                    pass

    def poll(self) -> None:
        """Take in what has been typed (never waits)."""
        if self.fd is None:
            return
        while select.select([self.fd], [], [], 0)[0]:
            try:
                data = os.read(self.fd, 1024)
            except OSError:
                return
            if not data:
                return
            self.pending.feed(data)

    # ===== at the prompt =====
    def read(self, prompt: str) -> str:
        """One line, as input(prompt) reads it; type-ahead first: a finished line is shown and
        returned, an unfinished one is put into the line editor. EOFError after a Ctrl-D."""
        p = self.pending
        if p.lines:
            line = p.lines.pop(0)
            self.out.write(prompt + line + "\n")
            self.out.flush()
            _add_history(line)
            return line
        if p.eof:
            self.pending = TypeAhead()
            self.out.write(prompt)
            self.out.flush()
            raise EOFError
        partial, p.partial = p.partial, ""
        if not partial:
            return input(prompt)
        readline = _readline() if self.fd is not None and _isatty(self.out) else None
        if readline is None:  # no line editor: show it, and read the rest of the line
            self.out.write(prompt + partial)
            self.out.flush()
            return partial + input()

        def prefill() -> None:
            readline.insert_text(partial)
            readline.redisplay()

        readline.set_pre_input_hook(prefill)
        try:
            return input(prompt)
        finally:
            readline.set_pre_input_hook()


def _readline():
    mod = sys.modules.get("readline")
    return mod if mod is not None and hasattr(mod, "set_pre_input_hook") else None


def _add_history(line: str) -> None:
    readline = _readline()
    if readline is not None and line.strip():
        readline.add_history(line)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
