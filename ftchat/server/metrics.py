"""Server figures for `GET /metrics`, in Prometheus' text format.

The engine thread records each finished request (tokens, times, the expert backend's figures);
the HTTP layer counts responses by status. Every update holds the lock; `render` reads under it.
"""

from __future__ import annotations

import threading
from collections import Counter

PREFIX = "ftchat"


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.queue_depth = 0  # jobs admitted and not decoding yet
        self.running = 0
        self.requests: Counter[str] = Counter()  # finished engine requests by stop reason
        self.responses: Counter[tuple[str, int]] = Counter()  # (endpoint, HTTP status)
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = 0
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_s = self.decode_s = 0.0
        self.last_prefill_tps: float | None = None
        self.last_decode_tps: float | None = None
        self.backend: dict[str, float] = {}
        self.cache_bytes = 0  # prefix checkpoints held in host memory
        self.interleaved = 0  # decode steps run while a prompt was half prefilled
        self.served = 0  # requests finished with a reply (record)
        self.prefix_hits = 0  # of them, those that reused a kept prefix
        # tokens decoded (all rows) and prefilled so far, counted as they are made: the live
        # status line's tok/s
        self.live_decoded = self.live_prefilled = 0

    def record(self, prompt: int, cached: int, generated: int, prefill_s: float,
               prefilled: int, decode_s: float, decoded: int, backend: dict, reason: str):
        with self.lock:
            self.requests[reason] += 1
            self.served += 1
            self.prefix_hits += cached > 0
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.generated_tokens += generated
            self.prefill_tokens += prefilled
            self.prefill_s += prefill_s
            self.decode_tokens += decoded
            self.decode_s += decode_s
            if prefill_s > 0 and prefilled:
                self.last_prefill_tps = prefilled / prefill_s
            if decode_s > 0 and decoded:
                self.last_decode_tps = decoded / decode_s
        self.set_backend(backend)

    def set_backend(self, backend: dict) -> None:
        """The expert backend's figures (its `stats()`; None: not known yet)."""
        with self.lock:
            self.backend = {k: v for k, v in backend.items()
                            if v is None or isinstance(v, (int, float))}

    def count_tokens(self, decoded: int = 0, prefilled: int = 0) -> None:
        with self.lock:
            self.live_decoded += decoded
            self.live_prefilled += prefilled

    def count_request(self, reason: str) -> None:
        with self.lock:
            self.requests[reason] += 1

    def count_interleaved(self) -> None:
        with self.lock:
            self.interleaved += 1

    def count_response(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.responses[(endpoint, status)] += 1

    def render(self) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {PREFIX}_{name} {help}")
            lines.append(f"# TYPE {PREFIX}_{name} {kind}")
            for labels, value in samples:
                lines.append(f"{PREFIX}_{name}{labels} {_num(value)}")

        with self.lock:
            metric("queue_depth", "gauge", "Requests admitted and waiting for the engine.",
                   [("", self.queue_depth)])
            metric("requests_running", "gauge", "Requests decoding now.", [("", self.running)])
            metric("requests_total", "counter", "Engine requests finished, by stop reason.",
                   [(f'{{reason="{r}"}}', n) for r, n in sorted(self.requests.items())])
            metric("http_responses_total", "counter", "HTTP responses by endpoint and status.",
                   [(f'{{endpoint="{e}",status="{s}"}}', n)
                    for (e, s), n in sorted(self.responses.items())])
            metric("prefix_cache_bytes", "gauge",
                   "Host memory held by prefix-reuse checkpoints (bounded by --cache-ram).",
                   [("", self.cache_bytes)])
            metric("prefix_cache_hits_total", "counter",
                   "Requests that reused a kept prefix (cached_tokens > 0).",
                   [("", self.prefix_hits)])
            metric("interleaved_decode_steps_total", "counter",
                   "Decode steps run between two prefill chunks of a new prompt.",
                   [("", self.interleaved)])
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [("", self.prompt_tokens)])
            metric("cached_prompt_tokens_total", "counter",
                   "Prompt tokens reused from a kept state (not prefilled).",
                   [("", self.cached_tokens)])
            metric("generated_tokens_total", "counter", "Generated tokens.",
                   [("", self.generated_tokens)])
            metric("prefill_tokens_per_second", "gauge",
                   "Prefill throughput: of the last request, and over all.",
                   [('{window="last"}', self.last_prefill_tps),
                    ('{window="total"}', _rate(self.prefill_tokens, self.prefill_s))])
            metric("decode_tokens_per_second", "gauge",
                   "Decode throughput: of the last request, and over all.",
                   [('{window="last"}', self.last_decode_tps),
                    ('{window="total"}', _rate(self.decode_tokens, self.decode_s))])
            b = self.backend
            installs, useful = b.get("prefetch_installs"), b.get("prefetch_useful")
            precision = useful / installs if installs else None
            for name, help, value in (
                    ("demand_misses_per_token", "Expert demand misses per decoded token "
                     "(offloading backend; NaN with every expert resident).",
                     b.get("misses_per_token")),
                    ("expert_hit_rate", "Expert slot-cache hit rate.", b.get("hit_rate")),
                    ("prefetch_precision", "Prefetched experts later used, of those copied.",
                     precision),
                    ("vram_bytes", "GPU memory allocated (CUDA only).", b.get("vram_bytes"))):
                metric(name, "gauge", help, [("", value)])
        return "\n".join(lines) + "\n"


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 and tokens else None


def _num(value: float | None) -> str:
    if value is None:
        return "NaN"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
