"""`ftchat serve` on the demo model, started as a subprocess: the `openai` client and plain
HTTP against it (replies, streaming, sampling, errors, cancellation, the queue)."""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest

from ftchat.model.tokenizer import Tokenizer
from tests.server_util import ROOT, run_json, start_server

KEY = "test-key-1"
FLAGS = ("--context", "512", "--prefill-chunk", "32")  # small context, chunked prefill
DEMO = ROOT / "ftchat" / "models" / "demo"
ASK = [{"role": "user", "content": "Who are you?"}]
LONG = "Read this list and say what it holds: " + ", ".join(f"item {i}" for i in range(60))
ADD = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve"), *FLAGS, "--queue", "1", key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """`ftchat run --json` replies to the same messages (greedy, and seeded)."""
    lines = [{"prompt": "Who are you?", "max_new_tokens": 8},
             {"prompt": ADD[1]["content"], "system": "Be brief.", "max_new_tokens": 8},
             {"prompt": ADD[1]["content"], "system": "Be brief.", "max_new_tokens": 8,
              "temperature": 0.9, "seed": 7},
             {"prompt": ADD[1]["content"], "system": "Be brief.", "max_new_tokens": 30},
             {"prompt": ADD[1]["content"], "system": "Be brief.", "max_new_tokens": 30,
              "temperature": 0.9, "seed": 11},
             {"prompt": LONG, "max_new_tokens": 6}]
    return run_json(lines, *FLAGS)


def after_think(text: str) -> str:
    """run --json's text: the answer, its think block already split off into `reasoning`."""
    assert "</think>" not in text
    return text


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["demo"]
    status, _, body = server.request("GET", "/health", key=False)
    assert status == 200 and body == {"status": "ok"}


def test_greedy_chat_equals_run(client, reference):
    for messages, ref in ((ASK, reference[0]), (ADD, reference[1])):
        r = client.chat.completions.create(model="any", messages=messages, max_tokens=8)
        assert r.choices[0].message.content == after_think(ref["text"])
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == len(ref["tokens"]) == 8
        assert r.usage.prompt_tokens == ref["prompt_tokens"]


def test_text_completion_equals_run_exactly(client, reference):
    prompt = Tokenizer.from_folder(DEMO).render_chat(ADD)
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=8)
    # a text completion is the raw text: the tokens run chose, decoded (think tags included)
    raw = Tokenizer.from_folder(DEMO).decode(reference[1]["tokens"])
    assert "</think>" in raw and r.choices[0].text == raw


def test_seed_reproduces_the_reply_and_run(client, reference):
    kw = dict(model="demo", messages=ADD, max_tokens=8, temperature=0.9, seed=7)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b == after_think(reference[2]["text"])


def test_a_sampled_request_without_a_seed_replies(server, client):
    # the server fixes a random seed for it (as run does); a given seed: the test above
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=3,
                                       temperature=0.9)
    assert r.usage.completion_tokens == 3
    status, _, text = server.request("POST", "/v1/completions", {
        "prompt": "def", "max_tokens": 3, "temperature": 0.9, "stream": True})
    assert status == 200 and text.endswith("data: [DONE]\n\n") and '"error"' not in text


def test_text_that_only_looks_like_a_surrogate_is_accepted(server):
    # controls of the lone-surrogate case below: a pair, and an escaped backslash before "u"
    for content in (b"\\ud83d\\ude00", b"\\\\ud800"):
        body = b'{"messages": [{"role": "user", "content": "' + content + b'"}], "max_tokens": 1}'
        status, _, reply = server.request("POST", "/v1/chat/completions", body,
                                          {"Content-Type": "application/json"})
        assert status == 200, reply


