"""Interactive chat: read a message, stream the reply, keep the conversation.

Ctrl-C during a reply stops it after the current step (the conversation keeps what was shown);
Ctrl-C at the prompt, a second Ctrl-C during a reply, Ctrl-D or /exit quit.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

from ftchat.errors import FtchatError
from ftchat.session import Session, StepRecord
from ftchat.ui.panel import Screen, figure_rows, summary_line
from ftchat.ui.text import ReplyText, printable

PROMPT, MORE = ">>> ", "... "
FENCE = '"""'
HELP = """\
/exit   quit (also Ctrl-D)          /reset  forget the conversation
/stats  figures of the last reply   /help   this text
Multi-line: end a line with \\ to continue it, or put the message between \"\"\" lines.
Ctrl-C stops a reply and keeps the conversation; Ctrl-C at the prompt quits."""


def read_message(read: Callable[[str], str]) -> str:
    """One message from `read` (input): trailing-backslash continuation or a \"\"\" block.

    Raises EOFError / KeyboardInterrupt as `read` does.
    """
    line = read(PROMPT)
    if line.strip().startswith(FENCE):
        body = line.strip()[len(FENCE):]
        if body.endswith(FENCE):  # """one line"""
            return body[: -len(FENCE)]
        lines = [body] if body else []
        while not (line := read(MORE)).rstrip().endswith(FENCE):
            lines.append(line)
        last = line.rstrip()[: -len(FENCE)]
        return "\n".join(lines + ([last] if last else []))
    parts = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        line = read(MORE)
    return "\n".join(parts + [line])


class _CtrlC:
    """SIGINT while a reply runs: the first asks it to stop, a second one quits."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _CtrlC:
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)


def run_chat(session: Session, screen: Screen, system: str | None,
             read: Callable[[str], str] = input) -> int:
    """The chat loop; returns the exit code (0, or 130 when quit with Ctrl-C)."""
    _enable_line_editing()
    last: StepRecord | None = None
    while True:
        try:
            text = read_message(read)
        except EOFError:
            screen.note("")
            return 0
        except KeyboardInterrupt:
            screen.note("")
            return 130
        command = text.strip()
        if not command:
            continue
        if command.startswith("/") and "\n" not in command:
            if command in ("/exit", "/quit", "/bye"):
                return 0
            _command(command, session, screen, last)
            continue
        try:
            ids = session.turn_ids(text, system)
            last = _reply(session, screen, ids) or last
        except KeyboardInterrupt:
            screen.note("")
            return 130
        except FtchatError as e:
            screen.note(f"error: {e}")


def _command(command: str, session: Session, screen: Screen, last: StepRecord | None) -> None:
    if command == "/reset":
        session.reset()
        screen.note("conversation cleared")
    elif command == "/stats":
        context = f"{session.context_used}/{session.max_len}"
        for label, value in figure_rows(last.figures if last else None, context):
            screen.note(f"{label:>18}  {value}")
    elif command == "/help":
        screen.note(HELP)
    else:
        screen.note(f"unknown command {command}: /help lists them")


def _reply(session: Session, screen: Screen, ids: list[int]) -> StepRecord | None:
    """Stream one reply; returns its last record (None if nothing was generated)."""
    replies = session.chat(ids)  # raises here when the turn does not fit
    decoder, last, ends_line = ReplyText(session.tokenizer), None, True
    with _CtrlC() as ctrl_c, screen.live() as out:
        try:
            for rec in replies:
                last = rec
                if rec.stop != "eos":  # the stop token ends the turn; it is not text
                    text = printable(decoder.feed(rec.token))
                    out.write(text)
                    ends_line = text.endswith("\n") if text else ends_line
                out.show(rec.figures)
                if ctrl_c.requested:
                    break
        finally:
            replies.close()  # at a step boundary: the conversation state stays whole
        text = printable(decoder.flush())
        out.write(text + ("" if (text.endswith("\n") if text else ends_line) else "\n"))
    if ctrl_c.requested and (last is None or last.stop is None):
        screen.note("[interrupted]")
    if last is not None:
        screen.note(summary_line(last))
    return last


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (input() gains history and line editing)
    except ImportError:
        pass
