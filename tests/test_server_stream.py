"""The SSE writer of `ftchat serve` on events it is handed: a comment while nothing comes (a
long prefill), an error event then the end when the engine fails midway, and the job cancelled
when the stream stops early; and the server in this process answering 503 while its real
engine worker has not loaded the model yet."""

from __future__ import annotations

import asyncio
import json
import time

from ftchat.sampling import Sampling
from ftchat.server.app import _key_ok, _Shape, _stream
from ftchat.server.protocol import Generation
from ftchat.server.replies import ChatReply
from ftchat.server.worker import Delta, Failed, Finished, Job

GEN = Generation(8, (), Sampling(), True, True)


def collect(events: list, delays: list[float], keepalive: float, take: int | None = None):
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        job = Job("chatcmpl-1", [1, 2], 8, (), Sampling(), (), lambda ev: None)
        shape = _Shape("chat.completion", "chatcmpl-1", 0, "demo", ChatReply(True, []))

        async def feed():
            for ev, d in zip(events, delays):
                await asyncio.sleep(d)
                q.put_nowait(ev)

        task = asyncio.create_task(feed())
        out = []
        gen = _stream(q, job, shape, GEN, keepalive)
        async for s in gen:
            out.append(s)
            if take is not None and len(out) == take:
                await gen.aclose()
                break
        task.cancel()
        return out, job

    return asyncio.run(main())


def test_keepalive_comments_while_nothing_comes():
    done = Finished("eos", 2, 0, 1, 0.1, 0.0)
    out, job = collect([Delta("</think>\n\nhi"), done], [0.35, 0.0], keepalive=0.1)
    assert out.count(": keepalive\n\n") >= 2
    assert out[0].startswith("data: ") and out[-1] == "data: [DONE]\n\n"
    assert json.loads(out[-2][6:])["usage"]["completion_tokens"] == 1
    control, _ = collect([Delta("hi"), done], [0.0, 0.0], keepalive=5.0)
    assert ": keepalive\n\n" not in control


def test_a_failure_midway_is_an_error_event_then_the_end():
    out, _ = collect([Delta("</think>\n\nhi"), Failed("internal error: boom")], [0, 0], 5.0)
    assert json.loads(out[-1][6:])["error"]["message"] == "internal error: boom"
    assert "[DONE]" not in "".join(out)


def test_closing_the_stream_cancels_the_job():
    out, job = collect([Delta("a")] * 5, [0.01] * 5, 5.0, take=2)
    assert len(out) == 2 and job.cancelled.is_set()
    whole, job2 = collect([Delta("a"), Finished("eos", 2, 0, 1, 0, 0)], [0, 0], 5.0)
    assert whole[-1] == "data: [DONE]\n\n"


def test_loading_answers_503_then_ready(tmp_path):
    """A real engine worker, started only after the HTTP server answers: /health and the
    completions say 503 (retry allowed) while it loads, then 200."""
    import threading

    import uvicorn

    from ftchat.model.tokenizer import Tokenizer
    from ftchat.resolve import ResolvedModel
    from ftchat.server.app import ServerConfig, create_app
    from ftchat.server.metrics import Metrics
    from ftchat.server.worker import EngineWorker
    from ftchat.settings import Settings
    from tests.server_util import ROOT, Server, free_port, wait_ready

    demo = ROOT / "ftchat" / "models" / "demo"
    metrics = Metrics()
    worker = EngineWorker(ResolvedModel(demo, "demo", demo=True), Settings(threads=1), 1, 1, 0,
                          metrics, lambda line: None)
    app = create_app(ServerConfig("demo"), worker, Tokenizer.from_folder(demo), metrics)
    port = free_port()
    userver = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                            log_level="warning"))
    thread = threading.Thread(target=userver.run, daemon=True)
    thread.start()
    server = Server(None, port, tmp_path / "none.log")
    try:
        for _ in range(100):
            if userver.started:
                break
            time.sleep(0.05)
        status, headers, err = server.request("GET", "/health")
        assert status == 503 and err["error"]["code"] == "loading"
        assert "x-should-retry" not in headers
        status, _, err = server.request("POST", "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 503 and err["error"]["code"] == "loading"
        worker.start()
        assert wait_ready(server)[-1] == 200
        status, _, body = server.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
    finally:
        worker.stop()
        userver.should_exit = True
        thread.join(10)


def test_a_non_ascii_key_as_its_utf8_bytes():
    def scope(value: bytes) -> dict:
        return {"headers": [(b"host", b"x"), (b"authorization", value)]}

    assert _key_ok(scope("Bearer kéy".encode()), "kéy")  # what curl sends from a terminal
    assert _key_ok(scope(b"bearer  key "), "key")  # control: ASCII, spaces and case
    assert not _key_ok(scope("Bearer kéy".encode("latin-1")), "kéy")  # other bytes
    assert not _key_ok(scope(b"Bearer"), "key") and not _key_ok(scope(b"Basic key"), "key")
