"""Piped mode: prompts from stdin (or --prompt), replies to stdout in input order, each prompt
answered as it arrives.

Input: one prompt per line; a line starting with `{` is a JSON object (`JSON_KEYS`: "prompt"
and optional per-prompt settings); blank lines are skipped. Lines are read as they arrive: the
first waiting prompt and up to --batch-size - 1 more that are already there decode together, so
a slow producer's first prompt is answered before its next line exists.
Output, plain: one line per reply, with `\\`, newline, CR, tab and other control characters
written as backslash escapes (`\\\\`, `\\n`, `\\r`, `\\t`, `\\x1b`). A --prompt reply is written
as is. With --json: one object per prompt (see `json_reply`).

A bad line (invalid JSON, a wrong field, an empty prompt, not UTF-8, too long for the
context): one `error:` line naming it on stderr, and in its reply's place an object
`{"index": i, "error": "..."}` with --json, an empty line without; the other lines are answered
and the exit status is 1 at the end. A bad --prompt is the run's error.
"""

from __future__ import annotations

import json
import os
import select
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TextIO

from ftchat.errors import FtchatError
from ftchat.model.tokenizer import check_unicode
from ftchat.sampling import Sampling
from ftchat.session import Session, StepRecord, StopText
from ftchat.settings import Settings
from ftchat.sizes import MAX_LINE_BYTES
from ftchat.ui.panel import PanelWriter, PlainWriter, Screen, isatty, timing_parts
from ftchat.ui.text import ReplyText, one_line, plural, printable, split_reasoning

# key -> what its value must be (for the messages); "prompt" is the only required key
JSON_KEYS = {
    "prompt": "a string with some text in it",
    "system": "a string",
    "max_new_tokens": "a positive integer",
    "stop": "a non-empty string or a list of them",
    "temperature": "a number >= 0 (0: greedy)",
    "top_k": "an integer >= 0 (0: off)",
    "top_p": "a number above 0 and at most 1",
    "repeat_penalty": "a positive number (1: no penalty)",
    "min_p": "a number from 0 to 1 (0: off)",
    "seed": "an integer from 0 to 2**63 - 1",
}


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v \
        and abs(v) != float("inf")


def _integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_VALID: dict[str, Callable[[object], bool]] = {
    "prompt": lambda v: isinstance(v, str) and bool(v.strip()),
    "system": lambda v: isinstance(v, str),
    "max_new_tokens": lambda v: _integer(v) and v >= 1,
    "stop": lambda v: (isinstance(v, str) and v != "") or (
        isinstance(v, list) and all(isinstance(x, str) and x != "" for x in v)),
    "temperature": lambda v: _number(v) and v >= 0,
    "top_k": lambda v: _integer(v) and v >= 0,
    "top_p": lambda v: _number(v) and 0 < v <= 1,
    "repeat_penalty": lambda v: _number(v) and v > 0,
    "min_p": lambda v: _number(v) and 0 <= v <= 1,
    "seed": lambda v: _integer(v) and 0 <= v < 2**63,
}


@dataclass(frozen=True)
class Job:
    """One prompt and how to answer it (None: the settings' value)."""

    prompt: str
    system: str | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    sampling: Sampling | None = None
    source: str = "--prompt"  # where it came from, for its errors ("stdin line 3")

    def messages(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return [*sys_msg, {"role": "user", "content": self.prompt}]


@dataclass(frozen=True)
class BadLine:
    """An input line that cannot be answered, and why (one line)."""

    message: str


def parse_line(line: str, lineno: int, settings: Settings) -> Job | None:
    """The job of one input line (None for a blank line); FtchatError for a bad one."""
    if not line.strip():
        return None
    where = f"stdin line {lineno}"
    if not line.lstrip().startswith("{"):
        return Job(line, settings.system, source=where)
    try:
        obj = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or an integer past int()'s digit limit
        detail = e if isinstance(e, json.JSONDecodeError) else "a number has too many digits"
        raise FtchatError(f"{where}: invalid JSON ({detail})") from None
    except RecursionError:
        raise FtchatError(f"{where}: the JSON is nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise FtchatError(f"{where}: expected a JSON object")
    unknown = sorted(set(obj) - set(JSON_KEYS))
    if unknown:
        raise FtchatError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(JSON_KEYS)})")
    if "prompt" not in obj:
        raise FtchatError(f"{where}: \"prompt\" is missing")
    for key, value in obj.items():
        if not _VALID[key](value):
            what = "empty" if key == "prompt" and isinstance(value, str) else None
            raise FtchatError(f"{where}: \"{key}\" is {what}: give a prompt with some text in it"
                              if what else f"{where}: \"{key}\" must be {JSON_KEYS[key]}")
    for key in ("prompt", "system", "stop"):
        texts = obj.get(key, [])
        for text in [texts] if isinstance(texts, str) else texts:
            check_unicode(text, f'{where}: "{key}"')
    stop = obj.get("stop")
    base = Sampling.from_settings(settings)
    temperature = obj.get("temperature", base.temperature)
    if not temperature:
        for key, off in (("top_k", 0), ("top_p", 1), ("min_p", 0), ("seed", None)):
            if obj.get(key, off) != off:
                raise FtchatError(f"{where}: \"{key}\" applies to sampling: give \"temperature\" "
                                  "above 0 too (decoding is greedy by default)")
    sampling = replace(base, **{k: obj[k] for k in ("temperature", "top_k", "top_p", "min_p",
                                                     "repeat_penalty", "seed") if k in obj})
    return Job(obj["prompt"], obj.get("system", settings.system), obj.get("max_new_tokens"),
               None if stop is None else tuple([stop] if isinstance(stop, str) else stop),
               sampling, where)


