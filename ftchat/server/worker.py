"""The engine thread: the only thread that calls torch. It loads the model, then serves jobs
from a bounded FIFO queue one at a time, each through `engine.decode` (the loop every caller
runs), and hands text back through the job's `emit` (thread-safe: the HTTP layer passes a
function that puts into its asyncio queue).

One decode row holds the last conversation; a request that continues it prefills only its new
tokens, and one that shares a prefix with a checkpoint (prefix_cache.py) restores it first.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ftchat import engine
from ftchat.model.config import check_context
from ftchat.model.registry import load_args
from ftchat.model.tokenizer import StreamDecoder
from ftchat.resolve import ResolvedModel
from ftchat.sampling import Sampler, Sampling
from ftchat.server.metrics import Metrics
from ftchat.server.prefix_cache import PrefixCache, restore
from ftchat.session import Session, StopText
from ftchat.settings import Settings
from ftchat.ui.run import apply_threads, plan_run

WARM_UP_TOKENS = 8


class Cancelled(Exception):
    """The client went away: the job stops where it is."""


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    reason: str  # eos | stop_string | length | context | cancelled
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass
class Job:
    id: str
    ids: list[int]
    limit: int
    stops: tuple[str, ...]
    sampling: Sampling
    splits: tuple[int, ...]  # prompt lengths worth a checkpoint
    emit: Callable[[Delta | Finished | Failed], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class EngineWorker:
    """Loads the model on its own thread, then serves `submit`ted jobs in order."""

    def __init__(self, resolved: ResolvedModel, settings: Settings, queue_size: int,
                 cache_bytes: int, metrics: Metrics, log: Callable[[str], None]):
        self.resolved, self.settings = resolved, settings
        self.queue_size, self.metrics, self.log = queue_size, metrics, log
        self.cache = PrefixCache(cache_bytes)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.admitted = 0  # jobs queued or decoding
        self.running = False
        self.state = "loading"  # loading | ready | failed
        self.error: str | None = None
        self.max_len = 0
        self.thread = threading.Thread(target=self._main, name="ftchat-engine", daemon=True)
        self.live: list[int] | None = None  # the tokens decode row 0 holds, when whole

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)

    def submit(self, job: Job) -> bool:
        """Queue `job`; False when the queue is full (busy engine and queue_size waiting)."""
        with self.lock:
            if self.admitted >= self.queue_size + 1:  # one decodes, queue_size wait
                return False
            self.admitted += 1
            self.metrics.queue_depth = self.admitted - self.running
        self.jobs.put(job)
        return True

    # ===== the engine thread =====
    def _main(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - reported by /health and the log
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            self.log(f"ftchat serve: loading failed: {self.error}")
            return
        self.state = "ready"
        while (job := self.jobs.get()) is not None:
            with self.lock:
                self.running = True
                self.metrics.queue_depth, self.metrics.running = self.admitted - 1, 1
            try:
                if job.cancelled.is_set():
                    job.emit(Finished("cancelled", len(job.ids), 0, 0, 0.0, 0.0))
                else:
                    self._serve(job)
            except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
                self.live = None
                self.metrics.count_request("error")
                self.log(f"ftchat serve: {job.id}: failed: {type(e).__name__}: {e}")
                job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
            finally:
                with self.lock:
                    self.running = False
                    self.admitted -= 1
                    self.metrics.queue_depth, self.metrics.running = self.admitted, 0

    def _load(self) -> None:
        s = self.settings
        apply_threads(s)
        check_context(load_args(self.resolved.path), s.context)
        s = self.settings = plan_run(self.resolved, s)
        t = time.perf_counter()
        self.session = Session.open(self.resolved.path, s)
        self.max_len = self.session.max_len
        self.dec = engine.Decoder(self.session.model, self.session.experts, 1, self.max_len,
                                  graph=s.use_graph(), prefill_chunk=s.prefill_chunk,
                                  kv_dtype=s.kv_torch_dtype())
        if self.session.warms_up():  # kernels compiled before the first request
            n = min(WARM_UP_TOKENS, self.max_len)
            self.dec.prefill(0, torch.full((n,), self.session.im_end, dtype=torch.long), 0)
            self.dec.reset()
        self.log(f"ftchat serve: {self.resolved.name}: {self.session.describe()}; loaded in "
                 f"{time.perf_counter() - t:.1f} s")

    def _start(self, ids: list[int]) -> int:
        """Put row 0 at the longest reusable prefix of `ids`; the tokens it holds."""
        live = self.live
        self.live = None  # the row is rewritten from here on
        if live is not None and len(live) < len(ids) and ids[:len(live)] == live:
            return len(live)
        self.dec.reset(experts=False)
        ck = self.cache.best(ids)
        if ck is None:
            return 0
        restore(self.dec.state, 0, ck)
        return len(ck.tokens)

    def _serve(self, job: Job) -> None:
        dec, ids, tok = self.dec, job.ids, self.session.tokenizer
        t0 = time.perf_counter()

        def check(done: int, total: int) -> None:
            if job.cancelled.is_set():
                raise Cancelled

        start = cached = self._start(ids)
        try:
            for cut in job.splits:  # checkpoints inside the prompt
                if start < cut < len(ids):
                    check(0, 0)
                    dec.prefill(0, torch.tensor(ids[start:cut]), start, check)
                    self.cache.add(dec.state, 0, ids[:cut])
                    start = cut
            choose = None if job.sampling.greedy else Sampler([job.sampling], [ids],
                                                                dec.m.device)
            steps = engine.decode(dec, [ids[start:]], [start], [job.limit],
                                  tok.eos_ids, choose, on_prefill=check)
            text, words = StreamDecoder(tok), StopText(job.stops)
            generated: list[int] = []
            reason, prefill_s, step = "cancelled", 0.0, None
            for step in steps:
                if not generated:
                    prefill_s = time.perf_counter() - t0
                    self.cache.add(dec.state, 0, ids)  # the end of the prompt
                t, reason = step.tokens[0], step.stops[0]
                generated.append(t)
                if reason != "eos":
                    piece = words.feed(text.feed(t))
                    if words.hit is not None:
                        reason = "stop_string"
                    if piece:
                        job.emit(Delta(piece))
                if reason is None and job.cancelled.is_set():
                    reason = "cancelled"
                if reason is not None:
                    break
            steps.close()
        except Cancelled:
            self.metrics.count_request("cancelled")
            job.emit(Finished("cancelled", len(ids), cached, 0, time.perf_counter() - t0, 0.0))
            return  # the row is half-written: self.live stays None
        rest = words.feed(text.flush()) + words.flush() if reason != "stop_string" else ""
        if rest:
            job.emit(Delta(rest))
        # the state holds the prompt and every generated token but the last (never fed)
        self.live = ids + generated[:-1]
        decode_s = step.decode_s if step is not None else 0.0
        decode_tokens = step.decode_tokens if step is not None else 0
        stats = dict(self.session.experts.stats())
        if dec.m.device.type == "cuda":
            stats["vram_bytes"] = torch.cuda.memory_allocated(dec.m.device)
        self.metrics.record(len(ids), cached, len(generated), prefill_s, len(ids) - cached,
                            decode_s, decode_tokens, stats, reason)
        self.log(_log_line(job.id, len(ids), cached, len(generated), prefill_s,
                           len(ids) - cached, decode_s, decode_tokens, stats, reason))
        job.emit(Finished(reason, len(ids), cached, len(generated), prefill_s, decode_s))


def _log_line(rid, prompt, cached, generated, prefill_s, prefilled, decode_s, decoded, stats,
              reason) -> str:
    pf = f"{prefilled / prefill_s:.1f}" if prefill_s > 0 else "-"
    dc = f"{decoded / decode_s:.1f}" if decode_s > 0 and decoded else "-"
    mpt = stats.get("misses_per_token")
    misses = f", {mpt:.2f} misses/token" if mpt is not None else ""
    return (f"ftchat serve: {rid}: prompt {prompt} (cached {cached}), generated {generated}, "
            f"prefill {pf} tok/s, decode {dc} tok/s{misses}, stop {reason}")


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
