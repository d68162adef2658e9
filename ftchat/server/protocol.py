"""The OpenAI request fields ftchat reads, checked into frozen requests, and errors in OpenAI's
shape (`{"error": {"message", "type", "param", "code"}}`).

Unknown fields are ignored; a field ftchat does not implement (n > 1, logprobs, a JSON
response_format) is a 400 that says so rather than a silently different reply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ftchat.sampling import Sampling

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 16


class ApiError(Exception):
    """An error answered in OpenAI's shape. `retry`: whether the same request may succeed later
    (False adds `x-should-retry: false`)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry: bool = False):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.retry = param, code, retry

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry else {"x-should-retry": "false"}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Generation:
    """What both endpoints share: limits, stop strings, sampling, streaming."""

    max_tokens: int | None  # None: the rest of the context
    stop: tuple[str, ...]
    sampling: Sampling
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # decode on past end-of-turn tokens (vLLM's and llama-server's
    # extension: benchmarks that need replies of exactly max_tokens)


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    gen: Generation
    tools: list[dict] = field(default_factory=list)  # [] also for tool_choice "none"
    template_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    gen: Generation


def parse_chat(body: object, defaults: Sampling = Sampling()) -> ChatRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    msgs = [_message(m, i) for i, m in enumerate(messages)]
    choice = body.get("tool_choice")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
            raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}} objects", "tools")
        for i, t in enumerate(tools):
            params = t["function"].get("parameters")
            if params is not None and not isinstance(params, dict):
                where = f"tools[{i}].function.parameters"
                raise bad(f"{where} must be a JSON Schema object, got {params!r:.40}", where)
    if choice not in (None, "auto", "none"):
        raise bad("'tool_choice' supports \"auto\" and \"none\"; \"required\" and a named "
                  "function are not implemented", "tool_choice")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    limit = _limit(body, ("max_completion_tokens", "max_tokens"))
    return ChatRequest(msgs, _generation(body, limit, defaults),
                       [] if choice == "none" or not tools else tools, dict(kwargs or {}))


def parse_completion(body: object, defaults: Sampling = Sampling()) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        prompt = [int(t) for t in prompt]
    elif not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string (or one list of token ids); several "
                  "prompts in one request are not implemented", "prompt")
    if _number(body, "best_of", 1) != 1:
        raise bad("'best_of' above 1 is not implemented", "best_of")
    if body.get("echo"):
        raise bad("'echo' is not implemented", "echo")
    return CompletionRequest(prompt, _generation(body, _limit(body, ("max_tokens",)), defaults))


# ===== fields =====


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _message(m: object, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object with 'role' and 'content'", where)
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role {role!r}: expected one of {', '.join(ROLES)}", f"{where}.role")
    content = _content(m.get("content"), f"{where}.content")
    out = {"role": "system" if role == "developer" else role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not all(
                _is_call(c) for c in calls):
            raise bad(f"{where}.tool_calls must be a list of function calls of an assistant "
                      "message", f"{where}.tool_calls")
        out["tool_calls"] = calls
    elif content is None:
        raise bad(f"{where}.content is missing", f"{where}.content")
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if isinstance(m.get("reasoning_content"), str):
        out["reasoning_content"] = m["reasoning_content"]
    return out


def _content(content: object, where: str) -> str | None:
    """A string; a list of text parts is joined; None stays None (an assistant's tool calls)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise bad(f"{where}: only text parts are supported ({{\"type\": \"text\", "
                          "\"text\": ...}})", where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where} must be a string or a list of text parts", where)


def _is_tool(t: object) -> bool:
    f = t.get("function") if isinstance(t, dict) else None
    return t.get("type", "function") == "function" and isinstance(f, dict) and isinstance(
        f.get("name"), str) and bool(f["name"])


def _is_call(c: object) -> bool:
    f = c.get("function") if isinstance(c, dict) else None
    return isinstance(f, dict) and isinstance(f.get("name"), str)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number(body: dict, name: str, default, integer: bool = False, low=None, high=None,
            low_open: bool = False):
    x = body.get(name)
    if x is None:
        return default
    ok = _is_int(x) if integer else _is_number(x)
    if ok and isinstance(x, float) and not math.isfinite(x):  # NaN, Infinity: as run's flags
        ok = False
    if ok and low is not None:
        ok = x > low if low_open else x >= low
    if ok and high is not None:
        ok = x <= high
    if not ok:
        kind = "an integer" if integer else "a number"
        lo = "" if low is None else f" {'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{' and' if lo else ''} <= {high}"
        raise bad(f"'{name}' must be {kind}{lo}{hi}, got {x!r}", name)
    return x


def _limit(body: dict, names: tuple[str, ...]) -> int | None:
    for name in names:  # max_completion_tokens wins over max_tokens
        if body.get(name) is not None:
            return _number(body, name, None, integer=True, low=1)
    return None


def _generation(body: dict, limit: int | None, defaults: Sampling) -> Generation:
    """A request's generation; a sampling field it does not give comes from `defaults`."""
    if _number(body, "n", 1, integer=True, low=1) != 1:
        raise bad("'n' above 1 is not implemented: send one request per reply", "n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad("'logprobs' is not implemented", "logprobs")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("'response_format' other than {\"type\": \"text\"} is not implemented",
                  "response_format")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"'stop' takes at most {MAX_STOPS} strings", "stop")
    d = defaults
    temperature = float(_number(body, "temperature", d.temperature, low=0, high=100))
    top_p = float(_number(body, "top_p", d.top_p, low=0, high=1, low_open=True))
    top_k = int(_number(body, "top_k", d.top_k, integer=True, low=0))
    min_p = float(_number(body, "min_p", d.min_p, low=0, high=1))
    if body.get("repetition_penalty") is not None:
        penalty = float(_number(body, "repetition_penalty", 1.0, low=0, low_open=True))
    else:
        penalty = float(_number(body, "repeat_penalty", d.repeat_penalty, low=0, low_open=True))
    seed = _number(body, "seed", None, integer=True)
    if seed is not None:
        seed %= 2**63  # a negative seed is fine too
    sampled = temperature > 0
    sampling = Sampling(temperature, top_k if sampled else 0, top_p if sampled else 1.0,
                        penalty, seed, min_p if sampled else 0.0)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    usage = bool((options or {}).get("include_usage"))
    return Generation(limit, stops, sampling, _flag(body, "stream"), usage,
                      _flag(body, "ignore_eos"))


def _flag(body: dict, name: str) -> bool:
    """A true / false field (null or absent: false)."""
    x = body.get(name)
    if not isinstance(x, bool) and x is not None:
        raise bad(f"'{name}' must be true or false", name)
    return bool(x)
