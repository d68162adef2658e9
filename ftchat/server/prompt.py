"""Chat messages to prompt token ids with the model's chat template, and where the prompt may
be checkpointed for prefix reuse.

A template that renders `tools` itself (Qwen3's) gets the request's messages and tools as they
are. For one that does not (the demo model's ChatML), ftchat writes Qwen3's tool preamble into
the system message, an assistant's tool calls as `<tool_call>` JSON blocks and a tool result as
a user turn holding `<tool_response>`: the form Qwen3's own template renders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ftchat.errors import ModelError
from ftchat.model.tokenizer import Tokenizer
from ftchat.server.protocol import bad
from ftchat.server.reasoning import think_open

_PROBE = "ftchat_probe_tool_7d1e"
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call>")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str
    splits: tuple[int, ...]  # token counts where a state checkpoint is worth keeping
    think_open: bool  # the reply starts inside a think block


class ChatRenderer:
    """Renders requests for one tokenizer; learns once whether its template renders tools."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        probe = [{"type": "function", "function": {"name": _PROBE, "parameters": {}}}]
        try:
            text = tokenizer.render_chat([{"role": "user", "content": "x"}],
                                         variables={"tools": probe})
        except ModelError:
            text = ""
        self.template_tools = _PROBE in text
        self.xml_form = self.template_tools and "<function=" in text

    def render(self, messages: list[dict], tools: list[dict], kwargs: dict,
               generation: bool = True) -> str:
        variables = {k: v for k, v in kwargs.items()
                     if k not in ("messages", "add_generation_prompt", "tools")}
        if self.template_tools:
            if tools:
                variables["tools"] = tools
            messages = [_object_arguments(m) for m in messages]
        else:
            messages = _inline_tools(messages, tools)
        try:
            return self.tok.render_chat(messages, add_generation_prompt=generation,
                                        variables=variables)
        except Exception as e:  # noqa: BLE001 - ModelError, or a template's own TypeError
            raise bad(f"the chat template refused the messages: {e}", "messages") from None

    def prompt(self, messages: list[dict], tools: list[dict], kwargs: dict) -> Prompt:
        text = self.render(messages, tools, kwargs)
        ids = self.tok.encode(text)
        splits = []
        # the system (and tools) prefix, shared by the main turns and the side calls; then
        # the history without the generation prompt (the next turn shares it)
        cuts = [1] if messages[0]["role"] == "system" and len(messages) > 1 else []
        for k in [*cuts, len(messages)]:
            try:
                part = self.tok.encode(self.render(messages[:k], tools, kwargs, generation=False))
            except Exception:  # noqa: BLE001 - a template may refuse a partial conversation
                continue
            if 0 < len(part) < len(ids) and ids[:len(part)] == part:
                splits.append(len(part))
        return Prompt(ids, text, tuple(sorted(set(splits))), think_open(text))


def _object_arguments(m: dict) -> dict:
    """The message with its calls' arguments as objects where they are JSON object text: OpenAI
    clients send text, templates that render calls iterate them (Qwen3-Coder's
    `arguments|items`); vLLM converts them the same way. Other text stays as given."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        args = c["function"].get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):  # not JSON, or past the parser's limits
                pass
            if isinstance(args, dict):
                c = {**c, "function": {**c["function"], "arguments": args}}
        calls.append(c)
    return {**m, "tool_calls": calls}


def _inline_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages for a template without tool support: tools in the system message, calls and
    results as text (Qwen3's rendering)."""
    out = []
    if tools:
        block = TOOLS_PREAMBLE + "".join(
            "\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FORMAT
        if messages[0]["role"] == "system":
            block = messages[0]["content"] + "\n\n" + block
            messages = messages[1:]
        out.append({"role": "system", "content": block})
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            for c in m["tool_calls"]:
                f = c["function"]
                args = f.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                call = json.dumps({"name": f["name"], "arguments": args}, ensure_ascii=False)
                content += ("\n" if content else "") + f"<tool_call>\n{call}\n</tool_call>"
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # consecutive results: one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "tool_responses": True})
        else:
            out.append({"role": m["role"], "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]
