"""The server's text handling on golden strings: tool calls (both forms), the think block,
request checks, and the tools rendered into the prompt. Streams are fed split at every
position, so a tag cut between two chunks is covered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftchat.model.tokenizer import Tokenizer
from ftchat.sampling import Sampling
from ftchat.server.prompt import ChatRenderer
from ftchat.server.protocol import ApiError, parse_chat, parse_completion
from ftchat.server.reasoning import ReasoningSplitter, think_open
from ftchat.server.replies import ChatReply
from ftchat.server.tool_calls import ToolCall, ToolCallParser, parse_block

DEMO = Path(__file__).resolve().parents[1] / "ftchat" / "models" / "demo"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}


def feed_split(parser, text: str, at: list[int]) -> list:
    out, last = [], 0
    for i in [*at, len(text)]:
        out += parser.feed(text[last:i])
        last = i
    return out + parser.flush()


def merged(items: list) -> list:
    """Adjacent text pieces joined (a stream may cut text anywhere)."""
    out: list = []
    for x in items:
        if isinstance(x, str) and out and isinstance(out[-1], str):
            out[-1] += x
        else:
            out.append(x)
    return [(x.name, json.loads(x.arguments)) if isinstance(x, ToolCall) else x for x in out]


JSON_ONE = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' \
           '\n</tool_call>'
JSON_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n'
            '</tool_call>')
XML_ONE = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n'
           '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>')


@pytest.mark.parametrize("text, expected", [
    (JSON_ONE, ["Let me look.\n", ("get_weather", {"city": "Paris"})]),
    (JSON_TWO, [("get_weather", {"city": "Paris"}), "\n", ("get_weather", {"city": "Oslo"})]),
    (XML_ONE, [("get_weather", {"city": "New York", "days": 3})]),
    ('a <tool_call>{"name": "f", "arguments": {oops}}</tool_call> b',
     ['a <tool_call>{"name": "f", "arguments": {oops}}</tool_call> b']),  # malformed: content
    ('<tool_call>{"arguments": {}}</tool_call>', ['<tool_call>{"arguments": {}}</tool_call>']),
    ('x <tool_call>{"name": "f"', ['x <tool_call>{"name": "f"']),  # never closed: content
    ("a < b and <tool_ca", ["a < b and <tool_ca"]),  # a tag's start at the end stays text
])
def test_tool_calls_at_every_split(text, expected):
    for cut in range(len(text) + 1):
        got = merged(feed_split(ToolCallParser([WEATHER]), text, [cut]))
        assert got == expected, cut
    one_char = merged(feed_split(ToolCallParser([WEATHER]), text, list(range(1, len(text)))))
    assert one_char == expected


def renderer_with_template(folder, template: str) -> ChatRenderer:
    """A ChatRenderer of the demo's tokenizer with `template` as its chat template."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((DEMO / name).read_text())
    (folder / "chat_template.jinja").write_text(template)
    return ChatRenderer(Tokenizer.from_folder(folder))


def test_xml_values_follow_the_schema():
    call = parse_block("<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>",
                       [WEATHER])
    assert json.loads(call.arguments) == {"city": "42"}  # a string by the schema
    untyped = parse_block("<function=other>\n<parameter=n>\n42\n</parameter>\n</function>", [])
    assert json.loads(untyped.arguments) == {"n": 42}
    assert parse_block("<function=f>junk<parameter=a>1</parameter></function>", []) is None


@pytest.mark.parametrize("parameters", ["a string", [1], {"properties": [1]},
                                        {"properties": "x"}, None])
def test_xml_values_without_a_usable_schema_read_as_json(parameters):
    # a tool whose schema names no types (or is no schema): values parse as JSON where they can
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    call = parse_block("<function=f><parameter=n>\n3\n</parameter><parameter=s>\nhi\n"
                       "</parameter></function>", tools)
    assert json.loads(call.arguments) == {"n": 3, "s": "hi"}


