"""The engine worker of `ftchat serve` in this process, on the demo model: two jobs decode
together and every token is chosen by engine.pick; a row whose logits turn NaN fails alone,
with the engine's message, and the job beside it replies as it does with no fault."""

from __future__ import annotations

import threading

import pytest
import torch

from ftchat import engine
from ftchat.model.tokenizer import Tokenizer
from ftchat.resolve import ResolvedModel
from ftchat.sampling import Sampling
from ftchat.server.metrics import Metrics
from ftchat.server.worker import Delta, EngineWorker, Failed, Finished, Job
from ftchat.settings import Settings
from tests.server_util import ROOT

DEMO = ROOT / "ftchat" / "models" / "demo"
GOOD = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write a function that adds two numbers."}]
BAD = [{"role": "user", "content": "Who are you?"}]
BREAK_AT = 2  # the bad job's logits turn NaN at its third decode step


def serve_two(monkeypatch, poison: bool):
    """Jobs "good" and "bad" (8 greedy tokens each) submitted together to a worker of two rows:
    (events per job, the worker's log lines, its metrics). With `poison`, the logits of the bad
    job's row hold a NaN from its BREAK_AT-th decode step on."""
    tok = Tokenizer.from_folder(DEMO)
    metrics, lines = Metrics(), []
    worker = EngineWorker(ResolvedModel(DEMO, "demo", demo=True),
                          Settings(threads=1, context=256), 2, 2, 0, metrics, lines.append)
    real = engine.Decoder.step

    def step(self, tokens, lengths):
        logits = real(self, tokens, lengths).clone()
        for b, r in enumerate(worker.rows):
            if poison and r is not None and r.job.id == "bad" and not r.pieces \
                    and r.decode_tokens >= BREAK_AT:
                logits[b, 7] = float("nan")
        return logits

    monkeypatch.setattr(engine.Decoder, "step", step)
    events: dict[str, list] = {"good": [], "bad": []}
    ended = {name: threading.Event() for name in events}

    def emit(name):
        def put(ev):
            events[name].append(ev)
            if isinstance(ev, (Finished, Failed)):
                ended[name].set()
        return put

    worker.start()
    try:
        for name, messages in (("good", GOOD), ("bad", BAD)):
            ids = tok.encode(tok.render_chat(messages))
            assert worker.submit(Job(name, ids, 8, (), Sampling(), (), emit(name)))
        assert all(e.wait(120) for e in ended.values()), events
    finally:
        worker.stop()
    return events, lines, metrics


def text(evs) -> str:
    return "".join(e.text for e in evs if isinstance(e, Delta))


@pytest.fixture(scope="module")
def clean():
    with pytest.MonkeyPatch.context() as mp:
        return serve_two(mp, poison=False)


def test_both_jobs_reply_without_a_fault(clean):
    events, _, metrics = clean
    for name in ("good", "bad"):
        assert isinstance(events[name][-1], Finished), events[name]
        assert events[name][-1].completion_tokens == 8 and text(events[name])
    assert metrics.requests == {"length": 2}


def test_a_nan_row_fails_alone(monkeypatch, clean):
    events, lines, metrics = serve_two(monkeypatch, poison=True)
    end = events["bad"][-1]
    assert isinstance(end, Failed) and "NaN or Inf (bad, position" in end.message, end
    assert not any(isinstance(e, Finished) for e in events["bad"])
    # the tokens before the fault went out; the job beside it replied as without the fault
    assert text(events["bad"]) and text(clean[0]["bad"]).startswith(text(events["bad"]))
    got, want = events["good"][-1], clean[0]["good"][-1]
    assert (got.reason, got.completion_tokens) == (want.reason, want.completion_tokens)
    assert text(events["good"]) == text(clean[0]["good"])
    assert metrics.requests == {"length": 1, "error": 1}
    assert any("bad: failed: the model's output holds NaN or Inf" in ln for ln in lines)


@pytest.mark.parametrize("fault", ["bug", "oom", None],
                         ids=["admission-fails", "out-of-memory", "control"])
def test_a_failed_admission_ends_that_job_and_the_worker_goes_on(monkeypatch, fault):
    # a bug while a job is given a row (here: choosing the row) must end that job with an
    # error event, not the engine thread (which would leave every later request waiting)
    tok = Tokenizer.from_folder(DEMO)
    worker = EngineWorker(ResolvedModel(DEMO, "demo", demo=True),
                          Settings(threads=1, context=256), 2, 1, 0, Metrics(), lambda _: None)
    real, calls = EngineWorker._pick_row, []

    def pick_row(self, ids):
        calls.append(ids)
        if fault and len(calls) == 1:
            if fault == "oom":  # a device allocation: named as one, not an internal error
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
            raise RuntimeError("no row for you")
        return real(self, ids)

    monkeypatch.setattr(EngineWorker, "_pick_row", pick_row)
    ends, done = [], threading.Event()

    def emit(ev):
        if isinstance(ev, (Finished, Failed)):
            ends.append(ev)
            done.set()

    worker.start()
    try:
        for name in ("first", "second"):  # one after the other
            done.clear()
            assert worker.submit(Job(name, tok.encode(tok.render_chat(BAD)), 2, (), Sampling(),
                                     (), emit))
            assert done.wait(120), (name, ends)
    finally:
        worker.stop()
    if fault == "bug":
        assert isinstance(ends[0], Failed) and ends[0].message == \
            "internal error: RuntimeError: no row for you", ends[0]
    elif fault == "oom":
        assert isinstance(ends[0], Failed) and ends[0].message.startswith(
            "out of GPU memory (2.00 GiB more was needed): try"), ends[0]
    else:
        assert isinstance(ends[0], Finished), ends[0]
    assert isinstance(ends[1], Finished) and ends[1].completion_tokens == 2, ends[1]
    assert worker.admitted == 0