def test_stream_shape(server):
    body = {"model": "demo", "messages": ADD, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    status, headers, text = server.request("POST", "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_stream_with_the_client_equals_non_streamed(client):
    whole = client.chat.completions.create(model="demo", messages=ASK, max_tokens=8)
    parts = list(client.chat.completions.create(model="demo", messages=ASK, max_tokens=8,
                                                stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == whole.choices[0].message.content and parts[0].choices[0].delta.role


def test_stop_and_max_tokens(client, reference):
    full = after_think(reference[1]["text"])  # "```python\ndef add(a, b):..."
    cut = full.index("def")
    r = client.chat.completions.create(model="demo", messages=ADD, max_tokens=8, stop=["def"])
    assert r.choices[0].message.content == full[:cut] and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="demo", messages=ADD, max_completion_tokens=3,
                                       max_tokens=50)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_ignore_eos_decodes_to_max_tokens(client):
    ends = client.chat.completions.create(model="demo", messages=ASK, max_tokens=30)
    assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens < 30
    on = client.chat.completions.create(model="demo", messages=ASK, max_tokens=30,
                                        extra_body={"ignore_eos": True})
    assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == 30
    text = on.choices[0].message.content
    assert text.startswith(ends.choices[0].message.content) and "<|im_end|>" not in text


def test_tools_are_rendered_into_the_prompt(client):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    plain = client.chat.completions.create(model="demo", messages=ASK, max_tokens=1)
    tools = client.chat.completions.create(model="demo", messages=ASK, max_tokens=1,
                                           tools=[tool])
    off = client.chat.completions.create(model="demo", messages=ASK, max_tokens=1,
                                         tools=[tool], tool_choice="none")
    assert tools.usage.prompt_tokens > plain.usage.prompt_tokens == off.usage.prompt_tokens


BIG = "word " * 600  # over the 512-token context


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, None),
    (b'["a list"]', 400, None),
    ({"model": "demo"}, 400, None),
    ({"messages": []}, 400, None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"messages": [{"role": "user", "content": ""}, {"role": "user", "content": 5}]}, 400, None),
    ({"messages": ASK, "max_tokens": 0}, 400, None),
    ({"messages": ASK, "max_tokens": -5}, 400, None),
    ({"messages": ASK, "max_tokens": 10**9}, 400, None),
    ({"messages": ASK, "max_tokens": "8"}, 400, None),
    ({"messages": ASK, "n": 2}, 400, None),
    ({"messages": ASK, "logprobs": True}, 400, None),
    ({"messages": ASK, "response_format": {"type": "json_object"}}, 400, None),
    ({"messages": ASK, "temperature": -1}, 400, None),
    ({"messages": ASK, "stream": "yes"}, 400, None),
    ({"messages": ASK, "ignore_eos": "yes"}, 400, None),
    ({"messages": [{"role": "user", "content": BIG}]}, 400, "context_length_exceeded"),
    (b"x" * (20 * 2**20), 413, None),
    (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400, None),  # lone surrogate
    ('{"messages": [{"role": "user", "content": "\\udfff"}]}'.encode("utf-16"), 400, None),
    (b'{"messages": [], "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),  # deep
    (b'{"messages": [], "seed": ' + b"9" * 5000 + b"}", 400, None),  # past int()'s digit limit
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f",
                                                                   "parameters": "{}"}}]},
     400, None),
])
def test_bad_requests(server, body, status, code):
    got, headers, err = server.request("POST", "/v1/chat/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["code"] == code or code is None
    assert headers.get("x-should-retry") == "false"


def test_keys_paths_and_methods(server):
    assert server.request("GET", "/v1/models", key=False)[0] == 401
    status, _, err = server.request("GET", "/v1/models", headers={"Authorization": "Bearer no"},
                                    key=False)
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    status, _, err = server.request("GET", "/v1/nothing")
    assert status == 404 and err["error"]["type"] == "not_found_error"
    status, headers, err = server.request("GET", "/v1/chat/completions")
    assert status == 405 and headers["allow"] == "POST" and err["error"]["message"]
    status, _, err = server.request("POST", "/v1/completions", {"prompt": "x", "best_of": 3})
    assert status == 400 and err["error"]["param"] == "best_of"


def test_still_serving_after_the_bad_requests(client):
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=2)
    assert r.usage.completion_tokens == 2