def test_call_ids_are_unique():
    calls = [x for x in feed_split(ToolCallParser([]), JSON_TWO, []) if isinstance(x, ToolCall)]
    assert len(calls) == 2 and calls[0].id != calls[1].id and calls[0].id.startswith("call_")


@pytest.mark.parametrize("text, open_block, reasoning, content", [
    ("</think>\n\nhello", True, "", "hello"),
    ("</think>\n\n</think>\n\nhello", True, "", "hello"),  # a repeated close, as run drops it
    ("I should greet.\n</think>\n\nhello\n", True, "I should greet.", "hello\n"),
    ("still thinking\n", True, "still thinking", ""),  # never closed
    ("hello </think> world", False, "", "hello </think> world"),  # block closed in the prompt
    ("<think>\nhm\n</think>\n\nok", False, "hm", "ok"),  # the reply opens the block itself
])
def test_reasoning_at_every_split(text, open_block, reasoning, content):
    for cut in range(len(text) + 1):
        s = ReasoningSplitter(open_block)
        parts = [s.feed(text[:cut]), s.feed(text[cut:]), s.flush()]
        assert "".join(p[0] for p in parts) == reasoning, cut
        assert "".join(p[1] for p in parts) == content, cut


def test_think_open():
    assert think_open("<|im_start|>assistant\n<think>\n")
    assert not think_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not think_open("no tags")


def test_chat_reply_message_and_finish_reason():
    reply = ChatReply(True, [WEATHER])
    deltas = reply.feed("Checking.\n</think>\n\n" + JSON_TWO[:40]) + reply.feed(JSON_TWO[40:])
    deltas += reply.finish()
    msg = reply.message()
    assert msg["reasoning_content"] == "Checking." and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"] * 2
    assert reply.finish_reason("eos") == "tool_calls" and reply.finish_reason("length") == "length"
    streamed = [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d]
    assert streamed == [0, 1] and not any("content" in d for d in deltas)  # "\n" between: not content
    plain = ChatReply(True, [])
    plain.feed("</think>\n\n" + JSON_ONE)
    plain.finish()
    assert plain.message()["content"] == JSON_ONE and plain.finish_reason("eos") == "stop"


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": float("inf")},
     "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "repeat_penalty": float("nan")},
     "repeat_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        WEATHER, {"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[1].function.parameters"),
])
def test_bad_chat_requests(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_good_chat_request_fields():
    r = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]},
                                 {"role": "user", "content": "x"}],
                    "max_tokens": 5, "max_completion_tokens": 7, "stop": "END", "seed": -1,
                    "temperature": 0.5, "top_k": 3, "repeat_penalty": 1.1, "unknown": {"x": 1},
                    "tools": [WEATHER], "tool_choice": "none"})
    assert r.messages[0] == {"role": "system", "content": "ab"}
    assert r.gen.max_tokens == 7 and r.gen.stop == ("END",) and r.tools == []
    assert r.gen.sampling.seed == 2**63 - 1 and r.gen.sampling.top_k == 3
    assert r.gen.sampling.repeat_penalty == 1.1
    greedy = parse_chat({"messages": [{"role": "user", "content": "x"}], "top_p": 0.5})
    assert greedy.gen.sampling.greedy and greedy.gen.sampling.top_p == 1.0
    assert parse_completion({"prompt": ["hi"]}).prompt == "hi"
    with pytest.raises(ApiError):
        parse_completion({"prompt": ["a", "b"]})


def test_the_model_defaults_fill_what_a_request_leaves_out():
    # the demo's generation_config.json gives a repetition penalty of 1.3; serve passes the
    # model's defaults as a Sampling
    defaults = Sampling(repeat_penalty=1.3)
    msgs = [{"role": "user", "content": "x"}]
    assert parse_chat({"messages": msgs}, defaults).gen.sampling.repeat_penalty == 1.3
    assert parse_completion({"prompt": "x"}, defaults).gen.sampling.repeat_penalty == 1.3
    given = parse_chat({"messages": msgs, "repetition_penalty": 1.0}, defaults)
    assert given.gen.sampling.repeat_penalty == 1.0 and given.gen.sampling.greedy
    assert parse_chat({"messages": msgs}).gen.sampling.repeat_penalty == 1.0  # control
    sampled = parse_chat({"messages": msgs, "temperature": 0.7},
                         Sampling(top_k=50, top_p=0.9, min_p=0.05))
    s = sampled.gen.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.7, 50, 0.9, 0.05)
    assert parse_chat({"messages": msgs, "min_p": 0.2, "temperature": 1}).gen.sampling.min_p == 0.2
    with pytest.raises(ApiError, match="min_p"):
        parse_chat({"messages": msgs, "min_p": 2})


