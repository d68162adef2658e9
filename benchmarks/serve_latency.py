"""Serve latency against a running `ftchat serve`: a second turn's time to first token with the
conversation's prefix reused vs cold, and a main turn's decode with side calls beside it.

    python benchmarks/serve_latency.py --url http://127.0.0.1:8080/v1 --history 3500,32000 \
        [--sides 0,1,3] [--main-tokens 256] [--side-tokens 16] [--reps 3] [--json FILE]

Time to first token (per history H, --reps times): turn 1 of a conversation whose user message
holds about H tokens of code (untimed, 16 greedy tokens), then turn 2 (turn 1, its reply, a new
question) with max_tokens 1, timed: the server reuses turn 1's kept state. The same turn 2
with another system line (a fresh nonce in its first tokens) is the cold arm: the same length,
no prefix to reuse. Each request's usage.prompt_tokens_details.cached_tokens is recorded.

Decode beside side calls (per history H and side count k): one main turn streams --main-tokens
greedy tokens (on /v1/completions, with `ignore_eos`, so all of them) after a prompt of about H
tokens (the warm-up's prompt: its prefix is reused, so its prefill is short); as soon as the
server has taken it, k threads send short side calls back to back until it ends. Main-turn
decode tok/s is the server's own (`timings.predicted_per_second` of the usage chunk: its decode
steps' tokens over their time), which holds also when the client sees no text per token (a
random-weight checkpoint's ids often decode to no text); the client's view, first text chunk to
the finish chunk, and its worst gap between text chunks are kept beside it when the text
streamed (in at least half as many chunks as tokens). Each side call's latency is request to
full reply. The server needs --parallel >= 1 + max(k).

One JSON object on stdout (and in --json): {"ttft": [...], "decode": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai

QUESTION = "Summarize what this file does."
FOLLOW_UP = "Now list the functions it defines."
SIDE_ASKS = ("Give this conversation a short title.", "Is this about Python? Answer yes or no.",
             "Summarize: merging sorted lists.")


def filler(lines: int) -> str:
    """Code-like text, `lines` lines (distinct, so no tokenizer merges them away)."""
    return "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(lines))


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.client = openai.OpenAI(base_url=a.url, api_key=a.api_key, max_retries=0,
                                    timeout=900)
        self.nonce = 0
        self.per_line = self.fixed = 0.0

    def system(self) -> dict:
        self.nonce += 1  # fixed width: the cold arm's prompt has the reused arm's length
        return {"role": "system", "content": f"Session {self.nonce:06d}. You are a coding agent."}

    def create(self, messages: list[dict], max_tokens: int):
        t0 = time.perf_counter()
        r = self.client.chat.completions.create(model="bench", messages=messages,
                                                max_tokens=max_tokens, temperature=0)
        return r, time.perf_counter() - t0

    def calibrate(self) -> None:
        """Prompt tokens per filler line, from two small cold prompts."""
        counts = []
        for lines in (8, 32):
            user = {"role": "user", "content": filler(lines) + QUESTION}
            r, _ = self.create([self.system(), user], 1)
            counts.append(r.usage.prompt_tokens)
        self.per_line = (counts[1] - counts[0]) / 24
        self.fixed = counts[0] - 8 * self.per_line

    def prompt(self, history: int) -> str:
        lines = max(1, int((history - self.fixed) / self.per_line))
        return filler(lines) + QUESTION

    def ttft(self, history: int) -> dict:
        user = {"role": "user", "content": self.prompt(history)}
        reuse_s, cold_s, cached_reuse, cached_cold, prompt_tokens = [], [], [], [], []
        for _ in range(self.a.reps):
            turn1 = [self.system(), user]
            r1, _ = self.create(turn1, 16)
            # the reply as a client sends it back; a random-weight model's may be empty
            reply = r1.choices[0].message.content or "It defines functions."
            turn2 = turn1 + [{"role": "assistant", "content": reply},
                             {"role": "user", "content": FOLLOW_UP}]
            r, s = self.create(turn2, 1)
            reuse_s.append(s)
            cached_reuse.append(r.usage.prompt_tokens_details.cached_tokens)
            prompt_tokens.append(r.usage.prompt_tokens)
            r, s = self.create([self.system()] + turn2[1:], 1)
            cold_s.append(s)
            cached_cold.append(r.usage.prompt_tokens_details.cached_tokens)
        return {"history": history, "prompt_tokens": prompt_tokens,
                "reuse_s": [round(s, 4) for s in reuse_s], "cold_s": [round(s, 4) for s in cold_s],
                "cached_tokens_reuse": cached_reuse, "cached_tokens_cold": cached_cold,
                "reuse_median_s": round(statistics.median(reuse_s), 4),
                "cold_median_s": round(statistics.median(cold_s), 4)}

    def side_loop(self, done: threading.Event, latencies: list[float], lock) -> None:
        i = 0
        while not done.is_set():
            ask = SIDE_ASKS[i % len(SIDE_ASKS)]
            i += 1
            r, s = self.create([{"role": "user", "content": ask}], self.a.side_tokens)
            if r.choices[0].finish_reason not in ("stop", "length", "tool_calls"):
                raise RuntimeError(f"side call ended with {r.choices[0].finish_reason}")
            with lock:
                latencies.append(s)

    def decode(self, history: int, sides: int) -> dict:
        # the main turn on /v1/completions: its text streams token by token whatever the model
        # writes (a chat reply's text can be held back whole, e.g. a random-weight model's
        # `<tool_call>` block, and the side calls would start at its end); one prompt per
        # history, so the warm-up's prompt state is reused by every arm
        prompt = f"Main turn at {history} tokens.\n{self.prompt(history)}\n"
        done, lock, latencies = threading.Event(), threading.Lock(), []
        pool = ThreadPoolExecutor(max(sides, 1))
        first, last, gap, usage, timings, texts = None, None, 0.0, None, None, 0
        stream = self.client.completions.create(
            model="bench", prompt=prompt, max_tokens=self.a.main_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})  # all --main-tokens: a trained model stops early
        futures = [pool.submit(self.side_loop, done, latencies, lock) for _ in range(sides)]
        try:
            for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage, timings = chunk.usage, (chunk.model_extra or {}).get("timings")
                if not chunk.choices:
                    continue
                if chunk.choices[0].text:
                    texts += 1
                    if first is None:
                        first = now
                    elif last is not None:
                        gap = max(gap, now - last)
                    last = now
                if chunk.choices[0].finish_reason and first is not None:
                    last = now  # its last tokens may carry no text (held back, end-of-turn)
        finally:
            done.set()
            for f in futures:
                f.result()  # a side call's error fails the benchmark
            pool.shutdown()
        generated = usage.completion_tokens if usage else 0
        # the client's view only where the text streamed (a chunk for most tokens)
        streamed = texts >= generated / 2 and first and last and last > first
        client = (generated - 1) / (last - first) if streamed else None
        server = (timings or {}).get("predicted_per_second")
        lat = sorted(latencies)
        return {"history": history, "sides": sides, "prompt_tokens": usage.prompt_tokens,
                "main_tokens": generated, "main_decode_tok_s": server,
                "main_decode_tok_s_client": client and round(client, 2),
                "main_worst_gap_s": round(gap, 4) if client else None, "side_calls": len(lat),
                "side_p50_s": round(lat[len(lat) // 2], 4) if lat else None,
                "side_max_s": round(lat[-1], 4) if lat else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--history", default="3500", help="prompt sizes in tokens, a comma list")
    p.add_argument("--sides", default="0,1,3", help="side calls beside the main turn")
    p.add_argument("--main-tokens", type=int, default=256)
    p.add_argument("--side-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="also write the result here")
    a = p.parse_args(argv)
    try:
        histories = [int(h) for h in a.history.split(",")]
        sides = [int(s) for s in a.sides.split(",")]
        b = Bench(a)
        b.calibrate()
        out = {"ttft": [], "decode": []}
        for h in histories:
            out["ttft"].append(b.ttft(h))
            print(json.dumps(out["ttft"][-1]), file=sys.stderr, flush=True)
        for h in histories:
            b.decode(h, 0)  # warm-up: the prompt's state is kept for the arms below
            for k in sides:
                out["decode"].append(b.decode(h, k))
                print(json.dumps(out["decode"][-1]), file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - one line, exit 1
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
