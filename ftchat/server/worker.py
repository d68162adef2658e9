"""The engine thread: the only thread that calls torch. It loads the model, then serves jobs
from a bounded FIFO queue, up to `parallel` decoding together in the rows of one `Decoder`, and
hands text back through each job's `emit` (thread-safe: the HTTP layer passes a function that
puts into its asyncio queue).

A job that arrives while others decode is prefilled into a free row one chunk at a time, one
chunk between two of their decode steps, then joins the steps. This is engine.decode's loop
(the same `Decoder.prefill`, `Decoder.step`, `engine.pick`, `engine.stop_reason` and
`Sampler`), written per row so that rows join and leave at any step. Each row keeps the
conversation it decoded while no other request rides along in its place; a request that
continues it prefills only its new tokens, and one that shares a prefix with a checkpoint
(prefix_cache.py) restores it first.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ftchat import engine
from ftchat.errors import out_of_memory_message
from ftchat.model.config import check_context
from ftchat.model.registry import load_args
from ftchat.model.tokenizer import StreamDecoder
from ftchat.resolve import ResolvedModel
from ftchat.sampling import Sampler, Sampling
from ftchat.server.metrics import Metrics
from ftchat.server.prefix_cache import (PrefixCache, restore, restore_recurrent,
                                        save_recurrent)
from ftchat.session import Session, StopText
from ftchat.settings import Settings
from ftchat.sizes import PREFILL_CHUNK
from ftchat.ui.run import apply_threads, plan_run

WARM_UP_TOKENS = 8
CHECKPOINT_EVERY = 8192  # tokens of a long prefill between two state checkpoints
# a split below this many tokens gets no checkpoint of its own: each one cuts the prompt's
# prefill into one more call, whose fixed cost (on the CPU the routed experts' dequantization:
# 0.25 s for 14 tokens, twice a decode step) outweighs prefilling so short a prefix again; a
# side call's short prompt prefills in one call
CHECKPOINT_MIN_TOKENS = 256


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
    decoded_tokens: int = 0  # tokens from decode steps (the first token comes from the prefill)


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
    ignore_eos: bool = False  # end-of-turn tokens neither end the reply nor show in its text


@dataclass
class Row:
    """A request decoding in row `b` of the decoder."""

    job: Job
    cached: int  # prompt tokens restored, not prefilled
    length: int  # tokens in the row's state
    sampler: Sampler | None
    text: StreamDecoder
    words: StopText
    t0: float  # when the job started
    prefill_s: float = 0.0
    decode_t0: float = 0.0  # when the first token was chosen
    decode_tokens: int = 0  # tokens from decode steps
    generated: list[int] = field(default_factory=list)
    pieces: list[tuple[int, int, bool]] = field(default_factory=list)  # prefill chunks to run:
    # (from, to, checkpoint after)


class EngineWorker:
    """Loads the model on its own thread, then serves `submit`ted jobs in arrival order, up to
    `parallel` of them decoding together (one decode step for all rows; a new job's prompt is
    prefilled one chunk between two steps)."""

    def __init__(self, resolved: ResolvedModel, settings: Settings, queue_size: int,
                 parallel: int, cache_bytes: int, metrics: Metrics,
                 log: Callable[[str], None], log_requests: bool = True):
        self.resolved, self.settings = resolved, settings
        self.queue_size, self.parallel = queue_size, parallel
        self.metrics, self.log = metrics, log
        self.log_requests = log_requests  # a line per finished request (off: --quiet)
        self.cache = PrefixCache(cache_bytes)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.admitted = 0  # jobs queued or decoding
        self.state = "loading"  # loading | ready | failed
        self.load_error: Exception | None = None  # why loading failed: serve exits with it
        self.max_len = 0
        self.thread = threading.Thread(target=self._main, name="ftchat-engine", daemon=True)
        self.rows: list[Row | None] = [None] * parallel
        self.live: list[list[int] | None] = [None] * parallel  # tokens a whole row holds

    @property
    def error(self) -> str | None:
        """Why loading failed, one line for /health and the status line (None: it did not)."""
        e = self.load_error
        return None if e is None else f"{type(e).__name__}: {e}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)

    def submit(self, job: Job) -> bool:
        """Queue `job`; False when `parallel` jobs decode and `queue_size` wait already."""
        with self.lock:
            if self.admitted >= self.queue_size + self.parallel:
                return False
            self.admitted += 1
            self._gauges()
        self.jobs.put(job)
        return True

    def _gauges(self) -> None:  # under self.lock
        running = sum(r is not None for r in self.rows)
        self.metrics.queue_depth, self.metrics.running = self.admitted - running, running

    def _release(self, b: int | None) -> None:
        with self.lock:
            if b is not None:
                self.rows[b] = None
            self.admitted -= 1
            self._gauges()

    # ===== the engine thread =====
    def _main(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - reported by /health and the log; serve exits
            self.load_error = e
            self.state = "failed"  # last: the error is set when serve sees the state
            return
        self.state = "ready"
        while True:
            while None in self.rows:  # admit waiting jobs into free rows
                idle = all(r is None for r in self.rows)
                try:
                    job = self.jobs.get(block=idle)
                except queue.Empty:
                    break
                if job is None:
                    return
                self._guard(job, lambda j: self._admit(self._pick_row(j.ids), j), job)
            filling = [b for b, r in enumerate(self.rows) if r is not None and r.pieces]
            if filling:  # one prefill chunk of the oldest prompt, then a decode step
                b = min(filling, key=lambda b: self.rows[b].t0)
                self._guard(self.rows[b].job, self._prefill_chunk, b)
            if any(r is not None and not r.pieces for r in self.rows):
                self._guard(None, self._step)

    def _guard(self, job: Job | None, fn, *args) -> None:
        """Run fn; a failure ends the jobs it touched (`job`, or every decoding one) with an
        error event, and the server goes on. A job that fails before it has a row (admission)
        ends alone."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            message = out_of_memory_message(e) or f"internal error: {type(e).__name__}: {e}"
            hit = [(b, r.job) for b, r in enumerate(self.rows)
                   if r is not None and (job is None or r.job is job)]
            for b, j in hit:
                self._fail(b, j, message)
            if job is not None and not hit:
                self._fail(None, job, message)

    def _fail(self, b: int | None, job: Job, message: str) -> None:
        """Job of row b (None: of no row yet) ends with an error event; the row's state is not
        kept."""
        if b is not None:
            self.live[b] = None  # half-written
        self._release(b)
        self.metrics.count_request("error")
        self.log(f"ftchat serve: {job.id}: failed: {message}")
        job.emit(Failed(message))

    def _load(self) -> None:
        s = self.settings
        apply_threads(s)
        check_context(load_args(self.resolved.path), s.context)
        s = self.settings = plan_run(self.resolved, s)
        t = time.perf_counter()
        self.session = Session.open(self.resolved.path, s)
        self.max_len = self.session.max_len
        self.dec = engine.Decoder(self.session.model, self.session.experts, self.parallel,
                                  self.max_len, graph=s.use_graph(),
                                  prefill_chunk=s.prefill_chunk, kv_dtype=s.kv_torch_dtype())
        if self.session.warms_up():  # kernels compiled before the first request
            n = min(WARM_UP_TOKENS, self.max_len)
            self.dec.prefill(0, torch.full((n,), self.session.im_end, dtype=torch.long), 0)
            self.dec.reset()
        self.metrics.set_backend(self.session.experts.stats())  # whether it reports misses
        self.log(f"ftchat serve: {self.resolved.name}: {self.session.describe()}; loaded in "
                 f"{time.perf_counter() - t:.1f} s")

    def _pick_row(self, ids: list[int]) -> int:
        """A free row: one whose kept conversation `ids` continues, else one keeping none, else
        the least useful (the first)."""
        free = [b for b, r in enumerate(self.rows) if r is None]
        for b in free:
            live = self.live[b]
            if live is not None and len(live) < len(ids) and ids[:len(live)] == live:
                return b
        return next((b for b in free if self.live[b] is None), free[0])

    def _start(self, b: int, ids: list[int]) -> tuple[int, torch.Tensor | None]:
        """Put row b at the longest reusable prefix of `ids`: the tokens it holds, and when
        that is all of `ids` (a checkpoint of the same prompt) their last logits [1, V]."""
        live, self.live[b] = self.live[b], None  # the row is rewritten from here on
        if live is not None and len(live) < len(ids) and ids[:len(live)] == live:
            return len(live), None
        self.dec.state.reset(slice(b, b + 1), self.session.model.args.eos_token_id or 0)
        ck = self.cache.best(ids)
        if ck is None:
            return 0, None
        restore(self.dec.state, b, ck)
        whole = len(ck.tokens) == len(ids)
        return len(ck.tokens), ck.logits.to(self.dec.m.device) if whole else None

    def _admit(self, b: int, job: Job) -> None:
        """Give job row b: restore the longest reusable prefix, and plan the prefill of the
        rest in chunks (the decode steps of the other rows run between them)."""
        if job.cancelled.is_set():
            self._release(None)
            job.emit(Finished("cancelled", len(job.ids), 0, 0, 0.0, 0.0))
            return
        row = Row(job, 0, 0, None, StreamDecoder(self.session.tokenizer), StopText(job.stops),
                  time.perf_counter())
        with self.lock:
            self.rows[b] = row
            self._gauges()
        try:
            start, logits = self._start(b, job.ids)
        except Exception as e:  # noqa: BLE001 - the restore failed: this job ends
            self._guard(job, _raise, e)
            return
        row.cached = start
        if logits is not None:  # the whole prompt restored: nothing to prefill
            self._first_token(b, row, logits)
            return
        row.pieces = plan_prefill(start, len(job.ids), job.splits,
                                  self.dec.prefill_chunk or PREFILL_CHUNK)

    def _prefill_chunk(self, b: int) -> None:
        dec, row = self.dec, self.rows[b]
        ids, (i, j, checkpoint) = row.job.ids, row.pieces.pop(0)
        if row.job.cancelled.is_set():
            self.metrics.count_request("cancelled")
            self._release(b)  # the row is half-written: its live stays None
            row.job.emit(Finished("cancelled", len(ids), row.cached, 0,
                                  time.perf_counter() - row.t0, 0.0))
            return
        logits = dec.prefill(b, torch.tensor(ids[i:j]), i)  # [1, V] of token j - 1
        self.metrics.count_tokens(prefilled=j - i)
        if checkpoint:  # at the end of the prompt with its logits (the same prompt again)
            self.cache.add(dec.state, b, ids[:j], logits if j == len(ids) else None)
            self.metrics.cache_bytes = self.cache.nbytes
        if row.pieces:
            return
        self._first_token(b, row, logits)

    def _first_token(self, b: int, row: Row, logits: torch.Tensor) -> None:
        """Row b holds the whole prompt and `logits` [1, V] are its last token's: choose the
        reply's first token."""
        row.length = len(row.job.ids)
        if not row.job.sampling.greedy:
            row.sampler = Sampler([row.job.sampling], [row.job.ids], self.dec.m.device)
        tok = _pick(logits, [row])[0]
        row.prefill_s = time.perf_counter() - row.t0
        row.decode_t0 = time.perf_counter()
        self._accept(b, row, tok)

    def _step(self) -> None:
        """One decode step of every row. A free row rides along on a dummy token (its state is
        no longer a conversation worth keeping); a row whose prompt is half prefilled rides
        along at the last position of the context (K/V written there are rewritten before
        they are read) with its recurrent state saved before the step and put back after."""
        eos, last = self.session.model.args.eos_token_id or 0, self.max_len - 1
        tokens, lengths, saved = [], [], []
        for b, r in enumerate(self.rows):
            if r is None:
                self.live[b] = None
            elif r.pieces:
                saved.append((b, save_recurrent(self.dec.state, b)))
                self.metrics.count_interleaved()
            decoding = r is not None and not r.pieces
            tokens.append(r.generated[-1] if decoding else eos)
            lengths.append(r.length if decoding else last if r is not None else 0)
        logits = self.dec.step(torch.tensor(tokens, device=self.dec.m.device), lengths)
        for b, parts in saved:
            restore_recurrent(self.dec.state, b, parts)
        rows = [r if r is not None and not r.pieces else None for r in self.rows]
        self.metrics.count_tokens(decoded=sum(r is not None for r in rows))
        chosen = _pick(logits, rows)
        for b, r in enumerate(rows):
            if r is not None:
                r.length += 1
                r.decode_tokens += 1
                self._accept(b, r, chosen[b])

    def _accept(self, b: int, r: Row, tok: int) -> None:
        """Row b chose `tok`: its text goes out; the row ends on a stop rule or a cancel, or
        alone with an error when its logits were broken (tok -1)."""
        if tok < 0:
            where = f"{r.job.id}, position {r.length - 1}"
            self._fail(b, r.job, str(engine.broken_output(self.dec.m.dtype, where)))
            return
        r.generated.append(tok)
        eos = self.session.tokenizer.eos_ids
        reason = engine.stop_reason(tok, len(r.generated), r.job.limit, r.length, self.max_len,
                                    frozenset() if r.job.ignore_eos else eos)
        if tok not in eos:  # an end-of-turn token's text is never shown
            piece = r.words.feed(r.text.feed(tok))
            if r.words.hit is not None:
                reason = "stop_string"
            if piece:
                r.job.emit(Delta(piece))
        if reason is None and r.job.cancelled.is_set():
            reason = "cancelled"
        if reason is not None:
            self._finish(b, r, reason)

    def _finish(self, b: int, r: Row, reason: str) -> None:
        if reason != "stop_string":
            rest = r.words.feed(r.text.flush()) + r.words.flush()
            if rest:
                r.job.emit(Delta(rest))
        ids = r.job.ids
        self.live[b] = ids + r.generated[:-1]  # the last token was never fed
        decode_s = time.perf_counter() - r.decode_t0 if r.decode_tokens else 0.0
        stats = dict(self.session.experts.stats())
        if self.dec.m.device.type == "cuda":
            stats["vram_bytes"] = torch.cuda.memory_allocated(self.dec.m.device)
        prefilled = len(ids) - r.cached
        self.metrics.record(len(ids), r.cached, len(r.generated), r.prefill_s, prefilled,
                            decode_s, r.decode_tokens, stats, reason)
        if self.log_requests:
            self.log(_log_line(r.job.id, len(ids), r.cached, len(r.generated), r.prefill_s,
                               prefilled, decode_s, r.decode_tokens, stats, reason))
        self._release(b)
        r.job.emit(Finished(reason, len(ids), r.cached, len(r.generated), r.prefill_s,
                            decode_s, r.decode_tokens))


