"""Tool calls in a reply's content, parsed as the text streams.

Two forms, both inside `<tool_call>...</tool_call>`:
- Qwen3's JSON form: `{"name": "f", "arguments": {...}}`;
- the XML form (Qwen3-Coder's templates): `<function=f><parameter=p>value</parameter>
  </function>`; a value is typed by the tool's JSON schema when it names the type, else read
  as JSON where it parses and kept as a string otherwise.
A block that does not parse stays in the content as written, as does a block the reply never
closes. `ToolCallParser.feed` returns content text and whole calls in reply order.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_block(body: str, tools: list[dict] | None = None) -> ToolCall | None:
    """The call inside one <tool_call> block (its text without the tags), or None when it is
    malformed."""
    text = body.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())
    m = _FUNCTION.fullmatch(text)
    if m is None:
        return None
    name, inner = m.group(1), m.group(2)
    if _PARAMETER.sub("", inner).strip():
        return None  # text outside the parameters: not this form
    types = _parameter_types(tools or [], name)
    args = {p: _value(v, types.get(p)) for p, v in _PARAMETER.findall(inner)}
    return ToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id())


def _parameter_types(tools: list[dict], name: str) -> dict[str, str]:
    for t in tools:
        f = t.get("function", {})
        if f.get("name") == name:
            params = f.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            if not isinstance(props, dict):  # no schema to type the values by
                return {}
            return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _value(raw: str, kind: str | None) -> object:
    v = raw.removeprefix("\n").removesuffix("\n")
    if kind == "string":
        return v
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


class ToolCallParser:
    """feed(text) -> [str | ToolCall]: content pieces and calls in order; flush() at the end.
    Text that may be the start of `<tool_call>` is held back until it is decided."""

    def __init__(self, tools: list[dict]):
        self.tools = tools
        self.held = ""
        self.inside = False
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self.held += text
        out: list[str | ToolCall] = []
        while self.held:
            if not self.inside:
                i = self.held.find(OPEN)
                if i < 0:
                    keep = max((k for k in range(1, len(OPEN)) if self.held.endswith(OPEN[:k])),
                               default=0)
                    _add(out, self.held[:len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep:]
                    break
                _add(out, self.held[:i])
                self.held, self.inside = self.held[i:], True
            j = self.held.find(CLOSE)
            if j < 0:
                break  # the block is still open
            block = self.held[:j + len(CLOSE)]
            self.held, self.inside = self.held[j + len(CLOSE):], False
            call = parse_block(block[len(OPEN):-len(CLOSE)], self.tools)
            if call is None:
                _add(out, block)  # malformed: the text stays content
            else:
                self.calls += 1
                out.append(call)
        return out

    def flush(self) -> list[str | ToolCall]:
        held, self.held, self.inside = self.held, "", False
        return [held] if held else []


def _add(out: list[str | ToolCall], text: str) -> None:
    if text:
        out.append(text)