# ===== input as it arrives =====

PENDING = object()  # no whole line has arrived yet


class LineSource:
    """The lines of piped stdin as they arrive (read from its file descriptor, unbuffered, so
    that what is "already there" is known); a stream without one (tests) is read at once."""

    def __init__(self, stdin: TextIO):
        raw = getattr(stdin, "buffer", stdin)
        try:
            self.fd: int | None = raw.fileno()
        except (AttributeError, OSError, ValueError):
            self.fd = None
        # bytearray: appends and cuts from the front in place (a bytes buffer was copied whole
        # per chunk and per line: quadratic on a long input)
        self.buf, self.eof, self.lineno = bytearray(), False, 0
        self.scanned = 0  # buf[:scanned] holds no newline
        if self.fd is None:
            data = raw.read()
            self.buf = bytearray(data.encode() if isinstance(data, str) else data)
            self.eof = True

    def _read(self, wait: bool) -> bool:
        """Append one chunk of what stdin holds (wait: block until one comes or EOF); False if
        nothing was there."""
        if self.eof or (not wait and not select.select([self.fd], [], [], 0)[0]):
            return False
        try:
            chunk = os.read(self.fd, 1 << 16)
        except OSError as e:  # a folder or a device given as stdin
            raise FtchatError(f"cannot read stdin ({e.strerror or e}): pipe prompts into it, "
                              "one per line") from None
        self.eof = not chunk
        self.buf += chunk
        return True

    def next(self, wait: bool) -> str | None | object:
        """The next line (without its newline); PENDING if wait is False and none has arrived
        whole; None at the end of the input."""
        while (end := self.buf.find(b"\n", self.scanned)) < 0 and not self.eof:
            self.scanned = len(self.buf)
            if len(self.buf) > MAX_LINE_BYTES:  # /dev/zero, or a file with no line breaks:
                self.buf, self.eof = bytearray(), True  # the input ends here
                raise FtchatError(f"stdin line {self.lineno + 1} is longer than "
                                  f"{MAX_LINE_BYTES >> 20} MiB: one prompt per line")
            if not self._read(wait):
                return PENDING
        if not self.buf and self.eof:
            return None
        end = len(self.buf) if end < 0 else end
        line = bytes(self.buf[:end])
        del self.buf[:end + 1]
        self.scanned = 0
        self.lineno += 1
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FtchatError(f"stdin line {self.lineno} is not UTF-8 text ({e})") from None
        if self.lineno == 1:
            text = text.removeprefix("\ufeff")
        return text.removesuffix("\r")


