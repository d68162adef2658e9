"""Agent soak: a scripted agentic client (the `openai` package) against a running `ftchat serve`.

    python scripts/agent_soak.py --url http://127.0.0.1:8080/v1 --minutes 15 [--side 1]
        [--server-pid PID] [--max-tokens 64] [--side-tokens 16] [--history 3000]
        [--replay-every 5] [--interval 60] [--max-rss-slope 16] [--max-vram-slope 16]
        [--api-key KEY] [--seed 0] [--out FILE]

Main turns grow one conversation: each is a streamed greedy reply; after it the script appends
a tool-call-shaped assistant turn (a `read_file` call) and its tool result, as an agent does,
and the next user turn. While each main turn streams, --side side calls (short, one-turn
requests) are fired concurrently. When the conversation's prompt passes --history tokens it
starts over. Every --replay-every main turns, an earlier main turn's request is sent again and
its greedy reply must equal the recorded one (prefix reuse and batching must not change it).

One JSON line per --interval (kind "interval": main turns, side calls, tool calls, main-turn
decode tok/s, worst gap between two streamed tokens, side-call latency (median, worst), server
RSS (with --server-pid) and VRAM (`/metrics`)), then a summary with the RSS and VRAM slopes
(MiB/min, least squares, after the first interval; RSS less the prefix checkpoints' bytes, which
grow up to --cache-ram by design).
Exit 1 on an error, a replay mismatch or a slope over its bound.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

MIB = 1 << 20
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
ASKS = ("Write a Python function that merges two sorted lists.",
        "Now add type hints to it.", "Explain what the function returns.",
        "Write a test for it.", "Make it work for any number of lists.",
        "What is a hash table?", "Rename the variables to be clearer.")
SIDE = ("Give this conversation a short title.", "Summarize: merging sorted lists.",
        "Is this a question about Python? Answer yes or no.")


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minutes, MiB)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1]) / 1024
    return None


def server_mib(url: str, key: str, name: str) -> float | None:
    """A gauge of the server's /metrics, in MiB (None: NaN or absent)."""
    req = urllib.request.Request(url.removesuffix("/v1") + "/metrics",
                                 headers={"Authorization": f"Bearer {key}"})
    for line in urllib.request.urlopen(req, timeout=30).read().decode().splitlines():
        if line.startswith(name + " "):
            v = float(line.split()[1])
            return None if v != v else v / MIB
    return None


