"""Making generated text safe to show: a terminal must not run control codes a model emits, and
a plain batch reply must stay on one line."""

from __future__ import annotations

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