def test_tools_reach_the_prompt_without_template_support():
    tok = Tokenizer.from_folder(DEMO)
    r = ChatRenderer(tok)
    assert not r.template_tools  # the demo's ChatML does not render tools itself
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type":
             "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    p = r.prompt(msgs, [WEATHER], {})
    text = tok.decode(p.ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
        in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert p.think_open and p.splits and all(0 < s < len(p.ids) for s in p.splits)
    assert "# Tools" not in tok.decode(r.prompt(msgs[:2], [], {}).ids)  # control: no tools


def test_tools_go_to_a_template_that_renders_them(tmp_path):
    r = renderer_with_template(tmp_path, (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "<function=example>{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
        "{% endif %}"))
    assert r.template_tools and r.xml_form
    p = r.prompt([{"role": "user", "content": "hi"}], [WEATHER], {"enable_thinking": False})
    assert p.text.startswith("TOOLS:get_weather;") and not p.think_open


def test_a_template_that_iterates_the_arguments_gets_them_as_an_object(tmp_path):
    # OpenAI clients send a call's arguments as JSON text; Qwen3-Coder's template (the XML
    # form) iterates them with `|items`, so they reach it as an object (vLLM's way too)
    r = renderer_with_template(tmp_path, (
        "{% if tools %}{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}<function={{ c.function.name }}>"
        "{% for k, v in c.function.arguments|items %}<parameter={{ k }}>{{ v }}</parameter>"
        "{% endfor %}</function>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    assert r.template_tools
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    p = r.prompt(msgs, [WEATHER], {})
    assert "<function=get_weather><parameter=city>Oslo</parameter></function>" in p.text
    assert call["function"]["arguments"] == '{"city": "Oslo"}'  # the request is not changed
    for text in ("{not json", "[" * 100_000, '{"n": ' + "9" * 5000 + "}"):  # text stays text
        bad = {**call, "function": {"name": "f", "arguments": text}}
        with pytest.raises(ApiError, match="refused"):
            r.prompt([msgs[0], {**msgs[1], "tool_calls": [bad]}], [WEATHER], {})


def test_prefill_plan():
    from ftchat.server.worker import plan_prefill

    assert plan_prefill(0, 10, (), 4, least=1) == [(0, 4, False), (4, 8, False), (8, 10, True)]
    assert plan_prefill(0, 10, (3, 10, 12), 4, least=1) == [(0, 3, True), (3, 7, False),
                                                           (7, 10, True)]
    assert plan_prefill(5, 10, (3, 7), 8, least=1) == [(5, 7, True), (7, 10, True)]  # 3: restored
    # a split shorter than `least` makes no checkpoint: a short prompt prefills in one call
    assert plan_prefill(0, 40, (14, 28), 512) == [(0, 40, True)]
    assert plan_prefill(0, 3000, (14, 2990), 4096) == [(0, 2990, True), (2990, 3000, True)]
    assert plan_prefill(0, 600, (300, 590), 4096, least=300) == [(0, 300, True), (300, 590, True),
                                                                 (590, 600, True)]
    long = plan_prefill(100, 20000, (), 1024)
    assert [p[1] for p in long if p[2]] == [8192, 16384, 20000]
    assert long[0] == (100, 1124, False) and all(b - a <= 1024 for a, b, _ in long)
    assert all(long[i][1] == long[i + 1][0] for i in range(len(long) - 1))
