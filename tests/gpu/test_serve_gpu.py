"""GPU tier (`pytest -m gpu`, on the device): `ftchat serve` on the demo model on CUDA, with CUDA
graphs and eagerly, one row and two. Greedy replies equal `ftchat run --json` with the same
device, graph mode, prefill chunk and batch size (tokens: the text they decode to, and their
count), also from a restored prefix checkpoint. Two concurrent requests both complete with the
replies of run: a long prompt prefills, a short one arrives meanwhile and prefills between the
long one's first decode steps (the half-prefilled row rides along in the captured graph), and
their replies stream at the same time; at --parallel 1 (the control) the second waits for the
first.

The requests are plain HTTP (tests/server_util.py), not the `openai` package: the device machine
has no package registry to install it from; the CPU tests cover the client's view.

Every server and reference run starts at once (one GPU, the demo model is small); without CUDA
the whole module is skipped before any process starts."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ftchat.model.tokenizer import Tokenizer
from tests.server_util import ROOT, run_json, start_server, wait_ready

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="serve on CUDA needs a GPU")]

DEMO = ROOT / "ftchat" / "models" / "demo"
# a small prefill chunk: the long prompt takes ~100 chunks, time for the short one to arrive
COMMON = ("--device", "cuda", "--context", "2048", "--prefill-chunk", "8")
SERVERS = {  # name -> serve flags; each is compared with the run of the same flags
    "graph": ("--graph", "--parallel", "1"),
    "eager": ("--eager", "--parallel", "1"),
    "graph2": ("--graph", "--parallel", "2"),
}
ASK = [{"role": "user", "content": "Who are you?"}]
ADD = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "Write a function that adds two numbers."}]
LONG = [{"role": "user", "content": "Read this list and say what it holds: "
         + ", ".join(f"item {i}" for i in range(200))}]
# an agent's long system prompt (~345 tokens): a checkpoint of its own at the end of the history
# (a shorter point gets none: worker.CHECKPOINT_MIN_TOKENS)
AGENT = [{"role": "system", "content": "You are a helpful assistant. Answer in Python. "
          + " ".join(f"Rule {i}: keep functions short and name them for what they do."
                     for i in range(20))},
         {"role": "user", "content": "Write a function that adds two numbers."}]
CHATS = [(ASK, 32), (ADD, 32), (AGENT, 16)]
PAIR = [(LONG, 16), (ADD, 32)]  # the concurrent pair: the long prompt first, then the short


def _line(messages: list[dict], n: int) -> dict:
    system = {"system": messages[0]["content"]} if messages[0]["role"] == "system" else {}
    return {"prompt": messages[-1]["content"], "max_new_tokens": n, **system}


def _run_lines(flags: tuple[str, ...]) -> list[dict]:
    """The references: the chats one by one at batch size 1, or, for --parallel 2, the pair
    decoded together at --batch-size 2 (rows 0 and 1)."""
    graph_flag, _, parallel = flags
    if parallel == "1":
        return run_json([_line(*c) for c in CHATS], *COMMON, graph_flag)
    return run_json([_line(*c) for c in PAIR], *COMMON, graph_flag, "--batch-size", "2")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """name -> (server, reference lines); the servers load while the references run."""
    tmp = tmp_path_factory.mktemp("serve-gpu")
    servers = {}
    try:
        for name, flags in SERVERS.items():
            servers[name] = start_server(tmp, *COMMON, *flags, wait=False)
        with ThreadPoolExecutor(len(SERVERS)) as pool:
            refs = dict(zip(SERVERS, pool.map(_run_lines, SERVERS.values())))
        for s in servers.values():
            wait_ready(s)
        yield {name: (servers[name], refs[name]) for name in SERVERS}
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(DEMO)


def _create(server, kind: str, **body) -> dict:
    """POST /v1/{kind} (chat/completions or completions), not streamed: the reply object."""
    status, _, r = server.request("POST", f"/v1/{kind}", {"model": "demo", **body})
    assert status == 200, (status, r)
    return r


@pytest.mark.parametrize("name", ["graph", "eager"])
def test_greedy_chat_equals_run(setup, name):
    server, ref = setup[name]
    for (messages, n), want in zip(CHATS, ref):
        r = _create(server, "chat/completions", messages=messages, max_tokens=n)
        msg = r["choices"][0]["message"]
        assert msg["content"] == want["text"], (name, msg["content"], want["text"])
        assert (msg.get("reasoning_content") or "") == want["reasoning"]
        assert r["usage"]["completion_tokens"] == len(want["tokens"])
        assert r["usage"]["prompt_tokens"] == want["prompt_tokens"]


@pytest.mark.parametrize("name", ["graph", "eager", "graph2"])
def test_greedy_completion_equals_run_tokens(setup, tok, name):
    """The raw completion of a rendered chat is the text of exactly the tokens run chose (the
    server prefills it whole, or from a checkpoint an earlier test's chat left)."""
    server, ref = setup[name]
    cases = zip(CHATS if name != "graph2" else PAIR, ref)  # graph2: the pair, one at a time
    for (messages, n), want in cases:
        r = _create(server, "completions", prompt=tok.render_chat(messages), max_tokens=n)
        assert r["choices"][0]["text"] == _text(tok, want), (name, messages[-1])
        assert r["usage"]["completion_tokens"] == len(want["tokens"])


def test_a_restored_checkpoint_gives_run_tokens(setup, tok):
    """A chat leaves a checkpoint at the end of its prompt's history; the raw completion of the
    same rendered prompt restores it and prefills only the generation prompt: still run's
    tokens."""
    server, ref = setup["graph"]
    messages, n = CHATS[2]
    _create(server, "chat/completions", messages=messages, max_tokens=n)
    r = _create(server, "completions", prompt=tok.render_chat(messages), max_tokens=n)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert r["choices"][0]["text"] == _text(tok, ref[2])


def _text(tok, ref: dict) -> str:
    """The text of run's tokens as a completion returns it: without the stop token."""
    return tok.decode(ref["tokens"][:-1] if ref["stop"] == "eos" else ref["tokens"])


def _stream_text(server, prompt: str, n: int, times: list[float]) -> str:
    """A streamed completion read event by event; the arrival time of each piece of text goes
    to `times`."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"model": "demo", "prompt": prompt, "max_tokens": n, "stream": True}
    out = []
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, (r.status, r.read())
        for raw in r:  # SSE: "data: {...}" lines, "data: [DONE]" last
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.monotonic())
                out.append(chunk["choices"][0]["text"])
    finally:
        conn.close()
    return "".join(out)


def _concurrent(server, tok) -> tuple[list[str], list[list[float]], float]:
    """The long prompt is sent; once the engine holds it (prefilling), the short one. Their
    texts, the arrival times of their pieces, and the decode steps run while a prompt was half
    prefilled (the short one's, between the long one's steps)."""
    steps = server.metric("ftchat_interleaved_decode_steps_total")
    times: list[list[float]] = [[], []]
    (long, n_long), (short, n_short) = PAIR
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_stream_text, server, tok.render_chat(long), n_long, times[0])
        end = time.monotonic() + 60
        while server.metric("ftchat_requests_running") < 1 and time.monotonic() < end:
            assert not first.done(), first.result()
        second = _stream_text(server, tok.render_chat(short), n_short, times[1])
        texts = [first.result(timeout=120), second]
    assert times[0] and times[1]
    return texts, times, server.metric("ftchat_interleaved_decode_steps_total") - steps


def test_two_concurrent_requests_decode_together(setup, tok):
    server, ref = setup["graph2"]
    assert ref[0]["stop"] == "length", "the long prompt's reply ends early: the overlap " \
        "below needs it to decode while the short prompt prefills"
    texts, (t_long, t_short), interleaved = _concurrent(server, tok)
    assert texts == [_text(tok, r) for r in ref]
    assert interleaved > 0  # the short prompt prefilled while the long one decoded
    assert t_short[0] < t_long[-1], "the short reply began after the long one ended"


def test_one_row_serves_the_second_request_after_the_first(setup, tok):
    # control for the test above: at --parallel 1 the short request waits in the queue
    server, _ = setup["graph"]
    _, (t_long, t_short), interleaved = _concurrent(server, tok)
    assert interleaved == 0
    assert t_short[0] > t_long[-1]
