"""Interactive chat: read a message, stream the reply, keep the conversation.

Ctrl-C during a reply stops it after the current step (the conversation keeps what was shown);
Ctrl-C at the prompt, a second Ctrl-C during a reply, Ctrl-D or /exit quit. What is typed while
a reply streams is kept for the next prompt (ui/tty.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from itertools import chain
from types import FrameType

from dataclasses import replace

from ftchat.errors import FtchatError
from ftchat.session import Session, StepRecord
from ftchat.ui.batch import json_reply
from ftchat.ui.panel import Screen, figure_rows, summary_parts
from ftchat.ui.progress import PrefillProgress
from ftchat.ui.text import ReplyText, printable
from ftchat.ui.tty import Terminal

PROMPT, MORE = ">>> ", "... "
FENCE = '"""'
EXIT = ("/exit", "/quit", "/bye")
RESET = ("/reset", "/clear")
HELP = """\
/exit   quit (also /bye, Ctrl-D)    /reset  forget the conversation (also /clear)
/stats  figures of the last reply   /help   this text
Multi-line: end a line with \\ to continue it, or put the message between \"\"\" lines.
Ctrl-C stops a reply and keeps the conversation; Ctrl-C at the prompt quits.
What you type while a reply streams waits for the next prompt."""


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
             read: Callable[[str], str] | None = None, terminal: Terminal | None = None,
             as_json: bool = False) -> int:
    """The chat loop; returns the exit code (0, or 130 when quit with Ctrl-C).

    Args:
        read: reads one line after a prompt (default: the terminal's, with type-ahead).
        terminal: the terminal; None: no type-ahead handling (plain input()).
        as_json: each reply is one JSON object on stdout (as piped --json writes them).
    """
    _enable_line_editing()
    terminal = terminal or Terminal(None, screen.out)
    read = read or terminal.read
    last: StepRecord | None = None
    replies = 0
    while True:
        try:
            text = read_message(read)
        except (EOFError, KeyboardInterrupt) as e:
            _end_prompt_line(screen)  # the shell's prompt starts on a line of its own
            return 0 if isinstance(e, EOFError) else 130
        except UnicodeDecodeError as e:  # bytes the terminal's encoding cannot read
            screen.note(f"error: the line typed is not {e.encoding} text; type it again")
            continue
        command = text.strip()
        if not command:
            continue
        if command.startswith("/") and "\n" not in command:
            if command in EXIT:
                return 0
            _command(command, session, screen, last)
            continue
        try:
            ids = session.turn_ids(text, system)
            rec = _reply(session, screen, ids, terminal, replies if as_json else None)
            if rec is not None:
                last, replies = rec, replies + 1
        except KeyboardInterrupt:
            _end_prompt_line(screen)
            return 130
        except FtchatError as e:
            screen.note(f"error: {e}")


def _end_prompt_line(screen: Screen) -> None:
    """After Ctrl-C or Ctrl-D at the prompt: end its line where the prompt was drawn (stdout,
    as input() writes it), so that a redirected stderr cannot leave it unfinished."""
    try:
        screen.out.write("\n")
        screen.out.flush()
    except (OSError, ValueError):
        pass


def _command(command: str, session: Session, screen: Screen, last: StepRecord | None) -> None:
    if command in RESET:
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


def _reply(session: Session, screen: Screen, ids: list[int], terminal: Terminal,
           json_index: int | None = None) -> StepRecord | None:
    """Stream one reply (or, with json_index, write it as one JSON object once done); returns
    its last record (None if nothing was generated)."""
    progress = PrefillProgress.on(None if session.settings.quiet else screen.err)
    replies = session.chat(ids, progress.callback)  # raises here when the turn does not fit
    decoder = ReplyText(session.tokenizer, session.settings.stop)
    last, ends_line, tokens = None, True, []
    with _CtrlC() as ctrl_c, terminal.replying():
        records = _prefilled(replies, progress)
        with screen.live() as out:
            try:
                for rec in records:
                    last = rec
                    tokens.append(rec.token)
                    if json_index is None and rec.stop != "eos":  # the stop token is not text
                        text = printable(decoder.feed(rec.token))
                        out.write(text)
                        ends_line = text.endswith("\n") if text else ends_line
                    out.show(rec.figures)
                    terminal.poll()
                    if ctrl_c.requested:
                        break
            finally:
                replies.close()  # at a step boundary: the conversation state stays whole
            if json_index is not None:
                if last is not None:
                    final = last if last.stop else replace(last, stop="interrupted")
                    out.write(json_reply(session, json_index, final, tokens) + "\n")
            else:
                text = printable(decoder.flush())
                out.write(text + ("" if (text.endswith("\n") if text else ends_line) else "\n"))
    if ctrl_c.requested and (last is None or last.stop is None):
        screen.note("[interrupted]")
    if last is not None and not session.settings.quiet:
        # the conversation's context: the turn is closed now (its <|im_end|> counts), as /stats
        screen.note_parts(summary_parts(last, f"{session.context_used}/{session.max_len}"))
    return last


def _prefilled(replies: Iterator[StepRecord], progress: PrefillProgress) -> Iterator[StepRecord]:
    """`replies` with its first record (the prefill) already taken, under the prefill line:
    before the panel starts, as two live displays on one terminal would draw over each other."""
    with progress:
        first = next(replies, None)
    return chain([] if first is None else [first], replies)


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (input() gains history and line editing)
    except ImportError:
        pass
