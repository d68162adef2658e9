"""The HTTP layer (FastAPI): routes, authentication, body limits, errors in OpenAI's shape and
server-sent events. It never calls torch: a request becomes a Job for the engine thread, whose
events come back through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ftchat.model.tokenizer import Tokenizer
from ftchat.sampling import Sampling
from ftchat.server.metrics import Metrics
from ftchat.server.prompt import ChatRenderer
from ftchat.server.protocol import ApiError, Generation, bad, parse_chat, parse_completion
from ftchat.server.replies import FINISH, ChatReply
from ftchat.server.worker import Delta, EngineWorker, Failed, Finished, Job

OPEN_PATHS = ("/health",)  # answered without a key
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    keepalive_s: float = 15.0  # an SSE comment this often while nothing else is sent
    poll_s: float = 0.5  # how often a non-streamed request checks that its client is there
    # what a request that names no sampling field gets: the model's generation_config.json
    # (generation_defaults.py), else greedy
    sampling: Sampling = Sampling()


def create_app(cfg: ServerConfig, worker: EngineWorker, tokenizer: Tokenizer,
               metrics: Metrics) -> FastAPI:
    app = FastAPI(title="ftchat", docs_url=None, redoc_url=None, openapi_url=None)
    renderer = ChatRenderer(tokenizer)
    created = int(time.time())

    app.add_middleware(_Guard, cfg=cfg, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return _error(bad(f"invalid request: {e.errors()}"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        response = _error(ApiError(e.status_code, message, type=kind))
        response.headers.update(e.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                               type="server_error", retry=True))

    @app.get("/health")
    async def health():
        if worker.state == "ready":
            return {"status": "ok"}
        if worker.state == "failed":
            return _error(ApiError(503, f"the model failed to load: {worker.error}",
                                   type="unavailable_error"))
        return _error(ApiError(503, "the model is loading", type="unavailable_error",
                               code="loading", retry=True))

    @app.get("/metrics")
    async def metrics_text():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model(cfg, created)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        return _model(cfg, created)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_chat(await _read_json(request, cfg.max_body_bytes), cfg.sampling)
        _ready(worker)
        prompt = await asyncio.to_thread(renderer.prompt, req.messages, req.tools,
                                         req.template_kwargs)
        reply = ChatReply(prompt.think_open, req.tools)
        return await _respond(request, cfg, worker, "chat.completion", "chatcmpl-", prompt.ids,
                              prompt.splits, req.gen, reply)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion(await _read_json(request, cfg.max_body_bytes), cfg.sampling)
        _ready(worker)
        if isinstance(req.prompt, str):
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt)
        else:
            ids = req.prompt
            if max(ids) >= tokenizer.backend.get_vocab_size(with_added_tokens=True):
                raise bad("'prompt' holds a token id outside the vocabulary", "prompt")
        return await _respond(request, cfg, worker, "text_completion", "cmpl-", ids, (),
                              req.gen, None)

    return app


# ===== requests =====


class _Guard:
    """ASGI middleware: the API key (when set) and the response count per endpoint. Plain ASGI,
    not BaseHTTPMiddleware, so a handler still sees its client disconnect."""

    def __init__(self, app, cfg: ServerConfig, metrics: Metrics):
        self.app, self.cfg, self.metrics = app, cfg, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        if self.cfg.api_key is not None and path not in OPEN_PATHS and not _key_ok(
                scope, self.cfg.api_key):
            response = _error(ApiError(
                401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                type="authentication_error", code="invalid_api_key"))
            self.metrics.count_response(endpoint, 401)
            return await response(scope, receive, send)
        status = [500]

        async def sent(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            self.metrics.count_response(endpoint, status[0])


def _key_ok(scope, key: str) -> bool:
    given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = given.partition(" ")
    # the header's own bytes (latin-1 gives them back) against the key's UTF-8: curl sends a
    # non-ASCII key as the terminal's UTF-8
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"),
                                                              key.encode())


async def _read_json(request: Request, limit: int) -> object:
    size = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is over {limit} bytes",
                       type="invalid_request_error", code="request_too_large")
    if size is not None and size.isdigit() and int(size) > limit:
        raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_big
        chunks.append(chunk)
    try:
        raw = b"".join(chunks)
        body = json.loads(raw)
    except RecursionError:
        raise bad("the request body is not valid JSON: it nests too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer too long
        detail = e if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else \
            "a number has too many digits"
        raise bad(f"the request body is not valid JSON: {detail}") from None
    # walked only where a surrogate escape may be: a UTF-8 body without one has none
    if json.detect_encoding(raw) not in ("utf-8", "utf-8-sig") or _SURROGATE_ESCAPE.search(raw):
        _check_surrogates(body)
    return body


_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_surrogates(body: object) -> None:
    """Refuse a lone surrogate escape ("\\ud800"): json.loads keeps it, but it is no text a
    tokenizer can encode (llama-server's JSON parser refuses it too)."""
    todo = [body]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
        elif isinstance(x, str) and (m := _SURROGATE.search(x)):
            raise bad("the request body is not valid JSON: a string holds the lone surrogate "
                      f"\\u{ord(m.group()):04x}")


def _ready(worker: EngineWorker) -> None:
    if worker.state != "ready":
        message = "the model is loading" if worker.state == "loading" else \
            f"the model failed to load: {worker.error}"
        raise ApiError(503, message, type="unavailable_error", code="loading",
                       retry=worker.state == "loading")


def _model(cfg: ServerConfig, created: int) -> dict:
    return {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "ftchat"}


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


# ===== responses =====


async def _respond(request: Request, cfg: ServerConfig, worker: EngineWorker, kind: str,
                   prefix: str, ids: list[int], splits: tuple[int, ...], gen: Generation,
                   reply: ChatReply | None) -> Response:
    max_len = worker.max_len
    if len(ids) >= max_len:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is "
                       f"{max_len} tokens and the reply needs at least one",
                       param="messages" if reply is not None else "prompt",
                       code="context_length_exceeded")
    if gen.max_tokens is not None and gen.max_tokens > max_len:
        raise bad(f"'max_tokens' {gen.max_tokens} is over the context ({max_len} tokens)",
                  "max_tokens")
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    rid = prefix + secrets.token_hex(12)
    # a sampled request without a seed gets a random one now (the Sampler draws from it)
    job = Job(rid, list(ids), gen.max_tokens or max_len - len(ids), gen.stop,
              gen.sampling.with_seed(), splits,
              lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
              ignore_eos=gen.ignore_eos)
    if not worker.submit(job):
        raise ApiError(503, f"the server is busy: {worker.queue_size} requests already wait "
                       "(--queue); retry later", type="unavailable_error", code="queue_full",
                       retry=True)
    shape = _Shape(kind, rid, int(time.time()), cfg.model_name, reply)
    if gen.stream:
        return StreamingResponse(_stream(events, job, shape, gen, cfg.keepalive_s),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    try:
        text: list[str] = []
        checked = time.monotonic()
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), cfg.poll_s)
            except asyncio.TimeoutError:
                ev = None
            if time.monotonic() - checked >= cfg.poll_s:  # tokens may arrive faster than that
                checked = time.monotonic()
                if await request.is_disconnected():
                    job.cancelled.set()
                    return Response(status_code=499)
            if ev is None:
                continue
            if isinstance(ev, Delta):
                text.append(ev.text)
                if reply is not None:
                    reply.feed(ev.text)
            elif isinstance(ev, Failed):
                raise ApiError(500, ev.message, type="server_error", retry=True)
            else:
                if reply is not None:
                    reply.finish()
                return JSONResponse(shape.whole("".join(text), ev))
    finally:
        job.cancelled.set()  # a no-op once finished; frees the engine if the client left


