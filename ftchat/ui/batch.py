"""Piped mode: prompts from stdin (or --prompt), replies to stdout in input order.

Input: one prompt per line; a line starting with `{` is a JSON object
`{"prompt": str, "system"?: str, "max_new_tokens"?: int}`; blank lines are skipped.
Output, plain: one line per reply, with `\\`, newline, CR, tab and other control characters
written as backslash escapes (`\\\\`, `\\n`, `\\r`, `\\t`, `\\x1b`). A --prompt reply is written
as is. With --json: one object per prompt (see `_json_reply`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from ftchat.errors import FtchatError
from ftchat.session import Session, StepRecord
from ftchat.ui.panel import PanelWriter, PlainWriter, Screen, isatty, timing_line
from ftchat.ui.text import ReplyText, one_line, plural, printable


@dataclass(frozen=True)
class Job:
    prompt: str
    system: str | None = None
    max_new_tokens: int | None = None

    def messages(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return [*sys_msg, {"role": "user", "content": self.prompt}]


def parse_jobs(text: str, system: str | None) -> list[Job]:
    """The prompts of piped input; `system` applies where a JSON line gives none."""
    jobs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        jobs.append(_json_job(line, lineno, system) if line.lstrip().startswith("{")
                    else Job(line, system))
    return jobs


def _json_job(line: str, lineno: int, system: str | None) -> Job:
    where = f"stdin line {lineno}"
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise FtchatError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise FtchatError(f"{where}: expected a JSON object")
    unknown = sorted(set(obj) - {"prompt", "system", "max_new_tokens"})
    if unknown:
        raise FtchatError(f"{where}: unknown key {unknown[0]!r} "
                          "(expected prompt, system, max_new_tokens)")
    prompt, limit = obj.get("prompt"), obj.get("max_new_tokens")
    sys_text = obj.get("system", system)
    if not isinstance(prompt, str):
        raise FtchatError(f"{where}: \"prompt\" must be a string")
    if sys_text is not None and not isinstance(sys_text, str):
        raise FtchatError(f"{where}: \"system\" must be a string")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise FtchatError(f"{where}: \"max_new_tokens\" must be a positive integer")
    return Job(prompt, sys_text, limit)


def run_batch(session: Session, screen: Screen, jobs: list[Job], as_json: bool,
              one_shot: bool = False) -> int:
    """Generate every job's reply and write them in input order; returns the exit code."""
    prompts = [session.encode_messages(j.messages()) for j in jobs]
    limits = [j.max_new_tokens or session.settings.max_new_tokens for j in jobs]
    records = session.generate_batch(prompts, limits)  # checks every prompt before any work
    if as_json:
        escape = None
    elif one_shot:
        escape = printable if isatty(screen.out) else str
    else:
        escape = one_line
    with screen.live() as out:
        replies = _Replies(session, out, len(jobs), escape)
        for rec in records:
            replies.add(rec)
            out.show(rec.figures, f"{replies.next}/{plural(len(jobs), 'reply', 'replies')}")
    screen.note(_batch_summary(replies.final, session.settings.batch_size))
    return 0


class _Replies:
    """Tokens and text per prompt; writes replies in input order, streaming the current one."""

    def __init__(self, session: Session, out: PlainWriter | PanelWriter, n: int,
                 escape: Callable[[str], str] | None):
        self.session, self.out, self.escape = session, out, escape  # escape None: JSON
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.pieces: list[list[str]] = [[] for _ in range(n)]  # text not yet written
        self.decoders = [ReplyText(session.tokenizer) for _ in range(n)]
        self.final: dict[int, StepRecord] = {}
        self.next = 0  # the first reply not fully written

    def add(self, rec: StepRecord) -> None:
        i = rec.seq
        self.tokens[i].append(rec.token)
        if self.escape is not None:
            if rec.stop != "eos":
                self.pieces[i].append(self.escape(self.decoders[i].feed(rec.token)))
            if rec.stop:
                self.pieces[i].append(self.escape(self.decoders[i].flush()))
        if rec.stop:
            self.final[i] = rec
        while self.next < len(self.tokens):
            j = self.next
            if self.escape is not None:
                self.out.write("".join(self.pieces[j]))
                self.pieces[j].clear()
            if j not in self.final:
                break
            self.out.write("\n" if self.escape is not None else self._json_reply(j) + "\n")
            self.next += 1

    def _json_reply(self, i: int) -> str:
        rec, tokens = self.final[i], self.tokens[i]
        text_ids = tokens[:-1] if rec.stop == "eos" else tokens
        f = rec.figures
        decode_tps = (rec.n - 1) / rec.decode_s if rec.decode_s > 0 else None
        prefill_tps = rec.prompt_tokens / rec.prefill_s if rec.prefill_s > 0 else None
        return json.dumps({
            "index": i,
            "text": self.session.tokenizer.decode(text_ids),
            "tokens": tokens,
            "stop": rec.stop,
            "prompt_tokens": rec.prompt_tokens,
            "timings": {"prefill_s": rec.prefill_s,
                        "prefill_tok_s": prefill_tps,
                        "decode_s": rec.decode_s, "decode_tok_s": decode_tps},
            "offload": dict(f.offload),
            "vram_peak_bytes": f.vram_peak,
        }, ensure_ascii=False)


def _batch_summary(final: dict[int, StepRecord], batch_size: int) -> str:
    # A chunk of batch_size prompts decodes together: its time is its slowest sequence's.
    chunk_s: dict[int, float] = {}
    for i, rec in final.items():
        chunk_s[i // batch_size] = max(chunk_s.get(i // batch_size, 0.0), rec.decode_s)
    recs = list(final.values())
    offload = recs[-1].figures.offload if recs else {}
    return f"{plural(len(recs), 'reply', 'replies')} | " + timing_line(
        sum(r.prefill_s for r in recs), sum(r.prompt_tokens for r in recs),
        sum(chunk_s.values()), sum(r.n - 1 for r in recs), dict(offload))
