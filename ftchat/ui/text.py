"""Generated text as shown: a terminal must not run control codes a model emits, a plain batch
reply must stay on one line, and an empty think block is not worth showing."""

from __future__ import annotations

from collections.abc import Sequence

from ftchat.model.tokenizer import StreamDecoder
from ftchat.session import StopText

_LINE_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _control(c: str) -> bool:
    o = ord(c)
    return o < 0x20 or 0x7F <= o < 0xA0 or c in "\u2028\u2029"


def _escape(c: str) -> str:
    if c in _LINE_ESCAPES:
        return _LINE_ESCAPES[c]
    if _control(c):
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    return c


def one_line(text: str) -> str:
    """Backslash escapes for `\\`, newline, CR, tab (`\\n`, ...) and other controls (`\\x1b`)."""
    return "".join(map(_escape, text))


def printable(text: str) -> str:
    """Text for a terminal: newlines, tabs and backslashes kept, other controls escaped."""
    return "".join(c if c in "\n\t\\" or not _control(c) else _escape(c) for c in text)


def plural(n: int, one: str, many: str | None = None) -> str:
    """`1 reply`, `2 replies`: the count and the noun that agrees with it."""
    return f"{n} {one if n == 1 else many or one + 's'}"


class ReplyText:
    """The text of a streamed reply as shown (plain output; --json keeps the exact text): ids
    decoded incrementally, without an empty think block at its start. The chat template opens
    `<think>` in the prompt, so a model that does not reason starts its reply with `</think>`
    and blank lines, and a small one may close it more than once (the demo model answers "hi"
    with `</think>` twice): every `</think>` before the first other text is dropped, with the
    whitespace around it. A block with reasoning in it is shown as generated.

    With stop strings the text ends before the first one (the rule of StopText, applied to the
    text as generated, before the think block is looked at)."""

    CLOSE = "</think>"

    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.decoder = StreamDecoder(tokenizer)
        self.stop = StopText(stops)
        self.held = ""  # the reply's start while it may still be an empty think block
        self.closed = False  # a `</think>` was dropped: the newlines after it go too
        self.passing = False  # past the start: text goes through as is

    def feed(self, token_id: int) -> str:
        return self._filter(self.stop.feed(self.decoder.feed(token_id)))

    def flush(self) -> str:
        out = self._filter(self.stop.feed(self.decoder.flush()) + self.stop.flush())
        if not self.passing:
            out += self._release()
        self.passing = True
        return out

    def _release(self) -> str:
        out = self.held.lstrip("\n") if self.closed else self.held
        self.held = ""
        return out

    def _filter(self, text: str) -> str:
        if self.passing:
            return text
        self.held += text
        while True:
            head = self.held.lstrip()
            if head.startswith(self.CLOSE):  # one more empty close: drop it and look again
                self.held, self.closed = head[len(self.CLOSE):], True
                continue
            if self.CLOSE.startswith(head):  # undecided: whitespace, or part of the tag so far
                return ""
            self.passing = True
            return self._release()


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(reply: str) -> tuple[str, str]:
    """(reasoning, answer) of a reply to a prompt that opened a think block: the reasoning is
    the text before the first `</think>` (newlines around it dropped), the answer what follows,
    without the further `</think>` and blank lines a model may repeat before it. A reply that
    never closes the block is all answer, reasoning "" (a model that does not reason)."""
    head, close, rest = reply.partition(THINK_CLOSE)
    if not close:
        return "", reply
    while True:
        rest = rest.lstrip("\n")
        if not rest.startswith(THINK_CLOSE):
            break
        rest = rest[len(THINK_CLOSE):]
    return head.removeprefix(THINK_OPEN).strip("\n"), rest