class JobReader:
    """Jobs (or bad lines) from a LineSource, parsed as they arrive; `take(n)` gathers the next
    batch: it waits for the first item, then takes up to n - 1 more that are already there."""

    def __init__(self, source: LineSource | None, settings: Settings,
                 jobs: list[Job] | None = None):
        self.source, self.settings = source, settings
        self.ready: list[Job | BadLine] = list(jobs or [])
        self.ended = source is None

    def _pull(self, wait: bool) -> bool:
        """Parse one more line into `ready`; False if none is there (or the input ended)."""
        while not self.ended:
            try:
                line = self.source.next(wait)
                if line is PENDING:
                    return False
                if line is None:
                    self.ended = True
                    return False
                job = parse_line(line, self.source.lineno, self.settings)
            except FtchatError as e:  # not UTF-8, or not a good line
                self.ready.append(BadLine(str(e)))
                return True
            if job is not None:
                self.ready.append(job)
                return True
        return False

    def peek_ready(self, limit: int = 10_000) -> list[Job | BadLine]:
        """Parse the lines already there (at most `limit`: a producer that never pauses, such
        as `yes`, is not read to its end); the items waiting."""
        while len(self.ready) < limit and self._pull(wait=False):
            pass
        return self.ready

    def take(self, n: int) -> list[Job | BadLine]:
        """The next items: a bad line alone, else up to n jobs; [] at the end of the input."""
        if not self.ready:
            self._pull(wait=True)
        while len(self.ready) < n and not any(isinstance(x, BadLine) for x in self.ready) \
                and self._pull(wait=False):
            pass
        out: list[Job | BadLine] = []
        while self.ready and len(out) < n:
            if isinstance(self.ready[0], BadLine):
                if not out:
                    out.append(self.ready.pop(0))
                break
            out.append(self.ready.pop(0))
        return out


# ===== output =====


def run_batch(session: Session, screen: Screen, jobs: JobReader, as_json: bool,
              one_shot: bool = False) -> int:
    """Answer every job in input order as the jobs arrive; returns the exit code (1 if a line
    was bad, 130 on Ctrl-C)."""
    if as_json:
        escape = None
    elif one_shot:
        escape = printable if isatty(screen.out) else str
    else:
        escape = one_line
    code, chunk_no, failed = 0, 0, 0
    with screen.live() as out:
        replies = _Replies(session, out, escape)
        try:
            while chunk := jobs.take(session.settings.batch_size):
                # a bad line, a prompt too long for the context or one that renders to nothing:
                # that prompt's error, the prompts around it are still answered
                parts = chunk if isinstance(chunk[0], BadLine) else _encoded(session, chunk)
                for part in parts:
                    if isinstance(part, BadLine):
                        if one_shot:
                            raise FtchatError(part.message)
                        replies.error(part.message)
                        out.note(screen.err, f"error: {part.message}")
                        code, failed = 1, failed + 1
                        continue
                    replies.run(*part, chunk_no)
                    chunk_no += 1
        except KeyboardInterrupt:
            replies.interrupted()
            code = 130
    if code == 130:
        screen.note("[interrupted]")
    if not session.settings.quiet:
        screen.note_parts(_batch_summary(replies.final, replies.chunk_of, failed))
    return code


def _encoded(session: Session, chunk: list[Job]
             ) -> Iterator[tuple[list[Job], list[list[int]]] | BadLine]:
    """The chunk's jobs with their prompt ids, in runs of good ones, and each job that cannot be
    answered as a BadLine in its place."""
    jobs: list[Job] = []
    ids: list[list[int]] = []
    for job in chunk:
        try:
            p = session.encode_messages(job.messages(), job.source)
            session.check_prompt(len(p), job.source)
        except FtchatError as e:
            if jobs:
                yield jobs, ids
                jobs, ids = [], []
            yield BadLine(str(e))
            continue
        jobs.append(job)
        ids.append(p)
    if jobs:
        yield jobs, ids


@dataclass
class _Reply:
    """One reply under way."""

    job: Job
    chunk: int
    text: ReplyText | None  # None: JSON
    tokens: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # text not yet written
    last: StepRecord | None = None