def side_latency(seconds: list[float]) -> dict:
    """Median and worst side-call latency so far (None before the first)."""
    if not seconds:
        return {"side_p50_s": None, "side_max_s": None}
    s = sorted(seconds)
    return {"side_p50_s": round(s[len(s) // 2], 3), "side_max_s": round(s[-1], 3)}


class Soak:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.client = openai.OpenAI(base_url=a.url, api_key=a.api_key, max_retries=0,
                                    timeout=600)
        self.rng = random.Random(a.seed)
        self.main_turns = self.side_calls = self.tool_calls = 0
        self.decode_tokens, self.decode_s, self.worst_gap = 0, 0.0, 0.0
        self.recorded: list[tuple[list[dict], str]] = []
        self.side_s: list[float] = []  # each side call's latency, request to full reply
        self.lock = threading.Lock()

    def main_turn(self, messages: list[dict]) -> tuple[str, int]:
        """Stream one greedy reply: (content, prompt tokens)."""
        stream = self.client.chat.completions.create(
            model="soak", messages=messages, tools=TOOLS, max_tokens=self.a.max_tokens,
            stream=True, stream_options={"include_usage": True})
        parts, last, first, prompt, generated, calls = [], None, None, 0, 0, 0
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                prompt, generated = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            text = (d.content or "") + (getattr(d, "reasoning_content", None) or "")
            if text or d.tool_calls:
                if last is not None:
                    self.worst_gap = max(self.worst_gap, now - last)
                first = first or now
                last = now
            parts.append(d.content or "")
            calls += len(d.tool_calls or [])
        if first is not None and last is not None and generated > 1:
            self.decode_s += last - first  # the first token came from the prefill
            self.decode_tokens += generated - 1
        self.tool_calls += calls
        return "".join(parts), prompt

    def side_call(self) -> None:
        t0 = time.perf_counter()
        r = self.client.chat.completions.create(
            model="soak", messages=[{"role": "user", "content": self.rng.choice(SIDE)}],
            max_tokens=self.a.side_tokens)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        with self.lock:
            self.side_calls += 1
            self.side_s.append(time.perf_counter() - t0)

    def replay(self) -> None:
        messages, expected = self.rng.choice(self.recorded)
        r = self.client.chat.completions.create(model="soak", messages=messages, tools=TOOLS,
                                                max_tokens=self.a.max_tokens)
        got = r.choices[0].message.content or ""
        if got != expected:
            raise RuntimeError(f"replayed greedy turn differs: {got!r} != {expected!r}")

    def run(self) -> int:
        a, start = self.a, time.perf_counter()
        end, next_report = start + a.minutes * 60, start + a.interval
        rss_points, vram_points = [], []
        messages = [{"role": "system", "content": "You are a coding agent."}]
        pool = ThreadPoolExecutor(max(a.side, 1))
        step = 0
        while time.perf_counter() < end:
            messages.append({"role": "user", "content": self.rng.choice(ASKS)})
            sides = [pool.submit(self.side_call) for _ in range(a.side)]
            content, prompt = self.main_turn(messages)
            for f in sides:
                f.result()  # an error fails the soak
            self.recorded = (self.recorded + [(list(messages), content)])[-20:]
            self.main_turns += 1
            step += 1
            call_id = f"call_{step}"
            messages += [
                {"role": "assistant", "content": content or None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {
                        "name": "read_file", "arguments": json.dumps({"path": f"src/m{step}.py"})}}]},
                {"role": "tool", "tool_call_id": call_id,
                 "content": f"def f{step}(x):\n    return x + {step}\n"}]
            if prompt > a.history:
                messages = messages[:1]
            if a.replay_every and step % a.replay_every == 0:
                self.replay()
            now = time.perf_counter()
            if now >= next_report:
                next_report = now + a.interval
                minutes = (now - start) / 60
                rss = rss_mib(a.server_pid)
                vram = server_mib(a.url, a.api_key, "ftchat_vram_bytes")
                cache = server_mib(a.url, a.api_key, "ftchat_prefix_cache_bytes") or 0.0
                if rss is not None:  # the checkpoints grow up to --cache-ram by design
                    rss_points.append((minutes, rss - cache))
                if vram is not None:
                    vram_points.append((minutes, vram))
                self.emit("interval", minutes, rss, vram, prefix_cache_mib=cache)
        rs, vs = slope(rss_points[1:]), slope(vram_points[1:])
        self.emit("summary", (time.perf_counter() - start) / 60, None, None,
                  rss_slope_mib_min=rs, vram_slope_mib_min=vs)
        if rs > a.max_rss_slope or vs > a.max_vram_slope:
            print(f"error: memory grows: RSS {rs:.1f}, VRAM {vs:.1f} MiB/min", file=sys.stderr)
            return 1
        return 0

    def emit(self, kind: str, minutes: float, rss, vram, **extra) -> None:
        tps = self.decode_tokens / self.decode_s if self.decode_s > 0 else None
        line = {"kind": kind, "minutes": round(minutes, 2), "main_turns": self.main_turns,
                "side_calls": self.side_calls, "tool_calls_returned": self.tool_calls,
                "main_decode_tok_s": tps, "worst_gap_s": round(self.worst_gap, 3),
                "side_at_once": self.a.side, **side_latency(self.side_s),
                "rss_mib": rss, "vram_mib": vram, **extra}
        text = json.dumps(line)
        print(text, flush=True)
        if self.a.out:
            with open(self.a.out, "a") as f:
                f.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--minutes", type=float, default=15)
    p.add_argument("--side", type=int, default=1)
    p.add_argument("--server-pid", type=int)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--side-tokens", type=int, default=16)
    p.add_argument("--history", type=int, default=3000)
    p.add_argument("--replay-every", type=int, default=5)
    p.add_argument("--interval", type=float, default=60)
    p.add_argument("--max-rss-slope", type=float, default=16)
    p.add_argument("--max-vram-slope", type=float, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    a = p.parse_args(argv)
    try:
        return Soak(a).run()
    except Exception as e:  # noqa: BLE001 - one line, exit 1
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
