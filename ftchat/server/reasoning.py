"""Split a reply's text into the think block (`reasoning_content`) and the answer (`content`),
piece by piece as it streams.

The chat template opens `<think>` in the prompt (Qwen3 style), so a reply starts inside the
block unless the prompt closed it (enable_thinking false). A reply that opens the block itself
(`<think>` first) is handled too. The newlines around the tags are dropped, as the template
drops them when it renders an earlier turn.
"""

from __future__ import annotations

from ftchat.model.tokenizer import END_THINK, THINK


def think_open(prompt: str) -> bool:
    """Whether `prompt` ends inside a think block (its last <think> is not closed)."""
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


class ReasoningSplitter:
    """feed(text) -> (reasoning, content) pieces; flush() at the end of the reply."""

    def __init__(self, open_block: bool):
        self.mode = "reasoning" if open_block else "start"  # start: a <think> may come first
        self.held = ""  # text that may be the start of a tag
        self.reasoning_started = self.content_started = False
        self.newlines = ""  # reasoning's trailing newlines: dropped if </think> follows

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning, content = "", ""
        while self.held:
            if self.mode == "start":
                if THINK.startswith(self.held) or self.held.startswith(THINK):
                    if len(self.held) < len(THINK):
                        break  # may still become <think>
                    self.held, self.mode = self.held[len(THINK):], "reasoning"
                    continue
                self.mode = "content"
            if self.mode == "reasoning":
                i = self.held.find(END_THINK)
                if i >= 0:
                    reasoning += self._reasoning(self.held[:i])
                    self.held, self.mode = self.held[i + len(END_THINK):], "content"
                    self.newlines = ""
                    continue
                keep = _partial_tail(self.held, END_THINK)
                reasoning += self._reasoning(self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
            if not self.content_started:  # a model may repeat </think> before its answer
                rest = self.held.lstrip("\n")
                if rest.startswith(END_THINK):
                    self.held = rest[len(END_THINK):]
                    continue
                if rest and END_THINK.startswith(rest):
                    break  # may still become a repeated </think>
            content += self._content(self.held)
            self.held = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.mode == "reasoning":
            return self._reasoning(held), ""  # an unclosed block: its last newlines dropped
        return "", self._content(held)

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_started:
            text = text.lstrip("\n")
            self.reasoning_started = bool(text)
        text = self.newlines + text
        body = text.rstrip("\n")
        self.newlines = text[len(body):]
        return body

    def _content(self, text: str) -> str:
        if not self.content_started:
            text = text.lstrip("\n")
            self.content_started = bool(text)
        return text


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)