class _Replies:
    """Tokens and text per prompt; writes replies in input order, streaming the current one."""

    def __init__(self, session: Session, out: PlainWriter | PanelWriter,
                 escape: Callable[[str], str] | None):
        self.session, self.out, self.escape = session, out, escape  # escape None: JSON
        self.index = 0  # the next reply to write, among all input items
        self.final: dict[int, StepRecord] = {}
        self.chunk_of: dict[int, int] = {}
        self.current: list[_Reply] = []  # the chunk being decoded
        self.head = 0  # its first reply not fully written
        self.started = False  # some of current[0]'s text is written (plain)

    def run(self, chunk: list[Job], prompts: list[list[int]], chunk_no: int) -> None:
        s = self.session
        stops = [s.settings.stop if j.stop is None else j.stop for j in chunk]
        self.current = [_Reply(j, chunk_no, None if self.escape is None else
                               ReplyText(s.tokenizer, stop)) for j, stop in zip(chunk, stops)]
        self.head = 0
        records = s.generate_batch(
            prompts,
            [j.max_new_tokens or s.settings.max_new_tokens for j in chunk],
            stop_strings=stops, sampling=[j.sampling or Sampling.from_settings(s.settings)
                                          for j in chunk])
        for rec in records:
            self._add(rec)
            self.out.show(rec.figures, f"{plural(self.index, 'reply', 'replies')} written")

    def _add(self, rec: StepRecord) -> None:
        r = self.current[rec.seq]
        r.tokens.append(rec.token)
        r.last = rec
        if r.text is not None:
            if rec.stop != "eos":
                r.pieces.append(self.escape(r.text.feed(rec.token)))
            if rec.stop:
                r.pieces.append(self.escape(r.text.flush()))
        while self.head < len(self.current):
            head = self.current[self.head]
            if head.text is not None and head.pieces:
                self.out.write("".join(head.pieces))
                head.pieces.clear()
                self.started = True
            if head.last is None or head.last.stop is None:
                break
            self._finish(head, head.last)

    def _finish(self, r: _Reply, rec: StepRecord) -> None:
        i = self.index
        self.final[i], self.chunk_of[i] = rec, r.chunk
        self.out.write("\n" if r.text is not None else
                       json_reply(self.session, i, rec, r.tokens, r.job) + "\n")
        self.head += 1
        self.index, self.started = i + 1, False

    def error(self, message: str) -> None:
        """A bad prompt's place in the output: an error object (JSON), or an empty line (plain:
        line i of stdout stays the reply to prompt i)."""
        self.out.write(("" if self.escape is not None else
                        json.dumps({"index": self.index, "error": message})) + "\n")
        self.index += 1

    def interrupted(self) -> None:
        """Ctrl-C: end the line being written; with --json, write what the replies of the
        chunk have so far, `stop` "interrupted"."""
        if self.escape is not None:
            if self.started:
                self.out.write("\n")
            return
        for r in self.current[self.head:]:
            if r.last is None:
                break
            self._finish(r, r.last if r.last.stop else replace(r.last, stop="interrupted"))


def json_reply(session: Session, index: int, rec: StepRecord, tokens: list[int],
               job: Job | None = None) -> str:
    """One reply as a JSON object: index, text (the answer: after the think block, cut before a
    stop string), reasoning (the think block's text, "" when there is none), tokens (every
    generated id, the stop token included: the exact reply), stop, prompt_tokens,
    timings, offload figures, peak VRAM, and the seed when it was sampled."""
    stops = session.settings.stop if job is None or job.stop is None else job.stop
    text_ids = tokens[:-1] if rec.stop == "eos" else tokens
    f = rec.figures
    decode_tps = (rec.n - 1) / rec.decode_s if rec.decode_s > 0 else None
    prefill_tps = rec.prompt_tokens / rec.prefill_s if rec.prefill_s > 0 else None
    reply = StopText.cut(session.tokenizer.decode(text_ids), stops)
    reasoning, answer = ("", reply) if session.settings.think is False else \
        split_reasoning(reply)
    obj = {
        "index": index,
        "text": answer,
        "reasoning": reasoning,
        "tokens": tokens,
        "stop": rec.stop,
        "prompt_tokens": rec.prompt_tokens,
        "timings": {"prefill_s": rec.prefill_s,
                    "prefill_tok_s": prefill_tps,
                    "decode_s": rec.decode_s, "decode_tok_s": decode_tps},
        "offload": dict(f.offload),
        "vram_peak_bytes": f.vram_peak,
    }
    if rec.seed is not None:
        obj["seed"] = rec.seed
    return json.dumps(obj, ensure_ascii=False)


def _batch_summary(final: dict[int, StepRecord], chunk_of: dict[int, int],
                   failed: int = 0) -> list[str]:
    # The prompts of a chunk decode together: its time is its slowest sequence's.
    chunk_s: dict[int, float] = {}
    for i, rec in final.items():
        chunk_s[chunk_of[i]] = max(chunk_s.get(chunk_of[i], 0.0), rec.decode_s)
    recs = list(final.values())
    offload = recs[-1].figures.offload if recs else {}
    parts = timing_parts(sum(r.prefill_s for r in recs), sum(r.prompt_tokens for r in recs),
                         sum(chunk_s.values()), sum(r.n - 1 for r in recs), dict(offload))
    replies = plural(len(recs), "reply", "replies")
    return [f"{replies}, {failed} failed" if failed else replies, *parts]