@dataclass
class _Shape:
    """The OpenAI objects of one response."""

    kind: str  # chat.completion | text_completion
    id: str
    created: int
    model: str
    reply: ChatReply | None

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, ev: Finished) -> dict:
        if self.reply is not None:
            choice = {"index": 0, "message": self.reply.message(), "logprobs": None,
                      "finish_reason": self.reply.finish_reason(ev.reason)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": FINISH[ev.reason]}
        return {**self._head(self.kind), "choices": [choice], "usage": _usage(ev),
                "timings": _timings(ev)}

    def chunk(self, delta: dict | str, finish: str | None = None) -> str:
        if self.reply is not None:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            obj = {**self._head("text_completion"), "choices": [choice]}
        return _sse(obj)

    def usage_chunk(self, ev: Finished) -> str:
        kind = "chat.completion.chunk" if self.reply is not None else "text_completion"
        return _sse({**self._head(kind), "choices": [], "usage": _usage(ev),
                     "timings": _timings(ev)})


async def _stream(events: asyncio.Queue, job: Job, shape: _Shape, gen: Generation,
                  keepalive_s: float) -> AsyncIterator[str]:
    reply = shape.reply
    try:
        if reply is not None:
            yield shape.chunk({"role": "assistant", "content": ""})
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), keepalive_s)
            except asyncio.TimeoutError:
                yield ": keepalive\n\n"  # a long prefill: the client's read timeout waits on
                continue
            if isinstance(ev, Delta):
                for delta in (reply.feed(ev.text) if reply is not None else [ev.text]):
                    yield shape.chunk(delta)
            elif isinstance(ev, Failed):
                yield _sse({"error": {"message": ev.message, "type": "server_error",
                                      "param": None, "code": None}})
                return
            else:
                if reply is not None:
                    for delta in reply.finish():
                        yield shape.chunk(delta)
                    yield shape.chunk({}, reply.finish_reason(ev.reason))
                else:
                    yield shape.chunk("", FINISH[ev.reason])
                if gen.include_usage:
                    yield shape.usage_chunk(ev)
                yield "data: [DONE]\n\n"
                return
    finally:
        job.cancelled.set()  # the client closed the stream: the engine stops this job


def _usage(ev: Finished) -> dict:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens}}


def _timings(ev: Finished) -> dict:
    """The engine's own timing of a request, in llama-server's `timings` fields: the prompt
    tokens it prefilled (the cached ones are cache_n) and the tokens of its decode steps (the
    first generated token ends the prefill). A client that sees no text per token (a reply held
    back, a random-weight model's ids without text) still reads the decode rate here."""
    prefilled = ev.prompt_tokens - ev.cached_tokens
    return {"cache_n": ev.cached_tokens,
            "prompt_n": prefilled, "prompt_ms": round(ev.prefill_s * 1e3, 3),
            "prompt_per_second": (round(prefilled / ev.prefill_s, 2)
                                  if ev.prefill_s > 0 and prefilled else None),
            "predicted_n": ev.decoded_tokens, "predicted_ms": round(ev.decode_s * 1e3, 3),
            "predicted_per_second": (round(ev.decoded_tokens / ev.decode_s, 2)
                                     if ev.decode_s > 0 and ev.decoded_tokens else None)}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