def plan_prefill(start: int, total: int, splits: Sequence[int], chunk: int,
                 every: int = CHECKPOINT_EVERY,
                 least: int = CHECKPOINT_MIN_TOKENS) -> list[tuple[int, int, bool]]:
    """The prefill of tokens [start, total) as (from, to, checkpoint after) pieces of at most
    `chunk` tokens: a checkpoint at each split (the system prefix, the history) of at least
    `least` tokens, every `every` tokens of a long prompt, and at its end; a piece never
    crosses one of them."""
    cuts = {c for c in splits if start < c < total and c >= least}
    cuts.update(range(every, total, every))
    cuts = sorted(c for c in cuts if c > start) + [total]
    pieces = []
    for cut in cuts:
        pieces += [(i, min(i + chunk, cut), i + chunk >= cut) for i in range(start, cut, chunk)]
        start = cut
    return pieces


def _pick(logits: torch.Tensor, rows: Sequence[Row | None]) -> list[int]:
    """The tokens of logits [B, V] (engine.pick: one SYNC for every row): row b's by its
    sampler, else the argmax (rows[b] None: a free or half-prefilled row, its token unused);
    -1 where row b's logits hold NaN or +Inf."""
    samplers = [(b, r.sampler) for b, r in enumerate(rows)
                if r is not None and r.sampler is not None]
    if not samplers:
        return engine.pick(logits)

    def choose(x: torch.Tensor) -> torch.Tensor:
        picked = x.argmax(-1)  # [B]
        for b, sampler in samplers:  # each row draws from its own generator
            picked[b] = sampler(x[b:b + 1])[0]
        return picked

    return engine.pick(logits, choose)


def _raise(e: Exception) -> None:
    raise e


def _log_line(rid, prompt, cached, generated, prefill_s, prefilled, decode_s, decoded, stats,
              reason) -> str:
    pf = f"{prefilled / prefill_s:.1f}" if prefill_s > 0 and prefilled else "-"
    dc = f"{decoded / decode_s:.1f}" if decode_s > 0 and decoded else "-"
    mpt = stats.get("misses_per_token")
    misses = f", {mpt:.2f} misses/token" if mpt is not None else ""
    return (f"ftchat serve: {rid}: prompt {prompt} (cached {cached}), generated {generated}, "
            f"prefill {pf} tok/s, decode {dc} tok/s{misses}, stop {reason}")