def _wait(cond, timeout=60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def _cancelled(server) -> float:
    return server.metric('ftchat_requests_total{reason="cancelled"}')


def test_a_closed_stream_frees_the_engine(server, client):
    before = _cancelled(server)
    stream = client.chat.completions.create(model="demo", messages=ADD, max_tokens=400,
                                            stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert _wait(lambda: _cancelled(server) == before + 1)
    t = time.monotonic()
    assert client.chat.completions.create(model="demo", messages=ASK, max_tokens=1)
    assert time.monotonic() - t < 15  # not behind 400 decode steps (~40 s here)
    assert server.metric("ftchat_queue_depth") == 0


def test_a_timed_out_request_frees_the_engine(server, client):
    before = _cancelled(server)
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=2.0).chat.completions.create(
            model="demo", messages=ADD, max_tokens=400)
    assert _wait(lambda: _cancelled(server) == before + 1)
    assert server.metric("ftchat_requests_running") == 0


def test_a_disconnect_mid_prefill_frees_the_engine(server, client):
    before = _cancelled(server)
    long = [{"role": "user", "content": "word " * 440}]  # ~15 s of prefill in 32-token chunks
    body = json.dumps({"model": "demo", "messages": long, "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert _wait(lambda: server.metric("ftchat_requests_running") == 1)
        time.sleep(1.0)
    assert _wait(lambda: _cancelled(server) == before + 1, timeout=20)
    t = time.monotonic()
    client.chat.completions.create(model="demo", messages=ASK, max_tokens=1)
    assert time.monotonic() - t < 10


def test_two_decode_one_waits_one_is_refused(server, client, reference):
    """--parallel 2 --queue 1: A and B decode together, C waits, D gets 503; each reply equals
    its run alone (B is sampled: its seed replays it beside A)."""
    a = client.chat.completions.create(model="demo", messages=ADD, max_tokens=30, stream=True)
    next(iter(a))
    b = client.chat.completions.create(model="demo", messages=ADD, max_tokens=30, stream=True,
                                       temperature=0.9, seed=11)
    next(iter(b))
    assert _wait(lambda: server.metric("ftchat_requests_running") == 2), server.request("GET", "/metrics")[2]
    waited = {}
    c = threading.Thread(target=lambda: waited.setdefault("r", client.chat.completions.create(
        model="demo", messages=ASK, max_tokens=8)))
    c.start()
    assert _wait(lambda: server.metric("ftchat_queue_depth") == 1)  # C waits
    status, headers, err = server.request("POST", "/v1/chat/completions",
                                          {"messages": ASK, "max_tokens": 2})
    assert status == 503 and err["error"]["code"] == "queue_full"
    assert "x-should-retry" not in headers  # a retry may succeed
    text_a = "".join(x.choices[0].delta.content or "" for x in a if x.choices)
    text_b = "".join(x.choices[0].delta.content or "" for x in b if x.choices)
    c.join(120)
    assert waited["r"].choices[0].message.content == after_think(reference[0]["text"])
    assert text_a == after_think(reference[3]["text"])
    assert text_b == after_think(reference[4]["text"])


def test_a_long_prompt_prefills_between_the_decode_steps(server, client, reference):
    """B's prompt (7 chunks of 32 tokens) is prefilled while A decodes: both replies equal
    their runs alone."""
    steps = server.metric("ftchat_interleaved_decode_steps_total")
    a = client.chat.completions.create(model="demo", messages=ADD, max_tokens=30, stream=True)
    next(iter(a))
    assert _wait(lambda: server.metric("ftchat_requests_running") == 1)
    b = client.chat.completions.create(model="demo", max_tokens=6,
                                       messages=[{"role": "user", "content": LONG}])
    text_a = "".join(x.choices[0].delta.content or "" for x in a if x.choices)
    assert b.choices[0].message.content == after_think(reference[5]["text"])
    assert text_a == after_think(reference[3]["text"])
    assert server.metric("ftchat_interleaved_decode_steps_total") > steps
