"""A chat reply's text turned into OpenAI message deltas: reasoning, content, tool calls.

`ChatReply.feed(text)` returns the deltas a stream sends for a piece of the reply's text;
`finish()` the rest; `message()` the whole message of a non-streamed response. Whitespace
between tool calls (or after the last one) is not content.
"""

from __future__ import annotations

from ftchat.server.reasoning import ReasoningSplitter
from ftchat.server.tool_calls import ToolCall, ToolCallParser

FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "context": "length",
          "cancelled": "stop"}


class ChatReply:
    def __init__(self, think_open: bool, tools: list[dict]):
        self.split = ReasoningSplitter(think_open)
        self.parser = ToolCallParser(tools) if tools else None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.blank = ""  # whitespace-only content held until text (or a call) follows

    def feed(self, text: str) -> list[dict]:
        return self._deltas(*self.split.feed(text), final=False)

    def finish(self) -> list[dict]:
        return self._deltas(*self.split.flush(), final=True)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason in ("eos", "stop_string") else FINISH[reason]

    def message(self) -> dict:
        msg: dict = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls and msg["content"] is not None:
            msg["content"] = msg["content"].strip() or None
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict]:
        out: list[dict] = []
        if reasoning:
            self.reasoning.append(reasoning)
            out.append({"reasoning_content": reasoning})
        items: list[str | ToolCall] = [content] if content else []
        if self.parser is not None:
            items = self.parser.feed(content) + (self.parser.flush() if final else [])
        for item in items:
            if isinstance(item, ToolCall):
                self.blank = ""
                out.append({"tool_calls": [{"index": len(self.calls), **item.to_openai()}]})
                self.calls.append(item)
            elif not item.strip() and (self.calls or not self.content):
                self.blank += item  # maybe space between calls
            else:
                text, self.blank = self.blank + item, ""
                self.content.append(text)
                out.append({"content": text})
        if final and self.blank and not self.calls and self.content:
            self.content.append(self.blank)
            out.append({"content": self.blank})
            self.blank = ""
        return out
